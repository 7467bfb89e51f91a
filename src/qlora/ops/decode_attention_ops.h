// The attention of a decode step through kernels/decode_attention_cpu.h: one query per sequence,
// keys and values read in place from the cache (grouped-query heads not repeated into a copy).
// q [B, H, 1, D], k and v [B, KVH, T, D], fp32 or bf16 on the CPU, unit stride along D, D a
// multiple of 16; allowed: undefined (every key) or bool [B or 1, T]. scale multiplies q.k;
// softcap > 0 caps the scores as cap * tanh(s / cap). Returns [B, H, 1, D] in q's dtype, or an
// undefined tensor where the kernel does not apply (the caller attends as before). No autograd.
#pragma once

#include <ATen/core/Tensor.h>

namespace qlora::ops {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                            double scale, double softcap);

}  // namespace qlora::ops
