"""``overlap="auto"`` on 2 gloo ranks: one measurement per shape, the same choice on every
rank, and, with the measurement's outcome forced each way, the fastest chunk count, a
geometric schedule, or the fallback to no overlap said once in the log; on CPU, the trial in
the step that decides between them (its rotation of schedules, its paired verdict, the MAX
over ranks, correct outputs from every schedule it runs). One spawn, each scenario its own
test. The geometric schedule's ratio, without ranks."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from distllm.parallel.tensor import overlap_tuner
from tests._errors import worst
from tests._spawn import SpawnCache, case_of, run_cases

DT = torch.float64


def _forced(times: dict[str, float | list[float]]):
    """A stand-in for one round of the tuner's measurement returning fixed times (ms): a
    number is every repetition's, a list each repetition's in turn; a geometric schedule
    (named ``<chunks>x<growth>``) takes ``times["geo"]`` (default: never the fastest)."""
    def timed(variants, comm, device, reps):
        return _read(times, variants)

    return timed


def _read(times: dict[str, float | list[float]], variants) -> dict[str, list[float]]:
    rounds = max((len(v) for v in times.values() if isinstance(v, list)), default=1)
    got = {n: times[n] if n in times else times.get("geo", 1e9) for n in variants}
    return {n: v if isinstance(v, list) else [v] * rounds for n, v in got.items()}


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, rec: logging.LogRecord) -> None:
        self.lines.append(rec.getMessage())


class _TrialRounds:
    """``with _TrialRounds(n):`` the trial in the step runs ``n`` rounds (0: no trial, the
    isolated confirmation decides, as on CUDA)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.old, overlap_tuner.TRIAL_ROUNDS = overlap_tuner.TRIAL_ROUNDS, self.n

    def __exit__(self, *exc) -> None:
        overlap_tuner.TRIAL_ROUNDS = self.old


def _real(dims, x) -> dict:
    """Calls of one shape with the real measurement and the real trial (2 rounds), each
    call's output against the float64 product of the full weight, summed over the ranks."""
    from distllm.nn import RowParallelLinear

    overlap_tuner.clear_cache()
    real, measured = overlap_tuner._measure_and_choose, []

    def counting(*args):
        measured.append(args[0])
        return real(*args)

    overlap_tuner._measure_and_choose = counting
    rw = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
    full = torch.empty(4, 8, dtype=DT)  # every rank's weight slice, gathered
    torch.distributed.all_gather(list(full.chunk(2, dim=1)), rw.weight.detach().contiguous())
    x_full = torch.empty(*x.shape[:-1], 8, dtype=DT)
    torch.distributed.all_gather(list(x_full.chunk(2, dim=-1)), x.contiguous())
    want = x_full @ full.T + rw.bias.detach()
    errs, runs, tuning = [], [], []
    try:
        with _TrialRounds(2), torch.no_grad():
            for _ in range(9):
                errs.append((rw(x) - want).abs().max().item())
                st = rw.overlap_stats.forward
                runs.append(st.chunks)
                tuning.append(rw.plan.tuning)
    finally:
        overlap_tuner._measure_and_choose = real
    choice = torch.tensor([float(st.chunks)])  # MAX over ranks: equal to ours if all agree
    torch.distributed.all_reduce(choice, op=torch.distributed.ReduceOp.MAX)
    return {"measured": len(measured), "calls": st.calls, "comm_ms_est": st.comm_ms_est,
            "reason": st.reason, "chunks": st.chunks, "max_chunks": choice.item(),
            "max_err": worst(errs), "runs": runs, "tuning": tuning}


def _forced_rounds(*rounds: dict[str, float]):
    """Like :func:`_forced`, with round ``i`` of the measurement reading ``rounds[i]``."""
    calls = []

    def timed(variants, comm, device, reps):
        times = rounds[min(len(calls), len(rounds) - 1)]
        calls.append(1)
        return _read(times, variants)

    return timed


