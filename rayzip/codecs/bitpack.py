"""Dense packing of b-bit unsigned codes (1 <= b <= 16) into exactly ceil(n*b/8) bytes.

Code ``i`` occupies bits ``[i*b, (i+1)*b)`` of the little-endian bit stream. Codes wider
than 8 bits are split into a plane of low bytes followed by the packed high ``b-8`` bits,
which keeps every width on the fast <= 8-bit path and still totals ceil(n*b/8) bytes.

Usage::

    packed = pack_bits(codes, bits=5, xp=np)      # uint8, ceil(len(codes)*5/8) bytes
    codes2 = unpack_bits(packed, bits=5, count=len(codes), xp=np)
"""

from __future__ import annotations

from ..xp import address

__all__ = ["packed_nbytes", "pack_bits", "unpack_bits"]


def packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")


def pack_bits(codes, bits: int, xp):
    """Pack unsigned integer ``codes`` (each < 2**bits) into a uint8 array."""
    _check_bits(bits)
    codes = codes.ravel()
    if bits == 8:  # uint8 codes are already the stream: no copy
        return codes.astype(xp.uint8, copy=False)
    if bits == 16:
        return codes.astype("<u2").view(xp.uint8)
    if bits > 8:
        low = (codes & 0xFF).astype(xp.uint8)
        high = _pack_narrow((codes >> 8).astype(xp.uint8), bits - 8, xp)
        return xp.concatenate([low, high])
    return _pack_narrow(codes.astype(xp.uint8), bits, xp)


def unpack_bits(packed, bits: int, count: int, xp):
    """Inverse of :func:`pack_bits`: ``count`` codes as uint16 (uint8 when bits <= 8)."""
    _check_bits(bits)
    if packed.size != packed_nbytes(count, bits):
        raise ValueError(
            f"packed stream has {packed.size} bytes, {count} codes of {bits} bits need "
            f"{packed_nbytes(count, bits)}"
        )
    if bits == 8:
        return packed.copy()
    if bits == 16:
        if address(packed) % 2:  # a field behind an odd count of bytes: a cupy kernel would fault
            packed = packed.copy()
        return packed.view("<u2").astype(xp.uint16)
    if bits > 8:
        low = packed[:count].astype(xp.uint16)
        high = _unpack_narrow(packed[count:], bits - 8, count, xp).astype(xp.uint16)
        return low | (high << 8)
    return _unpack_narrow(packed, bits, count, xp)


def _pack_narrow(codes, bits: int, xp):
    if 8 % bits == 0:
        return _pack_within_bytes(codes, bits, xp)
    # Eight codes of b <= 8 bits make exactly b bytes: assemble them in one uint64 word.
    count = codes.size
    groups = (count + 7) // 8
    padded = xp.zeros(groups * 8, dtype=xp.uint64)
    padded[:count] = codes
    padded = padded.reshape(groups, 8)
    word = xp.zeros(groups, dtype=xp.uint64)
    for j in range(8):
        word |= padded[:, j] << xp.uint64(j * bits)
    stream = word.astype("<u8").view(xp.uint8).reshape(groups, 8)[:, :bits]
    return stream.reshape(-1)[: packed_nbytes(count, bits)]


def _unpack_narrow(packed, bits: int, count: int, xp):
    if 8 % bits == 0:
        return _unpack_within_bytes(packed, bits, count, xp)
    groups = (count + 7) // 8
    stream = xp.zeros(groups * 8, dtype=xp.uint8).reshape(groups, 8)
    flat = xp.zeros(groups * bits, dtype=xp.uint8)
    flat[: packed.size] = packed
    stream[:, :bits] = flat.reshape(groups, bits)
    word = stream.reshape(-1).view("<u8")
    mask = xp.uint64((1 << bits) - 1)
    out = xp.empty((groups, 8), dtype=xp.uint8)
    for j in range(8):
        out[:, j] = (word >> xp.uint64(j * bits)) & mask
    return out.reshape(-1)[:count]


def _pack_within_bytes(codes, bits: int, xp):
    # 1, 2 or 4 bits: 8 // b codes fill one byte exactly, so the stream is built in uint8
    # (the uint64 path would widen every code to 8 bytes first).
    per = 8 // bits
    count = codes.size
    padded = codes if count % per == 0 else xp.concatenate([codes, xp.zeros(per - count % per, dtype=xp.uint8)])
    rows = padded.reshape(-1, per)
    out = rows[:, 0].copy()
    for j in range(1, per):
        out |= rows[:, j] << xp.uint8(j * bits)
    return out


def _unpack_within_bytes(packed, bits: int, count: int, xp):
    per = 8 // bits
    mask = xp.uint8((1 << bits) - 1)
    out = xp.empty((packed.size, per), dtype=xp.uint8)
    for j in range(per):
        out[:, j] = (packed >> xp.uint8(j * bits)) & mask
    return out.reshape(-1)[:count]
