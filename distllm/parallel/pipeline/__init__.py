"""Pipeline parallelism: stages, schedules as data, a simulator and one executor.

- :func:`build_schedule` (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``) gives
  per-rank action lists (``F``/``B``/``W`` and ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``);
- :func:`simulate` replays one: step time, bubble per rank, peak activations, deadlocks;
- :class:`PipelineParallel` holds a rank's stages and runs any schedule
  (``train_step(batch, targets, loss_fn) -> loss``, ``eval_step``);
- :func:`split_layers` splits ``num_layers`` into stages (evenly or by counts).

Typical use on every rank (torchrun, or ``distllm.testing.run_distributed``)::

    dims = ParallelDims(tp=1, pp=4, dp=2)
    pipe = PipelineParallel(layers, dims, schedule="1f1b", micro_batches=8)
    ddp = DistributedDataParallel(pipe.chunks, dims=dims,
                                  finish_on_backward_end=not pipe.schedule.split_backward)
    pipe.grad_sync = ddp                       # no_sync() / finish_grad_sync()
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.train_step(tokens, targets, loss_fn)   # float, same on every stage
    opt.step(); ddp.zero_grad()

``layers`` is the whole model as a list ``[embedding, blocks..., head]`` (only this rank's
layers are kept) or ``layer_fn(i)`` with ``num_layers=``; layer modules may be tensor-parallel
(activations identical on the TP ranks of a stage; P2P pairs the same ``tp_rank``).
Micro-batch shapes are fixed for an executor's life (the activation shape travels once).
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
