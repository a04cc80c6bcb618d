"""The spec's optimizer: fused kernels where torch has them, and checkpoints that do not undo that."""

import pytest
import torch

from rayzip.spec import TrainingSpec
from rayzip.torch.optim import build_optimizer, load_optimizer
from rayzip.train.gpt import GPT


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(vocab=256, layers=1, width=64, heads=2, context=16)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_the_spec_optimizer_runs_fused_on_cpu(optimizer):
    built = build_optimizer(TrainingSpec(optimizer=optimizer, momentum=0.9, lr=0.01), _gpt().parameters())
    assert built.defaults["fused"] is True and all(g["fused"] for g in built.param_groups)
    built.step()


def test_parameters_the_fused_kernel_cannot_take_get_torchs_default():
    model = _gpt()
    counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    built = build_optimizer(TrainingSpec(optimizer="adamw"), [*model.parameters(), counter])
    assert not built.defaults["fused"]
    built.step()


def test_a_checkpoint_saved_without_the_fused_kernel_loads_fused_and_continues_the_same_state():
    training = TrainingSpec(optimizer="adamw", lr=1e-3, weight_decay=0.1)
    old_model, new_model = _gpt(), _gpt()
    old = torch.optim.AdamW(old_model.parameters(), lr=1e-3, weight_decay=0.1)  # torch's default kernel
    for _ in range(3):
        old.step()
    new_model.load_state_dict(old_model.state_dict())
    for p in new_model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    new = build_optimizer(training, new_model.parameters())
    load_optimizer(new, old.state_dict())
    assert new.param_groups[0]["fused"] is True
    for a, b in zip(old.state.values(), new.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert float(a["step"]) == float(b["step"]) == 3
    before = [p.detach().clone() for p in new_model.parameters()]
    new.step()
    assert all(not torch.equal(p, q) for p, q in zip(new_model.parameters(), before))
