"""What every parallelism shares:

- :mod:`distllm.comm.collectives`: the collectives written once (the reduce-scatter, the
  all-gather and the all-reduce, with their point-to-point forms on gloo, and the broadcast
  from a rank named within its group);
- :mod:`distllm.comm.compat`: the one place where torch-version differences are handled;
- :mod:`distllm.comm.connections`: the ``CUDA_DEVICE_MAX_CONNECTIONS`` advice for overlap
  on Hopper and newer GPUs.

The tensor-parallel overlap engines live with tensor parallelism, in
:mod:`distllm.parallel.tensor`.
"""
