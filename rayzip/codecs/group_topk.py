"""``group_topk``: top-k inside each group of G consecutive entries.

The flat gradient is cut into groups of ``group_size`` G (the last may be shorter, of
length r = numel mod G). Each group keeps its k = max(1, ceil(density * |group|)) entries of
largest magnitude, so every group is represented and the payload size is fixed.

Wire, for F = numel // G full groups with k = kept(G) and kl = kept(r) (0 when r = 0), and
n = F*k + kl kept entries: ``indices`` (n offsets inside the group, uint16 when G <= 65536
else uint32) then ``values`` (n, fp16 by default or fp32): ``n * (index_bytes + value_bytes)``.
At density 0.01 and G = 1024 that is 11 * 4 bytes per 4096: 93x smaller than fp32.

Two options make each kept entry cheaper, for updates sent rarely and with many entries
(local steps' pseudo-gradients), where keeping twice the entries matters more than their
precision, which error feedback restores:

* ``packed_indices``: offsets bit-packed at ceil(log2 G) bits (10 for G = 1024):
  ``ceil(n * bits / 8)`` bytes;
* ``value_dtype="int8"``: each group's kept values as int8 multiples of the group's scale
  (its largest kept magnitude / 127), the scales first, fp32, one per group (F, plus one for
  a tail): ``4 * (F + [kl > 0]) + n`` bytes of values.

At density 0.02, G = 1024, both on: 4 + 21 * (1 + 10/8) bytes per 4096, 80x smaller than fp32
(the default wire at 0.02: 49x).

Two more go further, for the rarest and largest updates (SparseLoCo-style pseudo-gradients):

* ``coded_indices``: each group's offsets Elias-Fano coded (:mod:`.elias_fano`), at a fixed
  size near the least any code of k offsets among G can take: 8.6 bits an offset at G = 1024,
  k = 10 (the least: 7.8), where bit-packing takes 10;
* ``value_dtype="2bit"``: a sign and one magnitude bit per kept value. Each group's scale is
  one byte, its kept magnitudes' mean to a quarter of a binade; the two magnitudes, as
  multiples of the scale, are the payload's own (two fp32: a two-means split of every kept
  value's magnitude over its group's scale). ``F + [kl > 0] + 8 + ceil(2n / 8)`` bytes of
  values.

At density 0.01, G = 1024, both on: 1 + 10 * (8.6 + 2) / 8 bytes per 4096 (8 per payload
aside), 1/290 of fp32.

Usage::

    codec = get_codec("group_topk", density=0.01, group_size=1024)
    payload = codec.encode(grad)
    compact = get_codec("group_topk", density=0.02, value_dtype="int8", packed_indices=True)
"""

from __future__ import annotations

from . import elias_fano
from .base import CodecError, Field, Payload, check_int, check_density, index_dtype, kept_count
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .sparse import VALUE_DTYPES, SparseCodec, check_value_dtype
from .kernels import all_finite, rows_kernel_for, top_magnitude_rows
from .topk import top_magnitude
from .. import cuda
from ..cuda.group_topk import MAX_WIDTH, wire_rows
from ..xp import array_module

__all__ = ["GroupTopK"]


