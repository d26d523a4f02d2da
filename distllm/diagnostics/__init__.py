"""Diagnostics: is the communication really hidden, and how is it timed.

- :mod:`distllm.diagnostics.doctor`: :func:`diagnose` profiles a few training steps of a
  model built from ``distllm.nn`` and reports, per layer and direction, which collective
  ran, whether it overlapped and how much of it was hidden; it raises
  :class:`OverlapNotHappening` when an overlap that was asked for does not run;
- :mod:`distllm.diagnostics.probe`: the doctor's per-layer hooks and profiler read-out;
- :mod:`distllm.diagnostics.timeline`: one step as compute and communication lanes, from
  ``torch.profiler``, and the interval algebra of the hidden share;
- :mod:`distllm.diagnostics.profiler`: the one way distllm starts ``torch.profiler`` (kineto's
  log quiet on a machine without CUDA);
- :mod:`distllm.diagnostics.timing`: the one timing module (interleaved repetitions, timers,
  the max over ranks, a collective timed alone) that the doctor, ``distllm bench``,
  calibration and the auto-tuners share.

``distllm bench --doctor`` runs the doctor on a small model on 2 gloo ranks.
"""

from __future__ import annotations

from distllm.diagnostics.doctor import (
    DoctorReport,
    LayerDirection,
    OverlapNotHappening,
    diagnose,
)

__all__ = ["diagnose", "DoctorReport", "LayerDirection", "OverlapNotHappening"]
