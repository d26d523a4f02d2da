"""Training: config dataclasses, data, the engine (TP x PP x DP/ZeRO), loop and checkpoints.

- ``config``: typed dataclasses with a docstring per field, checks naming the knob;
- ``cli``: ``distllm train``, whose flags are generated from those fields, over :func:`train`;
- ``trainer``: the loop (learning-rate schedule, metrics, MFU, validation);
- ``engine``: one rank's GPT chunks, pipeline, DP wrapper or ZeRO optimizer, and AdamW;
- ``data``: the byte tokenizer, the corpus and the DP-split batch loader;
- ``checkpoint``, ``optim_state``: sharded checkpoints that load at any other layout.
"""

from __future__ import annotations

from distllm._lazy import lazy_exports

_LAZY = {
    "train": "distllm.train.trainer",
    "TrainConfig": "distllm.train.config",
    "ParallelConfig": "distllm.train.config",
    "OptimConfig": "distllm.train.config",
    "Engine": "distllm.train.engine",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY)
