"""Muon on the hidden matrices, AdamW on the rest, as one optimizer (issue 46): which
parameters each part steps, and a state that saves, loads and steps on as one."""

from __future__ import annotations

import copy

import pytest
import torch

from rayzip.spec import TrainingSpec
from rayzip.torch.muon import MuonWithAdamW, muon_parameters
from rayzip.torch.optim import adaptive, build_optimizer, default_compression, load_optimizer
from rayzip.train.gpt import GPT, lm_loss


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=256, layers=2, width=64, heads=2, context=16)


def _step(model: GPT, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
    optimizer.zero_grad()
    lm_loss(model(x), y).backward()
    optimizer.step()


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_tied_head_norms_and_biases():
    model = _gpt()
    matrices, rest = muon_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in matrices} == {f"blocks.{i}.{w}" for i in range(2) for w in (
        "attn.qkv.weight", "attn.out.weight", "mlp.0.weight", "mlp.2.weight")}
    # The head shares the token embedding's weight: it is stepped once, by AdamW.
    assert model.head.weight is model.tokens.weight and any(p is model.tokens.weight for p in rest)
    assert len(matrices) + len(rest) == len(list(model.parameters()))
    optimizer = MuonWithAdamW(model)
    assert [type(part) for part in optimizer._parts] == [torch.optim.Muon, torch.optim.AdamW]


def test_the_muon_part_steps_as_torchs_muon_and_the_rest_as_torchs_adamw():
    ours, theirs = _gpt(), _gpt()
    optimizer = MuonWithAdamW(ours, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    matrices, rest = muon_parameters(theirs)
    muon = torch.optim.Muon(matrices, lr=2e-3, weight_decay=0.1, momentum=0.9, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)

    class Both:
        def zero_grad(self):
            muon.zero_grad(), adamw.zero_grad()

        def step(self):
            muon.step(), adamw.step()

    for seed in range(3):
        _step(ours, optimizer, seed)
        _step(theirs, Both(), seed)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), _gpt().parameters()))


def test_one_learning_rate_schedule_reaches_both_parts():
    optimizer = MuonWithAdamW(_gpt(), lr=1e-3)
    for group in optimizer.param_groups:
        group["lr"] = 5e-4
    assert all(g["lr"] == 5e-4 for part in optimizer._parts for g in part.param_groups)


def test_a_saved_state_loads_and_steps_on_bit_for_bit():
    model = _gpt()
    optimizer = MuonWithAdamW(model)
    for seed in range(3):
        _step(model, optimizer, seed)
    saved = copy.deepcopy(optimizer.state_dict())
    # Muon's momentum buffers and AdamW's moments, under one optimizer's state.
    assert len(saved["state"]) == len(list(model.parameters()))
    resumed = copy.deepcopy(model)
    again = MuonWithAdamW(resumed)
    load_optimizer(again, saved)  # the path checkpoints and snapshots take
    for seed in (3, 4):
        _step(model, optimizer, seed)
        _step(resumed, again, seed)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_the_spec_builds_it_from_the_model_with_adamws_settings():
    training = TrainingSpec(optimizer="muon", lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = build_optimizer(training, _gpt())
    assert isinstance(optimizer, MuonWithAdamW)
    muon, adamw = optimizer._parts
    assert muon.param_groups[0]["momentum"] == 0.9 and muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert adamw.param_groups[0]["betas"] == (0.9, 0.95) and adamw.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(TypeError, match="muon needs the model, not its parameters"):
        build_optimizer(training, _gpt().parameters())
    for elsewhere in ({"momentum_elsewhere": True}, {"adam_elsewhere": True}):
        with pytest.raises(ValueError, match="muon has none there"):
            build_optimizer(training, _gpt(), **elsewhere)


def test_muon_gets_the_compression_that_holds_an_adaptive_optimizers_quality():
    assert adaptive("muon") and adaptive(MuonWithAdamW(_gpt()))
    assert default_compression("muon").codec == "dct_quant"
