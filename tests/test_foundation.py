"""Foundation checks: the CLI, `distllm info`, lazy extensions with a fallback, the
toolkit lookup of the build, and the installed layout (kernels/ and bench/ as subpackages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "distllm", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


def test_info_reports_every_backend_truthfully():
    out = _run("info", "--json", env={"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    rows = {r["backend"].split(" (")[0]: r for r in info["backends"]}
    assert set(rows) >= {
        "CPU extension",
        "CUDA extension",
        "Triton",
        "Triton interpreter",
        "reference",
    }
    assert rows["CPU extension"]["built"] and rows["CPU extension"]["usable"]
    import torch

    if not torch.cuda.is_available():
        assert not rows["CUDA extension"]["usable"] and rows["CUDA extension"]["reason"] != "ok"
        assert not rows["Triton"]["usable"]
    assert rows["Triton interpreter"]["usable"]  # TRITON_INTERPRET=1 was set for this run
    assert info["torch"] and info["python"] and info["devices"][0].startswith("cpu")
    ops = info["ops"]["linear_gelu"]
    assert ops["reference"].startswith("ok") and ops["cpu"].startswith("ok")
    if not torch.cuda.is_available():
        assert ops["cuda"].startswith("unavailable")


def test_info_says_triton_cannot_run_on_a_gpu_under_the_interpreter(monkeypatch):
    """With a GPU and TRITON_INTERPRET=1, the Triton backend refuses CUDA tensors: the GPU
    row said "usable" (the op table beside it said otherwise). The CPU count is this
    process's cores (its affinity), not the machine's."""
    import torch

    from distllm import info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = {r["backend"].split(" (")[0]: r for r in info.backend_table()}
    assert not rows["Triton"]["usable"] and "TRITON_INTERPRET=1" in rows["Triton"]["reason"]
    assert rows["Triton interpreter"]["usable"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rows = {r["backend"].split(" (")[0]: r for r in info.backend_table()}
    assert rows["Triton"]["usable"] and rows["Triton"]["reason"] == "ok"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert info.collect()["devices"][0].startswith("cpu (1 cores,")


def test_info_text_and_unknown_command():
    out = _run("info")
    assert out.returncode == 0 and "| backend | built | usable | reason |" in out.stdout
    bad = _run("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def test_missing_extension_warns_once_and_falls_back():
    # Block distllm._C at import: distllm still imports, bias_gelu uses the reference.
    code = r"""
import importlib.abc, logging, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "distllm._C":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import torch, distllm
from distllm.ops import bias_gelu
x = torch.randn(3, 5, dtype=torch.float64)
b = torch.randn(5, dtype=torch.float64)
y1 = bias_gelu(x, b); y2 = bias_gelu(x, b)
ref = torch.nn.functional.gelu(x + b)
assert torch.equal(y1, ref) and torch.equal(y2, ref)
print("ok")
"""
    out = _run(code=code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "distllm._C unavailable" in ln]
    assert len(warnings) == 1 and "blocked for the test" in warnings[0]


def test_import_distllm_loads_the_library_only():
    # plain imports of the library's packages; Triton, the benchmark suite, the testing
    # helpers and the compiled extensions wait until asked for
    code = r"""
import sys, distllm
print(distllm.nn.fuse.__module__, distllm.ops.linear_gelu.__module__)
print(sorted(m for m in ("triton", "distllm.kernels", "distllm.bench", "distllm.testing",
                         "distllm._C", "distllm._cuda") if m in sys.modules))
"""
    out = _run(code=code)
    assert out.returncode == 0, out.stderr
    names, loaded = out.stdout.splitlines()[:2]
    assert names == "distllm.nn.fused distllm.ops.linear_gelu", out.stdout
    assert loaded == "[]", f"import distllm loaded {loaded}"


def test_installed_layout_maps_kernels_and_bench():
    import distllm.bench.harness
    import distllm.kernels

    assert Path(distllm.kernels.__file__).resolve().parent == ROOT / "kernels"
    assert Path(distllm.bench.harness.__file__).resolve().parent == ROOT / "bench"


def test_build_finds_the_real_toolkit_root():
    sys.path.insert(0, str(ROOT))
    try:
        import setup as build
    finally:
        sys.path.pop(0)
    import shutil

    root = build._nvcc_toolkit_root()
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        assert root is None
    else:
        assert root is not None and (Path(root) / "bin" / "nvcc").exists()
        assert (Path(root) / "include" / "cuda_runtime.h").exists()


def test_build_mode_knob_is_checked(monkeypatch):
    sys.path.insert(0, str(ROOT))
    try:
        import setup as build
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("DISTLLM_BUILD_CUDA", "yes")
    with pytest.raises(SystemExit, match="DISTLLM_BUILD_CUDA='yes'"):
        build._cuda_mode()


@pytest.mark.parametrize("mode", ["", "1"])
def test_build_skips_a_toolkit_of_another_cuda_major(monkeypatch, tmp_path, mode):
    """torch's build_ext refuses a toolkit whose CUDA major differs from torch's and would
    fail the whole install: auto mode builds the CPU extension alone, "=1" names the cause."""
    import torch
    from torch.utils import cpp_extension as ce

    sys.path.insert(0, str(ROOT))
    try:
        import setup as build
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    other = 12
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {other}.8, V{other}.8.9'\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(ce, "CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("DISTLLM_BUILD_CUDA", mode)
    if mode == "1":
        with pytest.raises(SystemExit, match=f"is CUDA {other}, torch .* CUDA_HOME"):
            build._extensions()
    else:
        assert [e.name for e in build._extensions()] == ["distllm._C"]
    assert build._nvcc_major(str(tmp_path)) == other
