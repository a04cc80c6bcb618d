"""Codec layer: round trips, exact wire sizes, error feedback, edge cases (issue 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayzip.codecs import CODECS, CodecError, ErrorFeedback, MomentumCorrection, NoMemory, NonFiniteError, get_codec
from rayzip.codecs.bitpack import pack_bits, unpack_bits
from rayzip.codecs.dct_quant import wire_order, zigzag_order
from rayzip.codecs.randomk import random_indices

LOSSY = {
    "fp16": {},
    "bf16": {},
    "topk": {"density": 0.05},
    "randomk": {"density": 0.05, "seed": 3},
    "group_topk": {"density": 0.05, "group_size": 256},
    "qsgd": {"levels": 31},
    "dct_quant": {"bits": 4, "keep": 1.0},
}
ALL = {"none": {}, **LOSSY}
SIZES = [0, 1, 7, 63, 64, 65, 255, 256, 1023, 1024, 1025, 4096, 10_007]


def gaussian(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def rel_error(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def kept(density: float, size: int) -> int:
    return 0 if size == 0 else min(size, max(1, math.ceil(density * size - 1e-9)))


# Independent statements of each codec's documented wire size.
def documented_nbytes(name: str, params: dict, n: int) -> int:
    if name == "none":
        return 4 * n
    if name in ("fp16", "bf16"):
        return 2 * n
    if name == "topk":
        index_bytes = 2 if n <= 65536 else 4
        return kept(params["density"], n) * (index_bytes + 4)
    if name == "randomk":
        return 8 + 4 * kept(params["density"], n)
    if name == "group_topk":
        g = params["group_size"]
        count = (n // g) * kept(params["density"], g) + kept(params["density"], n % g)
        value_bytes = 2 if params.get("value_dtype", "fp16") == "fp16" else 4
        return count * (2 + value_bytes)
    if name == "qsgd":
        bits = math.ceil(math.log2(2 * params["levels"] + 1))
        return 4 * math.ceil(n / 512) + math.ceil(n * bits / 8)
    if name == "dct_quant":
        blocks, tail = divmod(n, 64)
        m = math.ceil(params["keep"] * 64)
        return 4 * blocks + math.ceil(blocks * m * params["bits"] / 8) + 4 * tail
    raise AssertionError(name)


# --- exact wire format ---------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("n", SIZES)
def test_payload_bytes_equal_documented_formula(name, n):
    codec = get_codec(name, **ALL[name])
    payload = codec.encode(gaussian(n, seed=n))
    wire = payload.to_bytes()
    expected = documented_nbytes(name, ALL[name], n)
    assert payload.nbytes == len(wire) == codec.wire_nbytes(n) == expected


@pytest.mark.parametrize("name", sorted(ALL))
def test_round_trip_through_wire_bytes_decodes_identically(name):
    codec = get_codec(name, **ALL[name])
    x = gaussian(5000)
    payload = codec.encode(x)
    rebuilt = codec.from_bytes(payload.to_bytes(), like=payload)
    assert np.array_equal(codec.decode(payload), codec.decode(rebuilt))


def test_from_bytes_rejects_a_payload_of_the_wrong_size():
    codec = get_codec("group_topk")
    payload = codec.encode(gaussian(4096))
    with pytest.raises(CodecError, match="bytes"):
        codec.from_bytes(payload.to_bytes()[:-1], like=payload)


COMPACT = [{"value_dtype": "int8", "packed_indices": True}, {"value_dtype": "int8"},
           {"value_dtype": "fp16", "packed_indices": True}]


@pytest.mark.parametrize("options", COMPACT)
@pytest.mark.parametrize("n", SIZES)
def test_compact_group_topk_bytes_equal_documented_formula(options, n):
    group, density = 256, 0.05
    codec = get_codec("group_topk", density=density, group_size=group, **options)
    payload = codec.encode(gaussian(n, seed=n))
    full, tail = divmod(n, group)
    count = full * kept(density, group) + kept(density, tail)
    index_bytes = math.ceil(count * 8 / 8) if options.get("packed_indices") else 2 * count  # G = 256: 8 bits
    value_bytes = 4 * (full + (tail > 0)) + count if options["value_dtype"] == "int8" else 2 * count
    assert payload.nbytes == len(payload.to_bytes()) == codec.wire_nbytes(n) == index_bytes + value_bytes


@pytest.mark.parametrize("options", COMPACT)
@pytest.mark.parametrize("n,group", [(10_240, 1024), (10_007, 1000), (50, 64)])
def test_compact_group_topk_keeps_the_same_entries_each_within_half_its_groups_step(options, n, group):
    x = gaussian(n, seed=n) * np.linspace(0.01, 10, n, dtype=np.float32)  # groups of unlike scales
    plain = get_codec("group_topk", density=0.03, group_size=group, value_dtype="fp32")
    compact = get_codec("group_topk", density=0.03, group_size=group, **options)
    payload = compact.encode(x)
    indices, values = compact.to_coo(compact.from_bytes(payload.to_bytes(), like=payload))
    expected_indices, expected = plain.to_coo(plain.encode(x))
    assert np.array_equal(indices, expected_indices)
    if options["value_dtype"] == "int8":
        # An entry's step is its group's scale: the group's largest magnitude (kept) / 127.
        step = np.array([np.abs(x[(i // group) * group:(i // group + 1) * group]).max() / 127 for i in indices])
        assert np.all(np.abs(values - expected) <= step / 2 * (1 + 1e-5))
    else:
        np.testing.assert_array_equal(values, expected.astype(np.float16).astype(np.float32))
    # Error feedback keeps what the wire lost: the residual is the input less the decoded payload.
    residual = compact.residual(x.copy(), payload)
    np.testing.assert_array_equal(residual, x - compact.decode(payload))


def test_compact_group_topk_at_two_percent_is_80x_and_sends_an_all_zero_group_as_zeros():
    codec = get_codec("group_topk", density=0.02, group_size=1024, value_dtype="int8", packed_indices=True)
    x = gaussian(1 << 20)
    x[:1024] = 0.0
    payload = codec.encode(x)
    assert 4 * x.size / payload.nbytes >= 79
    assert payload.arrays["scales"][0] == 0 and not codec.decode(payload)[:1024].any()


def test_group_topk_at_one_percent_compresses_more_than_50x():
    codec = get_codec("group_topk", density=0.01, group_size=1024, value_dtype="fp16")
    payload = codec.encode(gaussian(1 << 20))
    assert payload.arrays["indices"].dtype == np.uint16
    assert payload.arrays["values"].dtype == np.float16
    assert 4 * (1 << 20) / payload.nbytes >= 50


@pytest.mark.parametrize("n", [1000, 70_000])
def test_index_width_is_the_narrowest_that_holds_an_offset(n):
    topk = get_codec("topk", density=0.1).encode(gaussian(n))
    assert topk.arrays["indices"].dtype == (np.uint16 if n <= 65536 else np.uint32)
    big_groups = get_codec("group_topk", density=0.1, group_size=70_000).encode(gaussian(n))
    assert big_groups.arrays["indices"].dtype == np.uint32


# --- round-trip accuracy -------------------------------------------------------------

def test_none_is_bit_exact_including_signed_zero_and_denormals():
    x = gaussian(1000)
    x[:4] = [-0.0, 1e-42, -1e-45, np.finfo(np.float32).max]
    out = get_codec("none").decode(get_codec("none").encode(x))
    assert out.tobytes() == x.tobytes()
    t = torch.from_numpy(x).reshape(10, 100)
    assert torch.equal(get_codec("none").decode(get_codec("none").encode(t)), t)


def _dct_reference(x: np.ndarray, n: int, bits: int, keep: float) -> tuple[np.ndarray, np.ndarray]:
    """scipy-based DCT quantizer: (kept coefficients per block, decoded signal)."""
    size = n * n
    blocks = x[: (x.size // size) * size].reshape(-1, n, n).astype(np.float64)
    m = max(1, math.ceil(keep * size - 1e-9))
    zz = zigzag_order(n)[:m] if m < size else np.arange(size)  # all kept: row-major on the wire
    coef = scipy.fft.dctn(blocks, axes=(1, 2), norm="ortho").reshape(-1, size)[:, zz]
    top = 2**bits - 1
    peak = np.abs(coef).max(axis=1, keepdims=True)
    codes = np.clip(np.rint((coef / np.where(peak > 0, peak, 1) + 1) * top / 2), 0, top)
    deq = np.zeros((coef.shape[0], size))
    deq[:, zz] = (codes * 2 / top - 1) * peak
    decoded = scipy.fft.idctn(deq.reshape(-1, n, n), axes=(1, 2), norm="ortho").reshape(-1)
    return coef, np.concatenate([decoded, x[blocks.size:]])


@pytest.mark.parametrize("n,bits,keep", [(8, 8, 1.0), (4, 6, 1.0), (8, 4, 0.25), (5, 12, 0.6)])
def test_dct_quant_matches_scipy_reference(n, bits, keep):
    x = gaussian(n * n * 300 + 7)
    codec = get_codec("dct_quant", block=n, bits=bits, keep=keep)
    ref_coef, ref_out = _dct_reference(x, n, bits, keep)
    np.testing.assert_allclose(codec.coefficients(x, np), ref_coef, atol=2e-5)
    out = codec.decode(codec.encode(x))
    # Float32 vs float64 transforms may round a code the other way at a tie: one step at most.
    step = 2 * np.abs(ref_coef).max() / (2**bits - 1)
    assert np.max(np.abs(out - ref_out)) <= 1.01 * step
    assert np.array_equal(out[-7:], x[-7:])  # the tail travels raw


def test_dct_quant_8_bits_full_keep_error_below_one_percent():
    x = gaussian(1 << 18)
    codec = get_codec("dct_quant", block=8, bits=8, keep=1.0)
    assert rel_error(codec.decode(codec.encode(x)), x) < 0.01


def test_zigzag_order_is_jpegs():
    assert zigzag_order(4).tolist() == [0, 1, 4, 8, 5, 2, 3, 6, 9, 12, 13, 10, 7, 11, 14, 15]
    assert wire_order(4, 6).tolist() == [0, 1, 4, 8, 5, 2]  # a cut keeps the low frequencies
    assert wire_order(4, 16).tolist() == list(range(16))  # nothing cut: row-major, no permutation


@pytest.mark.parametrize("n,group", [(10_240, 1024), (10_000, 1024), (999, 100), (50, 64)])
def test_group_topk_keeps_exactly_the_per_group_topk(n, group):
    density = 0.03
    x = gaussian(n, seed=n)
    codec = get_codec("group_topk", density=density, group_size=group, value_dtype="fp32")
    out = codec.decode(codec.encode(x))
    t = torch.from_numpy(x)
    for start in range(0, n, group):
        chunk = t[start:start + group]
        k = max(1, math.ceil(density * chunk.numel()))
        expected = torch.zeros_like(chunk)
        idx = torch.topk(chunk.abs(), k).indices
        expected[idx] = chunk[idx]
        assert torch.equal(torch.from_numpy(out[start:start + group]), expected), start


def test_group_topk_on_ties_keeps_k_of_the_largest_magnitudes():
    x = np.array([3, -3, 3, 1, 0, 2, -3, 1], dtype=np.float32)  # four entries of |3|
    codec = get_codec("group_topk", density=0.25, group_size=8, value_dtype="fp32")
    out = codec.decode(codec.encode(x))
    kept_idx = np.flatnonzero(out)
    assert len(kept_idx) == 2
    assert np.all(np.abs(x[kept_idx]) == 3) and np.array_equal(out[kept_idx], x[kept_idx])


def test_group_topk_mixes_tied_and_untied_groups():
    # Group 1 is all zeros and group 3 has five entries tied at the top: both take the slow
    # path, the rest the partition threshold; every group must still keep k of its largest.
    x = gaussian(8 * 64, seed=3).reshape(8, 64)
    x[1] = 0.0
    x[3, :5] = 9.0
    codec = get_codec("group_topk", density=4 / 64, group_size=64, value_dtype="fp32")
    payload = codec.encode(x.reshape(-1))
    offsets = payload.arrays["indices"].reshape(8, 4).astype(np.int64)
    for g in range(8):
        assert np.all(np.diff(offsets[g]) > 0), g
        kth = np.sort(np.abs(x[g]))[-4]
        assert np.all(np.abs(x[g, offsets[g]]) >= kth), g
    assert np.all(x[3, offsets[3]] == 9.0)


def test_topk_keeps_the_global_largest():
    x = gaussian(5000)
    out = get_codec("topk", density=0.01).decode(get_codec("topk", density=0.01).encode(x))
    idx = torch.topk(torch.from_numpy(np.abs(x)), 50).indices.numpy()
    assert sorted(np.flatnonzero(out)) == sorted(idx)
    assert np.array_equal(out[idx], x[idx])


def test_randomk_indices_are_distinct_seeded_and_regenerated_from_the_payload():
    idx = random_indices(12345, 10_000, 100, np)
    assert len(np.unique(idx)) == 100 and idx.min() >= 0 and idx.max() < 10_000
    assert np.array_equal(idx, random_indices(12345, 10_000, 100, np))
    assert not np.array_equal(idx, random_indices(12346, 10_000, 100, np))
    a, b = get_codec("randomk", density=0.01, seed=9), get_codec("randomk", density=0.01, seed=9)
    x = gaussian(10_000)
    pa, pb = a.encode(x), b.encode(x * 2)
    ia, _ = a.to_coo(pa)
    ib, _ = b.to_coo(b.from_bytes(pb.to_bytes(), like=pb))
    assert np.array_equal(ia, ib)  # same seed, same call: same indices on both workers
    assert np.array_equal(a.decode(pa)[ia], x[ia])
    assert not np.array_equal(ia, a.to_coo(a.encode(x))[0])  # the next call draws anew


def test_randomk_covers_the_tensor_uniformly():
    hits = np.zeros(1000)
    for seed in range(2000):
        hits[random_indices(seed, 1000, 10, np)] += 1
    assert hits.min() > 0
    assert abs(hits.mean() - 20) < 1e-9 and hits.std() < 6  # binomial(2000, 0.01) has std 4.4


def test_qsgd_is_unbiased_and_bounded():
    x = gaussian(2048)
    codec = get_codec("qsgd", levels=3, bucket_size=256)
    mean = np.mean([codec.decode(codec.encode(x)) for _ in range(400)], axis=0)
    assert rel_error(mean, x) < 0.1
    single = codec.decode(codec.encode(x))
    assert rel_error(single, x) > 0.2  # stochastic rounding really happened
    assert len(np.unique(np.round(single[:256] / np.abs(single[:256]).max() * 3))) <= 7


def _reference(name: str, x: np.ndarray) -> np.ndarray:
    """What decoding each deterministic codec's payload gives, computed here without it."""
    if name == "none":
        return x
    if name == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if name == "bf16":
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    out = np.zeros_like(x)
    if name == "topk":  # fp32 values of the k largest magnitudes
        top = np.argsort(-np.abs(x), kind="stable")[:kept(0.05, x.size)]
        out[top] = x[top]
        return out
    if name == "group_topk":  # fp16 values of each group's largest magnitudes
        for lo in range(0, x.size, 256):
            group = x[lo:lo + 256]
            top = lo + np.argsort(-np.abs(group), kind="stable")[:kept(0.05, group.size)]
            out[top] = x[top].astype(np.float16).astype(np.float32)
        return out
    raise KeyError(name)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "topk", "group_topk"])
