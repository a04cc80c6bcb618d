"""Compressed checkpoints: bit-exact round trips, deltas, corruption named by file and tensor."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rayzip import checkpoint
from rayzip.checkpoint import CheckpointError, codecs, transforms
from rayzip.checkpoint.codecs import Planes, Prefix
from rayzip.checkpoint.store import write_manifest
from rayzip.checkpoint.transforms import tensor_words
from rayzip.cli import app

FLOAT_SPECIALS = {
    torch.float32: [0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38],
    torch.float16: [0.0, -0.0, float("inf"), float("-inf"), 6e-8, 65504.0],
    torch.bfloat16: [0.0, -0.0, float("inf"), float("-inf"), 9.2e-41, 3.38e38],
    torch.float64: [0.0, -0.0, float("inf"), 5e-324, 1.7976931348623157e308],
}
NAN_PAYLOADS = {torch.float32: [0x7FC00001, 0xFFA12345, 0x7F800001], torch.float16: [0x7E01, 0xFC01],
                torch.bfloat16: [0x7FC1, 0xFF81], torch.float64: [0x7FF0000000000001]}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor, name: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(bits(a.contiguous()), bits(b)), name


def special_tensor(dtype, shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype.is_floating_point:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.randint(-30, 30, (n,), generator=g)).to(dtype)
        specials = torch.tensor(FLOAT_SPECIALS[dtype], dtype=dtype)
        picks = torch.randint(0, n, (min(n, 3 * len(specials)),), generator=g)
        t[picks] = specials[torch.arange(picks.numel()) % len(specials)]
        payloads = torch.tensor(NAN_PAYLOADS[dtype], dtype=torch.int64).to(INT_VIEW[dtype])
        where = torch.randint(0, n, (min(n, payloads.numel()),), generator=g)
        bits(t)[where] = payloads[: where.numel()]
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -2**62), min(info.max, 2**62), (n,), generator=g, dtype=torch.int64).to(dtype)
    return t.reshape(shape)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]


@contextlib.contextmanager
def engine(name: str):
    """``kernels``: the C kernels (Huffman coding); ``numpy``: the fallback without them."""
    saved = transforms.kernels, codecs.kernels
    if name == "numpy":
        transforms.kernels = codecs.kernels = None
    try:
        yield
    finally:
        transforms.kernels, codecs.kernels = saved


def test_the_c_kernels_are_built():
    # CI builds them (setup.py); without them every test below would pass on the fallback alone.
    assert transforms.kernels is not None and codecs.kernels is not None


@pytest.mark.parametrize("name", ["kernels", "numpy"])
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 70), min_size=0, max_size=3),
       seed=st.integers(0, 2**16), delta=st.booleans(), big=st.booleans(), threads=st.sampled_from([1, 2]))
def test_round_trip_is_bit_exact_over_dtypes_shapes_and_special_values(tmp_path_factory, name, dtype, shape, seed,
                                                                       delta, big, threads):
    with engine(name):
        _round_trip(tmp_path_factory, dtype, shape, seed, delta, big, threads)


def _round_trip(tmp_path_factory, dtype, shape, seed, delta, big, threads):
    if big:  # large enough for the codec choice to sample and try the prefix mapping
        shape = [70_000 + seed % 7]
    tmp = tmp_path_factory.mktemp("ckpt")
    t = special_tensor(dtype, tuple(shape), seed)
    base = None
    if delta:
        moved = special_tensor(dtype, tuple(shape), seed + 1)
        checkpoint.save(tmp / "base", {"optimizer": {"m": moved}, "w": moved})
        base = tmp / "base"
    checkpoint.save(tmp / "c", {"optimizer": {"m": t}, "w": t, "step": 7, "note": ("a", 1.5, None)}, base=base,
                    threads=threads)
    back = checkpoint.load(tmp / "c")
    assert_bit_exact(t, back["w"])
    assert_bit_exact(t, back["optimizer"]["m"])
    assert back["step"] == 7 and back["note"] == ("a", 1.5, None)


@pytest.mark.parametrize("codec", [Planes(), Planes(rotate=1), Prefix(9), Prefix(12)])
def test_each_float_codec_round_trips_with_and_without_base(codec):
    t = special_tensor(torch.float32, (5000,), 1)
    base = special_tensor(torch.float32, (5000,), 2)
    for prior in (None, tensor_words(base)[0]):
        words, xp = tensor_words(t)
        streams, params = codec.encode(words, prior, xp)
        back = codec.decode([np.ascontiguousarray(s).view(np.uint8) for s in streams], params, words.size,
                            words.dtype, prior, np)
        assert np.array_equal(back, words)


def skewed_bytes(kind: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == 0:
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == 1:
        return np.full(n, seed % 256, dtype=np.uint8)
    if kind == 2:  # geometric: up to 255 distinct values, long codes in the tail
        return np.minimum(rng.geometric(0.05, n), 255).astype(np.uint8)
    if kind == 3:  # runs of alike values, as exponents of optimizer state
        return (120 + np.cumsum(rng.integers(-1, 2, n)) % 9).astype(np.uint8)
    return (rng.zipf(1.2, n) % 256).astype(np.uint8)  # one value dominates, a very long tail


@settings(max_examples=80, deadline=None)
@given(kind=st.integers(0, 4), n=st.integers(1, 20_000), seed=st.integers(0, 2**16), order=st.integers(0, 1))
def test_huffman_round_trips_any_bytes(kind, n, seed, order):
    data = skewed_bytes(kind, n, seed)
    stream = transforms.kernels.huffman_encode(data, order)
    back = np.empty_like(data)
    transforms.kernels.huffman_decode(stream, back)
    assert np.array_equal(back, data)


def package_merge_cost(counts: list[int], max_bits: int) -> int:
    """Σ count × length of the optimal code of at most ``max_bits`` bits, by package-merge."""
    leaves = sorted((c, (i,)) for i, c in enumerate(counts) if c)
    items = leaves
    for _ in range(max_bits - 1):
        packages = [(items[i][0] + items[i + 1][0], items[i][1] + items[i + 1][1]) for i in range(0, len(items) - 1, 2)]
        items = sorted(leaves + packages, key=lambda item: item[0])
    depth = [0] * len(counts)
    for _, symbols in items[: 2 * len(leaves) - 2]:
        for s in symbols:
            depth[s] += 1
    return sum(c * d for c, d in zip(counts, depth))


def test_huffman_codes_are_the_optimal_codes_within_the_length_limit():
    # Counts doubling 20 times would give an unlimited Huffman code 20 bits deep; the stored
    # code must be limited to 11 bits and still cost the least any such code can.
    counts = [2**i for i in range(20)] + [3, 5, 7]
    data = np.repeat(np.arange(len(counts), dtype=np.uint8), counts)
    np.random.default_rng(0).shuffle(data)
    stream = transforms.kernels.huffman_encode(data, 0)
    assert stream[0] & 1 == 0
    table = np.frombuffer(stream[33:33 + 128], dtype=np.uint8)
    lengths = np.stack([table & 15, table >> 4], axis=1).reshape(-1).astype(int)
    present = np.array(counts + [0] * (256 - len(counts))) > 0
    assert np.array_equal(lengths > 0, present)
    assert lengths.max() <= 11
    assert sum(2.0 ** -int(n) for n in lengths[present]) <= 1.0
    cost = int(sum(c * int(n) for c, n in zip(counts, lengths)))
    assert cost == package_merge_cost(counts, 11)
    assert cost < package_merge_cost(counts, 10)  # the limit binds: a plain Huffman code is deeper
    back = np.empty_like(data)
    transforms.kernels.huffman_decode(stream, back)
    assert np.array_equal(back, data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bell_shaped_weights_can_be_coded_with_the_top_mantissa_bits_beside_the_exponent(dtype, monkeypatch):
    weights = (torch.randn(512, 384, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    words = tensor_words(weights)[0]
    name = str(dtype).removeprefix("torch.")

    def chosen():
        return codecs.choose(words, None, name, np, False, tuple(weights.shape))

    def stored(rotate):
        return sum(len(codecs.pack_stream(s)[0]) for s in Planes(rotate=rotate).encode(words, None, np)[0])

    monkeypatch.setattr(codecs, "WEIGHT_ROTATE", 1)  # the default (the variable unset): faster
    assert isinstance(chosen(), Planes) and chosen().rotate == 1
    monkeypatch.setattr(codecs, "WEIGHT_ROTATE", 3)  # RAYZIP_CHECKPOINT_WEIGHT_ROTATE=3: smaller
    assert isinstance(chosen(), Planes) and chosen().rotate == 3
    assert stored(3) < stored(1)
    assert all(getattr(c, "rotate", None) != 3 for c in codecs.candidates(name, True, tuple(weights.shape)))
    assert all(getattr(c, "rotate", None) != 3 for c in codecs.candidates(name, False, tuple(weights.shape), True))


@pytest.mark.parametrize("n", [1 << 18, (1 << 18) + 3, 600_001])
def test_large_huffman_streams_round_trip_and_code_the_same_bytes_every_time(n):
    # From 256 KB on, order 0 codes two bytes per table lookup, and every stream writes its
    # segments straight to their place, each followed by zero padding.
    for kind in range(5):
        data = skewed_bytes(kind, n, kind)
        for order in (0, 1):
            stream = transforms.kernels.huffman_encode(data, order)
            assert transforms.kernels.huffman_encode(data.copy(), order) == stream
            back = np.empty_like(data)
            transforms.kernels.huffman_decode(stream, back)
            assert np.array_equal(back, data), (kind, order)


@pytest.mark.parametrize("n", [(2 << 20) - 1, 2 << 20, (5 << 20) + 3])
def test_huffman_streams_of_2mb_and_more_are_coded_in_groups_the_same_on_any_threads(n):
    # A stream of 2 MB or more is cut into groups (one per MB, at most 16) that threads code
    # and decode apart; the first byte holds the order and the groups less one.
    groups = min(16, max(1, n >> 20))
    for kind in (2, 3, 4):
        data = skewed_bytes(kind, n, kind)
        for order in (0, 1):
            stream = transforms.kernels.huffman_encode(data, order)
            assert stream[0] == order | (groups - 1) << 1
            for threads in (2, 3, 8):
                assert transforms.kernels.huffman_encode(data, order, None, threads) == stream
                back = np.zeros_like(data)
                transforms.kernels.huffman_decode(stream, back, threads)
                assert np.array_equal(back, data), (kind, order, threads)


# Huffman streams as format 3 wrote them, before groups: 3 MB + 7 bytes of a repeating
# exponent pattern, coded by that version's kernel (order 0, then order 1), then zstd'd.
FORMAT3_HUFFMAN = {0: "KLUv/aDVQAsARAEAwAABADASAwnQArGuWFesK9YV64p1xbpiXQQAPf8y8/oOdwRLzibgBrQAABABAAQAU6K7QzuTnzk0wLnoChV9BgGUAAAQBgADADpf0afeAOfiLajkMwhEAAAAAQD9//ILBLQAABAdAAQAgUFXh9amc5tIA5yLwLDsMwhdAAAIAAIAOEKSgSSfQA==",
                   1: "KLUv/aDVAgkAjAEAqAEBAIAHABEAAQAiECIAAAlAAh7qoQkASf26fOyOgRcFG1LaBJPeDVK8QYoRoIMDQ5QAABAGAAMAQ70KQGIGOBddBXcXBEQAAAABAP2//QIBpAAAOB7qAQCoh3oDADf9bx6vS7UqAAREAAAAAQD9X94BAYwAABAA6wMAMP0WgKAs73vAKhAEXQAACAACAC8hyYL9AgE="}


@pytest.mark.parametrize("order", [0, 1])
def test_huffman_streams_written_before_groups_still_decode(order):
    import base64

    import zstandard

    stream = zstandard.ZstdDecompressor().decompress(base64.b64decode(FORMAT3_HUFFMAN[order]))
    n = (3 << 20) + 7
    data = np.tile(np.array([120, 121, 121, 119, 120, 122, 121, 120], np.uint8), n // 8 + 1)[:n]
    assert stream[0] == order  # one group of four segments
    for threads in (1, 2):
        back = np.zeros_like(data)
        transforms.kernels.huffman_decode(stream, back, threads)
        assert np.array_equal(back, data)
    regrouped = transforms.kernels.huffman_encode(data, order)
    assert regrouped[0] == order | 2 << 1 and regrouped != stream


@pytest.mark.parametrize("width", [2, 4, 8])
def test_byte_planes_on_threads_are_the_planes_of_one_thread(width):
    rng = np.random.default_rng(width)
    dtype = transforms.WORD_DTYPES[width]
    words = rng.integers(0, 1 << (8 * width - 1), (2 << 20) + 5, dtype=np.uint64).astype(dtype)  # two ranges
    base = rng.integers(0, 1 << (8 * width - 1), words.size, dtype=np.uint64).astype(dtype)
    for prior in (None, base):
        for rotate in (0, 1):
            one = transforms.byte_planes(words, np, base=prior, rotate=rotate, threads=1).copy()
            many = transforms.byte_planes(words, np, base=prior, rotate=rotate, threads=3)
            assert np.array_equal(one, many)
            back = transforms.from_byte_planes(list(many), dtype, np, base=prior, rotate=rotate, threads=3)
            assert np.array_equal(back, words)


def test_a_large_tensor_is_the_same_bytes_on_any_threads_and_restores_on_any(tmp_path):
    # 2.25 M floats: an exponent plane of 2.25 MB, Huffman-coded in two groups.
    state = {"model": {"w": torch.randn(1500, 1500, generator=torch.Generator().manual_seed(0))}}
    one, blobs_one = checkpoint.encode(state, threads=1)
    two, blobs_two = checkpoint.encode(state, threads=2)
    assert b"".join(blobs_one) == b"".join(blobs_two) and one["version"] == checkpoint.store.VERSION
    streams = one["tensors"]["/model/w"]["streams"]
    assert any(s["coding"] == "huffman" and s["nbytes"] >= 2 << 20 for s in streams)
    for threads in (1, 2, 3):
        assert_bit_exact(checkpoint.decode(one, blobs_one, threads=threads)["model"]["w"], state["model"]["w"])
    checkpoint.save(tmp_path / "c", state, threads=2)
    assert_bit_exact(checkpoint.load(tmp_path / "c", threads=1)["model"]["w"], state["model"]["w"])


def test_huffman_into_a_buffer_writes_the_same_stream_and_refuses_one_too_small():
    for kind in range(5):
        data = skewed_bytes(kind, 300_000, kind)
        stream = transforms.kernels.huffman_encode(data, 0)
        out = np.full(len(stream) + 100, 0xAB, dtype=np.uint8)
        assert transforms.kernels.huffman_encode(data, 0, out) == len(stream)
        assert out[: len(stream)].tobytes() == stream and (out[len(stream):] == 0xAB).all()
        assert transforms.kernels.huffman_encode(data, 0, out[: len(stream) - 1]) == -1


def test_scratch_buffers_are_reused_only_after_every_view_of_them_is_gone():
    from rayzip.checkpoint import scratch

    if scratch.LIMIT < 1 << 22:
        pytest.skip("the scratch pool is turned off (RAYZIP_CHECKPOINT_SCRATCH_MB)")
    loan = scratch.take(1 << 20)
    address = loan.ctypes.data
    planes = loan.reshape(4, -1)[1:]  # a view outlives the loan's own name
    planes[:] = 7
    del loan
    second = scratch.take(1 << 20)
    assert second.ctypes.data != address and (planes == 7).all()
    del planes
    third = scratch.take((1 << 20) - 5000)  # the same size class: the returned buffer
    assert third.ctypes.data == address
    assert scratch.take(100).ctypes.data != address  # small: not pooled
    del second, third
    assert scratch.kept_bytes() >= 2 << 20


@pytest.mark.parametrize("kind", range(5))
@pytest.mark.parametrize("n, sample", [(30_000, 0), (30_003, 0), (3, 0), (200_003, 1 << 16), (1 << 16, 1 << 16),
                                        (70_001, 4099)])
def test_stream_statistics_match_numpy(kind, n, sample):
    # With a sample, the kernel reads four spaced runs in place: the statistics of the
    # runs concatenated (order 1 carries the context across their joins), as numpy sees them.
    data = skewed_bytes(kind, n, kind)
    fast = codecs.stream_stats(data, sample)
    with engine("numpy"):
        slow = codecs.stream_stats(data, sample)
        assert codecs.stream_stats(codecs._sample(data, sample) if sample else data) == slow
    assert fast[0] == pytest.approx(slow[0], abs=1e-9) and fast[2:] == slow[2:]
    assert (fast[1] is None) == (slow[1] is None)
    if fast[1] is not None:
        assert fast[1] == pytest.approx(slow[1], abs=1e-9) and fast[1] <= fast[0] + 1e-9


def test_join_planes_refuses_planes_that_do_not_match_the_words():
    words = np.empty(10, dtype=np.uint32)
    with pytest.raises(ValueError, match="width"):
        transforms.kernels.join_planes([np.zeros(10, np.uint8)] * 3, words, 4, 0, None)
    with pytest.raises(ValueError, match="one byte per word"):
        transforms.kernels.join_planes([np.zeros(9, np.uint8)] * 4, words, 4, 0, None)
    with pytest.raises(ValueError, match="base"):
        transforms.kernels.join_planes([np.zeros(10, np.uint8)] * 4, words, 4, 0, np.zeros(3, np.uint32))


@pytest.mark.parametrize("order", [0, 1])  # order 0 has its own decoding loop
@pytest.mark.parametrize("n, trials, threads", [(50_000, 300, 1), ((5 << 19) + 1, 60, 2)])
def test_a_damaged_huffman_stream_is_an_error_or_other_bytes_never_a_crash(n, trials, threads, order):
    data = skewed_bytes(3, n, 1)
    stream = transforms.kernels.huffman_encode(data, order)
    rng = np.random.default_rng(0)
    out = np.empty_like(data)
    errors = 0
    for trial in range(trials):
        damaged = bytearray(stream)
        for at in rng.integers(0, len(damaged), 1 + trial % 5):
            damaged[at] ^= int(rng.integers(1, 256))
        if trial % 3 == 0:
            damaged = damaged[: int(rng.integers(0, len(damaged)))]
        try:
            transforms.kernels.huffman_decode(bytes(damaged), out, threads)
        except ValueError:
            errors += 1
    assert errors > 0  # the stored checksums catch the rest before decoding


def test_planes_and_prefix_kernels_match_numpy():
    t = special_tensor(torch.float32, (10_000,), 3)
    base = special_tensor(torch.float32, (10_000,), 4)
    words, prior = tensor_words(t)[0], tensor_words(base)[0]
    for codec in (Planes(rotate=1), Prefix(9), Prefix(12)):
        fast = codec.encode(words, prior, np)
        with engine("numpy"):
            slow = codec.encode(words, prior, np)
        assert fast[1] == slow[1]
        assert all(np.array_equal(np.asarray(a).view(np.uint8).ravel(), np.asarray(b).view(np.uint8).ravel())
                   for a, b in zip(fast[0], slow[0]))


def adam_second_moment(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Squared gradients averaged as Adam does, with the row and column scales a layer's
    gradients have: near a product of a row factor and a column factor, times noise."""
    g = torch.Generator().manual_seed(seed)
    row = torch.exp(2 * torch.randn(rows, 1, generator=g))
    col = torch.exp(2 * torch.randn(1, cols, generator=g))
    grads = torch.randn(8, rows, cols, generator=g) * (row * col).sqrt()
    return (grads ** 2).mean(0)


