// The kernels' float -> bf16/fp16 conversions (kernels/simd.h: Vec's stores, Storage's scalar form
// that the compiler vectorizes) against c10's, the host's one definition, bit for bit on every
// class of float, on every ISA path this machine has (forced with ScopedIsaCap); and the host's
// raw-buffer form (quant/nf4_dtype.h) against c10 on the same values.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/simd.h"
#include "quant/nf4_dtype.h"

namespace qlora {
namespace {

using kernels::CpuIsa;
using nf4::Dtype;

// Float bit patterns of every class, then a sweep across all of them and random ones. The count
// is not a multiple of any vector width, so the last, partial vector (store_part) is covered too.
std::vector<float> interesting_floats() {
  std::vector<uint32_t> bits = {
      0x00000000, 0x80000000,                          // +0, -0
      0x3f800000, 0xbfc00000, 0x40490fdb, 0x3f8ccccd,  // normals: 1, -1.5, pi, 1.1
      0x3f808000, 0xbf808000,                          // ties with an even bf16 below: stay
      0x3f818000, 0xbf818000,                          // ties with an odd one below: round up
      0x3f807fff, 0x3f808001, 0x3f81ffff, 0x3fffffff,  // either side of a tie; carries into the exponent
      0x00000001, 0x00008000, 0x00018000, 0x00400000,  // subnormals (ties among them)
      0x007fffff, 0x807fffff, 0x00800000,              // subnormals that round to the smallest normal; it
      0x7f7f7fff, 0xff7f7fff,                          // the largest that stay finite
      0x7f7f8000, 0x7f7fffff, 0xff7fffff,              // finite, but round to +-inf (odd tie, max finite)
      0x7f800000, 0xff800000,                          // +-inf
      0x7fc00000, 0xffc00000, 0x7fc00001, 0x7fe12345,  // quiet NaNs, signs and payloads
      0x7fffffff, 0xffffffff,                          // NaNs whose rounding would carry into -0 / +0
      0x7f800001, 0xff800001, 0x7f80ffff, 0x7f808000,  // signalling NaNs whose truncation is +-inf
      0x7fbfffff, 0xffbfffff,                          // signalling NaNs, all payload bits
      0x477fe000, 0x477ff000, 0x477fefff, 0x33800000,  // fp16: 65504, 65520 (-> inf), just below; 2^-24
      0x33000000, 0x33000001, 0x387fc000, 0x38800000,  // fp16: 2^-25 (tie to 0), above; subnormal; min normal
  };
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) bits.push_back(static_cast<uint32_t>(u));
  std::mt19937 rng(3);
  for (int i = 0; i < 100003; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) x[i] = nf4::bits_to_float(bits[i]);
  return x;
}

std::string hex(uint32_t u) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", u);
  return s;
}

// Vec<N>::store of float vectors to bf16, compiled for the active ISA.
void vec_store_bf16(const std::vector<float>& x, std::vector<uint16_t>& out) {
  out.assign(x.size(), 0);
  kernels::dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
    using V = kernels::simd::Vec<kernels::lanes<isa()>>;
    V::for_vectors(static_cast<int64_t>(x.size()), [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
      V::store_n(out.data() + i, V::load_n(x.data() + i, w, 0.0f), w);
    });
  });
}

// Storage<D>'s scalar form in a plain loop compiled for the active ISA (where GCC vectorizes it).
template <Dtype D>
void storage_store(const std::vector<float>& x, std::vector<uint16_t>& out, std::vector<float>& rounded) {
  out.assign(x.size(), 0);
  rounded.assign(x.size(), 0.0f);
  kernels::dispatch_isa([&](auto) QLORA_LAMBDA_INLINE {
    using S = kernels::Storage<D>;
    for (size_t i = 0; i < x.size(); ++i) {
      out[i] = S::store(x[i]);
      rounded[i] = S::round(x[i]);
    }
  });
}