def test_deterministic_codecs_decode_to_an_independent_reference_bit_for_bit(name):
    x = gaussian(20_000)
    codec = get_codec(name, **ALL[name])
    out = codec.decode(codec.encode(x))
    assert np.array_equal(out.view(np.uint32), _reference(name, x).view(np.uint32))
    if name == "topk":  # the error a sparsifier must have: what it left out, from a sort
        energy = np.sort(x.astype(np.float64) ** 2)[::-1]
        left_out = math.sqrt(energy[kept(0.05, x.size):].sum() / energy.sum())
        assert rel_error(out, x) == pytest.approx(left_out, rel=1e-6)


def test_randomk_sends_one_exact_value_from_each_stratum():
    x = gaussian(20_000)
    k = kept(0.05, x.size)
    out = get_codec("randomk", **ALL["randomk"]).decode(get_codec("randomk", **ALL["randomk"]).encode(x))
    sent = np.flatnonzero(out)
    assert sent.size == k and np.array_equal(out[sent], x[sent])
    bounds = np.arange(k + 1) * x.size // k
    assert np.array_equal(np.searchsorted(bounds, sent, side="right") - 1, np.arange(k))  # one per stratum


def test_qsgd_rounds_every_entry_to_a_neighbouring_level_of_its_bucket():
    x = gaussian(20_000)
    levels, bucket = ALL["qsgd"]["levels"], 512  # the codec's default bucket
    codec = get_codec("qsgd", **ALL["qsgd"])
    out = codec.decode(codec.encode(x))
    for lo in range(0, x.size, bucket):
        norm = float(np.linalg.norm(x[lo:lo + bucket].astype(np.float64)))
        scaled_in, scaled_out = x[lo:lo + bucket] / norm * levels, out[lo:lo + bucket] / norm * levels
        # Each entry lands on floor or ceil of its scaled magnitude, with its own sign.
        assert np.allclose(scaled_out, np.round(scaled_out), atol=1e-3)
        assert np.all(np.abs(scaled_out - scaled_in) <= 1 + 1e-3)
        assert np.all((np.sign(scaled_out) == np.sign(scaled_in)) | (scaled_out == 0))


