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

__all__ = ["SCALED_MAX", "WORD_DTYPES", "byte_planes", "column_model", "column_signs", "exponent_residual",
           "exponent_restore", "from_byte_planes", "kernels", "prefix_join", "prefix_split", "rotate_left",
           "row_factors", "row_signs", "scaled_join", "scaled_split", "sign_factors", "tensor_words",
           "words_to_tensor"]

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
    for j in range(width):  # one strided column at a time: faster than a transpose copy
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
    row_fix[:], col_fix[:] = _fit_rows_and_columns(top, xp)
    top -= _prediction(row_fix, col_fix, xp, 255).astype(xp.uint8)
    return row_fix, col_fix


def exponent_restore(residual, row_fix, col_fix, xp) -> None:
    """Inverse of :func:`exponent_residual`, in place."""
    rows, cols = residual.shape
    if kernels is not None and xp is np:
        kernels.exponent_restore(residual, rows, cols, np.ascontiguousarray(row_fix, dtype=np.int16),
                                 np.ascontiguousarray(col_fix, dtype=np.int16))
        return
    residual += _prediction(row_fix, col_fix, xp, 255).astype(xp.uint8)


def _predicted_negative(model: dict, rows: int, cols: int) -> np.ndarray:
    """The sign model's prediction, (rows, cols) uint8, 1 negative."""
    if model["sign_rank"] == 1:
        return model["row_negative"][:, None] ^ model["col_negative"][None, :]
    left = model["row_factors"].reshape(rows, -1).astype(np.int64)
    return (left @ model["col_factors"].reshape(-1, cols).astype(np.int64) < 0).astype(np.uint8)


def _fit_rows_and_columns(matrix, xp):
    """``(row_fix, col_fix)``: 16 times the rows' means and the columns' means of what the
    rows' leave, rounded (the C kernels compute the same integers)."""
    rows, cols = matrix.shape
    row_fix = (32 * matrix.sum(axis=1, dtype=xp.int64) + cols) // (2 * cols)
    col_fix = (32 * matrix.sum(axis=0, dtype=xp.int64) - 2 * int(row_fix.sum()) + rows) // (2 * rows)
    return row_fix, col_fix


def _prediction(row_fix, col_fix, xp, most: int):
    """The model's prediction for every cell, clamped to 0..``most``."""
    total = row_fix.astype(xp.int32)[:, None] + col_fix.astype(xp.int32)[None, :] + 8
    return xp.clip(total, 0, 16 * most + 15) >> 4


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


# The scaled split of an fp32 matrix (codecs.Scaled). A float's log magnitude to a quarter
# binade is its exponent and top two mantissa bits, LOG_BITS bits read as one number; a
# matrix's log magnitudes follow its rows and columns (Adam's moments, and weights trained a
# few hundred steps), and its signs follow a rank-one pattern (a gradient's outer product):
# both are predicted, and what the predictions miss is one byte per float.
LOG_BITS = 10
LOG_MOST = (1 << LOG_BITS) - 1
LOW_BITS = 32 - 1 - LOG_BITS  # mantissa bits below the log magnitude: 21
RESIDUAL_REACH = 39  # residuals within this many quarter binades are symbols, the rest escape:
# a wider reach gives rarer symbols, which a code of at most 11 bits stores dearly
RESIDUAL_ZERO = 64
SIGN_SAMPLE_ROWS = 64  # rows whose signs fix the column pattern (the C kernel takes 64 at most)
SCALED_MAX = 1 << 22  # rows and columns at most: the C kernel's sums are 32-bit
SIGN_ROUNDS = 3
SIGN_RANK_MAX = 8  # the C kernel's
DIRECTION_ROWS = 32  # rows whose right singular vectors are the columns' factors (more gain
# little, and the Gram matrix costs the square of the rows)