@pytest.mark.parametrize("shape", [(2, 2), (3, 700), (257, 63), (64, 5, 9)])
def test_exponent_model_kernel_matches_numpy_and_inverts(shape):
    rng = np.random.default_rng(sum(shape))
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    for top in (rng.integers(0, 256, (rows, cols), dtype=np.uint8),  # predictions clamp at both ends
                np.full((rows, cols), 255, np.uint8), np.zeros((rows, cols), np.uint8),
                (100 + rng.integers(0, 30, (rows, 1)) + rng.integers(0, 30, (1, cols))).astype(np.uint8)):
        fast = top.copy()
        fast_model = transforms.exponent_residual(fast, np)
        slow = top.copy()
        with engine("numpy"):
            slow_model = transforms.exponent_residual(slow, np)
        assert np.array_equal(fast, slow)
        assert all(np.array_equal(a, b) for a, b in zip(fast_model, slow_model))
        for name in ("kernels", "numpy"):
            back = fast.copy()
            with engine(name):
                transforms.exponent_restore(back, *fast_model, np)
            assert np.array_equal(back, top), name


def stored_bytes(codec, words, shape) -> int:
    return sum(len(codecs.pack_stream(s)[0]) for s in codec.encode(words, None, np, shape=shape)[0])


def scaled_inputs(rows: int, cols: int, seed: int) -> list[np.ndarray]:
    """fp32 words of a matrix: special values and 60 binades (escapes, clamped predictions),
    random bits, all zeros, all one value, and a moment-like matrix with a sign pattern."""
    rng = np.random.default_rng(seed)
    pattern = np.sign(rng.standard_normal((rows, 1))) * np.sign(rng.standard_normal((1, cols)))
    flips = np.where(rng.random((rows, cols)) < 0.2, -1.0, 1.0)
    moment = (adam_second_moment(rows, cols, seed).sqrt().numpy() * pattern * flips).astype(np.float32)
    return [tensor_words(special_tensor(torch.float32, (rows, cols), seed))[0],
            rng.integers(0, 1 << 32, rows * cols, dtype=np.uint64).astype(np.uint32),
            np.zeros(rows * cols, np.uint32), np.full(rows * cols, 0x80000001, np.uint32),
            np.ascontiguousarray(moment).reshape(-1).view(np.uint32)]


