"""The suite registry and the loop behind ``distllm bench``.

A suite is a module (``bench/<name>.py``, installed as ``distllm.bench.<name>``) with
``SUITE``, ``cases(cfg)``, ``setup(cfg, case)`` and ``rows(cfg, case, result)``: the contract
of the one runner, :mod:`distllm.bench.harness`. :func:`run_suites` imports each selected
module, runs its cases one by one (one step of the progress bar each) and returns every row.
Nothing is silently dropped:

- a module that is missing or fails to import gives one row with ``status="unavailable"``
  and the import error as ``reason``;
- a case (or a module's ``cases``) that raises gives one row with ``status="error"`` and
  the exception; a case that returns no rows, one row saying so.

Two suites may share a module (``ddp`` and ``zero`` both live in ``ddp_overlap``): the
module runs once with ``cfg.extra["suites"]`` naming the suites wanted, and each row goes to
the suite it names in ``row["suite"]``, or else by its variant name (see :func:`_assign`).
A row naming a suite outside the registry (a module's own sub-suite, such as
``train_overhead`` from ``train_e2e``) keeps that name and follows its module's suites.
The seconds each suite took are those of its own cases (:func:`_case_suite`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from distllm.bench.harness import BenchConfig, Case, run_case
from distllm.bench.rows import row

__all__ = ["Suite", "SUITES", "parse_suites", "availability", "run_suites", "SuiteRun"]

_CONTRACT = ("cases", "setup", "rows")
CPU_RANKS = 2
"""The gloo ranks a suite's distributed cases run on CPU."""


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # importable module with SUITE, cases(cfg), setup(cfg, case), rows(...)
    title: str
    overlap: bool = False  # an overlap suite: its rows may carry a timeline to draw
    shape: str = ""  # the form of a shape --shapes gives it ("M,K,N"); "": it takes none
    shape_dims: tuple[int, ...] = ()  # the integers a shape may have
    split_dims: tuple[int, ...] = ()  # a shape's dimensions its 2 CPU ranks split
    check: str = ""  # the module's own check of shapes on CPU, check(shapes, spec), if any

    def check_shapes(self, shapes: list[tuple[int, ...]], spec: str, device: str = "cpu"
                     ) -> None:
        """ValueError naming ``--shapes`` where one of ``shapes`` is not of this suite's
        form, or (on CPU, where the suite runs 2 ranks) has a dimension they split that 2
        does not divide, or fails the module's own check (:attr:`check`: what its layouts
        need of a shape)."""
        bad = [s for s in shapes if len(s) not in self.shape_dims]
        if bad:
            raise ValueError(f"--shapes {spec!r}: {self.name} takes shapes '{self.shape}' "
                             f"({' or '.join(map(str, self.shape_dims))} integers), not "
                             f"{','.join(map(str, bad[0]))}")
        if device != "cpu":
            return
        names = self.shape.split(",")
        for s in shapes:
            for i in self.split_dims:
                if s[i] % CPU_RANKS:
                    raise ValueError(
                        f"--shapes {spec!r}: {self.name} splits {names[i]} over its "
                        f"{CPU_RANKS} ranks, which {s[i]} (in {','.join(map(str, s))}) does not "
                        f"divide; choose {names[i]} a multiple of {CPU_RANKS}")
        if self.check:
            getattr(importlib.import_module(self.module), self.check)(shapes, spec)


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("linear_gelu", "distllm.bench.linear_gelu", "Fused GEMM + bias + GeLU",
          shape="M,K,N", shape_dims=(3,)),
    Suite("parallel_mlp", "distllm.bench.parallel_mlp",
          "Tensor-parallel MLP: fused against unfused against DTensor",
          shape="tokens,hidden,ffn", shape_dims=(3,), split_dims=(2,)),
    Suite("row_overlap", "distllm.bench.row_parallel_overlap",
          "Row-parallel GEMM overlapped with its all-reduce", overlap=True, shape="M,K,N",
          shape_dims=(3,)),
    Suite("sp_overlap", "distllm.bench.sp_overlap",
          "Sequence-parallel all-gather / reduce-scatter overlap", overlap=True, shape="M,K,N",
          shape_dims=(3,), split_dims=(0,)),
    Suite("ddp", "distllm.bench.ddp_overlap", "DDP gradient all-reduce overlapped with backward",
          overlap=True),
    Suite("zero", "distllm.bench.ddp_overlap", "ZeRO-1/2/3 reduce-scatter overlapped with backward",
          overlap=True),
    Suite("pipeline", "distllm.bench.pipeline", "Pipeline schedules: bubble and step time"),
    Suite("train_e2e", "distllm.bench.train_e2e", "End-to-end training step against PyTorch",
          shape="L,H,B,S[,M]", shape_dims=(4, 5), check="check_shapes"),
    Suite("plan_validation", "distllm.bench.plan_validation",
          "Planner predictions against measured training steps"),
]}


