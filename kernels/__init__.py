"""Triton kernels (pure compute, no torch.distributed). Installed as ``distllm.kernels``."""
