"""Training: config dataclasses, data, the engine (TP x PP x DP/ZeRO), loop and checkpoints.

- ``config``: typed dataclasses with a docstring per field, checks naming the knob;
- ``cli``: ``distllm train``, whose flags are generated from those fields, over :func:`train`;
- ``trainer``: the loop (learning-rate schedule, metrics, MFU, validation);
- ``engine``: one rank's GPT chunks, pipeline, DP wrapper or ZeRO optimizer, and AdamW;
- ``data``: the byte tokenizer, the corpus and the DP-split batch loader;
- ``checkpoint``, ``optim_state``: sharded checkpoints that load at any other layout;
- ``resume``: what a resume must agree on with its checkpoint (:func:`train` checks it);
- ``stop_signal``: a signal (a scheduler's preemption) stops the run with a checkpoint;
- ``export``: ``distllm export``, a checkpoint as a Hugging Face GPT-2 folder;
- ``tokenize_data``: ``distllm tokenize``, text as a tokenizer's ids for ``--data``;
- ``sample``: ``distllm sample``, text a checkpoint's model generates;
- ``new_folder``: the folder those two write, whole or not at all.
"""

from __future__ import annotations

from distllm.train.config import OptimConfig, ParallelConfig, TrainConfig
from distllm.train.engine import Engine
from distllm.train.trainer import train

__all__ = ["train", "TrainConfig", "ParallelConfig", "OptimConfig", "Engine"]
