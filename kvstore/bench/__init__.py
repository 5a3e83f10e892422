"""What ``kvstore bench`` measures: a quick probe of one machine, each part returning rows the CLI prints.

- :mod:`~kvstore.bench.local`: DRAM and disk against memcpy and raw file I/O, and codecs on real KV
  (also the layouts, samples and row types the other parts share);
- :mod:`~kvstore.bench.remote`: Redis and S3 against their raw clients, on dev servers started by
  :mod:`~kvstore.bench.remote_servers`;
- :mod:`~kvstore.bench.prefetch`: layer streams against simulated compute (``--prefetch``);
- :mod:`~kvstore.bench.device` and :mod:`~kvstore.bench.ttft`: the paths into an engine's memory, and
  HFConnector's time to first token (``--device``, ``--gpu``);
- :mod:`~kvstore.bench.accuracy`: what each codec does to a real model's answers (``--accuracy``), on
  :mod:`~kvstore.bench.stdlib_prompts` with the model of :mod:`~kvstore.bench.models`.

Only what a ``kvstore bench`` option runs lives here (a test checks that :mod:`kvstore.cli.bench`
reaches every module). The research benchmarks, with their own entry points (eviction policies,
auto mode, KV events, the load planner, vLLM serving), live in ``benchmarks/`` of a clone and are
not in the wheel: see docs/benchmarks.md.
"""
