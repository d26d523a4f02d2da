// distllm._C: the CPU extension, a plain module of kernels (csrc/ops.h). Importing it
// registers nothing: distllm/ops/bias_gelu.py defines the torch.ops.distllm ops that call it.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "distllm CPU kernels (called by the ops of distllm.ops)";
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("bias_gelu", &distllm::bias_gelu_cpu, "gelu(x + bias) over x's last dimension",
        py::arg("x"), py::arg("bias"), py::arg("approximate"), no_gil);
  m.def("bias_gelu_backward", &distllm::bias_gelu_backward_cpu, "grad * gelu'(x + bias)",
        py::arg("grad"), py::arg("x"), py::arg("bias"), py::arg("approximate"), no_gil);
}
