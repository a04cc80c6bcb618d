"""``randomk``: k = max(1, ceil(density * numel)) entries chosen by a seed; only values travel.

The indices are stratified: entry j is drawn uniformly from the j-th of k equal strata
of the flat tensor, so indices never repeat and every entry has probability ~k/numel.
They are regenerated from the 8-byte seed by an integer hash, identically on numpy and
cupy. Workers that share ``seed`` pick the same indices at the same call, so their
payloads sum in compressed form (``aggregate``) and travel by a plain allreduce.

Wire: ``seed`` (1 uint64) then ``values`` (k, fp32 or fp16): ``8 + k * value_bytes``.

Usage::

    codec = get_codec("randomk", density=0.01, seed=7)    # same seed on every worker
    payload = codec.encode(grad)
"""

from __future__ import annotations

from .base import CodecError, Field, Payload, kept_count, check_int, check_density
from .seeding import call_seed, mix64
from .sparse import VALUE_DTYPES, SparseCodec, check_value_dtype
from ..xp import array_module

__all__ = ["RandomK", "random_indices"]


def random_indices(seed: int, numel: int, k: int, xp):
    """k distinct sorted int64 indices below numel, one per stratum, from ``seed``."""
    strata = xp.arange(k + 1, dtype=xp.int64)
    bounds = (strata * numel) // max(k, 1)
    start, size = bounds[:-1], bounds[1:] - bounds[:-1]
    offsets = mix64(seed, strata[:-1], xp) % size.astype(xp.uint64)
    return start + offsets.astype(xp.int64)


class RandomK(SparseCodec):
    name = "randomk"
    summable = True

    def __init__(self, density: float = 0.01, seed: int = 0, value_dtype: str = "fp32"):
        self.density = check_density(density)
        self.seed = check_int("seed", seed, 0, (1 << 64) - 1)
        self.value_dtype = check_value_dtype(value_dtype)
        self.calls = 0  # advances once per encode; saved with the codec's state

    def params(self):
        return {**super().params(), "seed": self.seed}

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])

    def wire_fields(self, numel: int) -> list[Field]:
        return [Field("seed", "<u8", 1), Field("values", VALUE_DTYPES[self.value_dtype], kept_count(self.density, numel))]

    def _encode(self, flat, xp):
        seed = call_seed(self.seed, self.calls)
        self.calls += 1
        indices = random_indices(seed, flat.size, kept_count(self.density, flat.size), xp)
        return {"seed": xp.asarray([seed], dtype="<u8"), "values": self._narrow_values(flat[indices])}

    def _to_coo(self, payload: Payload):
        values = payload.arrays["values"]
        xp = array_module(values)
        seed = int(payload.arrays["seed"][0])
        return random_indices(seed, payload.numel, values.size, xp), values.astype(xp.float32)

    def aggregate(self, payloads: list[Payload]) -> Payload:
        """Sum values of payloads drawn with one seed; stays a randomk payload."""
        seeds = {int(p.arrays["seed"][0]) for p in payloads}
        if len(seeds) != 1:
            raise CodecError("randomk payloads with different seeds cannot be summed in compressed form")
        first = payloads[0]
        total = sum(p.arrays["values"].astype("float32") for p in payloads)
        arrays = {"seed": first.arrays["seed"], "values": self._narrow_values(total)}
        return Payload(codec=self.name, arrays=arrays, numel=first.numel, shape=first.shape,
                       dtype=first.dtype, torch_out=first.torch_out)
