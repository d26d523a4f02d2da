// distllm._C: the CPU extension. Importing it registers the distllm:: ops with the
// dispatcher (see the TORCH_LIBRARY blocks in each source file).
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "distllm CPU ops (registered under torch.ops.distllm)";
  m.attr("ops") = pybind11::make_tuple("bias_gelu", "bias_gelu_backward");
}
