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
* ``factored``: byte planes whose exponent plane is the residual from a model of the
  matrix's rows and columns (Adam's moments: their exponents follow rows and columns).

Each codec gives ``encode(words, base, xp, shape=None) -> (streams, params)`` and
``decode(streams, params, count, dtype, base, xp) -> words``; ``params`` is JSON.
:func:`choose` picks the codec and prefix width per tensor by trying them on a sample.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np
import zstandard

from .. import cuda
from ..codecs.bitpack import pack_bits, unpack_bits
from ..xp import asnumpy, is_torch
from . import scratch
from .transforms import (byte_planes, column_model, exponent_residual, exponent_restore, from_byte_planes, kernels,
                         prefix_join, prefix_split, SCALED_MAX, scaled_join, scaled_split)

__all__ = ["CODECS", "Factored", "Scaled", "StreamCodec", "choose", "choose_delta", "on_host", "pack_stream",
           "stream_plan", "stream_stats", "unpack_stream"]

ZSTD_LEVEL = 1  # higher levels gain little on float planes, for several times the time
SAMPLE = 1 << 14  # elements tried per candidate when choosing


_COMPRESSORS = threading.local()
PROBE = 1 << 16  # bytes of a stream's head tried first
RAW_ABOVE = 7.9  # bits per byte: near-random mantissa planes are stored as they are
RUNS_BELOW = 1.0  # bits per byte: mostly one value; zstd's matches beat Huffman's 1-bit floor
HUFFMAN_FROM = 4096  # bytes: below this, the 128-byte code table does not pay
TABLE_BYTES = 128  # one Huffman code table: 256 4-bit code lengths
ORDER1_CONTEXTS = 64  # order-1 codes pay where few byte values precede (exponents); with
# many, their tables and decoding cost more than they save
MIXED_ABOVE = 5.0  # bits per byte from which zstd's fastest level is tried
ZSTD_FAST = -1
PLAN_SAMPLE = 1 << 16  # bytes of a stream whose statistics decide its coding


def _bytes(data) -> np.ndarray:
    if type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous:
        return data  # the common case, a plane: numpy's conversions cost more than the plan's statistics
    return np.ascontiguousarray(asnumpy(data)).reshape(-1).view(np.uint8)


def _entropy(counts: np.ndarray) -> float:
    """Bits per symbol of a histogram."""
    total = counts.sum()
    p = counts[counts > 0].astype(np.float64) / max(float(total), 1.0)
    return float(-(p * np.log2(p)).sum())


def stream_stats(data, sample: int = 0) -> tuple[float, float | None, int, int]:
    """``(order-0 bits per byte, order-1 bits per byte given the byte before, contexts,
    distinct byte values)`` of a stream, or with ``sample`` of :func:`_sample` of it. Order 1
    is ``None`` where more than ``ORDER1_CONTEXTS`` contexts (the values present, and 0
    before the first byte) could occur: it is not chosen there, so its counts are not made."""
    arr = _bytes(data)
    if kernels is not None:
        order0, order1, contexts, distinct = kernels.stream_stats(arr, ORDER1_CONTEXTS, sample)
        return order0, (order1 if order1 >= 0 else None), contexts, distinct
    if sample:
        arr = _sample(arr, sample)
    counts = np.bincount(arr, minlength=256)
    distinct = int(np.count_nonzero(counts))
    if not arr.size or distinct + (counts[0] == 0) > ORDER1_CONTEXTS:
        return _entropy(counts), None, distinct + int(counts[0] == 0), distinct
    previous = np.concatenate([[0], arr[:-1]]).astype(np.int64)
    pairs = np.bincount(previous << 8 | arr, minlength=1 << 16).reshape(256, 256).astype(np.float64)
    rows = np.broadcast_to(pairs.sum(axis=1, keepdims=True), pairs.shape)
    seen = pairs > 0
    # H(byte | previous) = sum over pairs of n(a, b) * log2(n(a) / n(a, b)), per byte
    order1 = float((pairs[seen] * np.log2(rows[seen] / pairs[seen])).sum()) / arr.size
    return _entropy(counts), order1, int(seen.any(axis=1).sum()), distinct


