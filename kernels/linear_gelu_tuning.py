"""Tuning configurations of the linear + GeLU Triton kernels and the launch space that
``distllm.kernels.aot`` compiles ahead of time: the forward's tile configs for Ampere and
Hopper, the shared-memory prune that drops configs a target cannot launch, and
``aot_variants`` (every specialization a GPU launch can make)."""

from __future__ import annotations

import torch
import triton

__all__ = [
    "BWD_LAUNCH",
    "BWD_META",
    "ELEM_BYTES",
    "aot_variants",
    "fwd_configs",
    "prune",
    "prune_for_launch",
    "smem_estimate",
]

KERNELS = "distllm.kernels.linear_gelu"  # the module whose kernels the variants name
BWD_META = {"BLOCK_M": 32, "BLOCK_N": 128}  # the GeLU-derivative pass's tile on a GPU


def fwd_configs() -> list[triton.Config]:
    """Tile shapes for Ampere (sm80) and Hopper (sm90); the tuner keeps the fastest per shape."""
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 32, 4, 4),
        (128, 64, 32, 4, 4),
        (64, 128, 32, 4, 4),
        (64, 256, 32, 4, 4),
        (64, 64, 32, 4, 4),
        (32, 64, 32, 4, 5),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s
        )
        for bm, bn, bk, w, s in shapes
    ]


def dgelu_configs() -> list[triton.Config]:
    """Tile shapes of the GEMM with the GeLU-derivative epilogue (the fused MLP backward): a
    subset of the forward's, as its GEMM has the forward's shapes (M, ffn/tp, hidden) with
    one more operand read in the epilogue."""
    keep = {(128, 128, 64), (128, 64, 32), (64, 128, 32), (32, 64, 32)}
    return [
        c
        for c in fwd_configs()
        if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) in keep
    ]


def min_block_m(configs: list) -> int:
    """The smallest BLOCK_M among ``configs`` (sizes per-row-block buffers for any of them)."""
    return min(c.kwargs["BLOCK_M"] for c in configs)


BWD_LAUNCH = {"num_warps": 4, "num_stages": 1}  # an elementwise pass: nothing to pipeline
ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def smem_estimate(cfg: triton.Config, elem_bytes: int) -> int:
    """Upper bound of the forward kernel's shared memory: ``num_stages`` buffered (BM, BK)
    and (BK, BN) operand tiles. Hopper's fp32-with-TF32 path (wgmma) holds all of them;
    other paths hold one stage fewer, 16-bit tiles less still. The compiled sizes are
    checked against this bound for sm_80 and sm_90 in tests/ops/test_triton_compile.py."""
    k = cfg.kwargs
    tiles = k["BLOCK_M"] * k["BLOCK_K"] + k["BLOCK_K"] * k["BLOCK_N"]
    return cfg.num_stages * tiles * elem_bytes


def prune(configs: list, elem_bytes: int, smem_limit: int) -> list:
    """The configs whose shared memory fits ``smem_limit`` bytes (fp32's 128x256x64 tiles in
    three stages need 288 KB on Hopper with TF32); the smallest config is always kept."""
    kept = [c for c in configs if smem_estimate(c, elem_bytes) <= smem_limit]
    return kept or configs[-1:]


def prune_for_launch(configs: list, named_args: dict, **kwargs) -> list:
    """``early_config_prune`` of the autotuner: drop configs that cannot launch here."""
    x = named_args["x_ptr"] if "x_ptr" in named_args else named_args["dy_ptr"]
    limit = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    return prune(configs, x.element_size(), limit)


_FWD_POINTERS = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "u_ptr")
_FWD_INTS = (
    "M",
    "N",
    "K",
    "stride_xm",
    "stride_xk",
    "stride_wn",
    "stride_wk",
    "stride_ym",
    "stride_yn",
    "M_BUCKET",
)
# A launch from contiguous tensors: the unit strides, which Triton turns into constants
# (it specializes an int argument equal to 1), and what it finds 16-divisible (M and
# M_BUCKET, the token count and its bucket, are never specialized: do_not_specialize).
_FWD_UNIT = ("stride_xk", "stride_wk", "stride_yn")
_FWD_ALIGNED = (
    "x_ptr",
    "w_ptr",
    "b_ptr",
    "y_ptr",
    "u_ptr",
    "N",
    "K",
    "stride_xm",
    "stride_wn",
    "stride_ym",
)
_BWD_POINTERS = ("g_ptr", "u_ptr", "gu_ptr", "db_ptr")
_DGELU_POINTERS = ("dy_ptr", "w_ptr", "u_ptr", "gu_ptr", "db_ptr")
_DGELU_INTS = ("M", "N", "K", "stride_dm", "stride_dk", "stride_wk", "stride_wn", "M_BUCKET")
_DGELU_UNIT = ("stride_dk", "stride_wn")
_DGELU_ALIGNED = ("dy_ptr", "w_ptr", "u_ptr", "gu_ptr", "db_ptr", "N", "K", "stride_dm",
                  "stride_wk")
