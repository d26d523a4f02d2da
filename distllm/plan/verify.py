"""``distllm plan --verify``: the planner's memory for one rank of a layout against a dry run
of the real training code (:mod:`distllm.plan.dry_run`) at that layout.

The model is distllm's GPT (:class:`distllm.models.gpt.GPTConfig`); the planner is given the
same shape (untied embeddings, no dropout, the vocabulary padded to ``64 * tp``), the
``distllm`` runtime and fused attention, so both describe the same job. The rank compared is
the pipeline rank the planner finds heaviest (first DP and TP rank). Its measured peak is
also held against the usable memory of one device of the hardware profile: a layout the
planner ranked but whose dry run does not fit fails the verification (:attr:`Verification.fits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import CostModel
from .dry_run import DryRun, dry_run
from .hardware import Profile, load_profile
from .layout import GB, Layout
from .model import ModelShape

__all__ = ["Verification", "verify", "gpt_config_for", "shape_for", "train_config_for"]

KEYS = ("params", "grads", "optimizer")


def gpt_config_for(shape: ModelShape, pp: int = 1):
    """distllm's GPT of ``shape`` (GeLU MLP, biases, learned positions) on ``pp`` pipeline
    stages: its head tied to the embedding where the shape's is and ``pp`` is 1 (distllm
    ties only there; across stages the last one holds a copy, as the planner counts)."""
    from distllm.models.config import GPTConfig

    if shape.gated_mlp or not shape.biases or not shape.learned_positions:
        raise ValueError(
            f"--verify builds distllm's GPT (GeLU MLP, biases, learned positions); "
            f"{shape.name} is not one: choose --model gpt2-xl, gpt3-175b, ... or GPT shape flags"
        )
    return GPTConfig(
        vocab_size=shape.vocab,
        n_layers=shape.layers,
        hidden_size=shape.hidden,
        n_heads=shape.heads,
        ffn_hidden_size=shape.ffn,
        max_seq_len=shape.seq_len,
        n_kv_heads=shape.kv_heads or None,
        tie_embeddings=shape.tied_embeddings and pp == 1,
        name=shape.name,
    )


def shape_for(mcfg, global_batch: int, seq_len: int) -> ModelShape:
    """The planner's view of distllm's GPT ``mcfg``."""
    return ModelShape(
        mcfg.name,
        mcfg.n_layers,
        mcfg.hidden_size,
        mcfg.n_heads,
        mcfg.ffn_hidden_size,
        mcfg.vocab_size,
        seq_len,
        global_batch,
        kv_heads=mcfg.n_kv_heads or 0,
        tied_embeddings=mcfg.tie_embeddings,
        dropout=False,
        source="distllm.models.gpt.GPTConfig",
    )


def train_config_for(lay: Layout, shape: ModelShape, dtype: str):
    """The :class:`distllm.train.config.TrainConfig` that runs ``lay`` for ``shape``."""
    from distllm.train.config import ParallelConfig, TrainConfig

    par = ParallelConfig.from_layout(lay, ParallelConfig(overlap="none"))
    return TrainConfig(
        model=shape.name,
        parallel=par,
        global_batch=shape.global_batch,
        seq_len=shape.seq_len,
        dtype=dtype,
        activation_checkpointing=lay.checkpointing,
        progress=False,
    )


def _gb(n: float) -> str:
    """``84.4 GB``; three significant digits below 1 GB (``0.00612 GB``)."""
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / GB:.3g} GB"


@dataclass
class Verification:
    """The planner's prediction and the dry run's measurement for one rank (bytes)."""

    layout: Layout
    model: str
    pp_rank: int
    predicted: dict[str, float]
    measured: DryRun
    profile: str = ""
    """The hardware profile's name."""
    usable: float = float("inf")
    """Bytes a layout may use on one of the profile's devices (``Profile.usable_bytes``)."""

    @property
    def fits(self) -> bool:
        """The measured peak is within the usable memory."""
        return self.measured.peak <= self.usable

    def verdict(self) -> str:
        """Whether the measured peak fits the usable memory, with both numbers."""
        m = self.measured
        where = f"{_gb(self.usable)} usable on {self.profile}"
        if self.fits:
            return f"fits: measured peak {_gb(m.peak)} of the {where}"
        return (f"does not fit: {self.layout.name()} measured a peak of {_gb(m.peak)} "
                f"(rank {m.rank}, {m.peak_phase}), over the {where}; the planner predicted "
                f"{_gb(self.predicted['total'])}")

    @property
    def error(self) -> float:
        """Predicted peak over measured peak, minus one."""
        return self.predicted["total"] / self.measured.peak - 1.0

    def as_dict(self) -> dict:
        m = self.measured
        return {
            "layout": self.layout.name(),
            "model": self.model,
            "world": m.world,
            "rank": m.rank,
            "pp_rank": self.pp_rank,
            "predicted_gb": {k: v / GB for k, v in self.predicted.items()},
            "measured_gb": {
                **{k: v / GB for k, v in m.states.items()},
                **{f"peak_{k}": v / GB for k, v in m.phases.items()},
                "total": m.peak / GB,
            },
            "peak_phase": m.peak_phase,
            "error": self.error,
            "profile": self.profile,
            "usable_gb": self.usable / GB,
            "fits": self.fits,
            "dry_run_seconds": m.seconds,
            "ops": m.ops,
        }

    def report(self) -> str:
        m, p = self.measured, self.predicted
        lines = [
            f"verify {self.layout.name()} of {self.model}: rank {m.rank} of {m.world} "
            f"(pipeline rank {self.pp_rank}), dry run of the real code in {m.seconds:.1f} s "
            f"({m.ops} ops on fake tensors)",
            f"  {'':12s} {'planner':>10s} {'dry run':>10s}",
        ]
        for k in KEYS:
            lines.append(f"  {k:12s} {p[k] / GB:10.3f} {m.states.get(k, 0) / GB:10.3f}")
        fb = m.phases.get("forward-backward", 0)
        act_measured = fb - sum(m.states.get(k, 0) for k in KEYS)
        # the dry run cannot tell ZeRO-2/3's accumulation buffers from the activations
        buf = p.get("grad_buffers", 0.0)
        name, note = (("act.+buffers", ", with the gradient accumulation buffers") if buf
                      else ("activations", ""))
        lines.append(f"  {name:12s} {(p['activations'] + buf) / GB:10.3f} "
                     f"{act_measured / GB:10.3f}  (forward-backward peak minus the states{note})")
        lines.append(f"  {'opt. step':12s} {p['optimizer_step'] / GB:10.3f} "
                     f"{m.phases.get('optimizer', 0) / GB:10.3f}")
        lines.append(f"  {'peak':12s} {p['total'] / GB:10.3f} {m.peak / GB:10.3f}  "
                     f"error {self.error:+.1%} (measured peak in {m.peak_phase})")
        lines.append(f"  {self.verdict()}")
        return "\n".join(lines)


def verify(shape: ModelShape, lay: Layout, *, dtype: str = "bfloat16",
           profile: str | Profile = "a100-80gb", pp_rank: int | None = None) -> Verification:
    """Dry-run ``lay`` for ``shape`` (as distllm's GPT) and compare one rank's peak memory
    with the planner's and with the usable memory of a device of ``profile``."""
    mcfg = gpt_config_for(shape, lay.pp)
    plan_shape = shape_for(mcfg, shape.global_batch, shape.seq_len)
    world = lay.tp * lay.pp * lay.dp
    prof = load_profile(profile)
    cm = CostModel(plan_shape, prof, world, min(world, prof.gpus_per_node), dtype=dtype,
                   flash_attention=True, runtime_name="distllm")
    r = cm.heaviest_rank(lay) if pp_rank is None else pp_rank
    predicted = cm.rank_memory(lay, r)
    device = "cpu" if prof.cores else "cuda"  # the code paths of the profile's device
    measured = dry_run(train_config_for(lay, plan_shape, dtype), mcfg, world, pp_rank=r,
                       device=device)
    name = prof.name if isinstance(profile, Profile) else str(profile)
    return Verification(lay, plan_shape.name, r, predicted, measured, name, prof.usable_bytes)