def test_dct_quant_errs_by_at_most_half_a_step_per_coefficient():
    x = gaussian(20_000)
    codec = get_codec("dct_quant", **ALL["dct_quant"])
    payload = codec.encode(x)
    out = codec.decode(payload)
    body = x.size // 64 * 64
    half_steps = payload.arrays["scales"].astype(np.float64) / (2 ** ALL["dct_quant"]["bits"] - 1)
    bound = math.sqrt(64 * float((half_steps**2).sum()))  # orthonormal: coefficient error = output error
    error = float(np.linalg.norm(out[:body].astype(np.float64) - x[:body]))
    assert 0 < error <= bound * 1.001 and np.array_equal(out[body:], x[body:])


# --- error feedback ------------------------------------------------------------------

def _drift(name: str, memory: ErrorFeedback, steps: int) -> float:
    codec = get_codec(name, **LOSSY[name])
    x = gaussian(4096, seed=1)
    total = np.zeros_like(x)
    worst = 0.0
    for t in range(1, steps + 1):
        total += codec.decode(memory.encode(codec, "w", x))
        worst = max(worst, float(np.linalg.norm(total - t * x) / np.linalg.norm(x)))
    return worst, float(np.linalg.norm(total - steps * x) / np.linalg.norm(x))


# Each lossy codec's worst relative error |v - C(v)| / |v| (randomk's: expected), from its
# definition: a sparsifier keeping a fraction d leaves out at most 1 - d of the energy; fp16
# and bf16 round to 11 and 8 significant bits; 4-bit DCT errs by at most half of a 1/15 step
# on each of a block's 64 coefficients, each at most the block's norm; QSGD by at most one of
# s levels of its bucket's norm on each of B = 512 entries.
CONTRACTION = {"topk": math.sqrt(1 - 0.05), "randomk": math.sqrt(1 - 0.05), "group_topk": math.sqrt(1 - 13 / 256),
               "fp16": 2.0**-11, "bf16": 2.0**-8, "dct_quant": 8 / 15, "qsgd": math.sqrt(512) / 31}


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_error_feedback_keeps_the_decoded_sum_near_t_times_input(name):
    steps = 300
    codec, memory = get_codec(name, **LOSSY[name]), ErrorFeedback()
    x = gaussian(4096, seed=1)
    total = np.zeros(x.size, np.float64)
    worst = 0.0
    for t in range(1, steps + 1):
        total += codec.decode(memory.encode(codec, "w", x))
        # What was sent so far is t * x minus what is still held back: the residual.
        drift = total - t * x.astype(np.float64)
        np.testing.assert_allclose(drift, -memory.residuals["w"], atol=1e-4 * t)
        worst = max(worst, float(np.linalg.norm(drift) / np.linalg.norm(x)))
    # Bounded: a codec whose error is at most q |v| for any v (q < 1) holds back at most
    # q / (1 - q) |x| (e_t = v_t - C(v_t), v_t = x + e_(t-1)), while t |x| grows to 300 |x|.
    q = CONTRACTION[name]
    assert worst <= q / (1 - q), (worst, q / (1 - q))
    if name not in ("fp16", "bf16", "qsgd"):  # unbiased or near-exact codecs drift slowly anyway
        # Without error feedback the left-out part is lost every step: the drift grows with t.
        _, without = _drift(name, NoMemory(), steps)
        assert without > 10 * worst, (without, worst)


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_error_feedback_residual_is_exactly_compensated_minus_decoded(name):
    codec = get_codec(name, **LOSSY[name])
    memory = ErrorFeedback()
    x, y = gaussian(5000, seed=1), gaussian(5000, seed=2)
    memory.encode(codec, "a", x)
    compensated = y + memory.residuals["a"]
    payload = memory.encode(codec, "a", y)
    assert np.array_equal(memory.residuals["a"], compensated - codec.decode_flat(payload))


