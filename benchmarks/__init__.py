"""Benchmarks: `python -m benchmarks.bench` (the side-by-side benchmark of issue 4, writes
RESULTS.md and speedup.png) and `python -m benchmarks.pair` (the pair's α, cost ratio and
in-process speeds, issue 2)."""
