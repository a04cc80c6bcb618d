"""The DDP comm hook on real torch DDP over gloo (issue 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs import get_codec
from rayzip.codecs.memory import ErrorFeedback
from rayzip.comm.control import control_nbytes
from rayzip.torch import CompressionConfig, compress, scaled_lr


def _model():
    torch.manual_seed(0)
    # ~2.3 MB of gradient: several DDP buckets at bucket_cap_mb=0.5 (the first is capped at 1 MB).
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _train_rank(rank, world, spec, steps, density_at=None, nan_at=None):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    plain = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    state = compress(ddp, CompressionConfig(**spec)) if spec else None
    alone = _model()  # this rank's own gradient, exchanged with nobody (no step changes the weights)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(steps):
        if density_at is not None and step == density_at:
            state.set_density(0.2)
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        if nan_at == step:
            x[0, 0] = float("nan")
        for model in (ddp, plain, alone):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        grads, plain_grads, local = (torch.cat([p.grad.flatten() for p in model.parameters()]).numpy().copy()
                                     for model in (ddp, plain, alone))
        stats = state.last_step.__dict__.copy() if state else None
        out.append((grads, plain_grads, stats, local))
    return out


def _checked_steps(results, world: int, steps: int, atol: float):
    """Each step's (step, rank 0's averaged gradient, every rank's stats), once the replicas
    are checked identical and equal to the reference without the hook: each rank's own
    gradient through a fresh group top-k (5%, fp32) and error feedback of its own, decoded,
    and averaged over the ranks."""
    codec = get_codec("group_topk", density=0.05, value_dtype="fp32")
    memories = [ErrorFeedback() for _ in range(world)]
    for step in range(steps):
        grads = [r[step][0] for r in results]
        for g in grads[1:]:
            assert np.array_equal(g, grads[0])  # replicas stay identical
        decoded = [codec.decode(memories[r].encode(codec, "grad", results[r][step][3])) for r in range(world)]
        np.testing.assert_allclose(grads[0], np.mean(decoded, axis=0), rtol=1e-5, atol=atol)
        yield step, grads[0], [r[step][2] for r in results]


def test_ring_hook_averages_the_decoded_payloads_and_counts_bytes():
    spec = {"codec": "group_topk", "density": 0.05, "value_dtype": "fp32", "verify": True}
    world = 3
    results = run_world(_train_rank, world, spec, 4)
    numel = sum(p.numel() for p in _model().parameters())
    for step, grad, ranks_stats in _checked_steps(results, world, 4, atol=1e-8):
        for stats in ranks_stats:
            assert stats["compressed"] and stats["step"] == step
            assert stats["verify_max_abs_err"] < 1e-6
            assert stats["numel"] == numel
            assert stats["bytes_sent"] == stats["verify_documented_bytes"] > 0
            # Several DDP buckets (bucket_cap_mb=0.5), gathered and sent as one gradient.
            assert stats["buckets"] == [numel]
            assert stats["dense_bytes"] == sum(2 * (world - 1) * 4 * n // world for n in stats["buckets"])
            assert stats["bytes_sent"] < stats["dense_bytes"] / 3
        assert not np.allclose(grad, results[0][step][1])  # compressed differs from plain DDP


def test_the_dense_collective_through_the_hook_is_the_mean_of_the_decoded_payloads():
    """collective: dense (sparse payloads scattered and all-reduced) with verify on: the mean
    of each rank's own error-fed payloads, and the vector's bytes on the wire."""
    spec = {"codec": "group_topk", "density": 0.05, "value_dtype": "fp32", "verify": True, "collective": "dense"}
    world = 3
    results = run_world(_train_rank, world, spec, 3)
    numel = sum(p.numel() for p in _model().parameters())
    for _, _, ranks_stats in _checked_steps(results, world, 3, atol=1e-7):
        for stats in ranks_stats:
            assert stats["verify_max_abs_err"] < 1e-6
            vector = 2 * (world - 1) * 4 * numel // world
            assert stats["bytes_sent"] == stats["verify_documented_bytes"] == vector + control_nbytes(world)


def test_fp16_ring_keeps_replicas_identical():
    results = run_world(_train_rank, 2, {"codec": "group_topk", "density": 0.02, "verify": True}, 3)
    for step in range(3):
        assert np.array_equal(results[0][step][0], results[1][step][0])
        assert results[0][step][2]["verify_max_abs_err"] < 1e-3


def test_none_codec_hook_matches_plain_ddp_and_sends_dense_bytes():
    results = run_world(_train_rank, 2, {"codec": "none"}, 2)
    for grads, plain, stats, _ in results[0]:
        np.testing.assert_allclose(grads, plain, rtol=1e-6, atol=1e-7)
        # The fp32 allreduce plus the control word's all-reduce (7 int64 fields, min and max).
        assert stats["control_bytes"] == control_nbytes(2) == 2 * 1 * (7 * 2 * 8) // 2
        assert stats["bytes_sent"] == stats["dense_bytes"] + stats["control_bytes"]


def test_warmup_steps_go_dense_then_compress_and_density_switches_at_a_step():
    spec = {"codec": "topk", "density": 0.05, "warmup_steps": 2}
    results = run_world(_train_rank, 2, spec, 5, 3)
    for rank_steps in results:
        stats = [s for _, _, s, _ in rank_steps]
        assert [s["compressed"] for s in stats] == [False, False, True, True, True]
        assert stats[0]["bytes_sent"] == stats[0]["dense_bytes"] + control_nbytes(2)
        assert stats[2]["bytes_sent"] < stats[2]["dense_bytes"] / 4
        assert [s["density"] for s in stats] == [None, None, 0.05, 0.2, 0.2]
        assert stats[3]["bytes_sent"] > stats[2]["bytes_sent"]


def test_nan_gradient_is_reported_with_rank_step_and_bucket():
    with pytest.raises(AssertionError, match=r"NonFiniteError: step 1: rank 0's gradient is not finite at "
                                             r"0.weight \(parameter 0 of the model\), element \d+"):
        run_world(_train_rank, 2, {"codec": "group_topk", "density": 0.05}, 2, None, 1)


def test_scaled_lr():
    assert scaled_lr(0.1, 4) == pytest.approx(0.4)
    assert scaled_lr(0.1, 4, base_world_size=2) == pytest.approx(0.2)
    assert scaled_lr(0.1, 4, step=0, warmup_steps=10) == pytest.approx(0.1)
    assert scaled_lr(0.1, 4, step=5, warmup_steps=10) == pytest.approx(0.25)
    assert scaled_lr(0.1, 4, step=10, warmup_steps=10) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        scaled_lr(0.1, 0)


def _sgd_rank(rank, world, momentum_correction, steps, momentum=0.9):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    if momentum_correction:
        compress(ddp, CompressionConfig(codec="none", momentum_correction=True), momentum=momentum)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.0 if momentum_correction else momentum)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in ddp.parameters()]).numpy()


def test_momentum_correction_through_a_lossless_codec_is_sgd_momentum():
    # Nothing waits in the residual, so per-worker momentum then averaging equals averaging
    # then the optimizer's momentum: only the order of float additions differs.
    (corrected, plain, without_momentum), (corrected_1, _, _) = run_world(_sgd_variants, 2, 6)
    np.testing.assert_array_equal(corrected, corrected_1)
    np.testing.assert_allclose(corrected, plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(corrected, without_momentum, atol=1e-4)  # momentum really acted


def _sgd_variants(rank, world, steps):
    """Momentum corrected in the hook, momentum in the optimizer, and none: one world."""
    return (_sgd_rank(rank, world, True, steps), _sgd_rank(rank, world, False, steps),
            _sgd_rank(rank, world, False, steps, 0.0))


def test_momentum_correction_needs_the_momentum_factor():
    with pytest.raises(AssertionError, match="needs the SGD momentum factor"):
        run_world(_needs_momentum, 2)


def _needs_momentum(rank, world):
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    compress(ddp, CompressionConfig(codec="group_topk", density=0.05, momentum_correction=True))


def _default_for_adamw_rank(rank, world, steps):
    """compress() told only of the user's AdamW, beside plain DDP on the same batches."""
    import warnings

    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    plain = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default draws no warning
        state = compress(ddp, optimizer=optimizer)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        norms = []
        for model in (ddp, plain):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            # What the user's habitual clipping sees: the norm of the averaged gradient.
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        grads = torch.cat([p.grad.flatten() for p in ddp.parameters()]).numpy().copy()
        out.append((state.codec.name, state.codec.bits, grads, norms, state.last_step.bytes_sent,
                    state.last_step.dense_bytes))
    return out


def test_told_of_adamw_the_hook_quantizes_every_entry_and_hands_back_a_gradient():
    """Issue 46: given the user's AdamW and no config, compress() picks 4-bit DCT, and what the
    code sees after backward() is the averaged gradient (decoded), so clipping's norm is
    plain DDP's to within the quantization noise, on every rank alike."""
    results = run_world(_default_for_adamw_rank, 2, 3)
    for step in range(3):
        (codec, bits, grads, norms, sent, dense), other = results[0][step], results[1][step]
        assert (codec, bits) == ("dct_quant", 4)
        assert np.array_equal(grads, other[2])  # replicas stay identical
        # 4-bit quantization noise adds its own energy to the norm (a few percent here); a
        # direction handed back instead of a gradient (adam_correction) is off by orders.
        assert norms[0] == pytest.approx(norms[1], rel=0.1) and norms[0] > 0
        assert dense / sent > 6  # 4 bits and a scale per 64 entries, against fp32


def _no_config_rank(rank, world):
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    try:
        compress(ddp)
    except ValueError as exc:
        return str(exc)
    return None


def test_compress_without_a_config_or_an_optimizer_says_what_it_needs():
    for message in run_world(_no_config_rank, 2):
        assert message is not None and "optimizer=" in message
