"""The fused C encoders (rayzip/codecs/_kernels.c) against the torch/numpy path that the GPU
and builds without a compiler use (issue 18)."""

from __future__ import annotations

import numpy as np
import pytest

from rayzip.codecs import get_codec, kernels
from rayzip.codecs.bitpack import unpack_bits

pytestmark = pytest.mark.skipif(kernels.fused is None, reason="rayzip.codecs._kernels is not built (no C compiler "
                                                             "when rayzip was installed)")


def _both(codec_name: str, x, monkeypatch, **params):
    fused = get_codec(codec_name, **params).encode(x)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "fused", None)
        assert not kernels.fused_for(x)
        fallback = get_codec(codec_name, **params).encode(x)
    return fused, fallback


def test_group_topk_selects_what_torch_topk_selects(monkeypatch):
    x = np.random.default_rng(0).standard_normal(1024 * 300 + 77, dtype=np.float32)
    fused, fallback = _both("group_topk", x, monkeypatch, ratio=0.01, value_dtype="fp32")
    for name in ("indices", "values"):
        assert np.array_equal(fused.arrays[name], fallback.arrays[name])


def test_group_topk_keeps_the_lowest_indices_among_ties():
    rows = np.zeros((3, 16), dtype=np.float32)
    rows[0, [2, 5, 9, 12]] = [1.0, -1.0, 1.0, 1.0]  # four tied for three places
    rows[1] = np.arange(16, dtype=np.float32)[::-1]  # a descending row: every entry displaces one
    rows[2] = -np.arange(16, dtype=np.float32)  # ascending magnitudes
    columns, values = kernels.top_magnitude_rows(rows, 3)
    assert columns.tolist() == [[2, 5, 9], [0, 1, 2], [13, 14, 15]]
    assert values.tolist() == [[1.0, -1.0, 1.0], [15.0, 14.0, 13.0], [-13.0, -14.0, -15.0]]


@pytest.mark.parametrize("levels, bucket", [(127, 512), (7, 512), (1000, 512), (127, 333)])
def test_qsgd_codes_match_the_array_path(monkeypatch, levels, bucket):
    x = np.random.default_rng(1).standard_normal(512 * 200 + 33, dtype=np.float32)
    fused, fallback = _both("qsgd", x, monkeypatch, levels=levels, bucket_size=bucket)
    np.testing.assert_allclose(fused.arrays["norms"], fallback.arrays["norms"], rtol=1e-5)
    codec = get_codec("qsgd", levels=levels, bucket_size=bucket)
    codes = [unpack_bits(p.arrays["codes"], codec.bits, x.size, np).astype(np.int64) for p in (fused, fallback)]
    # The same noise; a norm that differs in its last bit moves an element across a level
    # boundary now and then, by one level.
    differ = codes[0] != codes[1]
    assert differ.mean() < 1e-3
    assert np.all(np.abs(codes[0] - codes[1]) <= 1)
    assert not np.array_equal(codes[0], np.full_like(codes[0], levels))  # real codes, not a constant


def test_qsgd_fused_is_unbiased():
    x = np.random.default_rng(2).standard_normal(4096, dtype=np.float32)
    codec = get_codec("qsgd", levels=7)
    mean = np.mean([codec.decode(codec.encode(x)) for _ in range(400)], axis=0)
    norm_step = np.linalg.norm(x.reshape(-1, 512), axis=1).repeat(512) / 7
    # 400 draws of a value within one level step: the mean is within a few standard errors.
    assert np.all(np.abs(mean - x) < 5 * norm_step / np.sqrt(400))


@pytest.mark.parametrize("block, bits", [(8, 8), (8, 4), (4, 12), (5, 3)])
def test_dct_quant_codes_match_the_matmul_path(monkeypatch, block, bits):
    x = np.random.default_rng(3).standard_normal(block * block * 500 + 7, dtype=np.float32)
    fused, fallback = _both("dct_quant", x, monkeypatch, block=block, bits=bits)
    np.testing.assert_allclose(fused.arrays["scales"], fallback.arrays["scales"], rtol=1e-5)
    assert np.array_equal(fused.arrays["tail"], fallback.arrays["tail"])
    codec = get_codec("dct_quant", block=block, bits=bits)
    a, b = codec.decode(fused), codec.decode(fallback)
    error = np.linalg.norm(a - x) / np.linalg.norm(x)
    assert error <= 1.01 * np.linalg.norm(b - x) / np.linalg.norm(x) + 1e-6
    assert np.linalg.norm(a - b) / np.linalg.norm(x) < 0.2 * error + 1e-6  # one code off, rarely
