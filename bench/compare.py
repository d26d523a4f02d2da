"""``distllm bench --compare OLD_DIR``: what changed against an earlier run.

Rows are matched by (suite, case, variant). Two kinds of regression are flagged, both only
beyond the measured spread (the p10..p90 bands of the two runs must not overlap):

- ``slower``: the variant's time rose: ``new.p10 > old.p90 * (1 + tolerance)``. Absolute
  times from two runs only mean something on the same machine: where the runs' machines
  differ (:func:`machines_differ`: another CPU model, core count, GPU, torch or CUDA), a
  time beyond the spread is a note on the row, not a verdict, and only the speed-ups can
  flag a regression.
- ``lost speed-up``: a fused variant's speed-up over the unfused one (a ratio measured
  within each run, so comparable across machines and load) fell beyond both runs' bands.

A variant that ran before and now does not is flagged ``lost``: its row is unavailable or
an error, or it is missing from a suite the new run ran. A case or a suite that raised leaves
one error row (variant ``-``, case the case's label, or ``-`` for the whole suite) instead of
rows whose names carry the network; it is matched to the earlier rows by suite and case
label (:func:`_label_match`) and its reason is the note of each one it lost. Rows of a suite
the new run did not run are ``gone``, not a regression. Improvements are the mirror images;
everything else is ``same``.

:func:`winners` checks that two runs agree on which variant wins each case: the same
winner, or a different one whose lead is within the new run's spread (bands overlap).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from distllm.bench.report import by_case, role_of, speedup_band

__all__ = ["Change", "load_results", "machines_differ", "compare_rows", "compare_table",
           "regressions", "winners", "winners_table"]

_REGRESSIONS = ("slower", "lost speed-up", "lost")


@dataclass
class Change:
    suite: str
    case: str
    variant: str
    kind: str  # slower | lost speed-up | lost | faster | gained speed-up | same | new | gone
    old_ms: float | None = None
    new_ms: float | None = None
    old_speedup: float | None = None
    new_speedup: float | None = None
    note: str = ""

    @property
    def regression(self) -> bool:
        return self.kind in _REGRESSIONS


# what compare_rows reads of every row: its name and whether it ran; and the times it
# compares, which must be numbers (or null) where present
ROW_KEYS = ("suite", "case", "variant", "status")
_TIME_KEYS = ("ms", "ms_p10", "ms_p90")


def _check_results(path: str | Path, p: Path, data: dict) -> None:
    """ValueError naming ``--compare`` unless ``data``'s machine (where given) is a dict and
    every row is a dict with :data:`ROW_KEYS` and numeric times: checked when the earlier run
    is read, before any benchmark runs, not when the comparison meets the bad entry."""
    machine = data.get("machine")
    if machine is not None and not isinstance(machine, dict):
        raise ValueError(f"--compare {path}: {p.name} has a 'machine' of type "
                         f"{type(machine).__name__}, not the dict `distllm bench` writes; give "
                         "the --out folder of an earlier `distllm bench` run")
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            raise ValueError(f"--compare {path}: row {i} of {p.name} is a "
                             f"{type(r).__name__}, not a result row (a dict with "
                             f"{', '.join(ROW_KEYS)})")
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"--compare {path}: row {i} of {p.name} has no {', '.join(missing)} "
                             f"(a result row has {', '.join(ROW_KEYS)})")
        bad = [k for k in _TIME_KEYS if r.get(k) is not None
               and (isinstance(r[k], bool) or not isinstance(r[k], int | float))]
        if bad:
            raise ValueError(f"--compare {path}: row {i} of {p.name} has a {bad[0]} of "
                             f"{r[bad[0]]!r}, not a number of milliseconds")


def load_results(path: str | Path) -> tuple[list[dict], dict]:
    """Rows and machine from ``DIR/results.json`` (or a results.json path), checked whole
    (:func:`_check_results`): a file that is not an earlier run's results is a ValueError
    naming ``--compare``, raised here, before any benchmark runs."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise FileNotFoundError(f"--compare: no results.json at {p} (give the --out folder of "
                                "an earlier `distllm bench` run)")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:  # not JSON, not UTF-8, cut short
        raise ValueError(f"--compare: {p} cannot be read as JSON ({exc}); give the --out "
                         f"folder of an earlier `distllm bench` run") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"--compare: {p} is not a distllm bench results.json (no 'rows')")
    _check_results(path, p, data)
    run = data.get("run") if isinstance(data.get("run"), dict) else {}
    return data["rows"], {**(data.get("machine") or {}), "loadavg": run.get("loadavg")}


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("status") == "ok" and isinstance(r.get("ms"), int | float) \
        and r["ms"] > 0


