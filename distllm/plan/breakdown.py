"""A predicted step, term by term (``distllm plan --explain``): where the seconds go on the
busiest pipeline rank, what is exposed of each collective, and how MFU follows.

The per-micro-batch terms are those of the rank with the most blocks, times the micro-batches
of a step; the pipeline adds its bubble (which holds the exposed part of its transfers: the
transfers' total is shown, not added); the tail (after the last backward) adds the exposed
data-parallel reduction, the ZeRO-1/2 all-gather of the updated shards and the optimizer step,
and the step's scalar all-reduces.
"""

from __future__ import annotations

from .cost import CostModel
from .layout import GB, Estimate, grad_buffers_text

__all__ = ["step_terms", "explain_step"]

# terms shown beside the others but held in one of them (the transfers, in the bubble)
_NOT_ADDED = ("pp_p2p_total",)
_TERMS = (
    ("gemm", "GEMMs: forward, input and weight gradients, by shape"),
    ("attention", "attention core (fused kernel, or batched GEMMs + softmax in memory)"),
    ("elementwise", "memory-bound kernels (norms, residuals, GeLU, dropout)"),
    ("recompute", "recomputation in backward"),
    ("tp_comm", "tensor-parallel collectives, exposed part"),
    ("zero3_gather", "ZeRO-3 per-layer all-gathers, exposed part"),
    ("ends", "embedding, output layer and loss"),
    ("bubble", "pipeline bubble"),
    ("pp_p2p_total", "pipeline transfers (two per chunk and micro-batch; not added: the "
     "exposed part is in the bubble, the rest hidden behind compute)"),
    ("dp_comm", "data-parallel gradient reduction, exposed part"),
    ("zero_allgather", "ZeRO-1/2 all-gather of the updated parameters"),
    ("optimizer", "optimizer step (memory-bound)"),
    ("sync", "the step's scalar all-reduces (loss, gradient norm, inf/NaN flag)"),
)


def step_terms(est: Estimate, cm: CostModel) -> dict[str, float]:
    """Seconds per term of ``est``'s predicted step (keys of ``_TERMS``, plus ``step``)."""
    lay, t = est.layout, est.time
    z3 = t["zero3_gather"]
    listed = t["gemm"] + t["attention"] + t["elementwise"] + t["recompute"] + t["tp_comm"] + z3
    # what the busiest rank computes beyond its blocks: the pipeline less its bubble is
    # m * max(forward + backward) over the ranks, which holds no transfer (the bubble does)
    ends = max(0.0, t["compute"] - listed) if lay.pp == 1 else max(0.0, t["pipeline"]
                                                                    - t["bubble"] - listed)
    out = {k: t.get(k, 0.0) for k, _ in _TERMS}
    out.update(zero3_gather=z3, ends=ends, zero_allgather=t["zero_comm"] - z3)
    out["step"] = est.step_time_s
    return out


def explain_step(est: Estimate, cm: CostModel, simulated: bool = False) -> str:
    """The step of ``est`` as lines of text, with its MFU worked out (``simulated``: its
    pipeline time, and so the bubble, is the simulator's replay)."""
    lay = est.layout
    terms = step_terms(est, cm)
    total = sum(terms[k] for k, _ in _TERMS if k not in _NOT_ADDED)
    how = "; pipeline replayed by the simulator" if simulated and lay.pp > 1 else ""
    lines = [
        f"step of {lay.name()}: {est.step_time_s:.4g} s ({cm.runtime.name} runtime, "
        f"{cm.profile.name}, {lay.micro_batches} micro-batch(es) per replica{how})"
    ]
    for key, what in _TERMS:
        sec = terms[key]
        if sec > 0 or key in ("gemm", "optimizer"):
            lines.append(f"  {sec:9.4g} s  {sec / est.step_time_s:6.1%}  {what}")
    lines.append(f"  {total:9.4g} s  sum of the terms (overlap inside the pipeline and the "
                 "cores a CPU profile shares make the step differ)")
    flops = cm.shape.model_flops_per_step()
    peak = cm.peak
    lines.append(
        f"  MFU = model FLOPs {flops:.3g} / ({est.step_time_s:.4g} s x {cm.world} devices x "
        f"{peak / 1e12:.4g} TFLOP/s) = {est.mfu:.1%}"
    )
    mem = est.memory
    lines.append(
        f"  memory {mem['total'] / GB:.2f} GB: params {mem['params'] / GB:.3g}, grads "
        f"{mem['grads'] / GB:.3g}, optimizer {mem['optimizer'] / GB:.3g}, activations "
        f"{mem['activations'] / GB:.3g}{grad_buffers_text(mem)}; optimizer-step peak "
        f"{mem['optimizer_step'] / GB:.3g}"
    )
    return "\n".join(lines)
