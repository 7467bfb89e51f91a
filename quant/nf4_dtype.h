// Float <-> the NF4 storage dtypes on the host, one element at a time: c10::BFloat16's and
// c10::Half's conversions (round to nearest even; a NaN becomes a quiet NaN: 0x7fc0 for bf16,
// sign | 0x7e00 for fp16), the project's one definition of them. torchao rounds through the same
// c10 code, which is what keeps NF4 bytes identical to its. The CPU kernels' vectors round alike
// (kernels/simd.h). Apart from nf4_format.h, which the torch-free CUDA kernels include.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "quant/nf4_format.h"

namespace qlora::nf4 {

// Round a float to the nearest value representable in d (identity for F32).
inline float round_to(Dtype d, float f) {
  switch (d) {
    case Dtype::BF16: return static_cast<float>(c10::BFloat16(f));
    case Dtype::F16: return static_cast<float>(c10::Half(f));
    default: return f;
  }
}
// Read element i of a raw buffer of dtype d as float.
inline float load_as_float(Dtype d, const void* p, int64_t i) {
  switch (d) {
    case Dtype::BF16:
      return static_cast<float>(c10::BFloat16(static_cast<const uint16_t*>(p)[i], c10::BFloat16::from_bits()));
    case Dtype::F16:
      return static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[i], c10::Half::from_bits()));
    default: return static_cast<const float*>(p)[i];
  }
}
// Store float f as element i of a raw buffer of dtype d, rounded to d.
inline void store_from_float(Dtype d, void* p, int64_t i, float f) {
  switch (d) {
    case Dtype::BF16: static_cast<uint16_t*>(p)[i] = c10::BFloat16(f).x; break;
    case Dtype::F16: static_cast<uint16_t*>(p)[i] = c10::Half(f).x; break;
    default: static_cast<float*>(p)[i] = f;
  }
}

}  // namespace qlora::nf4