def _speedups(rows: list[dict]) -> dict[tuple, tuple[float, float, float]]:
    """(suite, case, variant) -> speed-up band over the case's fastest unfused variant."""
    out = {}
    for crows in by_case(rows).values():
        base = [r for r in crows if _ok(r) and role_of(r) == "unfused"]
        if not base:
            continue
        b = min(base, key=lambda r: r["ms"])
        for r in crows:
            if _ok(r) and role_of(r) == "fused":
                out[_key(r)] = speedup_band(b, r)
    return out


def _key(r: dict) -> tuple[str, str, str]:
    """(suite, case, variant): the case with the row's ``shape`` beside it where its name
    does not carry it (a pipeline stage's length, the overhead step's batch), so that rows of
    other shapes under one case name are not compared."""
    case, shape = str(r.get("case")), r.get("shape")
    if shape and str(shape) not in case and str(shape).replace("x", ",") not in case:
        case = f"{case} [{shape}]"
    return (str(r.get("suite")), case, str(r.get("variant")))


def _label_match(failure: dict, r: dict) -> bool:
    """Whether the failure row ``failure`` of one run (variant ``-``: a case or a suite that
    did not run) stands for row ``r`` of the other: same suite, and the failure's case is
    ``-`` (the whole suite), ``r``'s case label (``extra.case_label``, set by the runner), or,
    for rows without one, ``r``'s case itself or a run of whole words of it (row case names
    add the network to the label: ``fwd 256,256,512`` -> ``fwd 256,256,512 loopback``)."""
    if str(failure.get("suite")) != str(r.get("suite")):
        return False
    label = str(failure.get("case"))
    if label == "-":
        return True
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    if extra.get("case_label") is not None:
        return str(extra["case_label"]) == label
    return f" {label} " in f" {r.get('case')} "


def _failures(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") in ("error", "unavailable")
            and str(r.get("variant")) == "-"]


def _timed(r: dict) -> bool:
    """Whether a row's time was measured (it has repetitions and their p10..p90), not
    computed from other rows' medians (an ``ideal`` bound)."""
    return r.get("ms_p10") is not None and r.get("ms_p90") is not None


def _time_kind(o: dict, n: dict, tol: float) -> str:
    o10, o90 = o.get("ms_p10") or o["ms"], o.get("ms_p90") or o["ms"]
    n10, n90 = n.get("ms_p10") or n["ms"], n.get("ms_p90") or n["ms"]
    if n10 > o90 * (1 + tol):
        return "slower"
    if n90 * (1 + tol) < o10:
        return "faster"
    return "same"


def _lost_note(n: dict | None, stands_in: bool) -> str:
    """Why a row that ran before did not run now: its own row's reason, or that of the
    failure row of its case (``stands_in``) or suite."""
    if n is None:
        return "not in the new run"
    if not stands_in:
        return str(n.get("reason") or n.get("status"))
    what = "the whole suite" if str(n.get("case")) == "-" else f"case {n.get('case')}"
    return f"{what}: {n.get('status')}: {n.get('reason')}"


def machines_differ(old_machine: dict | None, new_machine: dict | None) -> bool:
    """Whether two runs ran on different machines (CPU model or GPU; core count, torch or CUDA
    version where both runs record one), so that their times are not comparable; False
    where neither machine is known. (A virtual machine may report one generic CPU name for
    guests of any size.)"""
    om, nm = old_machine or {}, new_machine or {}
    if not (om or nm):
        return False
    if (om.get("host_cpu"), om.get("gpu")) != (nm.get("host_cpu"), nm.get("gpu")):
        return True
    return any(om.get(k) is not None and nm.get(k) is not None and om[k] != nm[k]
               for k in ("cores", "torch", "cuda"))


