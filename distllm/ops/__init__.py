"""Fused ops, one public function each.

Each op's module registers it with ``torch.library`` and defines its public function, in
one order: custom op, fake (for ``torch.compile``), autograd, public function.

- :mod:`distllm.ops.bias_gelu`: :func:`bias_gelu`, gelu(x + bias) (the compiled kernels of
  ``distllm._C`` / ``distllm._cuda``, else the reference);
- :mod:`distllm.ops.linear_gelu`: :func:`linear_gelu`, gelu(x @ weight.T + bias) as one op,
  with its backends (cuBLASLt, Triton, oneDNN, reference) in
  :mod:`distllm.ops.linear_gelu_backends` and :func:`backends` saying which run here;
- :mod:`distllm.ops.backend_choice`: how ``backend="auto"`` measures and caches its choice;
- :mod:`distllm.ops.cpu_gemm`: the CPU GEMMs of distllm's own autograd functions (the cpu
  backend above, the tensor-parallel layers), oneDNN's or torch's, measured per shape.
- :mod:`distllm.ops.weight_grad`: zb-h1's split backward, where linears, these ops and the
  tensor-parallel layers leave their weight-gradient GEMMs to a later pass (W).

The compiled extensions load on first use (:mod:`distllm.ops.extensions`); a missing one is
a one-line warning and the next backend.
"""

from __future__ import annotations

from distllm.ops.bias_gelu import bias_gelu, bias_gelu_reference
from distllm.ops.linear_gelu import backends, gemm_dgelu, linear_gelu, linear_gelu_reference

__all__ = ["bias_gelu", "bias_gelu_reference", "linear_gelu", "linear_gelu_reference", "gemm_dgelu",
           "backends"]
