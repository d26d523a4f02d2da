"""Most bytes alive at once while one rank builds its ZeRO-3 engine, counted on fake tensors
(the dry run's counter, distllm.plan.dry_run: every storage, each once, no allocator), and
the bytes it holds once built, for the revision on PYTHONPATH; the CUDA code paths.
Usage: python build_bytes.py MODEL DTYPE DP"""

import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from distllm.models.config import GPTConfig
from distllm.parallel.mesh import ParallelDims
from distllm.plan import dry_run as dr
from distllm.train.config import ParallelConfig, TrainConfig
from distllm.train.engine import DTYPE, Engine

model, dtype, dp = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = TrainConfig(model=model, dtype=dtype, global_batch=dp, seq_len=1024,
                  parallel=ParallelConfig(dp=dp, zero=3))
mcfg = GPTConfig.preset(model)
header = (torch.Size([1, 1024, mcfg.hidden_size]), DTYPE[dtype])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
counter = dr._Counter()
with dr._patched(header, counter, "cuda"), FakeTensorMode(allow_non_fake_inputs=True), counter:
    engine = Engine(cfg, mcfg, ParallelDims(tp=1, pp=1, dp=dp))
    built_peak, held = counter.peak, counter.live
    weights = mcfg.num_params() * DTYPE[dtype].itemsize
    del engine
dist.destroy_process_group()
gib = 2 ** 30
print(f"{model} {dtype} dp{dp}: build peak {built_peak / gib:.2f} GiB, held after "
      f"{held / gib:.2f} GiB (the model's {dtype} weights: {weights / gib:.2f} GiB)")
