// `qlora run lora_finetune`: QLoRA fine-tuning on 1..N ranks (one process is a world of one),
// top to bottom.
//   setup  : config (file + overrides, or the embedded default), data, model (NF4 base + LoRA,
//            sharded by the engine), optimizer + schedule, and the resume point if asked for
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
#include <cmath>
#include <limits>
#include <ctime>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "qlora/checkpoint/export.h"
#include "qlora/checkpoint/fingerprint.h"
#include "qlora/checkpoint/resume.h"
#include "qlora/config/builders.h"
#include "qlora/config/config.h"
#include "qlora/data/batching.h"
#include "qlora/data/dataset.h"
#include "qlora/data/sampler.h"
#include "qlora/data/split.h"
#include "qlora/data/stats.h"
#include "qlora/data/tokenizer.h"
#include "qlora/engine/process_group.h"
#include "qlora/engine/sharded_export.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/engine/sharded_state.h"
#include "qlora/gguf/convert.h"
#include "qlora/gguf/modelfile.h"
#include "qlora/train/faults.h"
#include "qlora/models/llama.h"
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/cpu_memory.h"
#include "kernels/cpu_isa.h"
#include "qlora/train/demo.h"
#include "qlora/train/device.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/metrics.h"
#include "qlora/train/tiny_default.h"
#include "recipe_config.h"

namespace qlora::recipes {

namespace {
namespace fs = std::filesystem;
using config::RecipeConfig;

// Frozen embedding / lm_head storage: under fp32 compute, a bf16 checkpoint's embed_tokens and
// lm_head stay bf16 (widened exactly on use, so the numbers are those of fp32 storage): for a 7B
// model that is 0.5 GB less resident memory for nothing.
at::ScalarType frozen_storage_dtype(const std::string& base_dir, at::ScalarType compute) {
  const auto ckpt = io::CheckpointDir::open(base_dir);
  const std::string key = models::layout_key(models::key_layout_of(ckpt, models::load_llama_config(base_dir)),
                                             "model.embed_tokens.weight");
  if (compute == at::kFloat && ckpt.contains(key) && ckpt.file_of(key).info(key).dtype == io::Dtype::BF16)
    return at::kBFloat16;
  return compute;
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
                                "would change its results: " + keys + " (restore them, or start a new output_dir)" +
                                (keys.find("model.dtype") != std::string::npos
                                     ? "; model.dtype = \"auto\" resolves per machine: set the run's dtype explicitly"
                                     : ""));
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

// ---------------------------------------------------------------- setup helpers

// The training data as this run sees it: tokenized samples, packed rows when packing, and the
// sampler that draws one global batch (batch_size x ranks rows) per micro-step.
struct Data {
  std::string path, tokenizer_path;
  data::Tokenizer tokenizer;
  std::vector<data::Sample> samples;
  std::vector<data::Sample> validation;  // data.val_path, or the held-out data.val_fraction of `path`
  std::vector<data::PackedRow> rows;  // packing: samples packed once into rows of max_seq_len
  bool packed = false;
  std::unique_ptr<data::Sampler> sampler;
  data::DatasetOptions options;  // resolved for the tokenizer (data.template "auto", BOS, EOS)
  std::string template_note;     // what "auto" chose, for the log

