// Runs ops::chunk_gated_delta_rule forward and backward on tensors written by
// tests/conformance/test_gated_delta_transformers.py, for comparison with transformers.
//   gated_delta_tool IN.safetensors OUT.safetensors
// IN: q, k, v, g, beta, d_out, d_final and optionally initial_state; metadata use_qk_l2norm (0|1).
// OUT: out, final_state and the gradients (the vector-Jacobian product with d_out and d_final)
// d_q, d_k, d_v, d_g, d_beta and, with an initial state, d_initial_state.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "qlora/io/safetensors.h"
#include "qlora/ops/gated_delta_ops.h"

using namespace qlora;

namespace {

int run(const std::string& in_path, const std::string& out_path) {
  const auto in = io::SafetensorsFile::open(in_path);
  const auto flag = in.metadata().find("use_qk_l2norm");
  if (flag == in.metadata().end()) throw std::runtime_error(in_path + ": metadata 'use_qk_l2norm' missing");
  std::vector<std::string> names{"q", "k", "v", "g", "beta"};
  if (in.find("initial_state")) names.push_back("initial_state");
  std::vector<at::Tensor> leaves;
  for (const std::string& n : names) leaves.push_back(in.tensor(n).clone().requires_grad_());
  const at::Tensor state0 = leaves.size() > 5 ? leaves[5] : at::Tensor();
  const auto [out, fin] = ops::chunk_gated_delta_rule(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], state0,
                                                      /*output_final_state=*/true, flag->second == "1");
  const auto grads = torch::autograd::grad({out, fin}, leaves, {in.tensor("d_out"), in.tensor("d_final")});
  std::vector<std::pair<std::string, at::Tensor>> result{{"out", out.detach()}, {"final_state", fin.detach()}};
  for (size_t i = 0; i < names.size(); ++i) result.emplace_back("d_" + names[i], grads[i].contiguous());
  io::save_safetensors(out_path, result);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN.safetensors OUT.safetensors\n", argv[0]);
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gated_delta_tool: %s\n", e.what());
    return 1;
  }
}
