// distllm._cuda: the CUDA extension. Import distllm._C first (it defines the op schemas);
// importing this module registers the CUDA kernels of the distllm:: ops.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "distllm CUDA ops (registered under torch.ops.distllm)";
}
