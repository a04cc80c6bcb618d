"""Lossless codecs for one tensor: its words become a few byte *streams*, each stored
zstd-compressed where that pays and raw where it does not (near-random mantissa bytes).

* ``raw``: the bytes as they are (dtypes with no useful structure: complex, bool).
* ``planes``: byte planes of the words, XORed with the base checkpoint's words when there
  is one. A tensor unchanged since its base is all zeros: a few bytes per plane.
* ``prefix``: the top ``bits`` bits of each word are mapped through a table of the distinct
  prefixes, most frequent first, to indices of ``index_bits`` bits; the last index is an
  escape, whose prefixes follow in their own stream. The low bits go as byte planes. Adam's
  moments have few distinct exponents, so their sign-and-exponent prefix costs a few bits.
  The index stream is entropy-coded by zstd's Huffman stage, or bit-packed, whichever is
  smaller.

Each codec gives ``encode(words, base, xp) -> (streams, params)`` and
``decode(streams, params, count, dtype, base, xp) -> words``; ``params`` is JSON.
:func:`choose` picks the codec and prefix width per tensor by trying them on a sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from ..codecs.bitpack import pack_bits, unpack_bits
from ..xp import asnumpy
from .transforms import byte_planes, from_byte_planes, prefix_join, prefix_split

__all__ = ["CODECS", "StreamCodec", "choose", "pack_stream", "unpack_stream"]

ZSTD_LEVEL = 1  # higher levels gain < 2% on float planes at several times the time
SAMPLE = 1 << 16  # elements tried per candidate when choosing


_COMPRESSORS: dict[int, Any] = {}
PROBE = 1 << 16  # bytes of a stream's head tried first


def pack_stream(data, level: int = ZSTD_LEVEL) -> tuple[Any, bool]:
    """(stored bytes, zstd?) for one stream: compressed when that is smaller.

    A stream whose first 64 KB do not shrink by 2% (the low mantissa bytes of floats are
    near-random) is stored raw without compressing the rest.
    """
    arr = np.ascontiguousarray(asnumpy(data)).reshape(-1).view(np.uint8)
    if arr.size < 64:
        return arr.tobytes(), False
    compressor = _COMPRESSORS.get(level) or _COMPRESSORS.setdefault(level, zstandard.ZstdCompressor(level=level))
    if arr.size > 4 * PROBE and len(compressor.compress(arr[:PROBE])) > 0.98 * PROBE:
        return arr, False
    packed = compressor.compress(arr)
    return (packed, True) if len(packed) < arr.size else (arr, False)


def unpack_stream(blob: bytes, compressed: bool, nbytes: int) -> np.ndarray:
    data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=nbytes) if compressed else blob
    if len(data) != nbytes:
        raise ValueError(f"stream holds {len(data)} bytes, {nbytes} expected")
    return np.frombuffer(data, dtype=np.uint8)


class StreamCodec:
    name = ""

    def encode(self, words, base, xp) -> tuple[list[Any], dict]:
        raise NotImplementedError

    def decode(self, streams: list[np.ndarray], params: dict, count: int, dtype, base, xp):
        raise NotImplementedError

    @staticmethod
    def _delta(words, base):
        return words if base is None else words ^ base


class Raw(StreamCodec):
    name = "raw"

    def encode(self, words, base, xp):
        return [words.view(xp.uint8)], {}

    def decode(self, streams, params, count, dtype, base, xp):
        return xp.asarray(streams[0]).view(dtype)


class Planes(StreamCodec):
    name = "planes"

    def __init__(self, rotate: int = 0):
        # Rotating a float's word left by one moves the sign bit to the bottom, so the top
        # byte of fp32 and bf16 is exactly the exponent: one few-valued plane for zstd.
        self.rotate = rotate

    def encode(self, words, base, xp):
        words = self._delta(words, base)
        if self.rotate:
            words = _rotate_left(words, self.rotate)
        return list(byte_planes(words, xp)), {"rotate": self.rotate}

    def decode(self, streams, params, count, dtype, base, xp):
        words = from_byte_planes([xp.asarray(s) for s in streams], dtype, xp)
        rotate = params.get("rotate", 0)
        if rotate:
            words = _rotate_left(words, 8 * words.dtype.itemsize - rotate)
        return self._delta(words, base)


def _rotate_left(words, r: int):
    width = 8 * words.dtype.itemsize
    kind = words.dtype.type
    return (words << kind(r)) | (words >> kind(width - r))


class Prefix(StreamCodec):
    name = "prefix"

    def __init__(self, bits: int | None = None):
        self.bits = bits

    def encode(self, words, base, xp):
        width = 8 * words.dtype.itemsize
        bits = self.bits or default_prefix_bits(width)
        words = self._delta(words, base)
        prefix, low = prefix_split(words, bits, xp)
        # Prefixes are < 2**bits <= 65536: a histogram, not a sort, finds the distinct ones.
        histogram = xp.bincount(prefix.astype(xp.int64) if xp is not np else prefix, minlength=1 << bits)
        values = xp.flatnonzero(histogram)
        counts = histogram[values]
        order = xp.argsort(-counts, kind="stable")
        values, counts = values[order].astype(xp.uint16), counts[order]
        index_bits = _index_bits(asnumpy(counts), words.size, bits)
        escape = (1 << index_bits) - 1
        table = values[:escape]
        lookup = xp.full(1 << bits, escape, dtype=xp.uint8 if index_bits <= 8 else xp.uint16)
        lookup[table] = xp.arange(table.size, dtype=lookup.dtype)
        indices = lookup[prefix]
        escaped = prefix[indices == escape].astype("<u2")
        # zstd's Huffman stage codes byte-wide indices near their entropy; when that is no
        # better than the fixed width, bit-packing is smaller and costs no compression.
        packed = _entropy_bits(asnumpy(counts[:escape]), words.size) > 0.95 * index_bits
        index_stream = (pack_bits(indices, index_bits, xp) if packed else
                        indices.astype(xp.uint8) if index_bits <= 8 else indices.astype("<u2").view(xp.uint8))
        low_planes = byte_planes(low, xp)[: -(-(width - bits) // 8)]
        params = {"bits": bits, "index_bits": index_bits, "table": asnumpy(table).tolist(), "packed": packed}
        return [index_stream, escaped.view(xp.uint8), *low_planes], params

    def decode(self, streams, params, count, dtype, base, xp):
        bits, index_bits = params["bits"], params["index_bits"]
        width = 8 * np.dtype(dtype).itemsize
        escape = (1 << index_bits) - 1
        if params["packed"]:
            indices = unpack_bits(xp.asarray(streams[0]), index_bits, count, xp)
        else:
            indices = xp.asarray(streams[0])
            indices = indices if index_bits <= 8 else indices.view("<u2")
        # One entry per possible index, so the lookup needs no bounds work; escapes read 0 here.
        table = np.zeros(escape + 1, dtype=np.uint16)
        table[: len(params["table"])] = params["table"]
        prefix = xp.asarray(table)[indices]
        prefix[indices == escape] = xp.asarray(streams[1]).view("<u2")
        planes = [xp.asarray(s) for s in streams[2:]]
        planes += [xp.zeros(count, xp.uint8)] * (width // 8 - len(planes))
        low = from_byte_planes(planes, dtype, xp)
        return self._delta(prefix_join(prefix, low, bits, xp), base)


def default_prefix_bits(width: int) -> int:
    """Sign plus exponent: 9 bits of an fp32 word, 6 of an fp16 one (bf16 would be 9)."""
    return {32: 9, 16: 6, 64: 12}[width]


def _entropy_bits(counts: np.ndarray, total: int) -> float:
    """Bits per index under the empirical distribution (escapes counted as one symbol)."""
    p = np.append(counts, total - counts.sum()).astype(np.float64) / max(total, 1)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def _index_bits(counts: np.ndarray, total: int, bits: int) -> int:
    """Index width minimising indices plus escaped prefixes (16 bits each)."""
    best, best_cost = 1, None
    for b in range(1, min(bits, 16) + 1):
        mapped = int(counts[: (1 << b) - 1].sum())
        cost = total * b + (total - mapped) * 16
        if best_cost is None or cost < best_cost:
            best, best_cost = b, cost
        if mapped == total:
            break
    return best


CODECS = {"raw": Raw, "planes": Planes, "prefix": Prefix}


def candidates(dtype: str, optimizer_state: bool) -> list[StreamCodec]:
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        bits = {"float32": (9, 12), "float16": (6, 8), "bfloat16": (9, 12), "float64": (12,)}[dtype]
        prefixes = [Prefix(b) for b in bits]
        planes = [Planes(rotate=1), Planes()]
        return [*prefixes, *planes] if optimizer_state else [*planes, *prefixes]
    if dtype.startswith(("int", "uint")) or dtype == "bool":
        return [Planes()]
    return [Raw()]


def choose(words, base, dtype: str, xp, optimizer_state: bool = False) -> StreamCodec:
    """The candidate that stores a sample of ``words`` smallest."""
    options = candidates(dtype, optimizer_state)
    if len(options) == 1 or words.size <= SAMPLE:
        return options[0]
    # Sixteen evenly spaced runs keep the local structure that zstd's matches find.
    run = SAMPLE // 16
    starts = np.linspace(0, words.size - run, 16).astype(np.int64)
    sample = xp.concatenate([words[s: s + run] for s in starts])
    sample_base = None if base is None else xp.concatenate([base[s: s + run] for s in starts])
    sizes = []
    for codec in options:
        streams, _ = codec.encode(sample, sample_base, xp)
        sizes.append(sum(len(pack_stream(s)[0]) for s in streams))
    return options[int(np.argmin(sizes))]
