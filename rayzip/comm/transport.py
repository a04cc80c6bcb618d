"""torch.distributed, with every byte this worker sends counted.

Counts are what this worker transmits: exact for point-to-point sends (the size header
plus the payload), and the standard ring cost for collectives: 2(n-1)/n * size for
all_reduce, (n-1) * size for all_gather (gloo and NCCL both run rings at these sizes).

With an :class:`~rayzip.comm.emulation.Emulation`, every send also waits what the emulated
link would add, inside the network time.

Usage::

    transport = Transport()                        # the default process group
    received = transport.shift(my_bytes)           # send to rank+1, receive from rank-1
    print(transport.bytes_sent)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .emulation import Emulation

__all__ = ["Transport", "ring_allreduce_bytes"]

HEADER_INTS = 2  # (payload bytes, entry count or -1 for a dense chunk)
HEADER_BYTES = 8 * HEADER_INTS


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one worker sends in a ring all_reduce of ``nbytes``: 2(n-1)/n * nbytes."""
    return 2 * (world - 1) * nbytes // world


class Transport:
    def __init__(self, group=None, device: torch.device | str = "cpu", emulation: "Emulation | None" = None):
        self.group = group
        self.emulation = emulation
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device(device)
        # gloo's point-to-point sends read and write host memory only (its collectives stage
        # CUDA tensors through the host themselves): CUDA payloads cross via host copies.
        self._host_p2p = self.device.type == "cuda" and dist.get_backend(group) == "gloo"
        self.bytes_sent = 0
        # Latency-bound sends, as rayzip.comm.cost counts them (a ring allreduce: 2(n-1)):
        # the controller's cost model fits a latency per message to them.
        self.hops = 0
        # Seconds inside torch.distributed: the wire plus waiting for slower peers.
        self.network_s = 0.0

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` over all workers (a sum unless ``op`` says otherwise), in place."""
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world)
        with self._on_network(nbytes):
            dist.all_reduce(tensor, op=op, group=self.group)
        self._count(nbytes, hops=2 * (self.world - 1))
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Begin a sum all-reduce of ``tensor`` in place; the future completes with
        ``tensor``. Counted now; its network time is the caller's to measure (overlapping
        all-reduces share the wire)."""
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world)
        future = dist.all_reduce(tensor, group=self.group, async_op=True).get_future()
        self._count(nbytes, hops=2 * (self.world - 1))
        delay = 0.0 if self.emulation is None else self.emulation.delay_s(nbytes)

        def done(f: torch.futures.Future) -> torch.Tensor:
            f.wait()
            if delay:
                time.sleep(delay)
            return tensor

        return future.then(done)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``tensor`` (all the same size), in rank order."""
        return self.start_all_gather(tensor)()

    def start_all_gather(self, tensor: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        """Begin :meth:`all_gather`; the returned call waits for it and gives its result.
        The caller may run other collectives meanwhile (every rank in the same order): the
        wait alone counts as network time, what the wire did meanwhile is overlapped."""
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        nbytes = (self.world - 1) * tensor.numel() * tensor.element_size()
        with self._on_network(0):
            work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        self._count(nbytes, hops=self.world - 1)

        def wait(_sending: torch.Tensor = tensor) -> list[torch.Tensor]:  # held until the collective is done
            with self._on_network(nbytes):
                work.wait()
            return out

        return wait

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank ``src``'s ``tensor`` on every worker, in place. Counted as the root
        sending it to each of the others (what a small group's broadcast does)."""
        nbytes = (self.world - 1) * tensor.numel() * tensor.element_size() if self.rank == src else 0
        with self._on_network(nbytes):
            dist.broadcast(tensor, src=self._global(src), group=self.group)
        if nbytes:
            self._count(nbytes)
        return tensor

    def shift(self, payload: torch.Tensor, entries: int, distance: int = 1) -> tuple[torch.Tensor, int]:
        """Send uint8 ``payload`` to the rank ``distance`` ahead, receive the one as far behind's.

        A header with the byte count and ``entries`` goes first so the receiver can size its
        buffer; returns the received bytes and the sender's ``entries``.
        """
        nxt, prev = (self.rank + distance) % self.world, (self.rank - distance) % self.world
        return self._sized({nxt: (payload, entries)}, [prev])[prev]

    def exchange(self, payloads: list[torch.Tensor | None], entries: list[int]) -> list[tuple[torch.Tensor, int] | None]:
        """Send uint8 ``payloads[j]`` to every other rank j and receive each one's payload for
        this rank, every message of a round posted at once: a round of headers (byte count and
        ``entries[j]``), then a round of payloads. Returns, for each rank j, the bytes it sent
        here and its entries (None at this rank). Two latency-bound rounds whatever the
        world, where :meth:`shift` takes two per peer, one peer after another.
        """
        others = [j for j in range(self.world) if j != self.rank]
        received = self._sized({j: (payloads[j], entries[j]) for j in others}, others)
        return [received.get(j) for j in range(self.world)]

    def _sized(self, sends: dict[int, tuple[torch.Tensor, int]],
               sources: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
        """Each uint8 payload to its group rank with its ``entries``, and one from each source:
        a round of headers (byte count, entries) so that receivers can size their buffers,
        then a round of payloads, each round posted at once."""
        wire = torch.device("cpu") if self._host_p2p else self.device
        headers = [(torch.tensor([p.numel(), e], dtype=torch.int64, device=wire), dst) for dst, (p, e) in sends.items()]
        incoming = {src: torch.empty(HEADER_INTS, dtype=torch.int64, device=wire) for src in sources}
        self._exchange_many(headers, [(t, src) for src, t in incoming.items()])
        self._count(HEADER_BYTES * len(sends))
        sizes = {src: t.tolist() for src, t in incoming.items()}
        received = {src: torch.empty(sizes[src][0], dtype=torch.uint8, device=wire) for src in sources}
        self._exchange_many([(p.to(wire), dst) for dst, (p, _) in sends.items()],
                            [(t, src) for src, t in received.items()])
        self._count(sum(p.numel() for p, _ in sends.values()))
        return {src: (received[src].to(self.device), sizes[src][1]) for src in sources}

    def _exchange_many(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive (peers by group rank) at once and wait for them all."""
        ops = [dist.P2POp(dist.isend, t, self._global(dst), group=self.group) for t, dst in sends] + \
              [dist.P2POp(dist.irecv, t, self._global(src), group=self.group) for t, src in recvs]
        with self._on_network(sum(t.numel() * t.element_size() for t, _ in sends)):
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    @contextmanager
    def _on_network(self, nbytes: int):
        start = time.perf_counter()
        try:
            yield
            if self.emulation is not None:
                time.sleep(self.emulation.delay_s(nbytes))
        finally:
            self.network_s += time.perf_counter() - start

    def _count(self, nbytes: int, hops: int = 1) -> None:
        self.bytes_sent += nbytes
        self.hops += hops

