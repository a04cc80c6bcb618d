"""The Communicator role: move one worker's payload, return the average over all workers.

* :class:`AllReduce`: sum the payload's values in place (``none``, ``fp16``, ``bf16``, and
  ``randomk``, whose workers share indices through the seed).
* :class:`Ring`: sparse ring reduce-scatter + all-gather of (index, value) chunks
  (``topk``, ``group_topk``, ``randomk``).
* :class:`AllGather`: gather every payload, decode each, average locally (any codec; the
  only choice for ``qsgd`` and ``dct_quant``, which cannot be summed compressed).
* :class:`BalancedAllReduce`: balanced sparse reduce-scatter, the sum cut back to about k
  entries, all-gather (sparse codecs; :mod:`rayzip.comm.balanced`): bytes per worker flat
  in the number of workers. What it cuts goes back to each rank's error feedback.
* :class:`DenseAllReduce`: a sparse payload scattered into a dense vector and all-reduced
  (sparse codecs): 2(n-1)/n of the vector per worker at any density, the exact sum, where
  gathering grows with n and the ring's chunks fill in.

Usage::

    communicator = make_communicator("auto", codec, Transport())
    payload = codec.encode(grad * communicator.input_scale)     # allreduce: each rank sends grad / n
    average = communicator.average(codec, payload, "seg0")      # flat float32, same device
    if communicator.feeds_back:                                  # what the sum left out of mine
        memory.add_back("seg0", *communicator.take_dropped("seg0"), scale=communicator.input_scale)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..codecs import Codec, CodecError, Payload
from ..codecs.sparse import summed_value_bytes, summed_value_dtype
from ..xp import array_module, as_array, to_torch
from .balanced import Plan, balanced_sparse_allreduce
from .cost import Cost, Link, collective_costs, kept_entries
from .ring import chunk_nbytes, sparse_ring_allreduce
from .transport import HEADER_BYTES, Transport, ring_allreduce_bytes

__all__ = ["AllGather", "AllReduce", "BalancedAllReduce", "COLLECTIVES", "Communicator", "DenseAllReduce", "Ring",
           "choose_collective", "make_communicator"]


class Communicator:
    """Args of :meth:`average` and :meth:`start`: the codec, this rank's payload, and the
    segment's name (collectives that keep state per segment key it by the name)."""

    name = ""
    # Whether the mean leaves out some of what the ranks sent (beyond the codec's own loss):
    # then take_dropped(segment) gives this rank's share of it, for its error feedback.
    feeds_back = False

    def __init__(self, transport: Transport):
        self.transport = transport

    @property
    def input_scale(self) -> float:
        """What the caller multiplies a gradient by before encoding it for :meth:`average`."""
        return 1.0

    def average(self, codec: Codec, payload: Payload, segment: str = ""):
        """The mean over all workers of the decoded payloads (encoded at ``input_scale``)."""
        raise NotImplementedError

    def start(self, codec: Codec, payload: Payload, segment: str = "") -> Callable[[], Any]:
        """Begin :meth:`average`; the returned call finishes it and gives the mean. Between
        the two, the caller may encode and agree on the next segment (every rank in the
        same order) while this payload is on the wire. By default all the work is done here."""
        average = self.average(codec, payload, segment)
        return lambda: average

    def documented_bytes(self, codec: Codec, payload: Payload) -> int:
        """What the last ``average`` of ``payload`` should have sent, by the wire formulas."""
        raise NotImplementedError

    def expected(self, mean, segment: str = ""):
        """What the last :meth:`average` of ``segment`` should equal, given the exact mean of
        every rank's decoded payload (verify mode's reference)."""
        return mean

    def take_dropped(self, segment: str) -> tuple[Any, Any]:
        """(global indices, values) of this rank's payload that the last :meth:`average` of
        ``segment`` left out, in the payload's units; forgotten once taken."""
        raise NotImplementedError(f"the {self.name} collective drops nothing")

    def state_dict(self) -> dict[str, Any]:
        """What the next steps' results depend on (for checkpoints): nothing by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class AllReduce(Communicator):
    """Payloads carry grad / n, so the sum is the mean: as torch's own hooks do, dividing
    first keeps an fp16 sum of n large gradients from overflowing where their mean fits."""

    name = "allreduce"

    @property
    def input_scale(self) -> float:
        return 1.0 / self.transport.world

    def average(self, codec, payload, segment=""):
        # A zero-copy view: the in-place sum lands in the payload itself, which then decodes.
        tensor = to_torch(payload.arrays["values"])
        if codec.name == "bf16":  # bf16 travels as its uint16 bit pattern
            tensor = tensor.view(torch.bfloat16)
        self.transport.all_reduce(tensor)
        return codec.decode_flat(payload)

    def documented_bytes(self, codec, payload):
        return ring_allreduce_bytes(payload.arrays["values"].nbytes, self.transport.world)


class AllGather(Communicator):
    """Every rank gathers every payload and sums them. ``combine="senders"`` (sparse codecs):
    each entry is averaged over the ranks that sent it, not over all of them, as SparseLoCo
    does: an entry one worker of n picked is applied whole, where the mean would cut it to
    1/n while the others' shares of it still wait in their residuals."""

    name = "allgather"

    def __init__(self, transport: Transport, combine: str = "mean"):
        super().__init__(transport)
        self.combine = combine

    def average(self, codec, payload, segment=""):
        return self.start(codec, payload)()

    def start(self, codec, payload, segment=""):
        gathered = self.transport.start_all_gather(to_torch(payload.to_array()))
        return lambda: self._sum(codec, payload, gathered())

    def _sum(self, codec, payload, gathered):
        total = senders = None
        for wire in gathered:
            arr = as_array(wire)[0]
            xp = array_module(arr)
            received = codec.from_bytes(arr, like=payload, xp=xp)
            if codec.sparse:
                # Only the kept entries (distinct within a payload) add anything: no dense
                # decode, no new gradient-sized array per worker.
                indices, values = codec.to_coo(received)
                if total is None:
                    total = xp.zeros(payload.numel, dtype=xp.float32)
                    senders = xp.zeros(payload.numel, dtype=xp.float32) if self.combine == "senders" else None
                total[indices] += values
                if senders is not None:
                    senders[indices] += 1
            elif total is None:
                total = codec.decode_flat(received)  # a fresh array: the sum accumulates in it
            else:
                total += codec.decode_flat(received)
        if senders is not None:
            total /= xp.maximum(senders, 1)
        else:
            total /= self.transport.world
        return total

    def documented_bytes(self, codec, payload):
        return (self.transport.world - 1) * codec.wire_nbytes(payload.numel)


