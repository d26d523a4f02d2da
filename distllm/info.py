"""``distllm info``: versions, devices, and for each backend whether it is built and usable."""

from __future__ import annotations

import argparse
import json
import os
import platform


def backend_table() -> list[dict]:
    """One row per backend: name, built, usable, reason."""
    import torch

    from distllm.ops import extensions

    rows = []
    for name, label in (
        ("_C", "CPU extension (distllm._C)"),
        ("_cuda", "CUDA extension (distllm._cuda)"),
    ):
        built = extensions.is_built(name)
        usable, why = extensions.status(name) if built else (False, "not built")
        if name == "_cuda" and not built:
            why = (
                "not built (needs a CUDA toolkit and a CUDA torch at install; "
                "DISTLLM_BUILD_CUDA=1 forces it)"
            )
        rows.append({"backend": label, "built": built, "usable": usable, "reason": why})
    try:
        import triton

        tver = triton.__version__
        tbuilt = True
    except ImportError as exc:
        tver, tbuilt = None, False
        terr = str(exc)
    cuda = torch.cuda.is_available()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    rows.append(
        {
            "backend": f"Triton (GPU){' ' + tver if tver else ''}",
            "built": tbuilt,
            # under the interpreter, Triton runs on the CPU only in this process
            "usable": tbuilt and cuda and not interp,
            "reason": "ok" if tbuilt and cuda and not interp else (
                terr if not tbuilt else "no CUDA device" if not cuda
                else "TRITON_INTERPRET=1: Triton runs on the CPU only in this process"),
        }
    )
    rows.append(
        {
            "backend": "Triton interpreter (CPU)",
            "built": tbuilt,
            "usable": tbuilt and interp,
            "reason": "ok"
            if tbuilt and interp
            else (
                terr
                if not tbuilt
                else "set TRITON_INTERPRET=1 before start to run Triton kernels on CPU"
            ),
        }
    )
    rows.append({"backend": "reference (PyTorch)", "built": True, "usable": True, "reason": "ok"})
    return rows


def collect() -> dict:
    import torch

    import distllm

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    from distllm.train.launch import cores  # this process's (a cgroup or taskset: fewer)

    devices = [f"cpu ({cores()} cores, {torch.get_num_threads()} torch threads)"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB"
            )
    return {
        "distllm": distllm.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_v,
        "platform": platform.platform(),
        "devices": devices,
        "backends": backend_table(),
        "ops": {"linear_gelu": _op_backends()},
    }


def _op_backends() -> dict[str, str]:
    from distllm.ops import backends

    return backends()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the same as JSON")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k in ("distllm", "python", "torch", "torch_cuda", "triton", "platform"):
        print(f"{k:<11} {info[k]}")
    print("devices    " + "\n           ".join(info["devices"]))
    print("\n| backend | built | usable | reason |\n|---|---|---|---|")
    for r in info["backends"]:
        print(
            f"| {r['backend']} | {'yes' if r['built'] else 'no'} | "
            f"{'yes' if r['usable'] else 'no'} | {r['reason']} |"
        )
    for op, table in info["ops"].items():
        print(f"\n| {op} backend | status |\n|---|---|")
        for name, status in table.items():
            print(f"| {name} | {status} |")
    return 0
