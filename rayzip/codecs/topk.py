"""``topk``: the k = max(1, ceil(ratio * numel)) entries of largest magnitude, globally.

Wire: ``indices`` (k, narrowest unsigned type holding numel-1: uint16, uint32 or uint64)
then ``values`` (k, fp32 or fp16): ``k * (index_bytes + value_bytes)`` bytes.

Usage::

    codec = get_codec("topk", ratio=0.01)
    payload = codec.encode(grad)
"""

from __future__ import annotations

from .base import Field, Payload, check_ratio, index_dtype, kept_count
from .sparse import VALUE_DTYPES, SparseCodec, check_value_dtype

__all__ = ["TopK", "top_magnitude"]


def top_magnitude(rows, k: int, xp):
    """Column indices of the k largest |values| in each row, ascending within a row."""
    width = rows.shape[-1]
    if k == width:
        return xp.broadcast_to(xp.arange(width), rows.shape).copy()
    picked = xp.argpartition(xp.abs(rows), width - k, axis=-1)[..., width - k:]
    return xp.sort(picked, axis=-1)


class TopK(SparseCodec):
    name = "topk"

    def __init__(self, ratio: float = 0.01, value_dtype: str = "fp32"):
        self.ratio = check_ratio(ratio)
        self.value_dtype = check_value_dtype(value_dtype)

    def wire_fields(self, numel: int) -> list[Field]:
        k = kept_count(self.ratio, numel)
        return [Field("indices", index_dtype(numel), k), Field("values", VALUE_DTYPES[self.value_dtype], k)]

    def _encode(self, flat, xp):
        k = kept_count(self.ratio, flat.size)
        indices = top_magnitude(flat, k, xp)
        return {"indices": indices.astype(index_dtype(flat.size)), "values": self._narrow_values(flat[indices])}

    def _to_coo(self, payload: Payload):
        return payload.arrays["indices"].astype("int64"), payload.arrays["values"].astype("float32")
