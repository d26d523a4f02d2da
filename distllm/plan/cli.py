"""``distllm plan``: model + cluster in, ranked layouts out (``--json``, ``--explain``).

Examples::

    distllm plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --top 5
    distllm plan --params 7.5e9 --gpus 64 --tp 1 --pp 1 --json --explain
    distllm plan --calibrate --out cpu.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from distllm.cli import defaults_of
from distllm.models.config import CHECKPOINTING

from .cost import GB, STATE_BYTES, Estimate, training_dtype
from .hardware import load_profile, profile_names
from .model import ModelShape, preset, preset_names
from .runtime import runtime, runtime_names
from .search import default_dtype, explain, model_states_table, search
from .space import check_cluster

__all__ = ["add_arguments", "run", "shape_from_args"]

DEFAULT_GPUS = 8  # --gpus of a search or a --params table (--calibrate has its own)
_SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "global_batch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help=f"preset: {', '.join(preset_names())} (shape flags override it)",
    )
    for knob in _SHAPE:
        m.add_argument("--" + knob.replace("_", "-"), type=int, default=None)
    m.add_argument(
        "--params",
        type=float,
        default=None,
        help="a bare parameter count: model-state memory per ZeRO stage only",
    )
    m.add_argument(
        "--dtype",
        default=None,
        help="bfloat16 (GPU default), float32 (CPU default), float64; float16 with --runtime "
        "megatron-lm-2021 (distllm does not train in it)",
    )
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--gpus",
        type=int,
        default=None,
        help=f"devices in total (default {DEFAULT_GPUS}; --calibrate: the rank processes "
        "that share this machine, default 4)",
    )
    c.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    c.add_argument(
        "--gpu",
        default="a100-80gb",
        help=f"hardware profile: {', '.join(profile_names())} or a .json path",
    )
    s = p.add_argument_group("search (pin a dimension instead of searching it)")
    for knob in ("tp", "pp", "dp", "micro_batches"):
        s.add_argument("--" + knob.replace("_", "-"), type=int, default=None)
    s.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3))
    s.add_argument(
        "--schedule", default=None, choices=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
    )
    s.add_argument("--checkpointing", default=None, choices=CHECKPOINTING)
    s.add_argument("--sequence-parallel", default=None, choices=("on", "off"))
    s.add_argument(
        "--no-flash",
        action="store_true",
        help="attention keeps its s x s probabilities (no fused attention)",
    )
    s.add_argument(
        "--runtime",
        default="distllm",
        help="the training code whose behaviour is modelled: "
        f"{', '.join(runtime_names())} (default distllm)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to show")
    o.add_argument(
        "--explain",
        action="store_true",
        help="the chosen layout's step term by term, and the rejected layouts by reason (with "
        "--json: every one and why)",
    )
    o.add_argument(
        "--verify",
        action="store_true",
        help="dry-run the real training code for the chosen layout's heaviest rank on fake "
        "tensors and compare its peak memory with the planner's",
    )
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (GEMM, gloo links) and write a profile",
    )
    o.add_argument("--net", default=None,
                   help="--calibrate: emulated link rate (default 1gbit; '' for none)")
    o.add_argument(
        "--out",
        default=None,
        help="--calibrate: the profile .json to write (default cpu-calibrated.json in this "
        "folder; replaced if it exists); plan with it by --gpu FILE.json",
    )


def shape_from_args(a: argparse.Namespace) -> ModelShape:
    over = {k: getattr(a, k) for k in _SHAPE if getattr(a, k) is not None}
    if a.model:
        base = preset(a.model)
        # a learned position table has a row per position: no longer sequence (the trainer's
        # rule, distllm.train.cli.precheck)
        seq = over.get("seq_len", base.seq_len)
        if base.learned_positions and seq > base.seq_len:
            raise ValueError(f"--seq-len {seq} exceeds the {base.name} context {base.seq_len}: "
                             "lower --seq-len")
        return base.with_(**over)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq_len") if k not in over]
    if missing:
        flags = " ".join("--" + k.replace("_", "-") for k in missing)
        raise ValueError(
            f"no model: give --model PRESET ({', '.join(preset_names())}), "
            f"--params P, or the shape (missing {flags})"
        )
    over.setdefault("ffn", 4 * over["hidden"])
    over.setdefault("global_batch", 32)
    # the GPT that distllm trains from these flags (distllm.models.GPTConfig): untied head
    return ModelShape(name="custom", tied_embeddings=False, **over)


def _pins(a: argparse.Namespace) -> dict:
    pins = {
        k: getattr(a, k)
        for k in ("tp", "pp", "dp", "micro_batches", "zero", "schedule", "checkpointing")
    }
    for k in ("tp", "pp", "dp", "micro_batches"):
        if pins[k] is not None and pins[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')}={pins[k]}: it must be a positive integer")
    if a.sequence_parallel is not None:
        pins["sequence_parallel"] = a.sequence_parallel == "on"
    return {k: v for k, v in pins.items() if v is not None}


_SHORT = {"grad_buffers": "buf"}  # a memory entry's name in a row (else its first 3 letters)


def _row(e: Estimate) -> str:
    m = e.memory
    mem = " ".join(
        f"{_SHORT.get(k, k[:3])}={m[k] / GB:7.3f}"
        for k in ("params", "grads", "optimizer", "activations", "grad_buffers", "total")
        if k in m
    )
    t = f"{e.step_time_s:9.4g} s  MFU {e.mfu:5.1%}" if e.rejected_reason is None and e.time else ""
    return f"{e.layout.name():58s} {t}  GB: {mem}" + (
        f"  REJECTED: {e.rejected_reason}" if e.rejected_reason else ""
    )


# a number standing alone in a reason ("pp=2", "79.0 GB"), not part of a name ("1f1b", "zb-h1")
_NUMBER = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?!\w)")


def _rejections(rejected: list[Estimate], examples: int = 2) -> str:
    """The rejected layouts grouped by why, most common reason first: a search rejects tens of
    thousands (GPT-3 175B on 1024 GPUs: 32750), one line each would bury the few that nearly
    fit. Reasons that differ only in their numbers are one group; its examples are the
    layouts that came closest (least memory, where the row has it). ``--json --explain``
    lists every one."""
    groups: dict[str, list[Estimate]] = {}
    for e in rejected:
        groups.setdefault(_NUMBER.sub("#", e.rejected_reason or ""), []).append(e)
    lines = [f"\nrejected ({len(rejected)}), by reason (every one: --json --explain):"]
    for why, es in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(es):6d}  {why}")
        closest = sorted(es, key=lambda e: e.memory.get("total", float("inf")))
        lines += ["            " + _row(e) for e in closest[:examples]]
    return "\n".join(lines)


# flags a --params table does not read (no shape, no search): refused, not ignored
_NOT_WITH_PARAMS = ("model", *_SHAPE, "gpus_per_node", "micro_batches", "schedule",
                    "checkpointing", "sequence_parallel", "no_flash", "runtime", "top", "verify")
_CALIBRATE_READS = ("calibrate", "gpus", "net", "out")  # all that --calibrate reads


def _refuse_unread(a: argparse.Namespace, names, mode: str, instead: str) -> None:
    """Refuse the flags among ``names`` given at another value than their default: ``mode``
    (what runs, and so does not read them) and ``instead`` (what to do but drop them)."""
    defaults = defaults_of(add_arguments)
    given = [k for k in names if getattr(a, k) != getattr(defaults, k)]
    if given:
        flags = " ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{mode}, which does not read {flags}: drop "
                         f"{'it' if len(given) == 1 else 'them'}, or {instead}")


def _params_mode(a: argparse.Namespace) -> int:
    _refuse_unread(a, _NOT_WITH_PARAMS, "--params gives the model-state table of a bare "
                   "parameter count (no shape, no search)",
                   "give the model (--model, or the shape flags) instead of --params")
    check_cluster(a.gpus, a.gpus)  # --gpus a positive integer
    _pins(a)  # --tp/--pp/--dp positive integers
    if a.dp is not None and a.dp * (a.tp or 1) * (a.pp or 1) != a.gpus:
        raise ValueError(
            f"--dp={a.dp} with tp*pp={(a.tp or 1) * (a.pp or 1)} does not use "
            f"--gpus={a.gpus}: drop --dp or make tp*pp*dp = gpus"
        )
    given = a.dtype or default_dtype(a.gpu)  # the search's default
    rows = model_states_table(a.params, a.gpus, a.tp or 1, a.pp or 1, a.gpu, given)
    dtype = training_dtype(given)  # valid: the table above accepted it
    if a.zero is not None:
        rows = [r for r in rows if r.layout.zero == a.zero]
    if a.json:
        out = [r.as_dict() for r in rows]
        if a.explain:
            for d, r in zip(out, rows, strict=True):
                d["explain"] = _state_formula(r, dtype)
        print(json.dumps(out, indent=1))
    else:
        print(f"model states of {a.params:.4g} parameters on {a.gpus} devices ({a.gpu}):")
        for r in rows:
            print("  " + _row(r))
        if (gb := STATE_BYTES[dtype][1]) < 4:
            # the paper's figures, not what distllm's own run holds (its fp32 gradients)
            print(f"  (the ZeRO paper's accounting, {gb}-byte gradients; distllm keeps fp32 "
                  f"gradients under {dtype}: {4 - gb} more bytes per parameter, sharded as "
                  "the gradients are. Give --model for distllm's own plan.)")
        if a.explain:
            print(_explain_params(a.params, rows, dtype))
    return 0


# what each state holds per parameter, by its byte count (see cost.STATE_BYTES)
_STATE_WHAT = {
    "params": "weights",
    "grads": "gradients",
    "optimizer": "AdamW states (fp32 master weights, momentum, variance)",
}


def _state_formula(est: Estimate, dtype: str) -> str:
    """``"2P + 2P/64 + 12P/64 = 16.6 GB"``: P parameters per device, each state's bytes per
    parameter, divided by dp where this ZeRO stage shards it."""
    lay, mem = est.layout, est.memory
    sharded = {"params": lay.zero >= 3, "grads": lay.zero >= 2, "optimizer": lay.zero >= 1}
    terms = [
        f"{b}P" + (f"/{lay.dp}" if sharded[k] else "")
        for k, b in zip(("params", "grads", "optimizer"), STATE_BYTES[dtype], strict=True)
    ]
    return f"{' + '.join(terms)} = {mem['total'] / GB:.1f} GB"


def _explain_params(n_params: float, rows: list[Estimate], dtype: str) -> str:
    """How ``--params`` rows are computed: the per-device count, the bytes per parameter of
    each state, and each stage's sum."""
    lay = rows[0].layout
    pb, gb, ob = STATE_BYTES[dtype]
    what = dict(_STATE_WHAT)
    if pb == gb and ob == 2 * pb:  # no separate master copy: momentum and variance only
        what["optimizer"] = "AdamW momentum and variance"
    lines = [
        "explained:",
        f"  P = {n_params:.4g} parameters / (tp*pp = {lay.tp}*{lay.pp}) = "
        f"{n_params / (lay.tp * lay.pp):.4g} per device; dp = {lay.dp}",
        f"  bytes per parameter ({dtype} training): {pb} {what['params']}, {gb} "
        f"{what['grads']}, {ob} {what['optimizer']}",
        "  ZeRO-1 shards the optimizer states over dp, ZeRO-2 the gradients too, ZeRO-3 the "
        "weights too:",
    ]
    for r in rows:
        verdict = f"  REJECTED: {r.rejected_reason}" if r.rejected_reason else "  fits"
        lines.append(f"    zero{r.layout.zero}: {_state_formula(r, dtype)}{verdict}")
    lines.append(
        "  activations are not counted: a bare parameter count has no shape (give --model, "
        "or --layers/--hidden/--heads/--vocab/--seq-len, for a full plan)"
    )
    return "\n".join(lines)


