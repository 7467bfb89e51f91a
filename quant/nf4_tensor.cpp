#include "quant/nf4_tensor.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "quant/nf4_reference.h"

namespace qlora {

namespace {
std::string quoted(std::string_view name) { return "'" + std::string(name) + "'"; }
}  // namespace

nf4::Dtype nf4_dtype_of(at::ScalarType t, std::string_view name) {
  switch (t) {
    case at::kFloat: return nf4::Dtype::F32;
    case at::kBFloat16: return nf4::Dtype::BF16;
    case at::kHalf: return nf4::Dtype::F16;
    default:
      throw std::invalid_argument("nf4: tensor " + quoted(name) + " has dtype " +
                                  std::string(c10::toString(t)) +
                                  "; expected float32, bfloat16 or float16");
  }
}

at::ScalarType scalar_type_of(nf4::Dtype d) {
  return d == nf4::Dtype::BF16 ? at::kBFloat16 : d == nf4::Dtype::F16 ? at::kHalf : at::kFloat;
}

nf4::Dtype Nf4Tensor::nf4_dtype() const { return nf4_dtype_of(dtype(), "nf4 factors"); }

int64_t Nf4Tensor::nbytes() const {
  return codes.nbytes() + scalers.nbytes() + factors.nbytes() + mean.nbytes();
}

Nf4Tensor Nf4Tensor::to(at::Device device) const {
  Nf4Tensor t = *this;
  t.codes = codes.to(device);
  t.scalers = scalers.to(device);
  t.factors = factors.to(device);
  t.mean = mean.to(device);
  return t;
}

void Nf4Tensor::validate(std::string_view name) const {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("nf4: tensor " + quoted(name) + ": " + what);
  };
  if (!defined() || !scalers.defined() || !factors.defined() || !mean.defined())
    fail("missing buffers");
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) fail("negative dimension in shape");
    n *= s;
  }
  if (n != layout.numel) fail("shape does not match numel " + std::to_string(layout.numel));
  const nf4::Layout expect = nf4::Layout::make(n, layout.block_size, layout.scaler_block_size);
  if (!(expect == layout)) fail("inconsistent padded size");
  auto check = [&](const at::Tensor& t, const char* what, at::ScalarType st, int64_t numel) {
    if (t.scalar_type() != st || t.numel() != numel || !t.is_contiguous() ||
        t.device() != codes.device())
      fail(std::string(what) + " must be a contiguous " + c10::toString(st) + " tensor of " +
           std::to_string(numel) + " elements on " + codes.device().str() + ", got " +
           c10::toString(t.scalar_type()) + " with " + std::to_string(t.numel()));
  };
  nf4_dtype_of(factors.scalar_type(), name);
  check(codes, "codes", at::kByte, layout.code_bytes());
  check(scalers, "scalers", at::kChar, layout.n_blocks());
  check(factors, "factors", factors.scalar_type(), layout.n_groups());
  check(mean, "mean", factors.scalar_type(), 1);
}

Nf4Tensor nf4_empty(const std::vector<int64_t>& shape, at::ScalarType dtype, at::Device device,
                    int64_t block_size, int64_t scaler_block_size) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  Nf4Tensor t;
  t.shape = shape;
  t.layout = nf4::Layout::make(n, block_size, scaler_block_size);
  auto opts = at::TensorOptions().device(device);
  t.codes = at::empty({t.layout.code_bytes()}, opts.dtype(at::kByte));
  t.scalers = at::empty({t.layout.n_blocks()}, opts.dtype(at::kChar));
  t.factors = at::empty({t.layout.n_groups()}, opts.dtype(dtype));
  t.mean = at::empty({}, opts.dtype(dtype));
  return t;
}

void nf4_check_quantizable(const at::Tensor& x, std::string_view name) {
  if (!x.defined()) throw std::invalid_argument("nf4: tensor " + quoted(name) + " is undefined");
  nf4_dtype_of(x.scalar_type(), name);
  if (x.numel() == 0) throw std::invalid_argument("nf4: tensor " + quoted(name) + " is empty");
}

at::Tensor nf4_scaler_mean(const at::Tensor& absmax, const nf4::Layout& layout) {
  return absmax.narrow(0, 0, layout.n_real_blocks()).mean();
}

void nf4_throw_nonfinite(std::string_view name) {
  throw std::invalid_argument("nf4: tensor " + quoted(name) +
                              " contains NaN or Inf; refusing to quantize it");
}

Nf4Tensor nf4_quantize_reference(const at::Tensor& x_in, std::string_view name,
                                 int64_t block_size, int64_t scaler_block_size) {
  nf4_check_quantizable(x_in, name);
  const at::Tensor x = x_in.contiguous().cpu();
  const nf4::Dtype d = nf4_dtype_of(x.scalar_type(), name);
  Nf4Tensor t = nf4_empty(x.sizes().vec(), x.scalar_type(), at::kCPU, block_size,
                          scaler_block_size);
  at::Tensor absmax = at::empty({t.layout.n_blocks()}, x.options());
  if (!nf4::block_absmax_reference(d, x.data_ptr(), t.layout, absmax.data_ptr()))
    nf4_throw_nonfinite(name);
  t.mean.copy_(nf4_scaler_mean(absmax, t.layout));
  const float mean = t.mean.to(at::kFloat).item<float>();
  nf4::double_quantize_reference(d, absmax.data_ptr(), mean, t.layout,
                                 t.scalers.data_ptr<int8_t>(), t.factors.data_ptr());
  nf4::quantize_codes_reference(d, x.data_ptr(), absmax.data_ptr(), t.layout,
                                t.codes.data_ptr<uint8_t>());
  return t;
}

at::Tensor nf4_dequantize_reference(const Nf4Tensor& t_in, at::ScalarType out_dtype) {
  t_in.validate("nf4 dequantize input");
  const Nf4Tensor t = t_in.to(at::kCPU);
  const nf4::Dtype d = t.nf4_dtype();
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(out_dtype));
  const float mean = t.mean.to(at::kFloat).item<float>();
  nf4::dequantize_reference(d, nf4_dtype_of(out_dtype, "dequantize output"),
                            t.codes.data_ptr<uint8_t>(), t.scalers.data_ptr<int8_t>(),
                            t.factors.data_ptr(), mean, t.layout, out.data_ptr());
  return out;
}

}  // namespace qlora
