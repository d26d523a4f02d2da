// distllm._cuda: the CUDA extension, a plain module of kernels (csrc/cuda/ops.h). Importing
// it registers nothing: the ops that call these live in distllm/ops/.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "distllm CUDA kernels (called by the ops of distllm.ops)";
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("bias_gelu", &distllm::bias_gelu_cuda, "gelu(x + bias) over x's last dimension",
        py::arg("x"), py::arg("bias"), py::arg("approximate"), no_gil);
  m.def("bias_gelu_backward", &distllm::bias_gelu_backward_cuda, "grad * gelu'(x + bias)",
        py::arg("grad"), py::arg("x"), py::arg("bias"), py::arg("approximate"), no_gil);
  m.def("cublaslt_linear_gelu", &distllm::cublaslt_linear_gelu,
        "(y, pre): gelu(x @ weight.T + bias) through cuBLASLt's GELU(_AUX)(_BIAS) epilogue",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("save_pre"),
        py::arg("allow_tf32") = false, no_gil);
  m.def("cublaslt_dgelu_bgrad", &distllm::cublaslt_dgelu_bgrad,
        "(dpre, dbias): (dy @ w2) * gelu'(pre) and its column sums (DGELU_BGRAD epilogue)",
        py::arg("dy"), py::arg("w2"), py::arg("pre"), py::arg("allow_tf32") = false, no_gil);
  m.def("cublaslt_wgrad_bgrad", &distllm::cublaslt_wgrad_bgrad,
        "(dw, dbias): gpre.T @ x with the bias gradient in the BGRADB epilogue",
        py::arg("gpre"), py::arg("x"), py::arg("with_bias"), py::arg("allow_tf32") = false,
        no_gil);
}