def _check_plan_flags(args: argparse.Namespace) -> None:
    """The flags every plan (a search or a ``--params`` table) reads, checked before it runs;
    ``--gpus`` defaulted."""
    for flag, value in (("--net", args.net), ("--out", args.out)):
        if value is not None:  # (they would be ignored: nothing is measured or written)
            raise ValueError(f"{flag} is a --calibrate flag: add --calibrate to measure this "
                             f"machine, or drop {flag}")
    if args.gpus is None:
        args.gpus = DEFAULT_GPUS
    if args.top < 1:
        raise ValueError(f"--top={args.top}: it must be a positive integer")
    load_profile(args.gpu)  # a bad profile name fails before anything else
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node={args.gpus_per_node}: it must be a positive integer "
                         "(leave it out for the profile's)")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        from .calibrate import calibrate_cli

        others = [k for k in vars(defaults_of(add_arguments)) if k not in _CALIBRATE_READS]
        _refuse_unread(args, others, "--calibrate measures this machine and writes a profile "
                       "(it reads --gpus, --net and --out)", "run the plan without --calibrate")
        return calibrate_cli(args)
    _check_plan_flags(args)
    if args.params is not None:
        return _params_mode(args)
    shape = shape_from_args(args)
    runtime(args.runtime)  # a bad runtime name fails before the search
    if args.verify and args.runtime != "distllm":
        raise ValueError(f"--verify dry-runs distllm's own training code, not the code that "
                         f"--runtime {args.runtime} models: drop --verify, or --runtime")
    res = search(
        shape,
        args.gpus,
        args.gpus_per_node,
        args.gpu,
        dtype=args.dtype,
        pins=_pins(args),
        flash_attention=not args.no_flash,
        keep_rejected=args.explain or not args.json,  # the reason nothing fits is kept anyway
        runtime_name=args.runtime,
        exact=max(args.top, 2),  # the rows shown and the runner-up: ranked by one model
    )
    if args.verify:
        return _verify(args, shape, res)
    steps = _explained_steps(args, shape, res) if args.explain and res.ranked else None
    if args.json:
        out = {
            "model": shape.name,
            "gpus": args.gpus,
            "profile": args.gpu,
            "runtime": args.runtime,
            "search_seconds": res.seconds,
            # the leading rows timed by the pipeline simulator (the fastest by it, in order)
            "simulator_ranked": res.exact,
            # layouts too large for the simulator, timed by the closed form
            "simulator_declined": res.declined,
            "ranked": [e.as_dict() for e in res.ranked[: args.top]],
        }
        if args.explain:
            out["rejected"] = [e.as_dict() for e in res.rejected]
            if steps:
                out["ranked"][0]["step_terms_s"] = steps[0]
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        if res.ranked:
            print(explain(res.best, shape, res))
            if steps:
                print(steps[1])
            print(f"\ntop {min(args.top, len(res.ranked))} of {len(res.ranked)}:")
            for e in res.ranked[: args.top]:
                print("  " + _row(e))
        if args.explain:
            print(_rejections(res.rejected))
    if not res.ranked:
        res.best  # noqa: B018 - raises ValueError saying why nothing fits
    return 0


