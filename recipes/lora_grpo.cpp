// `qlora run lora_grpo`: online reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO,
// GSPO, CISPO as TRL 1.16 names and defines them) of LoRA adapters on the sharded NF4 base, on 1..N
// ranks. What every recipe shares (model, optimizer, resume, the step loop with its guard,
// checkpoints, exports) is in session.h; this file keeps what is its own:
//   setup   : prompt records (data.format = "prompt", data/prompts.h; a conversation's images go
//             through the vision tower, frozen or trained (lora.vision_targets, lora.train_projector), in the
//             rollouts' prefill (the current tower) and the loss's log-probs (its gradient reaching the
//             tower), the reference's with the tower's adapters off and the projector as loaded), the
//             validation split, the rewards (train/rewards.h), each record checked against what its rewards read
//   rollout : every grpo.num_iterations optimizer steps, the step's prompts (grad_accum global
//             batches of batch_size x ranks) each get num_generations completions, sampled as one
//             batch on each rank (models/generate.h) from the gathered base + adapters, each
//             completion seeded by its place in the step (the same completions on 1 and N ranks);
//             scored; the rewards of every rank combined into the step's advantages; the old
//             policy's (num_iterations > 1) and the reference's (beta != 0: adapters off) log-probs
//   train   : per micro-batch the policy's log-probs at the sampling temperature and the loss
//             (train/grpo_loss.h), scaled so that the step's loss is TRL's over its whole batch
//   validate: the greedy completions' mean reward on the held-out prompts
// The rollouts still to be reused (num_iterations > 1) are saved with each resume checkpoint, so
// a resumed run continues exactly; the sampling needs no state (seeds come from the step).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/checkpoint/serving.h"
#include "qlora/config/builders.h"
#include "qlora/data/prompts.h"
#include "qlora/models/generate.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/faults.h"
#include "qlora/train/grpo_batch.h"
#include "qlora/train/grpo_loss.h"
#include "qlora/train/rewards.h"
#include "qlora/train/untrained_tokens.h"
#include "recipes/recipes.h"
#include "recipes/session.h"

