"""The Communicator role: collectives over torch.distributed that count their bytes."""

from .collectives import (COLLECTIVES, AllGather, AllReduce, Communicator, Ring, choose_collective,
                          make_communicator)
from .cost import Cost, Link, collective_costs, ring_cost
from .emulation import Emulation, FixedLink
from .ring import chunk_nbytes, sparse_ring_allreduce
from .transport import Transport, ring_allreduce_bytes

__all__ = [
    "COLLECTIVES", "AllGather", "AllReduce", "Communicator", "Cost", "Emulation", "FixedLink", "Link", "Ring", "Transport",
    "choose_collective", "chunk_nbytes", "collective_costs", "make_communicator", "ring_allreduce_bytes", "ring_cost",
    "sparse_ring_allreduce",
]
