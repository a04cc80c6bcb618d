"""``qsgd``: QSGD with ``levels`` s, stochastic rounding, one norm per bucket, bit-packed.

Each bucket of ``bucket_size`` B entries is scaled by its L2 norm; |x|/norm * s is rounded
up or down at random so that the result is unbiased, giving a signed level in [-s, s],
sent as level + s in b = ceil(log2(2s + 1)) bits.

Wire, for numel n: ``norms`` (ceil(n / B), fp32) then ``codes`` (ceil(n * b / 8) bytes):
``4 * ceil(n / B) + ceil(n * b / 8)``. Defaults s = 127, B = 512: 8 bits, 3.97x.

Error feedback needs the variance bound min(B/s^2, sqrt(B)/s) below 1 (s > sqrt(B)); with
fewer levels the residual grows without bound, so :class:`ErrorFeedback` refuses it.

Usage::

    codec = get_codec("qsgd", levels=31, seed=0)     # 6-bit codes
    payload = codec.encode(grad)
"""

from __future__ import annotations

import math

import numpy as np

from .base import Codec, Field, Payload, check_int
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .kernels import fused, fused_for
from .. import cuda
from .seeding import call_seed, mix64
from ..xp import array_module

__all__ = ["QSGD"]


class QSGD(Codec):
    name = "qsgd"

    def __init__(self, levels: int = 127, bucket_size: int = 512, seed: int = 0):
        self.levels = check_int("levels", levels, 1, (1 << 15) - 1)
        self.bucket_size = check_int("bucket_size", bucket_size, 1)
        self.seed = check_int("seed", seed, 0, (1 << 64) - 1)
        self.bits = math.ceil(math.log2(2 * self.levels + 1))
        self.calls = 0

    def params(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}

    @property
    def variance_bound(self) -> float:
        """omega with E|Q(x) - x|^2 <= omega |x|^2 (Alistarh et al. 2017, Lemma 3.1)."""
        b, s = self.bucket_size, self.levels
        return min(b / s**2, math.sqrt(b) / s)

    def error_feedback_issue(self) -> str | None:
        if self.variance_bound >= 1:
            return (f"qsgd with levels={self.levels}, bucket_size={self.bucket_size} has variance "
                    f"bound {self.variance_bound:.2f} >= 1, so error feedback would diverge; "
                    f"use levels > sqrt(bucket_size) = {math.sqrt(self.bucket_size):.1f}")
        return None

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])

    def wire_fields(self, numel: int) -> list[Field]:
        buckets = -(-numel // self.bucket_size)
        return [Field("norms", "<f4", buckets), Field("codes", "|u1", packed_nbytes(numel, self.bits))]

    def _kernel_checks_finite(self, flat) -> bool:
        return cuda.enabled(flat)

    def _buckets(self, flat, xp):
        buckets = -(-flat.size // self.bucket_size)
        padded = xp.zeros(buckets * self.bucket_size, dtype=xp.float32)
        padded[: flat.size] = flat
        return padded.reshape(buckets, self.bucket_size)

    def _encode(self, flat, xp):
        seed = call_seed(self.seed, self.calls)
        self.calls += 1
        if fused_for(flat):  # one pass per bucket in C, the same noise
            norms = np.empty(-(-flat.size // self.bucket_size), dtype="<f4")
            wide = self.bits > 8
            codes = np.empty(flat.size, dtype=np.uint16 if wide else np.uint8)
            fused.qsgd(flat, self.bucket_size, self.levels, seed, norms, codes, wide)
            return {"norms": norms, "codes": pack_bits(codes, self.bits, np)}
        if cuda.enabled(flat):  # a block per bucket: norm, noise and codes in one pass
            from ..cuda.qsgd import encode

            norms, codes, finite = encode(flat, self.bucket_size, self.levels, seed, self.bits)
            if not finite:
                self._check_finite(flat, xp)
            return {"norms": norms, "codes": pack_bits(codes, self.bits, xp)}
        rows = self._buckets(flat, xp)
        norms = xp.sqrt(xp.einsum("ij,ij->i", rows, rows, dtype=xp.float32))
        scale = xp.where(norms > 0, self.levels / xp.where(norms > 0, norms, 1), 0).astype(xp.float32)
        magnitude = xp.abs(rows) * scale[:, None]
        # Uniform noise in [0, 1) from a counter hash: element i takes 24 bits of
        # mix64(seed, i // 2), the top ones for even i, the next for odd i. The C encoder
        # draws the same, and so does cupy.
        hashes = mix64(seed, xp.arange(-(-rows.size // 2), dtype=xp.uint64), xp)
        pairs = xp.stack([hashes >> xp.uint64(40), (hashes >> xp.uint64(16)) & xp.uint64(0xFFFFFF)], axis=1)
        noise = pairs.reshape(-1)[: rows.size].astype(xp.float32).reshape(rows.shape)
        noise *= xp.float32(1.0 / (1 << 24))
        level = xp.minimum(xp.floor(magnitude + noise), self.levels)
        signed = xp.where(rows < 0, -level, level).reshape(-1)[: flat.size]
        codes = (signed + self.levels).astype(xp.uint16)
        return {"norms": norms.astype("<f4"), "codes": pack_bits(codes, self.bits, xp)}

    def _decode(self, payload: Payload):
        norms, packed = payload.arrays["norms"], payload.arrays["codes"]
        xp = array_module(norms)
        n = payload.numel
        if cuda.enabled(norms):
            from ..cuda.qsgd import decode

            codes = packed if self.bits == 8 else unpack_bits(packed, self.bits, n, xp)  # 8 bits: the codes
            return decode(norms, codes, self.bucket_size, self.levels, n)
        codes = unpack_bits(packed, self.bits, n, xp)
        level = codes.astype(xp.float32) - self.levels
        padded = xp.zeros(norms.size * self.bucket_size, dtype=xp.float32)
        padded[:n] = level
        rows = padded.reshape(norms.size, self.bucket_size) * (norms / self.levels)[:, None]
        return rows.reshape(-1)[:n]
