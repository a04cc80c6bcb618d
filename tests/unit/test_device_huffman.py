"""The GPU's Huffman coder (rayzip/checkpoint/device_huffman.py) writes the C coder's bytes.

Its torch operations run on CPU tensors too, so these tests compare the two coders here;
tests/integration/test_gpu.py compares them on a GPU. Skipped without the C kernels, which
the code table comes from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzip.checkpoint import codecs
from rayzip.checkpoint.transforms import kernels

pytestmark = pytest.mark.skipif(kernels is None, reason="needs rayzip's C kernels (pip install builds them)")


def _exponent_like(n: int, seed: int) -> np.ndarray:
    """Skewed bytes with runs (an exponent plane's shape) and a sprinkle of any value."""
    rng = np.random.default_rng(seed)
    x = np.clip(np.round(np.cumsum(rng.normal(0, 0.3, n)) % 9 + 118 + rng.normal(0, 1.5, n)), 0, 255)
    x = x.astype(np.uint8)
    x[rng.integers(0, n, n // 97)] = rng.integers(0, 256, n // 97)
    return x


# Lengths around the C coder's segment and group boundaries: a stream under 64 segments'
# worth, one that is not a multiple of its segment count, and several 1 MB groups.
SIZES = [64, 65, 999, 4099, (1 << 20) + 3, 3 * (1 << 20) + 7, 5 * (1 << 20) + 1]


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("n", SIZES)
def test_the_device_coder_writes_the_c_coders_bytes(n, order):
    from rayzip.checkpoint.device_huffman import encode

    x = _exponent_like(n, seed=n + order)
    coded = encode(torch.from_numpy(x), order)
    assert coded.tobytes() == kernels.huffman_encode(x, order)
    back = np.empty(n, dtype=np.uint8)
    kernels.huffman_decode(coded.tobytes(), back)
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("x", [np.zeros(5000, np.uint8), np.full(3 << 20, 7, np.uint8),
                               np.arange(300_000).astype(np.uint8)], ids=["zeros", "one-value", "uniform"])
def test_one_symbol_and_every_symbol_code_alike(x):
    from rayzip.checkpoint.device_huffman import encode

    for order in (0, 1):
        assert encode(torch.from_numpy(x), order).tobytes() == kernels.huffman_encode(x, order)


def test_chunks_that_cut_a_segment_and_a_code_word_change_nothing(monkeypatch):
    from rayzip.checkpoint import device_huffman

    x = _exponent_like(3 * (1 << 20) + 7, seed=7)
    monkeypatch.setattr(device_huffman, "CHUNK", 100_003)  # a prime: chunks end mid-segment, mid-word
    for order in (0, 1):
        assert device_huffman.encode(torch.from_numpy(x), order).tobytes() == kernels.huffman_encode(x, order)


def test_a_bad_order_is_refused():
    from rayzip.checkpoint.device_huffman import encode

    with pytest.raises(ValueError, match="order must be 0 or 1"):
        encode(torch.zeros(100, dtype=torch.uint8), 2)


@pytest.mark.parametrize("kind", ["exponents", "mantissa", "runs", "small"])
def test_a_plan_from_the_sample_alone_is_the_streams_plan(kind):
    """A stream on the GPU is planned from its sample on the host: the same decision."""
    rng = np.random.default_rng(3)
    x = {"exponents": _exponent_like(1 << 20, 1), "mantissa": rng.integers(0, 256, 1 << 20).astype(np.uint8),
         "runs": np.repeat(rng.integers(0, 3, 1 << 12), 256).astype(np.uint8),
         "small": _exponent_like(3000, 2)}[kind]
    assert codecs._plan(codecs._sample(x, codecs.PLAN_SAMPLE), x.size) == codecs._plan(x)


def test_pack_stream_codes_on_the_device_only_when_asked(monkeypatch):
    """``gpu_coding`` routes a Huffman-planned stream on the GPU to the device coder (a CPU
    tensor stands in for the GPU's here); without it the stream is coded on the host. The
    bytes are the same either way."""
    from rayzip import cuda
    from rayzip.checkpoint import device_huffman

    x = torch.from_numpy(_exponent_like(1 << 20, seed=5))
    calls = []
    encode = device_huffman.encode
    monkeypatch.setattr(device_huffman, "encode", lambda data, order: calls.append(order) or encode(data, order))
    monkeypatch.setattr(cuda, "enabled", lambda arr: isinstance(arr, torch.Tensor))
    plan = codecs.stream_plan(x.numpy())
    assert plan[0] == "huffman"
    host, coding = codecs.pack_stream(x, plan=plan)
    assert coding == "huffman" and not calls
    device, coding = codecs.pack_stream(x, plan=plan, gpu_coding=True)
    assert coding == "huffman" and calls == [plan[1]]
    assert bytes(np.asarray(device)) == bytes(np.asarray(host))
