// `qlora run lora_finetune`: single-process QLoRA fine-tuning, top to bottom.
//   setup  : config (file + overrides, or the embedded default), model (NF4 base + LoRA), data,
//            optimizer, schedule, and the resume point if asked for
//   train  : epochs of optimizer steps; each step accumulates grad_accum micro-batches with the
//            loss normalised by the non-masked tokens of the whole step, clips, steps
//   save   : a resume checkpoint every save_every_steps and at every epoch end; an inference
//            export (PEFT adapter + merged HF model) after every epoch
//   cleanup: where the exports are
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/Reduction.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <csignal>
#include <ctime>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/checkpoint/fingerprint.h"
#include "qlora/checkpoint/resume.h"
#include "qlora/config/config.h"
#include "qlora/data/batching.h"
#include "qlora/data/dataset.h"
#include "qlora/data/sampler.h"
#include "qlora/data/tokenizer.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_export.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/engine/sharded_state.h"
#include "qlora/models/llama.h"
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/train/device.h"
#include "qlora/train/metrics.h"
#include "qlora/train/tiny_default.h"

namespace qlora::recipes {

extern const char* const kEmbeddedTinyConfig;  // configs/tiny_qlora.toml, compiled in

namespace {
namespace fs = std::filesystem;
using config::RecipeConfig;

RecipeConfig load_recipe_config(const std::vector<std::string>& args) {
  std::string path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) throw std::invalid_argument("--config needs a file");
      path = args[++i];
    } else if (args[i].find('=') != std::string::npos && args[i][0] != '-') {
      overrides.push_back(args[i]);
    } else {
      throw std::invalid_argument("unexpected argument '" + args[i] +
                                  "'; expected --config FILE and section.key=value overrides");
    }
  }
  RecipeConfig cfg = path.empty() ? config::parse_config(kEmbeddedTinyConfig, "<embedded tiny_qlora.toml>")
                                  : config::load_config(path);
  if (path.empty()) std::printf("No --config: running the embedded default (configs/tiny_qlora.toml)\n");
  for (const auto& o : overrides) config::apply_override(cfg, o);
  return cfg;
}

std::vector<std::string> peft_targets(const std::vector<std::string>& short_names) {
  std::vector<std::string> out;
  for (const auto& t : short_names) out.push_back(models::peft_target(models::llama_architecture(), t));
  return out;
}

// model.tokenizer, else the checkpoint's tokenizer.model, else original/tokenizer.model (Llama-3
// repositories keep Meta's tiktoken file there and only tokenizer.json at the top).
std::string find_tokenizer(const RecipeConfig& cfg, const std::string& base_dir) {
  if (!cfg.model.tokenizer.empty()) return cfg.model.tokenizer;
  for (const char* rel : {"tokenizer.model", "original/tokenizer.model"})
    if (fs::is_regular_file(fs::path(base_dir) / rel)) return (fs::path(base_dir) / rel).string();
  throw std::invalid_argument(base_dir + ": no tokenizer.model (nor original/tokenizer.model); "
                              "set model.tokenizer to the tokenizer file");
}

// Frozen embedding / lm_head storage: under fp32 compute, a bf16 checkpoint's embed_tokens and
// lm_head stay bf16 (widened exactly on use, so the numbers are those of fp32 storage): for a 7B
// model that is 0.5 GB less resident memory for nothing.
at::ScalarType frozen_storage_dtype(const std::string& base_dir, at::ScalarType compute) {
  const auto ckpt = io::CheckpointDir::open(base_dir);
  const char* key = "model.embed_tokens.weight";
  if (compute == at::kFloat && ckpt.contains(key) && ckpt.file_of(key).info(key).dtype == io::Dtype::BF16)
    return at::kBFloat16;
  return compute;
}

