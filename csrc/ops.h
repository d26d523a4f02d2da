// The functions of distllm._C (CPU kernels), bound to Python in csrc/bindings.cpp. The ops
// that call them (schema, fake tensor, autograd) are registered in distllm/ops/<op>.py.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>

namespace distllm {

// gelu(x + bias) over x's last dimension; x (..., N), bias (N,) or none.
at::Tensor bias_gelu_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         std::string_view approximate);

// grad * gelu'(x + bias), the derivative of bias_gelu with respect to x.
at::Tensor bias_gelu_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                  const std::optional<at::Tensor>& bias,
                                  std::string_view approximate);

}  // namespace distllm
