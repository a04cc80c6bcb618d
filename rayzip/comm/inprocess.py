"""n ranks in one process: a :class:`~rayzip.comm.transport.Transport` whose messages go
through queues between threads instead of torch.distributed, so that a collective's own code
runs at world sizes this machine cannot hold as processes (``rayzip bench collectives
--simulate``). Every send is counted exactly as :class:`Transport` counts it.

Usage::

    hub = InProcessHub(world=64)
    def rank(r):                                   # on a thread of its own
        transport = InProcessTransport(hub, r)
        ... BalancedAllReduce(transport).average(codec, payload, "seg0") ...
    hub.run(rank)                                  # every rank's result, in rank order
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

from .transport import Transport, ring_allreduce_bytes

__all__ = ["InProcessHub", "InProcessTransport"]


class InProcessHub:
    """The queues between ``world`` ranks, and a board for their collectives."""

    def __init__(self, world: int, timeout_s: float = 600.0):
        self.world, self.timeout_s = int(world), float(timeout_s)
        self.queues = {(src, dst): queue.SimpleQueue() for src in range(self.world) for dst in range(self.world)}
        self.barrier = threading.Barrier(self.world, timeout=self.timeout_s)
        self.board: list[Any] = [None] * self.world

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        """``work(rank)`` on a thread per rank; their results in rank order. The first
        exception raised on any rank is raised here (the others' waits are broken)."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as exc:
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,), name=f"rank-{r}", daemon=True)
                   for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def gather(self, rank: int, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order (every rank calls it)."""
        self.board[rank] = item
        self.barrier.wait()
        everyone = list(self.board)
        self.barrier.wait()  # nobody writes the board again before all have read it
        return everyone


class InProcessTransport(Transport):
    """Rank ``rank`` of ``hub``'s world."""

    def __init__(self, hub: InProcessHub, rank: int):
        # Not Transport.__init__: there is no process group to ask.
        self.hub, self.group, self.emulation = hub, None, None
        self.rank, self.world = int(rank), hub.world
        self.device = torch.device("cpu")
        self._host_p2p = False
        self.bytes_sent, self.hops, self.network_s = 0, 0, 0.0

    def _exchange_many(self, sends, recvs) -> None:
        for tensor, dst in sends:
            self.hub.queues[(self.rank, dst)].put(tensor.clone())
        for tensor, src in recvs:
            tensor.copy_(self.hub.queues[(src, self.rank)].get(timeout=self.hub.timeout_s))

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world)
        everyone = self.hub.gather(self.rank, tensor.clone())
        total = everyone[0].clone()
        for other in everyone[1:]:
            total += other
        tensor.copy_(total)
        self._count(nbytes, hops=2 * (self.world - 1))
        return tensor

    def start_all_gather(self, tensor: torch.Tensor):
        everyone = self.hub.gather(self.rank, tensor.clone())
        self._count((self.world - 1) * tensor.numel() * tensor.element_size(), hops=self.world - 1)
        return lambda: everyone

    def start_all_reduce(self, tensor: torch.Tensor):
        raise NotImplementedError("in-process ranks run collectives synchronously")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        everyone = self.hub.gather(self.rank, tensor.clone())
        tensor.copy_(everyone[src])
        if self.rank == src:
            self._count((self.world - 1) * tensor.numel() * tensor.element_size())
        return tensor