// Everything a resumed run needs to continue bit for bit; `inputs` (input_fingerprints) lets the
// resume tell whether the data or base weights changed under paths the config check ignores.
// `train_state` is the adapters and optimizer state: named per adapter in one process
// (model.<peft name>, optim.*), or this rank's flat shards with ranks (engine::sharded_train_state).
checkpoint::ResumeState capture(engine::NamedTensors train_state, const data::Sampler& sampler, int64_t epoch,
                                int64_t step_in_epoch, int64_t global_step, const RecipeConfig& cfg,
                                c10::Device device, const nlohmann::json& inputs, int64_t ranks) {
  checkpoint::ResumeState s;
  s.tensors = std::move(train_state);
  s.tensors.push_back({"rng.cpu", train::generator_state(c10::kCPU)});
  if (device.is_cuda()) s.tensors.push_back({"rng.cuda", train::generator_state(device)});
  s.meta = {{"epoch", epoch},
            {"step_in_epoch", step_in_epoch},
            {"global_step", global_step},
            {"sampler", nlohmann::json::parse(sampler.state_json())},
            {"config_toml", config::to_toml(cfg)},
            {"config_hash", config::config_hash(cfg, config::HashScope::Exactness)},
            {"device_type", device.is_cuda() ? "cuda" : "cpu"},
            {"world_size", ranks}};
  s.meta.update(inputs);
  return s;
}

engine::NamedTensors single_train_state(const std::vector<std::pair<std::string, at::Tensor>>& lora,
                                      const optim::AdamW& opt) {
  engine::NamedTensors out;
  for (const auto& [name, t] : lora) out.emplace_back("model." + name, t.detach().cpu());
  for (const auto& [name, t] : opt.state_dict()) out.emplace_back("optim." + name, t);
  return out;
}

// The checks before continuing from `ckpt`: exactness-breaking config keys (on another number of
// ranks, the mesh may change and batch_size with it as long as the global batch is the same),
// the device kind and the input fingerprints. Returns whether the mesh changed.
bool check_resumable(const nlohmann::json& meta, const RecipeConfig& cfg, c10::Device device,
                     const nlohmann::json& inputs, const std::string& ckpt, int64_t ranks) {
  const RecipeConfig saved = config::parse_config(meta.at("config_toml").get<std::string>(), ckpt + "/meta.json");
  const int64_t saved_ranks = meta.value("world_size", int64_t{1});
  const bool remesh = saved_ranks != ranks || saved.dist.shard_size != cfg.dist.shard_size;
  if (saved.training.batch_size * saved_ranks != cfg.training.batch_size * ranks)
    throw std::invalid_argument("cannot resume " + ckpt + ": its global batch was " +
                                std::to_string(saved.training.batch_size) + " x " + std::to_string(saved_ranks) +
                                " rank(s); this run's is " + std::to_string(cfg.training.batch_size) + " x " +
                                std::to_string(ranks) + " (set training.batch_size to keep the product)");
  std::string keys;
  for (const auto& d : config::exactness_breaking_differences(saved, cfg))
    if (!(remesh && (d == "dist.shard_size" || d == "training.batch_size"))) keys += (keys.empty() ? "" : ", ") + d;
  if (!keys.empty())
    throw std::invalid_argument("cannot resume " + ckpt + ": these keys differ from the run that wrote it and "
                                "would change its results: " + keys + " (restore them, or start a new output_dir)");
  // CPU and CUDA kernels round differently: continuing on the other kind would not be exact.
  const std::string saved_device = meta.value("device_type", std::string("cpu"));
  if (saved_device != (device.is_cuda() ? "cuda" : "cpu"))
    throw std::invalid_argument("cannot resume " + ckpt + ": it was written by a run on " + saved_device +
                                " and this run would compute on " + device.str() + "; set model.device=" +
                                saved_device + " (or start a new output_dir)");
  if (const auto warning = checkpoint::check_input_fingerprints(meta, inputs, ckpt))
    std::printf("warning: %s\n", warning->c_str());
  return remesh;
}

