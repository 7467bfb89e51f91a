// One Qwen3.5 decoder layer of each kind, forward + backward as the training step runs it: a Gated
// DeltaNet ("linear_attention") layer and a full-attention layer of Qwen3.5-9B's shape
// (bench/model_shapes.h "qwen3.5-9b": hidden 4096, 16 key / 32 value DeltaNet heads of 128,
// 16 query / 4 KV attention heads of 256, MLP 12288), frozen NF4 base, LoRA r 8 on every projection
// (fp32), batch 1, random weights (bench/random_llama.h), computing in --dtype (default auto: what
// model.dtype = "auto" picks on this CPU; bf16 where its GEMMs are native, as ATen's bf16 GEMM
// without them is a scalar loop). Per --seq: each layer's
// median fwd+bwd over --reps after one warm-up (modules::decoder_layer_forward, then backward of a
// random gradient into the input and the LoRA weights), the time inside its mixer's kernel alone
// (ops::chunk_gated_delta_rule, or modules::causal_attention on that layer's q, k, v shapes), and
// the ratio DeltaNet / attention. Prints one JSON object with the CPU and qlora's ISA.
//
//   build/bench_deltanet_layer [--seqs 512,2048] [--reps 3] [--r 8] [--dtype auto|fp32|bf16]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_dtype.h"
#include "bench/machine.h"
#include "bench/model_shapes.h"
#include "bench/random_llama.h"
#include "bench/timing.h"
#include "kernels/cpu_isa.h"
#include "qlora/io/cpu_memory.h"
#include "qlora/modules/attention.h"
#include "qlora/modules/decoder_layer.h"
#include "qlora/modules/rope.h"
#include "qlora/ops/gated_delta_ops.h"

using nlohmann::json;

namespace {

struct Args {
  std::vector<int64_t> seqs{512, 2048};
  int reps = 3;
  int64_t r = 8;
  std::string dtype = "auto", why;
  at::ScalarType compute = at::kFloat;  // --dtype resolved
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (s == "--seqs") {
      a.seqs.clear();
      std::stringstream list(v);
      for (std::string x; std::getline(list, x, ',');) a.seqs.push_back(std::stoll(x));
    } else if (s == "--reps") {
      a.reps = std::stoi(v);
    } else if (s == "--r") {
      a.r = std::stoll(v);
    } else if (s == "--dtype") {
      a.dtype = v;
    } else {
      throw std::invalid_argument("unknown argument " + s);
    }
  }
  a.compute = qlora::bench::resolve_bench_dtype(a.dtype, &a.why);
  return a;
}

// Layer i's forward + backward on a fresh leaf input; the LoRA weights' gradients are dropped.
double layer_step_s(const qlora::models::DecoderModel& m, int64_t i, const at::Tensor& x, const at::Tensor& dy,
                    const qlora::modules::RopeTables& rope, int reps) {
  const auto& layer = m.layers[static_cast<size_t>(i)];
  const qlora::modules::LayerDims d = m.dims(i);
  return qlora::bench::median_s(
      [&] {
        const at::Tensor h = x.detach().requires_grad_();
        const at::Tensor y = qlora::modules::decoder_layer_forward(layer, d, h, rope, /*training=*/true);
        torch::autograd::backward({y}, {dy});
        for (const at::Tensor& p : layer.trainable()) p.mutable_grad().reset();
      },
      reps, 1);
}

// The mixer's kernel alone, fwd + bwd, on the shapes the layer gives it.
double gated_delta_s(const qlora::models::DecoderConfig& c, int64_t seq, at::ScalarType dtype, int reps) {
  const qlora::modules::GatedDeltaDims& g = c.gated_delta;
  const auto opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn({1, seq, g.num_key_heads, g.key_head_dim}, opt);
  const at::Tensor k = at::randn({1, seq, g.num_key_heads, g.key_head_dim}, opt);
  const at::Tensor v = at::randn({1, seq, g.num_value_heads, g.value_head_dim}, opt);
  const at::Tensor gate = -at::rand({1, seq, g.num_value_heads}) * 2.0;
  const at::Tensor beta = at::rand({1, seq, g.num_value_heads}, opt);
  const at::Tensor d_out = at::randn_like(v);
  return qlora::bench::median_s(
      [&] {
        std::vector<at::Tensor> l;
        for (const at::Tensor& t : {q, k, v, gate, beta}) l.push_back(t.detach().requires_grad_());
        const auto out = qlora::ops::chunk_gated_delta_rule(l[0], l[1], l[2], l[3], l[4], {}, false, true);
        torch::autograd::backward({out.first}, {d_out});
      },
      reps, 1);
}

