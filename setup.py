"""Build of distllm: the pure-Python package plus two torch extensions.

- ``distllm._C``    C++ CPU ops from ``csrc/*.cpp``; always built.
- ``distllm._cuda`` CUDA ops from ``csrc/cuda/*.cu`` (cuBLASLt epilogues, elementwise kernels).
  ``DISTLLM_BUILD_CUDA`` unset: built when a CUDA toolkit and a CUDA-enabled torch are both
  present. ``=1``: forced, and the build fails with the reason when it cannot. ``=0``: skipped.
  ``TORCH_CUDA_ARCH_LIST`` is respected (default "8.0;9.0+PTX"); ``MAX_JOBS`` as in torch.
  A toolkit of another CUDA major version than torch's is skipped in auto mode (torch's
  build would refuse it) and refused with ``=1``.

``kernels/`` installs as ``distllm.kernels`` and ``bench/`` as ``distllm.bench``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent.resolve()


def _log(msg: str) -> None:
    print(f"distllm setup: {msg}", file=sys.stderr, flush=True)


def _nvcc_toolkit_root() -> str | None:
    """The real CUDA toolkit root, asked of nvcc itself.

    ``nvcc`` on PATH may be a wrapper script outside the toolkit, so the parent of its
    directory (torch's guess) can be wrong; ``nvcc --dryrun`` prints the ``TOP`` it uses.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for cand in ("/usr/local/cuda/bin/nvcc", *sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"))):
            if os.path.exists(cand):
                nvcc = cand
                break
    if nvcc is None:
        return None
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-v", "-x", "cu", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.MULTILINE)
    if not m:
        return None
    root = os.path.realpath(m.group(1).strip())
    return root if os.path.exists(os.path.join(root, "bin", "nvcc")) else None


def _cuda_mode() -> str:
    mode = os.environ.get("DISTLLM_BUILD_CUDA", "").strip()
    if mode not in ("", "0", "1"):
        raise SystemExit(
            f"DISTLLM_BUILD_CUDA={mode!r}: use 1 (force), 0 (skip) or leave unset (auto)"
        )
    return mode


def _wheel_cuda_dirs() -> tuple[list[str], list[str]]:
    """Include and library dirs of the NVIDIA wheels next to a CUDA torch (cuBLASLt, NCCL)."""
    import torch

    site = Path(torch.__file__).parent.parent / "nvidia"
    incs, libs = [], []
    for sub in ("cu13", "cu12", "cublas", "nccl"):
        d = site / sub
        if (d / "include").is_dir():
            incs.append(str(d / "include"))
        if (d / "lib").is_dir():
            libs.append(str(d / "lib"))
    return incs, libs


def _cublaslt_link_arg(lib_dirs: list[str], toolkit: str) -> list[str]:
    for d in [*lib_dirs, os.path.join(toolkit, "lib64"), os.path.join(toolkit, "lib")]:
        if os.path.exists(os.path.join(d, "libcublasLt.so")):
            return ["-lcublasLt"]
        versioned = sorted(glob.glob(os.path.join(d, "libcublasLt.so.*")))
        if versioned:
            return [f"-l:{os.path.basename(versioned[0])}", f"-Wl,-rpath,{d}"]
    raise SystemExit(
        "DISTLLM_BUILD_CUDA: libcublasLt not found in the CUDA toolkit or torch's NVIDIA wheels; "
        "install nvidia-cublas or set CUDA_HOME to a toolkit that has it"
    )


def _nvcc_major(toolkit: str) -> int | None:
    """The CUDA major version of ``toolkit``'s nvcc ("release 13.0" -> 13), or None."""
    try:
        out = subprocess.run([os.path.join(toolkit, "bin", "nvcc"), "--version"],
                             capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def _extensions():
    mode = _cuda_mode()
    if mode != "0" and "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        root = _nvcc_toolkit_root()
        if root:
            # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
            os.environ["CUDA_HOME"] = root
    import torch
    from torch.utils import cpp_extension as ce

    # PTX of the newest architecture too: a newer GPU JIT-compiles it (no "no kernel image")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    cxx = ["-O3", "-std=c++20", "-fopenmp"]
    exts = [
        ce.CppExtension(
            "distllm._C",
            sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.cpp")),
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    ]
    why_not = None
    if ce.CUDA_HOME is None:
        why_not = "no CUDA toolkit found (nvcc not on PATH and CUDA_HOME unset)"
    elif torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is a CPU build"
    elif (nvcc := _nvcc_major(ce.CUDA_HOME)) != int(torch.version.cuda.split(".")[0]):
        # torch's build_ext refuses a toolkit of another major version, and would fail the
        # whole install (the CPU extension and the Python package with it)
        why_not = (f"the CUDA toolkit at {ce.CUDA_HOME} is CUDA {nvcc or 'of unknown version'}, "
                   f"torch {torch.__version__} was built with CUDA {torch.version.cuda}: point "
                   f"CUDA_HOME at a CUDA {torch.version.cuda.split('.')[0]}.x toolkit")
    if mode == "0":
        _log("DISTLLM_BUILD_CUDA=0: skipping distllm._cuda")
        return exts
    if why_not:
        if mode == "1":
            raise SystemExit(
                f"DISTLLM_BUILD_CUDA=1 but the CUDA extension cannot be built: {why_not}"
            )
        _log(f"skipping distllm._cuda: {why_not}")
        return exts
    incs, libs = _wheel_cuda_dirs()
    _log(
        f"building distllm._cuda with CUDA_HOME={ce.CUDA_HOME}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"
    )
    srcs = sorted(str(p.relative_to(HERE)) for ext in ("cu", "cpp")  # not the headers
                  for p in (HERE / "csrc" / "cuda").glob(f"*.{ext}"))
    exts.append(
        ce.CUDAExtension(
            "distllm._cuda",
            srcs,
            include_dirs=incs,
            library_dirs=libs,
            extra_compile_args={
                "cxx": ["-O3", "-std=c++20"],
                "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr"],
            },
            extra_link_args=_cublaslt_link_arg(libs, ce.CUDA_HOME),
        )
    )
    return exts


def main() -> None:
    ext_modules = _extensions()  # first: it may set CUDA_HOME before cpp_extension is imported
    from torch.utils.cpp_extension import BuildExtension

    setup(
        packages=[
            "distllm",
            *[f"distllm.{p}" for p in _subpackages("distllm")],
            "distllm.kernels",
            "distllm.bench",
        ],
        package_dir={"distllm": "distllm", "distllm.kernels": "kernels", "distllm.bench": "bench"},
        package_data={"distllm": ["plan/profiles/*.json"], "distllm.bench": ["*.sh"]},
        ext_modules=ext_modules,
        cmdclass={
            "build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
        },
    )


def _subpackages(root: str) -> list[str]:
    out = []
    for init in sorted((HERE / root).rglob("__init__.py")):
        rel = init.parent.relative_to(HERE / root)
        if str(rel) != ".":
            out.append(".".join(rel.parts))
    return out


if __name__ == "__main__":
    main()
