"""What each collective costs one worker, so that ``collective: auto`` can pick the cheapest.

A collective's :class:`Cost` is the bytes one worker sends and the messages it sends them
in; on a link of bandwidth B (bytes/s) and latency L (s) it takes ``bytes / B + messages * L``.
For a gradient of ``numel`` entries over n workers:

* allreduce (values summed in their wire form: fp32, fp16, bf16, randomk's values): a ring,
  2(n-1)/n of the payload in 2(n-1) messages;
* allgather (any codec: every payload goes to every worker, each decodes all n): (n-1)
  payloads in n-1 messages. Fixed-size payloads need no headers and no size exchange;
* ring (sparse codecs: :mod:`rayzip.comm.ring`): n-1 reduce-scatter steps, where the chunk
  sent at step s holds the union of s workers' entries, then n-1 all-gather steps of fully
  reduced chunks (the union of all n). Each step sends a 16-byte header, then the chunk in
  the smaller of its sparse and dense forms. With each worker keeping a fraction d of the
  entries, independently placed, the union of s holds 1 - (1 - d)^s: the fill-in that makes
  the ring's cost grow with n (15% at d = 1%, n = 16). Workers whose selections overlap fill
  in less, so the model is an upper bound for the ring.
* balanced (sparse codecs: :mod:`rayzip.comm.balanced`): n-1 direct sends of this worker's
  entries in each other worker's region, then n-1 sends of its own region's kept entries, each
  phase's posted at once; with k kept of ``numel`` and regions holding k/n each, every message
  holds k/n entries of a numel/n span: 2(n-1) messages of that, whatever the fill-in, in 4
  latency-bound rounds (headers, then payloads, per phase). The sum's
  cut back to k is what makes it flat in n (about 2k entries at any n, against the ring's
  union of n), at the price of the entries it cuts waiting in error feedback.

Usage::

    costs = collective_costs(codec, numel=25_000_000, world=8)
    best = min(costs, key=lambda name: costs[name].seconds(Link(bandwidth=12.5e6, latency=1e-4)))
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs.sparse import summed_value_bytes
from .ring import chunk_nbytes
from .transport import HEADER_BYTES, ring_allreduce_bytes

__all__ = ["Cost", "Link", "balanced_cost", "collective_costs", "kept_entries", "ring_cost"]


@dataclass(frozen=True)
class Link:
    """A worker's link: bytes per second and one-way latency in seconds."""

    bandwidth: float = 125e6  # 1 Gbit/s
    latency: float = 50e-6


@dataclass(frozen=True)
class Cost:
    """What one worker sends in one collective."""

    bytes: int
    messages: int

    def seconds(self, link: Link) -> float:
        return self.bytes / link.bandwidth + self.messages * link.latency

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes + other.bytes, self.messages + other.messages)


def ring_cost(numel: int, density: float, world: int, value_bytes: int) -> Cost:
    """The sparse ring's expected cost, each worker sending ``density * numel`` entries
    placed independently of the others' (see the module docstring)."""
    if world < 2:
        return Cost(0, 0)
    total = 0
    for c in range(world):  # chunk c spans [c*numel//n, (c+1)*numel//n): the ring's own cut
        span = (c + 1) * numel // world - c * numel // world
        # Every worker sends each chunk once per phase; averaged over the ring's positions, a
        # worker sends each union size 1..n-1 once in reduce-scatter, the full union in all-gather.
        for merged in range(1, world):
            total += chunk_nbytes(span, round(span * (1 - (1 - density) ** merged)), value_bytes)[0]
        total += (world - 1) * chunk_nbytes(span, round(span * (1 - (1 - density) ** world)), value_bytes)[0]
    steps = 2 * (world - 1)
    # Two messages a step (the header, then the chunk); bytes averaged over the workers.
    return Cost(total // world + steps * HEADER_BYTES, 2 * steps)


def kept_entries(codec, numel: int) -> int:
    """How many entries a sparse ``codec`` keeps of ``numel``: the same on every rank."""
    return {f.name: f for f in codec.wire_fields(numel)}["values"].count


def balanced_cost(numel: int, kept: int, world: int, value_bytes: int) -> Cost:
    """The balanced sparse allreduce's expected cost, ``kept`` entries of the sum kept and
    each worker sending as many (see the module docstring)."""
    if world < 2:
        return Cost(0, 0)
    total = 0
    for c in range(world):  # equal regions, each holding its share of the kept entries
        span = (c + 1) * numel // world - c * numel // world
        share = (c + 1) * kept // world - c * kept // world
        total += chunk_nbytes(span, min(span, share), value_bytes, coded=True)[0]
    # Each worker sends its entries of every other region, then its own region's kept entries
    # to every other rank, averaged over the workers: 2(n-1)/n of the total, in messages
    # posted a phase at once (a round of headers, then one of payloads).
    return Cost(2 * (world - 1) * total // world + 2 * (world - 1) * HEADER_BYTES, 4)


def collective_costs(codec, numel: int, world: int) -> dict[str, Cost]:
    """The cost of every collective that can carry ``codec``'s payloads of ``numel``
    entries among ``world`` workers, by name (``allreduce``, ``allgather``, ``ring``,
    ``balanced``, ``dense``)."""
    fields = {f.name: f for f in codec.wire_fields(numel)}
    costs = {"allgather": Cost((world - 1) * codec.wire_nbytes(numel), world - 1)}
    if codec.summable:  # only the values are summed (randomk's seed stays home)
        costs["allreduce"] = Cost(ring_allreduce_bytes(fields["values"].nbytes, world), 2 * (world - 1))
        # Summed on the wire, a summable codec never sends more than gathering would (equal
        # bytes at n = 2), and its sum is what every other rayzip path computes.
        del costs["allgather"]
    if codec.sparse:
        kept = kept_entries(codec, numel)
        costs["ring"] = ring_cost(numel, kept / numel if numel else 0.0, world, summed_value_bytes(codec))
        costs["balanced"] = balanced_cost(numel, kept, world, summed_value_bytes(codec))
        costs["dense"] = Cost(ring_allreduce_bytes(numel * summed_value_bytes(codec), world), 2 * (world - 1))
    return costs
