"""The microbenchmark suite. Installed as ``distllm.bench``; run with ``distllm bench``."""