def _forced_outcome(dims, x, times) -> tuple[str, int, int]:
    """``(mode, chunks, fallback log lines, reason, growth)`` of three calls with the outcome
    of the isolated rounds forced to ``times`` (no trial in the step: the confirmation round
    decides, as on CUDA)."""
    from distllm.nn import RowParallelLinear

    overlap_tuner.clear_cache()
    log = _Log()
    logging.getLogger("distllm").addHandler(log)
    real = overlap_tuner._timed
    overlap_tuner._timed = times if callable(times) else _forced(times)
    try:
        with _TrialRounds(0):
            layer = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
            for _ in range(3):
                layer(x)
    finally:
        overlap_tuner._timed = real
        logging.getLogger("distllm").removeHandler(log)
    f = layer.overlap_stats.forward
    return f.mode, f.chunks, len([m for m in log.lines if "falls back" in m]), f.reason, f.growth


def _forced_backward(dims, x, times) -> tuple[str, int, str]:
    """``(mode, chunks, reason)`` of a column-parallel backward (whose weight-gradient GEMM
    follows the all-reduce's launch) after three calls, the isolated rounds forced to
    ``times`` (no trial in the step)."""
    from distllm.nn import ColumnParallelLinear

    overlap_tuner.clear_cache()
    real = overlap_tuner._timed
    overlap_tuner._timed = _forced(times)
    try:
        with _TrialRounds(0):
            layer = ColumnParallelLinear(4, 8, dims, overlap="auto", dtype=DT)
            for _ in range(3):
                layer(x.clone().requires_grad_(True)).sum().backward()
    finally:
        overlap_tuner._timed = real
    b = layer.overlap_stats.backward
    return b.mode, b.chunks, b.reason


# the isolated rounds of every trial scenario: 2 chunks win the selection (the layer's own
# count, 4, is second; the geometric schedules never win)
_SELECTION = {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0}


# isolated rounds where 8 pieces growing by C/G = 1.5 (bounded to 1.49) win the selection
# and 2 equal pieces are the first round's fastest
_GEO_SELECTION = {"compute": 4.0, "sequential": 10.0, "2": 8.0, "4": 8.8, "8": 9.0,
                  "8x1.49": 6.0}


def _trial(dims, x, call_ms, rounds: int = 3, calls: int = 11, clear_at: int | None = None,
           selection: dict[str, float] = _SELECTION) -> dict:
    """``calls`` calls of one shape, the isolated rounds forced to ``selection`` and each
    call of the trial (``rounds`` rounds) taking ``call_ms(name, rank, round)`` ms (``name``:
    the schedule it ran); ``clear_at``: call :func:`overlap_tuner.clear_cache` after that
    many calls. What each call ran (chunks) and whether the layer was still tuning after it,
    the last reason, fallback log lines, and how many times the isolated rounds ran."""
    from distllm.nn import RowParallelLinear

    overlap_tuner.clear_cache()
    rank = torch.distributed.get_rank()
    counts: dict[str, int] = {}

    def fake_time(fn, name):
        r = counts.get(name, 0)
        counts[name] = r + 1
        return fn(), call_ms(name, rank, r)

    log, measured = _Log(), []
    real_timed, real_time, real_measure = (overlap_tuner._timed, overlap_tuner._time_call,
                                           overlap_tuner._measure_and_choose)

    def counting(*args):
        measured.append(args[0])
        return real_measure(*args)

    logging.getLogger("distllm").addHandler(log)
    overlap_tuner._timed, overlap_tuner._time_call = _forced(selection), fake_time
    overlap_tuner._measure_and_choose = counting
    runs, tuning = [], []
    try:
        with _TrialRounds(rounds):
            layer = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
            for i in range(calls):
                if i == clear_at:
                    overlap_tuner.clear_cache()
                    counts.clear()
                layer(x)
                f = layer.overlap_stats.forward
                runs.append(f.chunks)
                tuning.append(layer.plan.tuning)
    finally:
        overlap_tuner._timed, overlap_tuner._time_call = real_timed, real_time
        overlap_tuner._measure_and_choose = real_measure
        logging.getLogger("distllm").removeHandler(log)
    return {"runs": runs, "tuning": tuning, "reason": f.reason, "mode": f.mode,
            "growth": f.growth, "fallbacks": len([m for m in log.lines if "falls back" in m]),
            "measured": len(measured)}