namespace qlora::recipes {

namespace {
using config::RecipeConfig;

struct Prompts {
  std::vector<data::PromptRecord> train, validation;
  std::unique_ptr<data::Sampler> sampler;  // this rank's prompts of one global batch per micro-step
  std::vector<int64_t> stop_ids;           // EOS, the end of turn: where a completion ends
  train::BatchImages images;               // where the prompts hold images: the data's processor
};

// A prompt as a sample: its tokens, none scored, its images.
data::Sample prompt_sample(const data::PromptRecord& r) {
  data::Sample x;
  x.tokens = r.tokens;
  x.labels.assign(r.tokens.size(), data::kIgnoreIndex);
  x.images = r.images;
  return x;
}

Prompts setup_prompts(const Session& s, const TextSetup& text, const train::Rewards& rewards) {
  const RecipeConfig& cfg = s.cfg;
  if (cfg.data.format != data::DatasetKind::kPrompt)
    throw std::invalid_argument("qlora run lora_grpo samples completions of prompts: set data.format = \"prompt\" "
                                "(records {\"prompt\": text or messages, \"answer\": ...})");
  if (cfg.data.packing) throw std::invalid_argument("data.packing: lora_grpo does not pack prompts; set it to false");
  if (rewards.empty())
    throw std::invalid_argument("qlora run lora_grpo needs a reward: set grpo.rewards (e.g. [{ kind = \"answer\" }]) "
                                "or grpo.reward_command");
  Prompts p;
  p.train = load_grpo_prompts(text.path, text.tokenizer, text.options, rewards);
  if (const std::string val = val_data_path(cfg); !val.empty())
    p.validation = load_grpo_prompts(val, text.tokenizer, text.options, rewards);
  hold_out_validation(cfg, p.train, p.validation);
  p.sampler = std::make_unique<data::Sampler>(
      config::sampler_options(cfg.data, cfg.training, static_cast<int64_t>(p.train.size()), s.world.size(),
                              s.world.rank()));
  p.stop_ids = checkpoint::stop_ids(s.base_dir, text.tokenizer, p.train.front().end_of_turn);
  return p;
}

// A completion's text as the rewards read it: without its stop token, cut at a multi-token end of turn.
std::string completion_text(const data::Tokenizer& tok, const Prompts& d, const data::PromptRecord& r,
                            std::vector<int64_t> ids) {
  if (!ids.empty() && std::find(d.stop_ids.begin(), d.stop_ids.end(), ids.back()) != d.stop_ids.end()) ids.pop_back();
  std::string text = tok.decode(ids);
  if (!r.end_of_turn.empty() && text.find(r.end_of_turn) != std::string::npos) text.erase(text.find(r.end_of_turn));
  return text;
}

// The rewards of `completions`, completion c sampled from records[c / per_prompt].
train::RewardScores score(const train::Rewards& rewards, const data::Tokenizer& tok, const Prompts& d,
                          const std::vector<const data::PromptRecord*>& records, int64_t per_prompt,
                          const std::vector<models::Completion>& completions) {
  std::vector<std::string> texts;
  std::vector<train::RewardInput> inputs;
  texts.reserve(completions.size());  // the inputs view them
  for (size_t c = 0; c < completions.size(); ++c) {
    const data::PromptRecord& r = *records[c / static_cast<size_t>(per_prompt)];
    texts.push_back(completion_text(tok, d, r, completions[c].ids));
    inputs.push_back({r.record, texts.back(), static_cast<int64_t>(completions[c].ids.size()), r.origin});
  }
  return rewards.score(inputs);
}

// The base gathered on every rank while it lives (a collective to make and to end): generation
// then runs no collectives, however many tokens each rank's sequences take.
struct Gathered {
  engine::ShardedDecoder& e;
  explicit Gathered(engine::ShardedDecoder& engine) : e(engine) { e.unshard_all(); }
  ~Gathered() { e.reshard_all(); }
  Gathered(const Gathered&) = delete;
  Gathered& operator=(const Gathered&) = delete;
};

// Sequences of `records` (each `per_prompt` times, the k-th seeded by seed_of(prompt, k)), as one
// batch (under a Gathered base). A completion stops at o.max_new_tokens or where prompt and
// completion fill `context` tokens (data.max_seq_len; 0: no limit), whichever comes first.
// A prompt's images prefill with it (through the vision tower, no gradient).
std::vector<models::Completion> sample(const Model& m, const Prompts& d, const std::vector<const data::PromptRecord*>& records,
                                       int64_t per_prompt, const models::GenerateOptions& o, int64_t context,
                                       const std::function<uint64_t(int64_t, int64_t)>& seed_of, c10::Device device) {
  std::vector<std::vector<int64_t>> prompts;
  std::vector<models::BatchSequence> seqs;
  std::vector<std::optional<models::ImageInputs>> features(records.size());
  std::vector<const models::ImageInputs*> prompt_images;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < records.size(); ++i) {
    prompts.push_back(records[i]->tokens);
    if (!records[i]->images.empty()) features[i] = d.images.of(m.decoder, data::collate({prompt_sample(*records[i])}, 0), device);
    prompt_images.push_back(features[i] ? &*features[i] : nullptr);
    for (int64_t k = 0; k < per_prompt; ++k) {
      models::BatchSequence q{static_cast<int64_t>(i), o};
      q.options.seed = seed_of(static_cast<int64_t>(i), k);
      const auto room = context - static_cast<int64_t>(records[i]->tokens.size());  // >= 1: data/prompts.h checks
      if (context > 0) q.options.max_new_tokens = std::min(o.max_new_tokens, room);
      seqs.push_back(std::move(q));
    }
  }
  return models::generate_batch(m.decoder, prompts, seqs, prompt_images);
}

// One generation batch on this rank: grad_accum micro-batches of batch_size prompts x G completions.
struct Rollout {
  std::vector<std::vector<train::Completion>> micro;
  std::vector<at::Tensor> advantages, old_logps, ref_logps;  // per micro-batch; logps undefined where unused
  std::vector<std::vector<int64_t>> prompt_of;  // per micro-batch: each completion's prompt in the training set
  double num_items = 0;  // scored tokens of the whole step on every rank (dapo, cispo)
  int64_t uses = 0;      // optimizer steps it has fed
  nlohmann::ordered_json metrics = nlohmann::ordered_json::object();
};

// Mean and Bessel std of the values `v` (n >= 1).
std::pair<double, double> mean_std(const std::vector<double>& v) {
  double mean = 0, sq = 0;
  for (double x : v) mean += x;
  mean /= static_cast<double>(v.size());
  for (double x : v) sq += (x - mean) * (x - mean);
  return {mean, v.size() > 1 ? std::sqrt(sq / static_cast<double>(v.size() - 1)) : 0.0};
}

// The step's rewards and lengths on every rank ([rows] each, in step order) -> TRL's metric names.
nlohmann::ordered_json rollout_metrics(const std::vector<std::string>& names, const std::vector<std::vector<double>>& all,
                                       int64_t group) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  const std::vector<double>& total = all[0];
  const auto [mean, std] = mean_std(total);
  j["reward"] = mean;
  j["reward_std"] = std;
  for (size_t r = 0; r < names.size(); ++r) {
    const auto [rm, rs] = mean_std(all[r + 1]);
    j["rewards/" + names[r] + "/mean"] = rm;
    j["rewards/" + names[r] + "/std"] = rs;
  }
  const std::vector<double>& len = all[names.size() + 1];
  const std::vector<double>& cut = all[names.size() + 2];
  j["completions/mean_length"] = mean_std(len).first;
  j["completions/max_length"] = *std::max_element(len.begin(), len.end());
  j["completions/clipped_ratio"] = mean_std(cut).first;
  int64_t flat = 0;  // groups whose rewards are all equal: no advantage, no signal
  for (size_t g = 0; g < total.size(); g += static_cast<size_t>(group))
    flat += std::all_of(total.begin() + g, total.begin() + g + group, [&](double x) { return x == total[g]; });
  j["frac_reward_zero_std"] = static_cast<double>(flat) / static_cast<double>(total.size() / group);
  return j;
}

