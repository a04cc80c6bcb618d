"""The fused C encoders (rayzip/codecs/_kernels.c) against the torch/numpy path that the GPU
and builds without a compiler use (issue 18)."""

from __future__ import annotations

import numpy as np
import pytest

from rayzip.codecs import get_codec, kernels
from rayzip.codecs.bitpack import unpack_bits



@pytest.fixture(autouse=True)
def _built():
    """Every test here fails, not skips, without the build: the fallback passing in their place
    would hide a broken C extension. (make setup builds it; a user's install may do without.)"""
    if kernels.fused is None:
        pytest.fail("rayzip.codecs._kernels is not built: no C compiler when rayzip was installed, or the "
                    "build failed (pip install -e . shows why)")


def _both(codec_name: str, x, monkeypatch, **params):
    fused = get_codec(codec_name, **params).encode(x)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "fused", None)
        assert not kernels.fused_for(x)
        fallback = get_codec(codec_name, **params).encode(x)
    return fused, fallback


def test_group_topk_selects_what_torch_topk_selects(monkeypatch):
    x = np.random.default_rng(0).standard_normal(1024 * 300 + 77, dtype=np.float32)
    fused, fallback = _both("group_topk", x, monkeypatch, density=0.01, value_dtype="fp32")
    for name in ("indices", "values"):
        assert np.array_equal(fused.arrays[name], fallback.arrays[name])


def test_group_topk_keeps_the_lowest_indices_among_ties():
    rows = np.zeros((3, 16), dtype=np.float32)
    rows[0, [2, 5, 9, 12]] = [1.0, -1.0, 1.0, 1.0]  # four tied for three places
    rows[1] = np.arange(16, dtype=np.float32)[::-1]  # a descending row: every entry displaces one
    rows[2] = -np.arange(16, dtype=np.float32)  # ascending magnitudes
    columns, values, finite = kernels.top_magnitude_rows(rows, 3)
    assert columns.tolist() == [[2, 5, 9], [0, 1, 2], [13, 14, 15]]
    assert values.tolist() == [[1.0, -1.0, 1.0], [15.0, 14.0, 13.0], [-13.0, -14.0, -15.0]]
    assert finite is True


@pytest.mark.parametrize("k", [10, 16, 52])  # up to 16: the bounded scan; above: the heap alone
def test_group_topk_in_long_rows_keeps_the_largest_and_the_lowest_index_among_ties(k):
    """Rows long enough for the 16-wide scan, with ties on the heap's floor inside one vector
    and candidates in every chunk (ascending) or in none (after a large head), against a
    stable sort (torch.topk picks among ties as it likes)."""
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal((64, 1024)), 1).astype(np.float32)  # many equal magnitudes
    x[1] = np.arange(1024, dtype=np.float32)
    x[2] = 0.0
    x[2, :40] = 5.0
    x[3, 1000:1016] = -x[3].max() - 1
    x = np.concatenate([x, x[:, :1000:7]], axis=1)  # 1167 entries: a tail after the last 16
    columns, values, finite = kernels.top_magnitude_rows(x, k)
    expected = np.sort(np.argsort(-np.abs(x), axis=1, kind="stable")[:, :k], axis=1)
    assert finite is True
    assert np.array_equal(columns, expected)
    assert np.array_equal(values, np.take_along_axis(x, expected, axis=1))


@pytest.mark.parametrize("codec, params", [("group_topk", {"density": 0.01}), ("dct_quant", {"bits": 8}),
                                           ("dct_quant", {"block": 4, "bits": 8}), ("dct_quant", {"keep": 0.5})])
@pytest.mark.parametrize("where", [5, 70_001, 1024 * 100 + 3])  # first vector, middle, tail
def test_fused_kernels_find_nan_and_inf_as_they_read(codec, params, where):
    from rayzip.codecs import NonFiniteError

    for bad in (float("nan"), float("inf")):
        x = np.random.default_rng(0).standard_normal(1024 * 100 + 10, dtype=np.float32)
        x[where] = bad
        with pytest.raises(NonFiniteError, match=f"1 NaN/Inf value\\(s\\), first at flat index {where}"):
            get_codec(codec, **params).encode(x)


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


@pytest.mark.parametrize("bits, keep", [(8, 1.0), (4, 1.0), (12, 1.0), (8, 0.25)])
def test_dct_quant_fused_decode_matches_the_matmul_path(monkeypatch, bits, keep):
    x = np.random.default_rng(4).standard_normal(64 * 500 + 13, dtype=np.float32)
    codec = get_codec("dct_quant", bits=bits, keep=keep)
    payload = codec.encode(x)
    fused = codec.decode(payload)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "fused", None)
        import rayzip.codecs.dct_quant as dct

        patch.setattr(dct, "fused", None)
        fallback = codec.decode(payload)
    np.testing.assert_allclose(fused, fallback, rtol=0, atol=2e-6 * np.abs(x).max())
    assert np.array_equal(fused[-13:], x[-13:])
    again = codec.decode(payload)  # deterministic: every worker decodes the same bits
    assert np.array_equal(fused, again)