def compare_rows(old: list[dict], new: list[dict], tolerance: float = 0.0,
                 old_machine: dict | None = None,
                 new_machine: dict | None = None) -> list[Change]:
    """One :class:`Change` per (suite, case, variant) present in either run; a new run's
    failure row that stands for rows of the old run is reported on those rows only.

    Where the machines differ (:func:`machines_differ`), a time beyond the spread is a note
    (``time slower ... another machine``), not a ``slower`` / ``faster`` verdict: only a
    speed-up (a ratio within each run) or a variant that stopped running is a regression."""
    other_machine = machines_differ(old_machine, new_machine)
    olds = {_key(r): r for r in old}
    news = {_key(r): r for r in new}
    osp, nsp = _speedups(old), _speedups(new)
    fails, new_suites = _failures(new), {str(r.get("suite")) for r in new}
    used: set[tuple[str, str, str]] = set()  # failure rows that stand for old rows
    out = []
    for k in list(dict.fromkeys([*olds, *news])):
        o, n = olds.get(k), news.get(k)
        stands_in = n is None and _ok(o)
        if stands_in:  # a case or a suite that failed as a whole: its one error row
            n = next((f for f in fails if _label_match(f, o)), None)
            used.update([_key(n)] if n is not None else [])
        c = Change(*k, kind="same", old_ms=o.get("ms") if o else None,
                   new_ms=n.get("ms") if n else None,
                   old_speedup=osp[k][1] if k in osp else None,
                   new_speedup=nsp[k][1] if k in nsp else None)
        if _ok(o) and not _ok(n):
            if n is None and k[0] not in new_suites:
                c.kind, c.note = "gone", "its suite did not run in the new run"
            else:
                c.kind, c.note = "lost", _lost_note(n, stands_in)
        elif _ok(n) and not _ok(o):
            c.kind, c.note = "new", "" if not o else f"was {o.get('status')}"
        elif _ok(o) and _ok(n) and not (_timed(o) and _timed(n)):
            c.note = "not timed (a bound computed from medians): no spread to judge it by"
        elif _ok(o) and _ok(n):
            c.kind = _time_kind(o, n, tolerance)
            if other_machine and c.kind != "same":  # times of two machines: no verdict
                c.kind, c.note = "same", (f"time {c.kind} beyond the spread, on another "
                                          "machine: not comparable, no verdict")
            if k in osp and k in nsp and c.kind != "slower":
                (olo, _, ohi), (nlo, _, nhi) = osp[k], nsp[k]
                if nhi * (1 + tolerance) < olo:
                    c.kind = "lost speed-up"
                elif c.kind == "same" and nlo > ohi * (1 + tolerance):
                    c.kind = "gained speed-up"
        else:
            c.note = "not measured in either run" if o else f"not measured: {_lost_note(n, False)}"
        out.append(c)
    return [c for c in out if (c.suite, c.case, c.variant) not in used - olds.keys()]


