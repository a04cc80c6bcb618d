"""Dense baselines: ``none`` (fp32, bit-exact), ``fp16`` and ``bf16``.

Wire: one array ``values`` of ``numel`` elements; 4, 2 and 2 bytes each.
fp16 refuses values beyond its range (|x| > 65504) instead of sending Inf; bf16 rounds
to nearest even, exactly as ``torch.Tensor.bfloat16()`` does.

Usage::

    codec = get_codec("bf16")
    payload = codec.encode(grad)          # payload.nbytes == 2 * grad.numel()
"""

from __future__ import annotations

from typing import ClassVar

from .base import Codec, Field, Payload, WireOverflowError
from .. import cuda
from .kernels import all_finite, bf16_bits_finite, from_bf16_bits, to_bf16_bits, to_fp16, widen

__all__ = ["NoCompression", "Float16", "BFloat16"]


class _Cast(Codec):
    summable = True
    wire_dtype: ClassVar[str]

    def wire_fields(self, numel: int) -> list[Field]:
        return [Field("values", self.wire_dtype, numel)]

    def _decode(self, payload: Payload):
        return self._widen(payload.arrays["values"])

    def _widen(self, values):
        return values.astype("float32")

    def aggregate(self, payloads: list[Payload]) -> Payload:
        total = sum(self.decode_flat(p) for p in payloads)
        first = payloads[0]
        return Payload(codec=self.name, arrays={"values": self._narrow(total)}, numel=first.numel,
                       shape=first.shape, dtype=first.dtype, torch_out=first.torch_out)

    def _encode(self, flat, xp):
        return {"values": self._narrow(flat)}

    def _narrow(self, flat):
        raise NotImplementedError


class NoCompression(_Cast):
    """fp32 as it is: the bit-exact reference."""

    name = "none"
    lossless = True
    wire_dtype = "<f4"

    def _narrow(self, flat):
        return flat.copy()


class _Narrowing(_Cast):
    # The check runs on the narrowed output, so one pass covers both bad input and overflow.
    def _check_finite(self, flat, xp) -> None:
        pass

    def _encode(self, flat, xp):
        if cuda.enabled(flat):  # cast and check in one pass
            from ..cuda.cast import narrow

            values, finite = narrow(flat, self.name)
        else:
            values = self._narrow(flat)
            finite = self._all_finite(values, xp)
        if not finite:
            Codec._check_finite(self, flat, xp)  # NaN/Inf in the input: raises, naming the first
            raise WireOverflowError(f"{self.name}: |x| up to {float(abs(flat).max()):.4g} overflows {self.name}; "
                                    "use bf16 or none", first_index=int(xp.argmax(~xp.isfinite(self._widen(values)))))
        return {"values": values}


class Float16(_Narrowing):
    name = "fp16"
    wire_dtype = "<f2"

    def _narrow(self, flat):
        return to_fp16(flat)  # overflow becomes Inf, which _encode reports

    def _widen(self, values):
        return widen(values)

    def _all_finite(self, values, xp) -> bool:
        return all_finite(values)


class BFloat16(_Narrowing):
    """bfloat16 as its upper 16 bits, carried in uint16 (numpy has no bfloat16)."""

    name = "bf16"
    wire_dtype = "<u2"

    def _narrow(self, flat):
        return to_bf16_bits(flat)  # round half to even

    def _widen(self, values):
        return from_bf16_bits(values)

    def _all_finite(self, values, xp) -> bool:
        return bf16_bits_finite(values)
