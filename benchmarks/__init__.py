"""The research benchmarks: run from a clone, never installed (the wheel holds only ``kvstore``).

Each module is a command of its own, run from the repository root with the environment it needs::

    .venv/bin/python -m benchmarks.eviction [--store]        # eviction policies against LRU
    .venv/bin/python -m benchmarks.adaptive                  # auto mode against fixed configurations
    .venv/bin/python -m benchmarks.events                    # what KV events cost a put
    .venv/bin/python -m benchmarks.planner --rounds 3        # load or recompute (SmolLM2, Redis)
    .venv-vllm/bin/python -m benchmarks.serving --out serving.json   # vllm serve under vllm bench serve

``traces/`` holds the public trace the eviction benchmark replays. What docs/benchmarks.md shows
and how each figure was measured is there; the quick probe of a machine an operator runs is
``kvstore bench`` (:mod:`kvstore.bench`), which ships with the package.
"""
