"""Checkpoints: resharding across layouts, atomic saves, kill + resume, a dead rank."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distllm.models.config import GPTConfig
from distllm.testing import run_distributed
from distllm.train import checkpoint, dcp_reader
from tests.train._util import train_many

TOL = 1e-12  # float64 (see test_parity)
WTOL = 1e-10  # the last weights, absolute (see test_parity)


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= TOL * max(1.0, abs(y)), f"step {i + 1}: {x} vs {y}"


def test_cross_layout_resume(corpus, references, tmp_path):
    """tp2.pp2 (DDP, the tiny vocabulary held whole) -> tp1.pp1.dp4 (ZeRO-2) -> tp4 (the
    vocabulary split): the losses go on matching, and the last weights are the one-process
    run's (the last leg's updates read the moments the others saved)."""
    out = tmp_path / "ckpt"
    # an incomplete save (no meta.json) and a crashed one (temp dir) must be ignored
    (out / "checkpoints" / "step_00000009").mkdir(parents=True)
    (out / "checkpoints" / ".tmp-step_00000010").mkdir()
    (out / "checkpoints" / ".old-step_00000001").mkdir()  # a pruning cut short
    common = dict(steps=60, save_final=True, out=str(out))
    runs = [
        dict(tp=2, pp=2, m=2, stop_after=2, **common),
        dict(dp=4, zero=2, stop_after=4, resume=True, **common),
        dict(tp=4, vp="on", stop_after=6, resume=True, **common),
    ]
    res = run_distributed(train_many, 4, runs, corpus, str(tmp_path), timeout=600)[0]
    assert [len(r) for r in res] == [2, 2, 2]
    _close(res[0] + res[1] + res[2], references["wd"])
    assert checkpoint.latest(out).name == "step_00000006"
    last, want = checkpoint.read_layers(checkpoint.latest(out))[1], references["weights6"]
    assert last.keys() == want.keys()
    for i, layer in want.items():
        assert last[i].keys() == layer.keys(), i
        for name, t in layer.items():
            err = float((last[i][name] - t).abs().max())
            assert err <= WTOL, f"layer {i} {name}: {err:.3g} from the one-process run's"
    # the crashed save's folder and the cut-short pruning's went with the next save (they
    # stayed on disk for good)
    assert not (out / "checkpoints" / ".tmp-step_00000010").exists()
    assert not (out / "checkpoints" / ".old-step_00000001").exists()
    meta = json.loads((checkpoint.latest(out) / "meta.json").read_text())
    assert meta["layout"]["tp"] == 4 and meta["data"]["index"] == 6 * 8


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def _train_cmd(corpus: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "distllm", "train", "--nproc", "2", "--pp", "2",
            "--micro-batches", "2", "--model", "tiny", "--seq-len", "32", "--global-batch", "8",
            "--steps", "60", "--seed", "7", "--dtype", "float64", "--data", corpus,
            "--out", str(out), "--no-progress", "--eval-batches", "0", "--timeout", "60",
            *extra]


def _workers(launcher: int) -> list[int]:
    """The rank processes of ``distllm train --nproc`` (the launcher's children)."""
    return _children(launcher)


def _signal_the_last_rank(cmd: list[str], out: Path, sig: int) -> tuple[int, str, float]:
    """Start ``distllm train --nproc 2`` (``cmd``), send ``sig`` to its last rank once a
    checkpoint exists; ``(exit code, stderr, seconds from the signal to the job's end)``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        deadline = time.time() + 240
        while checkpoint.latest(out) is None:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        t_sig = time.time()
        os.kill(workers[-1], sig)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err, time.time() - t_sig
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_kill_and_resume(corpus, reference, tmp_path):
    """A rank killed mid-run ends the job quickly with a clear message; resuming from the
    last checkpoint reproduces the uninterrupted losses exactly (float64)."""
    ref = reference
    out = tmp_path / "run"
    code, err, took = _signal_the_last_rank(
        _train_cmd(corpus, out, "--save-every", "3", "--no-save"), out, signal.SIGKILL)
    assert code != 0
    assert took < 60, f"the job took {took:.0f} s to end after a rank died"
    assert err.splitlines()[-1].startswith("distllm train: error: rank "), err[-2000:]
    assert err.splitlines()[-1].endswith(" was killed by SIGKILL"), err[-2000:]
    assert "Traceback" not in err, err[-3000:]  # the rank that lost it: no gloo traceback
    # resume from step 3 exactly (a later save, if the run got that far, is set aside)
    for d in (out / "checkpoints").iterdir():
        if d.name != "step_00000003":
            d.rename(tmp_path / d.name)
    done = subprocess.run(_train_cmd(corpus, out, "--resume", "--stop-after", "6"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step 3" in done.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert {"step", "loss", "tokens_per_s", "lr", "grad_norm", "mfu"} <= set(lines[0])
    _close([x["loss"] for x in lines], ref)


def test_a_stalled_rank_ends_the_job_with_one_line_naming_it(corpus, tmp_path):
    """A rank that stops answering (SIGSTOP) makes its peer's collective time out after
    ``--timeout``: the job ends with one line naming the rank that timed out, the flag, and
    the rank that did not answer (it printed the peer's traceback, naming only the peer)."""
    out = tmp_path / "run"
    code, err, took = _signal_the_last_rank(
        _train_cmd(corpus, out, "--save-every", "3", "--no-save", "--timeout", "8"), out,
        signal.SIGSTOP)
    assert code == 1, err[-2000:]
    assert took < 60, f"the job took {took:.0f} s to end after a rank stalled"
    last = err.splitlines()[-1]
    assert last.startswith("distllm train: error: rank 0 waited longer than --timeout 8 s "
                           "for a collective ("), err[-2000:]
    assert last.endswith("; ranks [1] did not answer (stalled, or died)"), last
    assert "Traceback" not in err, err[-3000:]


def _signalled_at_step_3(corpus: str, out: str) -> list[tuple[list[float], str | None]]:
    """Rank function: a dp2 ZeRO-1 run of the 60-step schedule in which rank 1 alone gets
    SIGUSR1 during step 4, then its resume for one more step; each run's losses and
    ``stopped_by``."""
    import torch.distributed as dist

    import distllm.train.trainer as trainer
    from tests.train._util import make_cfg

    lr_at = trainer.lr_at

    def signalling_lr_at(step, cfg):
        if step == 3 and dist.get_rank() == 1 and not cfg.resume:
            os.kill(os.getpid(), signal.SIGUSR1)
        return lr_at(step, cfg)

    trainer.lr_at = signalling_lr_at
    runs = []
    for kw in (dict(), dict(resume=True, stop_after=6)):
        res = trainer.train(make_cfg(corpus, out, dp=2, zero=1, steps=60, **kw))
        runs.append((res.losses, res.stopped_by))
    return runs


def test_a_signal_to_one_rank_stops_every_rank_with_a_checkpoint(corpus, reference, tmp_path):
    """SIGUSR1 (a ``--save-on-signal`` default) reaching one rank during step 4 stops both
    after step 5 (the ranks agree one step late, without a wait), with a checkpoint there
    although ``save_final`` is off; resuming from it reproduces the uninterrupted losses."""
    out = tmp_path / "run"
    res = run_distributed(_signalled_at_step_3, 2, corpus, str(out), timeout=300)
    for (stopped, by), (resumed, by_resumed) in res:
        assert by == "SIGUSR1" and by_resumed is None
        assert len(stopped) == 5 and len(resumed) == 1
        _close(stopped + resumed, reference)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000005"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def _one_rank_cannot_write(data: str, out: str, failing: str) -> str:
    """Rank function: rank 1's write of ``failing`` (its RNG file, or rank 0's meta.json)
    fails at the step-2 save; what this rank's ``train`` raised."""
    import errno

    import torch.distributed as dist

    from distllm.train import trainer
    from tests.train._util import make_cfg

    real_save, real_open = checkpoint.torch.save, open

    def full(path):
        if dist.get_rank() == (1 if failing == "rng" else 0) and "step_00000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")

    def save(obj, f, *args, **kwargs):
        full(f)
        return real_save(obj, f, *args, **kwargs)

    def meta_open(f, *args, **kwargs):
        if str(f).endswith("meta.json") and args[:1] == ("w",):
            full(f)
        return real_open(f, *args, **kwargs)

    checkpoint.torch.save = save
    checkpoint.open = meta_open  # (the module's own name lookup finds it first)
    try:
        trainer.train(make_cfg(data, out, pp=2, m=2, steps=3, save_every=1))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("failing", ["rng", "meta"])
def test_a_write_that_fails_on_one_rank_is_the_same_error_on_every_rank(corpus, tmp_path,
                                                                         failing):
    """Each rank writes its RNG state, and rank 0 the meta.json, on its own: one that failed
    raised alone while the others waited in the next collective and died there with gloo's
    traceback ("Connection closed by peer"). Every rank now raises the failed rank's error,
    which ``--nproc``'s launcher prints once; the step-1 checkpoint stays whole."""
    out = tmp_path / "run"
    msgs = run_distributed(_one_rank_cannot_write, 2, corpus, str(out), failing, timeout=300)
    rank = 1 if failing == "rng" else 0
    assert msgs[0] == msgs[1], msgs
    assert msgs[0].startswith(f"--out {out}: saving the checkpoint of step 2 failed (rank "
                              f"{rank}: [Errno 28] No space left on device; "), msgs[0]
    assert msgs[0].endswith("the newest complete checkpoint, step 1, is whole: free space "
                            "there (then --resume), or pass another --out"), msgs[0]
    assert [d.name for d in checkpoint.complete(out)] == ["step_00000001"]


class _Payload:
    """Unpickling it creates the folder ``mark``: a stand-in for code a crafted file runs."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return (os.makedirs, (str(self.mark),))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_crafted_metadata_runs_nothing(tmp_path):
    """A checkpoint whose DCP ``.metadata`` unpickles a callable: ``load_latest`` refuses it
    by name before DCP reads it, and the callable never runs."""
    mark = tmp_path / "ran"
    step = tmp_path / "out" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    mcfg = GPTConfig.preset("tiny")
    (step / "meta.json").write_text(json.dumps({
        "format": checkpoint.FORMAT, "step": 1, "model": checkpoint._model_key(mcfg),
        "model_name": "tiny", "optimizer_step": 0, "layout": {}, "data": {}}))
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(mark)))
    engine = types.SimpleNamespace(mcfg=mcfg, chunks=[], dtype=torch.float32)
    with pytest.raises(pickle.UnpicklingError) as e:
        checkpoint.load_latest(tmp_path / "out", engine, loader=None)
    assert str(e.value) == (
        f"{step}/.metadata asks to unpickle os.makedirs, which checkpoint metadata never "
        f"holds: refusing to load it (a damaged or crafted checkpoint: pass another --out)")
    assert not mark.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_non_tensor_entry_runs_nothing(tmp_path):
    """A DCP checkpoint whose entry is a pickled object (DCP would ``torch.load`` it with
    ``weights_only=False`` into a tensor's place) is refused; the object never runs."""
    mark, ck = tmp_path / "ran", tmp_path / "ck"
    dcp.save({"w": _Payload(mark)}, checkpoint_id=str(ck), no_dist=True)
    assert not mark.exists()
    reader = dcp_reader.RestrictedReader(ck)
    want = (f"{ck}/.metadata: entry 'w' is a BytesStorageMetadata, not a tensor (distllm "
            f"saves tensors only, and DCP would unpickle it without restriction): refusing "
            f"to load it (a damaged or crafted checkpoint: pass another --out)")
    with pytest.raises(pickle.UnpicklingError) as e:
        reader.read_metadata()
    assert str(e.value) == want
    # through dcp.load the refusal fails the load (a CheckpointException on torch 2.11 and
    # 2.14: 2.11 logs the reader's error and fails on the missing metadata, 2.14 wraps it);
    # either way the entry is never unpickled
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.empty(3)}, storage_reader=reader, no_dist=True)
    assert not mark.exists()


