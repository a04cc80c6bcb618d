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
* ``value_dtype="2bit"`` or ``"4bit"``: a sign and one of 2 or 8 magnitudes per kept value
  (:mod:`.levels`). Each group's scale is one byte, its kept magnitudes' mean to a quarter
  of a binade; the magnitudes, as multiples of the scale, are the payload's own (fp32, from
  Lloyd's algorithm). ``F + [kl > 0] + 4 * 2**(b-1) + ceil(b * n / 8)`` bytes of values.

At density 0.01, G = 1024, both on: 1 + 10 * (8.6 + 2) / 8 bytes per 4096 (8 per payload
aside), 1/290 of fp32.

Usage::

    codec = get_codec("group_topk", density=0.01, group_size=1024)
    payload = codec.encode(grad)
    compact = get_codec("group_topk", density=0.02, value_dtype="int8", packed_indices=True)
"""

from __future__ import annotations

from . import elias_fano, levels
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
        if self.value_dtype in levels.BITS:
            scales, magnitudes, values = levels.wire_bytes(count, full + (k_tail > 0), levels.BITS[self.value_dtype])
            return [Field("scales", "|u1", scales), Field("levels", "<f4", magnitudes), *indices,
                    Field("values", "|u1", values)]
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
            tail_offsets = top_magnitude(rest, k_tail, xp)  # ascending, as Elias-Fano needs
            offsets = xp.concatenate([offsets, tail_offsets])
            groups.append(rest[tail_offsets].reshape(1, k_tail))
            values = xp.concatenate([values, groups[-1].reshape(-1)])
        if self.coded_indices:
            indices = self._coded(offsets, full, k, tail, k_tail, xp)
        else:
            indices = {"indices": pack_bits(offsets, self.index_bits, xp) if self.packed_indices
                       else offsets.astype(index_dtype(self.group_size))}
        if self.value_dtype in levels.BITS:
            coded = levels.quantize(values, _group_of(values.size, k, full, xp), full + (k_tail > 0),
                                    levels.BITS[self.value_dtype], xp)
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
        if self.value_dtype in levels.BITS:
            values = levels.dequantize(arrays, group, count, levels.BITS[self.value_dtype], xp)
        else:
            values = arrays["values"].astype(xp.float32)
        if self.value_dtype == "int8":
            values *= arrays["scales"][group]
        return group * self.group_size + offsets.astype(xp.int64), values


def _group_of(count: int, k: int, full: int, xp):
    """Each kept entry's group: entries are laid out group after group, k each; the short
    tail group (index ``full``) comes last."""
    return xp.minimum(xp.arange(count, dtype=xp.int64) // k, full)