// Samples, scores and prepares the step's rollout (collective).
Rollout make_rollout(const Session& s, Model& m, Prompts& d, const TextSetup& text, const train::Rewards& rewards,
                     int64_t step) {
  const RecipeConfig& cfg = s.cfg;
  const int64_t per_rank = cfg.training.batch_size, G = cfg.grpo.num_generations, rank = s.world.rank();
  const int64_t per_micro = per_rank * s.world.size(), accum = cfg.training.grad_accum;
  const int64_t rows = per_micro * accum * G;  // the step's completions on every rank
  std::vector<const data::PromptRecord*> mine;
  std::vector<int64_t> first_row;  // per micro-batch: the step row of this rank's first completion
  for (int64_t k = 0; k < accum; ++k) {
    // This rank's prompts are the rank-th per_rank of the micro-batch's global batch (data/sampler.h).
    first_row.push_back((k * per_micro + rank * per_rank) * G);
    for (int64_t i : d.sampler->next()) mine.push_back(&d.train[static_cast<size_t>(i)]);
  }
  models::GenerateOptions o{cfg.grpo.max_completion_length, cfg.grpo.temperature, cfg.grpo.top_p, cfg.grpo.top_k, 0, d.stop_ids};
  // Prompt i of this rank sits in micro-batch i / per_rank; its completions' step rows follow.
  const auto seed_of = [&](int64_t i, int64_t k) {
    const int64_t row = first_row[static_cast<size_t>(i / per_rank)] + (i % per_rank) * G + k;
    return models::sequence_seed(static_cast<uint64_t>(cfg.training.seed), (step - 1) * rows + row);
  };
  std::vector<models::Completion> sampled;
  {
    const Gathered base(*m.engine);
    sampled = sample(m, d, mine, G, o, cfg.data.max_seq_len, seed_of, s.device);
  }
  const train::RewardScores scores = score(rewards, text.tokenizer, d, mine, G, sampled);

  // Every rank's values in step order (each row is one rank's; the others add 0): the total, each
  // reward, the length, whether truncated.
  const size_t R = scores.names.size(), cols = R + 3;
  std::vector<double> flat(cols * static_cast<size_t>(rows), 0.0);
  for (size_t c = 0; c < sampled.size(); ++c) {
    const size_t row = static_cast<size_t>(first_row[c / static_cast<size_t>(per_rank * G)]) + c % static_cast<size_t>(per_rank * G);
    flat[row] = scores.total[c];
    for (size_t r = 0; r < R; ++r) flat[(r + 1) * rows + row] = scores.each[r][c];
    flat[(R + 1) * rows + row] = static_cast<double>(sampled[c].ids.size());
    flat[(R + 2) * rows + row] = sampled[c].stopped ? 0.0 : 1.0;
  }
  flat = train::all_ranks_sum(s.world, flat, s.device);
  std::vector<std::vector<double>> all(cols);
  for (size_t col = 0; col < cols; ++col) all[col].assign(flat.begin() + col * rows, flat.begin() + (col + 1) * rows);

  Rollout r;
  r.metrics = rollout_metrics(scores.names, all, G);
  const at::Tensor advantages =
      train::grpo_advantages(at::tensor(all[0], at::kDouble).to(at::kFloat), G, cfg.grpo.scale_rewards);
  for (size_t row = 0; row < static_cast<size_t>(rows); ++row)  // TRL's num_items: the loss mask's tokens
    if (!(cfg.grpo.mask_truncated_completions && all[R + 2][row] != 0)) r.num_items += all[R + 1][row];
  for (int64_t k = 0; k < accum; ++k) {
    std::vector<train::Completion> batch;
    std::vector<int64_t> prompt_of;
    for (int64_t j = 0; j < per_rank * G; ++j) {
      const size_t c = static_cast<size_t>(k * per_rank * G + j);
      const data::PromptRecord& p = *mine[c / G];
      batch.push_back({p.tokens, sampled[c].ids, !sampled[c].stopped, p.images});
      prompt_of.push_back(&p - d.train.data());
    }
    r.micro.push_back(std::move(batch));
    r.prompt_of.push_back(std::move(prompt_of));
    r.advantages.push_back(advantages.narrow(0, first_row[static_cast<size_t>(k)], per_rank * G).clone());
  }
  return r;
}