class GroupTopK(SparseCodec):
    name = "group_topk"

    def __init__(self, density: float = 0.01, group_size: int = 1024, value_dtype: str = "fp16",
                 packed_indices: bool = False, coded_indices: bool = False):
        self.density = check_density(density)
        self.group_size = check_int("group_size", group_size, 1)
        self.value_dtype = check_value_dtype(value_dtype, scaled=True)
        self.packed_indices = bool(packed_indices)
        self.coded_indices = bool(coded_indices)
        if self.packed_indices and self.coded_indices:
            raise CodecError("packed_indices and coded_indices are two ways to store the offsets: choose one")
        if (self.packed_indices or self.coded_indices) and self.group_size > 1 << 16:
            flag = "packed_indices" if self.packed_indices else "coded_indices"
            raise CodecError(f"{flag} takes offsets of up to 16 bits: group_size {self.group_size} is above 65536")

    def params(self):
        return {**super().params(), "group_size": self.group_size, "packed_indices": self.packed_indices,
                "coded_indices": self.coded_indices}

    @property
    def index_bits(self) -> int:
        """Bits of a packed offset inside a group."""
        return max(1, (self.group_size - 1).bit_length())

    def _split(self, numel: int) -> tuple[int, int, int, int]:
        """(full groups, k per full group, tail length, k of the tail)."""
        full, tail = divmod(numel, self.group_size)
        return full, kept_count(self.density, self.group_size), tail, kept_count(self.density, tail)

    def wire_fields(self, numel: int) -> list[Field]:
        full, k, tail, k_tail = self._split(numel)
        count = full * k + k_tail
        if self.coded_indices:
            low, high = elias_fano.nbytes(full, k, self.group_size)
            tail_low, tail_high = elias_fano.nbytes(int(k_tail > 0), k_tail, tail)
            indices = [Field("low_bits", "|u1", low + tail_low), Field("high_bits", "|u1", high + tail_high)]
        elif self.packed_indices:
            indices = [Field("indices", "|u1", packed_nbytes(count, self.index_bits))]
        else:
            indices = [Field("indices", index_dtype(self.group_size), count)]
        if self.value_dtype == "int8":
            return [Field("scales", "<f4", full + (k_tail > 0)), *indices, Field("values", "|i1", count)]
        if self.value_dtype == "2bit":
            return [Field("scales", "|u1", full + (k_tail > 0)), Field("levels", "<f4", 2), *indices,
                    Field("values", "|u1", packed_nbytes(count, 2))]
        return [*indices, Field("values", VALUE_DTYPES[self.value_dtype], count)]

    def _kernel_checks_finite(self, flat) -> bool:
        return rows_kernel_for(self.group_size, flat)

    def _encode(self, flat, xp):
        full, k, tail, k_tail = self._split(flat.size)
        body = flat[: full * self.group_size].reshape(full, self.group_size)
        rest = flat[full * self.group_size:]
        if cuda.enabled(flat) and self.value_dtype in VALUE_DTYPES and not self.packed_indices \
                and not self.coded_indices and self.group_size <= MAX_WIDTH:
            return self._encode_on_gpu(flat, body, rest, k, k_tail, xp)
        offsets, values, finite = top_magnitude_rows(body, k)
        if finite is False or (finite and not all_finite(rest)):
            self._check_finite(flat, xp)  # raises, with the count and the first index
        groups = [values.reshape(full, k)]
        offsets, values = offsets.reshape(-1), values.reshape(-1)
        if tail:
            tail_offsets = xp.sort(top_magnitude(rest, k_tail, xp))
            offsets = xp.concatenate([offsets, tail_offsets])
            groups.append(rest[tail_offsets].reshape(1, k_tail))
            values = xp.concatenate([values, groups[-1].reshape(-1)])
        if self.coded_indices:
            indices = self._coded(offsets, full, k, tail, k_tail, xp)
        else:
            indices = {"indices": pack_bits(offsets, self.index_bits, xp) if self.packed_indices
                       else offsets.astype(index_dtype(self.group_size))}
        if self.value_dtype == "2bit":
            coded = two_bit(values, _group_of(values.size, k, full, xp), full + (k_tail > 0), xp)
            return {"scales": coded["scales"], "levels": coded["levels"], **indices, "values": coded["values"]}
        if self.value_dtype != "int8":
            return {**indices, "values": self._narrow_values(values)}
        largest = [xp.abs(g).max(axis=1) for g in groups if g.size]
        scales = (xp.concatenate(largest) if largest else xp.zeros(0)).astype(xp.float32) / 127
        inverse = xp.where(scales > 0, 1 / xp.where(scales > 0, scales, 1), 0).astype(xp.float32)
        quantized = xp.rint(values.astype(xp.float32) * inverse[_group_of(values.size, k, full, xp)])
        return {"scales": scales, **indices, "values": xp.clip(quantized, -127, 127).astype(xp.int8)}

    def _coded(self, offsets, full: int, k: int, tail: int, k_tail: int, xp) -> dict:
        """The offsets Elias-Fano coded: the full groups' block, then the tail's."""
        low, high = elias_fano.encode(offsets[: full * k].reshape(full, k), self.group_size, xp)
        if k_tail:
            tail_low, tail_high = elias_fano.encode(offsets[full * k:].reshape(1, k_tail), tail, xp)
            low, high = xp.concatenate([low, tail_low]), xp.concatenate([high, tail_high])
        return {"low_bits": low, "high_bits": high}

    def _offsets(self, arrays: dict, full: int, k: int, tail: int, k_tail: int, xp):
        """Every kept entry's offset inside its group, group after group."""
        if not self.coded_indices:
            return (unpack_bits(arrays["indices"], self.index_bits, full * k + k_tail, xp) if self.packed_indices
                    else arrays["indices"])
        low, high = elias_fano.nbytes(full, k, self.group_size)
        offsets = elias_fano.decode(arrays["low_bits"][:low], arrays["high_bits"][:high], full, k,
                                    self.group_size, xp).reshape(-1)
        if not k_tail:
            return offsets
        rest = elias_fano.decode(arrays["low_bits"][low:], arrays["high_bits"][high:], 1, k_tail, tail, xp)
        return xp.concatenate([offsets, rest.reshape(-1)])

    def _encode_on_gpu(self, flat, body, rest, k, k_tail, xp):
        """The kernel writes the wire (uint16 offsets, fp16 or fp32 values) itself: no casts
        and no overflow pass afterwards, each of which costs a launch on the host."""
        offsets, values, finite, fits = wire_rows(body, k, self.value_dtype)
        if not finite or (rest.size and not all_finite(rest)):
            self._check_finite(flat, xp)  # raises, with the count and the first index
        if not fits:
            raise self._fp16_overflow()
        if rest.size:
            tail_offsets = top_magnitude(rest, k_tail, xp)
            offsets = xp.concatenate([offsets, tail_offsets.astype(offsets.dtype)])
            values = xp.concatenate([values, self._narrow_values(rest[tail_offsets])])
        return {"indices": offsets, "values": values}

    def _to_coo(self, payload: Payload):
        arrays = payload.arrays
        xp = array_module(arrays["values"])
        full, k, tail, k_tail = self._split(payload.numel)
        count = full * k + k_tail
        offsets = self._offsets(arrays, full, k, tail, k_tail, xp)
        group = _group_of(count, k, full, xp)
        if self.value_dtype == "2bit":
            values = from_two_bit(arrays, group, count, xp)
        else:
            values = arrays["values"].astype(xp.float32)
        if self.value_dtype == "int8":
            values *= arrays["scales"][group]
        return group * self.group_size + offsets.astype(xp.int64), values


