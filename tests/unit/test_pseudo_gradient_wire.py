"""The cheapest wire for rare, large updates (local steps' pseudo-gradients): group top-k's
offsets Elias-Fano coded (``coded_indices``) and its values in 2 or 4 bits (``value_dtype``
"2bit", "4bit")."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayzip.codecs import elias_fano, get_codec
from rayzip.codecs.base import kept_count


def _subsets(rng, groups: int, k: int, group: int) -> np.ndarray:
    return np.sort(np.stack([rng.choice(group, k, replace=False) for _ in range(groups)]), axis=1) if groups \
        else np.zeros((0, k), dtype=np.int64)


@pytest.mark.parametrize("groups,k,group", [(40, 10, 1024), (7, 21, 1024), (3, 1, 1000), (2, 8, 8), (4, 3, 5),
                                            (2, 600, 1024), (0, 10, 1024), (5, 1, 1)])
def test_elias_fano_gives_back_every_offset_in_the_bytes_it_announces(groups, k, group):
    rng = np.random.default_rng(groups * 1000 + k)
    offsets = _subsets(rng, groups, k, group)
    low, high = elias_fano.encode(offsets, group, np)
    assert (low.size, high.size) == elias_fano.nbytes(groups, k, group)
    np.testing.assert_array_equal(elias_fano.decode(low, high, groups, k, group, np), offsets)


@pytest.mark.parametrize("k", [10, 21, 41, 102])
def test_elias_fano_is_within_two_bits_an_offset_of_the_least_any_code_needs(k):
    """The least: log2 C(G, k) bits for which k of G, as any code of the subset needs on
    average; bit-packed offsets take ceil(log2 G) = 10."""
    group, groups = 1024, 64
    low, high = elias_fano.nbytes(groups, k, group)
    bits = 8 * (low + high) / (groups * k)
    least = (math.lgamma(group + 1) - math.lgamma(k + 1) - math.lgamma(group - k + 1)) / math.log(2) / k
    assert least < bits <= least + 2 and bits < 10, (bits, least)


def test_a_corrupt_high_bit_vector_is_refused():
    offsets = _subsets(np.random.default_rng(0), 4, 10, 1024)
    low, high = elias_fano.encode(offsets, 1024, np)
    high = high.copy()
    high[high.size // 2] = 0xFF if high[high.size // 2] != 0xFF else 0  # ones added or taken away
    with pytest.raises(ValueError, match="Elias-Fano stream holds"):
        elias_fano.decode(low, high, 4, 10, 1024, np)


def _unlike_groups(n: int, seed: int = 0) -> np.ndarray:
    """Gaussian entries whose scale changes from group to group by up to 1000x."""
    rng = np.random.default_rng(seed)
    scale = np.repeat(rng.uniform(-3, 0, n // 1000 + 1), 1000)[:n]
    return (rng.standard_normal(n) * 10.0 ** scale).astype(np.float32)


@pytest.mark.parametrize("value_dtype", ["fp32", "fp16", "int8", "2bit", "4bit"])
@pytest.mark.parametrize("n,group", [(100_000, 1024), (10_007, 1000), (50, 64)])
def test_coded_indices_keep_the_entries_and_values_of_plain_offsets(value_dtype, n, group):
    x = _unlike_groups(n, seed=n)
    plain = get_codec("group_topk", density=0.02, group_size=group, value_dtype=value_dtype)
    coded = get_codec("group_topk", density=0.02, group_size=group, value_dtype=value_dtype, coded_indices=True)
    payload = coded.encode(x)
    indices, values = coded.to_coo(coded.from_bytes(payload.to_bytes(), like=payload))
    want_indices, want = plain.to_coo(plain.encode(x))
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want)
    assert payload.nbytes == coded.wire_nbytes(n) < plain.wire_nbytes(n) or n < group


@pytest.mark.parametrize("bits,error", [(2, 0.3), (4, 0.06)])
@pytest.mark.parametrize("n,group", [(100_000, 1024), (10_007, 1000), (50, 64)])
def test_few_bit_values_keep_each_sign_and_one_of_few_magnitudes_per_group(n, group, bits, error):
    x = _unlike_groups(n, seed=n + 1)
    codec = get_codec("group_topk", density=0.02, group_size=group, value_dtype=f"{bits}bit", coded_indices=True)
    payload = codec.encode(x)
    indices, values = codec.to_coo(codec.from_bytes(payload.to_bytes(), like=payload))
    exact_indices, exact = get_codec("group_topk", density=0.02, group_size=group,
                                     value_dtype="fp32").to_coo(get_codec("group_topk", density=0.02, group_size=group,
                                                                          value_dtype="fp32").encode(x))
    np.testing.assert_array_equal(indices, exact_indices)
    assert np.array_equal(np.sign(values), np.sign(exact))
    for g in np.unique(indices // group):
        mine = np.abs(values[indices // group == g])
        assert len(np.unique(mine)) <= 2 ** (bits - 1)
        # the group's scale is its kept magnitudes' mean to a quarter of a binade
        assert abs(np.log2(mine.mean() / np.abs(exact[indices // group == g]).mean())) < 1.5
    # Contractive on what it keeps, as error feedback needs: the error's norm is well below
    # the kept values' (an entry far below its group's mean can overshoot, by at most the
    # lower magnitude).
    assert np.linalg.norm(values - exact) / np.linalg.norm(exact) < error


def test_two_bit_wire_is_the_documented_bytes_and_a_zero_group_decodes_to_zeros():
    n, group, density = 100_000, 1024, 0.01
    codec = get_codec("group_topk", density=density, group_size=group, value_dtype="2bit", coded_indices=True)
    x = _unlike_groups(n)
    x[:group] = 0
    payload = codec.encode(x)
    full, tail = divmod(n, group)
    k, k_tail = kept_count(density, group), kept_count(density, tail)
    count = full * k + k_tail
    index_bytes = sum(elias_fano.nbytes(full, k, group)) + sum(elias_fano.nbytes(1, k_tail, tail))
    value_bytes = (full + 1) + 8 + math.ceil(2 * count / 8)
    assert payload.nbytes == len(payload.to_bytes()) == codec.wire_nbytes(n) == index_bytes + value_bytes
    assert payload.arrays["scales"][0] == 0 and not codec.decode(payload)[:group].any()
    assert 4 * n / payload.nbytes > 250  # 1% of entries at about 10.6 bits each


def test_error_feedback_delivers_a_constant_update_in_full_over_rounds():
    """With the residual carried from round to round, what 2-bit group top-k delivers over
    many rounds approaches what went in: nothing is lost, only late."""
    codec = get_codec("group_topk", density=0.05, group_size=256, value_dtype="2bit", coded_indices=True)
    x = _unlike_groups(8192, seed=3)
    residual = np.zeros_like(x)
    delivered = np.zeros_like(x)
    rounds = 200
    for _ in range(rounds):
        compensated = x + residual
        payload = codec.encode(compensated)
        delivered += codec.decode(payload)
        residual = codec.residual(compensated, payload)
    assert np.linalg.norm(delivered / rounds - x) / np.linalg.norm(x) < 0.1
