"""Peak host memory (ru_maxrss) of each rank of a ZeRO-3 engine on CPU: after the imports,
after the engine is built, and after one training step, for the revision on PYTHONPATH.
Usage: python build_peak.py MODEL DTYPE DP   (one line per rank)"""

import resource
import sys


def _rank(model: str, dtype: str, dp: int):
    import torch

    from distllm.models.config import GPTConfig
    from distllm.parallel.mesh import ParallelDims
    from distllm.train.config import ParallelConfig, TrainConfig
    from distllm.train.engine import Engine
    from distllm.train.host_memory import keep_freed_memory

    keep_freed_memory()  # as distllm train does on CPU
    torch.set_num_threads(1)
    cfg = TrainConfig(model=model, dtype=dtype, global_batch=dp, seq_len=64,
                      parallel=ParallelConfig(dp=dp, zero=3))
    mcfg = GPTConfig.preset(model)
    dims = ParallelDims(tp=1, pp=1, dp=dp)
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    before = rss()
    engine = Engine(cfg, mcfg, dims)
    built = rss()
    x = torch.randint(0, mcfg.vocab_size, (1, 64))
    loss = engine.forward_backward(x, x)
    engine.update(1.0, loss)
    return before, built, rss()


if __name__ == "__main__":
    from distllm.testing import run_distributed

    for r, (before, built, stepped) in enumerate(
            run_distributed(_rank, int(sys.argv[3]), sys.argv[1], sys.argv[2],
                            int(sys.argv[3]), timeout=1800)):
        print(f"rank {r}: imports {before:.0f} MiB, built {built:.0f} MiB, "
              f"stepped {stepped:.0f} MiB")
