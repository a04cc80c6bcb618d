"""Kept values in a few bits: a sign and one of 2**(b-1) magnitudes, as multiples of a scale
per group (group top-k's ``value_dtype`` "2bit" and "4bit").

Each group's scale is one byte, the mean of its kept magnitudes to a quarter of a binade
(``2 ** ((q - SCALE_ZERO) / 4)``; 0 for a group of zeros). Every kept magnitude over its
group's scale is then near 1 whatever the layer, so one set of magnitudes serves the whole
payload: Lloyd's algorithm on those ratios (quantiles to start, a few rounds), sent as fp32.
Each value's code is its sign (bit 0) and the nearest magnitude's index (the bits above).

Usage::

    arrays = quantize(values, group, groups, bits=2, xp=np)   # scales, levels, values
    values = dequantize(arrays, group, values.size, bits=2, xp=np)
"""

from __future__ import annotations

from .bitpack import pack_bits, packed_nbytes, unpack_bits

__all__ = ["BITS", "SCALE_ZERO", "dequantize", "quantize", "wire_bytes"]

BITS = {"2bit": 2, "4bit": 4}
SCALE_ZERO = 192
ROUNDS = 4


def wire_bytes(count: int, groups: int, bits: int) -> tuple[int, int, int]:
    """``(scale bytes, level floats, value bytes)`` of ``count`` values in ``groups`` groups."""
    return groups, 1 << (bits - 1), packed_nbytes(count, bits)


def quantize(values, group, groups: int, bits: int, xp) -> dict:
    """``values`` (float, 1-D), ``group`` each one's group (int64, of ``groups``): the groups'
    scale bytes, the payload's magnitudes and the packed codes."""
    magnitude = xp.abs(values.astype(xp.float32))
    mean = (xp.bincount(group, weights=magnitude, minlength=groups)
            / xp.maximum(xp.bincount(group, minlength=groups), 1)).astype(xp.float32)
    q = xp.clip(xp.rint(4 * xp.log2(xp.where(mean > 0, mean, 1))) + SCALE_ZERO, 1, 255)
    scales = xp.where(mean > 0, q, 0).astype(xp.uint8)
    scale = _scale(scales, xp)[group]
    ratio = magnitude / xp.where(scale > 0, scale, 1)
    levels = _lloyd(ratio[scale > 0], 1 << (bits - 1), xp)
    index = _nearest(ratio, levels, xp)
    codes = (values < 0).astype(xp.uint8) | (index.astype(xp.uint8) << 1)
    return {"scales": scales, "levels": levels, "values": pack_bits(codes, bits, xp)}


def dequantize(arrays: dict, group, count: int, bits: int, xp):
    """Inverse of :func:`quantize`: float32 values."""
    codes = unpack_bits(arrays["values"], bits, count, xp)
    magnitude = arrays["levels"].astype(xp.float32)[(codes >> 1).astype(xp.int64)]
    return xp.where(codes & 1, -magnitude, magnitude) * _scale(arrays["scales"], xp)[group]


def _scale(scales, xp):
    return xp.where(scales > 0, xp.exp2((scales.astype(xp.float32) - SCALE_ZERO) / 4), 0).astype(xp.float32)


def _nearest(ratio, levels, xp):
    """Each ratio's nearest level (``levels`` ascending)."""
    return xp.searchsorted((levels[1:] + levels[:-1]) / 2, ratio)


def _lloyd(ratio, count: int, xp):
    """``count`` ascending magnitudes for ``ratio`` (1-D, >= 0): quantiles to start, then
    rounds of Lloyd's algorithm; an empty cell keeps its magnitude."""
    if not ratio.size:
        return xp.zeros(count, dtype=xp.float32)
    levels = xp.quantile(ratio, (xp.arange(count, dtype=xp.float64) + 0.5) / count).astype(xp.float32)
    for _ in range(ROUNDS):
        cell = _nearest(ratio, levels, xp)
        sums = xp.bincount(cell, weights=ratio, minlength=count)
        counts = xp.bincount(cell, minlength=count)
        levels = xp.sort(xp.where(counts > 0, sums / xp.maximum(counts, 1), levels).astype(xp.float32))
    return levels
