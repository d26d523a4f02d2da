"""Which GEMM libraries a CPU test can pin: ``PINNED``, the parameters of a test run once with
each library of :mod:`distllm.ops.cpu_gemm` pinned. The oneDNN case is skipped only where this
torch build has no oneDNN linear for float32 (``ONEDNN`` False): torch's GEMM is then the
only library there is to run, and its case runs everywhere."""

from __future__ import annotations

import pytest
import torch

from distllm.ops import cpu_gemm

ONEDNN = cpu_gemm.onednn_dtype_ok(torch.float32)
PINNED = [pytest.param("onednn", marks=pytest.mark.skipif(
    not ONEDNN, reason="this torch has no oneDNN linear for float32: torch's GEMM is the only "
    "library there is to run")), "torch"]
