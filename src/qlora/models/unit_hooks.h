// The calls an engine gets around each unit of a model's forward and backward (DecoderModel's layers,
// a vision tower's encoder layers), so it can keep a unit's weights elsewhere between its uses.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace qlora::models {

// Calls around each unit of the model, for an engine that keeps weights elsewhere between uses
// (dist's sharded engine gathers a unit's shard group before it runs and frees it after). Units of a
// DecoderModel: kEmbedUnit, the decoder layers 0..L-1, and L = final norm + lm_head (a vision tower's:
// vision::Tower::hooks). Calls come in execution order: forward units ascending; in backward, before_backward(u) when the gradient of u's output
// is complete (u's backward is next) and after_backward(u) when the gradient of u's input is (it
// has run). With activation checkpointing, the replay of layer u inside backward is bracketed by
// before_forward(u, true) / after_forward(u, true).
struct UnitHooks {
  static constexpr int64_t kEmbedUnit = -1;
  virtual ~UnitHooks() = default;
  virtual void before_forward(int64_t unit, bool recompute) = 0;
  virtual void after_forward(int64_t unit, bool recompute) = 0;
  virtual void before_backward(int64_t unit) = 0;
  virtual void after_backward(int64_t unit) = 0;
};

// Registers unit u's backward calls on its output `out` (nothing when it wants no gradient): when
// out's gradient is complete, after_backward(u + 1) (where out feeds unit u + 1) then before_backward(u).
void add_unit_backward_hooks(const at::Tensor& out, UnitHooks* hooks, int64_t u, bool feeds_next);

}  // namespace qlora::models
