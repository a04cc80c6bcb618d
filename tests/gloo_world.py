"""The tests' multi-rank helper: rayzip.bench.gloo.run_world."""

from rayzip.bench.gloo import run_world

__all__ = ["run_world"]
