#include "qlora/models/fused_experts.h"

#include <c10/util/StringUtil.h>

#include <stdexcept>

#include "qlora/modules/experts.h"
#include "quant/mxfp4.h"

namespace qlora::models {

std::vector<int64_t> fused_expert_shape(const ExpertsRow& row, bool gate_up, int64_t experts, int64_t hidden,
                                        int64_t inter) {
  const int64_t out = gate_up ? 2 * inter : hidden, in = gate_up ? hidden : inter;
  if (row.transposed_interleaved) return {experts, in, out};
  return {experts, out, in};
}

at::Tensor expert_from_checkpoint(const ExpertsRow& row, bool gate_up, const at::Tensor& w) {
  if (!row.transposed_interleaved) return w;
  return gate_up ? modules::deinterleave_gate_up(w.t(), 0) : w.t();
}

at::Tensor expert_to_checkpoint(const ExpertsRow& row, bool gate_up, const at::Tensor& w) {
  if (!row.transposed_interleaved) return w;
  return (gate_up ? modules::interleave_gate_up(w, 0) : w).t();
}

at::Tensor FusedExperts::expert(int64_t e) const {
  if (!mxfp4()) return expert_from_checkpoint(*row, gate_up, dense[e]);
  const at::Tensor w = mxfp4::dequantize(blocks[e], scales[e], at::kFloat, where);  // [out, in], out-major
  return gate_up && row->transposed_interleaved ? modules::deinterleave_gate_up(w, 0) : w;
}

bool is_mxfp4(const io::CheckpointDir& ckpt, const ExpertsRow& row, const std::string& key) {
  return row.transposed_interleaved && ckpt.contains(key + "_blocks");
}

namespace {

at::Tensor checked(const io::CheckpointDir& ckpt, const std::string& key, const std::vector<int64_t>& shape) {
  if (!ckpt.contains(key)) throw std::invalid_argument(ckpt.path() + ": tensor '" + key + "' is missing");
  at::Tensor t = ckpt.tensor(key);
  if (t.sizes().vec() != shape)
    throw std::invalid_argument(ckpt.file_of(key).path() + ": tensor '" + key + "' has shape " + c10::str(t.sizes()) +
                                ", expected " + c10::str(at::IntArrayRef(shape)) + " from config.json");
  return t;
}

}  // namespace

FusedExperts read_fused_experts(const io::CheckpointDir& ckpt, const ExpertsRow& row, bool gate_up,
                                const std::string& key, int64_t E, int64_t H, int64_t I) {
  FusedExperts f;
  f.row = &row;
  f.gate_up = gate_up;
  if (!is_mxfp4(ckpt, row, key)) {
    f.dense = checked(ckpt, key, fused_expert_shape(row, gate_up, E, H, I));
    return f;
  }
  const int64_t out = gate_up ? 2 * I : H, in = gate_up ? H : I;
  const std::string blocks = key + "_blocks";
  if (in % 32 != 0)
    throw std::invalid_argument(ckpt.file_of(blocks).path() + ": " + blocks + ": MXFP4 needs the input size (" +
                                std::to_string(in) + " from config.json) to be a multiple of 32");
  f.blocks = checked(ckpt, blocks, {E, out, in / 32, 16});
  f.scales = checked(ckpt, key + "_scales", {E, out, in / 32});
  f.where = ckpt.file_of(blocks).path() + ": " + blocks;
  return f;
}

}  // namespace qlora::models
