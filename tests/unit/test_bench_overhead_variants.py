"""Which models ``rayzip bench overhead`` builds for the variants asked: each once, with the
DDP baselines they are divided by."""

import pytest

from rayzip.bench.overhead import VARIANTS, with_baselines


def test_variants_sharing_a_baseline_bring_it_once():
    assert with_baselines(["ddp_hook", "off", "off"]) == ["ddp_hook", "off", "ddp_sgd"]
    assert with_baselines(["off_adam", "off_momentum"]) == ["off_adam", "off_momentum", "ddp_adamw", "ddp_sgd"]
    assert with_baselines(["ddp_sgd", "off"]) == ["ddp_sgd", "off"]
    assert with_baselines(list(VARIANTS)) == list(VARIANTS)


def test_an_unknown_variant_is_named():
    with pytest.raises(ValueError, match="warp"):
        with_baselines(["off", "warp"])


def test_the_second_plain_ddp_brings_the_first_to_be_divided_by():
    assert with_baselines(["ddp_again"]) == ["ddp_again", "ddp_sgd"]