class Ring(Communicator):
    name = "ring"
    coded = False  # the chunks' offsets Elias-Fano coded (rayzip.comm.ring.Chunk)

    def average(self, codec, payload, segment=""):
        indices, values = codec.to_coo(payload)
        self.sent: list[tuple[int, int]] = []
        total = sparse_ring_allreduce(indices, values, payload.numel, self.transport,
                                      value_dtype=self._value_dtype(codec), sent=self.sent)
        total /= self.transport.world  # the ring's own fresh array
        return total

    def documented_bytes(self, codec, payload):
        value_bytes = summed_value_bytes(codec)
        return sum(HEADER_BYTES + chunk_nbytes(span, span if entries < 0 else entries, value_bytes, self.coded)[0]
                   for span, entries in self.sent)

    @staticmethod
    def _value_dtype(codec) -> str:
        return summed_value_dtype(codec.value_dtype or "fp32")


class BalancedAllReduce(Ring):
    """:func:`~rayzip.comm.balanced.balanced_sparse_allreduce`: about k entries of the sum
    reach every rank, k the codec's own count for the segment; each rank's entries that the
    sum left out wait in its error feedback (:meth:`take_dropped`). ``combine="senders"``:
    each entry averaged over the ranks that sent it (as :class:`AllGather`'s), before the cut."""

    name = "balanced"
    feeds_back = True
    coded = True

    def __init__(self, transport: Transport, combine: str = "mean"):
        super().__init__(transport)
        self.combine = combine
        self.plans: dict[str, Plan] = {}
        self.kept: dict[str, Any] = {}
        self.dropped: dict[str, tuple[Any, Any]] = {}

    def average(self, codec, payload, segment=""):
        indices, values = codec.to_coo(payload)
        plan = self.plans.setdefault(segment, Plan())
        self.sent = []
        senders = self.combine == "senders"
        total, kept = balanced_sparse_allreduce(indices, values, payload.numel, self.transport, plan,
                                                kept_entries(codec, payload.numel),
                                                value_dtype=self._value_dtype(codec), sent=self.sent, senders=senders)
        xp = array_module(values)
        left_out = ~xp.isin(indices, kept)
        self.kept[segment] = kept
        self.dropped[segment] = (indices[left_out], values[left_out])
        if not senders:
            total /= self.transport.world
        return total

    def expected(self, mean, segment=""):
        out = torch.zeros_like(mean)
        kept = to_torch(self.kept[segment]).to(mean.device)
        out[kept] = mean[kept]
        return out

    def take_dropped(self, segment):
        return self.dropped.pop(segment)

    def state_dict(self):
        return {"plans": {name: plan.state_dict() for name, plan in self.plans.items()}}

    def load_state_dict(self, state):
        self.plans = {name: Plan.from_state(saved) for name, saved in (state or {}).get("plans", {}).items()}


