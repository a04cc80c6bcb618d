"""Lossless, invertible rearrangements of a tensor's bits, written once for numpy and cupy.

A tensor is handled as *words*: its elements reinterpreted as unsigned integers of the same
width (fp32 -> uint32, bf16/fp16 -> uint16, int64 -> uint64), so every bit pattern, NaN
payloads, -0.0 and denormals included, survives unchanged. The transforms:

* ``xor``: words XOR the same tensor's words in the base checkpoint. Bits that did not
  change become 0; a weight that moved a little keeps its sign, exponent and high mantissa,
  so its high bytes are zero.
* ``byte planes``: byte j of every word, then byte j+1, ... The high bytes of floats (sign,
  exponent) are few-valued and compress well; the low mantissa bytes are near-random and
  are left as they are.
* ``prefix split``: the top ``n`` bits of each word (sign and exponent by default) and the
  remaining low bits, for the index mapping of optimizer state.
* ``exponent residual``: a matrix's exponent plane minus a prediction from its row and
  column means, for the optimizer state's moments.

Usage::

    words, xp = tensor_words(t)                   # zero-copy where the dtype allows
    planes = byte_planes(words ^ base_words, xp)  # (itemsize, numel) uint8
    back = from_byte_planes(planes, words.dtype, xp) ^ base_words
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import cuda
from ..xp import array_module, is_torch
from . import scratch

try:  # the C kernels (setup.py); numpy does the same work, slower, without them
    from . import _kernels as kernels
except ImportError:  # pragma: no cover - depends on the build
    kernels = None

__all__ = ["WORD_DTYPES", "byte_planes", "exponent_residual", "exponent_restore", "from_byte_planes", "kernels",
           "prefix_split", "prefix_join", "rotate_left", "tensor_words", "words_to_tensor"]

WORD_DTYPES = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def tensor_words(x: Any) -> tuple[Any, Any]:
    """``(flat unsigned words, xp)`` sharing memory with ``x`` (torch tensor, numpy or cupy)."""
    if is_torch(x):
        import torch

        t = x.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8)  # any dtype, bf16 included, as bytes
        if t.is_cuda:
            import cupy

            arr = cupy.from_dlpack(raw)
        else:
            arr = raw.numpy()
        xp = array_module(arr)
        return arr.view(WORD_DTYPES[t.element_size()]), xp
    xp = array_module(x)
    arr = xp.ascontiguousarray(x).reshape(-1)
    return arr.view(WORD_DTYPES[arr.dtype.itemsize]), xp


def words_to_tensor(words, dtype: str, shape: tuple[int, ...]):
    """A torch tensor of ``dtype`` (a torch dtype name) and ``shape`` over ``words``' bits."""
    import torch

    from ..xp import to_torch

    raw = to_torch(words.view(np.uint8))
    return raw.view(getattr(torch, dtype)).reshape(shape)


def byte_planes(words, xp, base=None, rotate: int = 0, threads: int = 1):
    """``(itemsize, numel)`` uint8: row j holds byte j (little-endian) of every word, after
    the word is XORed with ``base`` (when given) and rotated left by ``rotate`` bits. The C
    kernel splits a large tensor on up to ``threads`` threads."""
    width = words.dtype.itemsize
    if kernels is not None and xp is np:
        planes = scratch.take(width * words.size).reshape(width, words.size)
        kernels.split_planes(np.ascontiguousarray(words), planes, width, rotate,
                             None if base is None else np.ascontiguousarray(base), threads)
        return planes
    if cuda.enabled(words) and width > 1:  # XOR, rotation and split in one pass
        from ..cuda import planes as gpu_planes

        return gpu_planes.split(words, base, rotate)
    if base is not None:
        words = words ^ base
    if rotate:
        words = rotate_left(words, rotate)
    as_bytes = words.view(xp.uint8).reshape(-1, width)
    planes = xp.empty((width, words.size), dtype=xp.uint8)
    for j in range(width):  # one strided column at a time: 4x faster than a transpose copy
        planes[j] = as_bytes[:, j]
    return planes


