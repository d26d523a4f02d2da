"""The microbenchmark suite, apart from the library: installed as ``distllm.bench``, run
with ``distllm bench``; the library (``distllm.*``) never imports it.

- :mod:`~distllm.bench.cli`: ``distllm bench`` (options, output folder, report, plots,
  ``--compare``, ``--doctor`` through :mod:`distllm.diagnostics`);
- :mod:`~distllm.bench.suite`: the registry of suites and the loop over their cases;
- :mod:`~distllm.bench.harness`: the one runner (the suite contract, ranks, networks,
  interleaved timing from :mod:`distllm.diagnostics.timing`);
- :mod:`~distllm.bench.rows`: result rows, JSON/CSV, markdown tables;
- :mod:`~distllm.bench.verdicts`: each variant's role, the speed-up bands, the flags of
  impossible figures, one verdict per case;
- :mod:`~distllm.bench.report`, :mod:`~distllm.bench.plots`, :mod:`~distllm.bench.compare`:
  ``REPORT.md``, the PNG plots, ``COMPARE.md``;
- suites, each ``cases`` / ``setup`` / ``rows`` over the runner: ``linear_gelu``,
  ``row_parallel_overlap`` (``row_overlap``), ``sp_overlap``, ``ddp_overlap`` (``ddp``,
  ``zero``), ``pipeline``, ``train_e2e``, ``plan_validation``;
- ``gpu_bench`` and ``gpu_check.sh``: the check of one CUDA GPU
  (``bash bench/gpu_check.sh OUT_DIR``).
"""