class DenseAllReduce(Communicator):
    """A sparse payload's kept entries scattered into a dense vector that the transport
    all-reduces (gloo's or NCCL's ring): 2(n-1)/n of the vector per worker, whatever the
    density and the number of workers. The sum is exact, like the all-gather's; the cost
    model picks it where n payloads, or the ring's filled-in chunks, would pass the vector.
    Payloads carry grad / n, as :class:`AllReduce`'s do, and the vector sums in the type the
    ring sums the codec's values in (fp16 for scaled 2-, 4- and 8-bit values)."""

    name = "dense"
    DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

    @property
    def input_scale(self) -> float:
        return 1.0 / self.transport.world

    def average(self, codec, payload, segment=""):
        indices, values = codec.to_coo(payload)
        values = to_torch(values)
        dense = torch.zeros(payload.numel, dtype=self.DTYPES[Ring._value_dtype(codec)], device=values.device)
        dense[to_torch(indices).to(torch.int64)] = values.to(dense.dtype)
        self.transport.all_reduce(dense)
        return as_array(dense.float())[0]  # a fresh float32 array: the mean, as the others return it

    def documented_bytes(self, codec, payload):
        return ring_allreduce_bytes(payload.numel * summed_value_bytes(codec), self.transport.world)


COLLECTIVES = {cls.name: cls for cls in (AllReduce, AllGather, Ring, BalancedAllReduce, DenseAllReduce)}
COMBINES = ("mean", "senders")


def choose_collective(requested: str, codec: Codec, sizes: list[int] | None = None, world: int | None = None,
                      link: Link | None = None, combine: str = "mean") -> str:
    """The collective for ``codec``. ``auto`` picks the one of least modelled time for
    segments of ``sizes`` entries among ``world`` workers on ``link``
    (:mod:`rayzip.comm.cost`); without them, the cheapest at two workers. It leaves out the
    collectives that cut the sum (:attr:`Communicator.feeds_back`): they trade accuracy for
    bytes, which the cost model does not weigh, so they are chosen by name."""
    if combine not in COMBINES:
        raise CodecError(f"combine must be one of {', '.join(COMBINES)}, got {combine!r}")
    if combine == "senders":  # counting each entry's senders takes each entry's every payload
        if not codec.sparse:
            raise CodecError(f"combine senders averages each kept entry over the ranks that sent it: it needs a "
                             f"sparse codec (topk, group_topk, randomk), not {codec.name}")
        if requested not in ("auto", "allgather", "balanced"):
            raise CodecError(f"combine senders runs on the allgather or balanced collective, not {requested}")
        return "balanced" if requested == "balanced" else "allgather"
    if requested == "auto":
        if not sizes or world is None or world < 2:
            sizes, world = [1 << 20], 2
        link = link or Link()
        totals: dict[str, Cost] = {}
        for numel in sizes:
            for name, cost in collective_costs(codec, numel, world).items():
                if COLLECTIVES[name].feeds_back:
                    continue
                totals[name] = totals[name] + cost if name in totals else cost
        return min(totals, key=lambda name: (totals[name].seconds(link), totals[name].bytes, name))
    if requested in ("ring", "balanced", "dense") and not codec.sparse:
        raise CodecError(f"the {requested} collective needs a sparse codec (topk, group_topk, randomk), "
                         f"not {codec.name}")
    if requested == "allreduce" and not codec.summable:
        raise CodecError(f"{codec.name} payloads cannot be summed in compressed form; use allgather")
    if requested not in COLLECTIVES:
        raise CodecError(f"unknown collective {requested!r}; choose from auto, {', '.join(COLLECTIVES)}")
    return requested


def make_communicator(requested: str, codec: Codec, transport: Transport, sizes: list[int] | None = None,
                      link: Link | None = None, combine: str = "mean") -> Communicator:
    """The communicator for ``codec`` on ``transport``'s workers (``auto``: by cost, for
    segments of ``sizes`` entries); ``combine``: how each entry is averaged (see
    :class:`AllGather`)."""
    name = choose_collective(requested, codec, sizes, transport.world, link, combine)
    if name in ("allgather", "balanced"):
        return COLLECTIVES[name](transport, combine)
    return COLLECTIVES[name](transport)
