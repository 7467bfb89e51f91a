// The block encoders without llama.cpp: our own decoders of ggml's layouts (written from its format
// description) give back the input within the type's resolution, on ordinary and edge-case rows.
// Bit-exactness with ggml itself is conformance.gguf_kquants' job.
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "qlora/gguf/ggml_types.h"

namespace qlora::gguf {
namespace {

float half_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
}

void scale_min(const uint8_t* q, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One super-block of q4_K (bits 4) or q5_K (bits 5).
void decode_k45(const uint8_t* b, int bits, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + (bits == 5 ? 48 : 16);
  for (int i = 0; i < 256; ++i) {
    const int chunk = i / 64, l = i % 32, upper = (i % 64) / 32;
    int q = (ql[32 * chunk + l] >> (4 * upper)) & 0xF;
    if (bits == 5) q |= ((qh[l] >> (2 * chunk + upper)) & 1) << 4;
    int sc, mn;
    scale_min(b + 4, i / 32, &sc, &mn);
    y[i] = d * sc * q - dmin * mn;
  }
}

void decode_q6_k(const uint8_t* b, float* y) {
  const float d = half_at(b + 208);
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int i = 0; i < 256; ++i) {
    const int half = i / 128, k = i % 128, quarter = k / 32, l = k % 32;
    const int low = (b[64 * half + l + 32 * (quarter % 2)] >> (4 * (quarter / 2))) & 0xF;
    const int high = (b[128 + 32 * half + l] >> (2 * quarter)) & 3;
    y[i] = d * sc[i / 16] * ((low | (high << 4)) - 32);
  }
}

void decode_q5(const uint8_t* b, bool with_min, float* y) {
  const float d = half_at(b), m = with_min ? half_at(b + 2) : 0.0f;
  uint32_t qh;
  std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
  const uint8_t* qs = b + (with_min ? 8 : 6);
  for (int i = 0; i < 32; ++i) {
    const int q = ((qs[i % 16] >> (4 * (i / 16))) & 0xF) | (((qh >> i) & 1) << 4);
    y[i] = with_min ? d * q + m : d * (q - 16);
  }
}

std::vector<float> round_trip(GgmlType t, const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> bytes(row_bytes(t, n));
  encode_row(t, x.data(), n, bytes.data());
  const GgmlTypeInfo& info = type_info(t);
  std::vector<float> y(x.size());
  for (int64_t b = 0; b < n / info.block; ++b) {
    const uint8_t* p = bytes.data() + b * info.block_bytes;
    float* out = y.data() + b * info.block;
    if (t == GgmlType::Q4_K) decode_k45(p, 4, out);
    if (t == GgmlType::Q5_K) decode_k45(p, 5, out);
    if (t == GgmlType::Q6_K) decode_q6_k(p, out);
    if (t == GgmlType::Q5_0) decode_q5(p, false, out);
    if (t == GgmlType::Q5_1) decode_q5(p, true, out);
  }
  return y;
}

// Largest |error| relative to the row's range: about half a code step of the type, plus the
// 6-bit scales' and fp16's rounding (the k-quants' sub-block scales are themselves quantized).
double tolerance(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: return 0.12;
    case GgmlType::Q5_K: return 0.06;
    case GgmlType::Q6_K: return 0.03;
    default: return 0.04;  // q5_0, q5_1: 32-element blocks, 5 bits
  }
}

constexpr GgmlType kTypes[] = {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q5_1};

void expect_close(GgmlType t, const std::vector<float>& x, const char* what) {
  const std::vector<float> y = round_trip(t, x);
  float lo = 0, hi = 0, err = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    ASSERT_TRUE(std::isfinite(y[i])) << type_info(t).name << " " << what << " element " << i;
    err = std::max(err, std::fabs(y[i] - x[i]));
  }
  EXPECT_LE(err, tolerance(t) * (hi - lo) + 1e-30f) << type_info(t).name << " " << what << ": max error " << err
                                                     << " over a range of " << hi - lo;
}