def test_error_feedback_state_round_trips_and_checks_layout():
    memory = ErrorFeedback()
    codec = get_codec("topk", density=0.1)
    memory.encode(codec, "a", gaussian(100))
    restored = ErrorFeedback()
    restored.load_state_dict(memory.state_dict())
    assert np.array_equal(restored.residuals["a"], memory.residuals["a"])
    with pytest.raises(ValueError, match="bucket layout changed"):
        restored.compensate("a", gaussian(99))


def test_fading_error_feedback_carries_decay_times_the_residual():
    codec = get_codec("topk", density=0.1)
    memory = ErrorFeedback(decay=0.95)
    x, y = gaussian(5000, seed=1), gaussian(5000, seed=2)
    memory.encode(codec, "a", x)
    held = memory.residuals["a"].copy()
    compensated = memory.compensate("a", y)
    np.testing.assert_allclose(compensated, np.float32(0.95) * held + y, rtol=1e-6)
    payload = memory.encode(codec, "a", y)
    np.testing.assert_allclose(memory.residuals["a"], compensated - codec.decode_flat(payload), rtol=1e-6, atol=1e-7)
    # SparseLoCo's accumulator: after an input of zeros a residual keeps decay of itself,
    # less what was sent of it.
    before = memory.residuals["a"].copy()
    memory.encode(codec, "a", np.zeros(5000, np.float32))
    sent = np.float32(0.95) * before - memory.residuals["a"]
    assert np.count_nonzero(sent) == 500  # top-k at 0.1 of 5000 entries
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\]"):
        ErrorFeedback(decay=0.0)


