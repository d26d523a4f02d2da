// CPU bias + GeLU epilogue and its derivative (the kernels of distllm::bias_gelu and
// distllm::bias_gelu_backward, whose ops are registered in distllm/ops/bias_gelu.py):
//   bias_gelu_cpu(x, bias?, approximate)                -> gelu(x + bias)
//   bias_gelu_backward_cpu(grad, x, bias?, approximate) -> grad * gelu'(x + bias)
// x is (..., N) and bias (N,); the pre-activation x + bias is never materialised.
// One pass over memory, OpenMP over rows (at::parallel_for), vectorisable inner loop.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "checks.h"
#include "gelu.h"
#include "ops.h"

namespace distllm {

namespace {

// kBackward=false: out = gelu(x + b); kBackward=true: out = g * gelu'(x + b).
template <typename scalar_t, bool kBackward>
void run_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor* grad,
             at::Tensor& out, GeluKind kind) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const scalar_t* xp = x.const_data_ptr<scalar_t>();          // (rows, n) contiguous
  const scalar_t* bp = bias ? bias->const_data_ptr<scalar_t>() : nullptr;  // (n,) or null
  const scalar_t* gp = grad ? grad->const_data_ptr<scalar_t>() : nullptr;  // (rows, n)
  scalar_t* op = out.mutable_data_ptr<scalar_t>();              // (rows, n)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t off = r * n;
      for (int64_t j = 0; j < n; ++j) {
        acc_t u = static_cast<acc_t>(xp[off + j]);
        if (bp) u += static_cast<acc_t>(bp[j]);
        if constexpr (kBackward) {
          op[off + j] = static_cast<scalar_t>(static_cast<acc_t>(gp[off + j]) * gelu_bwd<acc_t>(u, kind));
        } else {
          op[off + j] = static_cast<scalar_t>(gelu_fwd<acc_t>(u, kind));
        }
      }
    }
  });
}

}  // namespace

at::Tensor bias_gelu_cpu(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in,
                         std::string_view approximate) {
  check_bias_gelu_args("bias_gelu", c10::DeviceType::CPU, x_in, bias_in);
  const GeluKind kind = parse_approximate(approximate);
  const at::Tensor x = x_in.contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in) bias = bias_in->contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_cpu", [&] {
    run_cpu<scalar_t, false>(x, bias, nullptr, out, kind);
  });
  return out;
}

at::Tensor bias_gelu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& x_in,
                                  const std::optional<at::Tensor>& bias_in,
                                  std::string_view approximate) {
  check_bias_gelu_args("bias_gelu_backward", c10::DeviceType::CPU, x_in, bias_in, &grad_in);
  const GeluKind kind = parse_approximate(approximate);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in) bias = bias_in->contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bias_gelu_bwd_cpu", [&] {
    run_cpu<scalar_t, true>(x, bias, &grad, out, kind);
  });
  return out;
}

}  // namespace distllm