class DtypeConversions : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    const CpuIsa isa = GetParam();
    if (isa > kernels::active_isa())
      GTEST_SKIP() << "ISA " << kernels::isa_name(isa) << " not available here (this CPU or QLORA_CPU_ISA gives "
                   << kernels::isa_name(kernels::active_isa()) << ")";
    cap_ = std::make_unique<kernels::ScopedIsaCap>(isa);
    ASSERT_EQ(kernels::active_isa(), isa);
  }
  std::unique_ptr<kernels::ScopedIsaCap> cap_;
};

TEST_P(DtypeConversions, VectorAndScalarStoresEqualC10) {
  const std::vector<float> x = interesting_floats();
  std::vector<uint16_t> vec, scalar;
  std::vector<float> rounded;
  vec_store_bf16(x, vec);
  storage_store<Dtype::BF16>(x, scalar, rounded);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t want = c10::BFloat16(x[i]).x;
    const std::string at = hex(nf4::float_to_bits(x[i]));
    ASSERT_EQ(vec[i], want) << "Vec::store of " << at;
    ASSERT_EQ(scalar[i], want) << "Storage::store of " << at;
    ASSERT_EQ(nf4::float_to_bits(rounded[i]), uint32_t{want} << 16) << "Storage::round of " << at;
    uint16_t host = 0;
    nf4::store_from_float(Dtype::BF16, &host, 0, x[i]);
    ASSERT_EQ(host, want) << "nf4::store_from_float of " << at;
  }
}

TEST_P(DtypeConversions, LoadsWidenEveryBf16AsC10) {
  std::vector<uint16_t> h(0x10000);
  for (uint32_t u = 0; u < 0x10000; ++u) h[u] = static_cast<uint16_t>(u);
  std::vector<float> vec(h.size());
  kernels::dispatch_isa([&](auto isa) QLORA_LAMBDA_INLINE {
    using V = kernels::simd::Vec<kernels::lanes<isa()>>;
    V::for_vectors(static_cast<int64_t>(h.size()), [&](int64_t i, int64_t w) QLORA_LAMBDA_INLINE {
      V::store_n(vec.data() + i, V::load_n(h.data() + i, w, 0.0f), w);
    });
  });
  for (uint32_t u = 0; u < 0x10000; ++u) {
    const uint32_t want = nf4::float_to_bits(static_cast<float>(c10::BFloat16(h[u], c10::BFloat16::from_bits())));
    ASSERT_EQ(nf4::float_to_bits(vec[u]), want) << "Vec::load of " << u;
    ASSERT_EQ(nf4::float_to_bits(kernels::Storage<Dtype::BF16>::load(h[u])), want) << u;
    ASSERT_EQ(nf4::float_to_bits(nf4::load_as_float(Dtype::BF16, h.data(), u)), want) << u;
  }
}

// fp16 is c10::Half's own code, inlined: this holds it to the out-of-line c10 in every ISA's
// compilation (no FMA contraction or reassociation may change its rounding there).
TEST_P(DtypeConversions, Fp16StoresEqualC10) {
  const std::vector<float> x = interesting_floats();
  std::vector<uint16_t> out;
  std::vector<float> rounded;
  storage_store<Dtype::F16>(x, out, rounded);
  for (size_t i = 0; i < x.size(); ++i) {
    const c10::Half want(x[i]);
    const std::string at = hex(nf4::float_to_bits(x[i]));
    ASSERT_EQ(out[i], want.x) << "Storage<F16>::store of " << at;
    ASSERT_EQ(nf4::float_to_bits(rounded[i]), nf4::float_to_bits(static_cast<float>(want))) << at;
    uint16_t host = 0;
    nf4::store_from_float(Dtype::F16, &host, 0, x[i]);
    ASSERT_EQ(host, want.x) << "nf4::store_from_float of " << at;
  }
}

std::string isa_param_name(const ::testing::TestParamInfo<CpuIsa>& info) { return kernels::isa_name(info.param); }
INSTANTIATE_TEST_SUITE_P(All, DtypeConversions,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16),
                         isa_param_name);

}  // namespace
}  // namespace qlora