def test_a_ranks_random_state_is_its_own_gpus(monkeypatch):
    """A rank saves the CPU generator's state and its own GPU's (every visible GPU's would
    not load where another number of GPUs is visible), and restores its own GPU's; a
    checkpoint that holds every visible GPU's state gives the rank its device's."""
    states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(4)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[device.index])
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda s, device="cuda": set_to.append((int(s[0]), device)))
    dev = torch.device("cuda", 2)
    rng = checkpoint.rng_state(dev)
    assert torch.equal(rng["cpu"], torch.get_rng_state())
    assert [int(s[0]) for s in rng["cuda"]] == [2]
    checkpoint.set_rng_state(rng, torch.device("cuda", 1))  # resumed where it is cuda:1
    checkpoint.set_rng_state({"cpu": rng["cpu"], "cuda": list(states.values())}, dev)
    assert set_to == [(2, torch.device("cuda", 1)), (2, dev)]
    # a CPU run keeps no GPU state and restores none
    assert checkpoint.rng_state(torch.device("cpu"))["cuda"] == []
    checkpoint.set_rng_state(rng, torch.device("cpu"))
    assert len(set_to) == 2


def test_a_save_is_synced_before_an_older_checkpoint_is_pruned(corpus, monkeypatch, tmp_path):
    """With --keep-checkpoints 1, saving step 2 prunes step 1: the new checkpoint's rank
    file and the folders naming it (its rng/, itself, and after the rename the checkpoints
    folder) are synced to the device before, so that a power loss cannot leave an empty
    rank file in the newest checkpoint and the previous one gone."""
    from distllm.train import trainer
    from tests.train._util import make_cfg, record_syncs

    events = record_syncs(monkeypatch)
    real_prune = checkpoint.prune

    def prune(out, keep: int) -> list[Path]:
        events.append(("prune",))
        return real_prune(out, keep)

    monkeypatch.setattr(checkpoint, "prune", prune)
    out = tmp_path / "run"
    trainer.train(make_cfg(corpus, str(out), steps=2, save_every=1, keep_checkpoints=1,
                           save_final=True))
    assert [d.name for d in checkpoint.complete(out)] == ["step_00000002"]
    root = (out / "checkpoints").resolve()
    tmp, final = root / ".tmp-step_00000002", root / "step_00000002"
    moved = events.index(("replace", str(out / "checkpoints" / tmp.name),
                          str(out / "checkpoints" / final.name)))
    synced = [events.index(("fsync", str(p))) for p in (tmp / "rng" / "rank0.pt",
                                                        tmp / "rng", tmp)]
    assert max(synced) < moved, events
    assert synced[0] < synced[1], events  # the file, then its name
    after = events.index(("fsync", str(root)), moved)
    assert after < events.index(("prune",), moved), events


