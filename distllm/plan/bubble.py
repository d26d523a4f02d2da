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

from distllm.parallel.pipeline.schedules import SCHEDULES

__all__ = ["in_flight", "pipeline_time", "SCHEDULES", "simulator_or_none"]


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> list[float]:
    """Micro-batches of a whole rank's activations held at peak, per pipeline rank.

    1F1B: rank ``r`` runs ``p - r`` forwards before its first backward frees one. ZB-H1
    holds a micro-batch from its forward until its weight-gradient pass (W), which the
    cool-down defers: every rank, the last included, holds up to ``p`` (the schedule's
    replay, :func:`distllm.parallel.pipeline.simulate`, counts the same). Between B and W
    only the deferred linears' inputs and output gradients stay, so counting a whole
    micro-batch there is an upper bound."""
    if p == 1 or schedule == "none":
        return [1.0]
    if schedule == "gpipe":
        return [float(m)] * p
    if schedule == "interleaved-1f1b":
        # warm-up of rank r: 2(p-1-r) + (v-1)p chunk forwards (Megatron's interleaved 1F1B)
        return [min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) / v for r in range(p)]
    if schedule == "zb-h1":
        return [float(min(p, m))] * p
    return [float(min(p - r, m)) for r in range(p)]  # 1f1b


def pipeline_time(
    schedule: str,
    p: int,
    m: int,
    v: int,
    t_f: list[float],
    t_b: list[float],
    t_w: list[float],
    t_comm: float,
    simulator: Callable | None = None,
) -> float:
    """Seconds of the forward+backward part of a step (all ranks done).

    ``t_f[r]``, ``t_b[r]``: forward and full backward (B + W) of one micro-batch through all
    of rank r's layers; ``t_w[r]``: the weight-gradient part of ``t_b[r]``; ``t_comm``: one
    point-to-point transfer. Uneven ranks: fill and drain pass every rank once, the steady
    state runs at the slowest one (exact for even ranks, the textbook forms above).
    """
    if p == 1 or schedule == "none":
        return m * (t_f[0] + t_b[0])
    if simulator is not None:
        got = simulator(schedule, p, m, v, t_f, t_b, t_w, t_comm)
        if got is not None:
            return got
    c = t_comm
    one = [f + b + 2 * c for f, b in zip(t_f, t_b, strict=True)]
    slow = max(one)
    if schedule in ("gpipe", "1f1b"):
        return (m - 1) * slow + sum(one)
    if schedule == "interleaved-1f1b":
        chunk = [f / v + b / v + 2 * c for f, b in zip(t_f, t_b, strict=True)]
        return m * v * max(chunk) + (sum(chunk) - max(chunk))
    if schedule == "zb-h1":
        idle = [max(f + b - 2 * w, f) + 2 * c for f, b, w in zip(t_f, t_b, t_w, strict=True)]
        return m * slow + (sum(idle) - idle[one.index(slow)])
    raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")


SIM_MAX_ACTIONS = 4096  # larger cases use the closed form (the replay is pure Python)


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
            res = simulate(
                sched,
                [f / v for f in t_f],
                [(b - w) / v for b, w in zip(t_b, t_w, strict=True)],
                [w / v for w in t_w],
                t_comm,
            )
        except Exception:  # noqa: BLE001 - an unsupported case falls back to the formula
            return None
        if getattr(res, "deadlock", None):
            return None
        return float(res.step_time)

    return run