def parse_suites(spec: str | None, registry: dict[str, Suite] | None = None) -> list[str]:
    """``"a,b"`` or ``"all"`` -> suite names, in registry order; unknown names raise."""
    registry = SUITES if registry is None else registry
    if spec is None or spec.strip() == "all":
        return list(registry)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    if not wanted:
        raise ValueError(f"--suite {spec!r} names no suite; choose from {', '.join(registry)} "
                         f"or 'all'")
    bad = [s for s in wanted if s not in registry]
    if bad:
        raise ValueError(f"--suite: unknown suite(s) {', '.join(bad)}; choose from "
                         f"{', '.join(registry)} or 'all'")
    return [s for s in registry if s in wanted]


def _import(modname: str) -> tuple[Any | None, str]:
    """The suite module, or None and why it cannot be used."""
    try:
        mod = importlib.import_module(modname)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported as a reason
        return None, f"{modname} cannot be imported: {type(exc).__name__}: {exc}"
    lacks = [n for n in _CONTRACT if not callable(getattr(mod, n, None))]
    if lacks or not isinstance(getattr(mod, "SUITE", None), str):
        return None, (f"{modname} is not a suite: it lacks "
                      f"{', '.join(lacks + ([] if hasattr(mod, 'SUITE') else ['SUITE']))}")
    return mod, ""


def availability(registry: dict[str, Suite] | None = None) -> list[tuple[str, bool, str]]:
    """(name, available, reason) per suite: whether its module imports and is a suite."""
    out = []
    for name, s in (SUITES if registry is None else registry).items():
        mod, why = _import(s.module)
        out.append((name, mod is not None, why or s.title))
    return out


@dataclass
class SuiteRun:
    """What the runner gives back: every row, and the seconds each suite took."""

    rows: list[dict]
    elapsed_s: dict[str, float]


def _failure_row(suite: str, status: str, reason: str, case: str = "-") -> dict:
    return row(suite, case, "-", status=status, reason=reason)


_TRACEBACK = "Traceback (most recent call last):"


def _error(names: list[str], exc: BaseException, label: str) -> list[dict]:
    """One error row per suite, naming the exception and where it was raised. A failure
    that carries a rank's traceback (:class:`~distllm.testing.DistributedFailure`) is named
    by its first line and the rank's exception, raised where the rank's traceback ends."""
    text = str(exc)
    if _TRACEBACK in text:
        head, _, rest = text.partition(_TRACEBACK)
        tb = rest.split("\n(ranks ")[0].strip("\n").splitlines()
        # the exception: the first unindented line after the last frame (a message of
        # several lines starts there)
        frame = max((i for i, ln in enumerate(tb) if ln.lstrip().startswith("File ")),
                    default=-1)
        last = next((ln for ln in tb[frame + 1:] if ln and not ln[0].isspace()), "")
        text = f"{head.strip()} {last}".strip()
    else:
        tb = traceback.format_exc(limit=-3).strip().splitlines()
    where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File")), "")
    return [_failure_row(n, "error", f"{type(exc).__name__}: {text} ({where})", label)
            for n in names]


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