def test_error_feedback_does_not_modify_its_input():
    memory = ErrorFeedback()
    x = gaussian(100)
    before = x.copy()
    codec = get_codec("topk", density=0.1)
    memory.encode(codec, "a", x)
    memory.encode(codec, "a", x)
    assert np.array_equal(x, before)


# --- compressed-domain sums ----------------------------------------------------------

@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "topk", "randomk", "group_topk"])
def test_aggregate_equals_sum_of_decodes(name):
    params = dict(ALL[name])
    xs = [gaussian(3000, seed=s) for s in range(3)]
    if name == "randomk":
        codecs = [get_codec(name, **params) for _ in xs]  # one seed: same indices everywhere
    else:
        codecs = [get_codec(name, **params)] * 3
    payloads = [c.encode(x) for c, x in zip(codecs, xs)]
    expected = sum(c.decode(p) for c, p in zip(codecs, payloads))
    total = codecs[0].aggregate(payloads)
    got = get_codec(total.codec, **(params if total.codec == name else {})).decode(total)
    tol = {"fp16": 2e-3, "bf16": 2e-2}.get(name, 1e-6)
    np.testing.assert_allclose(got, expected, atol=tol * 3)
    if total.codec == "coo":
        assert total.nbytes == len(total.to_bytes())
        rebuilt = get_codec("coo").from_bytes(total.to_bytes(), like=total)
        assert np.array_equal(get_codec("coo").decode(rebuilt), got)


