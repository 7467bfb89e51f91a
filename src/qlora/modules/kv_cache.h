// The KV cache for generation: every layer's state (an attention layer's keys and values, a Gated
// DeltaNet layer's conv window and recurrent state) and the positions seen, with key/value slots
// reserved ahead so that each step's keys are written in place.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace qlora::modules {

// One layer's state for generation: an attention layer's keys/values for every position seen so
// far, or a Gated DeltaNet layer's conv window and recurrent state.
struct LayerCache {
  at::Tensor k, v;  // [batch, kv_heads, past, head_dim]: the first `past` slots of k_room / v_room if defined
  // [batch, kv_heads, capacity, head_dim] or undefined: slots reserved for later tokens (reserve_kv),
  // which extend_cache fills in place instead of concatenating a new cache every step.
  at::Tensor k_room, v_room;
  at::Tensor conv;   // [batch, conv channels, conv_kernel - 1]: the last inputs of the causal conv
  at::Tensor state;  // [batch, value heads, key_head_dim, value_head_dim] fp32
};

// Makes room for `capacity` key/value slots in c (at least its past): later tokens are written in
// place. Anything that replaces c.k / c.v by other tensors must clear k_room / v_room.
void reserve_kv(LayerCache& c, int64_t capacity);

// Every layer's state, and how many positions it has seen.
struct KvCache {
  std::vector<LayerCache> layers;
  int64_t seen = 0;
  int64_t length() const { return seen; }
  void reset() {
    layers.clear();
    seen = 0;
  }
};

// k, v [b, kv_heads, s, d] appended to the layer's cache; returns what attention reads: all of it.
// Without a cache (null), k and v themselves.
std::pair<at::Tensor, at::Tensor> extend_cache(LayerCache* cache, const at::Tensor& k, const at::Tensor& v);

}  // namespace qlora::modules