@pytest.mark.parametrize("shape", [(2, 2), (3, 5), (7, 9), (64, 33), (257, 63), (70, 1536)])
@pytest.mark.parametrize("sign_rank", [1, 4])
def test_scaled_split_kernel_matches_numpy_and_inverts(shape, sign_rank):
    rows, cols = shape
    for words in scaled_inputs(rows, cols, rows + cols):
        fast = transforms.scaled_split(words, rows, cols, sign_rank)
        with engine("numpy"):
            slow = transforms.scaled_split(words, rows, cols, sign_rank)
        assert fast.keys() == slow.keys() and fast["sign_rank"] == slow["sign_rank"]
        # Rank 1's model is integer votes, the same everywhere; a higher rank's factors come
        # from float arithmetic, which C and numpy order differently: each decodes the other's.
        same = fast.keys() - ({"symbols", "row_factors", "col_factors"} if fast["sign_rank"] > 1 else set())
        for key in same:
            assert np.array_equal(fast[key], slow[key]), key
        for parts in (fast, slow):
            for name in ("kernels", "numpy"):
                with engine(name):
                    assert np.array_equal(transforms.scaled_join(parts, rows, cols), words), name


@pytest.mark.parametrize("sign_rank", [1, 4])
def test_scaled_split_on_threads_codes_the_same_streams_and_any_threads_join_them(sign_rank):
    """A matrix of over three million floats is split in ranges of rows, a thread each: the
    column sums are added, the ranges' escapes put back in order. 1001 rows in halves (501)
    or thirds (334) are not multiples of 8, so the ranges' rounding is tried too."""
    rows, cols = 1001, 3333
    rng = np.random.default_rng(sign_rank)
    value = (rng.standard_normal((rows, 1)) * rng.standard_normal((1, cols))
             * np.exp(rng.standard_normal((rows, cols)))).astype(np.float32)
    value.reshape(-1)[rng.integers(0, value.size, 300)] = np.float32(1e30)  # escapes all over
    value.reshape(-1)[rng.integers(0, value.size, 300)] = np.inf
    words = value.reshape(-1).view(np.uint32)
    one = transforms.scaled_split(words, rows, cols, sign_rank, threads=1)
    assert one["sign_rank"] == sign_rank and one["escapes"].size >= 500
    for threads in (2, 3):
        split = transforms.scaled_split(words, rows, cols, sign_rank, threads=threads)
        for key, part in one.items():
            assert np.array_equal(split[key], part), (threads, key)
    for threads in (1, 2, 3):
        assert np.array_equal(transforms.scaled_join(one, rows, cols, threads=threads), words), threads
        for escapes in (one["escapes"][:-1], np.append(one["escapes"], 7).astype(np.uint16)):
            with pytest.raises(ValueError, match="escapes"):
                transforms.scaled_join({**one, "escapes": escapes}, rows, cols, threads=threads)


