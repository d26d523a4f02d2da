"""Sharded, atomic, layout-independent checkpoints with ``torch.distributed.checkpoint``.

Format (``OUT/checkpoints/step_00000300/``):

* DCP files holding, for every layer, its *canonical* tensors: full weights under global
  names (``model.layers.3.attn.qkv.weight``; TP- and ZeRO-unsharded shapes) and the AdamW
  moments of each (``optim.layers.3.attn.qkv.weight.exp_avg`` / ``.exp_avg_sq``). Each rank
  writes its own boxes of them, with no gather (:mod:`distllm.train.checkpoint_state`): a TP
  rank its shard (QKV: its q, k and v heads, three boxes), a ZeRO rank the part its optimizer
  shard holds, a pipeline stage its own layers with their global indices. DP replicas of a
  box, and TP replicas of a replicated tensor, are written once (DCP deduplicates a chunk
  held by several ranks). Because the names and shapes do not depend on the layout, a
  checkpoint saved at one layout loads at any other (tp2.pp2.dp1 -> tp1.pp1.dp4 -> tp4, ZeRO
  stage changes included): each rank reads only the stored chunks that overlap its own boxes,
  each once (at the layout that saved them, exactly its own).
* ``meta.json``: the model config, step, layout, data-loader position and optimizer step,
  and what the data held (``tokens``: text's bytes or a tokenizer's ids, which ``distllm
  export`` passes on to ``--init-from``).
* ``rng/rank{r}.pt``: each rank's RNG states, restored only at the same layout
  (``torch.load(weights_only=True)``).

Loading unpickles three things, none able to run code: the RNG states and DCP's tensor data
(``torch.load(weights_only=True)``), and DCP's ``.metadata``, which DCP's own reader would
``pickle.load``: :class:`~distllm.train.dcp_reader.RestrictedReader` unpickles it allowing
only the classes DCP metadata holds and refuses entries that are not tensors (DCP
would ``torch.load`` those with ``weights_only=False``). A refused checkpoint is a
``pickle.UnpicklingError`` naming the file and what it asked for.

A save writes ``.tmp-step_N`` and renames it once every rank has finished, its files and
their folders synced to the device before the rename and the rename synced before
``--keep-checkpoints`` prunes an older one, so a crash or a power loss during a save leaves
the previous checkpoint whole; ``load_latest`` takes the newest complete one.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distllm.models.hf import weights_only_refusal
from distllm.train.checkpoint_folder import (  # noqa: F401 - the module's API, as before
    FORMAT,
    _cause,
    _ckpt_root,
    _complete,
    _damaged,
    _model_key,
    _read_meta,
    check_compatible,
    complete,
    latest,
    meta_of,
    optim_settings,
    prune,
    record_of,
    step_of,
    sync_dir,
    trained_positions_of,
)
from distllm.train.checkpoint_state import own_pieces, read_targets
from distllm.train.data import data_source, tokens_of
from distllm.train.dcp_pieces import PieceLoadPlanner, PieceSavePlanner
from distllm.train.dcp_reader import Refused, RestrictedReader

__all__ = ["save", "load_latest", "latest", "check_compatible", "prune", "step_of",
           "rng_state", "set_rng_state", "FORMAT"]

def save(out: str | os.PathLike, engine, loader, *, step: int,
         record: dict | None = None) -> Path:
    """Save a checkpoint of ``engine`` and ``loader`` at ``step`` (collective, every rank);
    ``record``: the step's line of metrics.jsonl, kept in its meta.json (:func:`record_of`).
    A write that fails (a full disk, a folder gone) is a one-line ValueError naming
    ``--out``; the checkpoints saved before stay whole."""
    try:
        return _save(out, engine, loader, step, record)
    except (OSError, CheckpointException, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not isinstance(exc, CheckpointException) and not \
                any(w in str(exc) for w in ("inline_container", "PytorchStreamWriter")):
            raise  # not a write's (a collective's, say)
        newest = latest(out)
        if newest:
            then = (f"the newest complete checkpoint, step {step_of(newest)}, is whole: free "
                    f"space there (then --resume)")
        else:  # nothing to resume: a new run there needs the old run's metrics gone
            then = (f"no complete checkpoint there: free space and remove "
                    f"{Path(out) / 'metrics.jsonl'} (then run again)")
        raise ValueError(
            f"--out {out}: saving the checkpoint of step {step} failed ({_cause(exc)}; "
            f"{_free(out)}); {then}, or pass another --out") from None


def _free(out: str | os.PathLike) -> str:
    """The free space of the device holding ``out``, in words (a full disk's torch writer
    names only a position in its zip file)."""
    where = Path(out)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "its free space unknown"
    return f"{free / 2**20:.3g} MiB free on its device"


def _agree(err: BaseException | None, dims) -> None:
    """After a write that each rank makes on its own: raise on every rank when any failed,
    with the first failed rank's cause (the others would wait in the next collective and
    fail there with a traceback of their own). Collective over the world."""
    world = dist.get_world_size()
    who = torch.tensor([dims.rank if err is not None else world], device=dims.device)
    dist.all_reduce(who, op=dist.ReduceOp.MIN)
    first = int(who.item())
    if first == world:
        return
    cause = [f"rank {first}: {_cause(err)}" if err is not None else None]
    dist.broadcast_object_list(cause, src=first)
    raise OSError(cause[0])


def _save(out, engine, loader, step: int, record: dict | None) -> Path:
    dims = engine.dims
    root = _ckpt_root(out)
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    err = None
    if dims.rank == 0:
        try:
            # this save's folder, and any an interrupted save or pruning left (one writer:
            # this job)
            for stale in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        except OSError as exc:
            err = exc
    _agree(err, dims)  # (the barrier before the ranks write into it)
    pieces, opt_step = own_pieces(engine)
    # (DCP shares a rank's failure itself)
    dcp.save({}, checkpoint_id=str(tmp), planner=PieceSavePlanner(pieces))
    del pieces
    try:
        _write_synced(tmp / "rng" / f"rank{dims.rank}.pt", rng_state(dims.device))
    except (OSError, RuntimeError) as exc:
        err = exc
    _agree(err, dims)
    if dims.rank == 0:
        try:
            _write_meta(out, engine, loader, step, record, opt_step, tmp, final)
        except (OSError, RuntimeError) as exc:
            err = exc
    _agree(err, dims)
    return final


def _write_synced(path: Path, obj: dict) -> None:
    """``torch.save`` ``obj`` to ``path`` and sync the file to its device before returning
    (the rename that publishes the checkpoint must not come back, after a power loss,
    naming an empty file)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_meta(out, engine, loader, step: int, record: dict | None, opt_step: int,
                tmp: Path, final: Path) -> None:
    """Rank 0's part of a save: ``meta.json``, which makes ``tmp`` a complete checkpoint, the
    rename to ``final`` and the pruning, each synced to the device before the next step: a
    power loss leaves the previous checkpoint or this one whole, never neither."""
    dims, p = engine.dims, engine.cfg.parallel
    meta = {"format": FORMAT, "step": step, "model": _model_key(engine.mcfg),
            "model_name": engine.mcfg.name, "optimizer_step": opt_step,
            "layout": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "zero": p.zero,
                       "v": engine.v, "world": dims.world_size},
            "data": loader.state_dict(), "dtype": engine.cfg.dtype,
            "tokens": tokens_of(engine.cfg.data),
            "data_source": data_source(engine.cfg.data),
            "data_fingerprint": engine.data_fingerprint,
            "trained_positions": engine.trained_positions,
            "optim": engine.cfg.optim.schedule(engine.cfg.steps),
            **({} if record is None else {"metrics": record})}
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    sync_dir(tmp / "rng")  # the ranks' files, synced each by its rank: their names
    sync_dir(tmp)  # meta.json's and the DCP files'
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    sync_dir(final.parent)  # the rename, before an older checkpoint goes
    prune(out, engine.cfg.keep_checkpoints)


