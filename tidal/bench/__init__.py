"""Benchmarks: seeded workloads, baselines and the offline throughput comparison."""