def test_a_higher_sign_rank_is_chosen_only_where_it_pays_on_the_whole_matrix():
    """Signs that follow no pattern: four directions found on the choice's sample itself (8
    rows of 2048) fit those rows' signs, and rank 4 looks smaller than rank 1 there. Found on
    the whole matrix, as the encoder finds them, they predict nothing, and their factors
    cost more than rank 1's signs."""
    rows, cols = 1024, 2048
    rng = np.random.default_rng(11)
    value = (np.exp(rng.standard_normal((rows, 1)) + rng.standard_normal((1, cols)))
             * rng.standard_normal((rows, cols))).astype(np.float32)
    words = value.reshape(-1).view(np.uint32)
    chosen = codecs.choose(words, None, "float32", np, True, (rows, cols))
    assert isinstance(chosen, codecs.Scaled) and chosen.sign_rank == 1, chosen
    sample, _, sample_shape = codecs._choice_sample(words, None, (rows, cols), np)
    assert sample_shape == (8, cols)

    def per_float(codec, streams) -> float:  # as the choice counts them: the columns' model at its weight
        return codec.stored_per_element([len(codecs.pack_stream(s)[0]) for s in streams], sample_shape, words.size)

    four, one = codecs.Scaled(4), codecs.Scaled(1)
    own = per_float(four, four.encode(sample, None, np, shape=sample_shape)[0])  # directions from the 8 rows
    whole = per_float(four, four.encode_sample(sample, None, np, sample_shape, words, (rows, cols)))
    rank_one = per_float(one, one.encode_sample(sample, None, np, sample_shape, words, (rows, cols)))
    assert own < rank_one < whole, (own, rank_one, whole)  # a better fit on the sample only


def test_a_first_moment_whose_signs_are_low_rank_is_coded_with_a_sign_model_of_rank_four(tmp_path):
    """A rank-4 product plus noise a quarter of its typical size, as a transformer's first
    moment is nearly low-rank: one sign per row and column agrees with about two thirds of
    its signs, rank-4 factors with all but those the noise flipped."""
    rows, cols = 512, 384
    g = torch.Generator().manual_seed(6)
    m = (torch.randn(rows, 4, generator=g) @ torch.randn(4, cols, generator=g)
         + 0.5 * torch.randn(rows, cols, generator=g)).contiguous()
    words = tensor_words(m)[0]
    one, four = (transforms.scaled_split(words, rows, cols, rank) for rank in (1, 4))
    assert four["sign_rank"] == 4 and (four["symbols"] & 1).mean() < 0.12, (four["symbols"] & 1).mean()
    assert (one["symbols"] & 1).mean() > 0.25, (one["symbols"] & 1).mean()
    sizes = {rank: stored_bytes(codecs.Scaled(rank), words, (rows, cols)) for rank in (1, 4)}
    # about 0.5 bits a sign instead of 0.8 or more, over 196,608 signs, less 3.6 KB of factors
    assert sizes[4] < sizes[1] - 4000, sizes
    chosen = codecs.choose(words, None, "float32", np, True, (rows, cols))
    assert isinstance(chosen, codecs.Scaled) and chosen.sign_rank == codecs.OPTIMIZER_SIGN_RANK
    checkpoint.save(tmp_path / "c", {"optimizer": {"state": {0: {"exp_avg": m}}}})
    entry = checkpoint.read_manifest(tmp_path / "c")["tensors"]["/optimizer/state/0/exp_avg"]
    assert entry["codec"] == "scaled" and entry["params"] == {"columns": cols, "sign_rank": 4}
    assert_bit_exact(m, checkpoint.load(tmp_path / "c")["optimizer"]["state"][0]["exp_avg"])


def test_scaled_symbols_hold_the_log_magnitude_residual_and_the_sign_disagreement():
    # A rank-one pattern of signs, two of ten floats flipped, magnitudes a row and a column scale.
    rows, cols = 96, 80
    words = scaled_inputs(rows, cols, 3)[-1]
    parts = transforms.scaled_split(words, rows, cols)
    value = words.view(np.float32).reshape(rows, cols)
    pattern = np.where(parts["row_negative"][:, None] ^ parts["col_negative"][None, :], -1.0, 1.0)
    disagree = (parts["symbols"] & 1).reshape(rows, cols)
    assert np.array_equal(disagree, (np.sign(value) != pattern).astype(np.uint8))
    assert 0.15 < disagree.mean() < 0.25  # the pattern found is the one planted, up to its sign
    log = (words >> 21) & 1023
    residual = (parts["symbols"] >> 1).astype(np.int64) - transforms.RESIDUAL_ZERO
    row_fix, col_fix = parts["row_fix"].astype(np.int64), parts["col_fix"].astype(np.int64)
    prediction = np.clip(row_fix[:, None] + col_fix[None, :] + 8, 0, 16383) >> 4
    inside = parts["symbols"] >= 2
    assert np.array_equal((residual + prediction.reshape(-1))[inside], log[inside].astype(np.int64))
    assert np.array_equal(parts["escapes"], log[~inside])