TEST(GgufKQuants, BlockSizesAndNames) {
  EXPECT_EQ(row_bytes(GgmlType::Q4_K, 512), 288u);
  EXPECT_EQ(row_bytes(GgmlType::Q5_K, 256), 176u);
  EXPECT_EQ(row_bytes(GgmlType::Q6_K, 768), 630u);
  EXPECT_EQ(row_bytes(GgmlType::Q5_0, 64), 44u);
  EXPECT_EQ(row_bytes(GgmlType::Q5_1, 32), 24u);
  EXPECT_THROW(row_bytes(GgmlType::Q4_K, 576), std::invalid_argument);
  EXPECT_EQ(type_from_name("q4_k_m"), GgmlType::Q4_K);
  EXPECT_EQ(type_from_name("Q5_K_M"), GgmlType::Q5_K);
  EXPECT_EQ(type_from_name("q6_k"), GgmlType::Q6_K);
  EXPECT_EQ(type_info(GgmlType::Q4_K).file_type, 15u);
  EXPECT_EQ(type_info(GgmlType::Q5_K).file_type, 17u);
  EXPECT_EQ(type_info(GgmlType::Q6_K).file_type, 18u);
  EXPECT_STREQ(type_info(GgmlType::Q4_K).name, "q4_K");
  try {
    type_from_name("q5_0");  // written inside mixes only
    FAIL() << "q5_0 accepted as a file type";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("q4_k_m, q5_k_m, q6_k"), std::string::npos) << e.what();
  }
}

TEST(GgufKQuants, RandomRowsRoundTrip) {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  for (GgmlType t : kTypes) {
    for (float scale : {1e-3f, 0.02f, 1.0f, 300.0f}) {
      std::vector<float> x(512);
      for (float& v : x) v = scale * normal(gen);
      expect_close(t, x, "normal");
      for (float& v : x) v = std::fabs(v) + scale;  // positive with an offset: the mins at work
      expect_close(t, x, "offset");
    }
  }
}

// Below fp16's range the scales (fp16, as ggml stores them) lose their precision or vanish: the
// format cannot promise the resolution there, only values of the row's own magnitude, never inf/NaN.
TEST(GgufKQuants, MagnitudesBelowHalfRange) {
  std::mt19937 gen(4);
  std::normal_distribution<float> normal;
  for (GgmlType t : kTypes) {
    for (float scale : {1e-6f, 1e-9f, 1e-30f}) {
      std::vector<float> x(256);
      float amax = 0;
      for (float& v : x) amax = std::max(amax, std::fabs(v = scale * normal(gen)));
      const std::vector<float> y = round_trip(t, x);
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_TRUE(std::isfinite(y[i])) << type_info(t).name << " scale " << scale;
        EXPECT_LE(std::fabs(y[i] - x[i]), 4 * amax + 1e-7f) << type_info(t).name << " scale " << scale << " element " << i;
      }
    }
  }
}

TEST(GgufKQuants, EdgeRows) {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  for (GgmlType t : kTypes) {
    const std::vector<float> zeros(256, 0.0f), neg_zeros(256, -0.0f);
    for (const auto* z : {&zeros, &neg_zeros})
      for (float v : round_trip(t, *z)) EXPECT_EQ(v, 0.0f) << type_info(t).name << " zero row";
    expect_close(t, std::vector<float>(256, 0.5f), "constant 0.5");
    expect_close(t, std::vector<float>(256, -3.0f), "constant -3");
    std::vector<float> neg(256), outlier(256), sparse(256);
    for (int i = 0; i < 256; ++i) {
      neg[i] = -std::fabs(normal(gen)) - 0.1f;
      outlier[i] = 0.01f * normal(gen) + (i == 77 ? 40.0f : 0.0f);
      sparse[i] = i / 32 == 2 ? 0.0f : normal(gen);  // one all-zero sub-block
    }
    expect_close(t, neg, "negative only");
    expect_close(t, outlier, "one outlier");
    expect_close(t, sparse, "a zero sub-block");
  }
}

TEST(GgufKQuants, SameBlocksSameBytes) {
  std::mt19937 gen(9);
  std::normal_distribution<float> normal;
  std::vector<float> x(256);
  for (float& v : x) v = normal(gen);
  std::vector<float> twice(x);
  twice.insert(twice.end(), x.begin(), x.end());
  for (GgmlType t : kTypes) {
    std::vector<uint8_t> one(row_bytes(t, 256)), two(row_bytes(t, 512));
    encode_row(t, x.data(), 256, one.data());
    encode_row(t, twice.data(), 512, two.data());
    EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size())) << type_info(t).name;
    EXPECT_EQ(0, std::memcmp(one.data(), two.data() + one.size(), one.size())) << type_info(t).name;
  }
}

}  // namespace
}  // namespace qlora::gguf