def _spaced(length: int, count: int) -> list[int]:
    """``count`` evenly spaced starts from 0 to ``length`` inclusive (np.linspace cost more
    than the statistics of the sample it placed)."""
    return [length * i // (count - 1) for i in range(count)]


def _sample(arr: np.ndarray, size: int) -> np.ndarray:
    """Four evenly spaced runs of ``size`` bytes in all."""
    if arr.size <= size:
        return arr
    run = size // 4
    return np.concatenate([arr[s: s + run] for s in _spaced(arr.size - run, 4)])


def _plan(arr: np.ndarray, size: int | None = None) -> tuple[str, int, float]:
    """How a stream of bytes should be coded: ``(coding, parameter, estimated stored
    bytes)``, the parameter being the Huffman order or the zstd level. ``arr`` is the
    stream, or its :func:`_sample` with ``size`` the stream's length (a stream on the GPU:
    only the sample crosses). Statistics of a 64 KB sample decide:

    * near-random (>= 7.9 bits per byte: low mantissa bytes): raw;
    * nearly all one value (< 1 bit per byte: unchanged tensors, exponents of XOR deltas):
      zstd, whose matches encode long runs below Huffman's 1-bit floor;
    * few contexts and a skewed distribution given the byte before (exponents of optimizer
      state, where neighbours are alike): order-1 Huffman, a code per preceding byte;
    * skewed (exponents of weights, prefix indices): order-0 Huffman;
    * between (5 bits or more: the mantissa bytes of XOR deltas, whose zero runs zstd's
      matches take): zstd at its fastest level when that beats the order-0 estimate.
    """
    size = arr.size if size is None else size
    if size < 64:
        return "raw", 0, float(size)
    order0, order1, contexts, _ = stream_stats(arr, PLAN_SAMPLE)  # the sample read in place
    if order0 >= RAW_ABOVE:
        return "raw", 0, float(size)
    if order0 < RUNS_BELOW or size < HUFFMAN_FROM:
        return "zstd", ZSTD_LEVEL, _zstd_estimate(arr, ZSTD_LEVEL, size)
    order0_bytes = size * order0 / 8 + TABLE_BYTES
    if order1 is not None:
        order1_bytes = size * order1 / 8 + TABLE_BYTES * contexts
        if order1_bytes < 0.98 * order0_bytes:
            return "huffman", 1, order1_bytes
    if order0 >= MIXED_ABOVE:
        fast = _zstd_estimate(arr, ZSTD_FAST, size)
        if fast < order0_bytes:
            return "zstd", ZSTD_FAST, fast
    return "huffman", 0, order0_bytes


def _zstd_estimate(arr: np.ndarray, level: int, size: int) -> float:
    """zstd's stored bytes for a stream of ``size`` bytes at ``level``, from the plan's
    sample of ``arr`` (built only here: the other codings' statistics read it in place)."""
    sample = _sample(arr, PLAN_SAMPLE)
    return len(_compressor(level).compress(sample)) * size / sample.size


def on_host(data) -> bool:
    """Whether ``data`` lies in host memory (numpy, or a CPU tensor), not on the GPU."""
    return data.device.type == "cpu" if is_torch(data) else isinstance(data, np.ndarray)


def _device_sample(data) -> np.ndarray:
    """:func:`_sample` of a stream on the GPU, on the host: the plan's statistics cross,
    not the stream."""
    import torch

    from .device_huffman import as_bytes

    t = as_bytes(data)
    if t.numel() <= PLAN_SAMPLE:
        return t.cpu().numpy()
    run = PLAN_SAMPLE // 4
    return torch.cat([t[s: s + run] for s in _spaced(t.numel() - run, 4)]).cpu().numpy()


def _compressor(level: int):
    """This thread's compressor for ``level`` (a ZstdCompressor is not thread-safe)."""
    mine = _COMPRESSORS.__dict__.setdefault("by_level", {})
    return mine.get(level) or mine.setdefault(level, zstandard.ZstdCompressor(level=level))


def stream_plan(data) -> tuple[str, int] | None:
    """``(coding, parameter)`` that :func:`pack_stream` gives ``data``, for a caller that
    treats streams to be stored raw apart; None without the C kernels (zstd decides there)."""
    if kernels is None:
        return None
    if not on_host(data):
        return _plan(_device_sample(data), int(data.nbytes))[:2]
    return _plan(_bytes(data))[:2]


def pack_stream(data, level: int = ZSTD_LEVEL, threads: int = 1,
                plan: tuple[str, int] | None = None, gpu_coding: bool = False) -> tuple[Any, str]:
    """(stored bytes, coding) for one stream; coding is ``raw``, ``huffman`` or ``zstd``,
    as :func:`_plan` decides (or ``plan``, from :func:`stream_plan`). Without the C kernels,
    zstd codes every stream whose first 64 KB shrink. A Huffman-coded stream of 2 MB or more
    is coded on up to ``threads`` threads, in groups that its decoder can take in parallel
    too; the bytes do not depend on ``threads``. With ``gpu_coding``, a Huffman-coded stream
    on the GPU is coded there, to the same bytes (:mod:`.device_huffman`), and only they cross
    to the host (where rayzip's CUDA kernels are on)."""
    if gpu_coding and kernels is not None and cuda.enabled(data) and int(data.nbytes) >= 64:
        plan = plan or stream_plan(data)
        if plan[0] == "huffman":
            from .device_huffman import encode

            coded = encode(data, plan[1])
            if coded.size < int(data.nbytes):
                return coded, "huffman"
    arr = _bytes(data)
    if arr.size < 64:
        return arr, "raw"
    if kernels is not None:
        coding, parameter = plan or _plan(arr)[:2]
        if coding == "huffman":
            # Coded into reused memory; a code no smaller than the bytes does not fit (-1).
            out = scratch.take(arr.size)
            length = kernels.huffman_encode(arr, parameter, out, threads)
            return (out[:length], coding) if 0 <= length < arr.size else (arr, "raw")
        packed = arr if coding == "raw" else _compressor(parameter).compress(arr)
        return (packed, coding) if len(packed) < arr.size else (arr, "raw")
    compressor = _compressor(level)
    if arr.size > 4 * PROBE and len(compressor.compress(arr[:PROBE])) > 0.98 * PROBE:
        return arr, "raw"
    packed = compressor.compress(arr)
    return (packed, "zstd") if len(packed) < arr.size else (arr, "raw")


def unpack_stream(blob: bytes, coding: str, nbytes: int, threads: int = 1) -> np.ndarray:
    """Inverse of :func:`pack_stream`; a large Huffman-coded stream on up to ``threads`` threads."""
    if coding == "huffman":
        if kernels is None:
            raise ValueError("the stream is Huffman-coded and rayzip's C kernels are not built")
        data = scratch.take(nbytes)
        kernels.huffman_decode(blob, data, threads)
        return data
    data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=nbytes) if coding == "zstd" else blob
    if len(data) != nbytes:
        raise ValueError(f"stream holds {len(data)} bytes, {nbytes} expected")
    return np.frombuffer(data, dtype=np.uint8)