double attention_s(const qlora::models::DecoderConfig& c, int64_t seq, at::ScalarType dtype, int reps) {
  const auto opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn({1, c.num_attention_heads, seq, c.head_dim}, opt);
  const at::Tensor k = at::randn({1, c.num_key_value_heads, seq, c.head_dim}, opt);
  const at::Tensor v = at::randn({1, c.num_key_value_heads, seq, c.head_dim}, opt);
  const at::Tensor d_out = at::randn_like(q);
  return qlora::bench::median_s(
      [&] {
        std::vector<at::Tensor> l;
        for (const at::Tensor& t : {q, k, v}) l.push_back(t.detach().requires_grad_());
        const at::Tensor o = qlora::modules::causal_attention(l[0], l[1], l[2]);
        torch::autograd::backward({o}, {d_out});
      },
      reps, 1);
}

json measure(const qlora::models::DecoderModel& m, int64_t linear, int64_t full, int64_t seq, const Args& a) {
  const auto opt = at::TensorOptions().dtype(a.compute);
  const at::Tensor x = at::randn({1, seq, m.config.hidden_size}, opt), dy = at::randn_like(x);
  const at::Tensor positions = at::arange(seq, at::TensorOptions().dtype(at::kLong));
  const qlora::modules::RopeTables rope = qlora::modules::rope_tables(
      m.inv_freq, positions, m.compute_dtype, qlora::modules::rope_attention_scaling(m.config.rope()));
  const double deltanet = layer_step_s(m, linear, x, dy, rope, a.reps);
  const double attention = layer_step_s(m, full, x, dy, rope, a.reps);
  const double gd = gated_delta_s(m.config, seq, a.compute, a.reps), attn = attention_s(m.config, seq, a.compute, a.reps);
  return {{"seq", seq},
          {"deltanet_layer_fwd_bwd_s", deltanet},
          {"attention_layer_fwd_bwd_s", attention},
          {"deltanet_over_attention", deltanet / attention},
          {"gated_delta_kernel_fwd_bwd_s", gd},
          {"attention_kernel_fwd_bwd_s", attn}};
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_deltanet_layer: " << e.what() << "\nusage: bench_deltanet_layer [--seqs 512,2048] [--reps 3] [--r 8] [--dtype auto|fp32|bf16]\n";
    return 2;
  }
  qlora::io::tune_cpu_memory();  // as the training programs run
  // Layers 0-2 are Gated DeltaNet and 3 is full attention (Qwen3.5's every-fourth rule).
  qlora::models::DecoderConfig c = qlora::bench::model_shape_config("qwen3.5-9b", 4);
  c.vocab_size = 1024;  // the embedding and head are not timed: no 2 GB of random rows to draw
  const qlora::models::DecoderModel m = qlora::bench::random_model(c, a.r, 2.0 * a.r, false, {}, a.compute);
  int64_t linear = -1, full = -1;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.is_linear(i) ? linear : full) = i;
  json j{{"bench", "qwen35_layer_fwd_bwd"},
         {"machine", {{"cpu", qlora::bench::cpu_model()}, {"load_average", qlora::bench::load_average()},
                      {"qlora_isa", qlora::kernels::isa_name(qlora::kernels::active_isa())}, {"threads", at::get_num_threads()}}},
         {"shape", {{"model", "qwen3.5-9b"}, {"compute", a.dtype}, {"why", a.why}, {"base", "nf4"}, {"lora_r", a.r}, {"batch", 1},
                    {"gated_delta_chunk", qlora::ops::kGatedDeltaChunk}}},
         {"reps", a.reps}};
  for (int64_t seq : a.seqs) j["runs"].push_back(measure(m, linear, full, seq, a));
  j["machine"]["load_average_after"] = qlora::bench::load_average();
  std::cout << j.dump(2) << std::endl;
  return 0;
}