def test_group_topk_of_a_group_of_nans_is_refused_not_read_out_of_bounds():
    from rayzip.codecs import NonFiniteError

    x = np.random.default_rng(0).standard_normal(1024 * 8, dtype=np.float32)
    x[1024:2048] = np.nan
    with pytest.raises(NonFiniteError, match="1024 NaN/Inf value\\(s\\), first at flat index 1024"):
        get_codec("group_topk", density=0.01).encode(x)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_all_finite_is_exact_where_a_sum_overflows_or_cancels(dtype):
    big = float(np.finfo(dtype).max) / 2
    assert kernels.all_finite(np.full(8, big, dtype=dtype))  # the sum overflows; every entry is finite
    assert kernels.all_finite(np.zeros(0, dtype=dtype))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(1000, dtype=dtype)
        x[637] = bad
        assert not kernels.all_finite(x), bad
    x = np.ones(1000, dtype=dtype)
    x[3], x[900] = np.inf, -np.inf  # the sum is NaN, not a cancelled finite value
    assert not kernels.all_finite(x)


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 3 * 4096 + 5])
@pytest.mark.parametrize("where", [None, "first", "chunk_edge", "last", "inf_before_nan"])
def test_scale_checked_scales_and_finds_the_first_bad_entry_as_the_fallback_does(monkeypatch, size, where):
    """A dense step's bucket: scaled by 1/world in place and checked in the same pass; the
    fused kernel's answer and result are the torch fallback's (which CUDA uses)."""
    torch = pytest.importorskip("torch")
    x = torch.randn(size, generator=torch.Generator().manual_seed(size))
    expected = -1
    if where is not None:
        at = {"first": 0, "chunk_edge": min(4096, size - 1), "last": size - 1,
              "inf_before_nan": size // 2}[where]
        x[at] = float("inf") if where == "inf_before_nan" else float("nan")
        if where == "inf_before_nan" and at + 1 < size:
            x[at + 1] = float("nan")
        expected = at
    fused, fallback = x.clone(), x.clone()
    assert kernels.scale_checked(fused, 0.25) == expected
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "fused", None)
        assert int(kernels.scale_checked(fallback, 0.25)) == expected
    assert torch.equal(fused.nan_to_num(), fallback.nan_to_num())
    assert torch.equal(fused.nan_to_num(), (x * 0.25).nan_to_num())


@pytest.mark.parametrize("held", [True, False])
def test_momentum_update_fused_is_the_torch_path_bit_for_bit(monkeypatch, held):
    """A dense step's momentum correction: u = m * held + g into the velocity and the gradient,
    rounded as SGD's buf.mul_(m).add_(g) rounds it."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    g, h = torch.randn(10_007, generator=gen), (torch.randn(10_007, generator=gen) if held else None)
    runs = []
    for kernel in (True, False):
        grad, out = g.clone(), torch.empty_like(g)
        with monkeypatch.context() as patch:
            if not kernel:
                patch.setattr(kernels, "fused", None)
            kernels.momentum_update(grad, h, out, 0.9)
        runs.append((grad, out))
    (fused_grad, fused_out), (torch_grad, torch_out) = runs
    expected = g.clone() if h is None else (h * 0.9).add_(g)
    assert torch.equal(fused_out, expected) and torch.equal(torch_out, expected)
    assert torch.equal(fused_grad, expected if h is not None else g) and torch.equal(torch_grad, fused_grad)


@pytest.mark.parametrize("held", [True, False])
def test_adam_update_fused_matches_the_torch_path(monkeypatch, held):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(10_007, generator=gen)
    m_held = torch.randn(10_007, generator=gen) if held else None
    v_held = torch.rand(10_007, generator=gen) if held else None
    runs = []
    for kernel in (True, False):
        grad, m, v = g.clone(), torch.empty_like(g), torch.empty_like(g)
        with monkeypatch.context() as patch:
            if not kernel:
                patch.setattr(kernels, "fused", None)
            kernels.adam_update(grad, m_held, v_held, m, v, (0.9, 0.95), (1 / (1 - 0.9 ** 3), 1 / (1 - 0.95 ** 3)), 1e-8)
        runs.append((grad, m, v))
    for fused, fallback in zip(*runs):
        torch.testing.assert_close(fused, fallback, rtol=2e-6, atol=1e-7)
    m_ref = 0.1 * g + (0.9 * m_held if held else 0)
    v_ref = 0.05 * g * g + (0.95 * v_held if held else 0)
    direction = m_ref / ((v_ref / (1 - 0.95 ** 3)).sqrt() + 1e-8) / (1 - 0.9 ** 3)
    torch.testing.assert_close(runs[0][0], direction, rtol=1e-5, atol=1e-6)
