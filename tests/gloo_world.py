"""The tests' multi-rank helper: rayzip.bench.gloo.run_world, whose fork server also imports
what the tests' ranks import beyond the library: Ray Train (checkpoint restores), the
training loop and scikit-learn's datasets (the digits). Each is seconds of CPU per rank
otherwise, on every world a test starts."""

from rayzip.bench import gloo
from rayzip.bench.gloo import run_world

gloo.PRELOAD.extend(["ray.train", "rayzip.train.loop", "sklearn.datasets"])

__all__ = ["run_world"]
