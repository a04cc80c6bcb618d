"""The engine's SegmentEncoder (one rank's codec and error feedback) and FlatLayout, alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzip.codecs import NonFiniteError, get_codec
from rayzip.engine import CompressionConfig, SegmentEncoder
from rayzip.engine.stats import FlatLayout

CONFIG = CompressionConfig(codec="group_topk", density=0.05)


def _grad(seed: int, n: int = 4096) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _residual(encoder: SegmentEncoder, names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(encoder.memory.residuals[n]) for n in names])


def test_the_residual_is_what_the_payload_left_out():
    encoder = SegmentEncoder(CONFIG)
    grad = _grad(0)
    decoded = torch.as_tensor(np.asarray(encoder.codec.decode_flat(encoder.encode("seg", grad))))
    np.testing.assert_allclose(_residual(encoder, ["seg"]), (grad - decoded).numpy(), rtol=0, atol=0)
    # The next payload carries the gradient plus that residual.
    again = encoder.encode("seg", grad)
    expected = get_codec("group_topk", density=0.05).encode(grad + (grad - decoded))
    np.testing.assert_array_equal(again.to_array(), expected.to_array())


def test_a_dense_step_sends_what_error_feedback_held_back():
    encoder = SegmentEncoder(CONFIG)
    grad = _grad(1)
    encoder.encode("seg", grad)
    held = torch.as_tensor(_residual(encoder, ["seg"]).copy())
    dense = encoder.encode("seg", grad, compressed=False)
    np.testing.assert_array_equal(np.asarray(encoder.dense_codec.decode_flat(dense)), (grad + held).numpy())
    assert not np.any(_residual(encoder, ["seg"]))


def test_a_nan_raises_and_leaves_the_memory_as_it_was():
    encoder = SegmentEncoder(CONFIG)
    encoder.encode("seg", _grad(2))
    before = _residual(encoder, ["seg"]).copy()
    bad = _grad(3)
    bad[100] = float("nan")
    with pytest.raises(NonFiniteError):
        encoder.encode("seg", bad)
    np.testing.assert_array_equal(_residual(encoder, ["seg"]), before)


def test_state_saved_under_one_segment_loads_under_two():
    from rayzip.codecs.memory import segment_name

    saved = SegmentEncoder(CONFIG)
    saved.encode(segment_name(0, 4096, 4096), _grad(4))
    loaded = SegmentEncoder(CONFIG)
    halves = [(2048, 4096), (0, 2048)]
    loaded.load_state_dict(saved.state_dict(), segments=halves, numel=4096)
    whole = _residual(saved, [segment_name(0, 4096, 4096)])
    for lo, hi in halves:
        np.testing.assert_array_equal(np.asarray(loaded.memory.residuals[segment_name(lo, hi, 4096)]), whole[lo:hi])


def test_residuals_follow_the_amp_loss_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # as a loop's first scaled loss: the scale exists from here
    encoder = SegmentEncoder(CONFIG, grad_scaler=scaler)
    encoder.follow_loss_scale()
    encoder.encode("seg", _grad(5) * 8.0)
    held = _residual(encoder, ["seg"]).copy()
    scaler.update(new_scale=2.0)
    encoder.follow_loss_scale()
    np.testing.assert_allclose(_residual(encoder, ["seg"]), held / 4.0, rtol=1e-6)
    assert encoder.state_dict()["loss_scale"] == 2.0


def test_a_density_change_keeps_the_residuals():
    encoder = SegmentEncoder(CONFIG)
    encoder.encode("seg", _grad(6))
    held = _residual(encoder, ["seg"]).copy()
    encoder.set_density(0.2)
    assert encoder.density == 0.2 and encoder.codec.name == "group_topk"
    np.testing.assert_array_equal(_residual(encoder, ["seg"]), held)


def test_the_flat_layout_names_parameter_and_element():
    layout = FlatLayout([3, 4], ["w", "b"])
    assert layout.numel == 7
    assert layout.where(0) == "w (parameter 0 of the model), element 0"
    assert layout.where(5) == "b (parameter 1 of the model), element 2"
    assert layout.where(7) == "flat element 7"
    assert FlatLayout([2]).where(1) == "parameter 0 (parameter 0 of the model), element 1"
