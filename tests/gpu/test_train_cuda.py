"""One training step of the tiny GPT at tp1.pp1 on CUDA in a 1-rank NCCL world, built as
``distllm train`` builds it (:class:`distllm.train.engine.Engine`): in bfloat16 (bf16 weights,
fp32 master weights in ZeroOptimizer) and in float32 under ``torch.autocast(bfloat16)``,
each against a float64 engine holding the same weights: the loss, the global gradient norm,
and the loss after one AdamW step on the same batch; the column-parallel layers (the fused
GEMM + GeLU of the MLP among them) compute in bf16 in both.

Needing more than one GPU, and therefore not here: the same step at tp >= 2 (TP all-reduces,
overlap engines with NCCL peers), pp >= 2 (NCCL P2P) and dp >= 2.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._nccl import run_nccl
from tests.train._util import make_cfg

pytestmark = pytest.mark.gpu

# bf16 rounds every activation and weight to 8 mantissa bits (2^-8 = 3.9e-3 relative); the
# loss is a mean over 256 tokens and the norm a sum over ~0.8M squared gradients, which
# average those roundings: 1e-2 and 3e-2 relative leave a margin of several times the
# differences measured on CPU (~1e-4 and ~1e-3).
LOSS_TOL, NORM_TOL = 1e-2, 3e-2


def _one_step(device_type: str, dtype: str, autocast: bool, out: str) -> dict[str, float]:
    from distllm import ParallelDims
    from distllm.nn import ColumnParallelLinear
    from distllm.ops import backend_choice
    from distllm.train.engine import Engine

    dims = ParallelDims(tp=1, pp=1, dp=1)
    assert dims.device.type == device_type
    cfg = make_cfg(None, out, dtype=dtype, steps=1)
    mcfg = cfg.model_config()
    eng = Engine(cfg, mcfg, dims)
    ref = Engine(make_cfg(None, out, dtype="float64", steps=1), mcfg, dims)
    ref.chunks[0].load_state_dict(eng.chunks[0].state_dict())  # the same weights, upcast
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(mcfg.vocab_size, (8, 32), generator=g)
    tgt = torch.randint(mcfg.vocab_size, (8, 32), generator=g)
    # what the column-parallel layers (QKV, and the fused GEMM + GeLU of the MLP) return
    out_dtypes: set[torch.dtype] = set()
    for m in eng.chunks[0].modules():
        if isinstance(m, ColumnParallelLinear):
            m.register_forward_hook(lambda mod, inp, out: out_dtypes.add(out.dtype))
    res = {}
    for name, e, on in (("", eng, autocast), ("ref_", ref, False)):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=on):
            res[name + "loss"] = e.train_step(tok, tgt)
        if not name:  # the dtypes linear_gelu computed in (its measured choices are per dtype)
            keys = [k for k in backend_choice.cached() if "|linear_gelu|" in k]
            res["linear_gelu_in_bf16"] = float(bool(keys) and all("bfloat16" in k for k in keys))
        res[name + "norm"] = e.step(1.0)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=on):
            res[name + "loss_after"] = e.eval_loss(tok, tgt)
    res["layers_in_bf16"] = float(out_dtypes == {torch.bfloat16})
    params = [p for c in eng.chunks for p in c.parameters()]
    res["param_device_ok"] = float(all(p.device.type == device_type for p in params))
    res["finite"] = float(all(bool(torch.isfinite(p).all()) for p in params))
    return res


@pytest.mark.parametrize("dtype,autocast", [("bfloat16", False), ("float32", True)])
def test_tiny_gpt_one_step(tmp_path, dtype, autocast):
    r = run_nccl(_one_step, "cuda", dtype, autocast, str(tmp_path))
    assert r["param_device_ok"] == 1.0 and r["finite"] == 1.0, r
    # under autocast too: the fused MLP GEMM follows it, whichever backend "auto" picks
    assert r["layers_in_bf16"] == 1.0 and r["linear_gelu_in_bf16"] == 1.0, r
    for key, tol in (("loss", LOSS_TOL), ("norm", NORM_TOL), ("loss_after", LOSS_TOL)):
        assert abs(r[key] - r["ref_" + key]) <= tol * abs(r["ref_" + key]), (key, r)
    assert r["loss_after"] < r["loss"], r  # the step moved the weights downhill


def _polls_on_nccl() -> tuple[list, str]:
    import os
    import signal

    import torch.distributed as dist

    from distllm.train.stop_signal import StopSignal

    got = []
    with StopSignal(("SIGUSR1",)) as stop:
        backend = dist.get_backend(stop.group)
        got.append(stop.poll())
        os.kill(os.getpid(), signal.SIGUSR1)
        got.append(stop.poll())
        got.append(stop.poll())
    return got, backend


def test_stop_signal_agrees_beside_nccl():
    """In an NCCL world the stop flag goes over a gloo group of its own, as a CPU tensor
    (no CUDA stream waits for it)."""
    got, backend = run_nccl(_polls_on_nccl)
    assert backend == "gloo" and got == [None, None, "SIGUSR1"]
