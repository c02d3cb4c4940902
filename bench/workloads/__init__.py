"""Benchmark workloads: data readers, models and recipes, the measured training loop, reporting."""