MARGIN = 0.02  # another codec replaces the default only when it stores the sample this much
# smaller (prefix costs an index table and numpy work on both sides), unless it says otherwise


class StreamCodec:
    name = ""
    host_only = False  # its transform runs on the host only: not tried for device arrays
    margin = MARGIN  # how much smaller than the default codec's a sample must store to be chosen
    extra_margin = 0.0  # and how much smaller than the best so far

    def encode(self, words, base, xp, shape: tuple[int, ...] | None = None,
               threads: int = 1) -> tuple[list[Any], dict]:
        raise NotImplementedError

    def decode(self, streams: list[np.ndarray], params: dict, count: int, dtype, base, xp, threads: int = 1):
        raise NotImplementedError

    def encode_sample(self, sample, base, xp, sample_shape, words, shape) -> list[Any]:
        """The streams of ``sample``, some of ``words``' elements (of a matrix, whole rows),
        for the choice of a codec. A codec whose model is built from a few of a matrix's rows
        builds it from ``words``: found on a sample's own few rows, it would fit them more
        closely than it fits the matrix."""
        return self.encode(sample, base, xp, shape=sample_shape)[0]

    column_streams = 0  # the last streams, whose size is the matrix's columns', not its

    def stored_per_element(self, sizes: list[float], sample_shape: tuple[int, ...], count: int) -> float:
        """Stored bytes per element of a ``count``-element tensor, from its streams' ``sizes``
        on a sample of ``sample_shape``. A sample of a matrix is a few of its rows: a model of
        its columns costs as much there as on the whole matrix, where it weighs far less."""
        sample = math.prod(sample_shape)
        split = len(sizes) - self.column_streams
        return (sum(sizes[:split]) + sum(sizes[split:]) * sample / count) / sample

    @staticmethod
    def _delta(words, base):
        return words if base is None else words ^ base


