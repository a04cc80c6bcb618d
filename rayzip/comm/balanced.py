"""Balanced sparse allreduce: bytes per worker that do not grow with the number of workers.

The sparse ring (:mod:`rayzip.comm.ring`) sums chunks as they travel, and a sum of n sparse
vectors fills in: its chunks, and the all-gather of the full union, grow with n. Here
(after Ok-Topk, Li and Hoefler, PPoPP'22) nothing is summed on the way and the sum is cut
back to k entries before it is shared:

1. **Balanced reduce-scatter.** The index space is cut into n regions, one per rank, holding
   about as many of last step's kept entries each (equal spans at the first step). Rank r
   sends its entries of region j straight to rank j, every message posted at once
   (:meth:`~rayzip.comm.transport.Transport.exchange`): its k entries cross once.
2. **Re-sparsification.** Each owner sums what it received and keeps the entries whose
   magnitude reaches the threshold, at most ``cap`` of them. The threshold is last step's:
   selection is one pass.
3. **All-gather** of the kept entries: each owner sends its region's to every other rank at
   once, about k in all, k (n-1)/n sent by each (as many as a ring would pass on).

So each worker sends about 2k (n-1)/n entries, whatever n is, plus a 16-byte header per
message (2(n-1) of them), in four latency-bound rounds (a header round and a payload round
per phase) at any n. A message's offsets are Elias-Fano coded over its region
(:class:`~rayzip.comm.ring.Chunk`'s coded form): regions shrink as n grows, and so do the
offsets' bits. What the re-sparsification drops is no worse than what the codec
drops: each rank hands its own share of it back to its error feedback
(:class:`BalancedAllReduce` records it; the engine adds it to the residuals), so the sum of
the residuals gains exactly the dropped mass.

Every rank holds the same kept entries after step 3 (each owner keeps its own rounded
through the wire type, as it sends them), so the next step's regions (quantiles of the kept
indices) and threshold (the k-th largest kept magnitude times its growth since the step
before, or the old one lowered when fewer than k were kept) are the same on every rank
without a word exchanged.

Usage::

    plan = Plan()                                          # one per segment, kept across steps
    total, kept = balanced_sparse_allreduce(indices, values, numel, transport, plan, k=1000)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .ring import Chunk
from ..codecs.sparse import coo_sum
from ..xp import array_module, as_array, to_torch

__all__ = ["Plan", "balanced_sparse_allreduce", "region_cap"]

# Lower the threshold at most this much in one step when too few entries were kept, and not
# at all when at least SHORT of k were (the sums' growth makes up for it).
MIN_LOWERING = 0.5
SHORT = 0.8
# The most the k-th largest magnitude is assumed to grow (or shrink) from one step to the next.
MAX_GROWTH = 1.1


def region_cap(k: int, world: int) -> int:
    """The most entries one owner keeps: a quarter above its share of k, so that a threshold
    gone stale (error feedback's growth in the first steps, a loss spike) cannot flood the
    all-gather; the rest goes back to error feedback."""
    return math.ceil(1.25 * k / world) + 16


@dataclass
class Plan:
    """One segment's region bounds and threshold, the same on every rank (None: not known
    yet, the first step's: equal spans, and each owner keeps its share of k by magnitude)."""

    bounds: list[int] | None = None
    threshold: float | None = None
    kth: float | None = None  # the k-th largest magnitude of the last sum that kept k or more

    def region_bounds(self, numel: int, world: int) -> list[int]:
        if self.bounds is not None and len(self.bounds) == world + 1 and self.bounds[-1] == numel:
            return self.bounds
        return [c * numel // world for c in range(world + 1)]

    def update(self, kept_indices, kept_values, k: int, numel: int, world: int) -> None:
        """Next step's bounds and threshold, from this step's kept entries (every rank's alike)."""
        xp = array_module(kept_values)
        count = int(kept_values.size)
        if count >= world:
            cuts = kept_indices[(xp.arange(1, world) * count) // world]
            self.bounds = [0, *(int(c) for c in cuts.tolist()), numel]
        if count == 0:
            self.threshold = None if self.threshold is None else self.threshold * MIN_LOWERING
            return
        magnitudes = xp.abs(kept_values)
        if count >= k:
            # This step's own k-th largest (what would have kept exactly k), carried on by its
            # growth since the step before: error feedback makes the sums grow for many steps,
            # and a threshold a step behind them keeps too many.
            kth = float(xp.partition(magnitudes, count - k)[count - k])
            growth = min(MAX_GROWTH, max(1 / MAX_GROWTH, kth / self.kth)) if self.kth else 1.0
            self.kth, threshold = kth, kth * growth
        else:
            # Too few: lower it, by less than the shortfall (counts fall faster than the
            # threshold rises on a gradient's tail), and measure growth afresh.
            base = self.threshold if self.threshold is not None else float(magnitudes.min())
            shortfall = count / k
            self.kth, threshold = None, base * (1.0 if shortfall >= SHORT else max(MIN_LOWERING, math.sqrt(shortfall)))
        self.threshold = threshold if threshold > 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"bounds": self.bounds, "threshold": self.threshold, "kth": self.kth}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Plan":
        bounds = state.get("bounds")
        return cls(None if bounds is None else [int(b) for b in bounds], state.get("threshold"), state.get("kth"))


def _cut(indices, values, bounds: list[int], xp) -> list[Chunk]:
    cuts = xp.searchsorted(indices, xp.asarray(bounds[1:-1], dtype=indices.dtype)).tolist()
    edges = [0, *cuts, int(indices.size)]
    return [Chunk(bounds[c + 1] - bounds[c], indices[edges[c]:edges[c + 1]] - bounds[c],
                  values[edges[c]:edges[c + 1]]) for c in range(len(bounds) - 1)]


def _sum(parts: list[Chunk], span: int, xp, senders: bool = False):
    """(sorted region-relative indices, float32 sums) of the parts' entries; with
    ``senders``, each sum divided by the parts that hold its entry (a part's entries are
    distinct; a dense part holds its nonzero ones)."""
    if any(p.dense for p in parts):
        total = xp.zeros(span, dtype=xp.float32)
        count = xp.zeros(span, dtype=xp.float32) if senders else None
        for p in parts:
            if p.dense:
                total += p.values
                if senders:
                    count += p.values != 0
            else:
                total[p.indices] += p.values
                if senders:
                    count[p.indices] += 1
        indices = xp.flatnonzero(total)
        return indices, total[indices] / count[indices] if senders else total[indices]
    indices = xp.concatenate([p.indices for p in parts])
    unique, sums = coo_sum(indices, xp.concatenate([p.values for p in parts]), xp)
    if senders:
        sums /= xp.bincount(xp.searchsorted(unique, indices), minlength=unique.size).astype(xp.float32)
    return unique, sums


def _select(indices, values, plan: Plan, quota: int, cap: int, xp):
    """The entries an owner keeps: magnitude at least the threshold (without one: the
    ``quota`` largest), at most ``cap`` (the largest), in index order."""
    magnitudes = xp.abs(values)
    if plan.threshold is None:
        limit = quota
        chosen = xp.arange(values.size)
    else:
        limit = cap
        chosen = xp.flatnonzero(magnitudes >= plan.threshold)
    if chosen.size > limit:
        top = xp.argpartition(-magnitudes[chosen], limit - 1)[:limit] if limit > 0 else chosen[:0]
        chosen = xp.sort(chosen[top])
    return indices[chosen], values[chosen]


def balanced_sparse_allreduce(indices, values, numel: int, transport, plan: Plan, k: int,
                              value_dtype: str = "fp32", sent: list | None = None, senders: bool = False):
    """Sum sparse vectors, keeping about the ``k`` largest entries of the sum: returns (the
    dense float32 sum (numel,) of the kept entries, their sorted global indices), the same on
    every worker, and updates ``plan`` for the next step. With ``senders``, each entry of the
    sum is divided by the workers that sent it before the cut (SparseLoCo's average): the
    owner counts them from what it received, at no cost in bytes.

    ``indices`` are sorted, unique global int64 indices and ``values`` float32, on numpy or
    cupy; messages move as uint8 torch tensors through ``transport.shift``. ``sent``, if
    given, collects (span, entries) of each message, entries -1 for a dense one.
    """
    xp = array_module(values)
    world, rank = transport.world, transport.rank
    bounds = plan.region_bounds(numel, world)
    spans = [bounds[c + 1] - bounds[c] for c in range(world)]
    chunks = _cut(indices, values, bounds, xp)

    def exchange(outgoing: list[Chunk | None], incoming_spans: list[int]) -> list[Chunk | None]:
        """Each other rank's chunk to it, all at once; the chunk each sent here, of its span."""
        packed = [None if c is None else c.pack(value_dtype, coded=True) for c in outgoing]
        if sent is not None:
            sent.extend((c.span, p[1]) for c, p in zip(outgoing, packed) if c is not None)
        received = transport.exchange([None if p is None else to_torch(p[0]) for p in packed],
                                      [0 if p is None else p[1] for p in packed])
        return [None if r is None else Chunk.unpack(as_array(r[0])[0], span, r[1], value_dtype, coded=True)
                for r, span in zip(received, incoming_spans)]

    # 1. Every other rank's entries of this rank's region, straight from it; summed in the
    # order of distance, as every owner does.
    received = exchange([None if j == rank else chunks[j] for j in range(world)], [spans[rank]] * world)
    parts = [chunks[rank]] + [received[(rank - d) % world] for d in range(1, world)]
    region_indices, region_values = _sum(parts, spans[rank], xp, senders)
    # 2. Cut back to this region's share of the k largest; rounded through the wire type here
    # too, so that the owner holds what the others receive, bit for bit.
    kept_indices, kept_values = _select(region_indices, region_values, plan, math.ceil(k / world),
                                        region_cap(k, world), xp)
    buf, entries = Chunk(spans[rank], kept_indices, kept_values).pack(value_dtype, coded=True)
    mine = Chunk.unpack(buf, spans[rank], entries, value_dtype, coded=True)
    # 3. All-gather: this region's kept entries to every other rank at once. Each worker sends
    # its own region n-1 times, where a ring passes on n-1 regions: the same bytes in all.
    regions = exchange([None if j == rank else mine for j in range(world)], spans)
    regions[rank] = mine
    all_indices, all_values = [], []
    for region, lo in zip(regions, bounds):
        indices = xp.flatnonzero(region.values) if region.dense else region.indices
        all_indices.append(indices + lo)
        all_values.append(region.values[indices] if region.dense else region.values)
    kept_global, kept_values = xp.concatenate(all_indices), xp.concatenate(all_values)
    out = xp.zeros(numel, dtype=xp.float32)
    out[kept_global] = kept_values
    plan.update(kept_global, kept_values, k, numel, world)
    return out, kept_global