def _contenders(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        if _ok(r) and role_of(r) in ("fused", "unfused", "peer"):
            out.setdefault(_key(r)[:2], {})[str(r["variant"])] = r
    return out


ONE_SIDED = ("only in the old run", "only in the new run")


def winners(old: list[dict], new: list[dict]) -> list[tuple[str, str, str, str, str]]:
    """Per case: (suite, case, old winner, new winner, verdict), verdict being ``same``,
    ``same kind (<role>)`` (both fused, say: the decision stands), ``within spread`` (the old
    winner's band overlaps the new winner's in the new run) or ``changed``; a case with
    contenders in one run only has ``-`` for the other winner and the verdict ``only in the
    old run`` / ``only in the new run`` (unless its suite did not run at all in the other
    run: a suite left out is no finding)."""
    o, n = _contenders(old), _contenders(new)
    ran = [{str(r.get("suite")) for r in rows} for rows in (new, old)]  # the other run's
    out = []
    for k, runs, side in ((o.keys() - n.keys(), o, 0), (n.keys() - o.keys(), n, 1)):
        for case in (c for c in k if c[0] in ran[side]):
            w = min(runs[case].values(), key=lambda r: r["ms"])["variant"]
            out.append((*case, *((w, "-") if side == 0 else ("-", w)), ONE_SIDED[side]))
    for k in o.keys() & n.keys():
        ow = min(o[k].values(), key=lambda r: r["ms"])["variant"]
        nrow = min(n[k].values(), key=lambda r: r["ms"])
        nw = nrow["variant"]
        if ow == nw:
            v = "same"
        elif role_of(o[k][ow]) == role_of(nrow):
            v = f"same kind ({role_of(nrow)})"  # e.g. fused-auto and fused-cpu: same decision
        elif ow in n[k] and (n[k][ow].get("ms_p10") or n[k][ow]["ms"]) <= (
                nrow.get("ms_p90") or nrow["ms"]):
            v = "within spread"
        else:
            v = "changed"
        out.append((*k, ow, nw, v))
    return sorted(out)


def regressions(changes: list[Change]) -> list[Change]:
    return [c for c in changes if c.regression]


def _f(x: float | None, fmt: str = "{:.3g}") -> str:
    return "" if x is None else fmt.format(x)


def winners_table(wins: list[tuple[str, str, str, str, str]]) -> str:
    both = [v for *_, v in wins if v not in ONE_SIDED]
    agree = sum(v != "changed" for v in both)
    lines = [f"Which variant wins: {agree} of {len(both)} cases agree (same winner, one of the "
             "same kind, or a different one within the spread)."
             + (f" {len(wins) - len(both)} case(s) ran in one run only."
                if len(wins) > len(both) else ""), "",
             "| suite | case | old winner | new winner | agreement |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {c} | {o} | {n} | {v} |" for s, c, o, n, v in wins]
    return "\n".join(lines)


def compare_table(changes: list[Change], old_machine: dict | None = None,
                  new_machine: dict | None = None) -> str:
    """Markdown: a header about the two runs, then one line per change (regressions first)."""
    lines = []
    om, nm = old_machine or {}, new_machine or {}
    if om or nm:
        lines.append(f"Old run: {om.get('time')} git {om.get('git')} on {om.get('host_cpu')} "
                     f"/ {om.get('gpu')}; new run: {nm.get('time')} git {nm.get('git')} on "
                     f"{nm.get('host_cpu')} / {nm.get('gpu')}.")
        if machines_differ(om, nm):
            lines.append("The machines differ: their times are not comparable, so a time "
                         "beyond the spread is a note, not a verdict; only the speed-ups "
                         "(ratios within each run) and variants that stopped running count "
                         "as regressions.")
        if om.get("loadavg") or nm.get("loadavg"):
            lines.append(f"Load average (start / end): old {om.get('loadavg')}, new "
                         f"{nm.get('loadavg')}; a busier machine slows every variant alike, "
                         "so check the speed-ups before the times.")
        lines.append("")
    regs = regressions(changes)
    lines.append(f"{len(regs)} regression(s) beyond the measured spread, "
                 f"{len(changes)} rows compared.")
    lines += ["", "| suite | case | variant | old ms | new ms | change | old speed-up | "
              "new speed-up | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    order = sorted(changes, key=lambda c: (not c.regression, c.kind == "same"))
    for c in order:
        ch = f"{100 * (c.new_ms / c.old_ms - 1):+.1f}%" if c.old_ms and c.new_ms else ""
        flag = f"**REGRESSION ({c.kind})**" if c.regression else c.kind
        note = f" — {c.note}" if c.note else ""
        lines.append(f"| {c.suite} | {c.case} | {c.variant} | {_f(c.old_ms)} | {_f(c.new_ms)} "
                     f"| {ch} | {_f(c.old_speedup, '{:.2f}x')} | {_f(c.new_speedup, '{:.2f}x')} "
                     f"| {flag}{note} |".replace("\n", " "))
    return "\n".join(lines)