def load_latest(out: str | os.PathLike, engine, loader) -> int:
    """Load the newest complete checkpoint under ``out`` into ``engine`` and ``loader`` at
    this run's layout; returns its step."""
    path = check_compatible(out, engine.mcfg)
    # every rank reads the same checkpoint: each picked the newest it sees, and a network
    # file system that shows one node a save later than another would mix two steps
    picked: list = [path.name] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(picked, path.name)
    if len(set(picked)) > 1:
        seen = ", ".join(f"rank {r}: {name}" for r, name in enumerate(picked))
        raise ValueError(f"--out {out}: the ranks see different newest checkpoints ({seen}); "
                         f"every rank must see one shared --out alike (a network file system "
                         f"showing a save late?): resume again once they agree")
    meta = _read_meta(path)
    made = []

    def targets(_) -> PieceLoadPlanner:  # each rank's own boxes, once the metadata passed
        pieces, commit = read_targets(engine, meta["optimizer_step"] > 0)
        made.append(commit)
        return PieceLoadPlanner(pieces)

    _read_dcp(path, targets)  # (a rank's failed read fails it on every rank)
    commit = made[0]
    # this rank's own part (its random state): every rank learns whether any failed, and
    # how: a ValueError is bad input (the data order of another --global-batch), said as is
    failed = None
    try:
        _install(path, engine, loader, meta, commit)
    except ValueError as exc:
        failed = ("usage", str(exc))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - named in the error
        failed = ("damaged", f"rank {engine.dims.rank}: {_cause(exc)}")
    causes: list = [None] * dist.get_world_size()
    dist.all_gather_object(causes, failed)
    if any(causes):
        kind, msg = next((c for c in causes if c and c[0] == "usage"),
                         next(c for c in causes if c))
        raise ValueError(msg) if kind == "usage" else _damaged(path, msg)
    dist.barrier()
    return int(meta["step"])


