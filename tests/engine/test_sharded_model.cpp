// The sharded engine trains exactly like one process: the tiny Llama (NF4 base, LoRA on every
// projection and the output head, fp32) on W = 1..4 ranks and as HSDP 2x2 gives the same per-step
// losses and final adapters as a single process on the same global batch; 4 micro-batches x 1 row
// equal 1 x 4; reduce-scattering every micro-batch equals reduce-scattering the last; activation
// checkpointing changes nothing; a vision tower's trainable group (ShardedDecoder::add_tower) that only
// one rank's micro-batch feeds trains as in one process. Tolerance: fp32 with sums split differently across ranks (partial
// gradient sums, then reduce-scatter) agrees to ~1e-6 relative; AdamW's first steps divide by
// sqrt(v) ~ |g| and so pass relative gradient differences of near-zero gradients (lora_A's, while
// B is still ~0) straight into the update: up to ~1e-2 of lr per step. With lr 1e-3 that is ~1e-5
// after 3 steps; 2e-5 absolute on losses (~5.5) and adapters leaves room for it and catches any
// real mistake (a missing rank's rows, a double-counted gradient, a stale shard move them by the
// size of an update, ~1e-3).
#include "qlora/engine/sharded_export.h"
#include "qlora/engine/sharded_model.h"
#include "qlora/engine/sharded_state.h"
#include "qlora/ops/nf4_ops.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdlib>
#include <map>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <string>
#include <vector>

#include "fork_ranks.h"
#include "qlora/models/decoder.h"
#include "qlora/models/vision/tower.h"
#include "qlora/optim/adamw.h"

using namespace qlora;
using namespace qlora::engine;
using namespace qlora::engine::testing;

namespace {

constexpr int kRows = 12, kSeq = 16, kSteps = 3;
constexpr double kTol = 2e-5;

std::string tiny_llama() {
  const char* d = std::getenv("QLORA_TEST_DATA");
  return std::string(d ? d : "tests/data") + "/tiny_llama";
}

models::DecoderModel load(bool ckpt, const std::function<void(int64_t, modules::DecoderLayer&, const models::Architecture&)>& on_layer = {}) {
  models::DecoderLoadOptions o;
  o.base_in_nf4 = true;
  o.lora_targets = {"q", "k", "v", "o", "gate", "up", "down", "output"};
  o.lora_r = 4;
  o.lora_alpha = 8;
  o.seed = 3;
  o.activation_checkpointing = ckpt;
  o.on_layer_loaded = on_layer;
  models::DecoderModel m = models::load_decoder(tiny_llama(), o);
  m.training = true;
  m.loss_chunk_tokens = 5;
  return m;
}

// Step s's global batch: tokens [kRows, kSeq] and shifted labels with a different number of
// masked prompt tokens per row, so ranks see different token counts.
std::pair<at::Tensor, at::Tensor> batch(int s) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
  const at::Tensor t = at::randint(0, 256, {kRows, kSeq + 1}, gen);
  at::Tensor labels = t.narrow(1, 1, kSeq).clone();
  for (int r = 0; r < kRows; ++r) labels[r].narrow(0, 0, (r * 5 + s) % 11).fill_(-100);
  return {t.narrow(1, 0, kSeq).contiguous(), labels};
}

// The sharded runs score by chunks of 5 tokens (the head's adapter gradients come from one node
// over all chunks, exactly once per backward); the single process from the whole logits.
at::Tensor loss_sum(const models::DecoderModel& m, const at::Tensor& tok, const at::Tensor& lab) {
  return m.loss(tok, lab);
}

