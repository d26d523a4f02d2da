"""The suite registry and the runner behind ``distllm bench``.

A suite is a benchmark module (``bench/<name>.py``, installed as ``distllm.bench.<name>``)
that exposes ``run(cfg: BenchConfig) -> list[dict]`` (rows from ``harness.row``). The runner
imports each selected module, runs it, and returns every row it produced. Nothing is
silently dropped:

- a module that is missing or fails to import gives one row with ``status="unavailable"``
  and the import error as ``reason``;
- a module whose ``run`` raises gives one row with ``status="error"`` and the exception;
- a module that returns no rows gives one row with ``status="error"`` saying so.

Progress is shown per case when the module can list its cases: an optional
``cases(cfg) -> list[str]`` returns shape strings (from explicit ``--shapes "M,K,N;M,K,N"``
or its presets), and the runner then calls ``run`` once per case with ``cfg.shapes`` set to
it. Otherwise ``run`` is called once with ``cfg.shapes`` as given, one step of the bar.

Two suites may share a module (``ddp`` and ``zero`` both live in ``ddp_overlap``): the
module runs once with ``cfg.extra["suites"]`` naming the suites wanted, and each row goes to
the suite it names in ``row["suite"]``, or else by its variant name (see :func:`_assign`).
A row naming a suite outside the registry (a module's own sub-suite, such as
``train_overhead`` from ``train_e2e``) keeps that name and follows its module's suites.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from distllm.bench.harness import BenchConfig, row

__all__ = ["Suite", "SUITES", "parse_suites", "availability", "run_suites", "SuiteRun"]


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # importable module exposing run(cfg) -> list[dict]
    title: str
    overlap: bool = False  # an overlap suite: its rows may carry a timeline to draw


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("linear_gelu", "distllm.bench.linear_gelu", "Fused GEMM + bias + GeLU"),
    Suite("row_overlap", "distllm.bench.row_parallel_overlap",
          "Row-parallel GEMM overlapped with its all-reduce", overlap=True),
    Suite("sp_overlap", "distllm.bench.sp_overlap",
          "Sequence-parallel all-gather / reduce-scatter overlap", overlap=True),
    Suite("ddp", "distllm.bench.ddp_overlap", "DDP gradient all-reduce overlapped with backward",
          overlap=True),
    Suite("zero", "distllm.bench.ddp_overlap", "ZeRO-1/2/3 reduce-scatter overlapped with backward",
          overlap=True),
    Suite("pipeline", "distllm.bench.pipeline", "Pipeline schedules: bubble and step time"),
    Suite("train_e2e", "distllm.bench.train_e2e", "End-to-end training step against PyTorch"),
]}


def parse_suites(spec: str | None, registry: dict[str, Suite] | None = None) -> list[str]:
    """``"a,b"`` or ``"all"`` -> suite names, in registry order; unknown names raise."""
    registry = SUITES if registry is None else registry
    if not spec or spec.strip() == "all":
        return list(registry)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in wanted if s not in registry]
    if bad:
        raise ValueError(f"--suite: unknown suite(s) {', '.join(bad)}; choose from "
                         f"{', '.join(registry)} or 'all'")
    return [s for s in registry if s in wanted]


def _import(modname: str) -> tuple[Any | None, str]:
    try:
        return importlib.import_module(modname), ""
    except Exception as exc:  # noqa: BLE001 - any import failure is reported as a reason
        return None, f"{modname} cannot be imported: {type(exc).__name__}: {exc}"


def availability(registry: dict[str, Suite] | None = None) -> list[tuple[str, bool, str]]:
    """(name, available, reason) per suite: whether its module imports and has ``run``."""
    out = []
    for name, s in (SUITES if registry is None else registry).items():
        mod, why = _import(s.module)
        if mod is not None and not callable(getattr(mod, "run", None)):
            mod, why = None, f"{s.module} has no run(cfg)"
        out.append((name, mod is not None, why or s.title))
    return out


@dataclass
class SuiteRun:
    """What the runner gives back: every row, and the seconds each suite took."""

    rows: list[dict]
    elapsed_s: dict[str, float]


def _cases(mod: Any, cfg: BenchConfig) -> list[str | None]:
    if callable(getattr(mod, "cases", None)):
        try:
            return list(mod.cases(cfg)) or [None]
        except Exception:  # noqa: BLE001 - fall back to one run over the module's own shapes
            return [None]
    return [None]  # one call with cfg.shapes as given (the module may ignore it)


def _failure_row(suite: str, status: str, reason: str, case: str = "-") -> dict:
    return row(suite, case, "-", status=status, reason=reason)


def _assign(r: dict, names: list[str]) -> str:
    """The suite a row from a shared module belongs to: the one it names, else the suite
    whose name is part of the variant (``zero2`` -> ``zero``), else the first asked for."""
    if r.get("suite") in names:
        return r["suite"]
    v = str(r.get("variant", "")).lower()
    for n in names[1:]:
        if n in v:
            return n
    return names[0]


def _run_case(mod: Any, names: list[str], cfg: BenchConfig, case: str | None,
              registered: frozenset[str] = frozenset()) -> list[dict]:
    c = dataclasses.replace(cfg, shapes=case if case is not None else cfg.shapes,
                            extra={**cfg.extra, "suites": list(names)})
    label = case or "-"
    try:
        rows = mod.run(c)
    except Exception as exc:  # noqa: BLE001 - a failing module is a row, not a crash
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File")), "")
        return [_failure_row(n, "error", f"{type(exc).__name__}: {exc} ({where})", label)
                for n in names]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return [_failure_row(n, "error", f"run() returned {type(rows).__name__}, "
                             "not a list of row dicts", label) for n in names]
    if not rows:
        return [_failure_row(n, "error", "run() returned no rows", label) for n in names]
    out = []
    for r in rows:
        own = r.get("suite")
        r = {**row(names[0], label, "-"), **r}
        if own not in names and (not own or own in registered or len(names) > 1):
            r["suite"] = _assign(r, names) if len(names) > 1 else names[0]
        # else: a sub-suite of this module's own (e.g. train_overhead): kept under its name
        r["status"] = r.get("status") or "ok"
        out.append(r)
    return out


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[str, bool], None]]:
    """Yield ``step(description, advance)``; rich if present, else tqdm, else plain lines."""
    if not enabled:
        yield lambda desc, adv: None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        cols = (TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.description}"))
        with Progress(*cols, console=Console(stderr=True)) as p:
            task = p.add_task("", total=total)
            yield lambda desc, adv: p.update(task, description=desc, advance=int(adv))
        return
    except ImportError:
        pass
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def plain(desc: str, adv: bool) -> None:
            done[0] += int(adv)
            print(f"[bench {done[0]}/{total}] {desc}", file=sys.stderr, flush=True)

        yield plain
        return
    with tqdm(total=total, file=sys.stderr, desc="bench") as bar:
        def step(desc: str, adv: bool) -> None:
            bar.set_postfix_str(desc)
            bar.update(int(adv))

        yield step


def _groups(names: list[str], registry: dict[str, Suite]) -> list[tuple[str, list[str]]]:
    """Selected suites grouped by module, in order: [(module, [suite, ...]), ...]."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(registry[n].module, []).append(n)
    return list(groups.items())


