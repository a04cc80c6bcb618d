"""Huffman coding of a checkpoint stream where it lies, on the GPU: the bytes of the C
kernel's ``huffman_encode``, so only the coded stream crosses to the host.

The C coder writes each segment's codes one after another, a shift and an OR per byte. On
a GPU every byte is coded at once:

1. counts: one histogram of (context, byte) keys, the context being the byte before under
   order 1 (0 at a segment's start), 0 under order 0;
2. the code table: the histogram (at most 64K counts) crosses to the host, where the C
   kernel's package-merge gives the lengths and canonical codes (``huffman_codes``), the
   same table the C coder builds;
3. positions: each byte's code length, summed per segment, gives each segment's stored size
   (its bits, rounded up to bytes, plus ``PAD`` zero bytes) and offset; an exclusive running
   sum of the lengths gives each code's first bit in the output;
4. bits: each code, shifted to its bit within a 32-bit word, is added into that word (in an
   int64, whose high half spills into the next word). Codes never share a bit, so the adds
   are ORs, and the spill is added to the next word after.

On the GPU, rayzip's CUDA kernels (:mod:`rayzip.cuda.huffman`) count, size and write. The
torch operations here do the same in passes over chunks of the stream (the temporaries stay
a few int64 per byte of a chunk): the fallback with the kernels off, and, since they run on
CPU tensors too, the reference that the tests compare with the C coder where no GPU is.

Usage::

    coded = encode(plane, order=0)   # plane: uint8 on the GPU; coded: numpy uint8 on the host
    assert coded.tobytes() == _kernels.huffman_encode(plane.cpu().numpy(), 0)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import cuda
from .transforms import kernels

__all__ = ["as_bytes", "encode"]

# The C coder's stream layout (rayzip/checkpoint/_kernels.c): they must agree.
SEGMENTS = 4
GROUP_BYTES = 1 << 20
MAX_GROUPS = 16
PAD = 8
CHUNK = 1 << 22  # bytes coded per pass: the temporaries are a few int64 per byte


def _segments(n: int) -> tuple[int, int]:
    """``(groups, bytes per segment)`` of a stream of ``n`` bytes, as the C coder cuts it."""
    groups = max(1, min(MAX_GROUPS, n // GROUP_BYTES))
    return groups, -(-n // (SEGMENTS * groups))


def _keys(data: torch.Tensor, start: int, stop: int, part: int, order: int) -> torch.Tensor:
    """The (context << 8 | byte) key of bytes ``start:stop``, int64."""
    x = data[start:stop].to(torch.int64)
    if not order:
        return x
    prev = torch.empty_like(x)
    prev[1:] = x[:-1]
    prev[0] = int(data[start - 1]) if start % part else 0
    first = -(-start // part) * part  # segment starts within the chunk: context 0
    prev[first - start: stop - start: part] = 0
    return (prev << 8) | x


def as_bytes(data: Any) -> torch.Tensor:
    """``data`` (a torch tensor, or a cupy or numpy array) as a flat uint8 tensor, no copy."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    return torch.from_dlpack(data).reshape(-1).view(torch.uint8)  # a cupy or numpy array


def encode(data: Any, order: int) -> np.ndarray:
    """The Huffman-coded stream of ``data`` (uint8, torch on any device, or cupy) as host
    bytes, equal to ``_kernels.huffman_encode(data, order)``. On the GPU, with rayzip's CUDA
    kernels on, the kernels of :mod:`rayzip.cuda.huffman` code it; elsewhere torch operations
    (the reference the GPU tests compare the kernels with).

    Args:
        data: the stream's bytes, 1-D.
        order: 0 (one code) or 1 (a code per preceding byte).
    """
    if kernels is None:
        raise RuntimeError("Huffman coding needs rayzip's C kernels (pip install builds them)")
    if order not in (0, 1):
        raise ValueError("order must be 0 or 1")
    arr = _as_cupy(data)
    if arr is not None and cuda.enabled(arr):
        with cuda.torch_stream():
            return _encode_kernels(arr, order)
    return _encode_torch(as_bytes(data), order)


def _as_cupy(data: Any):
    """``data`` as a flat uint8 cupy array (no copy) where it lies on the GPU, else None."""
    if isinstance(data, torch.Tensor):
        if not data.is_cuda:
            return None
        import cupy

        return cupy.from_dlpack(data.reshape(-1).view(torch.uint8))
    if type(data).__module__.startswith("cupy"):
        return data.reshape(-1).view(np.uint8)
    return None


