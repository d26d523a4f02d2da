"""The verdicts of REPORT.md: the role of each variant, the speed-up bands, the flags of
impossible figures and the one-line verdict per case.

Each variant has a *role*, taken from ``row["extra"]["role"]`` when the benchmark module
sets it, else guessed from its name (:func:`role_of`):

- ``unfused``: the plain path being replaced (``unfused``, ``sequential``, ``no_overlap``,
  ``none``, ``eager``, ``reference``, ``baseline``);
- ``peer``: the best outside equivalent (``torch_*``, ``onednn``, ``addmm``, ``fsdp``, ...);
- ``ideal``: a bound computed from measured parts (``ideal``), never a contender;
- ``part``: a component timed alone (``*_only``, ``*_alone``, ``gemm``, ``allreduce``);
- ``control``: the baseline again, elsewhere in the round (an A/A control, set by the
  module): how far one variant reads from itself, never a contender; an auto note quotes it;
- ``fused``: everything else (the distllm paths: ``fused``, ``overlap``, ``chunked``, ``auto``).

Speed-ups are ratios of medians measured in the same run (``unfused.ms / variant.ms``),
with a band (:func:`speedup_band`): the 10th-90th percentiles of the ratios of the
repetitions that ran in the same round (the runner interleaves the variants). A win counts
only when the whole band is above 1 and, where the rounds pair, at least ``ceil(0.9 n)`` of
the ``n`` per-round ratios are above 1 (:func:`beyond_spread`): faster in nine rounds of
ten, and with fewer than 10 rounds in all of them; a loss likewise below 1.

A ``hidden_frac`` above its ceiling (``extra.hidden_ceiling``, else 1: nothing hides more
than all of what could hide) is impossible, so the measurement is wrong: :func:`annotate`
sets ``extra.above_ceiling`` on every row with a hidden share, and the tables mark such a
figure with ``⚠`` and a note. A share has no floor of its own: a schedule may run slower
than its parts one after the other by more than all of what could hide (a chunking penalty,
contention), so a large negative share is a result. What is flagged (:func:`below_floor`)
is a share below a floor its module sets (``extra.hidden_floor``), or one computed from
parts that do not add up to the step without overlap beyond their spread
(``extra.parts_add_up`` False): ``extra.below_floor``, the same mark and a note. A hidden
share's cell carries its band where the row has one (``extra.hidden_band``: the p10..p90
of the share taken round by round; single rounds may pass the ceiling, which marks only the
median; the printed share always lies within its printed band). A timed row faster than its
case's ``ideal`` bound (the parts' overlap at best) beyond its spread (its p90 below the
bound's p10, or below the bound where that has no band) is impossible too: :func:`annotate`
sets ``extra.below_ideal``, its time carries the same mark and a note. (A median alone a
little below the bound is what a variant that reaches the bound shows half the time.) A
verdict whose chosen variant or baseline is so flagged (above its ceiling or below the ideal)
recommends nothing: it says the measurement is not trustworthy. A verdict names the device
its rows ran on (``device``) and what they were measured on (``extra.stage``); on a synthetic
stage (``extra.synthetic``, e.g. fixed-duration sleeps) the verdict reports the ratio and
recommends nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from distllm.diagnostics.timing import PAIRED_MIN, paired_band

__all__ = ["role_of", "annotate", "verdict", "by_case", "speedup_band", "above_ceiling",
           "below_floor", "below_ideal", "beyond_spread"]

_IDEAL = ("ideal",)
_PART = ("_only", "_alone", "alone", "part:")
_UNFUSED = ("unfused", "sequential", "no_overlap", "nooverlap", "no-overlap", "eager",
            "reference", "baseline", "serial")
_PEER = ("torch", "onednn", "addmm", "fsdp", "peer", "megatron", "cublas", "dtensor",
         "pipelining", "transformer_engine")
_PART_EXACT = ("gemm", "allreduce", "all_reduce", "comm", "compute", "gemm_chunked")



def role_of(r: dict) -> str:
    """``fused`` | ``unfused`` | ``peer`` | ``ideal`` | ``part`` for a row (see module doc)."""
    extra = r.get("extra") or {}
    if isinstance(extra, dict) and extra.get("role"):
        return str(extra["role"])
    v = str(r.get("variant", "")).lower().replace("-", "_")
    if v in ("_", ""):
        return "-"
    if any(k in v for k in _IDEAL):
        return "ideal"
    if v in _PART_EXACT or any(k in v for k in _PART):
        return "part"
    if any(k in v for k in _UNFUSED) or v == "none" or v.endswith(("_none", "=none")):
        return "unfused"
    if any(k in v for k in _PEER):
        return "peer"
    return "fused"


def by_case(rows: Iterable[dict]) -> OrderedDict[tuple[str, str], list[dict]]:
    """Rows grouped by (suite, case), first-seen order."""
    out: OrderedDict[tuple[str, str], list[dict]] = OrderedDict()
    for r in rows:
        out.setdefault((r.get("suite"), str(r.get("case"))), []).append(r)
    return out


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and isinstance(r.get("ms"), int | float) and r["ms"] > 0


def _best(rows: list[dict], role: str) -> dict | None:
    c = [r for r in rows if _ok(r) and role_of(r) == role]
    return min(c, key=lambda r: r["ms"]) if c else None


def _band(r: dict) -> tuple[float, float]:
    return (r.get("ms_p10") or r["ms"], r.get("ms_p90") or r["ms"])


def _samples(r: dict) -> list[float] | None:
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    s = extra.get("samples_ms")
    if isinstance(s, list) and s and all(isinstance(x, int | float) and x > 0 for x in s):
        return s
    return None


def speedup_band(base: dict, r: dict) -> tuple[float, float, float]:
    """``(low, mid, high)`` of ``base`` over ``r``: ``mid`` is the ratio of the medians.

    Paired (both rows carry ``extra.samples_ms`` of the same run length, at least
    :data:`~distllm.diagnostics.timing.PAIRED_MIN`): the 10th and 90th percentiles of the
    per-repetition ratios ``base_i / r_i``. The runner interleaves the variants, so
    repetition ``i`` of each ran in the same round and a drift of the machine moves both
    (``low > 1`` alone does not say ``r`` was faster in nine rounds of ten with fewer than 10
    rounds: :func:`beyond_spread` counts them). Otherwise the widest ratio of
    the two p10..p90 bands, ``base.p10 / r.p90 .. base.p90 / r.p10`` (rows of different
    runs)."""
    mid = base["ms"] / r["ms"]
    a, b = _samples(base), _samples(r)
    band = paired_band(lambda x, y: x / y, a, b) if a is not None and b is not None else None
    if band is not None:
        return min(band[0], mid), mid, max(band[1], mid)
    (b10, b90), (r10, r90) = _band(base), _band(r)
    return b10 / r90, mid, b90 / r10


def beyond_spread(base: dict, r: dict) -> int:
    """1 where ``r`` is faster than ``base`` beyond the spread, -1 where slower, else 0: the
    whole :func:`speedup_band` on one side of 1 and, where the rounds pair (the same number
    of ``extra.samples_ms``, at least :data:`~distllm.diagnostics.timing.PAIRED_MIN`), at
    least ``ceil(0.9 n)`` of the ``n`` per-round ratios on that side too (all of them with
    fewer than 10 rounds; an interpolated p10 lets one slower round in 5-9 pass)."""
    lo, _, hi = speedup_band(base, r)
    a, b = _samples(base), _samples(r)
    rounds = ([x / y for x, y in zip(a, b, strict=True)]
              if a is not None and b is not None and len(a) == len(b) >= PAIRED_MIN else [])
    need = -(-9 * len(rounds) // 10)  # ceil(0.9 n) in integers
    if lo > 1.0 and sum(q > 1.0 for q in rounds) >= need:
        return 1
    if hi < 1.0 and sum(q < 1.0 for q in rounds) >= need:
        return -1
    return 0


def above_ceiling(r: dict) -> bool | None:
    """Whether ``r``'s hidden share exceeds its ceiling (None: the row has no hidden share)."""
    hid = r.get("hidden_frac")
    if not isinstance(hid, int | float):
        return None
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    ceiling = extra.get("hidden_ceiling")
    return hid > (ceiling if isinstance(ceiling, int | float) else 1.0)