@pytest.mark.parametrize("name,params,message", [
    ("qsgd", {"levels": 7}, "variance bound 3.23 >= 1"),
    ("dct_quant", {"keep": 0.5}, "never sends the dropped frequencies"),
])
def test_error_feedback_refuses_codecs_under_which_it_diverges(name, params, message):
    codec = get_codec(name, **params)
    with pytest.raises(CodecError, match=message):
        ErrorFeedback().encode(codec, "w", gaussian(100))
    # The divergence is real: with the refused setting the residual keeps growing.
    memory, x = ErrorFeedback(), gaussian(4096)
    sizes = []
    for _ in range(200):
        compensated = memory.compensate("w", x)
        memory.update("w", compensated, codec.decode(codec.encode(compensated)))
        sizes.append(float(np.linalg.norm(memory.residuals["w"])))
    assert sizes[-1] > 3 * sizes[20] > 0


@pytest.mark.parametrize("name", ["qsgd", "dct_quant"])
def test_aggregate_refuses_codecs_that_cannot_sum(name):
    codec = get_codec(name)
    with pytest.raises(CodecError, match="allgather"):
        codec.aggregate([codec.encode(gaussian(100))] * 2)


# --- edge cases ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("n", [0, 1, 3, 65, 1025])
def test_small_and_odd_lengths(name, n):
    codec = get_codec(name, **ALL[name])
    x = gaussian(n, seed=7)
    out = codec.decode(codec.encode(x))
    assert out.shape == x.shape and out.dtype == np.float32
    if n and codec.sparse:
        assert np.all((out == 0) | (out == x.astype(np.float16 if name == "group_topk" else np.float32)))


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_dtypes_and_non_contiguous_inputs(name, dtype):
    codec = get_codec(name, **ALL[name])
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(dtype).t()  # non-contiguous
    assert not t.is_contiguous()
    out = codec.decode(codec.encode(t))
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == t.shape
    if name == "none":
        assert torch.equal(out, t)
    err = ((out.float() - t.float()).norm() / t.float().norm()).item()
    assert err < {"none": 1e-7, "fp16": 2e-3, "bf16": 1e-2}.get(name, 1.0)


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_with_their_position(name, bad):
    x = gaussian(3000)
    x[1234] = bad
    x[2000] = bad
    with pytest.raises(NonFiniteError, match=r"2 NaN/Inf value\(s\), first at flat index 1234"):
        get_codec(name, **ALL[name]).encode(x)