class Raw(StreamCodec):
    name = "raw"

    def encode(self, words, base, xp, shape=None, threads=1):
        return [words.view(xp.uint8)], {}

    def decode(self, streams, params, count, dtype, base, xp, threads=1):
        return xp.asarray(streams[0]).view(dtype)


class Planes(StreamCodec):
    name = "planes"

    def __init__(self, rotate: int = 0):
        # Rotating a float's word left by one moves the sign bit to the bottom, so the top
        # byte of fp32 and bf16 is exactly the exponent: one few-valued plane for zstd.
        self.rotate = rotate

    def encode(self, words, base, xp, shape=None, threads=1):
        return list(byte_planes(words, xp, base=base, rotate=self.rotate, threads=threads)), {"rotate": self.rotate}

    def decode(self, streams, params, count, dtype, base, xp, threads=1):
        return from_byte_planes([xp.asarray(s) for s in streams], dtype, xp, base=base, rotate=params.get("rotate", 0),
                                threads=threads)


class Prefix(StreamCodec):
    name = "prefix"

    def __init__(self, bits: int | None = None):
        self.bits = bits

    def encode(self, words, base, xp, shape=None, threads=1):
        width = 8 * words.dtype.itemsize
        bits = self.bits or default_prefix_bits(width)
        fused = kernels is not None and xp is np
        if fused:
            words = np.ascontiguousarray(words)
            base = None if base is None else np.ascontiguousarray(base)
            histogram = np.empty(1 << bits, dtype=np.uint64)
            kernels.prefix_histogram(words, width // 8, bits, base, histogram)
        else:
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
        low_count = -(-(width - bits) // 8)
        if fused:
            indices = scratch.take(words.size * lookup.dtype.itemsize, lookup.dtype)
            escaped = scratch.take(2 * words.size)
            low_planes = scratch.take(low_count * words.size).reshape(low_count, words.size)
            escaped = escaped[: 2 * kernels.prefix_map(words, width // 8, bits, base, lookup, escape,
                                                       indices, escaped, low_planes)]
        else:
            indices = lookup[prefix]
            escaped = prefix[indices == escape].astype("<u2").view(xp.uint8)
            low_planes = byte_planes(low, xp)[:low_count]
        # Byte-wide indices are Huffman-coded near their entropy; when that is no better than
        # the fixed width, bit-packing is as small and costs no coding.
        packed = _entropy_bits(asnumpy(counts[:escape]), words.size) > 0.95 * index_bits
        index_stream = (pack_bits(indices, index_bits, xp) if packed else
                        indices.astype(xp.uint8) if index_bits <= 8 else indices.astype("<u2").view(xp.uint8))
        params = {"bits": bits, "index_bits": index_bits, "table": asnumpy(table).tolist(), "packed": packed}
        return [index_stream, escaped, *low_planes], params

    def decode(self, streams, params, count, dtype, base, xp, threads=1):
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


class Factored(StreamCodec):
    """Byte planes of the words rotated left by one, whose top plane (the exponents of fp32
    and bf16) is coded as its residual from a row-and-column model of the matrix
    (:func:`~rayzip.checkpoint.transforms.exponent_residual`), the model's two int16
    vectors as two more streams. For matrices without a base: Adam's moments, whose
    exponents follow their rows and columns. Costs one pass over the exponents more than
    ``planes``."""

    name = "factored"
    margin = 0.005  # about as fast as planes: any real saving pays
    column_streams = 1

    @staticmethod
    def matrix(shape) -> tuple[int, int] | None:
        """``(rows, columns)`` of a tensor seen as a matrix (the last dimension its columns),
        or None where there is no matrix to model."""
        if shape is None or len(shape) < 2:
            return None
        rows, cols = math.prod(int(d) for d in shape[:-1]), int(shape[-1])  # math.prod: np.prod is slow on a short tuple
        return (rows, cols) if rows >= 2 and cols >= 2 else None

    def encode(self, words, base, xp, shape=None, threads=1):
        matrix = self.matrix(shape)
        if matrix is None or base is not None or matrix[0] * matrix[1] != words.size:
            raise ValueError(f"factored codes a matrix without a base, not shape {shape} with base {base is not None}")
        planes = byte_planes(words, xp, rotate=1, threads=threads)
        row_fix, col_fix = exponent_residual(planes[-1].reshape(matrix), xp)
        return [*planes, row_fix.astype("<i2").view(xp.uint8), col_fix.astype("<i2").view(xp.uint8)], \
            {"columns": matrix[1]}

    def decode(self, streams, params, count, dtype, base, xp, threads=1):
        cols = params["columns"]
        planes = [xp.asarray(s) for s in streams[:-2]]
        top = planes[-1]
        if not getattr(top.flags, "writeable", True):  # a stream stored raw is the file's bytes
            top = top.copy()
        exponent_restore(top.reshape(count // cols, cols), xp.asarray(streams[-2]).view("<i2"),
                         xp.asarray(streams[-1]).view("<i2"), xp)
        return from_byte_planes([*planes[:-1], top], dtype, xp, rotate=1, threads=threads)


class Scaled(StreamCodec):
    """An fp32 matrix's sign, exponent and top two mantissa bits as one byte per float, from
    two predictions (:func:`~rayzip.checkpoint.transforms.scaled_split`): its log magnitude
    to a quarter binade from a model of rows and columns, and its sign from a model of rank
    ``sign_rank``: a sign per row times a sign per column (1), or the signs of a product of
    int8 factors (2 to 8). The 21 mantissa bits below are stored as they are. Adam's moments
    follow their rows and columns to a fraction of a binade, which the exponent alone (as
    ``factored`` codes it) does not see; a gradient is a sum of outer products, and the
    first moment of a transformer's, low-rank, follows a product of rank 4 in most of its
    signs. Host tensors only.

    Streams: the symbols, the mantissa's high and middle bytes and its packed low bits, then
    the rows' model (fixes, signs or factors) with the escapes, and the columns' model."""

    name = "scaled"
    column_streams = 1
    host_only = True

    # A matrix codes markedly slower than with planes: a small saving does not pay for that
    # (ADR 0003, docs/adr/0003-sign-rank.md).
    margin = 0.005

    def __init__(self, sign_rank: int = 1):
        self.sign_rank = sign_rank
        # A higher sign rank transforms a matrix markedly slower than rank 1, so it must store
        # the sample clearly smaller than the codec tried before it (rank 1): it pays on
        # optimizer state, not on weights (ADR 0003, docs/adr/0003-sign-rank.md).
        self.extra_margin = 0.008 if sign_rank > 1 else 0.0

    @staticmethod
    def applies(dtype: str, shape) -> bool:
        matrix = Factored.matrix(shape)
        return dtype == "float32" and matrix is not None and max(matrix) <= SCALED_MAX

    def encode(self, words, base, xp, shape=None, threads=1, columns=None):
        matrix = Factored.matrix(shape)
        if matrix is None or base is not None or xp is not np or words.dtype.itemsize != 4 \
                or matrix[0] * matrix[1] != words.size or max(matrix) > SCALED_MAX:
            raise ValueError(f"scaled codes an fp32 host matrix without a base, not shape {shape}")
        parts = scaled_split(words, *matrix, sign_rank=self.sign_rank, threads=threads, columns=columns)
        rank = parts["sign_rank"]
        row_signs, col_signs = ((np.packbits(parts["row_negative"]), np.packbits(parts["col_negative"])) if rank == 1
                                else (parts["row_factors"].view(np.uint8), parts["col_factors"].view(np.uint8)))
        rows_model = np.concatenate([parts["row_fix"].astype("<i2").view(np.uint8), row_signs.reshape(-1),
                                     parts["escapes"].astype("<u2").view(np.uint8)])
        cols_model = np.concatenate([parts["col_fix"].astype("<i2").view(np.uint8), col_signs.reshape(-1)])
        return [parts["symbols"], parts["high"], parts["middle"], parts["low"], rows_model, cols_model], \
            {"columns": matrix[1], "sign_rank": rank}

    def encode_sample(self, sample, base, xp, sample_shape, words, shape):
        """The sample's rows coded with the sign model of the whole matrix's columns: 4
        directions found on a sample's 8 rows of 2048 predicted its signs so well that rank 4
        looked 1.1% smaller than rank 1 there (the MLP workload's first moment), 0.1% on the
        whole matrix."""
        matrix = Factored.matrix(shape)
        columns = None
        if matrix is not None and xp is np and base is None and words.size == matrix[0] * matrix[1]:
            columns = column_model(words, *matrix, self.sign_rank)
        return self.encode(sample, base, xp, shape=sample_shape, columns=columns)[0]

    def decode(self, streams, params, count, dtype, base, xp, threads=1):
        cols, rank = params["columns"], int(params.get("sign_rank", 1))
        rows = count // cols
        symbols, high, middle, low, rows_model, cols_model = (np.asarray(s).reshape(-1).view(np.uint8) for s in streams)
        row_signs, col_signs = (-(-rows // 8), -(-cols // 8)) if rank == 1 else (rank * rows, rank * cols)
        escapes_at = 2 * rows + row_signs
        if (rows_model.size < escapes_at or (rows_model.size - escapes_at) % 2
                or cols_model.size != 2 * cols + col_signs):
            raise ValueError("scaled models do not fit the matrix")
        parts = {"symbols": symbols, "high": high, "middle": middle, "low": low, "sign_rank": rank,
                 "row_fix": rows_model[: 2 * rows].view("<i2").copy(),  # copies: aligned
                 "escapes": rows_model[escapes_at:].view("<u2").copy(),
                 "col_fix": cols_model[: 2 * cols].view("<i2").copy()}
        row_part, col_part = rows_model[2 * rows: escapes_at], cols_model[2 * cols:]
        if rank == 1:
            parts["row_negative"] = np.unpackbits(row_part, count=rows)
            parts["col_negative"] = np.unpackbits(col_part, count=cols)
        else:
            parts["row_negative"], parts["col_negative"] = np.zeros(rows, np.uint8), np.zeros(cols, np.uint8)
            parts["row_factors"], parts["col_factors"] = row_part.view(np.int8), col_part.view(np.int8)
        return xp.asarray(scaled_join(parts, rows, cols, threads=threads)).view(dtype)


def default_prefix_bits(width: int) -> int:
    """Sign plus exponent: 9 bits of an fp32 word, 6 of an fp16 one (bf16 would be 9)."""
    return {32: 9, 16: 6, 64: 12}[width]


def _entropy_bits(counts: np.ndarray, total: int) -> float:
    """Bits per index under the empirical distribution (escapes counted as one symbol)."""
    return _entropy(np.append(counts, total - counts.sum()))


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


CODECS = {"raw": Raw, "planes": Planes, "prefix": Prefix, "factored": Factored, "scaled": Scaled}


# RAYZIP_CHECKPOINT_WEIGHT_ROTATE=3 codes weights (fp32 and bf16, not optimizer state, not
# deltas) with their words rotated left by 3: the top byte is then the exponent's low 6 bits
# and the mantissa's top 2, and the low byte the sign, the exponent's top 2 bits (the same
# in nearly every weight) and 5 low mantissa bits, both Huffman-coded. Within a binade near
# a layer's scale a trained weight's density falls (a bell, not a box), so the top mantissa
# bits are skewed given the exponent. That stores weights a little smaller than the rotation
# by 1, but coding a second plane with Huffman codes slows them down: smaller, not the
# default (ADR 0002, docs/adr/0002-rotation-by-three.md).
WEIGHT_ROTATE = int(os.environ.get("RAYZIP_CHECKPOINT_WEIGHT_ROTATE", "1"))
if WEIGHT_ROTATE not in (1, 3):
    raise ValueError(f"RAYZIP_CHECKPOINT_WEIGHT_ROTATE must be 1 (faster) or 3 (smaller), not {WEIGHT_ROTATE}")


def candidates(dtype: str, optimizer_state: bool, shape: tuple[int, ...] | None = None,
               delta: bool = False) -> list[StreamCodec]:
    """The codecs worth trying for a dtype, the default (fastest) first."""
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        bits = {"float32": (9, 12), "float16": (6, 8), "bfloat16": (9, 12), "float64": (12,)}[dtype]
        prefixes = [Prefix(b) for b in bits]
        planes = [Planes(rotate=1), Planes()]
        if WEIGHT_ROTATE != 1 and dtype in ("float32", "bfloat16") and not optimizer_state and not delta:
            planes.insert(0, Planes(rotate=WEIGHT_ROTATE))
        factored = [Factored()] if Factored.matrix(shape) and not delta else []
        if Scaled.applies(dtype, shape) and not delta:
            factored += [Scaled(1), Scaled(OPTIMIZER_SIGN_RANK)] if optimizer_state else [Scaled(1)]
        return [*prefixes, *planes, *factored] if optimizer_state and PREFIX_FIRST else [*planes, *prefixes, *factored]
    if dtype.startswith(("int", "uint")) or dtype == "bool":
        return [Planes()]
    return [Raw()]


PREFIX_FIRST = False
OPTIMIZER_SIGN_RANK = 4  # the first moment's signs: rank 4 stores the GPT workload's 352 KB
# smaller than rank 1; in a prototype, ranks 6 and 8 gained 40 and 33 KB more, for more time


def choose(words, base, dtype: str, xp, optimizer_state: bool = False,
           shape: tuple[int, ...] | None = None) -> StreamCodec:
    """The default codec, unless another stores a sample of ``words`` smaller by its margin
    (``MARGIN`` unless the codec has its own). ``shape`` lets matrix codecs be tried."""
    return _choose(words, base, dtype, xp, optimizer_state, shape)[0]


def choose_delta(words, base, dtype: str, xp, optimizer_state: bool = False,
                 shape: tuple[int, ...] | None = None) -> tuple[StreamCodec, bool]:
    """For a tensor that has a base: ``(codec, whether to code it against the base)``. An XOR
    delta pays while a tensor has changed little since its base; once most of its bits have
    changed (AdamW's weight decay moves every weight at every step), the tensor coded alone,
    with the codecs only a tensor without a base can use, stores smaller."""
    against, size_against = _choose(words, base, dtype, xp, optimizer_state, shape)
    alone, size_alone = _choose(words, None, dtype, xp, optimizer_state, shape)
    if size_against is None or size_alone is None or size_against <= size_alone:
        return against, True
    return alone, False


def _choose(words, base, dtype: str, xp, optimizer_state: bool,
            shape: tuple[int, ...] | None) -> tuple[StreamCodec, float | None]:
    """``(codec, its estimated stored bytes per element)``; None where nothing was tried."""
    options = [codec for codec in candidates(dtype, optimizer_state, shape, base is not None)
               if xp is np or not codec.host_only]
    if len(options) == 1 or words.size <= SAMPLE:
        return options[0], None
    sample, sample_base, sample_shape = _choice_sample(words, base, shape, xp)
    sizes = []
    for codec in options:
        streams = codec.encode_sample(sample, sample_base, xp, sample_shape, words, shape)
        sizes.append(codec.stored_per_element([_plan(_bytes(s))[2] for s in streams], sample_shape or (sample.size,),
                                              words.size))
    best, best_size = options[0], sizes[0]
    for codec, size in zip(options[1:], sizes[1:]):
        if size < (1 - codec.margin) * sizes[0] and size < (1 - codec.extra_margin) * best_size:
            best, best_size = codec, size
    return best, best_size


def _choice_sample(words, base, shape, xp):
    """``(words, base, shape)`` of a sample: evenly spaced whole rows of a matrix (a model of
    rows and columns needs them), else sixteen evenly spaced runs, which keep the local
    structure that order-1 codes and zstd use."""
    matrix = Factored.matrix(shape) if base is None else None
    if matrix is not None:
        rows, cols = matrix
        count = max(2, -(-SAMPLE // cols))
        if count < rows:
            picked = np.array(_spaced(rows - 1, count), dtype=np.int64)
            return words.reshape(rows, cols)[xp.asarray(picked)].reshape(-1), None, (count, cols)
        return words, None, shape
    run = SAMPLE // 16
    starts = _spaced(words.size - run, 16)
    sample = xp.concatenate([words[s: s + run] for s in starts])
    sample_base = None if base is None else xp.concatenate([base[s: s + run] for s in starts])
    return sample, sample_base, None
