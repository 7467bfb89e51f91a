#include "recipes/session.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <algorithm>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>

#include "kernels/cpu_isa.h"
#include "qlora/checkpoint/export.h"
#include "qlora/checkpoint/fingerprint.h"
#include "qlora/checkpoint/resume.h"
#include "qlora/config/builders.h"
#include "qlora/engine/sharded_export.h"
#include "qlora/engine/sharded_state.h"
#include "qlora/gguf/convert.h"
#include "qlora/gguf/mmproj.h"
#include "qlora/gguf/modelfile.h"
#include "qlora/io/checkpoint_dir.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/io/durable_file.h"
#include "qlora/optim/adamw.h"
#include "qlora/optim/schedule.h"
#include "qlora/train/device.h"
#include "qlora/train/evaluate.h"
#include "qlora/train/faults.h"
#include "qlora/train/output_dir.h"
#include "qlora/train/tiny_default.h"
#include "qlora/train/untrained_tokens.h"
#include "recipes/recipe_config.h"

namespace qlora::recipes {

namespace {
namespace fs = std::filesystem;
using config::RecipeConfig;

// Frozen embedding / lm_head storage: under fp32 compute, a bf16 checkpoint's embed_tokens and
// lm_head stay bf16 (widened exactly on use, so the numbers are those of fp32 storage): for a 7B
// model that is 0.5 GB less resident memory for nothing.
at::ScalarType frozen_storage_dtype(const std::string& base_dir, at::ScalarType compute) {
  const auto ckpt = io::CheckpointDir::open(base_dir);
  const std::string key = models::layout_key(models::key_layout_of(ckpt, models::load_decoder_config(base_dir)),
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

// Whether the export's head is its own where the base ties it to the embedding: LoRA on the output
// projection unties it (the merged config then says tie_word_embeddings = false).
bool export_unties_head(const RecipeConfig& cfg, const std::string& base_dir) {
  const auto& t = cfg.lora.targets;
  return std::find(t.begin(), t.end(), "output") != t.end() && models::load_decoder_config(base_dir).tie_word_embeddings;
}

// checkpoint.gguf: what rank 0 adds to each epoch's export before committing it (the GGUF files and
// their Modelfiles). Checked now, before training, for the model the export will be (its head
// untied by LoRA on it), so that no epoch's export is refused for the model or its tokenizer. A file
// that still fails is reported and added to `failed`; the epoch's adapter, merged model and other
// GGUF files are committed all the same, and training goes on. The files are named after the base's
// Hub name (base_model_name), else its directory.
std::function<void(const std::string&)> gguf_files(const RecipeConfig& cfg, const std::string& base_dir,
                                                   std::shared_ptr<std::vector<std::string>> failed, bool lead) {
  if (cfg.checkpoint.gguf.empty()) return {};
  const bool untied = export_unties_head(cfg, base_dir);
  try {
    gguf::check_convertible(base_dir, untied);
    std::string no_mmproj;
    if (gguf::has_mmproj(base_dir, &no_mmproj)) gguf::check_mmproj(base_dir);  // the tower's mmproj beside the model's files
    else if (lead && !no_mmproj.empty()) std::printf("checkpoint.gguf: %s\n", no_mmproj.c_str());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        std::string("checkpoint.gguf: ") + e.what() +
        (untied ? " (the export's head is untied: the base ties it to the embedding and lora.targets has \"output\"; "
                  "leave \"output\" out of lora.targets, or checkpoint.gguf empty)"
                : ""));
  }
  std::vector<gguf::GgmlType> types;
  for (const std::string& t : cfg.checkpoint.gguf) types.push_back(gguf::type_from_name(t));
  const std::string named = base_model_name(cfg);
  std::string name = fs::path(named.empty() ? base_dir : named).lexically_normal().filename().string();
  if (name.empty() || name == "." || name == "..") name = "model";
  return [types, name, failed](const std::string& dir) {
    const std::string epoch = fs::path(dir).stem().string();  // "epoch_0" of "epoch_0.tmp"
    for (const gguf::GgmlType type : types) {
      const std::string option = gguf::type_info(type).option;
      try {
        if (const auto& fault = train::fault_plan().before_gguf) fault(epoch + "/" + name + "-" + option + ".gguf");
        for (const std::string& path : gguf::write_gguf_files(dir, {type}, name))
          std::printf("  %s (%.1f MB%s)\n", fs::path(path).filename().c_str(),
                      static_cast<double>(fs::file_size(path)) / 1e6,
                      path.find("-mmproj-") == std::string::npos ? ", Modelfile beside it" : ": the vision tower");
      } catch (const std::exception& e) {
        failed->push_back(epoch + "'s GGUF " + option + ": " + e.what());
        std::fprintf(stderr, "error: %s's GGUF %s was not written: %s; the epoch's adapter and merged model are "
                     "kept, and training goes on\n", epoch.c_str(), option.c_str(), e.what());
      }
    }
  };
}

// The run's exit status once training is done: 1, naming each export file that was not written, if any.
int report_failed_exports(const std::vector<std::string>& failed, const std::string& out_dir) {
  if (failed.empty()) return 0;
  std::string list;
  for (const std::string& f : failed) list += "\n  " + f;
  std::fprintf(stderr, "qlora run: error: the run finished, but these exports were not written:%s\n(each epoch's "
               "adapter and merged model are in %s/epoch_*; `qlora gguf DIR --type TYPE` converts one)\n",
               list.c_str(), out_dir.c_str());
  return 1;
}

// On the CPU a model narrower than this gains nothing from a second intra-op thread: its GEMMs and
// elementwise ops last microseconds, and waking a sleeping (passive, engine/omp_wait_policy.h) OpenMP
// worker for each costs more than it saves. The tiny default, 40 steps on a 2-core EPYC VM: one
// thread 2.45 s alone and 2.42 s beside a busy process; two passive threads 5.0 s alone. A set
// OMP_NUM_THREADS wins.
constexpr int64_t kOneThreadBelowHidden = 512;

void fit_threads_to_model(const models::DecoderConfig& c, c10::Device device) {
  if (device.is_cpu() && c.hidden_size < kOneThreadBelowHidden && !std::getenv("OMP_NUM_THREADS"))
    at::set_num_threads(1);
}

}  // namespace

TextSetup open_text(const Session& s) {
  const std::string tokenizer_path = find_tokenizer(s.cfg, s.base_dir);
  TextSetup t{train_data_path(s.cfg), tokenizer_path, data::Tokenizer::open(tokenizer_path), {}, {}};
  t.options = config::dataset_options(s.cfg.data, t.tokenizer, &t.template_note);
  return t;
}

Model build_model(const Session& s, const DecoderBuilder& build,
                  const std::function<void(models::DecoderModel&)>& prepare) {
  const RecipeConfig& cfg = s.cfg;
  Model m{{}, engine::ShardedDecoder::begin(s.world, config::sharding_options(cfg.dist))};
  // LoRA init draws from its own generator (training.seed): the same adapters on every rank.
  models::DecoderLoadOptions mopts = config::decoder_load_options(
      cfg, s.device, build ? at::ScalarType::Undefined : frozen_storage_dtype(s.base_dir, cfg.model.dtype));
  mopts.on_layer_loaded = [&m](int64_t i, modules::DecoderLayer& L, const models::Architecture& a) {
    m.engine->shard_layer(i, L, a);
  };
  m.decoder = build ? build(mopts) : models::load_decoder(s.base_dir, mopts);
  fit_threads_to_model(m.decoder.config, s.device);
  if (prepare) prepare(m.decoder);
  m.engine->finish(m.decoder);
  io::release_free_cpu_memory();  // the load's temporaries
  m.decoder.training = true;
  // Ranks finish loading at their own pace (disk, page cache): wait for the slowest here, so the
  // step collectives' timeout (dist.collective_timeout_s) only has to cover a hung peer.
  s.world.world().barrier(std::chrono::minutes(30));
  // Dropout draws from the default generator, seeded apart per rank so masks differ between ranks
  // (LoRA init drew from its own, identical everywhere). Seeds CUDA too, now that it is up.
  at::manual_seed(static_cast<uint64_t>(cfg.training.seed) + static_cast<uint64_t>(s.world.rank()));
  return m;
}

bool trains_vision_tower(const RecipeConfig& cfg) {
  return !cfg.lora.vision_targets.empty() || cfg.lora.train_projector;
}

namespace {
// The key that asks to train the tower, for errors.
std::string vision_key(const RecipeConfig& cfg) {
  return cfg.lora.vision_targets.empty() ? "lora.train_projector" : "lora.vision_targets";
}
}  // namespace

Model setup_model(const Session& s, const TextSetup& text, const std::vector<int64_t>& data_token_ids) {
  // While embed_tokens and lm_head are whole: every rank has the whole data set's ids, so all do the same.
  Model m = build_model(s, {}, [&](models::DecoderModel& d) {
    train::apply_untrained_tokens_policy(d, data_token_ids, text.tokenizer, s.cfg.model.untrained_tokens, s.lead);
  });
  if (text.tokenizer.vocab_size() > m.decoder.config.vocab_size)
    throw std::invalid_argument(text.tokenizer_path + ": the tokenizer has " + std::to_string(text.tokenizer.vocab_size()) +
                                " ids but " + s.base_dir + "/config.json says vocab_size " +
                                std::to_string(m.decoder.config.vocab_size) + " (a tokenizer of another model?)");
  return m;
}

train::BatchImages load_vision_tower(const Session& s, Model& m, const data::DatasetOptions& options,
                                     bool trained_on_images, bool other_images) {
  if (!trained_on_images && !other_images && !trains_vision_tower(s.cfg)) return {};
  const config::LoraConfig& lora = s.cfg.lora;
  if (trains_vision_tower(s.cfg) && !m.decoder.config.multimodal)
    throw std::invalid_argument(vision_key(s.cfg) + ": " + s.base_dir + " is a text-only checkpoint (" + m.decoder.config.model_type +
                                "): it has no vision tower to train (use the Hub's multimodal form)");
  if (trains_vision_tower(s.cfg) && !trained_on_images)
    throw std::invalid_argument(vision_key(s.cfg) + ": the training data holds no images: nothing would train the "
                                "vision tower (unset the key, or train on records with images)");
  models::vision::TowerLoadOptions o;
  o.base_in_nf4 = s.cfg.model.base == config::BaseFormat::NF4;
  o.compute_dtype = m.decoder.compute_dtype;
  o.device = s.device;
  m.decoder.tower = models::vision::load_tower(s.base_dir, o);
  models::vision::Tower& tower = *m.decoder.tower;
  const int64_t adapted = models::vision::add_tower_lora(
      tower, lora.vision_targets, lora.rank, lora.alpha, lora.use_rslora, lora.dropout,
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(s.cfg.training.seed)));
  if (lora.train_projector) models::vision::train_projector(tower);
  m.engine->add_tower(tower);
  if (s.lead)
    std::printf("vision tower: %s's%s, %s; the data's images go through it\n", s.base_dir.c_str(),
                o.base_in_nf4 ? " (encoder linears in NF4)" : "",
                trains_vision_tower(s.cfg) ? ("LoRA on " + std::to_string(adapted) + " of its linears" +
                                              (lora.train_projector ? ", the projector trained" : "")).c_str()
                                           : "frozen");
  if (s.lead)
    std::printf("vision tower: %lld bytes of its frozen weights held on each rank\n",
                static_cast<long long>(m.engine->tower_bytes_held()));
  return train::BatchImages{&options};
}

std::unique_ptr<optim::AdamW> make_adamw(const RecipeConfig& cfg, const Model& m) {
  return std::make_unique<optim::AdamW>(m.engine->param_shards(), config::adamw_options(cfg.optim));
}

void backward_micro_batch(Model& m, const at::Tensor& loss, bool last) {
  m.engine->set_gradient_sync(last);
  torch::autograd::backward({loss});
  m.engine->finish_backward();
}

namespace {

struct Optimizer {
  std::unique_ptr<optim::AdamW> adamw;  // steps this rank's flat shards of the adapters
  optim::LrSchedule schedule;
  int64_t steps_per_epoch = 0;
};

Optimizer setup_optimizer(const RecipeConfig& cfg, const Model& m, const std::string& path, const RecipeParts& d,
                          int64_t ranks) {
  Optimizer o;
  o.adamw = make_adamw(cfg, m);
  o.steps_per_epoch = d.sampler->batches_per_epoch() / cfg.training.grad_accum * d.steps_per_batch;
  if (cfg.training.max_steps_per_epoch > 0) o.steps_per_epoch = std::min(o.steps_per_epoch, cfg.training.max_steps_per_epoch);
  if (o.steps_per_epoch < 1)
    throw std::invalid_argument("data set " + path + " has " + std::to_string(d.records) + " " + d.records_name +
                                ": too few for one step of batch_size x ranks x grad_accum = " +
                                std::to_string(cfg.training.batch_size * ranks * cfg.training.grad_accum));
  o.schedule = config::lr_schedule(cfg.optim, o.steps_per_epoch * cfg.training.epochs);
  return o;
}

// A fresh run must not mix its checkpoints with an earlier run's (keep_last_n would keep the old,
// higher steps; a later resume would pick them): they are set aside, never deleted.
void set_aside_old_checkpoints(const std::string& out_dir) {
  if (!fs::exists(out_dir + "/checkpoints")) return;
  const std::string aside = out_dir + "/checkpoints.prev-" + std::to_string(std::time(nullptr));
  fs::rename(out_dir + "/checkpoints", aside);
  io::fsync_path(out_dir);  // durable, or a power loss could bring them back for a later resume
  std::printf("fresh run: the earlier run's resume checkpoints were moved to %s\n", aside.c_str());
}

struct Loaded {
  std::string dir;
  checkpoint::ResumeCheckpoint ck;
};

// What this rank found in its output_dir: the newest checkpoint at or below `bound` that loads
// intact, the damaged ones it passed (added to `damaged`, never tried again) and the intact ones
// above the bound (`newer`).
std::optional<Loaded> newest_intact_up_to(const std::string& out_dir, int64_t bound, bool lead,
                                          std::vector<std::string>& damaged, std::string& why,
                                          std::vector<std::string>& newer) {
  newer.clear();
  for (const std::string& dir : checkpoint::resume_checkpoints(out_dir)) {
    if (std::find(damaged.begin(), damaged.end(), dir) != damaged.end()) continue;
    try {
      if (checkpoint::resume_checkpoint_step(dir) > bound) {
        newer.push_back(dir);
        continue;
      }
      return Loaded{dir, checkpoint::load_resume_checkpoint(dir)};
    } catch (const checkpoint::ResumeError& e) {
      if (lead) std::printf("resume: skipping damaged checkpoint %s: %s\n", dir.c_str(), e.what());
      damaged.push_back(dir);
      why += std::string(why.empty() ? "" : "; ") + e.what();
    }
  }
  return std::nullopt;
}

// The newest resume checkpoint that loads intact in every rank's output_dir (with node-local
// dirs, a crash between two nodes' commits leaves the newest step on some nodes only: the step
// before it is then the newest whole one, and the lone newer copies are set aside as
// <dir>.superseded). A damaged one (a file's size or checksum wrong, a file missing) is skipped,
// saying which and why, and set aside (<dir>.damaged) so keep_last_n no longer counts it; both by
// the directory's lead once every rank is past them. None intact: an error saying why each
// failed; none at all: nullopt; found by some ranks only: an error naming who. Collective.
std::optional<Loaded> load_newest_intact(const Session& s) {
  engine::World& world = s.world;
  const std::string& out_dir = s.cfg.checkpoint.output_dir;
  const bool lead = world.rank() == 0;
  std::vector<std::string> damaged, newer;
  std::string why;
  std::optional<Loaded> found;
  std::vector<double> steps;
  for (int64_t bound = std::numeric_limits<int64_t>::max();;) {
    if (!found || checkpoint::resume_checkpoint_step(found->dir) > bound)
      found = newest_intact_up_to(out_dir, bound, s.dir_lead(), damaged, why, newer);
    steps = train::every_rank(world, found ? static_cast<double>(checkpoint::resume_checkpoint_step(found->dir)) : -1.0,
                              s.device);
    const double agreed = *std::min_element(steps.begin(), steps.end());
    if (agreed == *std::max_element(steps.begin(), steps.end()) || agreed < 0) break;
    bound = static_cast<int64_t>(agreed);
  }
  // Over every rank: damaged ones, lone newer ones (set aside after a barrier that all must enter).
  const std::vector<double> aside = train::all_ranks_sum(
      world, {static_cast<double>(damaged.size()), static_cast<double>(newer.size())}, s.device);
  std::vector<int> with, without;
  for (int r = 0; r < world.size(); ++r) (steps[static_cast<size_t>(r)] >= 0 ? with : without).push_back(r);
  if (!with.empty() && !without.empty())
    throw std::invalid_argument(
        "checkpoint.resume = true, but no step's resume checkpoint is in every rank's checkpoint.output_dir (" +
        s.dirs.describe() + "): " + train::rank_list(without) + " found none that " + train::rank_list(with) +
        " also hold" + (why.empty() ? "" : " (damaged in " + out_dir + ": " + why + ")") +
        ". Resume on the nodes, with the output dirs, of the run that wrote them (a shared directory's "
        "checkpoint may be copied into each node's), or start a new output_dir");
  if (!found && !damaged.empty())
    throw std::invalid_argument("checkpoint.resume = true but no resume checkpoint in " + out_dir + " is intact: " + why);
  if (!found && aside[0] > 0)
    throw std::invalid_argument("checkpoint.resume = true but another rank's output_dir holds no intact resume "
                                "checkpoint (see its error)");
  if (aside[0] + aside[1] == 0) return found;
  world.world().barrier(std::chrono::minutes(30));  // nobody still reading them
  if (s.dir_lead()) {
    for (const std::string& dir : damaged)
      std::printf("resume: moved %s to %s\n", dir.c_str(), checkpoint::set_aside_damaged(dir).c_str());
    for (const std::string& dir : newer)
      std::printf("resume: %s is not intact in every rank's output_dir (a save interrupted between the nodes' "
                  "commits?): moved to %s\n", dir.c_str(), checkpoint::set_aside(dir, "superseded").c_str());
  }
  if (lead && found) std::printf("resume: continuing from %s, the newest intact checkpoint\n", found->dir.c_str());
  return found;
}

// A checkpoint written with node-local output dirs holds its node's ranks' files only: it resumes
// on the same ranks per directory (then the nodes share their parts); another layout is refused
// on every rank, naming the directory and what to do. Collective.
void check_layout(const Session& s, const Loaded& l) {
  const std::vector<int> here = s.dirs.ranks_with(s.world.rank());
  const auto& ck = l.ck;
  std::string problem;
  if (!ck.ranks_here.empty() && (ck.world_size != s.world.size() || ck.ranks_here != here))
    problem = "cannot resume " + l.dir + ": it holds the resume state of " + train::rank_list(ck.ranks_here) + " of a " +
              std::to_string(ck.world_size) + "-rank run that kept one output_dir per node, and on this " +
              std::to_string(s.world.size()) + "-rank run " + train::rank_list(here) +
              " see that directory. Resume with the nodes, ranks per node (--nproc-per-node) and output dirs "
              "of the run that wrote it, or start a new checkpoint.output_dir";
  // Every rank's copy of the step must be of one kind: all from one shared directory, or all node-local.
  const std::vector<double> sums =
      train::all_ranks_sum(s.world, {problem.empty() ? 0.0 : 1.0, ck.ranks_here.empty() ? 0.0 : 1.0}, s.device);
  if (sums[0] == 0 && (sums[1] == 0 || sums[1] == s.world.size())) return;
  if (problem.empty() && sums[0] == 0)
    problem = "cannot resume " + l.dir + ": at this step some ranks' output dirs hold a checkpoint written with one "
              "shared directory and others one written with node-local directories (copies of different runs?); "
              "put the same run's checkpoints in every node's output_dir, or start a new checkpoint.output_dir";
  throw std::invalid_argument(problem.empty() ? "another rank's output_dir holds a resume checkpoint of another "
                                                "node layout (see its error)"
                                              : problem);
}

// Continues from a resume checkpoint written on any number of ranks (or by the earlier
// single-process format): the adapters and AdamW state resharded onto this mesh, the sampler,
// and the RNG states where the mesh is the same (bit for bit then; within float tolerance else).
Position resume(const RecipeConfig& cfg, const Loaded& loaded, c10::Device device, engine::World& world, Model& m,
                Optimizer& o, RecipeParts& d, const nlohmann::json& inputs) {
  const bool lead = world.rank() == 0;
  const std::string& where = loaded.dir;
  const checkpoint::ResumeCheckpoint& ck = loaded.ck;
  // A checkpoint written before recipes recorded themselves is lora_finetune's.
  const std::string recipe = ck.meta.value("recipe", std::string("lora_finetune"));
  if (recipe != inputs.at("recipe").get<std::string>())
    throw std::invalid_argument("cannot resume " + where + ": it was written by `qlora run " + recipe +
                                "`, not by `qlora run " + inputs.at("recipe").get<std::string>() +
                                "` (start a new checkpoint.output_dir)");
  const bool remesh = check_resumable(ck.meta, cfg, device, inputs, where, world.size());
  engine::load_train_state(*m.engine, *o.adamw, ck, m.decoder, where);
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
  if (d.load_state) d.load_state(ck, remesh, where);
  const Position p{ck.meta.at("epoch"), ck.meta.at("step_in_epoch"), ck.meta.at("global_step")};
  if (lead)
    std::printf("resumed from %s (epoch %lld, step %lld)\n", where.c_str(), (long long)p.epoch + 1,
                (long long)p.global_step);
  return p;
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
  for (const auto& [name, t] : m.decoder.lora_parameters())
    if (!at::isfinite(t).all().item<bool>())
      throw std::runtime_error(what + ": adapter " + name + " holds NaN or inf; not saving it");
}

// ---------------------------------------------------------------- save

// Everything a resumed run needs to continue bit for bit: this rank's flat adapter and AdamW
// shards, its RNG states, the loop position and sampler, the exact config and the input
// fingerprints (so a resume can tell whether the data or base weights changed under paths the
// config check ignores). Every rank writes its part; rank 0 commits once all are durable.
void save_checkpoint(const Session& ses, const Model& m, const Optimizer& o, const RecipeParts& d, const Position& p,
                     const nlohmann::json& inputs) {
  const RecipeConfig& cfg = ses.cfg;
  engine::World& world = ses.world;
  const c10::Device device = ses.device;
  checkpoint::ResumeState s;
  s.tensors = engine::train_state(*m.engine, *o.adamw);
  s.tensors.push_back({"rng.cpu", train::generator_state(c10::kCPU)});
  if (device.is_cuda()) s.tensors.push_back({"rng.cuda", train::generator_state(device)});
  if (d.save_state)
    for (auto& t : d.save_state()) s.tensors.push_back(std::move(t));
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
  checkpoint::RankSync sync;
  sync.rank = world.rank();
  sync.world_size = world.size();
  sync.barrier = [&] {
    if (const auto& f = train::fault_plan().in_save) f(world.rank(), p.global_step, ++barriers);
    world.world().barrier();
  };
  sync.mesh = {{"shard_size", world.shard().size()}, {"replicas", world.replica().size()}};
  if (!ses.dirs.shared()) {  // node-local output dirs: each keeps its own ranks' files, committed by its lead
    sync.lead = ses.dirs.lead_of.at(static_cast<size_t>(world.rank()));
    sync.ranks_here = ses.dirs.ranks_with(world.rank());
  }
  checkpoint::save_resume_checkpoint(cfg.checkpoint.output_dir, p.global_step, s, cfg.checkpoint.keep_last_n, sync);
}

// Router statistics of the step just run (a MoE model's; DecoderModel::router_counts), summed over
// ranks, into r.extra: per MoE layer, its busiest expert's tokens over the mean (1 is perfectly even,
// E is one expert taking them all) and the experts that got no token, so a collapsing router shows.
void add_router_metrics(Model& m, engine::World& world, StepResult& r) {
  if (!m.decoder.router_counts) return;
  at::Tensor& counts = m.decoder.router_counts->counts;
  if (world.size() > 1) engine::wait(world.world().all_reduce_sum(counts));  // on the model's device
  const at::Tensor all = counts.cpu().to(at::kDouble);  // the step's one read-back
  counts.zero_();
  for (int64_t i = 0; i < all.size(0); ++i) {
    if (!m.decoder.config.is_moe(i)) continue;
    const at::Tensor row = all[i];
    const double mean = row.mean().item<double>();
    const std::string layer = "router/layer" + std::to_string(i);
    r.extra[layer + "/max_over_mean"] = mean > 0 ? row.max().item<double>() / mean : 0.0;
    r.extra[layer + "/unused_experts"] = row.eq(0).sum().item<int64_t>();
  }
}

void log_validation(const report::ValidationMetrics& v, report::MetricsLog* metrics, report::Progress& progress) {
  if (!metrics) return;  // not rank 0
  metrics->append(v);
  progress.validation(v);
}

void log_step(report::MetricsLog& metrics, report::Progress& progress, const RecipeConfig& cfg, const StepResult& r,
              const Position& p, double lr, double secs, c10::Device device, bool skipped) {
  report::StepMetrics sm;
  sm.skipped = skipped;
  sm.step = p.global_step;
  sm.epoch = p.epoch;
  sm.loss = r.loss;
  sm.lr = lr;
  sm.tokens = r.tokens;
  sm.tokens_per_second = r.tokens / std::max(secs, 1e-9);
  sm.peak_memory_bytes = train::peak_memory_bytes(device);
  sm.grad_norm = r.grad_norm;
  sm.extra = r.extra;
  metrics.append(sm);
  progress.update(sm, p.step_in_epoch, cfg.logging.log_every_steps);
}

}  // namespace

Position train(const Session& s, Model& m, const TextSetup& text, RecipeParts& parts) {
  const RecipeConfig& cfg = s.cfg;
  engine::World& world = s.world;
  const bool lead = s.lead;
  const std::string& out_dir = cfg.checkpoint.output_dir;
  Optimizer o = setup_optimizer(cfg, m, text.path, parts, world.size());
  nlohmann::json inputs = checkpoint::input_fingerprints(text.path, s.base_dir, text.tokenizer_path);
  inputs["recipe"] = s.recipe;
  std::optional<Loaded> latest;
  if (cfg.checkpoint.resume) latest = load_newest_intact(s);
  if (latest) {
    check_layout(s, *latest);
    engine::share_rank_states(world, latest->ck, s.device);
  }
  if (s.dir_lead() && !cfg.checkpoint.resume) set_aside_old_checkpoints(out_dir);
  if (cfg.checkpoint.resume && !latest && lead)
    std::printf("checkpoint.resume = true but %s has no resume checkpoint: starting fresh\n", out_dir.c_str());
  const Position start = latest ? resume(cfg, *latest, s.device, world, m, o, parts, inputs) : Position{};
  latest.reset();  // its tensors are in the engine and optimizer now

  std::optional<report::MetricsLog> metrics;
  if (lead) metrics.emplace(out_dir, start.global_step, cfg.logging.tensorboard);
  report::Progress progress(cfg.logging.progress);
  // base_model_name_or_path: the base's Hub name (base_model_name), else its absolute path (PEFT would resolve a
  // relative one against the loader's working directory). qlora.json: how `qlora generate` renders prompts.
  const std::string base_name = base_model_name(cfg);
  const checkpoint::AdapterInfo adapter_info{
      cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, models::peft_targets(m.decoder.architecture(), cfg.lora.targets),
      base_name.empty() ? fs::absolute(s.base_dir).lexically_normal().string() : base_name,
      config::prompt_format(text.options), {}, cfg.lora.use_rslora, {}, {}};  // token rows: export_epoch
  if (lead && !text.template_note.empty()) std::printf("%s\n", text.template_note.c_str());
  if (lead)
    std::printf("model %s on %s x %lld rank(s): %lld layers, %lld trainable LoRA parameters; %lld %s; "
                "%lld steps/epoch x %lld epochs\n",
                s.base_dir.c_str(), s.device.str().c_str(), (long long)world.size(),
                (long long)m.decoder.config.num_hidden_layers,
                (long long)[&] { int64_t n = 0; for (auto& [k, t] : m.decoder.lora_parameters()) n += t.numel(); return n; }(),
                (long long)parts.records, parts.records_name.c_str(), (long long)o.steps_per_epoch,
                (long long)cfg.training.epochs);
  if (lead && m.decoder.skipped_weights.tensors > 0)
    std::printf("%s\n", models::skipped_weights_note(m.decoder.skipped_weights).c_str());

  const train::FaultPlan& faults = train::fault_plan();  // empty unless a test installed one
  report::MetricsLog* lead_metrics = lead ? &*metrics : nullptr;
  const models::DecoderConfig& dc = m.decoder.config;
  if (!dc.moe_layers.empty())
    m.decoder.router_counts = std::make_shared<models::DecoderModel::RouterCounts>(models::DecoderModel::RouterCounts{
        at::zeros({dc.num_hidden_layers, dc.moe.num_experts},
                  at::TensorOptions(at::kLong).device(m.decoder.embed_tokens.device())), {}});
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
      StepResult r = parts.step(p.global_step + 1);
      add_router_metrics(m, world, r);
      r.grad_norm = m.engine->clip_grad_norm(cfg.optim.max_grad_norm);
      const Verdict verdict = judge_step(cfg, r, consecutive_skips);  // the same on every rank
      if (verdict == Verdict::kUpdate) o.adamw->step();
      m.engine->gather_params();  // also zeroes the gradients a skipped step leaves
      ++p.global_step, ++p.step_in_epoch;
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (lead) log_step(*metrics, progress, cfg, r, p, lr, secs, s.device, verdict != Verdict::kUpdate);
      if (verdict == Verdict::kStop) stop_nonfinite(cfg, r, p.global_step);
      if (faults.after_step) faults.after_step(world.rank(), p.global_step);

      const bool epoch_end = p.step_in_epoch == o.steps_per_epoch;
      if (parts.validate && (epoch_end || (cfg.training.eval_every_steps > 0 &&
                                           p.global_step % cfg.training.eval_every_steps == 0)))
        log_validation(parts.validate(p), lead_metrics, progress);
      if (epoch_end) parts.sampler->set_state({p.epoch + 1, 0});  // max_steps_per_epoch may cut an epoch short
      // The epoch-end checkpoint is written after the export below: a resume from it must find
      // the epoch's export already on disk.
      if (!epoch_end && cfg.checkpoint.save_every_steps > 0 && p.global_step % cfg.checkpoint.save_every_steps == 0)
        save_checkpoint(s, m, o, parts, p, inputs);
    }
    if (lead) progress.end_epoch();