def column_signs(words, rows: int, cols: int) -> np.ndarray:
    """Each column's sign (uint8, 1 negative) in a rank-one pattern of signs that the
    matrix's signs (the words' top bits) agree with as often as a few rounds of alternating
    majority votes over a sample of evenly spaced rows find. Integer votes, ties positive:
    the same pattern from any implementation."""
    picked = _sample_rows(rows)
    count = picked.size
    if kernels is not None:
        col_negative = np.empty(cols, np.uint8)
        kernels.column_signs(np.ascontiguousarray(words), rows, cols, picked, SIGN_ROUNDS, col_negative)
        return col_negative
    signs = (words.reshape(rows, cols)[picked] >> np.uint32(31)).astype(np.int64)
    col = 2 * signs.sum(axis=0) > count
    for _ in range(SIGN_ROUNDS):
        row = 2 * (signs != col[None, :]).sum(axis=1) > cols
        col = 2 * (signs != row[:, None]).sum(axis=0) > count
    return col.astype(np.uint8)


def row_signs(words, rows: int, cols: int, col_negative: np.ndarray) -> np.ndarray:
    """Each row's sign in the pattern: the majority of its floats' against the columns'."""
    disagree = ((words.reshape(rows, cols) >> np.uint32(31)).astype(np.uint8) != col_negative[None, :]).sum(axis=1)
    return (2 * disagree > cols).astype(np.uint8)


def sign_factors(words, rows: int, cols: int, rank: int) -> np.ndarray:
    """The columns' int8 factors, ``(rank, cols)``, of a product whose signs predict the
    matrix's: the top ``rank`` right singular vectors of a sample of evenly spaced rows (the
    eigenvectors of its Gram matrix, a small one; the C kernel finds them by subspace
    iteration), each column's scaled to +-127 (a positive scale keeps a sign). The rows'
    factors are the rows projected on them (:func:`row_factors`). The first moment of a
    gradient that is low-rank, as a transformer's are, follows them far better than one sign
    per row and column. Only the int8 values decide; any float arithmetic may find them."""
    if kernels is not None:
        factors = np.empty((rank, cols), np.int8)
        kernels.sign_directions(np.ascontiguousarray(words), rows, cols, _sample_rows(rows, DIRECTION_ROWS), rank,
                                factors)
        return factors
    sample = _finite(words.reshape(rows, cols)[_sample_rows(rows, DIRECTION_ROWS)])
    _, vectors = np.linalg.eigh(sample @ sample.T)
    right = np.zeros((cols, rank))  # the top directions first; a sample of fewer rows, fewer
    top = vectors[:, ::-1][:, :rank]
    right[:, :top.shape[1]] = sample.T @ top
    right /= np.maximum(np.linalg.norm(right, axis=0), np.finfo(np.float64).tiny)  # unit: a projection
    return np.ascontiguousarray(_int8_rows(right).T)


def row_factors(words, rows: int, cols: int, col_factors: np.ndarray) -> np.ndarray:
    """Each row's int8 factors, ``(rows, rank)``: its finite floats projected on the columns'
    factors, scaled to +-127 (the C kernel computes these in float32 while it reads the row)."""
    return _int8_rows(_finite(words.reshape(rows, cols)) @ col_factors.astype(np.float64).T)


def _finite(words) -> np.ndarray:
    """fp32 words as float64, inf and NaN as 0 (a signalling NaN's cast is not a warning)."""
    with np.errstate(invalid="ignore"):
        values = words.view(np.float32).astype(np.float64)
    values[~np.isfinite(values)] = 0.0
    return values


def _int8_rows(factors: np.ndarray) -> np.ndarray:
    factors = np.where(np.isfinite(factors), factors, 0.0).astype(np.float64)
    most = np.abs(factors).max(axis=1, keepdims=True)
    return np.round(127 * factors / np.where(most > 0, most, 1.0)).astype(np.int8)