def from_byte_planes(planes, dtype, xp, base=None, rotate: int = 0, threads: int = 1):
    """Inverse of :func:`byte_planes`; ``planes`` is the 2-D array or a list of its rows."""
    dtype = np.dtype(dtype)
    width, count = len(planes), len(planes[0])
    if kernels is not None and xp is np:
        words = np.empty(count, dtype=dtype)
        kernels.join_planes([np.ascontiguousarray(row) for row in planes], words, width, rotate,
                            None if base is None else np.ascontiguousarray(base), threads)
        return words
    if cuda.enabled(planes[0]) and width > 1:
        from ..cuda import planes as gpu_planes

        return gpu_planes.join(planes, dtype, base, rotate)
    out = xp.empty((count, width), dtype=xp.uint8)
    for j in range(width):
        out[:, j] = planes[j]
    words = out.reshape(-1).view(dtype)
    if rotate:
        words = rotate_left(words, 8 * width - rotate)
    return words if base is None else words ^ base


def exponent_residual(top, xp):
    """Replaces ``top`` (a ``(rows, cols)`` uint8 matrix: the exponents of a float matrix) in
    place by each byte's difference, mod 256, from a prediction from its row's and its
    column's mean, and returns the model, ``(row_fix, col_fix)`` (int16, 1/16 fixed point).

    Adam's second moment is close to a product of a row factor and a column factor (the
    observation behind Adafactor), so its exponents are close to a sum: given the model, an
    exponent costs about 1.9 bits on the GPT workload's ``exp_avg_sq`` instead of 3, and the
    first moment, which scales with its square root, gains about half as much."""
    rows, cols = top.shape
    row_fix = xp.empty(rows, dtype=xp.int16)
    col_fix = xp.empty(cols, dtype=xp.int16)
    if kernels is not None and xp is np:
        kernels.exponent_residual(top, rows, cols, row_fix, col_fix)
        return row_fix, col_fix
    row_sum = top.sum(axis=1, dtype=xp.int64)
    row_fix[:] = (32 * row_sum + cols) // (2 * cols)
    col_sum = top.sum(axis=0, dtype=xp.int64)
    col_fix[:] = (32 * col_sum - 2 * int(row_fix.astype(xp.int64).sum()) + rows) // (2 * rows)
    top -= _exponent_prediction(row_fix, col_fix, xp)
    return row_fix, col_fix


def exponent_restore(residual, row_fix, col_fix, xp) -> None:
    """Inverse of :func:`exponent_residual`, in place."""
    rows, cols = residual.shape
    if kernels is not None and xp is np:
        kernels.exponent_restore(residual, rows, cols, np.ascontiguousarray(row_fix, dtype=np.int16),
                                 np.ascontiguousarray(col_fix, dtype=np.int16))
        return
    residual += _exponent_prediction(row_fix, col_fix, xp)


def _exponent_prediction(row_fix, col_fix, xp):
    total = row_fix.astype(xp.int32)[:, None] + col_fix.astype(xp.int32)[None, :] + 8
    return (xp.clip(total, 0, 4095) >> 4).astype(xp.uint8)


def rotate_left(words, r: int):
    """Rotating a float's word left by one moves the sign bit to the bottom, so the top byte
    of fp32 and bf16 is exactly the exponent."""
    width = 8 * words.dtype.itemsize
    kind = words.dtype.type
    return (words << kind(r)) | (words >> kind(width - r))


def prefix_split(words, bits: int, xp):
    """``(prefix, low)``: the top ``bits`` bits of each word and the rest, as unsigned ints."""
    width = 8 * words.dtype.itemsize
    shift = words.dtype.type(width - bits)
    prefix = (words >> shift).astype(xp.uint16 if bits <= 16 else words.dtype)
    low = words & words.dtype.type((1 << (width - bits)) - 1)
    return prefix, low


def prefix_join(prefix, low, bits: int, xp):
    """Inverse of :func:`prefix_split`."""
    width = 8 * low.dtype.itemsize
    return (prefix.astype(low.dtype) << low.dtype.type(width - bits)) | low
