"""Pipeline parallelism: stages, schedules as data, a simulator and one executor.

- :func:`build_schedule` (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``) gives
  per-rank action lists (``F``/``B``/``W`` and ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``);
- :func:`simulate` replays one: step time, bubble per rank, peak activations, deadlocks;
- :class:`PipelineParallel` holds a rank's stages and runs any schedule
  (``train_step(batch, targets, loss_fn) -> loss``, ``eval_step``);
- :func:`split_layers` splits ``num_layers`` into stages (evenly or by counts).
"""

from distllm.parallel.pipeline.executor import PipelineParallel, StepStats, split_micro_batches
from distllm.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    forward_only_schedule,
    validate,
)
from distllm.parallel.pipeline.simulate import SimResult, simulate
from distllm.parallel.pipeline.stage import rank_chunk_of, split_layers, stage_of

__all__ = [
    "SCHEDULES", "Action", "Schedule", "build_schedule", "forward_only_schedule", "validate",
    "simulate", "SimResult", "PipelineParallel", "StepStats", "split_micro_batches",
    "split_layers", "stage_of", "rank_chunk_of",
]