  // Rows `picked` of the data set as one batch.
  data::Batch batch(const std::vector<int64_t>& picked) const {
    if (packed) {
      std::vector<data::PackedRow> b;
      for (int64_t i : picked) b.push_back(rows[i]);
      return data::collate_packed(b);
    }
    std::vector<data::Sample> b;
    for (int64_t i : picked) b.push_back(samples[i]);
    return data::collate(b, tokenizer.pad_id());
  }
};

// Samples `keep` of `all`, in order.
std::vector<data::Sample> pick(const std::vector<data::Sample>& all, const std::vector<int64_t>& keep) {
  std::vector<data::Sample> out;
  for (int64_t i : keep) out.push_back(all[static_cast<size_t>(i)]);
  return out;
}

// The validation set: data.val_path (the embedded default: its held-out file), or data.val_fraction
// of the training records held out (seeded by training.seed, the same on any number of ranks);
// empty without either.
void split_validation(const RecipeConfig& cfg, Data& d) {
  if (const std::string val = val_data_path(cfg); !val.empty()) d.validation = data::load_dataset(val, d.tokenizer, d.options);
  if (cfg.data.val_fraction > 0) {
    const data::SplitIndices split = data::split_validation(static_cast<int64_t>(d.samples.size()),
                                                            cfg.data.val_fraction, static_cast<uint64_t>(cfg.training.seed));
    d.validation = pick(d.samples, split.val);
    d.samples = pick(d.samples, split.train);
  }
  if (cfg.training.eval_every_steps > 0 && d.validation.empty())
    throw std::invalid_argument("training.eval_every_steps = " + std::to_string(cfg.training.eval_every_steps) +
                                " needs validation data: set data.val_path or data.val_fraction");
}

Data setup_data(const RecipeConfig& cfg, const std::string& base_dir, int64_t ranks) {
  const std::string tokenizer_path = find_tokenizer(cfg, base_dir);
  Data d{train_data_path(cfg), tokenizer_path,
         data::Tokenizer::open(tokenizer_path), {}, {}, {}, cfg.data.packing, nullptr};
  d.options = config::dataset_options(cfg.data, d.tokenizer, &d.template_note);
  d.samples = data::load_dataset(d.path, d.tokenizer, d.options);
  split_validation(cfg, d);
  // Otherwise every step's loss is 0/0 and the run "trains" on nothing.
  const data::DatasetStats stats = data::dataset_stats(d.samples);
  if (stats.trained_tokens == 0)
    throw std::invalid_argument(d.path + ": no sample has a trained token: every response is cut by data.max_seq_len = " +
                                std::to_string(cfg.data.max_seq_len) + " (or empty); raise it (`qlora data` shows the lengths)");
  if (!d.validation.empty() && data::dataset_stats(d.validation).trained_tokens == 0)
    throw std::invalid_argument("validation data (" + (val_data_path(cfg).empty() ? d.path : val_data_path(cfg)) +
                                ") has no trained tokens: every sample's response is cut by data.max_seq_len = " +
                                std::to_string(cfg.data.max_seq_len) + " (or empty)");
  if (!stats.untrained.empty())
    std::printf("warning: %s: %zu of %zu samples have no trained token (cut by data.max_seq_len = %lld, or an empty "
                "response) and train on nothing; `qlora data` lists them\n",
                d.path.c_str(), stats.untrained.size(), d.samples.size(), (long long)cfg.data.max_seq_len);
  if (d.packed) d.rows = data::pack_samples(d.samples, cfg.data.max_seq_len, d.tokenizer.pad_id());
  const int64_t size = static_cast<int64_t>(d.packed ? d.rows.size() : d.samples.size());
  // One global batch per micro-step; each rank trains on its own batch_size rows of it.
  d.sampler = std::make_unique<data::Sampler>(config::sampler_options(cfg.data, cfg.training, size, ranks));
  return d;
}

// The model as the engine holds it: every rank builds the same model (same seed, same adapters)
// and keeps its share of each layer as soon as the layer is loaded, so the whole base never sits
// in one rank's memory (one process keeps all of it, unmoved).
struct Model {
  models::LlamaModel llama;
  std::shared_ptr<engine::ShardedLlama> engine;
};

// On the CPU a model narrower than this gains nothing from a second intra-op thread: its GEMMs and
// elementwise ops last microseconds, and waking a sleeping (passive, engine/launcher.h) OpenMP
// worker for each costs more than it saves. The tiny default, 40 steps on a 2-core EPYC VM: one
// thread 2.45 s alone and 2.42 s beside a busy process; two passive threads 5.0 s alone. A set
// OMP_NUM_THREADS wins.
constexpr int64_t kOneThreadBelowHidden = 512;

void fit_threads_to_model(const models::LlamaConfig& c, c10::Device device) {
  if (device.is_cpu() && c.hidden_size < kOneThreadBelowHidden && !std::getenv("OMP_NUM_THREADS"))
    at::set_num_threads(1);
}

Model setup_model(const RecipeConfig& cfg, const std::string& base_dir, c10::Device device, engine::World& world) {
  Model m{{}, engine::ShardedLlama::begin(world, config::sharding_options(cfg.dist))};
  // LoRA init draws from its own generator (training.seed): the same adapters on every rank.
  models::LlamaLoadOptions mopts = config::llama_load_options(cfg, device, frozen_storage_dtype(base_dir, cfg.model.dtype));
  mopts.on_layer_loaded = [&m](int64_t i, modules::DecoderLayer& L, const models::Architecture& a) {
    m.engine->shard_layer(i, L, a);
  };
  m.llama = models::load_llama(base_dir, mopts);
  fit_threads_to_model(m.llama.config, device);
  m.engine->finish(m.llama);
  io::release_free_cpu_memory();  // the load's temporaries
  m.llama.training = true;
  // Ranks finish loading at their own pace (disk, page cache): wait for the slowest here, so the
  // step collectives' timeout (dist.collective_timeout_s) only has to cover a hung peer.
  world.world().barrier(std::chrono::minutes(30));
  return m;
}

struct Optimizer {
  std::unique_ptr<optim::AdamW> adamw;  // steps this rank's flat shards of the adapters
  optim::LrSchedule schedule;
  int64_t steps_per_epoch = 0;
};

Optimizer setup_optimizer(const RecipeConfig& cfg, const Model& m, const Data& d, int64_t ranks) {
  Optimizer o;
  o.adamw = std::make_unique<optim::AdamW>(m.engine->param_shards(), config::adamw_options(cfg.optim));
  o.steps_per_epoch = d.sampler->batches_per_epoch() / cfg.training.grad_accum;
  if (cfg.training.max_steps_per_epoch > 0) o.steps_per_epoch = std::min(o.steps_per_epoch, cfg.training.max_steps_per_epoch);
  if (o.steps_per_epoch < 1)
    throw std::invalid_argument("data set " + d.path + " has " + std::to_string(d.samples.size()) +
                                " samples: too few for one step of batch_size x ranks x grad_accum = " +
                                std::to_string(cfg.training.batch_size * ranks * cfg.training.grad_accum));
  o.schedule = config::lr_schedule(cfg.optim, o.steps_per_epoch * cfg.training.epochs);
  return o;
}

// Where the loop starts: the beginning, or just after the newest resume checkpoint.
struct Position {
  int64_t epoch = 0, step_in_epoch = 0, global_step = 0;
};

// A fresh run must not mix its checkpoints with an earlier run's (keep_last_n would keep the old,
// higher steps; a later resume would pick them): they are set aside, never deleted.
void set_aside_old_checkpoints(const std::string& out_dir) {
  if (!fs::exists(out_dir + "/checkpoints")) return;
  const std::string aside = out_dir + "/checkpoints.prev-" + std::to_string(std::time(nullptr));
  fs::rename(out_dir + "/checkpoints", aside);
  std::printf("fresh run: the earlier run's resume checkpoints were moved to %s\n", aside.c_str());
}

struct Loaded {
  std::string dir;
  checkpoint::ResumeCheckpoint ck;
};

// The newest resume checkpoint that loads intact. A damaged one (a file's size or checksum wrong,
// a file missing) is skipped, saying which and why, and set aside (<dir>.damaged, by rank 0 once
// every rank is past it) so keep_last_n no longer counts it. None intact: an error saying why each
// failed; none at all: nullopt.
std::optional<Loaded> load_newest_intact(const std::string& out_dir, engine::World& world) {
  const bool lead = world.rank() == 0;
  std::vector<std::string> damaged;
  std::string why;
  std::optional<Loaded> found;
  for (const std::string& dir : checkpoint::resume_checkpoints(out_dir)) {
    try {
      found = Loaded{dir, checkpoint::load_resume_checkpoint(dir)};
      break;
    } catch (const checkpoint::ResumeError& e) {
      if (lead) std::printf("resume: skipping damaged checkpoint %s: %s\n", dir.c_str(), e.what());
      damaged.push_back(dir);
      why += std::string(why.empty() ? "" : "; ") + e.what();
    }
  }
  if (!found && !damaged.empty())
    throw std::invalid_argument("checkpoint.resume = true but no resume checkpoint in " + out_dir + " is intact: " + why);
  if (!damaged.empty()) {
    world.world().barrier(std::chrono::minutes(30));  // nobody still reading them
    if (lead)
      for (const std::string& dir : damaged)
        std::printf("resume: moved %s to %s\n", dir.c_str(), checkpoint::set_aside_damaged(dir).c_str());
    if (lead) std::printf("resume: continuing from %s, the newest intact checkpoint\n", found->dir.c_str());
  }
  return found;
}

// Continues from a resume checkpoint written on any number of ranks (or by the earlier
// single-process format): the adapters and AdamW state resharded onto this mesh, the sampler,
// and the RNG states where the mesh is the same (bit for bit then; within float tolerance else).
Position resume(const RecipeConfig& cfg, const Loaded& loaded, c10::Device device, engine::World& world, Model& m,
                Optimizer& o, Data& d, const nlohmann::json& inputs) {
  const bool lead = world.rank() == 0;
  const std::string& where = loaded.dir;
  const checkpoint::ResumeCheckpoint& ck = loaded.ck;
  const bool remesh = check_resumable(ck.meta, cfg, device, inputs, where, world.size());
  engine::load_train_state(*m.engine, *o.adamw, ck, m.llama, where);
  if (!remesh) {
    const std::map<std::string, at::Tensor> mine(ck.ranks.at(world.rank()).begin(), ck.ranks.at(world.rank()).end());
    const auto rng = [&](const std::string& key) -> const at::Tensor& {
      const auto it = mine.find(key);
      if (it == mine.end()) throw std::invalid_argument("cannot resume " + where + ": it has no " + key + " state");
      return it->second;
    };
    train::set_generator_state(c10::kCPU, rng("rng.cpu"));
    if (device.is_cuda()) train::set_generator_state(device, rng("rng.cuda"));
  } else if (lead) {
    std::printf("resuming a %lld-rank checkpoint on %lld ranks (shard_size %lld): state resharded; the run "
                "continues within float tolerance of the original, not bit for bit\n",
                (long long)ck.meta.value("world_size", int64_t{1}), (long long)world.size(),
                (long long)cfg.dist.shard_size);
  }
  if (ck.legacy_single_process && lead)
    std::printf("%s is in the single-process format of earlier releases: converted on load\n", where.c_str());
  d.sampler->load_state_json(ck.meta.at("sampler").dump(), where);
  const Position p{ck.meta.at("epoch"), ck.meta.at("step_in_epoch"), ck.meta.at("global_step")};
  if (lead)
    std::printf("resumed from %s (epoch %lld, step %lld)\n", where.c_str(), (long long)p.epoch + 1,
                (long long)p.global_step);
  return p;
}

// ---------------------------------------------------------------- the step

struct StepResult {
  double loss = 0.0;
  int64_t tokens = 0;
  double grad_norm = 0.0;
};

// One optimizer step: grad_accum micro-batches, this rank's rows of each global batch, the loss
// normalised by the non-masked tokens of the whole step on every rank (every token weighs the
// same, however the step's tokens fall into micro-batches and ranks), then the gradient norm
// (clipped). The caller steps the optimizer, or not (a non-finite step): every rank sees the same
// summed loss and norm, so every rank decides alike.
StepResult train_step(const RecipeConfig& cfg, engine::World& world, Model& m, Data& d, c10::Device device,
                      int64_t step) {
  const int64_t per_rank = cfg.training.batch_size, me = world.rank();
  std::vector<data::Batch> micro;
  StepResult r;
  for (int64_t k = 0; k < cfg.training.grad_accum; ++k) {
    const std::vector<int64_t> global = d.sampler->next();
    micro.push_back(d.batch({global.begin() + me * per_rank, global.begin() + (me + 1) * per_rank}));
    r.tokens += micro.back().num_label_tokens;
  }
  r.tokens = static_cast<int64_t>(train::all_ranks_sum(world, static_cast<double>(r.tokens), device));
  const auto& poison = train::fault_plan().poison_loss;  // tests only
  const bool nan = poison && poison(world.rank(), step);
  for (size_t k = 0; k < micro.size(); ++k) {
    m.engine->set_gradient_sync(k + 1 == micro.size());
    at::Tensor loss = train::summed_token_loss(m.llama, micro[k], d.packed, device) /
                      static_cast<double>(std::max<int64_t>(r.tokens, 1));
    if (nan) loss = loss * std::numeric_limits<double>::quiet_NaN();
    torch::autograd::backward({loss});
    m.engine->finish_backward();
    r.loss += loss.item<double>();
  }
  r.loss = train::all_ranks_sum(world, r.loss, device);
  r.grad_norm = m.engine->clip_grad_norm(cfg.optim.max_grad_norm);
  return r;
}

// ---------------------------------------------------------------- non-finite steps

enum class Verdict { kUpdate, kSkip, kStop };

// training.on_nonfinite applied to a step: a finite loss and gradient norm update; otherwise
// "skip" drops the update until more than max_consecutive_skips steps in a row were not finite.
Verdict judge_step(const RecipeConfig& cfg, const StepResult& r, int64_t& consecutive_skips) {
  if (std::isfinite(r.loss) && std::isfinite(r.grad_norm)) {
    consecutive_skips = 0;
    return Verdict::kUpdate;
  }
  if (cfg.training.on_nonfinite == train::NonFinitePolicy::kSkip && ++consecutive_skips <= cfg.training.max_consecutive_skips)
    return Verdict::kSkip;
  return Verdict::kStop;
}

// The error a non-finite step stops the run with: the step, what was not finite, and the last good
// checkpoint to go back to (every saved one is finite: the update was never applied).
[[noreturn]] void stop_nonfinite(const RecipeConfig& cfg, const StepResult& r, int64_t step) {
  const auto last = checkpoint::latest_resume_checkpoint(cfg.checkpoint.output_dir);
  char what[160];
  std::snprintf(what, sizeof what, "step %lld: loss %g, gradient norm %g: not finite", (long long)step, r.loss,
                r.grad_norm);
  const bool skipping = cfg.training.on_nonfinite == train::NonFinitePolicy::kSkip;
  throw std::runtime_error(
      std::string(what) +
      (skipping ? " again after " + std::to_string(cfg.training.max_consecutive_skips) +
                      " skipped step(s) in a row (training.max_consecutive_skips)"
                : "") +
      "; stopped before the update, nothing non-finite was saved. Last good checkpoint: " +
      (last ? *last + " (continue from it with checkpoint.resume=true, e.g. with a lower optim.lr" +
                  (skipping ? ")" : ", or training.on_nonfinite=skip to drop such steps)")
            : std::string("none (no checkpoint was saved before this step)")));
}

// Nothing non-finite is ever exported (the step guard keeps adapters finite; this is the check).
void require_finite_adapters(const Model& m, const std::string& what) {
  for (const auto& [name, t] : m.llama.lora_parameters())
    if (!at::isfinite(t).all().item<bool>())
      throw std::runtime_error(what + ": adapter " + name + " holds NaN or inf; not saving it");
}

// ---------------------------------------------------------------- save

// Everything a resumed run needs to continue bit for bit: this rank's flat adapter and AdamW
// shards, its RNG states, the loop position and sampler, the exact config and the input
// fingerprints (so a resume can tell whether the data or base weights changed under paths the
// config check ignores). Every rank writes its part; rank 0 commits once all are durable.
void save_checkpoint(const RecipeConfig& cfg, engine::World& world, const Model& m, const Optimizer& o, const Data& d,
                     const Position& p, c10::Device device, const nlohmann::json& inputs) {
  checkpoint::ResumeState s;
  s.tensors = engine::train_state(*m.engine, *o.adamw);
  s.tensors.push_back({"rng.cpu", train::generator_state(c10::kCPU)});
  if (device.is_cuda()) s.tensors.push_back({"rng.cuda", train::generator_state(device)});
  s.meta = {{"epoch", p.epoch},
            {"step_in_epoch", p.step_in_epoch},
            {"global_step", p.global_step},
            {"sampler", nlohmann::json::parse(d.sampler->state_json())},
            {"config_toml", config::to_toml(cfg)},
            {"config_hash", config::config_hash(cfg, config::HashScope::Exactness)},
            {"device_type", device.is_cuda() ? "cuda" : "cpu"},
            {"world_size", world.size()}};
  s.meta.update(inputs);
  int barriers = 0;
  const checkpoint::RankSync sync{world.rank(), world.size(),
                                  [&] {
                                    if (const auto& f = train::fault_plan().in_save) f(world.rank(), p.global_step, ++barriers);
                                    world.world().barrier();
                                  },
                                  {{"shard_size", world.shard().size()}, {"replicas", world.replica().size()}}};
  checkpoint::save_resume_checkpoint(cfg.checkpoint.output_dir, p.global_step, s, cfg.checkpoint.keep_last_n, sync);
}

void log_step(train::MetricsLog& metrics, train::Progress& progress, const RecipeConfig& cfg, const StepResult& r,
              const Position& p, double lr, double secs, c10::Device device, bool skipped) {
  train::StepMetrics sm;
  sm.skipped = skipped;
  sm.step = p.global_step;
  sm.epoch = p.epoch;
  sm.loss = r.loss;
  sm.lr = lr;
  sm.tokens = r.tokens;
  sm.tokens_per_second = r.tokens / std::max(secs, 1e-9);
  sm.peak_memory_bytes = train::peak_memory_bytes(device);
  sm.grad_norm = r.grad_norm;
  metrics.append(sm);
  progress.update(sm, p.step_in_epoch, cfg.logging.log_every_steps);
}

// Validation loss now (every rank evaluates its share); rank 0 logs it.
void validate(const RecipeConfig& cfg, engine::World& world, Model& m, const Data& d, const Position& p,
              c10::Device device, train::MetricsLog* metrics, train::Progress& progress) {
  const train::Evaluation e =
      train::evaluate(m.llama, world, d.validation, cfg.training.batch_size, d.tokenizer.pad_id(), device);
  if (!metrics) return;
  const train::ValidationMetrics v{p.global_step, p.epoch, e.loss, e.perplexity, e.tokens};
  metrics->append(v);
  progress.validation(v);
}

// checkpoint.gguf: what rank 0 adds to each epoch's export before committing it (the GGUF files and
// their Modelfiles). Checked now, before training, so that no epoch's export fails for the model
// or its tokenizer. The files are named after model.name (a hub id), else the base's directory.
std::function<void(const std::string&)> gguf_files(const RecipeConfig& cfg, const std::string& base_dir) {
  if (cfg.checkpoint.gguf.empty()) return {};
  try {
    gguf::check_convertible(base_dir);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("checkpoint.gguf: ") + e.what());
  }
  std::vector<gguf::GgmlType> types;
  for (const std::string& t : cfg.checkpoint.gguf) types.push_back(gguf::type_from_name(t));
  std::string name = fs::path(cfg.model.name.empty() ? base_dir : cfg.model.name).lexically_normal().filename().string();
  if (name.empty() || name == "." || name == "..") name = "model";
  return [types, name](const std::string& dir) {
    for (const std::string& path : gguf::write_gguf_files(dir, types, name))
      std::printf("  %s (%.1f MB, Modelfile beside it)\n", fs::path(path).filename().c_str(),
                  static_cast<double>(fs::file_size(path)) / 1e6);
  };
}

// The recipe proper, the same on 1..N ranks: rank 0 (`lead`) prints, logs metrics and commits
// checkpoints and exports; every step's collectives go through `world` (none for one process).
int run_recipe(const RecipeConfig& cfg, c10::Device device, engine::World& world) {
  // ---------------------------------------------------------------- setup
  const bool lead = world.rank() == 0;
  const int64_t ranks = world.size();
  const std::string& out_dir = cfg.checkpoint.output_dir;
  fs::create_directories(out_dir);
  // Early steps push tiny values through AdamW's moments and the LoRA path; denormal arithmetic
  // is ~100x slower on x86, and flushing them to zero changes nothing a loss can see.
  at::globalContext().setFlushDenormal(true);
  // The embedded default's model is written once per node (output_dir may not be shared), before anyone reads it.
  if (cfg.model.checkpoint_dir.empty() && world.env().local_rank == 0) train::ensure_tiny_base(base_model_dir(cfg));
  world.world().barrier();
  const std::string base_dir = base_model_dir(cfg);

  Data d = setup_data(cfg, base_dir, ranks);
  const auto add_gguf = gguf_files(cfg, base_dir);
  Model m = setup_model(cfg, base_dir, device, world);
  // Dropout draws from the default generator, seeded apart per rank so masks differ between ranks
  // (LoRA init drew from its own, identical everywhere). Seeds CUDA too, now that it is up.
  at::manual_seed(static_cast<uint64_t>(cfg.training.seed) + static_cast<uint64_t>(world.rank()));
  if (d.tokenizer.vocab_size() > m.llama.config.vocab_size)
    throw std::invalid_argument(d.tokenizer_path + ": the tokenizer has " + std::to_string(d.tokenizer.vocab_size()) +
                                " ids but " + base_dir + "/config.json says vocab_size " +
                                std::to_string(m.llama.config.vocab_size) + " (a tokenizer of another model?)");
  Optimizer o = setup_optimizer(cfg, m, d, ranks);
  const nlohmann::json inputs = checkpoint::input_fingerprints(d.path, base_dir, d.tokenizer_path);
  std::optional<Loaded> latest;
  if (cfg.checkpoint.resume) latest = load_newest_intact(out_dir, world);
  if (lead && !cfg.checkpoint.resume) set_aside_old_checkpoints(out_dir);
  if (cfg.checkpoint.resume && !latest && lead)
    std::printf("checkpoint.resume = true but %s has no resume checkpoint: starting fresh\n", out_dir.c_str());
  const Position start = latest ? resume(cfg, *latest, device, world, m, o, d, inputs) : Position{};
  latest.reset();  // its tensors are in the engine and optimizer now

  std::optional<train::MetricsLog> metrics;
  if (lead) metrics.emplace(out_dir, start.global_step);
  train::Progress progress(cfg.logging.progress);
  // base_model_name_or_path: model.name (a hub id), else the base's absolute path (PEFT would resolve a
  // relative one against the loader's working directory). qlora.json: how `qlora generate` renders prompts.
  const checkpoint::AdapterInfo adapter_info{
      cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, models::peft_targets(m.llama.architecture(), cfg.lora.targets),
      cfg.model.name.empty() ? fs::absolute(base_dir).lexically_normal().string() : cfg.model.name,
      config::prompt_format(d.options)};
  if (lead && !d.template_note.empty()) std::printf("%s\n", d.template_note.c_str());
  if (lead)
    std::printf("model %s on %s x %lld rank(s): %lld layers, %lld trainable LoRA parameters; %zu samples; "
                "%lld steps/epoch x %lld epochs\n",
                base_dir.c_str(), device.str().c_str(), (long long)ranks, (long long)m.llama.config.num_hidden_layers,
                (long long)[&] { int64_t n = 0; for (auto& [k, t] : m.llama.lora_parameters()) n += t.numel(); return n; }(),
                d.samples.size(), (long long)o.steps_per_epoch, (long long)cfg.training.epochs);
  if (lead && m.llama.skipped_weights.tensors > 0)
    std::printf("%s\n", models::skipped_weights_note(m.llama.skipped_weights).c_str());

  // ---------------------------------------------------------------- train
  const train::FaultPlan& faults = train::fault_plan();  // empty unless a test installed one
  train::MetricsLog* lead_metrics = lead ? &*metrics : nullptr;
  int64_t consecutive_skips = 0;
  Position p = start;
  for (; p.epoch < cfg.training.epochs; ++p.epoch, p.step_in_epoch = 0) {
    if (lead) progress.start_epoch(p.epoch, cfg.training.epochs, o.steps_per_epoch, p.step_in_epoch);
    while (p.step_in_epoch < o.steps_per_epoch) {
      const auto t0 = std::chrono::steady_clock::now();
      world.mark_progress(p.global_step + 1);
      if (faults.before_step) faults.before_step(world.rank(), p.global_step + 1);
      const double lr = o.schedule.lr_at(p.global_step);
      o.adamw->set_lr(lr);
      const StepResult r = train_step(cfg, world, m, d, device, p.global_step + 1);
      const Verdict verdict = judge_step(cfg, r, consecutive_skips);  // the same on every rank
      if (verdict == Verdict::kUpdate) o.adamw->step();
      m.engine->gather_params();  // also zeroes the gradients a skipped step leaves
      ++p.global_step, ++p.step_in_epoch;
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (lead) log_step(*metrics, progress, cfg, r, p, lr, secs, device, verdict != Verdict::kUpdate);
      if (verdict == Verdict::kStop) stop_nonfinite(cfg, r, p.global_step);
      if (faults.after_step) faults.after_step(world.rank(), p.global_step);

      const bool epoch_end = p.step_in_epoch == o.steps_per_epoch;
      if (!d.validation.empty() && (epoch_end || (cfg.training.eval_every_steps > 0 &&
                                                  p.global_step % cfg.training.eval_every_steps == 0)))
        validate(cfg, world, m, d, p, device, lead_metrics, progress);
      if (epoch_end) d.sampler->set_state({p.epoch + 1, 0});  // max_steps_per_epoch may cut an epoch short
      // The epoch-end checkpoint is written after the export below: a resume from it must find
      // the epoch's export already on disk.
      if (!epoch_end && cfg.checkpoint.save_every_steps > 0 && p.global_step % cfg.checkpoint.save_every_steps == 0)
        save_checkpoint(cfg, world, m, o, d, p, device, inputs);
    }
    if (lead) progress.end_epoch();

    // ------------------------------------------------------------ save (export for inference)
    // Every rank writes the layers it owns into the same files: the same bytes as one process.
    require_finite_adapters(m, "export of epoch " + std::to_string(p.epoch + 1));
    engine::export_epoch(out_dir, p.epoch, m.llama, *m.engine, world, adapter_info, cfg.checkpoint.adapter_only, base_dir,
                         cfg.checkpoint.merge_from, d.tokenizer_path, add_gguf);
    if (lead) std::printf("epoch %lld exported to %s/epoch_%lld\n", (long long)p.epoch + 1, out_dir.c_str(), (long long)p.epoch);
    save_checkpoint(cfg, world, m, o, d, {p.epoch + 1, 0, p.global_step}, device, inputs);
  }

  // ---------------------------------------------------------------- cleanup
  world.finish();
  if (lead)
    std::printf("done: %lld steps; metrics in %s (qlora plot %s); exports in %s/epoch_*; try\n  qlora generate --checkpoint "
                "%s/epoch_%lld %s\n",
                (long long)p.global_step, metrics->path().c_str(), out_dir.c_str(), out_dir.c_str(), out_dir.c_str(),
                (long long)cfg.training.epochs - 1,
                cfg.data.format == data::DatasetKind::kInstruct ? "--instruction \"...\" [--input \"...\"]"
                : cfg.data.format == data::DatasetKind::kChat   ? "--message \"...\""
                                                                : "--prompt \"...\"");
  // The embedded default shows what it learned: greedy answers of the last export to held-out prompts.
  if (lead && cfg.model.checkpoint_dir.empty() && cfg.data.path.empty() && !cfg.checkpoint.adapter_only && cfg.data.template_) {
    const std::string last = out_dir + "/epoch_" + std::to_string(cfg.training.epochs - 1);
    train::print_heldout(train::score_heldout(last, train::bundled_val_path(), *cfg.data.template_), train::bundled_val_path(), last);
  }
  return 0;
}

}  // namespace

int lora_finetune_main(const std::vector<std::string>& args) {
  RecipeConfig cfg = load_recipe_config(args);
  const engine::RankEnv env = engine::rank_env_from_environment();
  c10::Device device = train::resolve_device(cfg.model.device);
  // Resolved before anything reads it: checkpoints record the dtype the run computed in.
  std::string dtype_note;
  cfg.model.dtype = config::resolve_compute_dtype(cfg.model.dtype, device, kernels::has_native_bf16(), &dtype_note);
  if (env.rank == 0)
    std::printf("compute dtype %s (%s)\n", cfg.model.dtype == at::kBFloat16 ? "bf16" : "fp32", dtype_note.c_str());
  if (env.world_size > 1) {
    // One GPU per rank on a node; on the CPU the node's cores are split between its ranks.
    if (device.is_cuda()) device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
    else at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / env.local_world_size));
  }
  const auto world = engine::World::join(env, cfg.dist.shard_size, std::chrono::seconds(cfg.dist.collective_timeout_s), device);
  try {
    return run_recipe(cfg, device, *world);
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