def _resume_from(outs: list[str], data: str) -> str:
    """Rank function: resume from ``outs[rank]`` (one --out seen two ways)."""
    from distllm.train import trainer
    from tests.train._util import make_cfg

    try:
        trainer.train(make_cfg(data, outs[dist.get_rank()], dp=2, steps=6, resume=True))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_see_different_newest_checkpoints_are_refused(corpus, tmp_path):
    """A network file system that shows one node a save later than another: each rank took
    the newest it saw and read it, two steps mixed in one run. Emulated by two folders, one
    without the last save: one line on every rank, naming what each saw."""
    a = tmp_path / "a"
    run = dict(dp=2, steps=6, stop_after=4, save_every=2, save_final=True, out=str(a))
    run_distributed(train_many, 2, [run], corpus, str(tmp_path), timeout=300)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(a / "checkpoints" / "step_00000004")
    msgs = run_distributed(_resume_from, 2, [str(a), str(b)], corpus, timeout=300)
    assert msgs == [f"--out {out}: the ranks see different newest checkpoints (rank 0: "
                    f"step_00000002, rank 1: step_00000004); every rank must see one shared "
                    f"--out alike (a network file system showing a save late?): resume again "
                    f"once they agree" for out in (a, b)], msgs


_GATHERS = (  # (module, name): every way a rank gathers or sends tensors (DCP's own
    # object collectives aside): torch's, distllm's, and the name ZeRO's state imported
    (dist, "all_gather"), (dist, "all_gather_into_tensor"), (dist, "send"), (dist, "isend"),
    ("distllm.comm.collectives", "all_gather"), ("distllm.parallel.data.zero_state",
                                                 "all_gather"))


