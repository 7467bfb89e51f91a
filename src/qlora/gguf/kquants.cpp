#include "qlora/gguf/kquants.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace qlora::gguf {
namespace {

constexpr int kSuper = 256;

// Round to nearest, ties to even, by adding 1.5 * 2^23 and reading the mantissa (ggml's
// nearest_int; outside |v| < 2^22 it gives the same wrapped value ggml does).
int nearest(float v) {
  const float shifted = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, 4);
  return (bits & 0x007fffff) - 0x00400000;
}

uint16_t half_bits(float v) { return c10::Half(v).x; }
float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

void put_u16(uint16_t v, uint8_t* out) { std::memcpy(out, &v, 2); }

// x[0, 32) ~ scale * L - offset with L in [0, nmax], minimising the weighted squared error: the
// first guess spans [min(x, 0), max(x)], then nstep + 1 trial ranges (rmin + rdelta * k + nmax
// steps over it) each refitted by weighted least squares, the best kept (ggml's make_qkx2_quants).
// Returns the scale; *offset is the (non-negative) amount subtracted.
float fit_scale_offset(const float* x, const float* w, int nmax, float rmin, float rdelta, int nstep, uint8_t* L,
                       float* offset) {
  float lo = x[0], hi = x[0], sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < 32; ++i) {
    if (x[i] < lo) lo = x[i];
    if (x[i] > hi) hi = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi == lo) {
    std::fill(L, L + 32, uint8_t{0});
    *offset = -lo;
    return 0.0f;
  }
  float iscale = nmax / (hi - lo), scale = 1 / iscale, best = 0;
  for (int i = 0; i < 32; ++i) {
    L[i] = static_cast<uint8_t>(std::clamp(nearest(iscale * (x[i] - lo)), 0, nmax));
    const float diff = scale * L[i] + lo - x[i];
    best += w[i] * (diff * diff);
  }
  uint8_t trial[32];
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * step + nmax) / (hi - lo);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < 32; ++i) {
      const int l = std::clamp(nearest(iscale * (x[i] - lo)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0)) continue;
    float s = (sum_w * sum_xl - sum_x * sum_l) / det, m = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (m > 0) {
      m = 0;
      s = sum_xl / sum_l2;
    }
    float err = 0;
    for (int i = 0; i < 32; ++i) {
      const float diff = s * trial[i] + m - x[i];
      err += w[i] * (diff * diff);
    }
    if (err < best) {
      std::copy(trial, trial + 32, L);
      best = err;
      scale = s;
      lo = m;
    }
  }
  *offset = -lo;
  return scale;
}

// The 12 bytes of eight 6-bit scales and mins: pairs 0-3 in the low six bits of bytes 0-3 (scales)
// and 4-7 (mins); pairs 4-7 as nibbles in bytes 8-11 with their top two bits in the high bits of
// bytes 0-7.
void pack_scales_mins(const uint8_t* sc, const uint8_t* mn, uint8_t* out) {
  for (int j = 0; j < 4; ++j) {
    out[j] = sc[j];
    out[j + 4] = mn[j];
  }
  for (int j = 4; j < 8; ++j) {
    out[j + 4] = static_cast<uint8_t>((sc[j] & 0xF) | ((mn[j] & 0xF) << 4));
    out[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
    out[j] |= static_cast<uint8_t>((mn[j] >> 4) << 6);
  }
}

void unpack_scale_min(const uint8_t* q, int j, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *mn = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// q4_K and q5_K share everything but the code width and the search range: eight sub-blocks of 32
// fitted as scale * L - offset (weights: the sub-block's RMS plus |x|), the scales and offsets
// quantized to 6 bits against their maxima (the fp16 d and dmin), then every code recomputed from
// the stored scales. Writes d, dmin, the 12 scale bytes to out[0, 16) and the codes to L.
void affine_super_block(const float* x, int nmax, float rmin, int nstep, uint8_t* out, uint8_t* L) {
  float scales[8], offsets[8], w[32], max_scale = 0, max_offset = 0;
  for (int j = 0; j < 8; ++j) {
    const float* s = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += s[l] * s[l];
    const float rms = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = rms + std::fabs(s[l]);
    scales[j] = fit_scale_offset(s, w, nmax, rmin, 0.1f, nstep, L + 32 * j, &offsets[j]);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (offsets[j] > max_offset) max_offset = offsets[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_offset = max_offset > 0 ? 63.f / max_offset : 0.f;
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest(inv_scale * scales[j])));
    mn[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest(inv_offset * offsets[j])));
  }
  const uint16_t d = half_bits(max_scale / 63.f), dmin = half_bits(max_offset / 63.f);
  put_u16(d, out);
  put_u16(dmin, out + 2);
  pack_scales_mins(sc, mn, out + 4);
  for (int j = 0; j < 8; ++j) {
    uint8_t s, m;
    unpack_scale_min(out + 4, j, &s, &m);
    const float dj = half_value(d) * s;
    if (dj == 0) continue;
    const float mj = half_value(dmin) * m;
    for (int l = 0; l < 32; ++l) L[32 * j + l] = static_cast<uint8_t>(std::clamp(nearest((x[32 * j + l] + mj) / dj), 0, nmax));
  }
}

