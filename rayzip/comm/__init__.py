"""The Communicator role: collectives over torch.distributed that count their bytes."""

from .collectives import (COLLECTIVES, AllGather, AllReduce, Communicator, Ring, choose_collective,
                          make_communicator)
from .ring import chunk_nbytes, sparse_ring_allreduce
from .transport import Transport, ring_allreduce_bytes

__all__ = [
    "COLLECTIVES", "AllGather", "AllReduce", "Communicator", "Ring", "Transport", "choose_collective",
    "chunk_nbytes", "make_communicator", "ring_allreduce_bytes", "sparse_ring_allreduce",
]
