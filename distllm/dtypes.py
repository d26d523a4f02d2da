"""Dtype names: the one table from a name (as flags and configs spell it) to a ``torch.dtype``.

``DTYPES`` maps each canonical name (``float32``, ``bfloat16``, ...) to its ``torch.dtype``;
``canonical_dtype`` also accepts the usual short spellings (``bf16``, ``fp32``, ``double``).
Which of these a given command supports is that command's own choice (training, for one,
runs float32, bfloat16 and float64).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "ALIASES", "autocast_cast", "canonical_dtype", "dtype_name", "to_torch_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}


def canonical_dtype(name: str) -> str:
    """The canonical name of ``name`` (``bf16`` -> ``bfloat16``); raises naming the choices."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is unknown: choose one of {', '.join(DTYPES)}")
    return key


def to_torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a dtype name or alias."""
    return DTYPES[canonical_dtype(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a ``torch.dtype`` of :data:`DTYPES` (``torch.bfloat16`` ->
    ``bfloat16``)."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} has no name in distllm.dtypes.DTYPES ({', '.join(DTYPES)})")


def autocast_cast(t, device_type: str, dtype: torch.dtype):
    """``t`` as autocast casts the operands of a lower-precision op (``F.linear``): a
    floating tensor on the autocast device ``device_type``, float64 excepted, goes to
    ``dtype``; anything else is returned as it is. The one home of this rule for the fused
    and parallel layers, whose GEMMs write into buffers autocast cannot cast."""
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type):
        return t.to(dtype)
    return t