    // Every rank writes the layers it owns into the same files: the same bytes as one process.
    require_finite_adapters(m, "export of epoch " + std::to_string(p.epoch + 1));
    engine::export_epoch(out_dir, p.epoch, m.decoder, *m.engine, world, adapter_info, cfg.checkpoint.adapter_only,
                         s.base_dir, cfg.checkpoint.merge_from, text.tokenizer_path, s.add_gguf,
                         s.dirs.shared() ? std::vector<bool>{} : s.dirs.sees_dir_of(0));
    if (lead) std::printf("epoch %lld exported to %s/epoch_%lld\n", (long long)p.epoch + 1, out_dir.c_str(), (long long)p.epoch);
    save_checkpoint(s, m, o, parts, {p.epoch + 1, 0, p.global_step}, inputs);
  }
  world.finish();
  return p;
}

void print_done(const Session& s, const Position& p, const std::string& what) {
  if (!s.lead) return;
  const std::string& out = s.cfg.checkpoint.output_dir;
  std::printf("done: %lld steps of %s; metrics in %s/metrics.jsonl (qlora plot %s); exports in %s/epoch_*; try\n"
              "  qlora generate --checkpoint %s/epoch_%lld --message \"...\"\n",
              (long long)p.global_step, what.c_str(), out.c_str(), out.c_str(), out.c_str(), out.c_str(),
              (long long)s.cfg.training.epochs - 1);
}

