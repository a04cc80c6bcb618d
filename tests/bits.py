"""The tests' comparison of two nests of state, bit for bit."""

from __future__ import annotations

import torch


def assert_same_bits(got, want, path: str = "") -> None:
    """``got`` is ``want``, every tensor bit for bit (0-d ones too), every key and scalar equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, got.keys(), want.keys())
        for key in want:
            assert_same_bits(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_bits(g, w, f"{path}/{i}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, path
        bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(bits(got), bits(want)), path
    else:
        assert got == want, (path, got, want)