// The old policy's and the reference's log-probs of each micro-batch, where the loss reads them.
void frozen_logps(const RecipeConfig& cfg, const Model& m, Rollout& r, int64_t pad, c10::Device device,
                  const train::BatchImages& images) {
  for (const std::vector<train::Completion>& micro : r.micro) {
    const train::CompletionBatch b = train::completion_batch(micro, pad);
    const auto logps = [&](train::LogpsOf which) { return train::completion_logps(m.decoder, b, device, which, nullptr, images); };
    r.old_logps.push_back(cfg.grpo.num_iterations > 1 ? logps(train::LogpsOf::kOld) : at::Tensor());
    r.ref_logps.push_back(cfg.grpo.beta != 0 ? logps(train::LogpsOf::kReference) : at::Tensor());
  }
}

// What one micro-batch's loss is divided by beyond grpo_loss's own normalisation, so that the
// step's summed loss is TRL's: grpo, bnpo and dr_grpo average over the micro-batches of every rank
// (TRL: over its accumulation steps, then DDP over processes); dapo and cispo already divide by
// the whole step's scored tokens.
double micro_share(const RecipeConfig& cfg, int64_t ranks) {
  const train::GrpoLossType t = cfg.grpo.loss_type;
  if (t == train::GrpoLossType::kDapo || t == train::GrpoLossType::kCispo) return 1.0;
  return 1.0 / static_cast<double>(cfg.training.grad_accum * ranks);
}

struct Grpo {
  const Session& s;
  Model& m;
  Prompts& d;
  const TextSetup& text;
  train::Rewards rewards;
  std::optional<Rollout> rollout;

  StepResult step(int64_t step);
  report::ValidationMetrics validate(const Position& p);
  std::vector<std::pair<std::string, at::Tensor>> save_state() const;
  void load_state(const checkpoint::ResumeCheckpoint& ck, bool remesh, const std::string& where);
};