// A vision tower in miniature: one adapted linear (its base sharded: the tower's rest) and a trained
// projector, fed a fixed input per step. In the sharded runs only rank 0 runs it (its micro-batch holds
// the images), so the tower's trainable group gets no gradient on the other ranks: their reduce-scatter
// must still pair with rank 0's, and their skip_forward and finish_backward's gathers with rank 0's
// forward and backward.
struct FakeTower : models::vision::Tower {
  modules::LoraLinear lin;
  at::Tensor proj;
  at::Tensor forward(const models::vision::PixelInputs& in) const override {
    enter(-1);
    leave(-1, in.pixel_values);
    enter(0);
    at::Tensor out = at::matmul(modules::lora_linear_forward(lin, in.pixel_values, training), proj);
    leave(0, out);
    return out;
  }
  std::vector<int64_t> tokens_per_image(const models::vision::PixelInputs& in) const override {
    return {in.pixel_values.size(0)};
  }
  std::vector<std::pair<std::string, modules::LoraLinear*>> linears() override { return {{"model.visual.fc", &lin}}; }
  std::vector<std::pair<std::string, at::Tensor*>> projector() override { return {{"model.visual.proj.weight", &proj}}; }
  std::vector<std::pair<std::string, at::Tensor*>> frozen() override { return {}; }
  std::vector<std::string> target_names() const override { return {"fc"}; }
};

std::shared_ptr<models::vision::Tower> fake_tower() {
  auto t = std::make_shared<FakeTower>();
  t->lin = modules::lora_linear_dense(at::randn({6, 5}, at::make_generator<at::CPUGeneratorImpl>(7)));
  models::vision::add_tower_lora(*t, {"fc"}, 2, 4.0, false, 0.0, at::make_generator<at::CPUGeneratorImpl>(8));
  t->proj = at::randn({6, 3}, at::make_generator<at::CPUGeneratorImpl>(9));
  models::vision::train_projector(*t);
  return t;
}

// Step s's tower term of the loss (its "images" are step s's fixed input).
at::Tensor tower_loss(const models::DecoderModel& m, int s) {
  const at::Tensor x = at::randn({4, 5}, at::make_generator<at::CPUGeneratorImpl>(2000 + s));
  return m.tower->forward({x, {}, {}}).pow(2).sum() * 0.01;
}

struct Trace {
  std::vector<double> losses;
  at::Tensor adapters;     // every adapter, flattened, in lora_parameters() order
  at::Tensor eval_logits;  // a no-grad forward of step 0's first rows after training
};

at::Tensor eval_logits(const models::DecoderModel& m) {
  at::NoGradGuard ng;  // generation's path: forward units only, every group released after use
  return m.forward(batch(0).first.narrow(0, 0, 2));
}

std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

at::Tensor flat_adapters(const models::DecoderModel& m) {
  std::vector<at::Tensor> v;
  for (const auto& [name, t] : m.lora_parameters()) v.push_back(t.detach().reshape({-1}));
  return at::cat(v);
}

optim::AdamWOptions adamw() {
  optim::AdamWOptions o;
  o.lr = 1e-3;
  return o;
}

Trace single_process(bool tower) {
  models::DecoderModel m = load(false);
  m.chunked_loss = false;
  if (tower) m.tower = fake_tower();
  std::vector<at::Tensor> params;
  for (const auto& [n, t] : m.lora_parameters()) params.push_back(t);
  optim::AdamW opt(params, adamw());
  Trace tr;
  for (int s = 0; s < kSteps; ++s) {
    const auto [tok, lab] = batch(s);
    const at::Tensor loss =
        loss_sum(m, tok, lab) / (lab != -100).sum().item<double>() + (tower ? tower_loss(m, s) : at::zeros({}));
    torch::autograd::backward({loss});
    tr.losses.push_back(loss.item<double>());
    optim::clip_grad_norm_(params, 1.0);
    opt.step();
    opt.zero_grad();
  }
  tr.adapters = flat_adapters(m);
  tr.eval_logits = eval_logits(m);
  return tr;
}

struct RunSetup {
  int micro = 1;
  bool ckpt = false;
  bool stream = true;  // shard each layer as load_decoder builds it (else shard the loaded model)
  std::string export_dir;  // non-empty: also check the parallel export against one process's
  bool tower = false;      // with a FakeTower whose term only rank 0's first micro-batch has
  ShardingOptions sharding;
};

