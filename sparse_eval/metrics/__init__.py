"""Benchmark metrics, one module per benchmark (written from the benchmarks' definitions)."""
