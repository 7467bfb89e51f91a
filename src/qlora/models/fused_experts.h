// A MoE layer's fused expert tensors (architecture.h, ExpertsRow) as checkpoints hold them, read into
// qlora's layout (each expert's gate_up [2 * inter, hidden], gate's rows then up's, and down
// [hidden, inter]) and written back: transformers' own ([E, 2 * inter, hidden], [E, hidden, inter]),
// gpt-oss's (transposed, gate_up's columns interleaved), and gpt-oss's Hub form, MXFP4
// (quant/mxfp4.h: <key>_blocks [E, out, in / 32, 16], <key>_scales [E, out, in / 32], out-major,
// gate_up's rows interleaved), decoded an expert at a time.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/io/checkpoint_dir.h"
#include "qlora/models/architecture.h"

namespace qlora::models {

// A fused tensor's shape in the checkpoint: gate_up_proj's ([E, 2 * inter, hidden], gpt-oss's
// [E, hidden, 2 * inter]) or down_proj's ([E, hidden, inter], gpt-oss's [E, inter, hidden]).
std::vector<int64_t> fused_expert_shape(const ExpertsRow& row, bool gate_up, int64_t experts, int64_t hidden,
                                        int64_t inter);
// One expert's matrix of a fused tensor (gate_up or down) from the checkpoint's layout into ours,
// and back (the identity but for gpt-oss's).
at::Tensor expert_from_checkpoint(const ExpertsRow& row, bool gate_up, const at::Tensor& w);
at::Tensor expert_to_checkpoint(const ExpertsRow& row, bool gate_up, const at::Tensor& w);

// One fused tensor of a layer as a checkpoint holds it: mapped, or MXFP4.
struct FusedExperts {
  const ExpertsRow* row = nullptr;
  bool gate_up = false;
  at::Tensor dense;           // fused_expert_shape, the checkpoint's dtype; undefined for MXFP4
  at::Tensor blocks, scales;  // MXFP4
  std::string where;          // "<file>: <key>_blocks", for MXFP4's errors

  bool mxfp4() const { return blocks.defined(); }
  // Expert e's matrix in our layout: a view of the mapped tensor, or its MXFP4 decoded to fp32.
  at::Tensor expert(int64_t e) const;
};

// Whether the checkpoint holds <key> (a fused tensor's key, in the checkpoint's layout) in MXFP4.
bool is_mxfp4(const io::CheckpointDir& ckpt, const ExpertsRow& row, const std::string& key);
// The fused tensor <key> of E experts (hidden H, width I): its shape (or the MXFP4 pair's) checked
// against those, std::invalid_argument naming the file and the key otherwise (or a missing key).
FusedExperts read_fused_experts(const io::CheckpointDir& ckpt, const ExpertsRow& row, bool gate_up,
                                const std::string& key, int64_t E, int64_t H, int64_t I);

}  // namespace qlora::models