def _cost_model(args: argparse.Namespace, shape: ModelShape, res):
    from .cost import CostModel

    prof = load_profile(args.gpu)
    gpn = min(prof.gpus_per_node, args.gpus) if args.gpus_per_node is None else args.gpus_per_node
    dtype = args.dtype or default_dtype(prof)
    return CostModel(shape, prof, args.gpus, gpn, dtype=dtype,
                     flash_attention=not args.no_flash, runtime_name=args.runtime)


def _explained_steps(args: argparse.Namespace, shape: ModelShape, res):
    """(terms in seconds, text) of the chosen layout's step: the headline's estimate (its
    pipeline replayed by the simulator where the search ranked by it)."""
    from .breakdown import explain_step, step_terms

    cm = _cost_model(args, shape, res)  # per-block terms: no pipeline, no simulator needed
    best = res.best
    return step_terms(best, cm), explain_step(best, cm, simulated=res.exact > 0)


def _verify(args: argparse.Namespace, shape: ModelShape, res) -> int:
    """``--verify``: the dry run of the chosen layout against the planner's memory; exit code
    1 when its measured peak does not fit the profile's usable memory."""
    from .verify import verify

    best = res.best  # raises, saying why, when nothing fits
    # the canonical name (bf16 -> bfloat16), as the search used it
    dtype = training_dtype(args.dtype or default_dtype(args.gpu))
    v = verify(shape, best.layout, dtype=dtype, profile=args.gpu)
    if args.json:
        json.dump(v.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(v.report())
    if not v.fits:
        print(f"distllm plan: verify failed: {v.verdict()}", file=sys.stderr)
        return 1
    return 0
