"""A CUDA job without a GPU: fake CUDA tensors, NCCL stood in for, and a recorder.

* Tensors: under :func:`fake_cuda`, ``torch.randn(4, device="cuda")`` is a ``FakeTensor``
  that carries its device and shape but no data, and an op raises when a CPU tensor meets
  a CUDA one, exactly where a GPU would raise; ops on CPU tensors alone run for real.
* Process groups: the ``fake`` backend (``FakeStore``) answers every collective at once;
  :class:`CudaDims` is a ``ParallelDims`` over it whose ``device`` is ``cuda:0`` (the only
  thing that differs from an NCCL job for the code under test).
* :class:`Recorder` wraps every ``torch.distributed`` collective and point-to-point call,
  wherever the code under test reaches it (``torch.distributed``, ``distributed_c10d``,
  or a reference a ``distllm`` module took at import, as ``distllm.comm.compat`` does),
  keeps the devices of the tensors each call received, and raises at a call given a
  tensor that is not on CUDA.
* :class:`Host` stands in for device-to-host reads (``item``, ``tolist``, ``float()``,
  ``bool()``, ...): a read of a CUDA tensor is recorded as a host sync and answered with
  zeros (or what :attr:`Host.value` says), since fake tensors hold no values.
* The CUDA runtime calls the overlap engines make (streams, events, ``synchronize``) are
  replaced by inert stand-ins, as they would ask for a driver.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distllm.parallel.mesh import ParallelDims

CUDA = torch.device("cuda", 0)

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
)


class CudaDims(ParallelDims):
    """``ParallelDims`` whose device is ``cuda:0``, as under NCCL (here over the fake backend)."""

    @property
    def device(self) -> torch.device:
        return CUDA


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size``-rank job on the fake backend."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


PKG = os.path.dirname(os.path.abspath(sys.modules["distllm"].__file__)) + os.sep
WRAPPERS = os.path.join(PKG, "comm") + os.sep  # the collectives every caller goes through


def _caller(past_wrappers: bool = False) -> str:
    """``path:line (function)`` of the innermost frame in the distllm package (with
    ``past_wrappers``, outside its collective wrappers, :mod:`distllm.comm`: the code that
    asked for the collective)."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if fr.filename.startswith(PKG) and not (past_wrappers and
                                                fr.filename.startswith(WRAPPERS)):
            return f"{fr.filename[len(PKG):]}:{fr.lineno} ({fr.name})"
    return "?"


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, dist.P2POp):
            leaf = leaf.tensor
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out


@dataclass
class Call:
    name: str
    devices: tuple[torch.device, ...]
    where: str  # the distllm code that asked for it (past the wrappers in distllm.comm)


@dataclass
class Recorder:
    """The collectives called while :meth:`installed`, with their tensors' devices."""

    calls: list[Call] = field(default_factory=list)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            ts = _tensors(args, kwargs)
            call = Call(name, tuple(t.device for t in ts), _caller(past_wrappers=True))
            self.calls.append(call)
            if any(d.type != "cuda" for d in call.devices):  # fail here, with the traceback
                raise AssertionError(f"{name} at {call.where} was given tensors on "
                                     f"{[str(d) for d in call.devices]}: NCCL needs CUDA tensors")
            return fn(*args, **kwargs)

        recorded.__wrapped__ = fn
        return recorded

    @contextlib.contextmanager
    def installed(self) -> Iterator[Recorder]:
        originals = {getattr(dist, n): n for n in COLLECTIVES if hasattr(dist, n)}
        wrapped = {fn: self._wrap(n, fn) for fn, n in originals.items()}
        mods = [dist, c10d] + [m for name, m in list(sys.modules.items())
                               if name.startswith("distllm") and m is not None]
        undo = []
        for mod in mods:
            for attr, val in list(vars(mod).items()):
                if callable(val) and val in wrapped:
                    undo.append((mod, attr, val))
                    setattr(mod, attr, wrapped[val])
        try:
            yield self
        finally:
            for mod, attr, val in undo:
                setattr(mod, attr, val)

    def names(self) -> set[str]:
        return {c.name for c in self.calls}

    def off_device(self) -> list[Call]:
        """Calls that received a tensor not on CUDA (NCCL would reject them)."""
        return [c for c in self.calls if any(d.type != "cuda" for d in c.devices)]

    def check(self, expect: set[str]) -> None:
        """Every collective got only CUDA tensors, and each of ``expect`` ran at least once."""
        bad = self.off_device()
        assert not bad, "collectives given CPU tensors (NCCL would fail): " + "; ".join(
            f"{c.name} at {c.where} on {[str(d) for d in c.devices]}" for c in bad)
        missing = expect - self.names()
        assert not missing, f"expected collectives {sorted(missing)} did not run: {self.calls}"


