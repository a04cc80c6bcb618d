"""The Communicator role: move one worker's payload, return the average over all workers.

* :class:`AllReduce`: sum the payload's values in place (``none``, ``fp16``, ``bf16``, and
  ``randomk``, whose workers share indices through the seed).
* :class:`Ring`: sparse ring reduce-scatter + all-gather of (index, value) chunks
  (``topk``, ``group_topk``, ``randomk``).
* :class:`AllGather`: gather every payload, decode each, average locally (any codec; the
  only choice for ``qsgd`` and ``dct_quant``, which cannot be summed compressed).

Usage::

    communicator = make_communicator("auto", codec, Transport())
    payload = codec.encode(grad * communicator.input_scale)     # allreduce: each rank sends grad / n
    average = communicator.average(codec, payload)              # flat float32, same device
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..codecs import Codec, CodecError, Payload
from ..codecs.sparse import summed_value_bytes, summed_value_dtype
from ..xp import array_module, as_array, to_torch
from .cost import Cost, Link, collective_costs
from .ring import chunk_nbytes, sparse_ring_allreduce
from .transport import HEADER_BYTES, Transport, ring_allreduce_bytes

__all__ = ["AllGather", "AllReduce", "COLLECTIVES", "Communicator", "Ring", "choose_collective",
           "make_communicator"]

class Communicator:
    name = ""

    def __init__(self, transport: Transport):
        self.transport = transport

    @property
    def input_scale(self) -> float:
        """What the caller multiplies a gradient by before encoding it for :meth:`average`."""
        return 1.0

    def average(self, codec: Codec, payload: Payload):
        """The mean over all workers of the decoded payloads (encoded at ``input_scale``)."""
        raise NotImplementedError

    def start(self, codec: Codec, payload: Payload) -> Callable[[], Any]:
        """Begin :meth:`average`; the returned call finishes it and gives the mean. Between
        the two, the caller may encode and agree on the next segment (every rank in the
        same order) while this payload is on the wire. By default all the work is done here."""
        average = self.average(codec, payload)
        return lambda: average

    def documented_bytes(self, codec: Codec, payload: Payload) -> int:
        """What the last ``average`` of ``payload`` should have sent, by the wire formulas."""
        raise NotImplementedError


class AllReduce(Communicator):
    """Payloads carry grad / n, so the sum is the mean: as torch's own hooks do, dividing
    first keeps an fp16 sum of n large gradients from overflowing where their mean fits."""

    name = "allreduce"

    @property
    def input_scale(self) -> float:
        return 1.0 / self.transport.world

    def average(self, codec, payload):
        # A zero-copy view: the in-place sum lands in the payload itself, which then decodes.
        tensor = to_torch(payload.arrays["values"])
        if codec.name == "bf16":  # bf16 travels as its uint16 bit pattern
            tensor = tensor.view(torch.bfloat16)
        self.transport.all_reduce(tensor)
        return codec.decode_flat(payload)

    def documented_bytes(self, codec, payload):
        return ring_allreduce_bytes(payload.arrays["values"].nbytes, self.transport.world)


class AllGather(Communicator):
    name = "allgather"

    def average(self, codec, payload):
        return self.start(codec, payload)()

    def start(self, codec, payload):
        gathered = self.transport.start_all_gather(to_torch(payload.to_array()))
        return lambda: self._sum(codec, payload, gathered())

    def _sum(self, codec, payload, gathered):
        total = None
        for wire in gathered:
            arr = as_array(wire)[0]
            received = codec.from_bytes(arr, like=payload, xp=array_module(arr))
            if total is None:
                total = codec.decode_flat(received)  # a fresh array: the sum accumulates in it
            elif codec.sparse:
                # Only the kept entries (distinct within a payload) add anything: no dense
                # decode, no new gradient-sized array per worker.
                indices, values = codec.to_coo(received)
                total[indices] += values
            else:
                total += codec.decode_flat(received)
        total /= self.transport.world
        return total

    def documented_bytes(self, codec, payload):
        return (self.transport.world - 1) * codec.wire_nbytes(payload.numel)


class Ring(Communicator):
    name = "ring"

    def average(self, codec, payload):
        indices, values = codec.to_coo(payload)
        self.sent: list[tuple[int, int]] = []
        total = sparse_ring_allreduce(indices, values, payload.numel, self.transport,
                                      value_dtype=self._value_dtype(codec), sent=self.sent)
        total /= self.transport.world  # the ring's own fresh array
        return total

    def documented_bytes(self, codec, payload):
        value_bytes = summed_value_bytes(codec)
        return sum(HEADER_BYTES + chunk_nbytes(span, span if entries < 0 else entries, value_bytes)[0]
                   for span, entries in self.sent)

    @staticmethod
    def _value_dtype(codec) -> str:
        return summed_value_dtype(codec.value_dtype or "fp32")


COLLECTIVES = {cls.name: cls for cls in (AllReduce, AllGather, Ring)}


def choose_collective(requested: str, codec: Codec, sizes: list[int] | None = None, world: int | None = None,
                      link: Link | None = None) -> str:
    """The collective for ``codec``. ``auto`` picks the one of least modelled time for
    segments of ``sizes`` entries among ``world`` workers on ``link``
    (:mod:`rayzip.comm.cost`); without them, the cheapest at two workers."""
    if requested == "auto":
        if not sizes or world is None or world < 2:
            sizes, world = [1 << 20], 2
        link = link or Link()
        totals: dict[str, Cost] = {}
        for numel in sizes:
            for name, cost in collective_costs(codec, numel, world).items():
                totals[name] = totals[name] + cost if name in totals else cost
        return min(totals, key=lambda name: (totals[name].seconds(link), totals[name].bytes, name))
    if requested == "ring" and not codec.sparse:
        raise CodecError(f"the ring collective needs a sparse codec (topk, group_topk, randomk), not {codec.name}")
    if requested == "allreduce" and not codec.summable:
        raise CodecError(f"{codec.name} payloads cannot be summed in compressed form; use allgather")
    if requested not in COLLECTIVES:
        raise CodecError(f"unknown collective {requested!r}; choose from auto, {', '.join(COLLECTIVES)}")
    return requested


def make_communicator(requested: str, codec: Codec, transport: Transport, sizes: list[int] | None = None,
                      link: Link | None = None) -> Communicator:
    """The communicator for ``codec`` on ``transport``'s workers (``auto``: by cost, for
    segments of ``sizes`` entries)."""
    return COLLECTIVES[choose_collective(requested, codec, sizes, transport.world, link)](transport)