def _settle(dims, x) -> tuple[int, bool, int, int]:
    """settle_overlap on a layer whose trial (3 rounds, isolated rounds forced, 4 chunks
    fastest) starts at its first call: (calls, tuning after, chunks the next call runs, a
    second settle's calls)."""
    from distllm.nn import RowParallelLinear
    from distllm.parallel.tensor import settle_overlap

    overlap_tuner.clear_cache()
    real_timed, real_time = overlap_tuner._timed, overlap_tuner._time_call
    overlap_tuner._timed = _forced(_SELECTION)
    overlap_tuner._time_call = lambda fn, name: (fn(), {"sequential": 10.0, "2": 9.5,
                                                        "4": 7.0}[name])
    try:
        with _TrialRounds(3):
            layer = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
            n = settle_overlap(lambda: layer(x), layer)
            tuning = layer.plan.tuning
            layer(x)
            again = settle_overlap(lambda: layer(x), layer.plan)
    finally:
        overlap_tuner._timed, overlap_tuner._time_call = real_timed, real_time
    return n, tuning, layer.overlap_stats.forward.chunks, again


def tuner_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=2)
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, dtype=DT)
    return run_cases({
        "real": lambda: _real(dims, x),
        "slower": lambda: _forced_outcome(
            dims, x, {"compute": 1.0, "sequential": 10.0, "2": 11.0, "4": 12.0}),
        "faster": lambda: _forced_outcome(
            dims, x, {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0}),
        "marginal": lambda: _forced_outcome(  # 2% faster: within the 3% margin
            dims, x, {"compute": 1.0, "sequential": 10.0, "2": 9.8, "4": 9.9}),
        "geometric": lambda: _forced_outcome(  # C = 6 ms, G = 4 ms: pieces growing by 1.5
            dims, x, {"compute": 4.0, "sequential": 10.0, "2": 9.0, "4": 8.5, "geo": 7.0}),
        "unconfirmed": lambda: _forced_outcome(  # 2 chunks win the selection, then lose
            dims, x, _forced_rounds({"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0},
                                    {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0},
                                    {"sequential": 10.0, "2": 9.9})),
        "lucky": lambda: _forced_outcome(  # confirmed by its fastest repetition, not its rounds
            dims, x, _forced_rounds({"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0},
                                    {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0},
                                    {"sequential": [10.0, 10.0, 10.0], "2": [6.0, 10.5, 10.5]})),
        # the machine slows down between rounds and one round of the chunked schedule is
        # disturbed: it wins 2 rounds of 3 by a third, so it is kept (its median, 19.8 ms, is
        # within 1% of sequential's 20 ms: a comparison of unpaired medians would drop it)
        "disturbed": lambda: _forced_outcome(
            dims, x, _forced_rounds({"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0},
                                    {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0},
                                    {"sequential": [10.0, 20.0, 30.0], "2": [29.0, 9.5, 19.8]})),
        # the trial in the step: the layer's own 4 chunks beat sequential by 30% in each
        # round; the selection's winner (2) by 5% only
        "trial_kept": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0, "2": 9.5, "4": 7.0}[n]),
        # a geometric winner (8 pieces growing by 1.49) meets its equal-piece twin (8) and
        # the first round's fastest (2) in the step (the layer's own 4 would be a fifth
        # schedule), where the twin wins
        "trial_twin": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0, "8x1.49": 8.0, "8": 7.0, "2": 9.0}[n], calls=14,
            selection=_GEO_SELECTION),
        # neither beats sequential by the margin: 2 chunks at 0.98, 4 slower
        "trial_dropped": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0, "2": 9.8, "4": 10.5}[n]),
        # the machine slows down from round to round (sequential 10, 20, 30, 40 ms) and the
        # first call of 4 chunks is disturbed: they run at 0.9 of sequential in 3 rounds of 4,
        # so they are kept (their unpaired median, 28 ms, is 1.12x sequential's 25 ms)
        "trial_paired": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0 * (r + 1), "2": 30.0 * (r + 1),
            "4": (29.0, 18.0, 27.0, 36.0)[r]}[n], rounds=4, calls=14),
        # 4 chunks at half of sequential in 2 rounds of 4 and 1.1x in the other 2: a median
        # ratio of 0.8, but faster in fewer than 3 of 4 rounds (TRIAL_WIN_SHARE): dropped
        "trial_few_wins": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0, "2": 12.0, "4": (5.0, 11.0, 5.0, 11.0)[r]}[n], rounds=4,
            calls=14),
        # rank 0 sees 4 chunks at half of sequential, rank 1 at 1.2x: the MAX over ranks
        # decides, the same on both (no overlap)
        "trial_max_over_ranks": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0, "2": 12.0, "4": 5.0 if rank == 0 else 12.0}[n]),
        # a backward's all-reduce behind its weight-gradient GEMM in one piece (Megatron-LM's
        # asynchronous input-gradient all-reduce) is a candidate, and here the fastest
        "one_piece": lambda: _forced_backward(
            dims, x, {"compute": 1.0, "sequential": 10.0, "1": 5.0, "2": 8.0, "4": 9.0}),
        # settle_overlap calls until the trial is over on both ranks: its 9 calls
        "settle": lambda: _settle(dims, x),
        # the cache is cleared in the middle of the trial: its decision is not kept, the
        # shape is measured again and a new trial starts
        "trial_cleared": lambda: _trial(dims, x, lambda n, rank, r: {
            "sequential": 10.0, "2": 9.5, "4": 7.0}[n], calls=6, clear_at=4),
    })


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