Trace sharded(World& w, const RunSetup& su) {
  std::shared_ptr<ShardedDecoder> engine;
  models::DecoderModel m;
  if (su.stream) {
    engine = ShardedDecoder::begin(w, su.sharding);
    m = load(su.ckpt, [&](int64_t i, modules::DecoderLayer& L, const models::Architecture& a) { engine->shard_layer(i, L, a); });
    engine->finish(m);
  } else {
    m = load(su.ckpt);
    engine = ShardedDecoder::shard(m, w, su.sharding);
  }
  if (su.tower) {
    m.tower = fake_tower();
    engine->add_tower(*m.tower);
  }
  optim::AdamW opt(engine->param_shards(), adamw());
  const int per_rank = kRows / w.size(), per_micro = per_rank / su.micro;
  Trace tr;
  for (int s = 0; s < kSteps; ++s) {
    const auto [tok, lab] = batch(s);
    const at::Tensor mine_t = tok.narrow(0, w.rank() * per_rank, per_rank);
    const at::Tensor mine_l = lab.narrow(0, w.rank() * per_rank, per_rank);
    at::Tensor tokens = (mine_l != -100).sum().to(at::kDouble).reshape({1});
    wait(w.world().all_reduce_sum(tokens));
    at::Tensor loss_total = at::zeros({1}, at::kDouble);
    for (int k = 0; k < su.micro; ++k) {
      engine->set_gradient_sync(k + 1 == su.micro);
      // The tower runs first, as a recipe's batch images do (its backward then comes last).
      at::Tensor tower_term = at::zeros({});
      if (su.tower && w.rank() == 0 && k == 0) tower_term = tower_loss(m, s);
      else if (su.tower) models::vision::skip_forward(*m.tower);
      at::Tensor loss = loss_sum(m, mine_t.narrow(0, k * per_micro, per_micro),
                                 mine_l.narrow(0, k * per_micro, per_micro)) / tokens.item<double>() + tower_term;
      torch::autograd::backward({loss});
      engine->finish_backward();
      loss_total += loss.detach().to(at::kDouble);
    }
    wait(w.world().all_reduce_sum(loss_total));
    tr.losses.push_back(loss_total.item<double>());
    engine->clip_grad_norm(1.0);
    opt.step();
    engine->gather_params();
  }
  tr.adapters = flat_adapters(m);
  tr.eval_logits = eval_logits(m);
  if (su.tower) {  // the tower's base: 6 x 5 fp32, a shard of it per rank (padded to split evenly)
    const int64_t held = engine->tower_bytes_held(), n = w.shard().size();
    check(n == 1 ? held == 120 : held * n >= 120 && held * n < 120 + 64 * n,
          "the tower's frozen bytes held on a rank: " + std::to_string(held));
    check((n > 1) == (engine->stats().tower_gathers > 0), "the tower's groups gathered where sharded");
  }
  if (su.export_dir.empty()) return tr;
  // The parallel export is byte-identical to one process's export of the same weights.
  const checkpoint::AdapterInfo info{4, 8, 0.0, {}, tiny_llama()};
  const std::string sharded_out = su.export_dir + "/w" + std::to_string(w.size()) + "_sharded";
  const std::string single_out = su.export_dir + "/w" + std::to_string(w.size()) + "_single";
  export_epoch(sharded_out, 0, m, *engine, w, info, false, tiny_llama(), checkpoint::MergeSource::Nf4, "");
  if (w.rank() == 0) {
    models::DecoderModel one = load(false);
    {
      at::NoGradGuard ng;
      const auto mine = m.lora_parameters(), theirs = one.lora_parameters();
      for (size_t k = 0; k < mine.size(); ++k) theirs[k].second.copy_(mine[k].second);
    }
    checkpoint::export_epoch(single_out, 0, one, info, false, tiny_llama(), checkpoint::MergeSource::Nf4, "");
    size_t files = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(single_out + "/epoch_0")) {
      if (!e.is_regular_file()) continue;
      const auto rel = std::filesystem::relative(e.path(), single_out + "/epoch_0");
      check(read_bytes(e.path()) == read_bytes(std::filesystem::path(sharded_out + "/epoch_0") / rel),
            "parallel export's " + rel.string() + " equals one process's");
      ++files;
    }
    check(files >= 4, "the export has the model, config and adapter files");
  }  // twice: the first must have left nothing gathered it relies on
  if (w.size() > 1)
    check(engine->stats().gathers > 0 && engine->stats().reduce_scatters > 0, "the engine gathered and reduce-scattered");
  else  // one rank keeps every group whole: nothing moves
    check(engine->stats().gathers == 0 && engine->stats().reduce_scatters == 0, "one rank gathers nothing");
  return tr;
}