def _own_boxes(data: str, out: str, layout: dict, then: dict | None = None) -> dict:
    """Rank function: a run at ``layout`` saving at step 2, then its resume at ``then``
    (the same by default) to step 3. Counts the gathers and sends made while saving, the
    elements of each rank's save plan, those its read asks DCP for, its read requests and
    the stored chunks they load; returns them with the resumed step's loss."""
    import importlib

    from distllm.train import dcp_pieces, dcp_reader

    counts = {"gathers": 0, "written": 0, "read": 0, "requests": 0, "chunks": 0}
    saving = []
    real = (checkpoint.save, None, dcp_reader.RestrictedReader.read_data,
            dcp_pieces.PieceSavePlanner.create_local_plan)
    where = [(importlib.import_module(m) if isinstance(m, str) else m, n) for m, n in _GATHERS]
    sends = [getattr(m, n) for m, n in where]

    def save(*a, **kw):
        saving.append(True)
        try:
            return real[0](*a, **kw)
        finally:
            saving.pop()

    def counted(fn):
        def call(*a, **kw):
            counts["gathers"] += bool(saving)
            return fn(*a, **kw)
        return call

    def read_data(self, plan, planner):
        counts["read"] += sum(math.prod(item.lengths) for item in plan.items)
        counts["requests"] += len(plan.items)
        counts["chunks"] += len({(i.storage_index.fqn, tuple(i.storage_index.offset))
                                 for i in plan.items})
        return real[2](self, plan, planner)

    def create_local_plan(self):
        plan = real[3](self)
        counts["written"] += sum(math.prod(i.tensor_data.chunk.sizes) for i in plan.items)
        return plan

    checkpoint.save, dcp_reader.RestrictedReader.read_data = save, read_data
    dcp_pieces.PieceSavePlanner.create_local_plan = create_local_plan
    for (m, n), fn in zip(where, sends, strict=True):
        setattr(m, n, counted(fn))
    try:
        losses = train_many([dict(stop_after=2, save_final=True, steps=60, out=out, **layout),
                             dict(stop_after=3, resume=True, steps=60, out=out,
                                  **(layout if then is None else then))], data, out)
    finally:
        checkpoint.save, dcp_reader.RestrictedReader.read_data = real[0], real[2]
        dcp_pieces.PieceSavePlanner.create_local_plan = real[3]
        for (m, n), fn in zip(where, sends, strict=True):
            setattr(m, n, fn)
    return {**counts, "loss": losses[1][0]}