// x[0, 16) ~ scale * (L - 32), L in [0, 63], weights x^2: the scale from the value of largest
// magnitude, then 18 nearby scales tried, each refitted by least squares (ggml's make_qx_quants
// with nmax 32, rmse_type 1).
float fit_symmetric(const float* x, int8_t* L) {
  constexpr int nmax = 32;
  float amax = 0, mx = 0;
  for (int i = 0; i < 16; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      mx = x[i];
    }
  }
  if (amax < 1e-15f) {
    std::fill(L, L + 16, int8_t{0});
    return 0.f;
  }
  const auto sums = [&](float iscale, float* sum_lx, float* sum_l2, bool keep) {
    *sum_lx = *sum_l2 = 0;
    for (int i = 0; i < 16; ++i) {
      const int l = std::clamp(nearest(iscale * x[i]), -nmax, nmax - 1);
      if (keep) L[i] = static_cast<int8_t>(l + nmax);
      const float w = x[i] * x[i];
      *sum_lx += w * x[i] * l;
      *sum_l2 += w * l * l;
    }
  };
  float sum_lx, sum_l2;
  sums(-nmax / mx, &sum_lx, &sum_l2, true);
  float scale = sum_l2 ? sum_lx / sum_l2 : 0.0f, best = scale * sum_lx;
  for (int k = -9; k <= 9; ++k) {
    if (k == 0) continue;
    const float iscale = -(nmax + 0.1f * k) / mx;
    sums(iscale, &sum_lx, &sum_l2, false);
    if (sum_l2 > 0 && sum_lx * sum_lx > best * sum_l2) {
      sums(iscale, &sum_lx, &sum_l2, true);
      scale = sum_lx / sum_l2;
      best = scale * sum_lx;
    }
  }
  return scale;
}

}  // namespace

void encode_q4_k(const float* x, uint8_t* out) {
  uint8_t L[kSuper];
  affine_super_block(x, 15, -1.f, 20, out, L);
  uint8_t* q = out + 16;
  for (int j = 0; j < kSuper; j += 64, q += 32)
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
}

void encode_q5_k(const float* x, uint8_t* out) {
  uint8_t L[kSuper];
  affine_super_block(x, 31, -0.5f, 15, out, L);
  uint8_t* qh = out + 16;
  uint8_t* ql = out + 48;
  std::memset(qh, 0, 32);
  for (int j = 0, bit = 0; j < kSuper; j += 64, bit += 2, ql += 32) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = L[j + l], b = L[j + l + 32];
      qh[l] |= static_cast<uint8_t>(((a >> 4) << bit) | ((b >> 4) << (bit + 1)));
      ql[l] = static_cast<uint8_t>((a & 0xF) | ((b & 0xF) << 4));
    }
  }
}

void encode_q6_k(const float* x, uint8_t* out) {
  int8_t L[kSuper];
  float scales[16], max_scale = 0, max_abs = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = fit_symmetric(x + 16 * j, L + 16 * j);
    if (std::fabs(scales[j]) > max_abs) {
      max_abs = std::fabs(scales[j]);
      max_scale = scales[j];
    }
  }
  std::memset(out, 0, 210);
  if (max_abs < 1e-15f) return;  // all zero, d = +0
  const float iscale = -128.f / max_scale;
  const uint16_t d = half_bits(1 / iscale);
  int8_t* sc = reinterpret_cast<int8_t*>(out + 192);
  for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(std::min(127, nearest(iscale * scales[j])));
  put_u16(d, out + 208);
  for (int j = 0; j < 16; ++j) {
    const float dj = half_value(d) * sc[j];
    if (dj == 0) continue;
    for (int l = 0; l < 16; ++l) L[16 * j + l] = static_cast<int8_t>(std::clamp(nearest(x[16 * j + l] / dj), -32, 31) + 32);
  }
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  for (int j = 0; j < kSuper; j += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      const int a = L[j + l], b = L[j + l + 32], c = L[j + l + 64], e = L[j + l + 96];
      ql[l] = static_cast<uint8_t>((a & 0xF) | ((c & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((b & 0xF) | ((e & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
    }
  }
}

}  // namespace qlora::gguf
