"""Adaptive sizing: miss-ratio curves from sampled reuse times, the cost model, advice, auto mode, traces."""
