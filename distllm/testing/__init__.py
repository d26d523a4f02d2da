"""What tests and benchmarks use to run distributed code on one machine.

- :mod:`distllm.testing.distributed`: :func:`run_distributed` starts N gloo ranks, runs a
  function in each and returns the results in rank order (a failing, dying or hanging rank
  ends the run with its traceback in :class:`DistributedFailure`);
- :mod:`distllm.testing.netem`: the emulated cluster link (network namespaces joined by
  rate-limited veth pairs) that multi-rank benchmarks, calibration and tests run over.

The library itself never imports this package except where a user asks for a measurement
across ranks (``distllm plan --calibrate``).
"""

from __future__ import annotations

from distllm.testing.distributed import DistributedFailure, run_distributed

__all__ = ["run_distributed", "DistributedFailure"]
