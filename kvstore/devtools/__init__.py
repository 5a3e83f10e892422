"""For developers: benchmarks of the public API against raw baselines, the demo, and dev servers."""