def below_floor(r: dict) -> bool | None:
    """Whether ``r``'s hidden share is below the floor its module set (``extra.hidden_floor``;
    none by default) or was computed from parts that do not add up (``extra.parts_add_up``
    False); None: the row has no hidden share."""
    hid = r.get("hidden_frac")
    if not isinstance(hid, int | float):
        return None
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    floor = extra.get("hidden_floor")
    return (isinstance(floor, int | float) and hid < floor) or (
        extra.get("parts_add_up") is False)


def below_ideal(r: dict) -> bool:
    """Whether :func:`annotate` found ``r`` faster than its case's ``ideal`` row beyond the
    spread (``r``'s p90 below the ideal's p10, or below its median without a band)."""
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    return extra.get("below_ideal") is True


def annotate(rows: list[dict]) -> list[dict]:
    """Fill ``speedup_vs_unfused`` (if the module did not), ``extra.role``,
    ``extra.speedup_vs_peer``, ``extra.above_ceiling``, ``extra.below_floor`` and, on every
    timed row of a case with an ``ideal`` row but the parts, ``extra.below_ideal`` in place,
    per case; returns ``rows``."""
    for case_rows in by_case(rows).values():
        base, peer = _best(case_rows, "unfused"), _best(case_rows, "peer")
        ideal = _best(case_rows, "ideal")
        for r in case_rows:
            extra = r["extra"] if isinstance(r.get("extra"), dict) else {}
            extra["role"] = role_of(r)
            over, under = above_ceiling(r), below_floor(r)
            if over is not None:
                extra["above_ceiling"], extra["below_floor"] = over, under
            if (ideal is not None and _ok(r) and r.get("ms_p90") is not None
                    and extra["role"] not in ("ideal", "part")):
                bound = ideal["ms_p10"] if ideal.get("ms_p10") is not None else ideal["ms"]
                extra["below_ideal"] = r["ms_p90"] < bound
            if _ok(r) and peer is not None and r is not peer:
                extra["speedup_vs_peer"] = peer["ms"] / r["ms"]
            r["extra"] = extra
            if _ok(r) and base is not None and r.get("speedup_vs_unfused") is None:
                r["speedup_vs_unfused"] = base["ms"] / r["ms"]
    return rows