StepResult Grpo::step(int64_t step) {
  const RecipeConfig& cfg = s.cfg;
  const int64_t pad = text.tokenizer.pad_id();
  if (!rollout || rollout->uses == cfg.grpo.num_iterations) {
    rollout = make_rollout(s, m, d, text, rewards, step);
    frozen_logps(cfg, m, *rollout, pad, s.device, d.images);
  }
  Rollout& r = *rollout;
  const train::GrpoOptions opt = cfg.grpo.options();
  const auto& poison = train::fault_plan().poison_loss;  // tests only
  const bool nan = poison && poison(s.world.rank(), step);
  std::vector<double> sums(5, 0.0);  // loss, KL · tokens, clipped tokens, −Σ log-probs, scored tokens
  for (size_t k = 0; k < r.micro.size(); ++k) {
    const train::CompletionBatch b = train::completion_batch(r.micro[k], pad);
    train::GrpoInputs in;
    in.mask = train::grpo_loss_mask(b.completion_mask, b.truncated, opt.mask_truncated_completions).to(s.device);
    at::Tensor entropy;  // [B, C]
    in.logps = train::completion_logps(m.decoder, b, s.device, train::LogpsOf::kPolicy, &entropy, d.images);
    in.old_logps = r.old_logps[k];
    in.ref_logps = r.ref_logps[k];
    in.advantages = r.advantages[k].to(s.device);
    in.num_items = r.num_items;
    const train::GrpoTerms t = train::grpo_loss(in, opt);
    at::Tensor loss = t.loss * micro_share(cfg, s.world.size());
    if (nan) loss = loss * std::numeric_limits<double>::quiet_NaN();
    backward_micro_batch(m, loss, k + 1 == r.micro.size());
    const double tokens = in.mask.sum().item<double>();
    sums[0] += loss.item<double>();
    if (t.mean_kl.defined()) sums[1] += t.mean_kl.item<double>() * tokens;
    sums[2] += t.clip_ratio.item<double>() * tokens;
    sums[3] += (entropy * in.mask).sum().item<double>();
    sums[4] += tokens;
  }
  r.uses += 1;
  sums = train::all_ranks_sum(s.world, sums, s.device);
  StepResult out;
  out.loss = sums[0];
  out.tokens = static_cast<int64_t>(sums[4]);
  out.extra = r.metrics;
  const double scored = std::max(sums[4], 1.0);
  if (cfg.grpo.beta != 0) out.extra["kl"] = sums[1] / scored;
  out.extra["clip_ratio/region_mean"] = sums[2] / scored;
  // TRL's: the policy's entropy at the sampling temperature, over the step's completion tokens.
  out.extra["entropy"] = sums[3] / scored;
  return out;
}

// The greedy completion's mean reward on the validation prompts, each rank its share (collective).
report::ValidationMetrics Grpo::validate(const Position& p) {
  const int64_t ranks = s.world.size(), n = static_cast<int64_t>(d.validation.size());
  std::vector<const data::PromptRecord*> mine;
  for (int64_t i = s.world.rank(); i < n; i += ranks) mine.push_back(&d.validation[static_cast<size_t>(i)]);
  const models::GenerateOptions greedy{s.cfg.grpo.max_completion_length, 0.0, 1.0, 0, 0, d.stop_ids};
  const size_t R = rewards.names().size();
  std::vector<double> sums(R + 3, 0.0);  // the total, each reward, the length, the prompts
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(1, s.cfg.training.batch_size * s.cfg.grpo.num_generations));
  const Gathered base(*m.engine);
  for (size_t c0 = 0; c0 < mine.size(); c0 += chunk) {
    const std::vector<const data::PromptRecord*> part(mine.begin() + c0, mine.begin() + std::min(mine.size(), c0 + chunk));
    const std::vector<models::Completion> out =
        sample(m, d, part, 1, greedy, s.cfg.data.max_seq_len, [](int64_t, int64_t) { return 0; }, s.device);
    const train::RewardScores scores = score(rewards, text.tokenizer, d, part, 1, out);
    for (size_t i = 0; i < out.size(); ++i) {
      sums[0] += scores.total[i];
      for (size_t r = 0; r < R; ++r) sums[r + 1] += scores.each[r][i];
      sums[R + 1] += static_cast<double>(out[i].ids.size());
      sums[R + 2] += 1;
    }
  }
  sums = train::all_ranks_sum(s.world, sums, s.device);
  const double prompts = std::max(sums[R + 2], 1.0);
  report::ValidationMetrics v{p.global_step, p.epoch, std::numeric_limits<double>::quiet_NaN(), -1.0,
                             static_cast<int64_t>(sums[R + 1])};
  v.extra["reward"] = sums[0] / prompts;
  const std::vector<std::string> names = rewards.names();
  for (size_t r = 0; r < R; ++r) v.extra["rewards/" + names[r] + "/mean"] = sums[r + 1] / prompts;
  v.extra["completions/mean_length"] = sums[R + 1] / prompts;
  return v;
}

