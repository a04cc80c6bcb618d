"""Adam correction: each worker's Adam moments on its own dense gradient, the direction
compressed with error feedback (issue 17: AdamW under sparsification)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzip.codecs import AdamCorrection, CodecError, get_codec
from rayzip.codecs.memory import reshard_state
from rayzip.spec import SpecError, parse_spec


def _grads(steps, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * (1 + 0.5 * t) for t in range(steps)]


def test_through_a_lossless_codec_it_is_adamw_exactly():
    n, lr, wd, betas = 500, 0.01, 0.1, (0.9, 0.95)
    reference = torch.nn.Parameter(torch.linspace(-1, 1, n))
    ours = torch.nn.Parameter(reference.detach().clone())
    adamw = torch.optim.AdamW([reference], lr=lr, betas=betas, weight_decay=wd, eps=1e-8)
    sgd = torch.optim.SGD([ours], lr=lr, momentum=0.0, weight_decay=wd)
    memory, codec = AdamCorrection(betas), get_codec("none")
    for g in _grads(30, n):
        reference.grad = g.clone()
        adamw.step()
        ours.grad = torch.as_tensor(np.asarray(codec.decode(memory.encode(codec, "model", g.numpy()))))
        sgd.step()
    torch.testing.assert_close(ours.detach(), reference.detach(), rtol=1e-5, atol=1e-6)


def test_every_direction_is_sent_once_now_or_later():
    memory, codec = AdamCorrection((0.9, 0.99)), get_codec("topk", density=0.05)
    sent = np.zeros(400, np.float32)
    directions = np.zeros(400, np.float32)
    reference = AdamCorrection((0.9, 0.99))
    lossless = get_codec("none")
    for g in _grads(25, 400, seed=1):
        sent += np.asarray(codec.decode(memory.encode(codec, "model", g.numpy())))
        directions += np.asarray(lossless.decode(reference.encode(lossless, "model", g.numpy())))
    np.testing.assert_allclose(sent + memory.residuals["model"], directions, rtol=1e-4, atol=1e-4)


def test_snapshot_restore_and_state_dict_round_trip():
    memory, codec = AdamCorrection((0.9, 0.95)), get_codec("topk", density=0.1)
    grads = _grads(6, 300, seed=2)
    for g in grads[:3]:
        memory.encode(codec, "model", g.numpy())
    snap = memory.snapshot()
    saved = memory.state_dict()
    first = np.asarray(codec.decode(memory.encode(codec, "model", grads[3].numpy())))
    memory.restore(snap)  # a dropped step leaves no trace
    again = np.asarray(codec.decode(memory.encode(codec, "model", grads[3].numpy())))
    np.testing.assert_array_equal(first, again)
    loaded = AdamCorrection((0.9, 0.95))
    loaded.load_state_dict(saved)
    assert loaded.steps == {"model": 3}
    np.testing.assert_array_equal(np.asarray(codec.decode(loaded.encode(codec, "model", grads[3].numpy()))), first)


def test_a_resize_gives_every_new_rank_the_mean_moments_and_keeps_pending_directions():
    codec = get_codec("topk", density=0.1)
    saved = {}
    for rank in range(2):
        memory = AdamCorrection((0.9, 0.95))
        for g in _grads(4, 200, seed=10 + rank):
            memory.encode(codec, "model", g.numpy())
        saved[rank] = memory.state_dict()
    merged = reshard_state(saved, 2, 1, 0)
    np.testing.assert_allclose(merged["adam_m:model"], (saved[0]["adam_m:model"] + saved[1]["adam_m:model"]) / 2)
    np.testing.assert_allclose(merged["model"], (saved[0]["model"] + saved[1]["model"]) / 2, rtol=1e-6)
    assert merged["adam_t:model"][0] == 4


def test_loss_scaling_is_refused_not_silently_wrong():
    with pytest.raises(CodecError, match="GradScaler"):
        AdamCorrection().rescale(0.5)


@pytest.mark.parametrize("patch, needle", [
    ({"training": {"optimizer": "sgd"}, "compression": {"codec": "topk", "adam_correction": True}}, "adamw"),
    ({"training": {"optimizer": "adamw"}, "compression": {"codec": "topk", "adam_correction": True,
                                                          "error_feedback": False}}, "error_feedback"),
])
def test_spec_refuses_adam_correction_without_its_parts(patch, needle):
    with pytest.raises(SpecError, match=needle):
        parse_spec({"name": "x", **patch})