int run_recipe(const std::string& name, const ConfigArgs& args, const std::function<int(Session&)>& body) {
  RecipeConfig cfg = load_recipe_config(args);
  const engine::RankEnv env = engine::rank_env_from_environment();
  c10::Device device = train::resolve_device(cfg.model.device);
  // Resolved before anything reads it: checkpoints record the dtype the run computed in.
  std::string dtype_note;
  cfg.model.dtype = config::resolve_compute_dtype(cfg.model.dtype, device, kernels::bf16_gemms_fast(), &dtype_note);
  if (env.rank == 0)
    std::printf("compute dtype %s (%s)\n", cfg.model.dtype == at::kBFloat16 ? "bf16" : "fp32", dtype_note.c_str());
  if (env.world_size > 1) {
    // One GPU per rank on a node; on the CPU the node's cores are split between its ranks.
    if (device.is_cuda()) device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
    else at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / env.local_world_size));
  }
  const auto world = engine::World::join(env, cfg.dist.shard_size, std::chrono::seconds(cfg.dist.collective_timeout_s), device);
  try {
    fs::create_directories(cfg.checkpoint.output_dir);
    // Early steps push tiny values through AdamW's moments and the LoRA path; denormal arithmetic
    // is ~100x slower on x86, and flushing them to zero changes nothing a loss can see.
    at::globalContext().setFlushDenormal(true);
    // One filesystem for every rank, or one per node (a node-local scratch disk): then each keeps
    // its own ranks' resume checkpoints, and the exports are written into rank 0's.
    train::OutputDirs dirs = train::find_output_dirs(*world, cfg.checkpoint.output_dir, device);
    if (world->rank() == 0 && !dirs.shared())
      std::printf("checkpoint.output_dir %s is not one filesystem for every rank (%s): each keeps its own ranks' "
                  "resume checkpoints; exports, metrics and TensorBoard files are written into rank 0's\n",
                  cfg.checkpoint.output_dir.c_str(), dirs.describe().c_str());
    // The embedded default's model: one writer per output_dir (its lead), before anyone reads it.
    if (cfg.model.checkpoint_dir.empty() && dirs.leads(world->rank())) train::ensure_tiny_base(base_model_dir(cfg));
    world->world().barrier();
    Session s{name, cfg, device, *world, world->rank() == 0, base_model_dir(cfg), {}, std::move(dirs)};
    auto failed_exports = std::make_shared<std::vector<std::string>>();
    s.add_gguf = gguf_files(cfg, s.base_dir, failed_exports, s.lead);
    const int rc = body(s);
    return rc == 0 ? report_failed_exports(*failed_exports, cfg.checkpoint.output_dir) : rc;
  } catch (const std::exception& e) {
    try {
      world->rethrow_with_culprits(e, name);
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