// ---- the rollout still to be reused, in the resume checkpoint --------------------------------

at::Tensor ids_tensor(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }
std::vector<int64_t> ids_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

std::vector<std::pair<std::string, at::Tensor>> Grpo::save_state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!rollout || rollout->uses == s.cfg.grpo.num_iterations) return out;  // the next step samples anew
  const Rollout& r = *rollout;
  const std::string metrics = r.metrics.dump();
  out.emplace_back("grpo.state", at::tensor({static_cast<double>(r.uses), r.num_items}, at::kDouble));
  out.emplace_back("grpo.metrics", at::tensor(std::vector<uint8_t>(metrics.begin(), metrics.end()), at::kByte));
  for (size_t k = 0; k < r.micro.size(); ++k) {
    const std::string p = "grpo." + std::to_string(k) + ".";
    std::vector<int64_t> ids, lengths;  // per completion: prompt length, completion length, truncated
    for (const train::Completion& c : r.micro[k]) {
      ids.insert(ids.end(), c.prompt.begin(), c.prompt.end());
      ids.insert(ids.end(), c.completion.begin(), c.completion.end());
      lengths.insert(lengths.end(), {static_cast<int64_t>(c.prompt.size()), static_cast<int64_t>(c.completion.size()), c.truncated});
    }
    out.emplace_back(p + "ids", ids_tensor(ids));
    out.emplace_back(p + "lengths", ids_tensor(lengths));
    out.emplace_back(p + "advantages", r.advantages[k]);
    out.emplace_back(p + "prompts", ids_tensor(r.prompt_of[k]));
    if (r.old_logps[k].defined()) out.emplace_back(p + "old_logps", r.old_logps[k]);
    if (r.ref_logps[k].defined()) out.emplace_back(p + "ref_logps", r.ref_logps[k]);
  }
  return out;
}

