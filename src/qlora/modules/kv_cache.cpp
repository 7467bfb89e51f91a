#include "qlora/modules/kv_cache.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

namespace qlora::modules {

void reserve_kv(LayerCache& c, int64_t capacity) {
  if (!c.k.defined() || capacity <= c.k.size(2)) return;
  const auto room = [&](const at::Tensor& t) {
    at::Tensor r = at::empty({t.size(0), t.size(1), capacity, t.size(3)}, t.options());
    r.narrow(2, 0, t.size(2)).copy_(t);
    return r;
  };
  c.k_room = room(c.k);
  c.v_room = room(c.v);
  c.k = c.k_room.narrow(2, 0, c.k.size(2));
  c.v = c.v_room.narrow(2, 0, c.v.size(2));
}

std::pair<at::Tensor, at::Tensor> extend_cache(LayerCache* cache, const at::Tensor& k, const at::Tensor& v) {
  if (!cache) return {k, v};
  if (cache->k.defined()) {
    const int64_t past = cache->k.size(2), s = k.size(2);
    if (cache->k_room.defined() && past + s <= cache->k_room.size(2)) {  // in place, no copy of the past
      cache->k_room.narrow(2, past, s).copy_(k);
      cache->v_room.narrow(2, past, s).copy_(v);
      cache->k = cache->k_room.narrow(2, 0, past + s);
      cache->v = cache->v_room.narrow(2, 0, past + s);
    } else {
      cache->k = at::cat({cache->k, k}, 2);  // [b, kv_heads, past + s, d]
      cache->v = at::cat({cache->v, v}, 2);
      cache->k_room = cache->v_room = at::Tensor();
    }
  } else {
    cache->k = k;
    cache->v = v;
  }
  return {cache->k, cache->v};
}

}  // namespace qlora::modules