_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__complex__",
          "numpy", "cpu")


def _as_read(t: torch.Tensor, how: str, value: float | list):
    """``value`` in the form the read ``how`` of tensor ``t`` returns (a list: as is)."""
    if isinstance(value, list):
        return value
    if how == "tolist":
        out: object = float(value)
        for n in reversed(t.shape):  # nested lists, no tensor made (fake mode is on)
            out = [out] * n if not isinstance(out, list) else [list(out) for _ in range(n)]
        return out
    if how == "__bool__":
        return bool(value)
    if how in ("__int__", "__index__"):
        return int(value)
    return float(value)


@dataclass
class Host:
    """Device-to-host reads of CUDA tensors (and of their fake CPU copies), counted and
    answered (fake tensors have no values): every element reads as ``value(tensor)``, 0 by
    default (a list: what ``tolist`` returns). Reads of real CPU tensors go to torch."""

    syncs: list[tuple[str, str]] = field(default_factory=list)
    value: Callable[[torch.Tensor], float | list] = lambda t: 0.0

    @contextlib.contextmanager
    def installed(self) -> Iterator[Host]:
        # FakeTensor has its own tolist (element by element): patch it as well
        saved = {(torch.Tensor, n): getattr(torch.Tensor, n) for n in _READS}
        saved |= {(FakeTensor, n): vars(FakeTensor)[n] for n in _READS if n in vars(FakeTensor)}
        inherited = {n for n in _READS if n not in vars(torch.Tensor)}  # from the C base

        def make(how: str, orig: Callable):
            def read(t, *args, **kwargs):
                # (a fake CPU tensor is a copy of a CUDA one: its values never existed)
                if t.device.type != "cuda" and not isinstance(t, FakeTensor):
                    return orig(t, *args, **kwargs)
                self.syncs.append((how, _caller()))
                if how in ("cpu", "numpy"):
                    return orig(t, *args, **kwargs)
                return _as_read(t, how, self.value(t))

            return read

        for (cls, n), orig in saved.items():
            setattr(cls, n, make(n, orig))
        try:
            yield self
        finally:
            for (cls, n), orig in saved.items():
                if cls is torch.Tensor and n in inherited:
                    delattr(cls, n)
                else:
                    setattr(cls, n, orig)


class _Inert:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: every method does nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


@contextlib.contextmanager
def no_cuda_runtime(monkeypatch) -> Iterator[None]:
    """Inert CUDA streams, events and synchronisation (the driver calls the overlap engines
    and timers make)."""
    monkeypatch.setattr(torch.cuda, "Stream", _Inert)
    monkeypatch.setattr(torch.cuda, "Event", _Inert)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Inert())
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: _Inert())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    yield


class _FakeCudaOnly(TorchDispatchMode):
    """Over a ``FakeTensorMode``: an op that touches CUDA (a fake tensor among its arguments,
    or a CUDA device asked for) goes to the fake mode; any other runs for real, so CPU work
    (model construction, index arithmetic, CPU-side optimizer counters) keeps its values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(x, FakeTensor) or (isinstance(x, torch.device) and x.type == "cuda")
               for x in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """CUDA tensors are fake (device and shape, no data; a CPU tensor meeting one raises as
    on a GPU); CPU tensors stay real."""
    with FakeTensorMode(allow_non_fake_inputs=True), _FakeCudaOnly():
        yield


class _QueuedCallbacks:
    """Stands in for autograd's engine while a backward pass is emulated: keeps the
    callbacks queued for the end of the pass."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] = []

    def queue_callback(self, cb: Callable[[], None]) -> None:
        self.queued.append(cb)


def emulate_backward(monkeypatch, steps: list) -> None:
    """What autograd does in a backward pass, without running one (autograd's engine asks
    the CUDA driver for a context): for each ``(param, grad)`` of ``steps`` accumulate
    ``grad`` into ``param.grad`` and run the param's post-accumulate-grad hooks; a callable
    in ``steps`` is called there (a tensor hook firing); finally the queued callbacks run.
    A ``grad`` of None is drawn at that point, shaped like the parameter then (ZeRO-3
    parameters are empty until their unit is gathered)."""
    engine = _QueuedCallbacks()
    with monkeypatch.context() as m:
        m.setattr(torch.autograd.Variable, "_execution_engine", engine)
        for item in steps:
            if callable(item):
                item()
                continue
            p, g = item
            g = torch.randn_like(p) if g is None else g
            with torch.no_grad():
                p.grad = g.clone() if p.grad is None else p.grad + g
            for hook in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p)
        for cb in engine.queued:
            cb()
