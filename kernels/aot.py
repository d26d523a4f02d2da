"""Ahead-of-time compilation of every Triton kernel of the project, with no GPU.

The Triton interpreter (``TRITON_INTERPRET=1``, what CPU tests run) is not the compiler: it
accepts code the compiler refuses (a plain module float read inside ``@triton.jit``, for
one). This module compiles each kernel the way a GPU launch would, through
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, which stops at PTX
and cubin and needs no driver, and reads back the shared memory each variant uses.

Each kernel module lists what its launchers can launch in ``aot_variants()``: one
:class:`Variant` per (kernel, dtype, specialization, tuning config). Every module-level
``@triton.jit`` function whose name ends in ``_kernel`` must be covered, so that a new
kernel is compiled here the day it is written.

Run ``python -m distllm.kernels.aot --arch 80,90 --json out.json`` (``TRITON_INTERPRET``
must be unset: under the interpreter ``@triton.jit`` does not make compilable functions).
``tests/ops/test_triton_compile.py`` runs it in a subprocess with a fresh
``TRITON_CACHE_DIR``, so a cached result cannot hide a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

# Largest shared memory one block may use (opt-in), bytes, per compute capability major.minor:
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
# (8.0: 163 KB; 9.0: 227 KB).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

# Kernel modules of the package (kernels/ is installed as distllm.kernels).
MODULES = ("distllm.kernels.linear_gelu",)

_TRITON_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One launchable specialization of one kernel.

    ``pointers`` name the tensor arguments (all of ``dtype``, except those in
    ``fp32_pointers``), ``ints`` the i32 scalars, ``constexprs`` every ``tl.constexpr``
    argument with the value the launcher passes. ``aligned`` names the arguments a launch
    finds 16-divisible (pointer addresses from the caching allocator, strides and sizes
    that are multiples of 16): Triton specializes on it, so both forms are compiled.
    """

    module: str
    kernel: str
    dtype: str
    pointers: tuple[str, ...]
    ints: tuple[str, ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int
    fp32_pointers: tuple[str, ...] = ()
    aligned: tuple[str, ...] = ()

    def label(self) -> str:
        ce = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs)
        tag = "aligned" if self.aligned else "generic"
        return f"{self.kernel}[{self.dtype},{ce},w{self.num_warps},s{self.num_stages},{tag}]"


def _compile(variant: Variant, arch: int) -> dict:
    """Compile one variant for sm_<arch>; a failure becomes a row with the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(variant.module), variant.kernel)
    tdt = _TRITON_DTYPE[variant.dtype]
    sig: dict[str, str] = {}
    for name in fn.arg_names:
        if name in variant.pointers:
            sig[name] = "*fp32" if name in variant.fp32_pointers else f"*{tdt}"
        elif name in variant.ints:
            sig[name] = "i32"
        else:
            sig[name] = "constexpr"
    constexprs = dict(variant.constexprs)
    missing = [n for n, t in sig.items() if t == "constexpr" and n not in constexprs]
    row = {
        "label": variant.label(),
        "kernel": variant.kernel,
        "dtype": variant.dtype,
        "arch": arch,
        "num_warps": variant.num_warps,
        "num_stages": variant.num_stages,
        "constexprs": {k: v for k, v in variant.constexprs},
        "aligned": bool(variant.aligned),
    }
    if missing:
        return {**row, "ok": False, "error": f"no value for constexpr argument(s) {missing}"}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in variant.aligned}
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
        )
    except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the run
        msg = f"{type(exc).__name__}: {exc}"
        return {**row, "ok": False, "error": msg[-2000:], "seconds": time.perf_counter() - t0}
    shared = int(compiled.metadata.shared)
    limit = SMEM_LIMIT[arch]
    return {
        **row,
        "ok": True,
        "shared_bytes": shared,
        "smem_limit_bytes": limit,
        "fits": shared <= limit,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def variants(arch: int) -> list[Variant]:
    """Every variant the project's launchers can launch on sm_<arch>."""
    out: list[Variant] = []
    for name in MODULES:
        out.extend(importlib.import_module(name).aot_variants(arch))
    return out


def uncovered_kernels() -> list[str]:
    """``module.kernel`` names of launchable JIT functions that no variant covers."""
    import triton

    missing = []
    for name in MODULES:
        mod = importlib.import_module(name)
        covered = {v.kernel for arch in SMEM_LIMIT for v in mod.aot_variants(arch)}
        for attr, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.JITFunction) and attr.endswith("_kernel"):
                if attr not in covered:
                    missing.append(f"{name}.{attr}")
    return missing


def parse_archs(text: str) -> list[int]:
    """The compute capabilities of ``text`` (``"80,90"``), sorted; a ValueError that says
    which are known unless each is one of :data:`SMEM_LIMIT`'s and at least one is given."""
    try:
        archs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{text!r}: give compute capabilities such as 80,90 (known are "
                         f"{sorted(SMEM_LIMIT)})") from None
    unknown = [x for x in archs if x not in SMEM_LIMIT]
    if unknown or not archs:
        raise ValueError(f"{text!r}: {f'unknown {unknown}' if unknown else 'no target'}; known "
                         f"are {sorted(SMEM_LIMIT)}")
    return archs


def run(archs: list[int], jobs: int) -> dict:
    """Compile every variant for every arch in ``jobs`` processes; the rows and a summary."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit(
            "distllm.kernels.aot: unset TRITON_INTERPRET (the interpreter does not compile)"
        )
    tasks = [(v, a) for a in archs for v in variants(a)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(_compile_task, tasks, chunksize=1))
    import triton

    return {
        "triton": triton.__version__,
        "archs": archs,
        "seconds": time.perf_counter() - t0,
        "uncovered": uncovered_kernels(),
        "rows": rows,
        "failed": [r["label"] + f"@sm_{r['arch']}" for r in rows if not r["ok"]],
        "over_smem": [r["label"] + f"@sm_{r['arch']}" for r in rows if r["ok"] and not r["fits"]],
    }


def _compile_task(task: tuple[Variant, int]) -> dict:
    return _compile(*task)


def _table(rows: list[dict]) -> str:
    lines = [
        "| kernel | dtype | arch | config | shared KB | limit KB | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['label']} | {r['dtype']} | sm_{r['arch']} | FAILED | | | |")
            continue
        ce = r["constexprs"]
        cfg = "x".join(str(ce[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in ce)
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | sm_{r['arch']} | {cfg} w{r['num_warps']} "
            f"s{r['num_stages']} | {r['shared_bytes'] / 1024:.0f} | "
            f"{r['smem_limit_bytes'] / 1024:.0f} | {r['seconds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m distllm.kernels.aot", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--json", help="write every row and the summary here")
    ap.add_argument("--table", action="store_true", help="print a markdown table of all rows")
    a = ap.parse_args(argv)
    try:
        archs = parse_archs(a.arch)
    except ValueError as e:
        ap.error(f"--arch {e}")
    res = run(archs, a.jobs)
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(tmp, a.json)
    if a.table:
        print(_table(res["rows"]))
    n = len(res["rows"])
    print(
        f"triton {res['triton']}: {n - len(res['failed'])}/{n} variants compiled for "
        f"sm_{', sm_'.join(map(str, archs))} in {res['seconds']:.0f} s; "
        f"{len(res['over_smem'])} over the shared-memory limit; "
        f"uncovered kernels: {res['uncovered'] or 'none'}"
    )
    for label in res["failed"][:20]:
        print("FAILED", label)
    return 1 if res["failed"] or res["over_smem"] or res["uncovered"] else 0


if __name__ == "__main__":
    sys.exit(main())
