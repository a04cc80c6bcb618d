"""Benchmarks, run as ``rayzip bench ...``."""
