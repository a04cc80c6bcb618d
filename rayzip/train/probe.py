"""The link, measured for free: the broadcast of the model at start, timed.

Wrapping a model in DDP broadcasts its parameters and buffers from rank 0, so every run
moves a dense-sized payload across the network before its first step. rayzip asks DDP to
skip that sync (``init_sync=False``) and does it itself, after a barrier (so that no rank's
late arrival counts as transfer) and timed apart from DDP's own set-up, which takes longer
than the transfer on a fast link. The time is one sample of the link at a payload size the
compressed steps never produce: with it, the adaptive controller's cost model separates
latency from bandwidth from the first steps, without a probe of its own.

Usage::

    model, probe = prepare_timed(model, parallel_strategy="ddp")
    state.link_probe = probe      # Telemetry sends it to the controller with the first step
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import ray.train.torch
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .records import LinkProbe

__all__ = ["LinkProbe", "prepare_timed", "sync_module_states", "sync_replicas"]


def prepare_timed(model: torch.nn.Module, **prepare_kwargs: Any) -> tuple[torch.nn.Module, LinkProbe | None]:
    """``ray.train.torch.prepare_model(model, **prepare_kwargs)``, with DDP's start-up sync
    done by :func:`sync_module_states` and timed (the probe is None where no DDP wraps the
    model, or where ``init_sync`` was given). Every rank must call it."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ddp_kwargs = dict(prepare_kwargs.get("parallel_strategy_kwargs") or {})
    ours = world > 1 and prepare_kwargs.get("parallel_strategy", "ddp") == "ddp" and "init_sync" not in ddp_kwargs
    if ours:
        prepare_kwargs = {**prepare_kwargs, "parallel_strategy_kwargs": {**ddp_kwargs, "init_sync": False}}
    prepared = ray.train.torch.prepare_model(model, **prepare_kwargs)
    if not ours:
        return prepared, None
    if not isinstance(prepared, DistributedDataParallel):
        raise RuntimeError("ray.train.torch.prepare_model did not wrap the model in DDP at world size "
                           f"{world}: its start-up sync was skipped, so the ranks' weights may differ")
    buffers = ddp_kwargs.get("broadcast_buffers") is not False
    return prepared, sync_module_states(prepared.module, set(prepared.parameters_to_ignore), buffers=buffers)


def sync_module_states(module: torch.nn.Module, ignore: set[str] = frozenset(), buffers: bool = True) -> LinkProbe:
    """What DDP does at construction, timed: check that every rank's parameters have the
    same names and shapes, then broadcast rank 0's parameters (and buffers) to all. One
    broadcast per dtype and device; the time is of the broadcasts alone, after a barrier."""
    named = [(n, t) for n, t in module.named_parameters() if n not in ignore]
    if buffers:
        named += [(n, t) for n, t in module.named_buffers() if n not in ignore]
    return _broadcast_timed(named, None, lambda rank: f"rank {rank}'s model differs from rank {dist.get_rank()}'s")


def sync_replicas(model: torch.nn.Module, replicate: dist.ProcessGroup) -> LinkProbe:
    """HSDP's start-up sync, timed: each rank of the first shard group broadcasts its
    parameter shards to the ranks that hold the same shards on the other nodes (the
    ``replicate`` group), after checking that their names and shapes agree. So the replicas
    start from the same weights whatever each rank's seed, and the adaptive controller gets
    one sample of the link between nodes, as :func:`sync_module_states` gives it under DDP.
    Every rank calls it after ``fully_shard``."""
    from torch.distributed.tensor import DTensor

    named = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]
    return _broadcast_timed(named, replicate, lambda rank: f"the replica of rank {rank} holds other shards than "
                                                           f"rank {dist.get_rank()}'s")


def _broadcast_timed(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, differs) -> LinkProbe:
    """Check that the ``group``'s ranks hold tensors of the same names and shapes (else raise
    ``differs(global rank)``), then broadcast the group's first rank's to the others: one
    broadcast per dtype and device, timed alone, after a barrier."""
    shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    for index, theirs in enumerate(everyone):
        mine, other = next(((a, b) for a, b in itertools.zip_longest(shapes, theirs) if a != b), (None, None))
        if mine != other:
            rank = dist.get_global_rank(group, index) if group is not None else index
            raise ValueError(f"{differs(rank)}: (name, shape, dtype) {other} against {mine}")
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, t in named:
        groups.setdefault((t.dtype, t.device), []).append(t)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    dist.barrier(group=group)
    seconds = 0.0
    with torch.no_grad():
        for tensors in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            started = time.perf_counter()
            dist.broadcast(flat, group=group, group_src=0)
            if flat.is_cuda:
                torch.cuda.synchronize(flat.device)  # NCCL returns before the transfer is done
            seconds += time.perf_counter() - started
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))
    world = dist.get_world_size(group)
    # gloo broadcasts along a binomial tree, whose root sends the whole payload to each of
    # its ceil(log2 n) children in turn; NCCL pipelines it along a ring, once per link.
    rounds = 1 if dist.get_backend(group) == "nccl" else max(1, math.ceil(math.log2(world)))
    return LinkProbe(bytes=float(rounds * nbytes), seconds=seconds, messages=float(rounds * len(groups)))
