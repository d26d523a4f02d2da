"""Pipeline bubble and activations in flight, per schedule.

When :mod:`distllm.parallel.pipeline` provides ``simulate`` (a replay of the real schedule),
the planner can use it for the short list of candidates; the closed forms below are used
for the full search and whenever the simulator is absent:

* GPipe and 1F1B: ``(m + p - 1) * (t_f + t_b)`` (bubble fraction ``(p-1)/(m+p-1)``,
  Huang et al. 2019; Narayanan et al. 2021 sec. 2.2).
* Interleaved 1F1B with v chunks per rank: the bubble shrinks by v, at v times the
  point-to-point messages (Narayanan et al. 2021 sec. 2.2.2).
* ZB-H1: backward split into B (input gradients) and W (weight gradients) with W filling the
  cool-down; bubble ``(p-1) * (t_f + t_b - 2 t_w)`` against 1F1B's ``(p-1) * (t_f + t_b)``
  (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 3, where their T_B excludes W).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["in_flight", "pipeline_time", "SCHEDULES", "simulator_or_none"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> tuple[float, float]:
    """Micro-batches of a whole stage's activations held at peak: (first stage, last stage)."""
    if p == 1 or schedule == "none":
        return 1.0, 1.0
    if schedule == "gpipe":
        return float(m), float(m)
    if schedule == "interleaved-1f1b":
        # warm-up of rank r is 2(p-1-r) + (v-1)p chunk forwards (Megatron's interleaved 1F1B)
        first = min(2 * (p - 1) + (v - 1) * p + 1, m * v) / v
        last = min((v - 1) * p + 1, m * v) / v
        return first, last
    return float(min(p, m)), 1.0  # 1f1b, zb-h1


def pipeline_time(
    schedule: str,
    p: int,
    m: int,
    v: int,
    t_f: float,
    t_b: float,
    t_w: float,
    t_comm: float,
    simulator: Callable | None = None,
) -> float:
    """Seconds of the forward+backward part of a step on the busiest stage.

    t_f, t_b: forward and full backward (B + W) of one micro-batch on a whole stage;
    t_w: the weight-gradient part of t_b; t_comm: one point-to-point transfer.
    """
    if p == 1 or schedule == "none":
        return m * (t_f + t_b)
    if simulator is not None:
        got = simulator(schedule, p, m, v, t_f, t_b, t_w, t_comm)
        if got is not None:
            return got
    f, b = t_f + t_comm, t_b + t_comm
    if schedule in ("gpipe", "1f1b"):
        return (m + p - 1) * (f + b)
    if schedule == "interleaved-1f1b":
        fc, bc = t_f / v + t_comm, t_b / v + t_comm
        return (m * v + p - 1) * (fc + bc)
    if schedule == "zb-h1":
        return m * (f + b) + (p - 1) * max(f + b - 2 * t_w, f)
    raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")


SIM_MAX_ACTIONS = 20000  # larger cases use the closed form (the replay is pure Python)


def simulator_or_none() -> Callable | None:
    """An adapter to ``distllm.parallel.pipeline``'s schedule replay if it is importable.

    The adapter returns the simulated step time, or None when the simulator cannot run that
    case (too big, or a schedule it refuses), so that the closed form is used instead.
    """
    try:  # lazy: the pipeline package is a higher-level sibling and may be absent
        from distllm.parallel.pipeline.schedules import build_schedule
        from distllm.parallel.pipeline.simulate import simulate
    except Exception:  # noqa: BLE001 - absent or broken: closed forms
        return None

    def run(schedule, p, m, v, t_f, t_b, t_w, t_comm):
        if p * m * v > SIM_MAX_ACTIONS:
            return None
        try:
            sched = build_schedule(schedule, p, m, v if schedule == "interleaved-1f1b" else 1)
            # per chunk; a non-split backward B takes (t_b - t_w) + t_w in the simulator
            res = simulate(sched, t_f / v, (t_b - t_w) / v, t_w / v, t_comm)
        except Exception:  # noqa: BLE001 - an unsupported case falls back to the formula
            return None
        if getattr(res, "deadlock", None):
            return None
        return float(res.step_time)

    return run