def _sample_rows(rows: int, most: int = SIGN_SAMPLE_ROWS) -> np.ndarray:
    count = min(rows, most)
    steps = np.arange(count, dtype=np.int64)
    return (steps * (rows - 1) + (count - 1) // 2) // (count - 1) if count > 1 else steps


def column_model(words, rows: int, cols: int, sign_rank: int = 1) -> tuple[int, np.ndarray, np.ndarray]:
    """The columns' part of :func:`scaled_split`'s sign model, from a few of the matrix's
    rows: ``(sign_rank, col_negative, col_factors)``. A matrix without a negative sign among
    the sampled rows' (Adam's second moment) takes rank 1, which costs a bit per row and
    column."""
    words = np.ascontiguousarray(words).reshape(-1)
    if sign_rank > 1 and not (words.reshape(rows, cols)[_sample_rows(rows)] >> np.uint32(31)).any():
        sign_rank = 1
    if sign_rank > 1:
        return sign_rank, np.zeros(cols, np.uint8), sign_factors(words, rows, cols, sign_rank)
    return 1, column_signs(words, rows, cols), np.zeros(0, np.int8)


def scaled_split(words, rows: int, cols: int, sign_rank: int = 1, threads: int = 1,
                 columns: tuple[int, np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The streams of an fp32 matrix's words (uint32, ``rows * cols``): ``symbols`` (one byte
    per float: its log magnitude's residual from the row-and-column model plus
    ``RESIDUAL_ZERO``, times two, plus whether its sign disagrees with the pattern; a
    residual beyond ``RESIDUAL_REACH`` is 0 there, its log magnitude in ``escapes``,
    uint16), ``high`` and ``middle`` (mantissa bits 20..13 and 12..5), ``low`` (bits 4..0,
    eight floats in five bytes), and the models: ``row_fix``, ``col_fix`` (int16, 1/16 fixed
    point, as :func:`exponent_residual`'s) and the sign model: for ``sign_rank`` 1, a sign
    per row and per column, ``row_negative`` and ``col_negative`` (uint8, 1 negative); above,
    :func:`sign_factors`' ``row_factors`` and ``col_factors``. The columns' part is
    :func:`column_model`'s, unless ``columns`` gives it (one found on a whole matrix, for a
    few of its rows). The kernel codes a large matrix on up to ``threads`` threads, a range
    of rows each; the streams do not depend on ``threads``."""
    words = np.ascontiguousarray(words).reshape(-1)
    sign_rank, col_negative, col_factors = columns or column_model(words, rows, cols, sign_rank)
    left = np.zeros((rows, sign_rank), np.int8) if sign_rank > 1 else np.zeros(0, np.int8)  # the kernel's output
    count = rows * cols
    out = {"symbols": scratch.take(count), "high": scratch.take(count), "middle": scratch.take(count),
           "low": scratch.take(-(-count // 8) * 5), "row_fix": np.empty(rows, np.int16),
           "col_fix": np.empty(cols, np.int16), "row_negative": np.zeros(rows, np.uint8), "col_negative": col_negative,
           "sign_rank": sign_rank, "row_factors": left, "col_factors": col_factors}
    if kernels is not None:
        escapes = scratch.take(2 * count, np.uint16)
        found = kernels.scaled_split(words, rows, cols, col_negative, out["row_negative"], out["symbols"], escapes,
                                     out["high"], out["middle"], out["low"], out["row_fix"], out["col_fix"], sign_rank,
                                     left, col_factors, threads)
        out["escapes"] = escapes[:found].copy()
        return out
    if sign_rank == 1:
        out["row_negative"] = row_signs(words, rows, cols, col_negative)
    else:
        out["row_factors"] = row_factors(words, rows, cols, col_factors)
    log = (words >> np.uint32(LOW_BITS)).astype(np.int64) & LOG_MOST
    out["row_fix"][:], out["col_fix"][:] = _fit_rows_and_columns(log.reshape(rows, cols), np)
    residual = log - _prediction(out["row_fix"], out["col_fix"], np, LOG_MOST).reshape(-1)
    escaped = np.abs(residual) > RESIDUAL_REACH
    disagree = ((words >> np.uint32(31)).astype(np.uint8).reshape(rows, cols)
                ^ _predicted_negative(out, rows, cols)).reshape(-1)
    out["symbols"][:] = np.where(escaped, 0, (residual + RESIDUAL_ZERO) << 1) | disagree
    out["escapes"] = log[escaped].astype("<u2")
    out["high"][:] = words >> np.uint32(13)
    out["middle"][:] = words >> np.uint32(5)
    low = np.zeros(-(-count // 8) * 8, np.uint64)  # eight 5-bit fields to a 40-bit group
    low[:count] = words & np.uint32(31)
    packed = (low.reshape(-1, 8) << (5 * np.arange(8, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)
    out["low"][:] = packed.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :5].reshape(-1)
    return out


def scaled_join(streams: dict[str, np.ndarray], rows: int, cols: int, threads: int = 1) -> np.ndarray:
    """Inverse of :func:`scaled_split`: the uint32 words, on up to ``threads`` threads.
    ValueError where the streams do not fit the matrix (too few escapes, wrong lengths)."""
    count = rows * cols
    parts = {name: np.ascontiguousarray(streams[name]).reshape(-1).view(np.uint8)
             for name in ("symbols", "high", "middle", "low", "row_negative", "col_negative")}
    escapes = np.ascontiguousarray(streams["escapes"]).view("<u2")
    row_fix = np.ascontiguousarray(streams["row_fix"]).view("<i2")
    col_fix = np.ascontiguousarray(streams["col_fix"]).view("<i2")
    expected = {"symbols": count, "high": count, "middle": count, "low": -(-count // 8) * 5,
                "row_negative": rows, "col_negative": cols}
    for name, length in expected.items():
        if parts[name].size != length:
            raise ValueError(f"scaled stream {name} holds {parts[name].size} bytes, {length} expected")
    if row_fix.size != rows or col_fix.size != cols:
        raise ValueError("scaled model does not fit the matrix")
    sign_rank = int(streams.get("sign_rank", 1))
    factors = {name: np.ascontiguousarray(streams.get(name, np.zeros(0, np.int8))).reshape(-1).view(np.int8)
               for name in ("row_factors", "col_factors")}
    if not 1 <= sign_rank <= SIGN_RANK_MAX or (sign_rank > 1 and (factors["row_factors"].size != sign_rank * rows
                                                                   or factors["col_factors"].size != sign_rank * cols)):
        raise ValueError(f"scaled sign model of rank {sign_rank} does not fit the matrix")
    if kernels is not None:
        words = np.empty(count, np.uint32)
        kernels.scaled_join(parts["symbols"], escapes, parts["high"], parts["middle"], parts["low"], row_fix, col_fix,
                            parts["row_negative"], parts["col_negative"], rows, cols, words, sign_rank,
                            factors["row_factors"], factors["col_factors"], threads)
        return words
    symbols = parts["symbols"]
    escaped = symbols < 2
    if int(escaped.sum()) != escapes.size:
        raise ValueError(f"scaled stream escapes holds {escapes.size} values, {int(escaped.sum())} expected")
    log = (symbols >> 1).astype(np.int64) - RESIDUAL_ZERO + _prediction(row_fix, col_fix, np, LOG_MOST).reshape(-1)
    log[escaped] = escapes
    model = {**parts, **factors, "sign_rank": sign_rank}
    sign = ((symbols & 1).reshape(rows, cols) ^ _predicted_negative(model, rows, cols)).reshape(-1).astype(np.uint32)
    padded = np.zeros(-(-count // 8) * 8, np.uint8).reshape(-1, 8)
    padded[:, :5] = parts["low"].reshape(-1, 5)
    low = (padded.view("<u8").reshape(-1, 1) >> (5 * np.arange(8, dtype=np.uint64))) & np.uint64(31)
    return ((sign << np.uint32(31)) | ((log & LOG_MOST).astype(np.uint32) << np.uint32(LOW_BITS))
            | (parts["high"].astype(np.uint32) << np.uint32(13)) | (parts["middle"].astype(np.uint32) << np.uint32(5))
            | low.reshape(-1)[:count].astype(np.uint32))

