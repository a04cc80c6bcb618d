"""The Compressor role: a codec turns a tensor into a :class:`Payload` and back.

A payload is a few named arrays. Their bytes, concatenated in field order, are exactly
what crosses the network: ``payload.nbytes == len(payload.to_bytes())``, and both equal
the codec's documented formula ``codec.wire_nbytes(numel)``. Shape and dtype are not
sent: both sides of a collective know the bucket they exchange.

Usage::

    codec = get_codec("group_topk", density=0.01)
    payload = codec.encode(grad)                     # torch tensor, numpy or cupy array
    wire = payload.to_bytes()                        # len(wire) == codec.wire_nbytes(grad.numel())
    back = codec.decode(codec.from_bytes(wire, like=payload))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..xp import address, array_module, as_array, asnumpy, is_torch, to_torch
from .kernels import all_finite

__all__ = [
    "Codec",
    "CodecError",
    "Field",
    "NonFiniteError",
    "WireOverflowError",
    "Payload",
    "check_density",
]


class CodecError(ValueError):
    """Bad codec parameters or a payload that does not fit its codec."""


class NonFiniteError(FloatingPointError):
    """The input holds NaN or Inf, which no lossy codec can represent faithfully.
    ``first_index`` is the flat index of the first such value, where known."""

    first_index: int | None = None


class WireOverflowError(NonFiniteError, CodecError):
    """A finite value beyond the wire type's range (fp16): it would arrive as Inf.
    ``first_index`` is the flat index of the first such value, where known."""

    def __init__(self, message: str, first_index: int | None = None):
        super().__init__(message)
        self.first_index = first_index


@dataclass(frozen=True)
class Field:
    """One array of a payload's wire layout."""

    name: str
    dtype: str  # numpy dtype string with explicit byte order, e.g. "<f4"
    count: int

    @property
    def nbytes(self) -> int:
        return np.dtype(self.dtype).itemsize * self.count


@dataclass
class Payload:
    """Named arrays (numpy or cupy) in wire order, plus what both ends already know."""

    codec: str
    arrays: dict[str, Any]
    numel: int
    shape: tuple[int, ...]
    dtype: str = "float32"  # the input's dtype; decode restores it
    torch_out: bool = False  # decode to a torch tensor (the input was one)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    def to_bytes(self) -> bytes:
        return asnumpy(self.to_array()).tobytes()

    def to_array(self):
        """The wire bytes as one uint8 array on the payload's device (numpy or cupy)."""
        arrays = list(self.arrays.values())
        xp = array_module(arrays[0]) if arrays else np
        parts = [xp.ascontiguousarray(a).view(xp.uint8).reshape(-1) for a in arrays]
        return xp.concatenate(parts) if parts else xp.zeros(0, xp.uint8)

    def fields(self) -> list[Field]:
        return [Field(k, asnumpy(a[:0]).dtype.str, int(a.size)) for k, a in self.arrays.items()]

    @classmethod
    def from_buffer(cls, data, fields: list[Field], xp=np, **kwargs) -> "Payload":
        """Split ``data`` (bytes-like or uint8 array) into ``fields``; the size must match."""
        buf = data if hasattr(data, "dtype") else np.frombuffer(data, dtype=np.uint8)  # an array, or bytes
        expected = sum(f.nbytes for f in fields)
        if buf.size != expected:
            raise CodecError(f"payload has {buf.size} bytes, its layout needs {expected}")
        if xp is not np and isinstance(buf, np.ndarray):
            buf = xp.asarray(buf)
        arrays, offset = {}, 0
        for f in fields:
            part = buf[offset : offset + f.nbytes]
            if address(part) % np.dtype(f.dtype).itemsize:
                # A field behind an odd count of narrower entries (fp32 values after uint16
                # offsets), or in a buffer that starts at an odd address, is misaligned for
                # its type: numpy copes, a cupy kernel faults with a sticky misaligned-address
                # error. A copy is aligned.
                part = part.copy()
            arrays[f.name] = part.view(np.dtype(f.dtype))
            offset += f.nbytes
        return cls(arrays=arrays, **kwargs)


