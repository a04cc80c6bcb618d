"""A user's own Ray Train loop with rayzip (issue 17): examples/user_loop.py on 2 workers on a
local Ray, with ray.data input, compression on, and a killed worker resumed with its
compression state."""

from __future__ import annotations

import importlib.util
from pathlib import Path



EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user_loop.py"


def _example():
    spec = importlib.util.spec_from_file_location("user_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_user_loop_example_compresses_and_resumes_its_compression_state(local_ray, tmp_path):
    result = _example().main(["--workers", "2", "--epochs", "8", "--fail-at-epoch", "3",
                              "--storage-path", str(tmp_path)])
    m = result.metrics
    assert m["epoch"] == 7
    resumed = m["resumed"]
    assert resumed is not None and resumed["epoch"] < 3  # rank 0 was killed at epoch 3
    # The hook resumed at the checkpoint's step, with its error-feedback residual, and counted on.
    steps_per_epoch = resumed["hook_step"] // (resumed["epoch"] + 1)
    assert steps_per_epoch >= 20 and resumed["hook_step"] == steps_per_epoch * (resumed["epoch"] + 1)
    assert m["hook_step"] == steps_per_epoch * 8
    assert resumed["residual_norm"] > 0
    # SparseLoCo's wire every step, prepare_model's default under AdamW: 50x is issue 46's bar.
    assert m["dense_bytes"] / m["bytes_sent"] >= 50
    assert m["test_accuracy"] >= 0.9