// The recipe proper. `world` is null for a single process; with ranks, rank 0 (`lead`) prints,
// logs metrics and writes the exports, and every step's collectives go through `world`.
int run_recipe(const RecipeConfig& cfg, c10::Device device, engine::World* world) {
  // ---------------------------------------------------------------- setup
  const bool lead = !world || world->rank() == 0;
  const int64_t ranks = world ? world->size() : 1, rank = world ? world->rank() : 0;
  const auto& out_dir = cfg.checkpoint.output_dir;
  fs::create_directories(out_dir);
  at::manual_seed(static_cast<uint64_t>(cfg.training.seed));
  // Early steps push tiny values through AdamW's moments and the LoRA path; denormal arithmetic
  // is ~100x slower on x86, and flushing them to zero changes nothing a loss can see.
  at::globalContext().setFlushDenormal(true);

  // The embedded default's model is written once, by rank 0, before anyone reads it.
  if (cfg.model.checkpoint_dir.empty() && (!world || world->env().local_rank == 0))
    train::ensure_tiny_base(out_dir + "/tiny_base");  // once per node: output_dir may not be shared
  if (world) world->world().barrier();
  const std::string base_dir = cfg.model.checkpoint_dir.empty()
                                   ? train::ensure_tiny_base(out_dir + "/tiny_base")
                                   : cfg.model.checkpoint_dir;
  const std::string data_path = cfg.data.path.empty() ? train::bundled_data_dir() + "/tiny_tasks.jsonl" : cfg.data.path;
  const std::string tokenizer_path = find_tokenizer(cfg, base_dir);
  const data::Tokenizer tokenizer = data::Tokenizer::open(tokenizer_path);

  data::DatasetOptions dopts;
  dopts.kind = data::dataset_kind_from_name(config::to_string(cfg.data.format));
  if (cfg.data.template_ != config::PromptTemplate::None)
    dopts.prompt_template = data::template_kind_from_name(config::to_string(cfg.data.template_));
  dopts.max_seq_len = cfg.data.max_seq_len;
  dopts.train_on_input = cfg.data.train_on_input;
  const std::vector<data::Sample> samples = data::load_dataset(data_path, tokenizer, dopts);
  // Packing: samples are packed once into rows of max_seq_len; the sampler then draws rows.
  const std::vector<data::PackedRow> rows =
      cfg.data.packing ? data::pack_samples(samples, cfg.data.max_seq_len, tokenizer.pad_id())
                       : std::vector<data::PackedRow>{};

  data::SamplerOptions sopts;
  sopts.dataset_size = static_cast<int64_t>(cfg.data.packing ? rows.size() : samples.size());
  // One global batch per micro-step; each rank trains on its own batch_size rows of it.
  sopts.batch_size = cfg.training.batch_size * ranks;
  sopts.seed = static_cast<uint64_t>(cfg.training.seed);
  sopts.shuffle = cfg.data.shuffle;
  sopts.drop_last = true;
  data::Sampler sampler(sopts);

  models::LlamaLoadOptions mopts;
  if (device.is_cuda()) at::manual_seed(static_cast<uint64_t>(cfg.training.seed));  // seeds CUDA too, now it is up
  mopts.base_in_nf4 = cfg.model.base == config::BaseFormat::NF4;
  mopts.compute_dtype = cfg.model.dtype == config::ComputeDtype::BF16 ? at::kBFloat16 : at::kFloat;
  mopts.frozen_dtype = frozen_storage_dtype(base_dir, mopts.compute_dtype);
  mopts.device = device;
  mopts.lora_targets = cfg.lora.targets;
  mopts.lora_r = cfg.lora.rank;
  mopts.lora_alpha = cfg.lora.alpha;
  mopts.lora_dropout = cfg.lora.dropout;
  mopts.seed = static_cast<uint64_t>(cfg.training.seed);
  mopts.activation_checkpointing = cfg.model.activation_checkpointing;
  // Ranks: every rank builds the same model (same seed, same adapters) and keeps 1/N of each layer
  // as soon as it is loaded, so the whole base never sits in one rank's memory.
  std::shared_ptr<engine::ShardedLlama> sharded;
  if (world) {
    engine::ShardingOptions so;
    so.reshard_after_forward = cfg.dist.reshard_after_forward;
    so.prefetch = cfg.dist.prefetch;
    so.reduce_scatter_every_micro_batch = cfg.dist.reduce_scatter_every_micro_batch;
    sharded = engine::ShardedLlama::begin(*world, so);
    mopts.on_layer_loaded = [&sharded](int64_t i, modules::DecoderLayer& L) { sharded->shard_layer(i, L); };
  }
  models::LlamaModel model = models::load_llama(base_dir, mopts);
  if (sharded) {
    sharded->finish(model);
    // Ranks finish loading at their own pace (disk, page cache): wait for the slowest here, so the
    // step collectives' timeout (dist.collective_timeout_s) only has to cover a hung peer.
    world->world().barrier(std::chrono::minutes(30));
  }
  // LoRA init above drew from its own seeded generator, identical on every rank; dropout draws
  // from the default one, which each rank seeds apart so masks are not the same on every rank.
  if (rank > 0) at::manual_seed(static_cast<uint64_t>(cfg.training.seed) + static_cast<uint64_t>(rank));
  if (tokenizer.vocab_size() > model.config.vocab_size)
    throw std::invalid_argument(tokenizer_path + ": the tokenizer has " + std::to_string(tokenizer.vocab_size()) +
                                " ids but " + base_dir + "/config.json says vocab_size " +
                                std::to_string(model.config.vocab_size) + " (a tokenizer of another model?)");
  model.training = true;
  const auto lora = model.lora_parameters();
  std::vector<at::Tensor> params;
  if (sharded) params = sharded->param_shards();
  else
    for (const auto& [name, t] : lora) params.push_back(t);

  optim::AdamW opt(params, {cfg.optim.lr, cfg.optim.betas[0], cfg.optim.betas[1], cfg.optim.eps,
                            cfg.optim.weight_decay});
  int64_t steps_per_epoch = sampler.batches_per_epoch() / cfg.training.grad_accum;
  if (cfg.training.max_steps_per_epoch > 0) steps_per_epoch = std::min(steps_per_epoch, cfg.training.max_steps_per_epoch);
  if (steps_per_epoch < 1)
    throw std::invalid_argument("data set " + data_path + " has " + std::to_string(samples.size()) +
                                " samples: too few for one step of batch_size x ranks x grad_accum = " +
                                std::to_string(cfg.training.batch_size * ranks * cfg.training.grad_accum));
  optim::LrSchedule schedule;
  schedule.kind = cfg.optim.schedule == config::Schedule::Cosine ? optim::ScheduleKind::Cosine : optim::ScheduleKind::Constant;
  schedule.base_lr = cfg.optim.lr;
  schedule.warmup_steps = cfg.optim.warmup_steps;
  schedule.total_steps = steps_per_epoch * cfg.training.epochs;
  schedule.min_lr_ratio = cfg.optim.min_lr_ratio;

  int64_t start_epoch = 0, start_step = 0, global_step = 0;
  const nlohmann::json inputs = checkpoint::input_fingerprints(data_path, base_dir, tokenizer_path);
  const auto latest = checkpoint::latest_resume_checkpoint(out_dir);
  if (lead && !cfg.checkpoint.resume && fs::exists(out_dir + "/checkpoints")) {
    // A fresh run must not mix its checkpoints with an earlier run's (keep_last_n would keep the
    // old, higher steps; a later resume would pick them). Nothing saved is deleted: set aside.
    const std::string aside = out_dir + "/checkpoints.prev-" + std::to_string(std::time(nullptr));
    fs::rename(out_dir + "/checkpoints", aside);
    std::printf("fresh run: the earlier run's resume checkpoints were moved to %s\n", aside.c_str());
  }
  if (cfg.checkpoint.resume) {
    if (!latest) {
      std::printf("checkpoint.resume = true but %s has no resume checkpoint: starting fresh\n", out_dir.c_str());
    } else {
      nlohmann::json meta;
      if (world) {
        // Every rank reads every old rank's file: on another mesh each needs pieces of all of them.
        const checkpoint::ShardedResumeState s = checkpoint::load_sharded_resume_checkpoint(*latest);
        meta = s.meta;
        const bool remesh = check_resumable(meta, cfg, device, inputs, *latest, ranks);
        engine::load_sharded_train_state(*sharded, opt, s.ranks);
        if (!remesh) {
          std::map<std::string, at::Tensor> mine(s.ranks.at(rank).begin(), s.ranks.at(rank).end());
          train::set_generator_state(c10::kCPU, mine.at("rng.cpu"));
          if (device.is_cuda()) train::set_generator_state(device, mine.at("rng.cuda"));
        } else if (lead) {
          std::printf("resuming a %lld-rank checkpoint on %lld ranks (shard_size %lld): state resharded; the run "
                      "continues within float tolerance of the original, not bit for bit\n",
                      (long long)meta.value("world_size", int64_t{1}), (long long)ranks,
                      (long long)cfg.dist.shard_size);
        }
      } else {
        const checkpoint::ResumeState s = checkpoint::load_resume_checkpoint(*latest);
        meta = s.meta;
        check_resumable(meta, cfg, device, inputs, *latest, ranks);
        std::map<std::string, at::Tensor> by_name(s.tensors.begin(), s.tensors.end());
        c10::NoGradGuard no_grad;
        for (const auto& [name, t] : lora) t.copy_(by_name.at("model." + name));
        optim::NamedTensors ostate;
        for (const auto& [name, t] : s.tensors)
          if (name.rfind("optim.", 0) == 0) ostate.push_back({name.substr(6), t});
        opt.load_state_dict(ostate);
        train::set_generator_state(c10::kCPU, by_name.at("rng.cpu"));
        if (device.is_cuda()) train::set_generator_state(device, by_name.at("rng.cuda"));
      }
      const nlohmann::json& s_meta = meta;
      sampler.load_state_json(s_meta.at("sampler").dump(), *latest);
      start_epoch = s_meta.at("epoch");
      start_step = s_meta.at("step_in_epoch");
      global_step = s_meta.at("global_step");
      if (lead)
        std::printf("resumed from %s (epoch %lld, step %lld)\n", latest->c_str(), (long long)start_epoch + 1,
                  (long long)global_step);
    }
  }

  std::optional<train::MetricsLog> metrics;
  if (lead) metrics.emplace(out_dir, global_step);
  train::Progress progress(train::parse_progress_mode(config::to_string(cfg.logging.progress)));
  const checkpoint::AdapterInfo adapter_info{cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout,
                                             peft_targets(cfg.lora.targets), base_dir};
  if (lead)
    std::printf("model %s on %s x %lld rank(s): %lld layers, %lld trainable LoRA parameters; %zu samples; "
                "%lld steps/epoch x %lld epochs\n",
                base_dir.c_str(), device.str().c_str(), (long long)ranks, (long long)model.config.num_hidden_layers,
                (long long)[&] { int64_t n = 0; for (auto& [k, t] : lora) n += t.numel(); return n; }(),
                samples.size(), (long long)steps_per_epoch, (long long)cfg.training.epochs);

  // QLORA_TEST_KILL_AFTER_STEP=N: die by SIGKILL right after step N is logged (resume tests);
  // with QLORA_TEST_KILL_RANK=R only rank R dies (failure tests). QLORA_TEST_KILL_IN_SAVE_AT_STEP=N:
  // rank R dies in the save of step N, its part written but the checkpoint not yet committed.
  const char* kill_env = std::getenv("QLORA_TEST_KILL_AFTER_STEP");
  const char* kill_rank = std::getenv("QLORA_TEST_KILL_RANK");
  const int64_t kill_after_step = kill_env && (!kill_rank || std::stoll(kill_rank) == rank) ? std::stoll(kill_env) : -1;
  // QLORA_TEST_HANG_AT_STEP=N with QLORA_TEST_KILL_RANK=R: rank R's loop stalls (alive, beating) before step N.
  const char* hang_env = std::getenv("QLORA_TEST_HANG_AT_STEP");
  const int64_t hang_at_step = hang_env && kill_rank && std::stoll(kill_rank) == rank ? std::stoll(hang_env) : -1;
  const char* kill_save_env = std::getenv("QLORA_TEST_KILL_IN_SAVE_AT_STEP");
  const int64_t kill_in_save = kill_save_env && kill_rank && std::stoll(kill_rank) == rank ? std::stoll(kill_save_env) : -1;
  // A resume checkpoint: one file in one process; with ranks, each rank's shards in its own file,
  // committed by rank 0 once all are durable.
  const auto save = [&](int64_t epoch, int64_t step_in_epoch) {
    const checkpoint::ResumeState st =
        capture(sharded ? engine::sharded_train_state(*sharded, opt) : single_train_state(lora, opt), sampler, epoch,
                step_in_epoch, global_step, cfg, device, inputs, ranks);
    if (!world) return checkpoint::save_resume_checkpoint(out_dir, global_step, st, cfg.checkpoint.keep_last_n);
    int barriers = 0;
    const checkpoint::RankSync sync{world->rank(), world->size(),
                                    [&] {
                                      if (++barriers == 2 && global_step == kill_in_save) ::raise(SIGKILL);
                                      world->world().barrier();
                                    },
                                    {{"shard_size", world->shard().size()}, {"replicas", world->replica().size()}}};
    checkpoint::save_sharded_resume_checkpoint(out_dir, global_step, st, sync, cfg.checkpoint.keep_last_n);
  };

  // ---------------------------------------------------------------- train
  const int64_t vocab = model.config.vocab_size;
  for (int64_t epoch = start_epoch; epoch < cfg.training.epochs; ++epoch) {
    if (lead) progress.start_epoch(epoch, cfg.training.epochs, steps_per_epoch, epoch == start_epoch ? start_step : 0);
    for (int64_t step = epoch == start_epoch ? start_step : 0; step < steps_per_epoch; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      if (world) world->mark_progress(global_step + 1);
      if (global_step + 1 == hang_at_step) std::this_thread::sleep_for(std::chrono::hours(1));  // tests: a hung rank
      const double lr = schedule.lr_at(global_step);
      opt.set_lr(lr);
      std::vector<data::Batch> micro;
      int64_t tokens = 0;
      for (int64_t m = 0; m < cfg.training.grad_accum; ++m) {
        const std::vector<int64_t> global = sampler.next();
        const std::vector<int64_t> picked(global.begin() + rank * cfg.training.batch_size,
                                          global.begin() + (rank + 1) * cfg.training.batch_size);
        if (cfg.data.packing) {
          std::vector<data::PackedRow> batch_rows;
          for (int64_t idx : picked) batch_rows.push_back(rows[idx]);
          micro.push_back(data::collate_packed(batch_rows));
        } else {
          std::vector<data::Sample> batch_samples;
          for (int64_t idx : picked) batch_samples.push_back(samples[idx]);
          micro.push_back(data::collate(batch_samples, tokenizer.pad_id()));
        }
        tokens += micro.back().num_label_tokens;
      }
      // The loss is normalised by the tokens of the whole step on every rank.
      if (world) {
        // On the compute device: NCCL reduces CUDA tensors only.
        at::Tensor t = at::full({1}, static_cast<double>(tokens), at::TensorOptions().dtype(at::kDouble).device(device));
        engine::wait(world->world().all_reduce_sum(t));
        tokens = static_cast<int64_t>(t.item<double>());
      }
      double loss_value = 0.0;
      for (size_t m = 0; m < micro.size(); ++m) {
        const data::Batch& b = micro[m];
        if (sharded) sharded->set_gradient_sync(m + 1 == micro.size());
        // Sum over tokens / tokens of the whole step: every token weighs the same, however the
        // step's tokens fall into micro-batches.
        // [batch, seq, vocab] fp32; packed rows attend within their own sample only
        const at::Tensor logits =
            cfg.data.packing ? model.forward(b.tokens.to(device), b.position_ids.to(device),
                                             data::block_causal_mask(b.document_ids).to(device))
                             : model.forward(b.tokens.to(device));
        const at::Tensor loss = at::cross_entropy_loss(logits.view({-1, vocab}), b.labels.view({-1}).to(device), {},
                                                       at::Reduction::Sum, data::kIgnoreIndex) /
                                static_cast<double>(std::max<int64_t>(tokens, 1));
        torch::autograd::backward({loss});
        if (sharded) sharded->finish_backward();
        loss_value += loss.item<double>();
      }
      if (world) {
        at::Tensor l = at::full({1}, loss_value, at::TensorOptions().dtype(at::kDouble).device(device));
        engine::wait(world->world().all_reduce_sum(l));
        loss_value = l.item<double>();
      }
      const double grad_norm = sharded ? sharded->clip_grad_norm(cfg.optim.max_grad_norm)
                                       : optim::clip_grad_norm_(params, cfg.optim.max_grad_norm).item<double>();
      opt.step();
      if (sharded) sharded->gather_params();
      else opt.zero_grad();
      ++global_step;

      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      train::StepMetrics sm;
      sm.step = global_step;
      sm.epoch = epoch;
      sm.loss = loss_value;
      sm.lr = lr;
      sm.tokens = tokens;
      sm.tokens_per_second = tokens / std::max(secs, 1e-9);
      sm.peak_memory_bytes = train::peak_memory_bytes(device);
      sm.grad_norm = grad_norm;
      if (lead) {
        metrics->append(sm);
        progress.update(sm, step + 1, cfg.logging.log_every_steps);
      }

      if (global_step == kill_after_step) ::raise(SIGKILL);  // tests: an abrupt death mid-run

      const bool epoch_end = step + 1 == steps_per_epoch;
      if (epoch_end) sampler.set_state({epoch + 1, 0});  // max_steps_per_epoch may cut an epoch short
      // The epoch-end checkpoint is written after the export below: a resume from it must find
      // the epoch's export already on disk.
      if (!epoch_end && cfg.checkpoint.save_every_steps > 0 && global_step % cfg.checkpoint.save_every_steps == 0)
        save(epoch, step + 1);
    }
    if (lead) progress.end_epoch();

    // ------------------------------------------------------------ save (export for inference)
    const auto merge = cfg.checkpoint.merge_from == config::MergeFrom::NF4 ? checkpoint::MergeSource::Nf4
                                                                          : checkpoint::MergeSource::Original;
    if (sharded) {
      // Every rank writes the layers it owns into the same files: the same bytes as one process.
      engine::export_epoch_sharded(out_dir, epoch, model, *sharded, *world, adapter_info, cfg.checkpoint.adapter_only,
                                 base_dir, merge, tokenizer_path);
    } else {
      checkpoint::export_epoch(out_dir, epoch, model, adapter_info, cfg.checkpoint.adapter_only, base_dir, merge,
                               tokenizer_path);
    }
    if (lead) std::printf("epoch %lld exported to %s/epoch_%lld\n", (long long)epoch + 1, out_dir.c_str(), (long long)epoch);
    save(epoch + 1, 0);
  }

  // ---------------------------------------------------------------- cleanup
  if (world) world->finish();
  if (lead)
    std::printf("done: %lld steps; metrics in %s; exports in %s/epoch_*; try\n  qlora generate --checkpoint %s/epoch_%lld --prompt \"...\"\n",
              (long long)global_step, metrics->path().c_str(), out_dir.c_str(), out_dir.c_str(),
              (long long)cfg.training.epochs - 1);
  return 0;
}

}  // namespace

int lora_finetune_main(const std::vector<std::string>& args) {
  const RecipeConfig cfg = load_recipe_config(args);
  const engine::RankEnv env = engine::rank_env_from_environment();
  c10::Device device = train::resolve_device(cfg.model.device);
  if (env.world_size == 1) return run_recipe(cfg, device, nullptr);
  // One GPU per rank on a node; on the CPU the node's cores are split between its ranks.
  if (device.is_cuda()) device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  else at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / env.local_world_size));
  const auto world = engine::World::join(env, cfg.dist.shard_size, std::chrono::seconds(cfg.dist.collective_timeout_s), device);
  try {
    return run_recipe(cfg, device, world.get());
  } catch (const std::exception& e) {
    try {
      world->rethrow_with_culprits(e, "lora_finetune");
    } catch (const std::exception& named) {
      // Printed before `world` goes: its destructor tells the peers, and their launcher may then
      // stop this process before an error thrown further up would be printed.
      std::fprintf(stderr, "qlora run: error: %s\n", named.what());
      std::fflush(stderr);
    }
    return 1;
  }
}

}  // namespace qlora::recipes