def _auto_note(rows: list[dict], base: dict | None) -> str:
    auto = next((r for r in rows if _ok(r) and "auto" in str(r["variant"]).lower()), None)
    if auto is None or base is None or auto is base:
        return ""
    lo, mid, hi = speedup_band(base, auto)
    b = base["variant"]
    ctl = next((r for r in rows if _ok(r) and role_of(r) == "control"), None)
    aa = f" ({b} against itself: {speedup_band(base, ctl)[1]:.2f}x)" if ctl else ""
    if hi < 1.0:
        return f"; auto is {1 / mid:.2f}x slower than {b} (a miss){aa}"
    return f"; auto runs at {mid:.2f}x of {b}{aa}"


def _stage(rows: list[dict]) -> tuple[str, bool]:
    """What a case was measured on (``extra.stage``) and whether that is synthetic."""
    for r in rows:
        extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
        if extra.get("stage"):
            return str(extra["stage"]), bool(extra.get("synthetic"))
    return "", False


def _device(rows: list[dict]) -> str:
    """The devices the measured rows of a case ran on (``device``), first seen first."""
    return "/".join(dict.fromkeys(str(r["device"]) for r in rows if _ok(r) and r.get("device")))


def verdict(rows: list[dict]) -> str:
    """One line for one case: who wins, by how much, and whether it is beyond the spread;
    prefixed with the device its rows ran on and what they were measured on when the rows
    say, and with no advice when that is synthetic."""
    line = _verdict(rows)
    stage, synthetic = _stage(rows)
    if synthetic:
        line = line.split(" — ")[0] + (" — measured on synthetic stages: not a "
                                       "recommendation (real compute decides)")
    where = ", ".join(w for w in (_device(rows), stage) if w)
    return f"on {where}: {line}" if where else line


def _distrust(rows: list[dict]) -> str:
    """Why a verdict between ``rows`` (the chosen variant and its baseline) is not to be
    trusted: each one flagged above its hidden-share ceiling or below the case's ideal."""
    why = [f"{r['variant']} " + " and ".join(
        w for w, bad in (("above its hidden-share ceiling", above_ceiling(r)),
                         ("faster than the ideal bound", below_ideal(r))) if bad)
        for r in rows if above_ceiling(r) or below_ideal(r)]
    return "; ".join(why)