def test_scaled_codec_codes_the_sign_pattern_and_quarter_binades_smaller_than_factored():
    rows, cols = 512, 384
    words = scaled_inputs(rows, cols, 5)[-1]
    sizes = {codec.name: stored_bytes(codec, words, (rows, cols)) for codec in (codecs.Factored(), codecs.Scaled())}
    # The signs alone: 0.72 bits a float at 20% flipped instead of 1 (0.28 bits x 196,608 = 6.9 KB).
    assert sizes["scaled"] < sizes["factored"] - 6000, sizes
    assert isinstance(codecs.choose(words, None, "float32", np, True, (rows, cols)), codecs.Scaled)


def test_scaled_streams_that_do_not_fit_are_an_error_not_other_words():
    rows, cols = 64, 33
    words = scaled_inputs(rows, cols, 7)[0]  # special values: escapes
    parts = transforms.scaled_split(words, rows, cols)
    assert parts["escapes"].size > 0
    for name in ("kernels", "numpy"):
        with engine(name):
            with pytest.raises(ValueError, match="escapes"):
                transforms.scaled_join({**parts, "escapes": parts["escapes"][:-1]}, rows, cols)
            with pytest.raises(ValueError, match="escapes"):
                more = np.append(parts["escapes"], 1).astype(np.uint16)
                transforms.scaled_join({**parts, "escapes": more}, rows, cols)
            with pytest.raises(ValueError):
                transforms.scaled_join({**parts, "low": parts["low"][:-1]}, rows, cols)
    four = transforms.scaled_split(scaled_inputs(rows, cols, 7)[-1], rows, cols, 4)
    for name in ("kernels", "numpy"):
        with engine(name):
            with pytest.raises(ValueError, match="sign model"):
                transforms.scaled_join({**four, "col_factors": four["col_factors"][:, :-1]}, rows, cols)
            with pytest.raises(ValueError, match="sign model"):
                transforms.scaled_join({**four, "sign_rank": 9}, rows, cols)
    assert not codecs.Scaled.applies("float32", (transforms.SCALED_MAX + 1, 2))
    assert not codecs.Scaled.applies("bfloat16", (64, 33)) and not codecs.Scaled.applies("float32", (64,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_factored_codec_round_trips_bit_exactly(dtype):
    t = special_tensor(dtype, (300, 170), 5)
    t[7] = adam_second_moment(1, 170, 1).to(dtype)
    words, xp = tensor_words(t)
    codec = codecs.Factored()
    for name in ("kernels", "numpy"):
        with engine(name):
            streams, params = codec.encode(words, None, xp, shape=tuple(t.shape))
            back = codec.decode([np.ascontiguousarray(s).view(np.uint8) for s in streams], params, words.size,
                                words.dtype, None, np)
        assert np.array_equal(back, words), name
    with pytest.raises(ValueError, match="matrix without a base"):
        codec.encode(words, words, xp, shape=tuple(t.shape))


def test_adam_second_moment_is_coded_by_its_rows_and_columns(tmp_path):
    v = adam_second_moment(512, 384, 0)
    weights = torch.randn(512, 384) * 0.02  # no row or column structure: the model cannot help
    words = tensor_words(v)[0]
    assert isinstance(codecs.choose(words, None, "float32", np, True, tuple(v.shape)), codecs.Scaled)
    assert not isinstance(codecs.choose(tensor_words(weights)[0], None, "float32", np, False, tuple(weights.shape)),
                          codecs.Factored)
    flat = codecs.choose(words, None, "float32", np, True, (v.numel(),))
    assert not isinstance(flat, (codecs.Factored, codecs.Scaled))
    checkpoint.save(tmp_path / "c", {"optimizer": {"state": {0: {"exp_avg_sq": v}}}, "model": {"w": weights}})
    manifest = checkpoint.read_manifest(tmp_path / "c")
    entry = manifest["tensors"]["/optimizer/state/0/exp_avg_sq"]
    assert entry["codec"] == "scaled" and entry["params"] == {"columns": 384, "sign_rank": 1}  # no negative signs
    assert manifest["tensors"]["/model/w"]["codec"] != "factored"
    assert_bit_exact(v, checkpoint.load(tmp_path / "c")["optimizer"]["state"][0]["exp_avg_sq"])
    planes_bytes = stored_bytes(Planes(rotate=1), words, None)
    factored_bytes = stored_bytes(codecs.Factored(), words, tuple(v.shape))
    stored = sum(stream["stored"] for stream in entry["streams"])
    assert stored < factored_bytes < 0.97 * planes_bytes, (stored, factored_bytes, planes_bytes)


def test_a_sample_of_a_wide_matrix_does_not_weigh_its_column_model_as_the_whole_matrix(monkeypatch):
    """A sample of a 384 x 1536 matrix is 11 of its rows: the 1536 column fixes weigh 35 times
    more there than on the matrix. Counted as if they grew with the rows, the model was not
    chosen over planes though it stores 2% smaller (the GPT workload's exp_avg of
    mlp.2.weight)."""
    m = adam_second_moment(384, 1536, 3).sqrt() * torch.randn(384, 1536, generator=torch.Generator().manual_seed(4))
    words = tensor_words(m)[0]
    sizes = {codec.name: stored_bytes(codec, words, (384, 1536)) for codec in (Planes(rotate=1), codecs.Factored())}
    assert sizes["factored"] < 0.99 * sizes["planes"], sizes
    monkeypatch.setattr(codecs, "candidates", lambda *args: [Planes(rotate=1), codecs.Factored()])
    assert isinstance(codecs.choose(words, None, "float32", np, True, (384, 1536)), codecs.Factored)


def test_a_tensor_changed_everywhere_since_its_base_is_coded_alone(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(256, 384, generator=gen)
    base = {"model": {"w": weights}, "optimizer": {"state": {0: {"exp_avg_sq": adam_second_moment(256, 384, 1)}}}}
    checkpoint.save(tmp_path / "base", base)
    # The weights moved in their low bits (a delta pays); the moment is another one entirely.
    state = {"model": {"w": weights + 1e-6 * torch.randn(256, 384, generator=gen)},
             "optimizer": {"state": {0: {"exp_avg_sq": adam_second_moment(256, 384, 2)}}}}
    checkpoint.save(tmp_path / "c", state, base=tmp_path / "base")
    tensors = checkpoint.read_manifest(tmp_path / "c")["tensors"]
    assert tensors["/model/w"]["delta"] is True
    moment = tensors["/optimizer/state/0/exp_avg_sq"]
    assert moment["delta"] is False and moment["codec"] == "scaled"  # a codec only a tensor without a base can use
    back = checkpoint.load(tmp_path / "c")
    assert_bit_exact(state["model"]["w"], back["model"]["w"])
    assert_bit_exact(state["optimizer"]["state"][0]["exp_avg_sq"], back["optimizer"]["state"][0]["exp_avg_sq"])


def test_threads_write_the_same_bytes(tmp_path):
    state = adam_state(0)(3)
    one, blobs_one = checkpoint.encode(state, threads=1)
    two, blobs_two = checkpoint.encode(state, threads=2)
    assert b"".join(blobs_one) == b"".join(blobs_two) and one["checksum"] == two["checksum"]
    # The largest tensors are coded first; the manifest still lists them as the state does.
    assert list(one["tensors"]) == [f"/model/{k}" for k in state["model"]] + [
        f"/optimizer/state/{i}/{k}" for i, s in state["optimizer"]["state"].items() for k in s]
    for threads in (1, 2):
        assert_bit_exact(checkpoint.decode(two, blobs_two, threads=threads)["model"]["0.weight"],
                         state["model"]["0.weight"])
    checkpoint.save(tmp_path / "c", state, threads=2)
    assert_bit_exact(checkpoint.load(tmp_path / "c", threads=2)["optimizer"]["state"][0]["exp_avg"],
                     state["optimizer"]["state"][0]["exp_avg"])


def test_a_huffman_checkpoint_without_the_kernels_is_a_clear_error(tmp_path):
    checkpoint.save(tmp_path / "c", adam_state(0)(3))
    assert any(s["coding"] == "huffman" for e in checkpoint.inspect(tmp_path / "c")["tensors"] for s in
               checkpoint.read_manifest(tmp_path / "c")["tensors"][e["name"]]["streams"])
    with engine("numpy"), pytest.raises(CheckpointError, match="C kernels are not built"):
        checkpoint.load(tmp_path / "c")


def adam_state(steps: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 32), torch.randint(0, 10, (512,))

    def advance(n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict() | {"state": {i: {k: v.clone() for k, v in s.items()}
                                                           for i, s in opt.state_dict()["state"].items()}}}
    return advance


def test_unchanged_tensor_since_base_costs_under_1kb_and_deltas_restore(tmp_path):
    advance = adam_state(0)
    first = advance(5)
    checkpoint.save(tmp_path / "a", first)
    second = advance(1)
    second["frozen"] = torch.randn(300_000)
    first_with_frozen = dict(first, frozen=second["frozen"])
    checkpoint.save(tmp_path / "a2", first_with_frozen)
    checkpoint.save(tmp_path / "b", second, base=tmp_path / "a2")
    info = {row["name"]: row for row in checkpoint.inspect(tmp_path / "b")["tensors"]}
    assert info["/frozen"]["delta"] and info["/frozen"]["stored_bytes"] <= 1024, info["/frozen"]
    back = checkpoint.load(tmp_path / "b")
    for name, value in second["model"].items():
        assert_bit_exact(value, back["model"][name], name)
    assert_bit_exact(second["frozen"], back["frozen"])


def test_adam_checkpoint_compresses(tmp_path):
    state = adam_state(0)(20)
    checkpoint.save(tmp_path / "c", state)
    assert checkpoint.inspect(tmp_path / "c")["ratio"] > 1.1


def _saved(tmp_path):
    state = {"model": {"w": torch.randn(4096), "b": torch.randn(64)}, "optimizer": {"m": torch.randn(4096)}}
    checkpoint.save(tmp_path / "c", state)
    return tmp_path / "c", checkpoint.inspect(tmp_path / "c")


def test_a_flipped_byte_names_the_file_and_the_tensor(tmp_path):
    path, info = _saved(tmp_path)
    manifest = checkpoint.read_manifest(path)
    stream = manifest["tensors"]["/optimizer/m"]["streams"][0]
    data = bytearray((path / "tensors.bin").read_bytes())
    data[stream["offset"] + stream["stored"] // 2] ^= 0x10
    (path / "tensors.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensors\.bin: tensor '/optimizer/m'.*checksum"):
        checkpoint.load(path)
    result = CliRunner().invoke(app, ["checkpoint", "verify", str(path)])
    assert result.exit_code == 1 and "/optimizer/m" in result.output


def test_a_truncated_file_names_the_first_tensor_cut(tmp_path):
    path, info = _saved(tmp_path)
    manifest = checkpoint.read_manifest(path)
    cut = manifest["tensors"]["/optimizer/m"]["streams"][0]["offset"] + 1
    (path / "tensors.bin").write_bytes((path / "tensors.bin").read_bytes()[:cut])
    with pytest.raises(CheckpointError, match=r"tensors\.bin: .*truncated.*'/optimizer/m'"):
        checkpoint.load(path)
    # Two small biases are coded together, and named together.
    path = tmp_path / "biases"
    manifest = checkpoint.save(path, {"model": {"0.bias": torch.randn(4096), "1.bias": torch.randn(64)},
                                      "optimizer": {"m": torch.randn(4096)}})
    pack = manifest["tensors"]["/model/1.bias"]["pack"][0]
    cut = manifest["packs"][pack]["streams"][-1]["offset"] + 1
    (path / "tensors.bin").write_bytes((path / "tensors.bin").read_bytes()[:cut])
    with pytest.raises(CheckpointError,
                       match=r"tensors\.bin: .*truncated.*tensors '/model/0\.bias', '/model/1\.bias' \(coded together\)"):
        checkpoint.load(path)


def test_a_missing_or_changed_base_is_refused(tmp_path):
    checkpoint.save(tmp_path / "a", {"w": torch.randn(1000)})
    checkpoint.save(tmp_path / "b", {"w": torch.randn(1000)}, base=tmp_path / "a")
    checkpoint.save(tmp_path / "a", {"w": torch.randn(1000)})  # rewritten: not the base b was made against
    with pytest.raises(CheckpointError, match="delta was made against"):
        checkpoint.load(tmp_path / "b")
    import shutil

    shutil.rmtree(tmp_path / "a")
    with pytest.raises(CheckpointError, match="base checkpoint .* is missing"):
        checkpoint.load(tmp_path / "b")


def test_cli_inspect_and_decompress(tmp_path):
    path, info = _saved(tmp_path)
    runner = CliRunner()
    shown = runner.invoke(app, ["checkpoint", "inspect", str(path), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["stored_bytes"] == info["stored_bytes"]
    out = tmp_path / "state.pt"
    done = runner.invoke(app, ["checkpoint", "decompress", str(path), "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert torch.equal(torch.load(out)["model"]["w"], checkpoint.load(path)["model"]["w"])
    ok = runner.invoke(app, ["checkpoint", "verify", str(path)])
    assert ok.exit_code == 0 and "restore exactly" in ok.output


def test_delta_chain_survives_ray_rotation_and_restarts(tmp_path):
    import shutil

    from rayzip.checkpoint import DeltaChain

    advance = adam_state(0)
    chain = DeltaChain(tmp_path / "bases", full_every=3, keep=2)
    reported = []  # what Ray would hold: the last num_to_keep=2 checkpoint directories
    states = {}
    for index in range(8):
        state = advance(2)
        target = tmp_path / f"checkpoint_{index:03d}"
        chain.history = chain.save(target, state, index, chain.history)
        states[target] = state
        reported.append(target)
        while len(reported) > 2:
            shutil.rmtree(reported.pop(0))  # Ray's rotation
    # Bases of the last keep + 1 checkpoints: the newest is not registered with Ray yet.
    assert sorted(p.name for p in (tmp_path / "bases").iterdir()) == sorted(set(chain.history[-3:]))
    assert chain.history == ["base-000000"] * 3 + ["base-000003"] * 3 + ["base-000006"] * 2
    for target in reported:  # every checkpoint Ray kept restores bit-exactly
        back = checkpoint.load(target)
        for name, value in states[target]["model"].items():
            assert_bit_exact(value, back["model"][name], name)
        assert back["chain"] == chain.history[: int(target.name[-3:]) + 1]
        weights = [r for r in checkpoint.inspect(target)["tensors"] if r["name"].startswith("/model/")]
        assert all(r["delta"] for r in weights)
    # A restart from the last checkpoint continues the chain from the history it stored.
    resumed = DeltaChain(tmp_path / "bases", full_every=3, keep=2)
    resumed.history = checkpoint.load(reported[-1])["chain"]
    resumed.history = resumed.save(tmp_path / "checkpoint_008", advance(1), 8, resumed.history)
    assert resumed.history[-1] == "base-000006"
    checkpoint.verify(tmp_path / "checkpoint_008")


def test_delta_chain_keeps_the_registered_checkpoints_base_until_a_newer_one_is_registered(tmp_path):
    # num_to_keep 1, a new base every checkpoint: saving checkpoint 1 must not delete the base
    # of checkpoint 0, which is still the registered one until Ray registers checkpoint 1.
    import shutil

    from rayzip.checkpoint import DeltaChain

    advance = adam_state(1)
    chain = DeltaChain(tmp_path / "bases", full_every=1, keep=1)
    first, second = advance(2), advance(2)
    chain.history = chain.save(tmp_path / "checkpoint_000", first, 0, chain.history)
    chain.history = chain.save(tmp_path / "checkpoint_001", second, 1, chain.history)
    # The worker dies here, before Ray registered checkpoint_001: the job resumes from 000.
    back = checkpoint.load(tmp_path / "checkpoint_000")
    for name, value in first["model"].items():
        assert_bit_exact(value, back["model"][name], name)
    # Once 001 is registered, Ray deletes 000, and the next save collects 000's base.
    shutil.rmtree(tmp_path / "checkpoint_000")
    chain.history = chain.save(tmp_path / "checkpoint_002", advance(1), 2, chain.history)
    assert sorted(p.name for p in (tmp_path / "bases").iterdir()) == ["base-000001", "base-000002"]
    checkpoint.verify(tmp_path / "checkpoint_001")


def test_hundreds_of_small_tensors_round_trip_in_batches_each_with_its_own_entry(tmp_path, monkeypatch):
    """Biases and norms are coded a batch per task, not a task each (issue 21)."""
    from rayzip.checkpoint import crew

    submitted = []
    original = crew._Helpers.submit

    def counting(self, owner, fn, *args):
        submitted.append(fn)
        return original(self, owner, fn, *args)

    monkeypatch.setattr(crew._Helpers, "submit", counting)
    gen = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.{kind}": torch.randn(384, generator=gen) for i in range(150)
                       for kind in ("weight", "bias")},
             "big": torch.randn(1 << 18, generator=gen)}
    checkpoint.save(tmp_path / "c", state, threads=2)
    manifest = checkpoint.read_manifest(tmp_path / "c")
    assert len(manifest["tensors"]) == 301
    # 300 small tensors: a handful of batch tasks, not 300 (plus the big one's own tasks).
    assert len(submitted) < 30, len(submitted)
    submitted.clear()
    back = checkpoint.load(tmp_path / "c", threads=2)
    assert len(submitted) < 30, len(submitted)
    for name, value in state["model"].items():
        assert torch.equal(back["model"][name].view(torch.int32), value.view(torch.int32))
    assert torch.equal(back["big"], state["big"])


def test_a_family_of_layers_is_planned_once(tmp_path, monkeypatch):
    """The trial encodings that pick a codec run for the largest tensor of a family (same
    dtype, delta or not, weights or optimizer state, last name part) and serve the rest."""
    from rayzip.checkpoint import store

    calls = []
    original = store.choose

    def counting(words, base, dtype, xp, optimizer_state=False, shape=None):
        calls.append(words.size)
        return original(words, base, dtype, xp, optimizer_state, shape)

    monkeypatch.setattr(store, "choose", counting)
    gen = torch.Generator().manual_seed(0)
    # Above the small-tensor size, so that each is coded alone (small ones are packed).
    state = {"model": {f"blocks.{i}.mlp.weight": torch.randn(70_000 + i, generator=gen) for i in range(6)},
             "optimizer": {i: {"exp_avg": torch.randn(70_000 + i, generator=gen) * 1e-3} for i in range(6)}}
    checkpoint.save(tmp_path / "c", state, threads=1)
    assert sorted(calls) == [70_005, 70_005]  # one per family: the largest of each
    back = checkpoint.load(tmp_path / "c")
    for i in range(6):
        assert torch.equal(back["model"][f"blocks.{i}.mlp.weight"], state["model"][f"blocks.{i}.mlp.weight"])
        assert torch.equal(back["optimizer"][i]["exp_avg"], state["optimizer"][i]["exp_avg"])


def _many_small_tensors():
    gen = torch.Generator().manual_seed(0)
    model = {}
    for i in range(40):
        model[f"blocks.{i}.ln.weight"] = 1 + 0.01 * torch.randn(384, generator=gen)
        model[f"blocks.{i}.ln.bias"] = 0.01 * torch.randn(384, generator=gen)
    model["embed.weight"] = torch.randn(100_000, generator=gen)  # above the small-tensor size: coded alone
    optimizer = {i: {"step": torch.tensor(7.0), "exp_avg": 1e-3 * torch.randn(384, generator=gen)} for i in range(40)}
    return {"model": model, "optimizer": optimizer}


def test_small_tensors_are_coded_together_each_restored_and_named_exactly(tmp_path):
    state = _many_small_tensors()
    manifest = checkpoint.save(tmp_path / "c", state)
    # Weights and optimizer state are packed apart, and by family (the layer norms' weights
    # apart from their biases); the large tensor has its own streams.
    families = sorted(sorted({name.rsplit(".", 1)[-1].rsplit("/", 1)[-1] for name in pack["members"]})
                      for pack in manifest["packs"])
    assert families == [["bias"], ["exp_avg"], ["step"], ["weight"]], families
    small = {name: e for name, e in manifest["tensors"].items() if name != "/model/embed.weight"}
    assert all(e["codec"] == "packed" and not e["streams"] for e in small.values())
    assert manifest["tensors"]["/model/embed.weight"]["streams"]
    streams = sum(len(e["streams"]) for e in [*manifest["tensors"].values(), *manifest["packs"]])
    assert streams <= 4 * (len(manifest["packs"]) + 1), streams  # 160 small tensors: 4 streams a pack, not 4 each
    back = checkpoint.load(tmp_path / "c")
    for name, value in state["model"].items():
        assert_bit_exact(value, back["model"][name], name)
    for i, moments in state["optimizer"].items():
        for key, value in moments.items():
            assert_bit_exact(value, back["optimizer"][i][key], f"{i}/{key}")
    info = checkpoint.inspect(tmp_path / "c")
    assert abs(sum(r["stored_bytes"] for r in info["tensors"]) - info["stored_bytes"]) <= len(info["tensors"])
    # A damaged byte in a pack names its tensors.
    pack = manifest["packs"][manifest["tensors"]["/model/blocks.0.ln.bias"]["pack"][0]]
    stream = max(pack["streams"], key=lambda s: s["stored"])
    data = bytearray((tmp_path / "c" / "tensors.bin").read_bytes())
    data[stream["offset"] + stream["stored"] // 2] ^= 0x04
    (tmp_path / "c" / "tensors.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensors\.bin: tensors '/model/blocks\.0\.ln\.bias', "
                                              r"'/model/blocks\.1\.ln\.bias', .* and 37 more \(coded together\): .*checksum"):
        checkpoint.load(tmp_path / "c")


def test_small_tensors_alone_in_their_family_are_packed_with_their_own_kind_of_state(tmp_path):
    """The output layer's small moment matrices are each alone in their family (the other
    matrices are large): each joins the vectors of its own moment, never the other moment
    (the MLP's were packed together and stored 6 KB larger than apart)."""
    gen = torch.Generator().manual_seed(5)
    optimizer = {0: {"exp_avg": 1e-3 * torch.randn(512, 512, generator=gen),
                     "exp_avg_sq": 1e-7 * torch.rand(512, 512, generator=gen)},
                 1: {"exp_avg": 1e-3 * torch.randn(10, 512, generator=gen),
                     "exp_avg_sq": 1e-7 * torch.rand(10, 512, generator=gen)},
                 2: {"exp_avg": 1e-3 * torch.randn(512, generator=gen),
                     "exp_avg_sq": 1e-7 * torch.rand(512, generator=gen)}}
    state = {"optimizer": optimizer}
    manifest = checkpoint.save(tmp_path / "c", state)
    members = sorted(sorted(pack["members"]) for pack in manifest["packs"])
    assert members == [["/optimizer/1/exp_avg", "/optimizer/2/exp_avg"],
                       ["/optimizer/1/exp_avg_sq", "/optimizer/2/exp_avg_sq"]], members
    back = checkpoint.load(tmp_path / "c")
    for i, moments in optimizer.items():
        for key, value in moments.items():
            assert_bit_exact(value, back["optimizer"][i][key], f"{i}/{key}")


def test_small_tensors_as_deltas_against_a_base_restore(tmp_path):
    state = _many_small_tensors()
    checkpoint.save(tmp_path / "a", state)
    later = {"model": {k: v + 1e-4 if "bias" in k else v for k, v in state["model"].items()},
             "optimizer": state["optimizer"]}
    manifest = checkpoint.save(tmp_path / "b", later, base=tmp_path / "a")
    assert all(p["delta"] for p in manifest["packs"])
    back = checkpoint.load(tmp_path / "b")
    for name, value in later["model"].items():
        assert_bit_exact(value, back["model"][name], name)


def test_a_version_2_checkpoint_without_packs_still_loads(tmp_path, monkeypatch):
    from rayzip.checkpoint import store

    state = _many_small_tensors()
    monkeypatch.setattr(store, "PACK_BYTES", 0)  # every tensor coded alone, as version 2 did
    manifest = checkpoint.save(tmp_path / "c", state)
    assert not manifest["packs"]
    del manifest["packs"]
    manifest["version"] = 2
    write_manifest(tmp_path / "c", manifest)
    back = checkpoint.load(tmp_path / "c")
    assert_bit_exact(state["model"]["blocks.3.ln.bias"], back["model"]["blocks.3.ln.bias"])
    assert checkpoint.verify(tmp_path / "c")["tensors"] == 161


def test_the_manifest_is_compressed_and_version_4_plain_manifests_still_load(tmp_path):
    state = _many_small_tensors()
    manifest = checkpoint.save(tmp_path / "c", state)
    stored = (tmp_path / "c" / "manifest.json.zst").read_bytes()
    plain = json.dumps(manifest, separators=(",", ":")).encode()
    assert not (tmp_path / "c" / "manifest.json").exists() and len(stored) < len(plain) / 4
    assert checkpoint.read_manifest(tmp_path / "c") == manifest
    # A version-4 checkpoint: the same tensors.bin, its manifest plain JSON.
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({**manifest, "version": 4}))
    (tmp_path / "c" / "manifest.json.zst").unlink()
    back = checkpoint.load(tmp_path / "c")
    for name, value in state["model"].items():
        assert_bit_exact(value, back["model"][name], name)
    # Saving over it leaves only the new manifest.
    checkpoint.save(tmp_path / "c", state)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["manifest.json.zst", "tensors.bin"]


def test_a_damaged_manifest_names_its_file(tmp_path):
    checkpoint.save(tmp_path / "c", {"w": torch.randn(1000)})
    path = tmp_path / "c" / "manifest.json.zst"
    stored = bytearray(path.read_bytes())
    for damaged in (stored[: len(stored) // 2], b"{}", stored[:4] + b"\x00" * (len(stored) - 4)):
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError, match=r"manifest\.json\.zst: (manifest cannot be decompressed|not a)"):
            checkpoint.load(tmp_path / "c")


def test_a_save_on_two_threads_finishes_while_its_helper_is_held_elsewhere(tmp_path):
    """The calling thread runs its queued calls itself while it waits: a helper that is
    asleep, slow to wake or busy with another checkpoint never holds a save up. It does not
    run another checkpoint's calls (which could be long: here, one that never ends)."""
    import threading
    import time

    from rayzip.checkpoint import crew

    release = threading.Event()
    other = crew.Crew(2)  # another checkpoint's, on the same helper
    blocker, queued = other.submit(release.wait), other.submit(release.wait)
    while not blocker.running():
        time.sleep(0.001)
    state = _many_small_tensors()
    state["model"]["large"] = torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))
    done = {}

    def round_trip():
        manifest, blobs = checkpoint.encode(state, threads=2)
        done["back"] = checkpoint.decode(manifest, blobs, threads=2)

    worker = threading.Thread(target=round_trip, daemon=True)
    try:
        worker.start()
        worker.join(timeout=60)
        assert "back" in done, "a two-thread save waited for its held helper, or ran the other's call"
        assert not blocker.done() and not queued.running()
    finally:
        release.set()
        blocker.result(timeout=10)
        queued.result(timeout=10)
    for name, value in state["model"].items():
        assert_bit_exact(value, done["back"]["model"][name], name)


def test_a_helper_keeps_nothing_of_a_call_it_has_run():
    """A helper drops a call's arguments and result once it has run it. Kept until its next
    call, they were freed at the start of the next checkpoint (on the helper, holding the
    GIL: the caller waited 3 to 8 ms for a load's 42 MB input to be unmapped) and stayed in
    memory meanwhile."""
    import threading
    import time
    import weakref

    from rayzip.checkpoint import crew

    class Payload:
        pass

    argument, ran = Payload(), threading.Event()

    def call(payload):
        ran.set()
        return Payload()

    with crew.Crew(2) as pool:
        future = pool.submit(call, argument)
        assert ran.wait(timeout=10)
        result = future.result(timeout=10)  # not pool.result: this thread must not run it itself
    arguments_left, results_left = weakref.ref(argument), weakref.ref(result)
    del argument, result, future, pool
    deadline = time.monotonic() + 10
    while (arguments_left() is not None or results_left() is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arguments_left() is None, "the helper still holds the call's argument"
    assert results_left() is None, "the helper still holds the call's result"


def test_a_family_takes_its_largest_tensors_codec_whichever_thread_arrives_first(tmp_path, monkeypatch):
    """The bytes do not depend on the thread count: the family's codec is chosen on its
    largest member even when another member's thread reaches the choice first."""
    import time

    from rayzip.checkpoint import store

    gen = torch.Generator().manual_seed(3)
    rows, cols = torch.rand(700, 1, generator=gen) * 12 - 14, torch.rand(1, 400, generator=gen) * 12
    structured = torch.exp2(rows + cols) * (1 + 0.1 * torch.rand(700, 400, generator=gen))  # a row and a column factor
    plain = torch.exp2(torch.randn(600, 400, generator=gen) * 3 - 10)  # no structure by row or column
    state = {"optimizer": {0: {"exp_avg_sq": structured}, 1: {"exp_avg_sq": plain}}}
    chosen = {t.numel(): type(store.choose_for(tensor_words(t)[0], None, "float32", np, True, tuple(t.shape))[0]).__name__
              for t in (structured, plain)}
    assert chosen[structured.numel()] != chosen[plain.numel()], chosen  # else the test shows nothing
    one, blobs_one = checkpoint.encode(state, threads=1)
    original = store.tensor_words

    def slow_for_the_largest(tensor):
        if tensor.numel() == structured.numel():
            time.sleep(0.3)  # the other member's thread gets to the family's choice first
        return original(tensor)

    monkeypatch.setattr(store, "tensor_words", slow_for_the_largest)
    two, blobs_two = checkpoint.encode(state, threads=2)
    assert [e["codec"] for e in two["tensors"].values()] == [e["codec"] for e in one["tensors"].values()]
    assert b"".join(bytes(b) for b in blobs_two) == b"".join(bytes(b) for b in blobs_one)
