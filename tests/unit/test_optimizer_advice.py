"""A sparse codec every step under Adam or AdamW warns once, naming what holds quality there
(issue 46): the user's optimizer is given to rayzip.torch.compress / prepare_model, or named."""

from __future__ import annotations

import warnings

import pytest
import torch

from rayzip.engine import CompressionConfig
from rayzip.torch.optim import default_compression, warn_for_optimizer


def _entry_point(config, optimizer):
    """As rayzip.torch.compress and rayzip.train.prepare_model call it."""
    return warn_for_optimizer(config, optimizer)


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("optimizer", [lambda: torch.optim.AdamW(_params()), lambda: torch.optim.Adam(_params()),
                                       lambda: "adamw", lambda: "Adam"])
@pytest.mark.parametrize("codec", ["group_topk", "topk", "randomk"])
def test_a_sparse_codec_under_adam_warns_naming_what_holds_quality(optimizer, codec):
    with pytest.warns(UserWarning, match="codec='dct_quant'.*local steps") as caught:
        message = _entry_point(CompressionConfig(codec=codec), optimizer())
    assert codec in message and len(caught) == 1
    assert caught[0].filename == __file__  # pointed at the entry point's caller, not at rayzip


@pytest.mark.parametrize("optimizer,codec", [(lambda: torch.optim.SGD(_params(), lr=0.1), "group_topk"),
                                             (lambda: "sgd", "topk"), (lambda: None, "group_topk"),
                                             (lambda: "adamw", "dct_quant"), (lambda: "adamw", "none"),
                                             (lambda: torch.optim.AdamW(_params()), "bf16")])
def test_no_warning_where_quality_holds_or_the_optimizer_is_unknown(optimizer, codec):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_for_optimizer(CompressionConfig(codec=codec), optimizer()) is None


def test_under_adam_correction_the_warning_says_what_clipping_then_sees():
    config = CompressionConfig(codec="group_topk", adam_correction=True)
    with pytest.warns(UserWarning, match="clip_grad_norm_ there scales every update down"):
        warn_for_optimizer(config, "adamw")


class _Custom(torch.optim.Optimizer):
    """An optimizer rayzip does not know."""

    def __init__(self, params):
        super().__init__(params, {})


@pytest.mark.parametrize("optimizer", [lambda: torch.optim.AdamW(_params()), lambda: torch.optim.Adam(_params()),
                                       lambda: torch.optim.RMSprop(_params()), lambda: torch.optim.Adagrad(_params()),
                                       lambda: "adamw", lambda: "Adam", lambda: "nadam"])
def test_the_default_under_an_adaptive_optimizer_quantizes_every_entry_every_step(optimizer):
    config = default_compression(optimizer())
    assert (config.codec, config.bits) == ("dct_quant", 4)
    assert not config.adam_correction  # the user's code sees a gradient after backward()
    sharded = default_compression(optimizer(), sharded=True)  # 4 bits cost the GPT's loss on shards
    assert (sharded.codec, sharded.bits, sharded.adam_correction) == ("dct_quant", 8, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_for_optimizer(config, optimizer()) is None  # the default draws no warning of its own


@pytest.mark.parametrize("optimizer", [lambda: torch.optim.SGD(_params(), lr=0.1), lambda: "sgd",
                                       lambda: _Custom(_params()), lambda: "lion"])
def test_the_default_under_sgd_or_an_unknown_optimizer_is_group_topk(optimizer):
    for config in (default_compression(optimizer()), default_compression(optimizer(), sharded=True)):
        assert (config.codec, config.density) == ("group_topk", 0.01)


def test_the_default_needs_the_optimizer():
    with pytest.raises(ValueError, match="needs the optimizer"):
        default_compression(None)


def test_prepare_models_default_under_adamw_is_sparseloco_every_step_keeping_the_residual():
    from rayzip.train.api import _per_step_default

    for optimizer in ("adamw", torch.optim.AdamW(_params()), "adam", "muon"):
        config = _per_step_default(optimizer)
        assert config.every == 1 and config.keep_unsent
    # Where local steps cannot run, or the optimizer is not adaptive: the per-step codec.
    assert _per_step_default("sgd") is None and _per_step_default(None) is None
    assert _per_step_default("adamw", grad_scaler=torch.amp.GradScaler("cpu")) is None
    assert _per_step_default("adamw", sharding=object()) is None