_DTYPES = ("float32", "float16", "bfloat16")


def aot_variants(arch: int) -> list:
    """The kernel specializations of this module's GPU launches on sm_<arch>, for
    ``distllm.kernels.aot``: each forward tuning config the autotuner may pick there, for
    each dtype (fp32 with and without TF32), with every epilogue flag on; every
    combination of the epilogue flags (bias, pre-activation saved, erf or tanh) with one
    config, launched from contiguous tensors (unit strides, which Triton makes constants,
    and 16-divisible pointers, sizes and strides: a training launch's form); the generic
    form (any strides, nothing 16-divisible); and the backward pass for each dtype and
    flag, in both forms. A launch between the two forms (some arguments 16-divisible) is
    not compiled here; the token count never splits a kernel (do_not_specialize)."""
    from distllm.kernels.aot import SMEM_LIMIT, Variant

    mod, out = KERNELS, []

    def contiguous(ints, ce, unit, aligned):
        """(ints, constexprs) of a launch: from contiguous tensors when ``aligned`` (the
        unit strides constants), else any strides (all ints)."""
        if not aligned:
            return ints, ce
        return tuple(i for i in ints if i not in unit), (*ce, *((u, 1) for u in unit))

    def fwd(dt, tf32, cfg, flags, aligned):
        bias, save, tanh = flags
        ce = (
            ("HAS_BIAS", bias),
            ("SAVE_PRE", save),
            ("APPROX_TANH", tanh),
            ("ALLOW_TF32", tf32),
            ("DOT_FP32", False),
            *sorted(cfg.kwargs.items()),
        )
        ints, ce = contiguous(_FWD_INTS, ce, _FWD_UNIT, aligned)
        return Variant(
            mod,
            "_fwd_kernel",
            dt,
            _FWD_POINTERS,
            ints,
            ce,
            cfg.num_warps,
            cfg.num_stages,
            aligned=_FWD_ALIGNED if aligned else (),
        )

    def dgelu(dt, tf32, cfg, bias, tanh, aligned):
        ce = (
            ("HAS_BIAS", bias),
            ("APPROX_TANH", tanh),
            ("ALLOW_TF32", tf32),
            ("DOT_FP32", False),
            *sorted(cfg.kwargs.items()),
        )
        ints, ce = contiguous(_DGELU_INTS, ce, _DGELU_UNIT, aligned)
        return Variant(
            mod,
            "_dgelu_kernel",
            dt,
            _DGELU_POINTERS,
            ints,
            ce,
            cfg.num_warps,
            cfg.num_stages,
            fp32_pointers=("db_ptr",),
            aligned=_DGELU_ALIGNED if aligned else (),
        )

    all_on = (True, True, False)
    for dt in _DTYPES:
        configs = prune(fwd_configs(), ELEM_BYTES[dt], SMEM_LIMIT[arch])
        for tf32 in (False, True) if dt == "float32" else (False,):
            out += [fwd(dt, tf32, c, all_on, True) for c in configs]
            flags = [(b, s, t) for b in (0, 1) for s in (0, 1) for t in (0, 1)]
            out += [
                fwd(dt, tf32, configs[-1], tuple(map(bool, f)), True)
                for f in flags
                if tuple(map(bool, f)) != all_on
            ]
            out.append(fwd(dt, tf32, configs[-1], all_on, False))
        dconfigs = prune(dgelu_configs(), ELEM_BYTES[dt], SMEM_LIMIT[arch])
        for tf32 in (False, True) if dt == "float32" else (False,):
            for i, cfg in enumerate(dconfigs):  # every config with bias and erf; then the flags
                flags = [(True, False)] if i else [(b, t) for b in (0, 1) for t in (0, 1)]
                for bias, tanh in flags:
                    out.append(dgelu(dt, tf32, cfg, bool(bias), bool(tanh), True))
            out.append(dgelu(dt, tf32, dconfigs[-1], True, False, False))
        for bias, tanh, aligned in [(b, t, True) for b in (0, 1) for t in (0, 1)] + [
                (True, False, False)]:
            ce = (("HAS_BIAS", bool(bias)), ("APPROX_TANH", bool(tanh)),
                  *sorted(BWD_META.items()))
            out.append(
                Variant(
                    mod,
                    "_bwd_kernel",
                    dt,
                    _BWD_POINTERS,
                    ("M", "N"),
                    ce,
                    BWD_LAUNCH["num_warps"],
                    BWD_LAUNCH["num_stages"],
                    fp32_pointers=("db_ptr",),
                    aligned=(*_BWD_POINTERS, "N") if aligned else (),
                )
            )
    return out