def _run_case(mod: Any, names: list[str], cfg: BenchConfig, case: Case,
              registered: frozenset[str] = frozenset()) -> list[dict]:
    """The rows of one case; each carries the case's label (``extra.case_label``), which its
    own case name may extend (with the network, say), so that a later run whose case failed
    (one error row, case = the label) can be matched to these rows."""
    # a case of one suite of a shared module fails that suite only
    owners = [case.suite] if case.suite in names else names
    try:
        rows = run_case(mod, cfg, case)
    except Exception as exc:  # noqa: BLE001 - a failing case is a row, not a crash
        return _error(owners, exc, case.label)
    if not rows:
        return [_failure_row(n, "error", "rows() returned no rows", case.label) for n in owners]
    out = []
    for r in rows:
        own = r.get("suite")
        r = {**row(names[0], case.label, "-"), **r}
        if own not in names and (not own or own in registered or len(names) > 1):
            r["suite"] = _assign(r, names) if len(names) > 1 else names[0]
        # else: a sub-suite of this module's own (e.g. train_overhead): kept under its name
        r["status"] = r.get("status") or "ok"
        r["extra"] = {**(r.get("extra") or {}), "case_label": case.label}
        out.append(r)
    return out


def _case_suite(case: Case, rows: list[dict], group: list[str]) -> str:
    """The suite of ``group`` whose time a case counts to: the one it names, else the one
    of its first row, else the first of the group."""
    if case.suite in group:
        return case.suite
    return next((r["suite"] for r in rows if r.get("suite") in group), group[0])


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[str, bool], None]]:
    """Yield ``step(description, advance)``: a rich progress bar on stderr."""
    if not enabled:
        yield lambda desc, adv: None
        return
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


def _groups(names: list[str], registry: dict[str, Suite]) -> list[tuple[str, list[str]]]:
    """Selected suites grouped by module, in order: [(module, [suite, ...]), ...]."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(registry[n].module, []).append(n)
    return list(groups.items())


def _plan(names: list[str], cfg: BenchConfig, registry: dict[str, Suite]):
    """Per module: its suites, the module, the config it runs with and its cases (or the
    rows that say why it cannot run)."""
    plan, failed = [], {}
    for i, (modname, group) in enumerate(_groups(names, registry)):
        mod, why = _import(modname)
        if mod is None:
            failed[i] = [_failure_row(n, "unavailable", why) for n in group]
            continue
        c = dataclasses.replace(cfg, extra={**cfg.extra, "suites": list(group)})
        try:
            cases = list(mod.cases(c))
        except Exception as exc:  # noqa: BLE001 - a module that cannot list its cases
            failed[i] = _error(group, exc, "-")
            continue
        if not cases:
            failed[i] = [_failure_row(n, "error", "cases() returned no cases") for n in group]
            continue
        plan.append((i, group, mod, c, cases))
    return plan, failed


def run_suites(names: list[str], cfg: BenchConfig, *, progress: bool = True,
               registry: dict[str, Suite] | None = None) -> SuiteRun:
    """Run the named suites and return all their rows (see the module docstring)."""
    registry = SUITES if registry is None else registry
    plan, per_group = _plan(names, cfg, registry)  # rows by group, in registry order
    elapsed: dict[str, float] = {}
    known = frozenset(registry)
    with _progress(sum(len(p[-1]) for p in plan), progress) as step:
        for i, group, mod, c, cases in plan:
            got: list[dict] = []
            elapsed.update(dict.fromkeys(group, 0.0))
            for case in cases:
                desc = f"{'+'.join(group)} {case.label}"
                step(desc, False)
                t0 = time.perf_counter()
                case_rows = _run_case(mod, group, c, case, known)
                elapsed[_case_suite(case, case_rows, group)] += time.perf_counter() - t0
                got += case_rows
                step(desc, True)
            order = {n: j for j, n in enumerate(group)}
            per_group[i] = sorted(got, key=lambda r: order.get(r["suite"], len(order)))
    return SuiteRun([r for i in sorted(per_group) for r in per_group[i]], elapsed)