def test_one_measurement_per_shape_and_the_same_choice_everywhere(spawned):
    for got in case_of(spawned(tuner_main, 2), "real"):
        assert got["measured"] == 1, f"nine calls of one shape measured {got['measured']} times"
        assert got["calls"] == 9 and got["comm_ms_est"] >= 0.0 and got["reason"]
        assert got["max_chunks"] == got["chunks"]  # timings are reduced with MAX
        # every schedule the trial ran gave the product (a chunked one reorders no sums:
        # each row is one GEMM row plus the peer's)
        assert got["max_err"] < 1e-12, got
        n = got["tuning"].index(False) + 1  # the trial's calls: 2 rounds of 2 to 4
        assert n in (4, 6, 8) and not any(got["tuning"][n - 1:]), got
        assert 0 in got["runs"][:n] and any(c > 0 for c in got["runs"][:n]), got
        assert len(set(got["runs"][n:])) == 1, got  # decided: one schedule from then on


def test_trial_rotates_and_keeps_the_faster_of_its_two(spawned):
    for got in case_of(spawned(tuner_main, 2), "trial_kept"):
        # round r runs (sequential, 2, 4) rotated by r; then the kept schedule, every call
        assert got["runs"] == [0, 2, 4, 2, 4, 0, 4, 0, 2, 4, 4], got
        assert got["tuning"] == [True] * 8 + [False] * 3, got
        assert (got["mode"], got["fallbacks"], got["measured"]) == ("chunked", 0, 1), got
        assert got["reason"] == ("4 chunks: median ratio to sequential over 3 rounds of calls "
                                 "in the step: 2 0.950, 4 0.700"), got


def test_trial_puts_a_geometric_winner_against_its_equal_pieces(spawned):
    for got in case_of(spawned(tuner_main, 2), "trial_twin"):
        # 3 rounds of (sequential, 8x1.49, 8, 2), rotated; then 8 equal pieces, every call
        assert got["runs"] == [0, 8, 8, 2, 8, 8, 2, 0, 8, 2, 0, 8, 8, 8], got
        assert got["tuning"] == [True] * 11 + [False] * 3, got
        assert (got["mode"], got["growth"], got["fallbacks"]) == ("chunked", None, 0), got
        assert got["reason"] == ("8 chunks: median ratio to sequential over 3 rounds of calls "
                                 "in the step: 8x1.49 0.800, 8 0.700, 2 0.900"), got


