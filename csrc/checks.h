// Argument checks shared by the CPU (_C) and CUDA (_cuda) extensions. Every message names
// the function and the failing argument, so that a user sees which tensor to fix.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>

#include "gelu.h"

// DISTLLM_CHECK_ARG(cond, op, arg, ...): "<op>: <arg> <message...>" unless cond.
#define DISTLLM_CHECK_ARG(cond, op, arg, ...) TORCH_CHECK((cond), op, ": ", arg, " ", __VA_ARGS__)

// `t` lives on `want_device` (same type and index): a CPU tensor handed to a CUDA kernel
// would be read through a host pointer.
#define DISTLLM_CHECK_SAME_DEVICE(t, want_device, op, arg, ref)                             \
  DISTLLM_CHECK_ARG((t).device() == (want_device), op, arg, "is on ", (t).device(), " but ", \
                    ref, " is on ", (want_device), ": move ", arg, " to ", (want_device))

#define DISTLLM_CHECK_SAME_DTYPE(t, want_dtype, op, arg, ref)                              \
  DISTLLM_CHECK_ARG((t).scalar_type() == (want_dtype), op, arg, "has dtype ",              \
                    (t).scalar_type(), " but ", ref, " has dtype ", (want_dtype))

// `t` is on device type `type` (the extension's): each extension's kernels read only
// their own device's memory.
#define DISTLLM_CHECK_DEVICE_TYPE(t, want_type, op, arg)                                \
  DISTLLM_CHECK_ARG((t).device().type() == (want_type), op, arg, "must be a ", (want_type), \
                    " tensor, got one on ", (t).device())

namespace distllm {

// `t` has the device and dtype of `like` (named `ref` in the message): operands that are
// combined in one kernel.
inline void check_like(const at::Tensor& t, const at::Tensor& like, const char* op,
                       const char* arg, const char* ref) {
  DISTLLM_CHECK_SAME_DEVICE(t, like.device(), op, arg, ref);
  DISTLLM_CHECK_SAME_DTYPE(t, like.scalar_type(), op, arg, ref);
}

inline GeluKind parse_approximate(std::string_view approximate) {
  if (approximate == "none") return GeluKind::Exact;
  TORCH_CHECK(approximate == "tanh", "approximate must be 'none' (erf) or 'tanh', got '",
              std::string(approximate), "'");
  return GeluKind::Tanh;
}

// The arguments of bias_gelu(x, bias?) and bias_gelu_backward(grad, x, bias?): x at least
// 1-D on a `device_type` device, bias (x.size(-1),) and grad of x's shape, both of x's dtype
// on x's device.
inline void check_bias_gelu_args(const char* op, c10::DeviceType device_type, const at::Tensor& x,
                                 const std::optional<at::Tensor>& bias,
                                 const at::Tensor* grad = nullptr) {
  DISTLLM_CHECK_DEVICE_TYPE(x, device_type, op, "x");
  DISTLLM_CHECK_ARG(x.dim() >= 1, op, "x", "must have at least 1 dimension, got a scalar");
  const at::ScalarType st = x.scalar_type();
  DISTLLM_CHECK_ARG(st == at::kFloat || st == at::kDouble || st == at::kHalf ||
                        st == at::kBFloat16,
                    op, "x", "must be float32, float64, float16 or bfloat16, got ", st);
  if (bias.has_value()) {
    DISTLLM_CHECK_ARG(bias->dim() == 1 && bias->size(0) == x.size(-1), op, "bias",
                      "must be (", x.size(-1), ",) (x's last dimension), got ", bias->sizes());
    check_like(*bias, x, op, "bias", "x");
  }
  if (grad != nullptr) {
    DISTLLM_CHECK_ARG(grad->sizes() == x.sizes(), op, "grad", "has shape ", grad->sizes(),
                      " but x has shape ", x.sizes());
    check_like(*grad, x, op, "grad", "x");
  }
}

}  // namespace distllm
