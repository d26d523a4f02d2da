"""Hardware profiles: peak FLOP/s per dtype, memory, and one alpha-beta model per link class.

A profile is a JSON file (``distllm/plan/profiles/<name>.json``, or any path). Published
figures carry their source in the file's ``source`` fields; ``distllm plan --calibrate``
writes a measured one for the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distllm.dtypes import ALIASES

__all__ = [
    "Gemm",
    "Link",
    "Profile",
    "load_profile",
    "profile_names",
    "detect_profile",
    "PROFILE_DIR",
]

PROFILE_DIR = Path(__file__).with_name("profiles")


def _peak_key(dtype: str) -> str:
    """A profile's ``peak_flops`` key: the canonical name of a dtype distllm trains in
    (:mod:`distllm.dtypes`), else the name as written (``float8``, a datasheet figure)."""
    key = dtype.lower()
    return ALIASES.get(key, key)


@dataclass(frozen=True)
class Link:
    """One link class: time of a message of ``n`` bytes is ``latency + n / (bandwidth*eff)``."""

    bandwidth: float
    """Bytes/s per direction per rank (datasheet or measured)."""
    latency: float
    """Seconds per message (alpha)."""
    efficiency: float = 1.0
    """Achievable fraction of ``bandwidth`` (1.0 for measured profiles)."""
    overlap: float = 0.0
    """Fraction of overlappable communication really hidden behind compute on this link
    (0 where communication takes the same CPU cores as the compute, as on loopback)."""
    source: str = ""
    uses_cpu: bool = False
    """Moving the bytes takes the ranks' CPU cores (loopback TCP), so on a CPU profile it
    counts as work competing for the cores; False for a wire the ranks just wait on."""
    tree: bool = True
    """The collective library may run a tree all-reduce where it is cheaper (NCCL); False:
    ring only, the algorithm the link's latency was fitted with (gloo, calibrated)."""
    cpu_latency: float = 0.0
    """CPU seconds per ring step of a collective on each rank (gloo's threads; 0: none)."""
    cpu_per_byte: float = 0.0
    """CPU seconds per byte a rank moves in a collective (gloo's copies and sums; 0: none).
    See :mod:`distllm.plan.comm_cpu`."""

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.bandwidth * self.efficiency)


@dataclass(frozen=True)
class Gemm:
    """GEMM efficiency by shape: a tiled kernel on ``sms`` multiprocessors.

    A GEMM of ``(m, k) @ (k, n)`` is cut into output tiles of ``tile_m x tile_n``; the tiles
    run in waves of ``sms``, so the last wave may leave SMs idle (wave quantization), and a
    tile that sticks out of the matrix does wasted work (tile quantization). A full wave of
    full tiles reaches ``max_efficiency`` of peak; a GEMM whose bytes outweigh its FLOPs is
    bound by memory instead (the roofline)."""

    max_efficiency: float
    """Fraction of peak that the best-shaped large GEMM reaches (a measured maximum)."""
    shape_fraction: float = 1.0
    """What an ordinary large GEMM reaches of that best shape (beyond quantization)."""
    tile_m: int = 256
    tile_n: int = 128
    sms: int = 108
    source: str = ""


