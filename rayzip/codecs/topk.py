"""``topk``: the k = max(1, ceil(density * numel)) entries of largest magnitude, globally.

Wire: ``indices`` (k, narrowest unsigned type holding numel-1: uint16, uint32 or uint64)
then ``values`` (k, fp32 or fp16): ``k * (index_bytes + value_bytes)`` bytes.

Usage::

    codec = get_codec("topk", density=0.01)
    payload = codec.encode(grad)
"""

from __future__ import annotations

from .base import Field, Payload, check_density, index_dtype, kept_count
from .sparse import VALUE_DTYPES, SparseCodec, check_value_dtype

__all__ = ["TopK", "top_magnitude"]


def top_magnitude(rows, k: int, xp):
    """Column indices of the k largest |values| in each row, ascending within a row. Of the
    entries tied at the k-th largest magnitude, those of the lowest indices: the rule of the
    C and CUDA kernels, so that every device and library picks the same set (an
    argpartition's pick among ties is its implementation's: numpy's and cupy's differ)."""
    width = rows.shape[-1]
    if k == width:
        return xp.broadcast_to(xp.arange(width), rows.shape).copy()
    # A partition finds each row's k-th largest magnitude; the entries at or above it are the
    # top k, already in index order, unless ties at the threshold make more than k. Those
    # rows keep the first of their ties, as many as there is room for.
    magnitudes = xp.abs(rows)
    kth = xp.partition(magnitudes, width - k, axis=-1)[..., width - k: width - k + 1]
    chosen = magnitudes >= kth
    if bool((chosen.sum(axis=-1) != k).any()):
        at = magnitudes == kth
        room = k - (magnitudes > kth).sum(axis=-1, keepdims=True)
        chosen &= ~at | (xp.cumsum(at, axis=-1) <= room)
    if rows.ndim == 1:
        return xp.flatnonzero(chosen)
    return (xp.flatnonzero(chosen) % width).reshape(*rows.shape[:-1], k)


class TopK(SparseCodec):
    name = "topk"

    def __init__(self, density: float = 0.01, value_dtype: str = "fp32"):
        self.density = check_density(density)
        self.value_dtype = check_value_dtype(value_dtype)

    def wire_fields(self, numel: int) -> list[Field]:
        k = kept_count(self.density, numel)
        return [Field("indices", index_dtype(numel), k), Field("values", VALUE_DTYPES[self.value_dtype], k)]

    def _encode(self, flat, xp):
        k = kept_count(self.density, flat.size)
        indices = top_magnitude(flat, k, xp)
        return {"indices": indices.astype(index_dtype(flat.size)), "values": self._narrow_values(flat[indices])}

    def _to_coo(self, payload: Payload):
        return payload.arrays["indices"].astype("int64"), payload.arrays["values"].astype("float32")
