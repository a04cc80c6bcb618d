"""The language-model workload's pure parts: the stdlib text split, windows, the sharded
resumable sampler, the GPT, the cosine schedule (issue 17)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayzip.torch.lr import cosine_lr, learning_rate
from rayzip.spec import SpecError, TrainingSpec, parse_spec
from rayzip.train.gpt import GPT, lm_loss
from rayzip.train.text import ShardSampler, Windows, is_validation, load_python_stdlib, stdlib_files


def _take(sampler, steps):
    it = iter(sampler)
    return [[next(it) for _ in range(sampler.batch)] for _ in range(steps)]


def test_the_split_is_by_file_and_fixed_by_the_path_alone(tmp_path):
    for name in ("a.py", "b.py", "pkg/c.py", "pkg/test/skip.py", "site-packages/x.py", "d.txt"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode() * 50)
    assert [rel for rel, _ in stdlib_files(tmp_path)] == ["a.py", "b.py", "pkg/c.py"]
    fraction = 0.5
    held = [rel for rel in ("a.py", "b.py", "pkg/c.py") if is_validation(rel, fraction)]
    assert 0 < len(held) < 3, held  # CRC32 of these names puts files on both sides
    text = load_python_stdlib(fraction, root=tmp_path)
    assert text.validation_files == len(held) and text.train_files == 3 - len(held)
    validation = bytes(text.validation)
    for rel in ("a.py", "b.py", "pkg/c.py"):  # a file lies whole in its split, in the other not at all
        content = rel.encode() * 50
        assert (content in validation) == (rel in held)
        assert (content in bytes(text.train)) == (rel not in held)


def test_the_real_stdlib_loads_with_both_splits():
    text = load_python_stdlib(0.05)
    assert text.train_files > 300 and text.validation_files > 5
    assert len(text.train) > 5_000_000 and text.train.dtype == np.uint8
    assert b"def " in bytes(text.validation[:100_000])


def test_windows_are_next_byte_pairs_without_overlap():
    tokens = np.arange(250, dtype=np.uint8)
    w = Windows(tokens, context=16)
    assert len(w) == (250 - 1) // 16
    x, y = w[3]
    assert x.tolist() == list(range(48, 64)) and y.tolist() == list(range(49, 65))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_share_each_epoch_without_replacement(world):
    n, batch = 120, 4
    per_rank = [_take(ShardSampler(n, batch, r, world, seed=3), n // (batch * world)) for r in range(world)]
    seen = [i for steps in per_rank for b in steps for i in b]
    assert len(seen) == len(set(seen)) == (n // (batch * world)) * batch * world  # one epoch, no repeats
    for step in range(len(per_rank[0])):  # the ranks' batches at a step are disjoint
        assert not set(per_rank[0][step]) & set(per_rank[-1][step]) or world == 1


@pytest.mark.parametrize("old, new", [(2, 2), (2, 3), (3, 1)])
def test_a_resumed_group_of_any_size_continues_the_same_stream(old, new):
    n, batch, seed = 97, 3, 5  # epochs do not divide evenly into global batches
    done = 7
    before = [_take(ShardSampler(n, batch, r, old, seed), done) for r in range(old)]
    consumed = ShardSampler(n, batch, 0, old, seed).consumed_after(done)
    after = [_take(ShardSampler(n, batch, r, new, seed, start=consumed), 40) for r in range(new)]
    stream = [i for s in range(done) for k in range(batch) for r in range(old) for i in [before[r][s][k]]]
    stream_after = [i for s in range(40) for k in range(batch) for r in range(new) for i in [after[r][s][k]]]
    # The same stream of indices as one sampler that never stopped, read by one rank.
    whole = _take(ShardSampler(n, 1, 0, 1, seed), len(stream) + len(stream_after))
    assert sorted(stream) == sorted(i for b in whole[:len(stream)] for i in b)
    assert sorted(stream_after) == sorted(i for b in whole[len(stream):] for i in b)
    # No window repeats inside an epoch, across the resize.
    first_epoch = [i for b in whole[:n] for i in b]
    assert sorted(first_epoch) == list(range(n))


def test_gpt_is_causal_and_sized_as_documented():
    torch.manual_seed(0)
    model = GPT(layers=4, width=384, heads=6, context=128)
    params = sum(p.numel() for p in model.parameters())
    assert 5_000_000 <= params <= 20_000_000 and abs(params - 12 * 4 * 384 ** 2) / params < 0.05
    small = GPT(layers=2, width=32, heads=4, context=16).eval()
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = small(x), small(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # the future does not reach the past
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    with torch.no_grad():
        loss = lm_loss(small(x), x)
    assert abs(float(loss) - math.log(256)) < 0.5  # near uniform at initialisation
    with pytest.raises(ValueError, match="longer than the context"):
        small(torch.zeros(1, 17, dtype=torch.long))


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    lrs = [cosine_lr(1.0, s, 100, warmup_steps=10, min_ratio=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    training = TrainingSpec(lr=0.01, lr_schedule="cosine", lr_warmup_steps=0, base_world_size=1, steps=10)
    assert learning_rate(training, 2, 0, 10) == pytest.approx(0.02)  # linearly scaled peak


@pytest.mark.parametrize("patch, field", [
    ({"model": {"name": "gpt"}}, "(top level)"),  # gpt on digits under loop classification
    ({"model": {"name": "mlp", "layers": 2}}, "model"),
    ({"training": {"loop": "language_model"}}, "(top level)"),  # text loop on digits
    ({"training": {"target_val_loss": 2.0}}, "training"),
    ({"training": {"loop": "not a path"}}, "training.loop"),
    ({"training": {"betas": [0.9, 1.5]}}, "training.betas"),
    ({"training": {"mixed_precision": "fp16"}}, "training.mixed_precision"),
    ({"training": {"loop": "os:getcwd", "mixed_precision": "bf16"}}, "training"),
    ({"model": {"name": "gpt", "width": 100, "heads": 3}, "dataset": {"name": "python-stdlib"},
      "training": {"loop": "language_model"}}, "model"),
])
def test_language_model_spec_errors_name_the_field(patch, field):
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", **patch})
    assert any(p.startswith(f"{field}:") for p in err.value.problems), err.value.problems


def test_the_bench_gpt_job_validates_and_survives_a_dump():
    from rayzip.spec import load_spec

    spec = load_spec("jobs/bench-gpt.yaml")
    assert (spec.model.name, spec.dataset.name, spec.training.loop) == ("gpt", "python-stdlib", "language_model")
    assert parse_spec(spec.model_dump()) == spec


def test_bf16_mixed_precision_autocasts_the_forward_and_keeps_float32_gradients():
    from rayzip.spec import load_spec
    from rayzip.train.tasks import Task

    class Next(Task):
        def loss(self, model, batch):
            x, y = batch
            return lm_loss(model(x), y)

    spec = load_spec("jobs/bench-gpt.yaml")
    bf16 = spec.model_copy(update={"training": spec.training.model_copy(update={"mixed_precision": "bf16"})})
    torch.manual_seed(0)
    model = GPT(layers=1, width=64, heads=2, context=16)
    tokens = torch.randint(0, 256, (4, 17))
    batch = tokens[:, :-1], tokens[:, 1:]
    seen: list[torch.dtype] = []
    model.head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    losses, grads = [], []
    for job in (spec, bf16):
        model.zero_grad()
        loss = Next(job, 0, 1, "cpu").training_loss(model, batch)
        loss.backward()
        losses.append(float(loss))
        grads.append(model.head.weight.grad.clone())
    assert seen == [torch.float32, torch.bfloat16]
    assert all(g.dtype == torch.float32 for g in grads)
    assert losses[0] != losses[1] and losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0) > 0.99
