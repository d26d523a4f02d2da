// The functions of distllm._cuda (CUDA kernels), bound to Python in csrc/cuda/bindings.cpp.
// The ops that call them are registered in distllm/ops/<op>.py.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace distllm {

// csrc/cuda/bias_gelu.cu: gelu(x + bias) and grad * gelu'(x + bias) over x's last dimension.
at::Tensor bias_gelu_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                          std::string_view approximate);
at::Tensor bias_gelu_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                                   const std::optional<at::Tensor>& bias,
                                   std::string_view approximate);

// csrc/cuda/linear_gelu.cu: cuBLASLt GEMMs with GeLU / bias-gradient epilogues.
std::tuple<at::Tensor, at::Tensor> cublaslt_linear_gelu(const at::Tensor& x, const at::Tensor& w,
                                                        const std::optional<at::Tensor>& bias,
                                                        bool save_pre, bool allow_tf32);
std::tuple<at::Tensor, at::Tensor> cublaslt_dgelu_bgrad(const at::Tensor& dy, const at::Tensor& w2,
                                                        const at::Tensor& pre, bool allow_tf32);
std::tuple<at::Tensor, at::Tensor> cublaslt_wgrad_bgrad(const at::Tensor& gpre, const at::Tensor& x,
                                                        bool with_bias, bool allow_tf32);

}  // namespace distllm
