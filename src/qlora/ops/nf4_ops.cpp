#include "qlora/ops/nf4_ops.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <stdexcept>
#include <string>

#include "kernels/nf4_cpu.h"

#ifdef QLORA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/nf4_cuda.h"
#endif

namespace qlora::ops {

namespace {

#ifdef QLORA_WITH_CUDA
kernels::Nf4Tables tables_of(nf4::Dtype d) {
  kernels::Nf4Tables t{};
  const auto& cb = nf4::codebook(d);
  const auto& th = nf4::code_thresholds(d);
  std::copy(cb.begin(), cb.end(), t.codebook);
  std::copy(th.begin(), th.end(), t.thresholds);
  return t;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("nf4 ") + what + " (CUDA): " + cudaGetErrorString(e));
}

Nf4Tensor quantize_cuda(const at::Tensor& x, std::string_view name, nf4::Dtype d,
                        Nf4Tensor t) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor absmax = at::empty({t.layout.n_blocks()}, x.options());
  at::Tensor bad = at::zeros({1}, x.options().dtype(at::kInt));
  check_cuda(kernels::nf4_block_absmax_cuda(d, x.data_ptr(), t.layout, absmax.data_ptr(),
                                            bad.data_ptr<int>(), stream),
             "block absmax");
  if (bad.item<int>() != 0) nf4_throw_nonfinite(name);
  t.mean.copy_(nf4_scaler_mean(absmax, t.layout));
  check_cuda(kernels::nf4_double_quantize_cuda(d, absmax.data_ptr(), t.mean.data_ptr(), t.layout,
                                               t.scalers.data_ptr<int8_t>(), t.factors.data_ptr(),
                                               stream),
             "double quantize");
  check_cuda(kernels::nf4_quantize_codes_cuda(d, x.data_ptr(), absmax.data_ptr(), t.layout,
                                              tables_of(d), t.codes.data_ptr<uint8_t>(), stream),
             "quantize codes");
  return t;
}
#endif

}  // namespace

bool cuda_available() {
#ifdef QLORA_WITH_CUDA
  return at::hasCUDA() && at::cuda::device_count() > 0;
#else
  return false;
#endif
}

Nf4Tensor nf4_quantize(const at::Tensor& x_in, std::string_view name, int64_t block_size,
                       int64_t scaler_block_size) {
  nf4_check_quantizable(x_in, name);
  const at::Tensor x = x_in.contiguous();
  const nf4::Dtype d = nf4_dtype_of(x.scalar_type(), name);
  Nf4Tensor t = nf4_empty(x.sizes().vec(), x.scalar_type(), x.device(), block_size,
                          scaler_block_size);
  if (x.is_cuda()) {
#ifdef QLORA_WITH_CUDA
    return quantize_cuda(x, name, d, std::move(t));
#else
    throw std::runtime_error("nf4 quantize: tensor '" + std::string(name) +
                             "' is on CUDA but qlora was built without CUDA");
#endif
  }
  if (!x.is_cpu()) throw std::invalid_argument("nf4 quantize: unsupported device " + x.device().str());
  at::Tensor absmax = at::empty({t.layout.n_blocks()}, x.options());
  if (!kernels::nf4_block_absmax_cpu(d, x.data_ptr(), t.layout, absmax.data_ptr()))
    nf4_throw_nonfinite(name);
  t.mean.copy_(nf4_scaler_mean(absmax, t.layout));
  kernels::nf4_double_quantize_cpu(d, absmax.data_ptr(), t.mean.to(at::kFloat).item<float>(),
                                   t.layout, t.scalers.data_ptr<int8_t>(), t.factors.data_ptr());
  kernels::nf4_quantize_codes_cpu(d, x.data_ptr(), absmax.data_ptr(), t.layout,
                                  t.codes.data_ptr<uint8_t>());
  return t;
}

at::Tensor nf4_dequantize(const Nf4Tensor& t, at::ScalarType out_dtype) {
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(out_dtype).device(t.device()));
  nf4_dequantize_out(t, out);
  return out;
}

void nf4_dequantize_out(const Nf4Tensor& t, at::Tensor& out) {
  RECORD_USER_SCOPE("qlora::nf4_dequantize");  // a phase of bench_train_step's profile
  t.validate("nf4 dequantize input");
  const nf4::Dtype d = t.nf4_dtype();
  const nf4::Dtype od = nf4_dtype_of(out.scalar_type(), "nf4 dequantize output");
  if (out.numel() != t.numel() || !out.is_contiguous() || out.device() != t.device())
    throw std::invalid_argument("nf4 dequantize: output must be contiguous with " +
                                std::to_string(t.numel()) + " elements on " + t.device().str());
  if (t.device().is_cuda()) {
#ifdef QLORA_WITH_CUDA
    const c10::cuda::CUDAGuard guard(t.device());
    check_cuda(kernels::nf4_dequantize_cuda(d, od, t.codes.data_ptr<uint8_t>(),
                                            t.scalers.data_ptr<int8_t>(), t.factors.data_ptr(),
                                            t.mean.data_ptr(), t.layout, tables_of(d),
                                            out.data_ptr(), at::cuda::getCurrentCUDAStream()),
               "dequantize");
    return;
#endif
  }
  kernels::nf4_dequantize_cpu(d, od, t.codes.data_ptr<uint8_t>(), t.scalers.data_ptr<int8_t>(),
                              t.factors.data_ptr(), t.mean.to(at::kFloat).item<float>(), t.layout,
                              out.data_ptr());
}

}  // namespace qlora::ops