def check_density(density: float) -> float:
    if not (isinstance(density, (int, float)) and 0.0 < density <= 1.0):
        raise CodecError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def check_int(name: str, value: int, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CodecError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise CodecError(f"{name} must be {bound}, got {value}")
    return int(value)


def kept_count(density: float, size: int) -> int:
    """k = max(1, ceil(density * size)), and 0 for an empty span."""
    if size <= 0:
        return 0
    # The epsilon keeps density*size that is an integer in exact arithmetic (0.01*1000)
    # from rounding up through float error.
    return min(size, max(1, math.ceil(density * size - 1e-9)))


def index_dtype(span: int) -> str:
    """Narrowest unsigned type that holds offsets 0..span-1."""
    if span <= 1 << 16:
        return "<u2"
    if span <= 1 << 32:
        return "<u4"
    return "<u8"


def find_nonfinite(flat, xp) -> tuple[int, int] | None:
    """``(count, first_index)`` of NaN/Inf entries, or None."""
    if flat.size == 0 or all_finite(flat):  # one fast pass in the common case
        return None
    bad = ~xp.isfinite(flat)
    return int(bad.sum()), int(xp.argmax(bad))


class Codec:
    """Base of every codec. Subclasses implement ``_encode``, ``_decode``, ``wire_fields``.

    ``encode`` flattens to float32 on the input's device, refuses NaN/Inf (raising
    :class:`NonFiniteError` with the count and first index), and records what ``decode``
    needs to return the input's kind, dtype and shape.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    summable: ClassVar[bool] = False  # aggregate() sums payloads without decoding them
    sparse: ClassVar[bool] = False  # payloads are (index, value) pairs: to_coo() works
    value_dtype: str | None = None  # the wire type of the values a sparse codec sends; None for the others

    @property
    def density(self) -> float | None:
        """The fraction of entries sent, for a codec that sends a fraction of them (top-k,
        random-k, group top-k); None for one that sends every entry in some form."""
        return None

    def with_density(self, density: float) -> "Codec":
        """This codec, sending ``density`` of the entries, with its state (a seeded codec's
        call count). Only for codecs with a :attr:`density`."""
        raise CodecError(f"{self.name} sends every entry: it has no density to change")

    def params(self) -> dict[str, Any]:
        """The constructor arguments, so ``type(c)(**c.params())`` rebuilds ``c``."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def state_dict(self) -> dict[str, Any]:
        """What a stateful codec (a seeded one) must carry across checkpoints; {} by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def error_feedback_issue(self) -> str | None:
        """Why error feedback would diverge with this configuration, or None when it is sound.

        Error feedback needs a contractive codec: |x - decode(encode(x))| < |x| for every x.
        """
        return None

    # --- wire layout -------------------------------------------------------------------
    def wire_fields(self, numel: int) -> list[Field]:
        raise NotImplementedError

    def wire_nbytes(self, numel: int) -> int:
        """Exact bytes on the wire for ``numel`` elements (the documented formula)."""
        return sum(f.nbytes for f in self.wire_fields(numel))

    def from_bytes(self, data, like: Payload | None = None, *, numel: int | None = None,
                   shape: tuple[int, ...] | None = None, dtype: str = "float32",
                   torch_out: bool = False, xp=np) -> Payload:
        """Rebuild a payload from its wire bytes. Give ``like`` (a payload of the same
        tensor) or ``numel``/``shape``: the receiver knows them, the wire does not carry them."""
        if like is not None:
            numel, shape, dtype, torch_out = like.numel, like.shape, like.dtype, like.torch_out
        if numel is None:
            raise CodecError("from_bytes needs the element count (numel= or like=)")
        shape = tuple(shape) if shape is not None else (numel,)
        return Payload.from_buffer(data, self.wire_fields(numel), xp=xp, codec=self.name,
                                   numel=numel, shape=shape, dtype=dtype, torch_out=torch_out)

    # --- compress / decompress ---------------------------------------------------------
    def encode(self, x) -> Payload:
        flat, xp = as_array(x)
        shape = tuple(flat.shape)
        dtype = str(x.dtype).replace("torch.", "")
        flat = xp.ascontiguousarray(flat.reshape(-1))
        if flat.dtype != xp.float32:
            flat = flat.astype(xp.float32)
        if not self._kernel_checks_finite(flat):
            self._check_finite(flat, xp)
        arrays = self._encode(flat, xp)
        return Payload(codec=self.name, arrays=arrays, numel=int(flat.size), shape=shape,
                       dtype=dtype, torch_out=is_torch(x))

    def decode(self, payload: Payload):
        flat = self.decode_flat(payload)
        return restore(flat, payload)

    def decode_flat(self, payload: Payload):
        """Decoded float32 1-D array on the payload's device."""
        self._check_payload(payload)
        return self._decode(payload)

    def _check_payload(self, payload: Payload) -> None:
        if payload.codec != self.name:
            raise CodecError(f"{self.name} cannot decode a {payload.codec!r} payload")

    def _kernel_checks_finite(self, flat) -> bool:
        """Whether ``_encode`` finds NaN/Inf itself as it reads ``flat`` (a fused kernel), and
        then calls :meth:`_check_finite` to raise; ``encode`` then spends no pass of its own."""
        return False

    def _check_finite(self, flat, xp) -> None:
        found = find_nonfinite(flat, xp)
        if found:
            count, first = found
            error = NonFiniteError(
                f"{self.name}: input has {count} NaN/Inf value(s), first at flat index {first}"
            )
            error.first_index = first
            raise error

    def _encode(self, flat, xp) -> dict[str, Any]:
        raise NotImplementedError

    def _decode(self, payload: Payload):
        raise NotImplementedError

    def residual(self, compensated, payload: Payload):
        """What ``payload`` leaves out of ``compensated``: flat float32, possibly reusing
        ``compensated``'s memory (the caller gives it up)."""
        flat, xp = as_array(compensated)
        return (flat.reshape(-1) - self.decode_flat(payload)).astype(xp.float32, copy=False)

    # --- compressed-domain sum ---------------------------------------------------------
    def aggregate(self, payloads: list[Payload]) -> Payload:
        """Sum payloads without a full decode. Only for codecs with ``summable`` or
        ``sparse`` set; the others raise, and their collective gathers then decodes."""
        raise CodecError(
            f"{self.name} payloads cannot be summed in compressed form; "
            "gather them and decode each (the allgather collective)"
        )


def restore(flat, payload: Payload):
    """Give decoded float32 ``flat`` the input's shape, dtype and kind (torch or array)."""
    out = flat.reshape(payload.shape)
    if payload.torch_out:
        import torch

        t = to_torch(out)
        target = getattr(torch, payload.dtype)
        return t if t.dtype == target else t.to(target)
    if payload.dtype != "float32":
        return out.astype(payload.dtype)
    return out
