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


PLAIN = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _plain(optimizer: str, params, training: TrainingSpec) -> torch.optim.Optimizer:
    """torch's own optimizer, as the spec names it, on its default (unfused) kernel."""
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=training.lr, momentum=training.momentum,
                               weight_decay=training.weight_decay, foreach=False)
    return PLAIN[optimizer](params, lr=training.lr, betas=tuple(training.betas), weight_decay=training.weight_decay,
                            foreach=False)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_the_spec_optimizer_runs_fused_on_cpu_and_steps_as_torchs_own(optimizer):
    training = TrainingSpec(optimizer=optimizer, momentum=0.9, lr=0.01, weight_decay=0.05)
    fused_model, plain_model = _gpt(), _gpt()
    built = build_optimizer(training, fused_model.parameters())
    assert type(built) is PLAIN[optimizer]
    assert built.defaults["fused"] is True and all(g["fused"] for g in built.param_groups)
    plain = _plain(optimizer, plain_model.parameters(), training)
    for _ in range(3):
        built.step()
        plain.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # one kernel, another's rounding
    assert any(not torch.equal(a, b) for a, b in zip(fused_model.parameters(), _gpt().parameters()))


def test_parameters_the_fused_kernel_cannot_take_get_torchs_default():
    training = TrainingSpec(optimizer="adamw")
    model, plain_model = _gpt(), _gpt()
    counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    built = build_optimizer(training, [*model.parameters(), counter])
    assert not built.defaults["fused"]
    plain = _plain("adamw", plain_model.parameters(), training)
    built.step()
    plain.step()
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)  # torch's default kernel: the same bits
    assert torch.equal(counter, torch.zeros(3, dtype=torch.int64))


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
