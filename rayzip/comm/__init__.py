"""The Communicator role: collectives over torch.distributed that count their bytes."""

from .balanced import Plan, balanced_sparse_allreduce
from .collectives import (COLLECTIVES, AllGather, AllReduce, BalancedAllReduce, Communicator, DenseAllReduce, Ring,
                          choose_collective, make_communicator)
from .cost import Cost, Link, balanced_cost, collective_costs, ring_cost
from .emulation import Emulation, FixedLink
from .ring import chunk_nbytes, sparse_ring_allreduce
from .transport import Transport, ring_allreduce_bytes

__all__ = [
    "COLLECTIVES", "AllGather", "AllReduce", "BalancedAllReduce", "Communicator", "Cost", "DenseAllReduce", "Emulation",
    "FixedLink",
    "Link", "Plan", "Ring", "Transport", "balanced_cost", "balanced_sparse_allreduce", "choose_collective",
    "chunk_nbytes", "collective_costs", "make_communicator", "ring_allreduce_bytes", "ring_cost",
    "sparse_ring_allreduce",
]
