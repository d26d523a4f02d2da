// CUDA bias + GeLU epilogue and its derivative (the CUDA kernels of distllm::bias_gelu and
// distllm::bias_gelu_backward, whose ops are registered in distllm/ops/bias_gelu.py; the CPU
// ones are csrc/bias_gelu.cpp). One thread per element with a grid-stride loop; arithmetic
// in float (double for double).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../checks.h"
#include "../gelu.h"
#include "ops.h"

namespace distllm {

template <typename scalar_t, bool kBackward>
__global__ void bias_gelu_kernel(const scalar_t* __restrict__ x,     // (rows, n)
                                 const scalar_t* __restrict__ bias,  // (n,) or nullptr
                                 const scalar_t* __restrict__ grad,  // (rows, n), backward only
                                 scalar_t* __restrict__ out,         // (rows, n)
                                 int64_t total, int64_t n, GeluKind kind) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(blockDim.x) * gridDim.x) {
    acc_t u = static_cast<acc_t>(x[i]);
    if (bias != nullptr) u += static_cast<acc_t>(bias[i % n]);
    if constexpr (kBackward) {
      out[i] = static_cast<scalar_t>(static_cast<acc_t>(grad[i]) * gelu_bwd<acc_t>(u, kind));
    } else {
      out[i] = static_cast<scalar_t>(gelu_fwd<acc_t>(u, kind));
    }
  }
}

template <bool kBackward>
static at::Tensor launch(const at::Tensor* grad_in, const at::Tensor& x_in,
                         const std::optional<at::Tensor>& bias_in, std::string_view approximate) {
  const char* op = kBackward ? "bias_gelu_backward (CUDA)" : "bias_gelu (CUDA)";
  check_bias_gelu_args(op, c10::DeviceType::CUDA, x_in, bias_in, grad_in);
  const GeluKind kind = parse_approximate(approximate);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor grad;
  if (grad_in) grad = grad_in->contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in) bias = bias_in->contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t total = x.numel();
  if (total == 0) return out;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535LL * 8);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_cuda", [&] {
    bias_gelu_kernel<scalar_t, kBackward><<<blocks, threads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), bias ? bias->const_data_ptr<scalar_t>() : nullptr,
        grad_in ? grad.const_data_ptr<scalar_t>() : nullptr, out.mutable_data_ptr<scalar_t>(),
        total, x.size(-1), kind);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor bias_gelu_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                          std::string_view approximate) {
  return launch<false>(nullptr, x, bias, approximate);
}

at::Tensor bias_gelu_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                                   const std::optional<at::Tensor>& bias,
                                   std::string_view approximate) {
  return launch<true>(&grad, x, bias, approximate);
}

}  // namespace distllm