void expect_same_as_single_process(int ranks, int64_t shard_size, const RunSetup& su) {
  const Trace ref = single_process(su.tower);
  const Result res = run_ranks(ranks, shard_size, [&](World& w) {
    at::set_num_threads(1);
    const Trace t = sharded(w, su);
    for (int s = 0; s < kSteps; ++s)
      check(std::abs(t.losses[s] - ref.losses[s]) < kTol,
            "step " + std::to_string(s + 1) + " loss " + std::to_string(t.losses[s]) + " vs single-process " +
                std::to_string(ref.losses[s]));
    const double diff = (t.adapters - ref.adapters).abs().max().item<double>();
    check(diff < kTol, "final adapters differ from single-process by " + std::to_string(diff));
    const double ldiff = (t.eval_logits - ref.eval_logits).abs().max().item<double>();
    check(ldiff < 10 * kTol, "no-grad logits differ from single-process by " + std::to_string(ldiff));
  });
  expect_all_ok(res);
}

}  // namespace

TEST(ShardedDecoder, FullShardingOnOneToFourRanksEqualsOneProcess) {
  for (int w = 1; w <= 4; ++w) expect_same_as_single_process(w, 0, {});
}

TEST(ShardedDecoder, HsdpTwoByTwoEqualsOneProcess) { expect_same_as_single_process(4, 2, {}); }

TEST(ShardedDecoder, ParallelExportIsByteIdenticalToOneProcess) {
  RunSetup su;
  su.export_dir = ::testing::TempDir() + "/sharded_export_" + std::to_string(::getpid());
  for (int w : {2, 3}) expect_same_as_single_process(w, 0, su);
  expect_same_as_single_process(4, 2, su);  // HSDP: one shard group writes
}

TEST(ShardedDecoder, GradientAccumulationFourByOneEqualsOneByFour) {
  RunSetup su;
  su.micro = 4;  // 12 rows / 3 ranks = 4 per rank: 4 micro-batches of 1 row vs 1 of 4
  expect_same_as_single_process(3, 0, su);
  su.sharding.reduce_scatter_every_micro_batch = true;
  expect_same_as_single_process(3, 0, su);
}

TEST(ShardedDecoder, ActivationCheckpointingAndNoPrefetchOrReshardChangeNothing) {
  RunSetup su;
  su.ckpt = true;
  expect_same_as_single_process(3, 0, su);
  su.ckpt = false;
  su.stream = false;
  su.sharding.prefetch = false;
  su.sharding.reshard_after_forward = false;
  expect_same_as_single_process(2, 0, su);
}

TEST(ShardedDecoder, TowerGroupFedByOneRankOnlyEqualsOneProcess) {
  RunSetup su;
  su.tower = true;
  for (int w : {1, 2}) expect_same_as_single_process(w, 0, su);
  su.micro = 2;
  expect_same_as_single_process(3, 0, su);
  su.micro = 1;
  su.sharding.prefetch = false;
  su.sharding.reshard_after_forward = false;
  expect_same_as_single_process(2, 0, su);
}
