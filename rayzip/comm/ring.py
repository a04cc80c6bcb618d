"""Sparse ring allreduce: reduce-scatter then all-gather of (index, value) chunks.

Each worker splits its sparse vector by index range into n = world-size chunks. In n-1
reduce-scatter steps every worker sends one chunk to its ring neighbour, which adds it to
its own copy; then n-1 all-gather steps pass the fully reduced chunks on until every
worker holds all n. Only the entries present travel, so a chunk costs what it holds, until
merging makes it denser than its dense form, which is then sent instead.

Chunk wire format, for a chunk spanning ``span`` entries with ``nnz`` present and values of
``v`` bytes (fp16 or fp32):

* sparse: ``counts`` (uint32, one per 65536-entry block of the span), ``values`` (nnz), then
  ``offsets`` (uint16, nnz, position inside the block): 4*ceil(span/65536) + nnz*(v + 2)
  bytes. Values come before the offsets so that every field starts aligned for its type
  (after an odd count of uint16 offsets, fp32 values would not be, which cupy refuses);
* dense: ``values`` (span): span*v bytes, used when that is no larger;
* coded (the balanced collective's, :mod:`rayzip.comm.balanced`): ``values`` (nnz), then the
  offsets Elias-Fano coded over the span (:mod:`rayzip.codecs.elias_fano`): about
  2 + log2(span / nnz) bits an offset, against 16 plus the block counts.

Every chunk is preceded by a 16-byte header (byte count, entry count or -1 when dense).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import cuda
from ..codecs import elias_fano
from ..codecs.sparse import VALUE_DTYPES, coo_sum
from ..xp import array_module, as_array, to_torch

__all__ = ["Chunk", "chunk_nbytes", "sparse_ring_allreduce"]

BLOCK = 1 << 16


def chunk_nbytes(span: int, nnz: int, value_bytes: int, coded: bool = False) -> tuple[int, bool]:
    """(bytes on the wire, dense?) for a chunk: the smaller of the two encodings (with
    ``coded``, the sparse one's offsets Elias-Fano coded)."""
    if coded:
        sparse = nnz * value_bytes + sum(elias_fano.nbytes(1, nnz, span))
    else:
        sparse = 4 * (-(-span // BLOCK)) + nnz * (2 + value_bytes)
    dense = span * value_bytes
    return (dense, True) if dense <= sparse else (sparse, False)


@dataclass
class Chunk:
    """Entries of one index range: sorted relative ``indices`` and float32 ``values``,
    or, when ``indices`` is None, all ``span`` values densely."""

    span: int
    indices: Any
    values: Any

    @property
    def dense(self) -> bool:
        return self.indices is None

    def add(self, other: "Chunk") -> "Chunk":
        xp = array_module(self.values)
        if self.dense or other.dense:
            total = self.to_dense(xp)
            if other.dense:
                total += other.values
            else:
                total[other.indices] += other.values
            return Chunk(self.span, None, total)
        if cuda.enabled(self.values):  # both sorted: merge, do not sort again
            from ..cuda.sparse import merge_sum

            return Chunk(self.span, *merge_sum(self.indices, self.values, other.indices, other.values))
        indices, values = coo_sum(xp.concatenate([self.indices, other.indices]),
                                  xp.concatenate([self.values, other.values]), xp)
        return Chunk(self.span, indices, values)

    def to_dense(self, xp):
        if self.dense:
            return self.values.copy()
        out = xp.zeros(self.span, dtype=xp.float32)
        out[self.indices] = self.values
        return out

    def pack(self, value_dtype: str, coded: bool = False):
        """(uint8 wire bytes, entry count or -1 when dense)."""
        xp = array_module(self.values)
        wire_dtype = VALUE_DTYPES[value_dtype]
        vbytes = np.dtype(wire_dtype).itemsize
        nnz = self.span if self.dense else int(self.indices.size)
        _, send_dense = chunk_nbytes(self.span, nnz, vbytes, coded)
        if send_dense:
            return _bytes(_narrow(self.to_dense(xp), value_dtype), xp), -1
        if coded:
            low, high = elias_fano.encode(self.indices.reshape(1, -1), self.span, xp)
            return xp.concatenate([_bytes(_narrow(self.values, value_dtype), xp), low, high]), nnz
        counts = xp.bincount(self.indices >> 16, minlength=-(-self.span // BLOCK)).astype("<u4")
        parts = [counts, _narrow(self.values, value_dtype), (self.indices & 0xFFFF).astype("<u2")]
        return xp.concatenate([_bytes(p, xp) for p in parts]), nnz

    @classmethod
    def unpack(cls, buf, span: int, entries: int, value_dtype: str, coded: bool = False) -> "Chunk":
        xp = array_module(buf)
        wire_dtype = VALUE_DTYPES[value_dtype]
        if entries < 0:
            return cls(span, None, buf.view(wire_dtype).astype(xp.float32))
        if coded:
            vbytes = np.dtype(wire_dtype).itemsize * entries
            low_bytes, _ = elias_fano.nbytes(1, entries, span)
            offsets = elias_fano.decode(buf[vbytes:vbytes + low_bytes], buf[vbytes + low_bytes:], 1, entries, span, xp)
            return cls(span, offsets.reshape(-1), buf[:vbytes].view(wire_dtype).astype(xp.float32))
        blocks = -(-span // BLOCK)
        vbytes = np.dtype(wire_dtype).itemsize
        counts = buf[: 4 * blocks].view("<u4")
        values = buf[4 * blocks: 4 * blocks + vbytes * entries].view(wire_dtype).astype(xp.float32)
        offsets = buf[4 * blocks + vbytes * entries:].view("<u2")
        # The block of entry j: how many blocks end at or before it. (xp.repeat with an array
        # of repeats, the obvious spelling, is refused by cupy before 14.1.)
        block_of = xp.searchsorted(xp.cumsum(counts.astype(xp.int64)), xp.arange(entries, dtype=xp.int64),
                                   side="right")
        return cls(span, block_of * BLOCK + offsets.astype(xp.int64), values)


def _narrow(values, value_dtype: str):
    # A partial sum beyond fp16's range travels as Inf rather than raising here, on this rank
    # alone, while the others wait in the ring: the Inf reaches every rank's result, where the
    # caller sees it and every rank skips (or raises) together.
    with np.errstate(over="ignore"):
        return values.astype(VALUE_DTYPES[value_dtype])


def _bytes(arr, xp):
    return xp.ascontiguousarray(arr).view(xp.uint8).reshape(-1)


def split_chunks(indices, values, numel: int, world: int, xp) -> tuple[list[Chunk], list[int]]:
    """Cut sorted global (indices, values) into ``world`` index ranges."""
    bounds = [c * numel // world for c in range(world + 1)]
    cuts = xp.searchsorted(indices, xp.asarray(bounds[1:-1], dtype=indices.dtype)).tolist()
    edges = [0, *cuts, int(indices.size)]
    chunks = [Chunk(bounds[c + 1] - bounds[c], indices[edges[c]:edges[c + 1]] - bounds[c],
                    values[edges[c]:edges[c + 1]]) for c in range(world)]
    return chunks, bounds


def sparse_ring_allreduce(indices, values, numel: int, transport, value_dtype: str = "fp32",
                          sent: list | None = None):
    """Sum sparse vectors over the ring: returns the dense float32 sum (numel,) on every worker.

    ``indices`` are sorted, unique global int64 indices and ``values`` float32, on numpy or
    cupy; chunks move as uint8 torch tensors through ``transport.shift``. ``sent``, if given,
    collects (span, entries) of each chunk sent, entries -1 for a dense one.
    """
    xp = array_module(values)
    world, rank = transport.world, transport.rank
    chunks, bounds = split_chunks(indices, values, numel, world, xp)

    def exchange(send_id: int, recv_id: int) -> Chunk:
        buf, entries = chunks[send_id].pack(value_dtype)
        if sent is not None:
            sent.append((chunks[send_id].span, entries))
        received, their_entries = transport.shift(to_torch(buf), entries)
        return Chunk.unpack(as_array(received)[0], chunks[recv_id].span, their_entries, value_dtype)

    # Reduce-scatter: after n-1 steps this worker holds the full sum of chunk rank+1.
    for step in range(world - 1):
        recv_id = (rank - step - 1) % world
        chunks[recv_id] = chunks[recv_id].add(exchange((rank - step) % world, recv_id))
    # All-gather: pass the reduced chunks round, replacing the partial ones. The owner keeps
    # its chunk as it travels (rounded to the wire's value type), so all replicas match bitwise.
    owned = (rank + 1) % world
    buf, entries = chunks[owned].pack(value_dtype)
    chunks[owned] = Chunk.unpack(buf, chunks[owned].span, entries, value_dtype)
    for step in range(world - 1):
        recv_id = (rank - step) % world
        chunks[recv_id] = exchange((rank + 1 - step) % world, recv_id)
    out = xp.empty(numel, dtype=xp.float32)
    for c, chunk in enumerate(chunks):
        out[bounds[c]:bounds[c + 1]] = chunk.to_dense(xp)
    return out