def test_fp16_overflow_is_an_error_not_inf():
    x = gaussian(100)
    x[5] = 1e6
    with pytest.raises(NonFiniteError, match="overflows fp16"):
        get_codec("fp16").encode(x)
    with pytest.raises(CodecError, match="fp16 range"):
        get_codec("group_topk", density=0.5, group_size=10).encode(x)
    assert get_codec("bf16").decode(get_codec("bf16").encode(x))[5] == pytest.approx(1e6, rel=1e-2)


def test_bf16_rounds_like_torch():
    x = gaussian(10_000) * 1000
    ours = get_codec("bf16").decode(get_codec("bf16").encode(x))
    assert np.array_equal(ours, torch.from_numpy(x).bfloat16().float().numpy())


# --- parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("name,params,message", [
    ("topk", {"density": 0}, "density must be in"),
    ("topk", {"density": 1.5}, "density must be in"),
    ("randomk", {"density": -0.1}, "density must be in"),
    ("group_topk", {"group_size": 0}, "group_size must be"),
    ("group_topk", {"value_dtype": "fp8"}, "value_dtype"),
    ("topk", {"value_dtype": "int8"}, "value_dtype"),
    ("group_topk", {"group_size": 70_000, "packed_indices": True}, "packed_indices"),
    ("group_topk", {"group_size": 70_000, "coded_indices": True}, "coded_indices"),
    ("group_topk", {"packed_indices": True, "coded_indices": True}, "choose one"),
    ("dct_quant", {"block": 1}, "block must be"),
    ("dct_quant", {"bits": 0}, "bits must be in 1..16"),
    ("dct_quant", {"bits": 17}, "bits must be in 1..16"),
    ("dct_quant", {"keep": 0}, "keep must be in"),
    ("qsgd", {"levels": 0}, "levels must be"),
    ("qsgd", {"bucket_size": 2.5}, "bucket_size must be an integer"),
    ("topk", {"k": 3}, "no parameter 'k'"),
    ("zip", {}, "unknown codec 'zip'"),
])
def test_bad_parameters_raise_clear_errors(name, params, message):
    with pytest.raises(CodecError, match=message):
        get_codec(name, **params)


def test_every_registered_codec_is_covered():
    assert set(CODECS) == set(ALL) | {"coo"}


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 4]), codes=st.lists(st.integers(0, 255), max_size=70))
def test_bitpack_byte_fast_path_writes_the_documented_stream(bits, codes):
    # Code i sits at bits [i*b, (i+1)*b) of the little-endian stream, whichever path packs it.
    arr = np.array([c % (1 << bits) for c in codes], dtype=np.uint8)
    stream = "".join(format(int(c), f"0{bits}b")[::-1] for c in arr)
    stream += "0" * (-len(stream) % 8)
    expected = np.array([int(stream[i:i + 8][::-1], 2) for i in range(0, len(stream), 8)], dtype=np.uint8)
    assert np.array_equal(pack_bits(arr, bits, np), expected)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), codes=st.lists(st.integers(0, 65535), max_size=70))