void Grpo::load_state(const checkpoint::ResumeCheckpoint& ck, bool remesh, const std::string& where) {
  rollout.reset();
  const auto& saved = ck.ranks.at(static_cast<size_t>(remesh ? 0 : s.world.rank()));
  std::map<std::string, at::Tensor> t(saved.begin(), saved.end());
  if (!t.count("grpo.state")) return;  // saved between rollouts: the next step samples anew
  if (remesh)
    throw std::invalid_argument("cannot resume " + where + " on " + std::to_string(s.world.size()) +
                                " ranks: it was saved while its rollouts were still being reused (grpo.num_iterations = " +
                                std::to_string(s.cfg.grpo.num_iterations) + "), which only the same ranks can continue; "
                                "resume it on " + std::to_string(ck.world_size) + " ranks, or from an earlier checkpoint");
  const auto at_key = [&](const std::string& k) -> const at::Tensor& {
    const auto it = t.find(k);
    if (it == t.end()) throw std::invalid_argument("cannot resume " + where + ": its GRPO state has no " + k);
    return it->second;
  };
  Rollout r;
  const at::Tensor state = at_key("grpo.state").to(at::kDouble);
  r.uses = static_cast<int64_t>(state[0].item<double>());
  r.num_items = state[1].item<double>();
  const at::Tensor m = at_key("grpo.metrics").contiguous();
  r.metrics = nlohmann::ordered_json::parse(std::string(m.data_ptr<uint8_t>(), m.data_ptr<uint8_t>() + m.numel()));
  for (int64_t k = 0; k < s.cfg.training.grad_accum; ++k) {
    const std::string p = "grpo." + std::to_string(k) + ".";
    const std::vector<int64_t> ids = ids_of(at_key(p + "ids")), lengths = ids_of(at_key(p + "lengths"));
    std::vector<train::Completion> micro;
    size_t at = 0;
    if (lengths.size() % 3 != 0) throw std::invalid_argument("cannot resume " + where + ": " + p + "lengths is damaged");
    for (size_t c = 0; c < lengths.size(); c += 3) {
      const size_t np = static_cast<size_t>(lengths[c]), nc = static_cast<size_t>(lengths[c + 1]);
      if (at + np + nc > ids.size()) throw std::invalid_argument("cannot resume " + where + ": " + p + "ids is too short");
      micro.push_back({{ids.begin() + at, ids.begin() + at + np}, {ids.begin() + at + np, ids.begin() + at + np + nc},
                       lengths[c + 2] != 0, {}});
      at += np + nc;
    }
    // Each completion's prompt's images, from the training set (a resume checks the data's fingerprint).
    r.prompt_of.push_back(t.count(p + "prompts") ? ids_of(t.at(p + "prompts")) : std::vector<int64_t>());
    for (size_t c = 0; c < r.prompt_of.back().size() && c < micro.size(); ++c) {
      const int64_t i = r.prompt_of.back()[c];
      if (i < 0 || i >= static_cast<int64_t>(d.train.size()))
        throw std::invalid_argument("cannot resume " + where + ": " + p + "prompts names prompt " + std::to_string(i) +
                                    " of " + std::to_string(d.train.size()));
      micro[c].images = d.train[static_cast<size_t>(i)].images;
    }
    r.micro.push_back(std::move(micro));
    r.advantages.push_back(at_key(p + "advantages").clone());
    r.old_logps.push_back(t.count(p + "old_logps") ? t.at(p + "old_logps").to(s.device) : at::Tensor());
    r.ref_logps.push_back(t.count(p + "ref_logps") ? t.at(p + "ref_logps").to(s.device) : at::Tensor());
  }
  rollout = std::move(r);
}

int run_grpo(Session& s) {
  const RecipeConfig& cfg = s.cfg;
  const TextSetup text = open_text(s);
  train::Rewards rewards = config::grpo_rewards(cfg.grpo);
  Prompts d = setup_prompts(s, text, rewards);
  train::TokenIdSet ids;
  for (const auto* set : {&d.train, &d.validation})
    for (const data::PromptRecord& p : *set) ids.add(prompt_sample(p));
  Model m = setup_model(s, text, ids.ids());
  const auto has_images = [](const std::vector<data::PromptRecord>& set) {
    return std::any_of(set.begin(), set.end(), [](const data::PromptRecord& x) { return !x.images.empty(); });
  };
  d.images = load_vision_tower(s, m, text.options, has_images(d.train), has_images(d.validation));
  m.decoder.logit_temperature = cfg.grpo.temperature;  // the loss's log-probs at the sampling temperature
  Grpo g{s, m, d, text, std::move(rewards), std::nullopt};
  RecipeParts parts;
  parts.sampler = d.sampler.get();
  parts.records = static_cast<int64_t>(d.train.size());
  parts.records_name = "prompts";
  parts.steps_per_batch = cfg.grpo.num_iterations;
  parts.step = [&](int64_t step) { return g.step(step); };
  if (!d.validation.empty()) parts.validate = [&](const Position& p) { return g.validate(p); };
  parts.save_state = [&] { return g.save_state(); };
  parts.load_state = [&](const checkpoint::ResumeCheckpoint& ck, bool remesh, const std::string& where) {
    g.load_state(ck, remesh, where);
  };
  const Position p = train(s, m, text, parts);
  print_done(s, p, io::enum_name(train::kGrpoLossTypeNames, cfg.grpo.loss_type));
  return 0;
}

}  // namespace

std::vector<data::PromptRecord> load_grpo_prompts(const std::string& path, const data::Tokenizer& tok,
                                                  const data::DatasetOptions& options, const train::Rewards& rewards) {
  std::vector<data::PromptRecord> out = data::load_prompts(path, tok, options);
  for (const data::PromptRecord& p : out) rewards.check_record(p.record, p.origin);
  return out;
}

int lora_grpo_main(const ConfigArgs& args) { return run_recipe("lora_grpo", args, run_grpo); }

}  // namespace qlora::recipes