SCALE_ZERO = 192  # a scale byte q stands for 2 ** ((q - SCALE_ZERO) / 4); 0 for a group of zeros


def two_bit(values, group, groups: int, xp) -> dict:
    """The kept ``values`` as a sign and a magnitude bit each, given each value's ``group``
    (of ``groups``), with each group's scale byte and the payload's two magnitudes, as
    multiples of the scale."""
    magnitude = xp.abs(values.astype(xp.float32))
    mean = (xp.bincount(group, weights=magnitude, minlength=groups)
            / xp.maximum(xp.bincount(group, minlength=groups), 1)).astype(xp.float32)
    q = xp.clip(xp.rint(4 * xp.log2(xp.where(mean > 0, mean, 1))) + SCALE_ZERO, 1, 255)
    scales = xp.where(mean > 0, q, 0).astype(xp.uint8)
    scale = _scale(scales, xp)[group]
    low, high = _two_means((magnitude / xp.where(scale > 0, scale, 1))[scale > 0], xp)
    big = magnitude > (low + high) / 2 * scale
    codes = (values < 0).astype(xp.uint8) | (big.astype(xp.uint8) << 1)
    return {"scales": scales, "levels": xp.asarray([low, high], dtype=xp.float32),
            "values": pack_bits(codes, 2, xp)}


def from_two_bit(arrays: dict, group, count: int, xp):
    """Inverse of :func:`two_bit`: float32 values, given each kept entry's group."""
    codes = unpack_bits(arrays["values"], 2, count, xp)
    magnitude = arrays["levels"].astype(xp.float32)[(codes >> 1).astype(xp.int64)]
    return xp.where(codes & 1, -magnitude, magnitude) * _scale(arrays["scales"], xp)[group]


def _scale(scales, xp):
    return xp.where(scales > 0, xp.exp2((scales.astype(xp.float32) - SCALE_ZERO) / 4), 0).astype(xp.float32)


def _two_means(ratio, xp) -> tuple[float, float]:
    """Two magnitudes for ``ratio`` (1-D, >= 0): a two-means split, from the mean, refined
    twice; both the mean where the split leaves one side empty."""
    if not ratio.size:
        return 0.0, 0.0
    cut = float(ratio.mean())
    low = high = cut
    for _ in range(3):
        below, above = ratio[ratio <= cut], ratio[ratio > cut]
        low = float(below.mean()) if below.size else float(above.mean())
        high = float(above.mean()) if above.size else low
        cut = (low + high) / 2
    return low, high


def _group_of(count: int, k: int, full: int, xp):
    """Each kept entry's group: entries are laid out group after group, k each; the short
    tail group (index ``full``) comes last."""
    return xp.minimum(xp.arange(count, dtype=xp.int64) // k, full)