def _read_dcp(path: Path, targets, no_dist: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint ``path`` that ``targets(metadata)`` asks for (a dict of
    tensors to fill, or a :class:`PieceLoadPlanner` of boxes), read through
    :class:`RestrictedReader` (refused metadata raises, on every rank, before DCP runs); any
    other failure is the one-line damaged error."""
    try:
        reader = RestrictedReader(path)
        want = targets(reader.read_metadata())
        planner = want if isinstance(want, PieceLoadPlanner) else None
        state = {} if planner is not None else want
        with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a
            warnings.filterwarnings("ignore", message=".*single process")  # single process"
            dcp.load(state, storage_reader=reader, no_dist=no_dist, planner=planner)
    except Refused:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - named in the error
        raise _damaged(path, _cause(exc)) from None
    return state


def _install(path: Path, engine, loader, meta: dict, commit) -> None:
    commit(meta["optimizer_step"])  # (first: collective under ZeRO)
    # a checkpoint of before this was recorded: every position, as sample assumes
    engine.trained_positions = max(engine.trained_positions,
                                   int(meta.get("trained_positions", engine.mcfg.max_seq_len)))
    loader.load_state_dict(meta["data"])
    if "data_source" in meta and meta["data_source"] != data_source(engine.cfg.data) or \
            _data_changed(meta, engine) and engine.cfg.override_data:
        loader.restart()  # other data (--override-data): from its start
    elif _data_changed(meta, engine):
        raise ValueError(_changed_data(meta, engine))
    _load_rng(path, engine, meta)


def _data_changed(meta: dict, engine) -> bool:
    """Whether the data's contents differ from those the checkpoint trained on (by their
    fingerprints: a checkpoint from before they were recorded, or a run without one, never
    differs)."""
    theirs, ours = meta.get("data_fingerprint"), engine.data_fingerprint
    return theirs is not None and ours is not None and list(theirs) != list(ours)


def _changed_data(meta: dict, engine) -> str:
    """The one-line error of a resume whose ``--data`` holds other contents than it did."""
    theirs, ours = meta["data_fingerprint"], engine.data_fingerprint
    what = (f"{theirs[0]:,} training tokens then, {ours[0]:,} now" if theirs[0] != ours[0]
            else "as many training tokens, other ones" if theirs[1] != ours[1]
            else "other validation tokens")
    data = "the default corpus" if engine.cfg.data is None else f"--data {engine.cfg.data}"
    return (f"--resume: {data} has changed since the checkpoint in --out {engine.cfg.out} "
            f"trained on it ({what}): pass the data it trained on, or add --override-data "
            f"to train on with this data, from its start")


def read_layers(path: Path):
    """``(GPTConfig, {layer index: {canonical name: full tensor}}, tokens)`` of the
    checkpoint folder ``path``: its weights (the fp32 masters of a mixed-precision run), read
    in this process alone (no process group) through :class:`RestrictedReader`, and what
    the run trained on (``"bytes"``, ``"ids"``, or None from a checkpoint before that was
    recorded)."""
    from distllm.models.config import GPTConfig

    meta = _read_meta(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a distllm GPT checkpoint (format "
                         f"{meta.get('format')!r})")
    try:
        cfg = GPTConfig(**meta["model"], name=meta.get("model_name") or "custom")
    except (TypeError, KeyError) as exc:  # (a bad value is GPTConfig's ValueError, named)
        raise ValueError(f"{path}: its meta.json's model is not a GPTConfig this distllm "
                         f"builds ({_cause(exc)}): a checkpoint of another distllm version, "
                         f"or a damaged meta.json") from None
    state = _read_dcp(path, lambda md: {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items() if k.startswith("model.layers.")},
        no_dist=True)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        i, name = key.removeprefix("model.layers.").split(".", 1)
        layers.setdefault(int(i), {})[name] = t
    return cfg, layers, meta.get("tokens")


def install_weights(engine, layers) -> None:
    """Set ``engine``'s weights from full canonical tensors, ``layers(i)`` giving layer
    ``i``'s by canonical name: each rank takes its own boxes of them, as a resume reads them
    (its TP shards; under ZeRO only its optimizer shard's part, into the fp32 master weights,
    so that a bf16 run starts from the source's values and not from their bf16 rounding).
    The optimizer starts fresh. Collective under ZeRO, as a load is."""
    layer = functools.cache(layers)  # each layer's tensors once, for all its parameters
    for chunk in engine.chunks:  # every layer of the stage read on every rank, as before: a
        for i in chunk.layer_ids:  # source that fails to read fails each DP rank alike (a
            layer(i)  # ZeRO rank's boxes may leave a layer out, and the others would wait)
    pieces, commit = read_targets(engine, with_optim=False)
    for fqn, (shape, boxes) in pieces.items():
        i, name = fqn.removeprefix("model.layers.").split(".", 1)
        full = layer(int(i))[name]
        if tuple(full.shape) != tuple(shape):
            raise ValueError(f"layer {i} {name}: the source's tensor is {tuple(full.shape)}, "
                             f"the model's {tuple(shape)}")
        for off, t in boxes:
            t.copy_(full[tuple(slice(o, o + n) for o, n in zip(off, t.shape, strict=True))])
    commit(0)


def rng_state(device: torch.device) -> dict:
    """The random state of this process on ``device``: the CPU generator's and, for a GPU,
    that GPU's (``cuda``: a list of one; every visible GPU's, as checkpoints before held,
    would not load where another number of GPUs is visible)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []}


def set_rng_state(rng: dict, device: torch.device) -> None:
    """Restore :func:`rng_state`'s ``rng`` on ``device`` (a list of every visible GPU's
    state, from an older checkpoint: ``device``'s own)."""
    torch.set_rng_state(rng["cpu"])
    cuda = rng["cuda"]
    if device.type != "cuda" or not cuda:
        return
    if len(cuda) == 1:
        torch.cuda.set_rng_state(cuda[0], device)
    elif (device.index or 0) < len(cuda):  # a checkpoint with every visible GPU's state
        torch.cuda.set_rng_state(cuda[device.index or 0], device)


def _load_rng(path: Path, engine, meta: dict) -> None:
    d = engine.dims
    lay = meta["layout"]
    same = (lay["tp"], lay["pp"], lay["dp"], lay["world"]) == (d.tp, d.pp, d.dp, d.world_size)
    f = path / "rng" / f"rank{d.rank}.pt"
    if same and f.is_file():
        try:
            rng = torch.load(f, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file: the one-line error
            why = weights_only_refusal(exc) or _cause(exc)
            raise RuntimeError(f"rng/{f.name}: {why}") from None  # named by load_latest
        set_rng_state(rng, d.device)
