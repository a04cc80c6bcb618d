"""Shared machinery of the sparse codecs (top-k, group top-k, random-k) and their COO sums.

A sparse payload names some entries of the flat tensor and their values. ``to_coo`` gives
them as global int64 indices and float32 values, which is what the ring collective moves
and sums. Summing sparse payloads yields a ``coo`` payload (see :mod:`.coo`), decodable
by any sparse codec.
"""

from __future__ import annotations

from typing import Any

from .base import Codec, CodecError, Payload, WireOverflowError
from ..xp import array_module, as_array

__all__ = ["SparseCodec", "VALUE_DTYPES", "coo_sum", "scatter", "summed_value_bytes", "summed_value_dtype"]

VALUE_DTYPES = {"fp16": "<f2", "fp32": "<f4"}
SCALED_VALUE_DTYPES = ("int8", "2bit", "4bit")  # multiples of a scale per group: group top-k only
FP16_MAX = 65504.0


def check_value_dtype(value_dtype: str, scaled: bool = False) -> str:
    allowed = sorted(VALUE_DTYPES) + (list(SCALED_VALUE_DTYPES) if scaled else [])
    if value_dtype not in allowed:
        raise CodecError(f"value_dtype must be one of {allowed}, got {value_dtype!r}")
    return value_dtype


def summed_value_dtype(value_dtype: str) -> str:
    """The type partial sums of sparse values travel in (the ring collective): int8, 2-bit and 4-bit
    values are multiples of their group's scale, which a sum of several workers' values does not
    share, so they are summed in fp16."""
    return "fp16" if value_dtype in SCALED_VALUE_DTYPES else value_dtype


def summed_value_bytes(codec) -> int:
    """Bytes of one summed value of ``codec`` on the ring (fp32 for codecs without a value type)."""
    return 2 if summed_value_dtype(codec.value_dtype or "fp32") == "fp16" else 4


def scatter(indices, values, numel: int, xp):
    """Dense float32 vector with ``values`` at ``indices`` (indices unique)."""
    out = xp.zeros(numel, dtype=xp.float32)
    out[indices] = values
    return out


def coo_sum(indices, values, xp):
    """Sum duplicate indices: sorted unique indices and their float32 sums."""
    unique, inverse = xp.unique(indices, return_inverse=True)
    sums = xp.bincount(inverse.reshape(-1), weights=values.astype(xp.float64), minlength=unique.size)
    return unique, sums.astype(xp.float32)


class SparseCodec(Codec):
    sparse = True
    summable = False
    density: float = 1.0  # the kept fraction
    value_dtype: str = "fp32"

    def with_density(self, density: float) -> "SparseCodec":
        codec = type(self)(**{**self.params(), "density": density})
        codec.load_state_dict(self.state_dict())
        return codec

    def to_coo(self, payload: Payload) -> tuple[Any, Any]:
        """Global int64 indices and float32 values of ``payload``."""
        if payload.codec == "coo":
            arrays = payload.arrays
            return arrays["indices"].astype("int64"), arrays["values"].astype("float32")
        self._check_payload(payload)
        return self._to_coo(payload)

    def _to_coo(self, payload: Payload) -> tuple[Any, Any]:
        raise NotImplementedError

    def decode_flat(self, payload: Payload):
        indices, values = self.to_coo(payload)
        return scatter(indices, values, payload.numel, array_module(values))

    def residual(self, compensated, payload: Payload):
        # Only the kept entries change: no dense decode, no new array.
        flat, xp = as_array(compensated)
        flat = flat.reshape(-1)
        if flat.dtype != xp.float32:
            flat = flat.astype(xp.float32)
        indices, values = self.to_coo(payload)
        flat[indices] -= values
        return flat

    def _narrow_values(self, values):
        """Cast kept values to the wire dtype; fp16 refuses what it cannot hold."""
        if self.value_dtype == "fp16" and values.size and float(abs(values).max()) > FP16_MAX:
            raise self._fp16_overflow()
        return values.astype(VALUE_DTYPES[self.value_dtype])

    def _fp16_overflow(self) -> WireOverflowError:
        return WireOverflowError(f"{self.name}: kept values exceed the fp16 range (|x| > {FP16_MAX}); "
                                 "use value_dtype='fp32'")

    def aggregate(self, payloads: list[Payload]) -> Payload:
        """Sum sparse payloads into one ``coo`` payload (union of indices)."""
        from .coo import Coo

        parts = [self.to_coo(p) for p in payloads]
        xp = array_module(parts[0][1])
        indices, values = coo_sum(xp.concatenate([i for i, _ in parts]),
                                  xp.concatenate([v for _, v in parts]), xp)
        first = payloads[0]
        return Coo().from_coo(indices, values, first.numel, shape=first.shape, dtype=first.dtype,
                              torch_out=first.torch_out)

    def _decode(self, payload: Payload):  # decode_flat is overridden
        raise AssertionError("unreachable")

    def params(self) -> dict[str, Any]:
        return {"density": self.density, "value_dtype": self.value_dtype}
