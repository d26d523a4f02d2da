"""Every Triton kernel compiles for sm_80 and sm_90, ahead of time and with no GPU.

The interpreter the other CPU tests use accepts code the compiler refuses, so this test
runs the compiler itself (``python -m distllm.kernels.aot``) in a subprocess without
``TRITON_INTERPRET`` and with a fresh ``TRITON_CACHE_DIR``: a cached result from an earlier
compile must not hide a failure. One run serves the tests below (the variants are listed by
each kernel module's ``aot_variants``).

``DISTLLM_AOT_ARCH`` (default ``80,90``) names the targets: CI's torch 2.11 pass, whose Triton
is the one the Hopper GPU machines carry, compiles for ``90`` only; its 2.14.1 pass compiles
for both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from distllm.kernels.aot import parse_archs

# the module fixture's compile runs inside whichever test asks for it first
pytestmark = pytest.mark.timeout(2400)

try:
    ARCHS = parse_archs(os.environ.get("DISTLLM_AOT_ARCH", "80,90"))
except ValueError as e:
    raise pytest.UsageError(f"DISTLLM_AOT_ARCH={e}") from None


@pytest.fixture(scope="module")
def aot(tmp_path_factory) -> dict:
    # ~110 variants per arch; about 2.5 minutes for both archs on two idle cores, several
    # times that under load
    tmp = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")
    out = tmp / "aot.json"
    # its own session, so that a timeout ends the compile workers too (orphans would keep
    # the output pipes open)
    proc = subprocess.Popen(
        [sys.executable, "-m", "distllm.kernels.aot", "--arch", ",".join(map(str, ARCHS)),
         "--json", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=2300)
    except BaseException:  # our timeout, pytest-timeout's, or an interrupt
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert out.exists(), f"the AOT run wrote nothing (rc={proc.returncode}):\n{stderr[-3000:]}"
    res = json.loads(out.read_text())
    res["stdout"] = stdout
    res["returncode"] = proc.returncode
    print(stdout)
    return res


def _errors(res: dict, n: int = 3) -> str:
    bad = [r for r in res["rows"] if not r["ok"]][:n]
    return "\n\n".join(f"{r['label']} @ sm_{r['arch']}:\n{r['error']}" for r in bad)


def test_every_variant_compiles_for_every_target(aot):
    assert aot["rows"], "no variant was compiled: the kernel modules list none"
    assert {r["arch"] for r in aot["rows"]} == set(ARCHS)
    assert not aot["failed"], (
        f"{len(aot['failed'])} of {len(aot['rows'])} Triton variants do not compile "
        f"(triton {aot['triton']}); first errors:\n{_errors(aot)}"
    )


def test_every_kernel_is_covered(aot):
    # A module-level @triton.jit `*_kernel` that no aot_variants() lists would reach a GPU
    # uncompiled: list it in its module's aot_variants().
    assert aot["uncovered"] == []


def test_kept_configs_fit_the_targets_shared_memory(aot):
    # aot_variants() lists only the configs the autotuner keeps on that arch (the same
    # prune); the compiled size must then fit, or the estimate behind the prune is wrong.
    over = [
        f"{r['label']}@sm_{r['arch']}: {r['shared_bytes']} > {r['smem_limit_bytes']}"
        for r in aot["rows"]
        if r["ok"] and not r["fits"]
    ]
    assert over == []


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_dtype_has_forward_tuning_configs(aot, dtype, arch):
    fwd = {
        (r["num_warps"], r["num_stages"], tuple(sorted(r["constexprs"].items())))
        for r in aot["rows"]
        if r["kernel"] == "_fwd_kernel" and r["dtype"] == dtype and r["arch"] == arch
    }
    assert len(fwd) >= 2, f"only {len(fwd)} forward variants for {dtype} on sm_{arch}"


def test_the_prune_keeps_what_the_measured_sizes_allow():
    # The estimate is an upper bound of the compiled size (checked above); it must also not
    # drop the whole list on any target.
    from distllm.kernels import linear_gelu_tuning as k
    from distllm.kernels.aot import SMEM_LIMIT

    # prune() falls back to the smallest config when none fits, so the check is on the
    # configs that fit by the estimate, and prune() must keep exactly those.
    for dt, nbytes in k.ELEM_BYTES.items():
        for arch, limit in SMEM_LIMIT.items():
            configs = k.fwd_configs()
            fits = [c for c in configs if k.smem_estimate(c, nbytes) <= limit]
            assert fits, f"no forward config fits {limit} bytes for {dt} on sm_{arch}"
            assert k.prune(configs, nbytes, limit) == fits


def test_arch_lists_are_parsed_and_checked():
    assert parse_archs("90, 80,90") == [80, 90]
    for bad, why in (("75", r"unknown \[75\]"), ("sm90", "compute capabilities"),
                     ("", "no target")):
        with pytest.raises(ValueError, match=why):
            parse_archs(bad)


_PRECISION_PROBE = """
import importlib, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from distllm.kernels import linear_gelu_tuning as t

v = next(v for v in t.aot_variants(90) if v.kernel == "_fwd_kernel" and v.dtype == "float32"
         and dict(v.constexprs)["ALLOW_TF32"] is (sys.argv[1] == "1") and not v.aligned)
fn = getattr(importlib.import_module(v.module), v.kernel)
sig = {n: "*fp32" if n in v.pointers else "i32" if n in v.ints else "constexpr"
       for n in fn.arg_names}
c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(v.constexprs)),
                   target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": v.num_warps, "num_stages": v.num_stages})
print("tf32" in c.asm["ptx"])
"""


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_torch_switch_not_tritons_default_sets_the_fp32_precision(tmp_path, allow_tf32):
    # TRITON_F32_DEFAULT sets tl.dot's precision where the kernel passes none: set against
    # torch's switch (ALLOW_TF32), it must not turn TF32 on, or off
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_F32_DEFAULT="ieee" if allow_tf32 else "tf32")
    out = subprocess.run([sys.executable, "-c", _PRECISION_PROBE, str(int(allow_tf32))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(allow_tf32)]
