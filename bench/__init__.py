"""Benchmarks (not tests): figures go to docs/performance.md."""