def test_bitpack_round_trip(bits, codes):
    arr = np.array([c % (1 << bits) for c in codes], dtype=np.uint16)
    packed = pack_bits(arr, bits, np)
    assert packed.size == (arr.size * bits + 7) // 8
    assert np.array_equal(unpack_bits(packed, bits, arr.size, np), arr)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), block=st.integers(2, 9), bits=st.integers(1, 16),
       keep=st.floats(0.01, 1.0), seed=st.integers(0, 2**32 - 1))
def test_dct_quant_any_configuration_round_trips_within_one_step(n, block, bits, keep, seed):
    x = gaussian(n, seed=seed)
    codec = get_codec("dct_quant", block=block, bits=bits, keep=keep)
    payload = codec.encode(x)
    assert payload.nbytes == len(payload.to_bytes()) == codec.wire_nbytes(n)
    out = codec.decode(payload)
    body = (n // block**2) * block**2
    assert np.array_equal(out[body:], x[body:])  # the tail travels raw
    if not body:
        return
    # An independent reference: scipy's orthonormal DCT of each block, the first m
    # coefficients of a zig-zag walk written here, each block's scale the largest |kept|.
    from scipy.fft import dctn

    coef = dctn(x[:body].astype(np.float64).reshape(-1, block, block), axes=(1, 2), norm="ortho")
    coef = coef.reshape(-1, block * block)
    m = max(1, math.ceil(keep * block * block - 1e-9))
    kept = np.zeros(block * block, bool)
    kept[_zigzag(block)[:m]] = True
    peak = np.abs(coef[:, kept]).max(axis=1)
    # (float32 arithmetic: a small coefficient carries the rounding of its block's large ones)
    np.testing.assert_allclose(payload.arrays["scales"], peak, rtol=1e-5, atol=1e-6 * float(np.abs(x).max()))
    # Orthonormal transform: the error's energy is the dropped coefficients' plus each kept
    # one's rounding, at most half a quantization step of its block.
    dropped = float((coef[:, ~kept] ** 2).sum())
    rounding = float((m * (peak / (2**bits - 1)) ** 2).sum())
    error = float(np.linalg.norm(out[:body].astype(np.float64) - x[:body]))
    assert math.sqrt(dropped) * 0.999 - 1e-5 <= error <= math.sqrt(dropped + rounding) * 1.001 + 1e-5, \
        (error, math.sqrt(dropped), math.sqrt(rounding))


def _zigzag(n: int) -> list[int]:
    """JPEG's zig-zag walk over an n x n block, as row-major positions: anti-diagonal d runs
    bottom-left to top-right when d is even, top-right to bottom-left when odd."""
    walk = []
    for d in range(2 * n - 1):
        cells = [(i, d - i) for i in range(n) if 0 <= d - i < n]  # top-right first
        walk += cells[::-1] if d % 2 == 0 else cells
    return [i * n + j for i, j in walk]


def test_momentum_correction_masks_the_velocity_of_sent_entries():
    memory = MomentumCorrection(0.9)
    codec = get_codec("topk", density=0.1)
    g1, g2 = gaussian(200, seed=1), gaussian(200, seed=2)
    p1 = memory.encode(codec, "a", g1)
    sent = codec.to_coo(p1)[0]
    velocity = memory.velocities["a"]
    assert np.all(velocity[sent] == 0) and np.array_equal(np.delete(velocity, sent), np.delete(g1, sent))
    assert np.all(memory.residuals["a"][sent] == 0)
    p2 = memory.encode(codec, "a", g2)
    # Unsent entries carry momentum 0.9 * g1 + g2 plus their residual g1; sent ones only g2.
    expected = np.where(np.isin(np.arange(200), sent), g2, (np.float32(0.9) * g1 + g2) + g1)
    np.testing.assert_allclose(codec.decode_flat(p2)[codec.to_coo(p2)[0]], expected[codec.to_coo(p2)[0]], rtol=1e-6)
    restored = MomentumCorrection(0.9)
    restored.load_state_dict(memory.state_dict())
    assert np.array_equal(restored.velocities["a"], memory.velocities["a"])
    assert np.array_equal(restored.residuals["a"], memory.residuals["a"])
    with pytest.raises(CodecError, match="momentum in"):
        MomentumCorrection(1.0)
