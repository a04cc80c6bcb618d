"""Two-level exchange: workers on one node average densely, one compressed exchange per node
crosses the network.

Within a node the link is fast (NVLink or PCIe for NCCL, shared memory or loopback for
gloo), so compressing there only loses accuracy. Each node's workers sum their gradient
densely (:attr:`Hierarchy.local`), the node's leader (its lowest rank) compresses the
node's share with error feedback and exchanges it with the other leaders
(:attr:`Hierarchy.leaders`), then broadcasts the average to its node. The bytes that leave a
node are one compressed exchange among ``nodes`` workers, whatever the number of workers
on it.

A node is what :func:`node_key` says: ``$RAYZIP_NODE_ID`` when set, else the Ray node this
process runs on, else the host name.

Usage (every rank, in the same order)::

    hierarchy = build_hierarchy("auto", group=None)        # None when it would not help
    node_share = hierarchy.node_share(grad)                 # every rank: its node's part of the mean
    ...                                                      # the leader exchanges node_share
    hierarchy.broadcast(average)                            # every rank: the leader's average
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .emulation import Emulation
from .transport import Transport, ring_allreduce_bytes

__all__ = ["HIERARCHY_MODES", "Hierarchy", "Topology", "build_hierarchy", "node_key"]

HIERARCHY_MODES = ("none", "node", "auto")


def node_key() -> str:
    """What identifies this process's node when the caller gives no key: ``$RAYZIP_NODE_ID``,
    or the host name. (Under Ray, rayzip.train gives the Ray node id: namespaced nodes share
    a host name.)"""
    return os.environ.get("RAYZIP_NODE_ID") or socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """Which node each rank of a group is on (``nodes[r]`` for group rank r)."""

    nodes: tuple[str, ...]

    @property
    def groups(self) -> list[list[int]]:
        """Group ranks per node, nodes ordered by their lowest rank."""
        order: dict[str, list[int]] = {}
        for rank, key in enumerate(self.nodes):
            order.setdefault(key, []).append(rank)
        return list(order.values())

    @property
    def helps(self) -> bool:
        """Whether a hierarchy saves anything: several nodes, and a node with several workers."""
        groups = self.groups
        return len(groups) > 1 and max(len(g) for g in groups) > 1


class Hierarchy:
    """This rank's two groups: its node's workers (``local``) and, on a node's leader, the
    leaders of every node (``leaders``; None on the other workers)."""

    def __init__(self, topology: Topology, rank: int, local: Transport | None, leaders: Transport | None,
                 local_ranks: list[int]):
        self.topology = topology
        self.rank = rank
        self.local = local  # None when this rank is alone on its node
        self.leaders = leaders
        self.local_ranks = local_ranks  # group ranks on this node, the leader first
        self.nodes = len(topology.groups)
        self.world = len(topology.nodes)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.local_ranks[0]

    @property
    def local_world(self) -> int:
        return len(self.local_ranks)

    def node_share(self, grad: torch.Tensor) -> torch.Tensor:
        """This node's sum of ``grad`` times nodes / world, on every rank of the node: the
        leaders' mean of these is the mean over every worker, also with unequal nodes."""
        share = grad.to(torch.float32, copy=True)
        if self.local is not None:
            self.local.all_reduce(share)
        return share.mul_(self.nodes / self.world)

    def first_bad(self, key: int) -> int:
        """The node's highest ``key`` (a :func:`~rayzip.comm.control.bad_key`: its lowest
        rank with a non-finite gradient), on every rank of the node."""
        if self.local is None:
            return key
        word = torch.tensor([key], dtype=torch.int64, device=self.local.device)
        return int(self.local.all_reduce(word, op=dist.ReduceOp.MAX)[0])

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's ``tensor`` on every rank of the node (in place)."""
        if self.local is not None:
            self.local.broadcast(tensor, src=0)
        return tensor

    def documented_bytes(self, numel: int) -> int:
        """What one segment of ``numel`` fp32 entries should send inside the node, by the
        wire formulas: the ring all-reduces of the sum and of the bad-gradient word, and
        the leader's broadcast of the average."""
        if self.local is None:
            return 0
        n = self.local_world
        sent = ring_allreduce_bytes(4 * numel, n) + ring_allreduce_bytes(8, n)
        return sent + ((n - 1) * 4 * numel if self.is_leader else 0)

    @property
    def bytes_sent(self) -> int:
        """What this rank has sent inside its node."""
        return self.local.bytes_sent if self.local is not None else 0


def build_hierarchy(mode: str, group=None, key: str | None = None,
                    device: torch.device | str = "cpu", emulation: Emulation | None = None) -> Hierarchy | None:
    """The hierarchy for ``group``'s ranks (``mode``: ``node`` always, ``auto`` when
    :attr:`Topology.helps`, ``none`` never); None when there is none. Every rank of
    ``group`` calls it at the same point: it gathers the node keys and creates each node's
    group and the leaders' group, in the same order everywhere."""
    if mode not in HIERARCHY_MODES:
        raise ValueError(f"hierarchy must be one of {', '.join(HIERARCHY_MODES)}, got {mode!r}")
    if mode == "none":
        return None
    world = dist.get_world_size(group)
    keys: list = [None] * world
    dist.all_gather_object(keys, key or node_key(), group=group)
    topology = Topology(tuple(keys))
    if mode == "auto" and not topology.helps:
        return None
    rank = dist.get_rank(group)
    backend = dist.get_backend(group)

    def global_ranks(ranks: list[int]) -> list[int]:
        return [r if group is None else dist.get_global_rank(group, r) for r in ranks]

    local = leaders = None
    mine: list[int] = []
    for ranks in topology.groups:  # every rank creates every group, in one order
        created = dist.new_group(global_ranks(ranks), backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = ranks
            local = Transport(created, device=device) if created is not None else None
    heads = [ranks[0] for ranks in topology.groups]
    created = dist.new_group(global_ranks(heads), backend=backend)
    if rank in heads:  # an emulated link is the one between nodes
        leaders = Transport(created, device=device, emulation=emulation)
    return Hierarchy(topology, rank, local, leaders, mine)
