// The NF4 format: codebook, block layout and sizes. The codebook's one home in the project.
//
// Meaning (equal to torchao's to_nf4, block_size 64, scaler_block_size 256):
//   absmax_b   = max |x| over block b (block_size elements)                       [dtype T]
//   mean       = mean(absmax) over the real blocks (ATen's mean in T)             [T]
//   s_b        = absmax_b - mean                                                  [T]
//   factor_g   = (1 / (2 * max|s| over group g)) * 256  (reciprocal rounded to T) [T]
//   scaler_b   = clamp(round_half_even(s_b * factor_g), -128, 127)               [int8]
//   v          = x / absmax_b                                                     [T]
//   code       = argmin_i |v - codebook_T[i]| (T arithmetic, first index on ties)
//   byte       = code(even element) << 4 | code(odd element)
// Dequantize: deq_b = (scaler_b / factor_g) + mean, out = codebook_T[code] * deq_b, each op
// rounded to T. T is the input dtype (bf16, fp16 or fp32); every op rounds separately (no FMA).
//
// Deviations from torchao, only where torchao refuses or misbehaves:
//   * numel need not divide 64*256: blocks are padded with zeros up to a whole group. Padded
//     blocks get s = 0 (they do not enter the mean or any group's max), so real values quantize
//     exactly as they would without padding.
//   * an all-zero block gets code 7 (codebook value 0.0) for every element, so it dequantizes
//     to exact zeros (torchao divides 0/0 and stores code 0); a group whose s are all zero gets
//     scalers 0 (factor is +inf as torchao computes it, and 0/inf = 0 on dequantize).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

namespace qlora::nf4 {

constexpr int64_t kBlockSize = 64;
constexpr int64_t kScalerBlockSize = 256;
constexpr int kNumCodes = 16;
constexpr uint8_t kZeroCode = 7;  // codebook value 0.0: what padding and all-zero blocks use
constexpr uint8_t kZeroByte = (kZeroCode << 4) | kZeroCode;

// Storage dtypes the format is defined for. Factors and mean are stored in this dtype.
enum class Dtype : uint8_t { F32, BF16, F16 };
const char* dtype_name(Dtype d);
inline int dtype_size(Dtype d) { return d == Dtype::F32 ? 4 : 2; }

// Sizes of one NF4 tensor's buffers (struct of arrays, like torchao):
//   codes   u8  [padded_numel / 2]
//   scalers i8  [n_blocks]
//   factors T   [n_groups]
//   mean    T   []
struct Layout {
  int64_t numel = 0;           // real elements (product of the shape)
  int64_t block_size = kBlockSize;
  int64_t scaler_block_size = kScalerBlockSize;
  int64_t padded_numel = 0;    // whole groups: multiple of block_size * scaler_block_size

  int64_t group_numel() const { return block_size * scaler_block_size; }
  int64_t n_blocks() const { return padded_numel / block_size; }
  int64_t n_real_blocks() const { return (numel + block_size - 1) / block_size; }
  int64_t n_groups() const { return padded_numel / group_numel(); }
  int64_t code_bytes() const { return padded_numel / 2; }
  bool operator==(const Layout& o) const {
    return numel == o.numel && block_size == o.block_size &&
           scaler_block_size == o.scaler_block_size && padded_numel == o.padded_numel;
  }

  // Throws std::invalid_argument for numel < 1, odd or non-positive block sizes.
  static Layout make(int64_t numel, int64_t block_size = kBlockSize,
                     int64_t scaler_block_size = kScalerBlockSize);
};

// Bit casts (order_key, tests). Conversions between float and the storage dtypes are
// quant/nf4_dtype.h's: this header is also compiled into the torch-free CUDA kernels.
inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// The 16 NF4 values in dtype d, as floats (torchao writes them as Python floats and lets
// torch.tensor(..., dtype=d) convert them: double -> float -> d).
const std::array<float, kNumCodes>& codebook(Dtype d);

// Nearest code of v (a value of dtype d in [-1, 1]) exactly as torchao decides it:
// argmin over i of round_to(d, |v - codebook[i]|), the first index winning ties.
uint8_t nearest_code_reference(Dtype d, float v);

// The code is a non-decreasing step function of v, so it is fully described by 15
// thresholds: code(v) = number of k with v >= thresholds[k]. Derived once from
// nearest_code_reference over the dtype's own values (tests check the equivalence).
const std::array<float, kNumCodes - 1>& code_thresholds(Dtype d);

inline uint8_t nearest_code(const float* t, float v) {
  uint8_t c = 0;
  for (int k = 0; k < kNumCodes - 1; ++k) c += v >= t[k];
  return c;
}

}  // namespace qlora::nf4
