"""``coo``: lossless sparse vectors, the form in which sparse payloads are summed.

Wire: ``indices`` (nnz, narrowest unsigned type holding numel-1) then ``values`` (nnz, fp32):
``nnz * (index_bytes + 4)`` bytes. The entry count is not sent; the receiver derives it
from the byte count it was told first, as the ring collective does.

Usage::

    total = get_codec("group_topk", density=0.01).aggregate([p0, p1])   # a coo payload
    dense = get_codec("coo").decode(total)
"""

from __future__ import annotations

import numpy as np

from .base import CodecError, Field, Payload, index_dtype
from .sparse import SparseCodec

__all__ = ["Coo"]


class Coo(SparseCodec):
    name = "coo"
    lossless = True

    @property
    def density(self) -> None:
        return None  # a sum's entries, whatever their count: nothing to tune

    def params(self):
        return {}

    def wire_fields(self, numel: int, nnz: int | None = None) -> list[Field]:
        if nnz is None:
            raise CodecError("a coo layout depends on its entry count: pass nnz")
        return [Field("indices", index_dtype(numel), nnz), Field("values", "<f4", nnz)]

    def wire_nbytes(self, numel: int, nnz: int | None = None) -> int:
        return sum(f.nbytes for f in self.wire_fields(numel, nnz))

    def from_bytes(self, data, like=None, *, numel=None, shape=None, dtype="float32",
                   torch_out=False, xp=np) -> Payload:
        if like is not None:
            numel, shape, dtype, torch_out = like.numel, like.shape, like.dtype, like.torch_out
        size = data.size if hasattr(data, "dtype") else len(data)  # an array, or bytes
        entry = np.dtype(index_dtype(numel)).itemsize + 4
        if size % entry:
            raise CodecError(f"coo payload of {size} bytes is not a whole number of {entry}-byte entries")
        return Payload.from_buffer(data, self.wire_fields(numel, size // entry), xp=xp, codec=self.name,
                                   numel=numel, shape=tuple(shape or (numel,)), dtype=dtype,
                                   torch_out=torch_out)

    def from_coo(self, indices, values, numel: int, **meta) -> Payload:
        arrays = {"indices": indices.astype(index_dtype(numel)), "values": values.astype("<f4")}
        meta.setdefault("shape", (numel,))
        return Payload(codec=self.name, arrays=arrays, numel=numel, **meta)

    def _encode(self, flat, xp):
        indices = xp.flatnonzero(flat)
        return {"indices": indices.astype(index_dtype(flat.size)), "values": flat[indices]}