def _table(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, codes)`` per context row of ``counts``, as the C coder builds them."""
    counts = counts.astype(np.uint64).reshape(-1, 256)
    lengths = np.zeros(counts.shape, dtype=np.uint8)
    codes = np.zeros(counts.shape, dtype=np.uint16)
    kernels.huffman_codes(counts, lengths, codes)
    return lengths, codes


def _layout(segment_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(stored, offset)`` bytes of each segment: its bits rounded up, plus ``PAD`` zero bytes,
    one after another from the first segment's start."""
    stored = (segment_bits.astype(np.int64) + 7) // 8 + PAD
    return stored, np.concatenate([[0], np.cumsum(stored)[:-1]])


def _header(order: int, groups: int, lengths: np.ndarray, stored: np.ndarray) -> list[np.ndarray]:
    """The stream's head: the order and groups, the bitmap of contexts with a code, their
    4-bit code lengths, and the segments' stored sizes."""
    present = lengths.any(axis=1)
    return [np.array([order | (groups - 1) << 1], dtype=np.uint8),
            np.packbits(np.pad(present, (0, 256 - len(present))), bitorder="little"),
            (lengths[present][:, 0::2] | lengths[present][:, 1::2] << 4).reshape(-1),
            stored.astype("<u4").view(np.uint8)]


def _encode_kernels(data, order: int) -> np.ndarray:
    import cupy

    from ..cuda import huffman as gpu

    n = data.size
    groups, part = _segments(n)
    segments = SEGMENTS * groups
    lengths, codes = _table(gpu.count(data, part, order).get())
    entries = cupy.asarray((codes.astype(np.uint32) | lengths.astype(np.uint32) << 16).reshape(-1))
    tile_bits = gpu.tile_bits(data, part, segments, order, entries)
    segment_bits = tile_bits.sum(axis=1)
    stored, offset = _layout(segment_bits.get())
    first_bits = cupy.cumsum(tile_bits, axis=1) - tile_bits + cupy.asarray(8 * offset, dtype=cupy.uint64)[:, None]
    total = int(stored.sum())
    words = gpu.write(data, part, segments, order, entries, first_bits, total // 4 + 1)
    return np.concatenate(_header(order, groups, lengths, stored) + [words.view(cupy.uint8)[:total].get()])


def _encode_torch(data: torch.Tensor, order: int) -> np.ndarray:
    n = data.numel()
    groups, part = _segments(n)
    segments = SEGMENTS * groups
    ncells = 1 << 16 if order else 256
    device = data.device
    chunks = [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]

    counts = torch.zeros(ncells, dtype=torch.int64, device=device)
    for a, b in chunks:
        counts += torch.bincount(_keys(data, a, b, part, order), minlength=ncells)
    lengths, codes = _table(counts.cpu().numpy())
    length_of = torch.from_numpy(lengths.reshape(-1).astype(np.int64)).to(device)
    code_of = torch.from_numpy(codes.reshape(-1).astype(np.int64)).to(device)

    # Each segment's bits, from the counts alone (as the C coder sizes them).
    segment = torch.zeros(segments, dtype=torch.int64, device=device)
    for a, b in chunks:
        bits = length_of[_keys(data, a, b, part, order)]
        segment += torch.bincount(torch.arange(a, b, device=device) // part, weights=bits.double(),
                                  minlength=segments).to(torch.int64)
    segment_bits = segment.cpu().numpy()
    stored, offset = _layout(segment_bits)
    # A code's bit: 8 * its segment's offset + the bits before it in its segment.
    shift_of = torch.from_numpy(8 * offset - np.concatenate([[0], np.cumsum(segment_bits)[:-1]])).to(device)

    words = torch.zeros(int(stored.sum()) // 4 + 2, dtype=torch.int64, device=device)
    before = 0  # bits of the codes before this chunk
    for a, b in chunks:
        key = _keys(data, a, b, part, order)
        bits = length_of[key]
        ends = torch.cumsum(bits, 0)
        at = shift_of[torch.arange(a, b, device=device) // part] + before + ends - bits
        words.scatter_add_(0, at >> 5, code_of[key] << (at & 31))
        before += int(ends[-1])
    low = words & 0xFFFFFFFF
    low[1:] += words[:-1] >> 32  # the spill of a code that crosses into the next word
    body = torch.stack([(low >> s) & 0xFF for s in (0, 8, 16, 24)], 1).to(torch.uint8).reshape(-1)
    return np.concatenate(_header(order, groups, lengths, stored) + [body[: int(stored.sum())].cpu().numpy()])
