"""torch's own DDP comm hooks as baselines, with the bytes they hand to torch.distributed counted.

torch's hooks call ``torch.distributed.all_reduce``/``all_gather`` themselves, so their bytes
are counted where those calls enter torch.distributed (the collectives still run for real),
with the same ring cost formulas as rayzip's transport.

Usage::

    counter = register_torch_hook(ddp, "powersgd", rank=2, start_iter=10)
    ...
    counter.take()   # bytes sent since the last take
"""

# No `from __future__ import annotations`: DDP checks hook annotations at runtime.
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ..comm.transport import ring_allreduce_bytes

__all__ = ["CollectiveCounter", "register_torch_hook"]


class CollectiveCounter:
    """Counts the bytes of every all_reduce / all_gather issued through torch.distributed."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self._taken = 0
        self._originals = (dist.all_reduce, dist.all_gather)

    def install(self) -> "CollectiveCounter":
        all_reduce, all_gather = self._originals

        def counted_all_reduce(tensor, *args, **kwargs):
            world = dist.get_world_size(kwargs.get("group"))
            self.bytes_sent += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world)
            return all_reduce(tensor, *args, **kwargs)

        def counted_all_gather(tensor_list, tensor, *args, **kwargs):
            world = dist.get_world_size(kwargs.get("group"))
            self.bytes_sent += (world - 1) * tensor.numel() * tensor.element_size()
            return all_gather(tensor_list, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
        return self

    def uninstall(self) -> None:
        dist.all_reduce, dist.all_gather = self._originals

    def take(self) -> int:
        """Bytes counted since the previous take."""
        delta, self._taken = self.bytes_sent - self._taken, self.bytes_sent
        return delta


def one_bucket_at_a_time(hook):
    """``hook``, finishing each bucket before DDP hands over the next.

    PowerSGD chains several async all_reduces per bucket through future callbacks. On gloo
    the chains of different buckets interleave differently on each rank, which pairs
    mismatched messages ("op.preamble.length <= op.nbytes") and aborts. Waiting here keeps
    the collectives in the same order everywhere, as rayzip's own hook does.
    """

    def run(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        future.wait()
        return future

    run.__name__ = f"{hook.__name__}_one_bucket_at_a_time"
    return run


def register_torch_hook(ddp, name: str, rank: int = 2, start_iter: int = 1000) -> CollectiveCounter:
    counter = CollectiveCounter().install()
    if name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start_iter)
        hook = powerSGD_hook.powerSGD_hook
        if dist.get_backend() == "gloo":
            hook = one_bucket_at_a_time(hook)
        ddp.register_comm_hook(state, hook)
    else:
        raise ValueError(f"unknown torch hook {name!r}")
    return counter