def _tiny_elements(split: int) -> int:
    """Elements of the tiny model's canonical tensors, those TP splits divided by ``split``."""
    from distllm.models.config import GPTConfig
    from distllm.models.sharding import canonical_shapes, param_table

    cfg = GPTConfig.preset("tiny")
    assert cfg.vocab_size % 128 == 0  # tp2 pads nothing: each rank holds half of it
    return sum(math.prod(shape) // (1 if param_table(cfg, i)[name][1] == "rep" else split)
               for i in range(cfg.n_layers + 2) for name, shape in canonical_shapes(cfg, i).items())


def test_each_rank_writes_and_reads_its_own_boxes(corpus, reference, tmp_path):
    """At tp2 a save gathers nothing and writes each TP rank's boxes (QKV: its q, k and v
    heads); a resume at the same layout reads on each rank its own shard's elements alone
    (weights and both moments), and goes on as the one-process run."""
    out = tmp_path / "ckpt"
    res = run_distributed(_own_boxes, 2, corpus, str(out), dict(tp=2, vp="on"), timeout=300)
    own = 3 * _tiny_elements(2)
    for r in res:
        assert r["gathers"] == 0 and r["written"] == own and r["read"] == own, r
        assert abs(r["loss"] - reference[2]) <= TOL * max(1.0, abs(reference[2])), r
    md = dcp_reader.read_metadata(checkpoint.latest(out) / ".metadata").state_dict_metadata
    chunks = {k: sorted(tuple(c.offsets) for c in m.chunks) for k, m in md.items()}
    # 4 heads of 32 rows: rank 0 holds q 0-63, k 128-191, v 256-319; rank 1 the rest
    assert chunks["model.layers.1.attn.qkv.weight"] == [(r, 0) for r in range(0, 384, 64)]
    assert chunks["optim.layers.1.mlp.proj.weight.exp_avg"] == [(0, 0), (0, 256)]  # columns
    assert chunks["model.layers.0.wte.weight"] == [(0, 0), (128, 0)]
    assert chunks["model.layers.1.ln_1.weight"] == [(0,)]  # replicated: written once
    for k, m in md.items():  # every element of every tensor stored once
        assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), k