@pytest.mark.parametrize("case, calls, said", [
    ("trial_dropped", 9, ["2 0.980, 4 1.050"]),  # neither beats sequential by the margin
    # a median ratio of 0.8, but faster than sequential in only 2 of 4 rounds
    ("trial_few_wins", 12, ["2 1.200, 4 0.800",
                            "4 beat sequential in 2 of 4 rounds, fewer than 3"]),
])
def test_trial_without_a_winner_falls_back_once(spawned, case, calls, said):
    for got in case_of(spawned(tuner_main, 2), case):
        assert got["runs"][calls:] == [0, 0] and got["mode"] == "none", got
        assert got["fallbacks"] == 1, got
        assert "no chunked schedule won its trial" in got["reason"], got
        assert all(s in got["reason"] for s in said), got


def test_trial_compares_each_round_apart(spawned):
    for got in case_of(spawned(tuner_main, 2), "trial_paired"):
        assert got["runs"][12:] == [4, 4] and "4 0.900" in got["reason"], got


def test_trial_decides_on_the_slowest_rank_the_same_everywhere(spawned):
    got = case_of(spawned(tuner_main, 2), "trial_max_over_ranks")
    assert [g["runs"][9:] for g in got] == [[0, 0], [0, 0]], got
    assert all("4 1.200" in g["reason"] for g in got), got


def test_settle_overlap_runs_the_trial_to_its_end(spawned):
    for got in case_of(spawned(tuner_main, 2), "settle"):
        assert got == (9, False, 4, 1), got


def test_a_cleared_cache_forgets_a_running_trial(spawned):
    for got in case_of(spawned(tuner_main, 2), "trial_cleared"):
        # 4 calls of the first trial; the fifth measures again and starts a new one
        assert got["measured"] == 2 and got["runs"] == [0, 2, 4, 2, 0, 2], got
        assert all(got["tuning"]), got


@pytest.mark.parametrize("case, want", [
    ("slower", ("none", 0, 1)),  # chunked slower than sequential: no overlap, said once
    ("faster", ("chunked", 2, 0)),  # the fastest chunk count, nothing logged
    ("marginal", ("none", 0, 1)),
    ("geometric", ("chunked", 4, 0)),  # C/G = 1.5; 4 and 8 pieces tie: the first kept
    ("unconfirmed", ("none", 0, 1)),  # the selection's winner must win its confirmation too
    ("lucky", ("none", 0, 1)),  # ... in its rounds as well as by its fastest repetition
    ("disturbed", ("chunked", 2, 0)),  # ... the rounds compared pairwise
])
def test_forced_outcomes(spawned, case, want):
    for got in case_of(spawned(tuner_main, 2), case):
        assert tuple(got[:3]) == want, got
        if case == "lucky":
            assert ("not its confirmation in its rounds (median ratio to sequential 1.050)"
                    in got[3]), got
        if case == "disturbed":
            assert "(median ratio of its rounds 0.660)" in got[3], got
        if case == "geometric":
            assert "4 chunks growing by 1.50" in got[3], got[3]
            assert got[4] == pytest.approx(1.5)  # the counter keeps the piece sizes it ran
        else:
            assert got[4] is None, got  # equal pieces (or none)


def test_paired_ratio_takes_each_round_apart():
    s = {"a": [9.0, 30.0, 18.0], "b": [10.0, 20.0, 20.0]}
    assert overlap_tuner.paired_ratio(s, "a", "b") == pytest.approx(0.9)  # 0.9, 1.5, 0.9
    assert overlap_tuner.paired_ratio(s, "b", "a") == pytest.approx(10 / 9)
    with pytest.raises(ValueError):  # rounds pair by position: counts must agree
        overlap_tuner.paired_ratio({"a": [1.0], "b": [1.0, 2.0]}, "a", "b")