@dataclass(frozen=True)
class Profile:
    """A device and its node: what the cost model needs to know about the hardware."""

    name: str
    peak_flops: dict[str, float]
    """FLOP/s of one device per dtype (dense)."""
    memory_bytes: float
    """Device memory (HBM, or the share of host RAM for CPU ranks)."""
    memory_bandwidth: float
    """Bytes/s of device memory, for memory-bound (elementwise, optimizer) work."""
    links: dict[str, Link]
    """``intra`` (inside a node) and ``inter`` (between nodes)."""
    matmul_efficiency: float = 1.0
    """Fraction of peak that large GEMMs reach (1.0 when ``peak_flops`` is measured)."""
    usable_memory_fraction: float = 1.0
    """Fraction of ``memory_bytes`` a layout may plan to use (context, fragmentation)."""
    gpus_per_node: int = 8
    op_overhead_s: float = 0.0
    """Host-side time per operator that is not hidden (eager CPU execution)."""
    cores: int | None = None
    """CPU profiles: cores a node has; ranks beyond that share them (time scales up)."""
    step_overhead_s: float = 0.0
    """Fixed time per optimizer step beyond compute and communication."""
    gemm: Gemm | None = None
    """GEMM efficiency by shape; None: every GEMM runs at ``matmul_efficiency``."""
    memory_efficiency: float = 1.0
    """Achievable fraction of ``memory_bandwidth`` for elementwise kernels (1.0 if measured)."""
    flash_efficiency: float | None = None
    """Fraction of peak a fused (flash) attention kernel reaches; None: the GEMM efficiency."""
    gelu_s_per_element: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds per element of the MLP's GeLU where it is not bound by its
    bytes (a CPU core: the tanh, and the first touch of its fresh output); (0, 0): its bytes
    alone, with the other elementwise work."""
    core_sharing: float = 1.0
    """CPU profiles: factor on the ranks' CPU time when more ranks than ``cores`` share the
    cores (cache and context-switch losses of oversubscription)."""
    description: str = ""
    source: dict[str, Any] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        d = _peak_key(dtype)
        if d not in self.peak_flops:
            raise ValueError(
                f"profile {self.name!r} has no peak FLOP/s for dtype {dtype!r}: "
                f"choose --dtype from {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[d]

    def link(self, crosses_node: bool) -> Link:
        return self.links["inter" if crosses_node else "intra"]

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def to_json(self) -> dict[str, Any]:
        d = {
            k: getattr(self, k)
            for k in (
                "name",
                "description",
                "peak_flops",
                "matmul_efficiency",
                "memory_bytes",
                "usable_memory_fraction",
                "memory_bandwidth",
                "gpus_per_node",
                "op_overhead_s",
                "cores",
                "step_overhead_s",
                "memory_efficiency",
                "flash_efficiency",
                "core_sharing",
            )
        }
        d["gelu_s_per_element"] = list(self.gelu_s_per_element)
        if self.gemm is not None:
            d["gemm"] = dict(vars(self.gemm))
        d["links"] = {
            k: {
                "bandwidth": v.bandwidth,
                "latency": v.latency,
                "efficiency": v.efficiency,
                "overlap": v.overlap,
                "uses_cpu": v.uses_cpu,
                "tree": v.tree,
                "cpu_latency": v.cpu_latency,
                "cpu_per_byte": v.cpu_per_byte,
                "source": v.source,
            }
            for k, v in self.links.items()
        }
        d["source"] = self.source
        return d

    @classmethod
    def from_json(cls, d: Any) -> Profile:
        """A profile from its JSON object; ValueError naming the field that is missing or
        malformed (a wrong type, a count below 1, a zero bandwidth or efficiency)."""
        if not isinstance(d, dict):
            raise ValueError(f"the file holds a JSON {type(d).__name__}, not an object of "
                             "profile fields (see distllm/plan/profiles/a100-80gb.json)")
        for k in ("links", "name", "peak_flops", "memory_bytes", "memory_bandwidth"):
            if k not in d:
                raise ValueError(f"profile is missing the field {k!r}")
        if not isinstance(d["name"], str):
            raise ValueError(f"field 'name' is {d['name']!r}: give a string")
        links = {k: _build(Link, v, _LINK_FIELDS, f"links.{k}")
                 for k, v in _mapping(d["links"], "links").items()}
        for need in ("intra", "inter"):
            if need not in links:
                raise ValueError(f"profile {d['name']!r} lacks the {need!r} link class "
                                 "(field 'links')")
        # a key that is no field (a misspelt one) is an error, not its default quietly taken
        for k in d:
            if k not in _TOP_FIELDS and k not in _OTHER_TOP_FIELDS:
                raise ValueError(f"field {k!r} is not a profile field: choose from "
                                 f"{', '.join((*_OTHER_TOP_FIELDS, *_TOP_FIELDS))}")
        kw = _fields({k: v for k, v in d.items() if k in _TOP_FIELDS}, _TOP_FIELDS, "")
        if "gelu_s_per_element" in d:
            g = d["gelu_s_per_element"]
            if not isinstance(g, list) or len(g) != 2:
                raise ValueError(f"field 'gelu_s_per_element' is {g!r}: give [forward, backward] "
                                 "seconds per element")
            kw["gelu_s_per_element"] = tuple(
                _check(x, "nonneg", f"gelu_s_per_element[{i}]") for i, x in enumerate(g))
        if d.get("gemm"):
            kw["gemm"] = _build(Gemm, d["gemm"], _GEMM_FIELDS, "gemm")
        peak = {_peak_key(str(k)): _check(v, "positive", f"peak_flops.{k}")
                for k, v in _mapping(d["peak_flops"], "peak_flops").items()}
        if not peak:
            raise ValueError("field 'peak_flops' is empty: give FLOP/s per dtype")
        return cls(name=d["name"], peak_flops=peak, links=links, **kw)


# what each numeric field may hold: "positive" (> 0), "nonneg" (>= 0), "fraction" (0 < x <= 1),
# "unit" (0 <= x <= 1), "count" (an integer >= 1); "count?"/"positive?" allow null
_TOP_FIELDS = {
    "memory_bytes": "positive",
    "memory_bandwidth": "positive",
    "matmul_efficiency": "positive",
    "usable_memory_fraction": "fraction",
    "gpus_per_node": "count",
    "op_overhead_s": "nonneg",
    "cores": "count?",
    "step_overhead_s": "nonneg",
    "memory_efficiency": "positive",
    "flash_efficiency": "positive?",
    "core_sharing": "positive",
    "description": str,
    "source": dict,
}
# top-level fields read on their own (not through _TOP_FIELDS)
_OTHER_TOP_FIELDS = ("name", "peak_flops", "links", "gemm", "gelu_s_per_element")
_LINK_FIELDS = {
    "bandwidth": "positive",
    "latency": "nonneg",
    "efficiency": "fraction",
    "overlap": "unit",
    "uses_cpu": bool,
    "tree": bool,
    "cpu_latency": "nonneg",
    "cpu_per_byte": "nonneg",
    "source": str,
}
_GEMM_FIELDS = {
    "max_efficiency": "fraction",
    "shape_fraction": "fraction",
    "tile_m": "count",
    "tile_n": "count",
    "sms": "count",
    "source": str,
}
_WANT = {
    "positive": "a positive number",
    "nonneg": "a number >= 0",
    "fraction": "a number in (0, 1]",
    "unit": "a number in [0, 1]",
    "count": "an integer >= 1",
}


def _mapping(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"field {where!r} is a JSON {type(v).__name__}: give an object")
    return v


def _fields(d: Any, spec: dict, where: str) -> dict:
    """``d``'s fields checked against ``spec`` (name: kind or type); an unknown one is an
    error."""
    out = {}
    for k, v in _mapping(d, where or "profile").items():
        name = f"{where}.{k}" if where else k
        kind = spec.get(k)
        if kind is None:
            raise ValueError(f"field {name!r} is not a profile field: choose from "
                             f"{', '.join(spec)}")
        if isinstance(kind, type):
            if not isinstance(v, kind):
                raise ValueError(f"field {name!r} is {v!r}: give a JSON {kind.__name__}")
            out[k] = v
        elif v is None and kind.endswith("?"):
            out[k] = None
        else:
            out[k] = _check(v, kind.rstrip("?"), name)
    return out


def _build(cls: type, d: Any, spec: dict, where: str):
    """``cls`` from ``d``'s fields (checked by :func:`_fields`); ValueError naming a field
    that ``cls`` needs and ``d`` lacks."""
    kw = _fields(d, spec, where)
    for f in dataclasses.fields(cls):
        needed = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if needed and f.name not in kw:
            raise ValueError(f"profile is missing the field '{where}.{f.name}'")
    return cls(**kw)


def _check(v: Any, kind: str, name: str) -> float | int:
    """``v`` as the number ``kind`` asks for, else ValueError naming the field."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if ok and kind == "count":
        ok = float(v).is_integer() and v >= 1
        v = int(v) if ok else v
    elif ok:
        ok = {"positive": v > 0, "nonneg": v >= 0, "fraction": 0 < v <= 1,
              "unit": 0 <= v <= 1}[kind]
    if not ok:
        raise ValueError(f"field {name!r} is {v!r}: give {_WANT[kind]}")
    return v if kind == "count" else float(v)


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path | Profile) -> Profile:
    """A profile by name (``a100-80gb``, ``h100``, ``h200``, ``cpu``) or by JSON path."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    s = str(name_or_path)
    path = Path(s) if s.endswith(".json") else PROFILE_DIR / f"{s.lower()}.json"
    if s.endswith(".json") and path.is_dir():
        raise ValueError(f"--gpu {s} is a folder: give the path of a profile .json file")
    if not path.is_file():
        if s.endswith(".json"):
            raise ValueError(f"--gpu {s}: no such file; give the path of a profile .json "
                             f"(distllm plan --calibrate writes one), or one of "
                             f"{', '.join(profile_names())}")
        raise ValueError(
            f"unknown hardware profile {s!r}: choose --gpu from "
            f"{', '.join(profile_names())} or give a profile .json path"
        )
    where = s if s.endswith(".json") else f"{s} ({path})"
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except OSError as e:  # unreadable: its permissions, or a folder in its place by now
        raise ValueError(f"--gpu {where} could not be read ({e.strerror or e}): make it "
                         "readable or give another --gpu") from None
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ones
        raise ValueError(f"--gpu {where} is not a valid profile: {e}") from None


# a GPU's name -> the profile of that GPU; the device's memory must match the profile's too
_GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"))
# the PCIe cards (and the NVL ones, PCIe cards bridged in pairs) of those GPUs: slower
# clocks and memory than the SXM modules the profiles describe, no NVLink switch
_OTHER_FORM = re.compile(r"PCI|NVL", re.IGNORECASE)
_MEMORY_TOLERANCE = 0.1  # the driver reports a little less than the datasheet's GiB
_NO_PROFILE = (
    "so `distllm train --plan auto` cannot plan for it: write a profile .json (a copy of "
    "distllm/plan/profiles/a100-80gb.json with this GPU's figures), run `distllm plan --gpu "
    "FILE.json --gpus N` with the model's flags, and give `distllm train` the layout it chooses "
    "(--tp --pp --dp --zero --schedule --micro-batches --virtual-stages --sequence-parallel "
    "--activation-checkpointing) instead of --plan auto"
)


def _device_memory(name: str) -> float | None:
    """Bytes of device 0: the driver's figure, else the name's (``A100-SXM4-40GB``), else
    None."""
    import torch

    try:
        return float(torch.cuda.get_device_properties(0).total_memory)
    except (AssertionError, RuntimeError, AttributeError):  # no driver to ask
        m = re.search(r"(\d+)\s*GB", name)
        return float(m.group(1)) * 2**30 if m else None


def detect_profile() -> str:
    """The profile name of this machine's device: ``cpu`` without CUDA, else the GPU's
    (A100 80GB -> a100-80gb, H100 -> h100, H200 -> h200: the SXM modules) when its memory is
    within 10% of the profile's (the name alone where neither the driver nor the name gives
    the memory); another GPU, one of these with a different memory size, or their PCIe or
    NVL cards, is an error that says how to plan for it."""
    import torch  # lazy: the planner itself does not need torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    known = ", ".join(profile_names())
    for key, prof in _GPU_NAMES:
        if key not in name:
            continue
        if _OTHER_FORM.search(name):
            raise ValueError(
                f"no hardware profile for {name!r} (the {prof} profile is the SXM module: its "
                f"compute, memory bandwidth and NVLink are not this card's; packaged: "
                f"{known}), {_NO_PROFILE}")
        want, have = load_profile(prof).memory_bytes, _device_memory(name)
        if have is None or abs(have / want - 1) <= _MEMORY_TOLERANCE:
            return prof
        raise ValueError(
            f"no hardware profile for {name!r} with {have / 2**30:.0f} GiB (the {prof} "
            f"profile has {want / 2**30:.0f} GiB; packaged: {known}), {_NO_PROFILE}"
        )
    raise ValueError(f"no hardware profile for {name!r} (packaged: {known}), {_NO_PROFILE}")