@pytest.mark.parametrize("zero", [1, 3])
def test_a_zero_rank_writes_and_reads_its_own_shard(corpus, reference, tmp_path, zero):
    """Under ZeRO at dp2 each rank writes the part of the state its optimizer shard holds
    (together: every element once, each rank about half), reads back that part alone, and
    the resumed run goes on as the one-process run."""
    out = tmp_path / "ckpt"
    res = run_distributed(_own_boxes, 2, corpus, str(out), dict(dp=2, zero=zero),
                          timeout=300)
    total = 3 * _tiny_elements(1)
    assert sum(r["written"] for r in res) == total, res
    for r in res:
        assert r["gathers"] == 0 and r["read"] == r["written"] < 0.55 * total, (r, total)
        assert abs(r["loss"] - reference[2]) <= TOL * max(1.0, abs(reference[2])), r


def test_a_resume_at_another_layout_loads_each_stored_chunk_once(corpus, reference, tmp_path):
    """Saved at dp2 ZeRO-3 (each rank's range of a flat bucket: parts of rows), resumed at
    tp2 (QKV: three boxes): a stored chunk overlaps several of a rank's boxes, and is still
    one request (DCP's reader loads a chunk whole for each request); the run goes on as the
    one-process run."""
    res = run_distributed(_own_boxes, 2, corpus, str(tmp_path / "ckpt"), dict(dp=2, zero=3),
                          dict(tp=2, vp="on"), timeout=300)
    for r in res:
        assert r["requests"] == r["chunks"] > 0, r
        assert abs(r["loss"] - reference[2]) <= TOL * max(1.0, abs(reference[2])), r


def _views_of_the_state(data: str, out: str, zero: int) -> list[int]:
    """Rank function: a dp2 engine at ZeRO ``zero`` after one step (weight decay on: rank
    1's shard of a bucket spans two param groups, two optimizer segments): the boxes its save
    would hand DCP whose storage is neither a master shard's nor the optimizer's (copies),
    how many boxes there are, the step, and the most segments of a bucket's shard."""
    from distllm import ParallelDims
    from distllm.train.checkpoint_state import own_pieces
    from distllm.train.engine import Engine
    from tests.train._util import make_cfg

    cfg = make_cfg(data, out, dp=2, zero=zero)
    engine = Engine(cfg, cfg.model_config(), ParallelDims.from_layout(cfg.parallel))
    tok = torch.randint(0, 256, (4, 32))
    engine.train_step(tok, tok)
    engine.step(1.0)
    z = engine.zero
    held = {m.untyped_storage().data_ptr() for m in z.masters} | {
        v.untyped_storage().data_ptr() for st in z.optimizer.state.values()
        for v in st.values() if isinstance(v, torch.Tensor)}
    pieces, step = own_pieces(engine)
    boxes = [t for _, b in pieces.values() for _, t in b]
    copies = sum(t.untyped_storage().data_ptr() not in held for t in boxes)
    return [copies, len(boxes), step, max(len(segs) for segs in z.bucket_segments)]


@pytest.mark.parametrize("zero", [1, 3])
def test_a_zero_save_hands_dcp_views_of_the_state_it_holds(corpus, tmp_path, zero):
    """No box of a ZeRO save is a copy: on a GPU, DCP copies each to the CPU as it writes it
    (a copy of the shard's moments made first would sit on the device beside them)."""
    res = run_distributed(_views_of_the_state, 2, corpus, str(tmp_path), zero, timeout=300)
    assert max(r[3] for r in res) > 1, res  # (a shard of two optimizer segments)
    for copies, boxes, step, _ in res:
        assert copies == 0 and boxes > 0 and step == 1, res