def test_geometric_growth_balances_and_is_bounded():
    g = overlap_tuner.geometric_growth
    assert g(4.0, 6.0, 4, comm_first=False) == pytest.approx(1.5)  # comm-bound: pieces grow
    assert g(6.0, 4.0, 4, comm_first=False) == pytest.approx(4 / 6)  # compute-bound: shrink
    assert g(4.0, 6.0, 4, comm_first=True) == pytest.approx(4 / 6)  # all-gather: reversed
    bound = overlap_tuner.MAX_PIECE_RATIO ** (1 / 7)
    assert g(1.0, 100.0, 8, comm_first=False) == pytest.approx(bound)  # largest/smallest <= 16
    assert g(5.0, 5.1, 4, comm_first=False) is None  # within 5% of equal pieces
    assert g(0.0, 5.0, 4, comm_first=False) is None


def test_geometric_pieces():
    from distllm.parallel.tensor.overlap import pipeline_bounds

    sizes = [e - s for s, e in pipeline_bounds(2048, 4, 1.5)]
    assert sizes == [252, 378, 567, 851] and sum(sizes) == 2048
    sizes = [e - s for s, e in pipeline_bounds(2048, 4, 0.5)]
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] and sum(sizes) == 2048
    assert pipeline_bounds(3, 8, 2.0) == [(0, 1), (1, 2), (2, 3)]  # never an empty piece


def test_one_rank_never_measures(monkeypatch):
    overlap_tuner.clear_cache()
    monkeypatch.setattr(overlap_tuner, "_measure_and_choose",
                        lambda *a: pytest.fail("measured"))
    comm = types.SimpleNamespace(backend="gloo", ranks=(0,), world=1)
    ch = overlap_tuner.choose(("k",), lambda c, n: None, comm, 8, torch.device("cpu"), "x")
    assert (ch.chunks, ch.comm_ms) == (0, 0.0) and "tp=1" in ch.reason
    assert overlap_tuner.choose(("k",), None, comm, 8, torch.device("cpu"), "x") is ch  # cached
    overlap_tuner.clear_cache()
    assert overlap_tuner.choose(("k",), None, comm, 8, torch.device("cpu"), "x") is not ch


def test_a_backward_may_keep_its_collective_in_one_piece(spawned):
    for got in case_of(spawned(tuner_main, 2), "one_piece"):
        assert got[:2] == ("chunked", 1), got
        assert got[2].startswith("1 piece (the collective runs behind the GEMM that follows)"), got


def _trial_across_a_new_group() -> str:
    """A trial begun on one mesh, the process groups destroyed and made again (a second
    run in the same process), then the same shape on the new mesh."""
    import datetime
    import os
    import tempfile

    import torch.distributed as dist

    from distllm import ParallelDims
    from distllm.nn import RowParallelLinear

    overlap_tuner.clear_cache()
    rank, x = dist.get_rank(), torch.randn(64, 32, dtype=DT)
    first = RowParallelLinear(64, 64, ParallelDims(tp=2), overlap="auto", dtype=DT)
    real, overlap_tuner._timed = overlap_tuner._timed, _forced(_SELECTION)  # a trial follows
    try:
        with torch.no_grad():
            first(x)  # measured: the trial in the step begins
    finally:
        overlap_tuner._timed = real
    assert first.plan.tuning
    where = [os.path.join(tempfile.mkdtemp(), "init") if rank == 0 else None]
    dist.broadcast_object_list(where)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{where[0]}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    again = RowParallelLinear(64, 64, ParallelDims(tp=2), overlap="auto", dtype=DT)
    with torch.no_grad():
        for _ in range(overlap_tuner.trial_calls() + 1):
            again(x)
    assert not again.plan.tuning
    return again.overlap_stats.forward.reason


def test_a_trial_decides_over_the_group_of_its_last_call():
    """A running trial is cached by ranks and shape, and carried the group it began on: on a
    mesh made again in the same process it decided over the destroyed group (TypeError in
    gloo's backend lookup). It decides over the calling layer's group."""
    from distllm.testing import run_distributed

    reasons = run_distributed(_trial_across_a_new_group, 2, timeout=120)
    assert reasons[0] == reasons[1] and "rounds of calls in the step" in reasons[0], reasons
