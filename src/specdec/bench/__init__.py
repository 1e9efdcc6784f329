"""Benchmark harness: ``specdec bench`` (workloads, timed runs in separate processes, reports)."""