def run_suites(names: list[str], cfg: BenchConfig, *, progress: bool = True,
               registry: dict[str, Suite] | None = None) -> SuiteRun:
    """Run the named suites and return all their rows (see the module docstring)."""
    registry = SUITES if registry is None else registry
    plan: list[tuple[int, list[str], Any, list[str | None]]] = []
    per_group: dict[int, list[dict]] = {}  # rows by group, concatenated in registry order
    for i, (modname, group) in enumerate(_groups(names, registry)):
        mod, why = _import(modname)
        if mod is not None and not callable(getattr(mod, "run", None)):
            mod, why = None, f"{modname} has no run(cfg)"
        if mod is None:
            per_group[i] = [_failure_row(n, "unavailable", why) for n in group]
            continue
        plan.append((i, group, mod, _cases(mod, cfg)))
    elapsed: dict[str, float] = {}
    known = frozenset(registry)
    with _progress(sum(len(c) for *_, c in plan), progress) as step:
        for i, group, mod, cases in plan:
            t0 = time.perf_counter()
            got: list[dict] = []
            for case in cases:
                step(f"{'+'.join(group)} {case or ''}".strip(), False)
                got += _run_case(mod, group, cfg, case, known)
                step(f"{'+'.join(group)} {case or ''}".strip(), True)
            order = {n: j for j, n in enumerate(group)}
            per_group[i] = sorted(got, key=lambda r: order.get(r["suite"], len(order)))
            for n in group:
                elapsed[n] = (time.perf_counter() - t0) / len(group)
    return SuiteRun([r for i in sorted(per_group) for r in per_group[i]], elapsed)