def _verdict(rows: list[dict]) -> str:
    bad = [r for r in rows if r.get("status") != "ok"]
    fused, base = _best(rows, "fused"), _best(rows, "unfused")
    if base is None:
        ok = sorted((r for r in rows
                     if _ok(r) and role_of(r) not in ("ideal", "part", "control")),
                    key=lambda r: r["ms"])
        if len(ok) >= 2:
            mid = speedup_band(ok[1], ok[0])[1]
            sure = "" if beyond_spread(ok[1], ok[0]) > 0 else ", within the spread"
            return f"fastest: {ok[0]['variant']} ({mid:.2f}x over {ok[1]['variant']}{sure})"
        if ok:
            return _overhead_verdict(ok[0]) or (
                f"measured: {ok[0]['variant']} only (no unfused baseline in this case)")
        why = bad[0].get("reason") if bad else "no rows"
        return f"not measured here: {why}"
    if fused is None:
        return _penalty_verdict(rows, base) or (
            f"no fused variant ran here ({'; '.join(str(r.get('reason')) for r in bad) or '-'})")
    mid, side = speedup_band(base, fused)[1], beyond_spread(base, fused)
    name, note, b = fused["variant"], _auto_note(rows, base), base["variant"]
    doubt = _distrust([fused, base])
    if doubt:  # a time no schedule can reach: no win, no loss, no advice
        line = (f"{name} {mid:.2f}x over {b} — the measurement is not trustworthy ({doubt}): "
                "no verdict")
    elif side > 0:
        line = f"{name} wins by {mid:.2f}x over {b} — use it"
    elif side < 0:
        line = f"{name} loses ({mid:.2f}x, {1 / mid:.2f}x slower than {b}) — keep {b}"
    else:
        line = f"no gain here ({name} {mid:.2f}x, within the spread) — {b} is as good"
    peer = _best(rows, "peer")
    if peer is not None:
        pmid, pside = speedup_band(peer, fused)[1], beyond_spread(peer, fused)
        tag = "ahead of" if pside > 0 else "behind" if pside < 0 else "level with"
        line += f"; {tag} {peer['variant']} ({pmid:.2f}x)"
    return line + note


def _overhead_verdict(r: dict) -> str | None:
    """The verdict of a row that measures a step's fixed overhead (``extra.overhead_frac``),
    or None for another row."""
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    if "overhead_frac" not in extra:
        return None
    frac, band = extra["overhead_frac"], extra.get("overhead_band")
    if not isinstance(frac, int | float):
        return f"fixed overhead not read: {extra.get('overhead_unresolved') or 'no figure'}"
    spread = (f" (p10..p90 {100 * band[0]:.1f}..{100 * band[1]:.1f}%)"
              if isinstance(band, list | tuple) and len(band) == 2 else "")
    target = extra.get("target")
    met = _target_status(extra, "met")
    return (f"fixed overhead {100 * frac:.1f}% of the step outside operators{spread}"
            + (f", target {target}: {met}" if target and met else ""))


def _target_status(extra: dict, key: str) -> str:
    """``extra.target_status`` (judged on the figure's band, or its median where the row says
    so), else from the median's bool ``extra[key]`` (rows written before it); "" for none."""
    status = extra.get("target_status") or {True: "met", False: "missed"}.get(extra.get(key))
    if status and extra.get("target_judged_on", "").startswith("median"):
        status += " (on the median: no per-round values)"
    return status or ""


def _penalty_verdict(rows: list[dict], base: dict) -> str | None:
    """The verdict of a case that measures chunking penalties against a target (rows with
    ``extra.chunking_penalty`` and ``extra.meets_target``, as the GPU ``row_overlap`` case's:
    each chunked GEMM over the whole one, ``base``), or None for another case: each penalty,
    the target and whether it was met (the whole band of the penalty within it; missed where
    the whole band is beyond; else within the spread), and any slowdown measured beside
    (``extra.slowdown``)."""
    def extra(r: dict) -> dict:
        return r["extra"] if isinstance(r.get("extra"), dict) else {}

    pens = [r for r in rows if _ok(r) and isinstance(extra(r).get("chunking_penalty"), int | float)
            and isinstance(extra(r).get("meets_target"), bool)]
    if not pens:
        return None
    status = {str(r["variant"]): _target_status(extra(r), "meets_target") for r in pens}
    missed = [v for v, st in status.items() if st.startswith("missed")]
    unsure = [v for v, st in status.items() if st.startswith("within")]
    judged = ([f"missed ({', '.join(missed)})"] if missed else []) + (
        [f"within the spread ({', '.join(unsure)})"] if unsure else [])

    def band(r: dict) -> str:
        b = (extra(r).get("target_band") or [None])[0]
        return f" ({100 * b[0]:+.1f}..{100 * b[1]:+.1f}%)" if b and b[0] != b[1] else ""

    line = (f"chunking penalty over {base['variant']}: "
            + ", ".join(f"{r['variant']} {100 * extra(r)['chunking_penalty']:+.1f}%{band(r)}"
                        for r in pens)
            + (f", target {extra(pens[0])['target']}" if extra(pens[0]).get("target") else "")
            + (": " + ", ".join(judged) if judged else ": met"))
    if any(str(extra(r).get("target_judged_on", "")).startswith("median") for r in pens):
        line += " (on the medians: too few rounds for a band)"
    for r in rows:
        if _ok(r) and isinstance(extra(r).get("slowdown"), int | float):
            line += f"; {r['variant']} {100 * extra(r)['slowdown']:+.1f}% over {base['variant']}"
    return line
