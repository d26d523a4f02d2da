"""``distllm bench``: run the microbenchmark suites, write results, report and plots.

Output in ``--out DIR`` (default ``runs/bench-<UTC time>``; a folder that already holds a
run's results is refused, so that nothing is overwritten or mixed): ``results.json`` and
``results.csv`` (one row per case and variant, with the machine), ``REPORT.md`` (a table per
suite with speed-ups and a verdict per case), ``<suite>_speedup.png`` and, for the overlap
suites, ``<suite>_timeline.png``; with ``--compare OLD_DIR`` also ``COMPARE.md``. A markdown
table goes to stdout. ``--doctor`` instead profiles a small distllm.nn model on 2 gloo ranks
and reports, per layer, how much of each collective was hidden (the library's
:func:`distllm.diagnostics.diagnose`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import shlex
import sys
from pathlib import Path

from distllm.bench.train_e2e import BREAKDOWN_FILE

from distllm.cli import defaults_of
from distllm.dtypes import canonical_dtype
from distllm.parallel.tensor.layers import OVERLAP_MODES

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from distllm.bench.suite import SUITES

    p.add_argument("--suite", default="all",
                   help=f"comma-separated suites or 'all' (default): {', '.join(SUITES)}")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, few repetitions: the whole suite in minutes on 2 cores")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--shapes", default=None,
                   help="explicit shapes 'M,K,N;M,K,N' (default: each suite's presets)")
    p.add_argument("--model", default=None, metavar="NAMES",
                   help="train_e2e only, instead of --shapes: comma-separated GPT presets "
                        "(e.g. tiny,gpt2-small), each one size: the preset's blocks and hidden "
                        "size at the suite's batch and sequence for that size")
    p.add_argument("--net", default=None, metavar="RATE",
                   help="emulated link for multi-rank suites, e.g. 2gbit (root + iproute2)")
    p.add_argument("--reps", type=int, default=None, help="override each suite's repetitions")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="a new folder, or one without an earlier run's results (default "
                        "runs/bench-<time>)")
    p.add_argument("--compare", default=None, metavar="OLD_DIR",
                   help="compare with an earlier run's folder; writes COMPARE.md")
    p.add_argument("--fail-on-regression", action="store_true",
                   help="with --compare: exit 1 when a regression beyond the spread is found")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="with --compare: extra relative margin before a change counts (0.05=5%%)")
    p.add_argument("--list", action="store_true", help="list the suites and whether each runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--doctor", action="store_true",
                   help="profile a small distllm.nn model on 2 gloo ranks and report, per "
                        "layer, how much communication was hidden; fails if an asked-for "
                        "overlap does not happen")
    p.add_argument("--overlap", default="chunked", choices=list(OVERLAP_MODES),
                   help="with --doctor: the overlap mode the model's layers are built with")
    p.add_argument("--require-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="with --doctor: fail unless every overlap-capable layer overlaps "
                        "(default: only layers built with overlap='chunked' must)")
    p.add_argument("--steps", type=int, default=3, help="with --doctor: steps to profile")


def _check_rate(rate: str) -> None:
    """ValueError naming ``--net`` (``parse_rate``'s own) unless ``rate`` is a link rate."""
    from distllm.testing.netem import parse_rate

    parse_rate(rate)


_MODEL_SUITES = ("train_e2e",)  # the suites whose model sizes --model sets


def _check_model(args: argparse.Namespace) -> None:
    """``--model``: known GPT presets (kept as a list of names), for a suite that takes it,
    not with ``--shapes``."""
    from distllm.bench.suite import parse_suites
    from distllm.bench.train_e2e import model_names

    args.model = model_names(args.model)
    if args.shapes:
        raise ValueError("--model and --shapes both set train_e2e's model sizes: give one")
    if args.doctor:
        raise ValueError("--model sets train_e2e's model sizes; --doctor does not take it")
    others = [n for n in parse_suites(args.suite) if n not in _MODEL_SUITES]
    if others:
        raise ValueError(f"--model sets the model sizes of {', '.join(_MODEL_SUITES)} only, "
                         f"and --suite {args.suite} also runs {', '.join(others)}: use "
                         "--suite train_e2e")


# the flags of a suites run, and those of --doctor alone
_SUITE_FLAGS = ("suite", "quick", "device", "dtype", "shapes", "reps", "compare",
                "fail_on_regression", "tolerance")
_DOCTOR_FLAGS = ("overlap", "require_overlap", "steps")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_doctor_flags(args: argparse.Namespace) -> None:
    """A flag of the other mode would be ignored without a word: refuse it, naming it (a
    CI gate of ``--doctor --compare OLD --fail-on-regression`` could never fail)."""
    default = vars(defaults_of(add_arguments))
    if args.doctor:
        given = [_flag(k) for k in _SUITE_FLAGS if getattr(args, k) != default[k]]
        if given:
            raise ValueError(f"{given[0]}: --doctor takes none (it profiles its own small "
                             f"model on 2 CPU ranks and writes no results.json); drop "
                             f"{given[0]}, or --doctor")
    else:
        given = [_flag(k) for k in _DOCTOR_FLAGS if getattr(args, k) != default[k]]
        if given:
            raise ValueError(f"{given[0]} only applies with --doctor: add --doctor, or drop "
                             f"{given[0]}")


def _check(args: argparse.Namespace) -> None:
    """Validate the knobs; each error names the option and what works."""
    try:
        args.dtype = canonical_dtype(args.dtype)
    except ValueError:
        raise ValueError(f"--dtype {args.dtype!r} is unknown; use one of float32, bfloat16, "
                         "float16") from None
    if args.shapes:
        from distllm.bench.harness import parse_shapes
        from distllm.bench.suite import SUITES, parse_suites

        given = parse_shapes(args.shapes)
        takers = [SUITES[n] for n in parse_suites(args.suite) if SUITES[n].shape_dims]
        if not takers and not args.doctor:
            raise ValueError(f"--shapes: --suite {args.suite} measures its own presets and "
                             f"takes no shapes; drop --shapes")
        for suite in takers:
            suite.check_shapes(given, args.shapes, args.device)
    if args.model is not None:
        _check_model(args)
    if args.net:
        _check_rate(args.net)
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps {args.reps}: must be >= 1")
    if args.fail_on_regression and not args.compare:
        raise ValueError("--fail-on-regression needs --compare OLD_DIR")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise ValueError(f"--tolerance {args.tolerance}: give a relative margin >= 0 (0.05 "
                         f"is 5%)")
    if args.tolerance and not args.compare:
        raise ValueError("--tolerance is the margin of --compare OLD_DIR: add --compare, or "
                         "drop --tolerance")
    _check_doctor_flags(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")


_RECORDS = ("results.json", "results.csv", "REPORT.md", "COMPARE.md", "DOCTOR.md", "doctor.json",
            BREAKDOWN_FILE)
"""The files that make a folder hold the results of a run (a benchmark run's or the doctor's;
train_e2e's breakdowns are written case by case, so a run interrupted before results.json
leaves them)."""


def _out_dir(path: Path) -> Path:
    """``path`` as the run's output folder, created if need be. Refused (ValueError naming
    ``--out``) where it is a file, cannot be created, or holds an earlier run's results
    (:data:`_RECORDS`): the run would overwrite them, or mix its files with theirs."""
    try:
        if path.exists() and not path.is_dir():
            raise ValueError(f"--out {path} is a file, not a folder: pass a folder as --out")
        held = [f for f in _RECORDS if (path / f).exists()]
        if held:
            raise ValueError(f"--out {path} holds the results of an earlier run "
                             f"({', '.join(held)}): pass another --out")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create the folder ({exc.strerror or exc}): "
                         "pass another --out") from None
    return path


def _list() -> int:
    from distllm.bench.suite import availability

    rows = availability()
    width = max(len(name) for name, _, _ in rows)
    for name, ok, why in rows:
        print(f"{name:{width}s} {'available  ' if ok else 'UNAVAILABLE'}  {why}")
    return 0


def _stdout_tables(rows: list[dict]) -> str:
    from distllm.bench.report import by_case, suite_table, verdict

    parts = []
    for s in dict.fromkeys(r["suite"] for r in rows):
        srows = [r for r in rows if r["suite"] == s]
        parts += [f"## {s}", "", suite_table(srows), ""]
        parts += [f"- `{c}`: {verdict(cr)}" for (_, c), cr in by_case(srows).items()] + [""]
    return "\n".join(parts)


def _compare(args: argparse.Namespace, old: tuple[list[dict], dict], rows: list[dict],
             machine: dict, out: Path) -> int:
    from distllm.bench.compare import (
        compare_rows,
        compare_table,
        regressions,
        winners,
        winners_table,
    )
    from distllm.bench.rows import write_text_atomic

    old_rows, old_machine = old
    changes = compare_rows(old_rows, rows, tolerance=args.tolerance, old_machine=old_machine,
                           new_machine=machine)
    table = compare_table(changes, old_machine, machine)
    table += "\n\n" + winners_table(winners(old_rows, rows))
    write_text_atomic(out / "COMPARE.md", f"# Changes against {args.compare}\n\n{table}\n")
    print(f"\n## Changes against {args.compare}\n\n{table}")
    regs = regressions(changes)
    if regs and args.fail_on_regression:
        print(f"distllm bench: {len(regs)} regression(s) beyond the measured spread",
              file=sys.stderr)
        return 1
    return 0


def _doctor_rank(overlap: str, require: bool | None, steps: int, trace: str | None) -> dict:
    """One rank of ``--doctor``: two MLP blocks (column-parallel GEMM + GeLU, then
    row-parallel GEMM) at tp=2, SGD steps on a fixed batch, diagnosed."""
    import torch

    import distllm
    from distllm.diagnostics import diagnose
    from distllm.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    dims = distllm.ParallelDims(tp=2)
    h, m = 256, 512
    layers = []
    for _ in range(2):
        layers += [ColumnParallelLinear(h, 4 * h, dims, activation="gelu", overlap=overlap),
                   RowParallelLinear(4 * h, h, dims, overlap=overlap)]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(m, h)  # (tokens, hidden), the same on both ranks
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    rep = diagnose(model, step, steps, require_overlap=require, raise_on_failure=False,
                   trace_path=trace if trace and dims.rank == 0 else None)
    return {"report": rep.as_dict(), "markdown": rep.to_markdown()}


def _doctor(args: argparse.Namespace) -> int:
    from distllm.testing import run_distributed

    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be >= 1")
    out = _out_dir(Path(args.out)) if args.out else None
    trace = str((out / "doctor_trace.json").resolve()) if out is not None else None
    link = "loopback"
    with contextlib.ExitStack() as stack:
        kw: dict = {}
        if args.net:
            from distllm.testing.netem import EmulatedNetwork

            net = stack.enter_context(EmulatedNetwork(2, args.net))
            link = args.net if net.available else f"loopback ({args.net} unavailable: " \
                                                   f"{net.reason})"
            if net.available:
                kw = {"setup": net.setup, "env": net.env}
        res = run_distributed(_doctor_rank, 2, args.overlap, args.require_overlap, args.steps,
                              trace, timeout=300, **kw)
    print(f"distllm bench --doctor: tp=2 on 2 gloo ranks over {link}, layers built with "
          f"overlap={args.overlap!r}\n\n{res[0]['markdown']}")
    if out is not None:
        from distllm.bench.plots import plot_events
        from distllm.bench.rows import write_text_atomic

        reports = [{**r["report"], "trace": "doctor_trace.json" if i == 0 else None}
                   for i, r in enumerate(res)]  # the trace path relative to the folder
        write_text_atomic(out / "doctor.json", json.dumps(reports, indent=1))
        cmd = "distllm bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
            if sys.argv[1:2] == ["bench"] else "distllm bench --doctor"
        write_text_atomic(out / "DOCTOR.md", (
            f"# Overlap doctor\n\nCommand: `{cmd}` (tp=2, 2 gloo ranks over {link}; "
            f"rank 0 shown, every rank in doctor.json)\n\n{res[0]['markdown']}\n\n"
            "![doctor_timeline.png](doctor_timeline.png)\n"))
        plot_events(res[0]["report"]["timeline"], f"rank 0, one step, overlap={args.overlap!r}",
                    out / "doctor_timeline.png")
    failed = [i for i, r in enumerate(res) if not r["report"]["ok"]]
    if failed:
        print(f"distllm bench --doctor: overlap asked for but not happening (ranks {failed})",
              file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from distllm.bench import plots, report
    from distllm.bench.harness import BenchConfig
    from distllm.bench.rows import write_rows
    from distllm.bench.suite import SUITES, parse_suites, run_suites

    if args.list:
        return _list()
    _check(args)
    if args.doctor:
        return _doctor(args)
    names = parse_suites(args.suite)
    old = None
    if args.compare:  # read the earlier run first: a bad path fails before any benchmark runs
        from distllm.bench.compare import load_results

        old = load_results(args.compare)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = _out_dir(Path(args.out or f"runs/bench-{stamp}"))
    cfg = BenchConfig(quick=args.quick, device=args.device, dtype=args.dtype,
                      shapes=args.shapes, net=args.net, out=out, reps=args.reps,
                      extra={"model": args.model} if args.model else {})
    load0 = report.loadavg()
    res = run_suites(names, cfg, progress=not args.no_progress)
    rows = report.annotate(res.rows)
    meta = {"command": "distllm bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            if sys.argv[1:2] == ["bench"] else None,
            "suites": names, "elapsed_s": res.elapsed_s,
            "loadavg": f"{load0} / {report.loadavg()}", "config": {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()}}
    jp, _ = write_rows(rows, out, run=meta)  # (written once, whole)
    data = json.loads(jp.read_text())
    pngs = plots.plot_all(rows, out, {n for n in names if SUITES[n].overlap})
    report.write_report(rows, data["machine"], out, meta,
                        {n: SUITES[n].title for n in names}, pngs)
    print(_stdout_tables(rows))
    print("## Summary\n\n" + report.summary_table(rows) + "\n")
    print(f"wrote {out}/: results.json results.csv REPORT.md "
          + " ".join(p for ps in pngs.values() for p in ps))
    if not any(report._ok(r) for r in rows):  # a run that measured nothing has not succeeded
        why = next((r.get("reason") for r in rows if r.get("reason")), "no rows")
        print(f"distllm bench: nothing was measured ({len(rows)} rows, none ok; the first "
              f"says: {' '.join(str(why).split())[:300]}); see {out}/REPORT.md", file=sys.stderr)
        return 1
    if old is None:
        return 0
    return _compare(args, old, rows, {**data["machine"], "loadavg": meta["loadavg"]}, out)
