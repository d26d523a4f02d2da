"""Hardware profiles: peak FLOP/s per dtype, memory, and one alpha-beta model per link class.

A profile is a JSON file (``distllm/plan/profiles/<name>.json``, or any path). Published
figures carry their source in the file's ``source`` fields; ``distllm plan --calibrate``
writes a measured one for the machine it runs on.
"""

from __future__ import annotations

import json
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
    def from_json(cls, d: dict[str, Any]) -> Profile:
        try:
            links = {k: Link(**v) for k, v in d["links"].items()}
            for need in ("intra", "inter"):
                if need not in links:
                    raise ValueError(f"profile {d.get('name')!r} lacks the {need!r} link class")
            kw = {
                k: d[k]
                for k in (
                    "matmul_efficiency",
                    "usable_memory_fraction",
                    "gpus_per_node",
                    "op_overhead_s",
                    "cores",
                    "step_overhead_s",
                    "memory_efficiency",
                    "flash_efficiency",
                    "core_sharing",
                    "description",
                    "source",
                )
                if k in d
            }
            if "gelu_s_per_element" in d:
                fwd, bwd = d["gelu_s_per_element"]
                kw["gelu_s_per_element"] = (float(fwd), float(bwd))
            if d.get("gemm"):
                kw["gemm"] = Gemm(**d["gemm"])
            peak = {_peak_key(k): float(v) for k, v in d["peak_flops"].items()}
            return cls(
                name=d["name"],
                peak_flops=peak,
                memory_bytes=float(d["memory_bytes"]),
                memory_bandwidth=float(d["memory_bandwidth"]),
                links=links,
                **kw,
            )
        except KeyError as e:
            raise ValueError(f"profile is missing the field {e.args[0]!r}") from None
        except TypeError as e:  # an unknown key in a link or in "gemm"
            raise ValueError(f"profile {d.get('name')!r} has a malformed entry: {e}") from None


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path | Profile) -> Profile:
    """A profile by name (``a100-80gb``, ``h100``, ``h200``, ``cpu``) or by JSON path."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    s = str(name_or_path)
    path = Path(s) if s.endswith(".json") else PROFILE_DIR / f"{s.lower()}.json"
    if not path.is_file():
        if s.endswith(".json"):
            raise ValueError(f"--gpu {s}: no such file; give the path of a profile .json "
                             f"(distllm plan --calibrate writes one), or one of "
                             f"{', '.join(profile_names())}")
        raise ValueError(
            f"unknown hardware profile {s!r}: choose --gpu from "
            f"{', '.join(profile_names())} or give a profile .json path"
        )
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except ValueError as e:  # json.JSONDecodeError is one
        where = s if s.endswith(".json") else f"{s} ({path})"
        raise ValueError(f"--gpu {where} is not a valid profile: {e}") from None


# a GPU's name -> the profile of that GPU; the device's memory must match the profile's too
_GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"))
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
    (A100 80GB -> a100-80gb, H100 -> h100, H200 -> h200) when its memory is within 10% of
    the profile's (the name alone where neither the driver nor the name gives the memory);
    another GPU, or one of these with a different memory size, is an error that says how to
    plan for it."""
    import torch  # lazy: the planner itself does not need torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    known = ", ".join(profile_names())
    for key, prof in _GPU_NAMES:
        if key not in name:
            continue
        want, have = load_profile(prof).memory_bytes, _device_memory(name)
        if have is None or abs(have / want - 1) <= _MEMORY_TOLERANCE:
            return prof
        raise ValueError(
            f"no hardware profile for {name!r} with {have / 2**30:.0f} GiB (the {prof} "
            f"profile has {want / 2**30:.0f} GiB; packaged: {known}), {_NO_PROFILE}"
        )
    raise ValueError(f"no hardware profile for {name!r} (packaged: {known}), {_NO_PROFILE}")
