"""FSDP2 with rayzip's exchange between nodes: HSDP whose replicas trade compressed shards.

Inside a node, FSDP2 (``fully_shard`` on a mesh over the node's ranks) gathers parameters
and reduce-scatters gradients densely: that link is fast. Between nodes, the ranks that hold
the same shard (one per node: the *replicate group*) average their shard through rayzip's
engine, one :class:`~rayzip.engine.GradientExchange` per FSDP parameter group, with codec,
error feedback per shard, control word and NaN handling as for DDP.

The seam is FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``): on a 1-D mesh,
FSDP2 calls it with each parameter group's reduce-scatter output (this rank's flat shard,
the node's mean) before it views that buffer as the shards' gradients, so the engine's mean
written into the buffer is what the optimizer sees. ``set_requires_all_reduce(False)`` on a
2-D mesh was the other candidate; FSDP2 then accumulates without calling the hook (its
gradient-accumulation path), so it offers no point to exchange at.

The control word is agreed by every rank of the model, not only the replicas: a NaN, a stop
or a configuration mismatch in any shard stops, skips or raises on every rank at the same
step, where FSDP2's next collective would otherwise wait for ranks that raised.

Example::

    shard_mesh, replicate = hsdp_mesh(shard_size=2)          # 2 ranks per node
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    exchange = compress_sharded(model, CompressionConfig(codec="group_topk", density=0.01), replicate)
    loss.backward()                                          # shards averaged across nodes
    if not exchange.last_step.skipped:
        optimizer.step()
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from .. import cuda
from ..comm.emulation import Emulation
from ..engine import CompressionConfig, GradientExchange, StepStats
from .local_steps import LocalSteps

__all__ = ["ShardedExchange", "ShardingConfig", "blocks", "compress_sharded", "hsdp_mesh", "local_steps_on_shards",
           "shard_group_size", "shard_model"]

_SUMMED = ("bytes_sent", "local_bytes", "bytes_received", "dense_bytes", "control_bytes", "comm_s", "busy_s",
           "network_s", "numel", "hops")


SHARDING_MODES = ("fsdp", "hsdp")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How FSDP2 shards a model.

    Args:
        mode: ``"fsdp"``: every rank holds one shard of one model (no replicas);
            ``"hsdp"``: shard groups of ``shard_size`` consecutive ranks (a node), each a
            replica of the model, whose shards are averaged across groups by rayzip.
        shard_size: ranks per shard group under ``hsdp`` (default: the ranks per node).
        blocks: class names of the modules to shard one by one (each gathers its
            parameters only while it runs); default: the entries of every ``ModuleList``
            (a transformer's blocks), or else the model's children that hold parameters.

    Example::

        ShardingConfig(mode="hsdp", shard_size=8, blocks=("TransformerBlock",))
    """

    mode: str = "hsdp"
    shard_size: int | None = None
    blocks: tuple[str, ...] = ()

    def __post_init__(self):
        if self.mode not in SHARDING_MODES:
            raise ValueError(f"sharding mode must be one of {', '.join(SHARDING_MODES)}, got {self.mode!r}")
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {self.shard_size}")


def blocks(model: torch.nn.Module, names: tuple[str, ...] = ()) -> list[torch.nn.Module]:
    """The modules :func:`shard_model` shards one by one (see :class:`ShardingConfig`)."""
    if names:
        return [m for m in model.modules() if type(m).__name__ in names and m is not model]
    listed = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
    if listed:
        return listed
    return [m for m in model.children() if any(True for _ in m.parameters())]


def shard_group_size(sharding: ShardingConfig, world: int, ranks_per_node: int) -> int:
    """Ranks per shard group: the world under ``fsdp``; under ``hsdp``, ``shard_size`` or the
    ranks per node, at most the world."""
    return world if sharding.mode == "fsdp" else min(world, sharding.shard_size or ranks_per_node)


def shard_model(model: torch.nn.Module, sharding: ShardingConfig, ranks_per_node: int,
                device_type: str | None = None,
                native_hsdp: bool = False) -> tuple[torch.nn.Module, dist.ProcessGroup | None]:
    """Apply ``fully_shard`` to ``model``'s blocks and to ``model``; returns the model and,
    under ``hsdp`` with more than one shard group, the replicate group for
    :func:`compress_sharded` (None under ``fsdp``, or with one group). Every rank calls it.

    Args:
        model: the model, on this rank's device, the same weights on every rank.
        sharding: the :class:`ShardingConfig`.
        ranks_per_node: the default shard group size under ``hsdp``.
        device_type: ``"cuda"`` or ``"cpu"`` (default: the model's).
        native_hsdp: shard over a 2-D mesh, so that FSDP2 itself all-reduces each shard
            between groups, densely (the baseline); no replicate group is returned.
    """
    from torch.distributed.fsdp import fully_shard

    device_type = device_type or next(model.parameters()).device.type
    world = dist.get_world_size()
    size = shard_group_size(sharding, world, ranks_per_node)
    replicate = None
    if size == world:
        mesh = init_device_mesh(device_type, (world,))  # one shard group: no replicas to average
    elif native_hsdp:
        mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("replicate", "shard"))
    else:
        mesh, replicate = hsdp_mesh(size, device_type)
    for block in blocks(model, sharding.blocks):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, replicate


def hsdp_mesh(shard_size: int, device_type: str | None = None) -> tuple[DeviceMesh, dist.ProcessGroup]:
    """(the mesh to ``fully_shard`` over, the replicate group to exchange over) for ranks in
    nodes of ``shard_size`` consecutive ranks: FSDP2 shards within a node, rayzip averages
    each shard across nodes. Every rank calls it.

    Args:
        shard_size: ranks per shard group (the workers or GPUs of a node).
        device_type: ``"cuda"`` or ``"cpu"`` (default: CUDA where it is available).

    Example::

        shard_mesh, replicate = hsdp_mesh(shard_size=torch.cuda.device_count())
    """
    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"the world of {world} ranks is not a whole number of shard groups of {shard_size}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    return mesh["shard"], mesh.get_group("replicate")


def _managed(module: FSDPModule) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of ``module``'s own FSDP parameter group: its parameters but those of
    nested FSDP modules, in the order FSDP2 lays them out."""
    nested = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
              for p in sub.parameters()}
    return [(name, p) for name, p in module.named_parameters() if id(p) not in nested]


def _padded_shard_numel(param: torch.nn.Parameter, shard_world: int) -> int:
    """Elements of one rank's slot for ``param`` in the reduce-scatter output: FSDP2 pads
    dimension 0 to a multiple of the shard group's size."""
    shape = tuple(param.shape)
    if not shape:
        return 1
    return math.ceil(shape[0] / shard_world) * math.prod(shape[1:])


class ShardedExchange:
    """The engines of one rank's FSDP parameter groups, as one: their knobs, their step
    statistics summed, and one state to checkpoint.

    A skipped step (``on_nonfinite="skip"``) skips every group: the groups exchanged before
    the NaN was found have their error feedback restored at the next step, as a DDP step's
    segments do.
    """

    def __init__(self, modules: list[tuple[str, FSDPModule]], exchanges: list[GradientExchange]):
        self.modules, self.exchanges = modules, exchanges
        self._seen: set[int] = set()
        self._snapshots: list | None = None
        self.last_step: StepStats | None = None
        self.link_probe = None  # the timed start-up sync of the replicas (sync_replicas), where one ran

    # --- the hook -----------------------------------------------------------------------------
    def _hook(self, index: int, reduce_output: torch.Tensor) -> None:
        if index in self._seen or not self._seen:  # a new backward
            self._begin_backward()
        self._seen.add(index)
        exchange = self.exchanges[index]
        if reduce_output.numel() != exchange.numel:
            raise RuntimeError(f"FSDP2 handed {self.modules[index][0] or 'the root'}'s group "
                               f"{reduce_output.numel()} elements, the engine expects {exchange.numel}: "
                               "an FSDP2 layout this torch version changed")
        # FSDP2 calls the hook on a stream of its own (CUDA): cupy's kernels must queue there
        # too, or torch's caching allocator hands their blocks to that stream while they run.
        with cuda.torch_stream(reduce_output.device) if reduce_output.is_cuda else contextlib.nullcontext():
            reduce_output.copy_(exchange.average(reduce_output))
        self.last_step = self._combined()

    def _begin_backward(self) -> None:
        if self.last_step is not None and self.last_step.skipped and self._snapshots is not None:
            for exchange, snapshot in zip(self.exchanges, self._snapshots):
                exchange.memory.restore(snapshot)
        self._seen = set()
        self._snapshots = [exchange.memory.snapshot() for exchange in self.exchanges]

    def _combined(self) -> StepStats:
        steps = [self.exchanges[i].last_step for i in sorted(self._seen)]
        first = steps[0]
        out = StepStats(step=first.step, compressed=first.compressed, density=first.density)
        for name in _SUMMED:
            setattr(out, name, sum(getattr(s, name) for s in steps))
        out.buckets = [n for s in steps for n in s.buckets]
        out.skipped = any(s.skipped for s in steps)
        out.nonfinite = next((s.nonfinite for s in steps if s.nonfinite), None)
        out.stop = any(s.stop for s in steps)
        # Every group agrees on the same control words, so a proposal is adopted by each of
        # them at the same step; the newest is the step's.
        out.adopted = max((s.adopted for s in steps if s.adopted is not None), default=None)
        return out

    # --- knobs: every group alike ---------------------------------------------------------------
    @property
    def density(self) -> float | None:
        return self.exchanges[0].density

    @property
    def step(self) -> int:
        return self.exchanges[0].step

    def set_density(self, density: float) -> None:
        for exchange in self.exchanges:
            exchange.set_density(density)

    def set_enabled(self, enabled: bool) -> None:
        for exchange in self.exchanges:
            exchange.set_enabled(enabled)

    def compress_at(self, compression: float) -> None:
        """Every group at ``compression`` from the next step (every rank, the same step)."""
        for exchange in self.exchanges:
            exchange.compress_at(compression)

    def propose(self, compression: float, seq: int = 0) -> None:
        """Ask every rank to compress at ``compression`` from the step after the next exchange
        (one rank may call it alone: each group's control word carries it to every rank)."""
        for exchange in self.exchanges:
            exchange.propose(compression, seq=seq)

    def request_stop(self) -> None:
        for exchange in self.exchanges:
            exchange.request_stop()

    @property
    def totals(self) -> dict:
        out = dict.fromkeys(self.exchanges[0].totals, 0)
        for exchange in self.exchanges:
            for key, value in exchange.totals.items():
                out[key] += value
        out["steps"], out["skipped"] = self.exchanges[0].totals["steps"], self.exchanges[0].totals["skipped"]
        return out

    # --- checkpoints ------------------------------------------------------------------------
    # A shard's residual belongs to its layout: nothing to re-shard between holders.
    holders = None

    def start_at(self, step: int) -> None:
        """Fresh residuals, every engine counting from ``step`` (a restart on another layout)."""
        for exchange in self.exchanges:
            exchange.step = step

    def state_dict(self) -> dict:
        """Each group's engine state, by the FSDP module's name: this rank's shards' residuals."""
        return {name: exchange.state_dict() for (name, _), exchange in zip(self.modules, self.exchanges)}

    def load_state_dict(self, state: dict) -> None:
        for (name, _), exchange in zip(self.modules, self.exchanges):
            exchange.load_state_dict(state[name])


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    """``model``'s FSDP2 modules by name; raises, saying what to do, where there is none."""
    modules = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not modules:
        raise ValueError("no FSDP2 module in the model: apply torch.distributed.fsdp.fully_shard first")
    return modules


def compress_sharded(model: torch.nn.Module, config: CompressionConfig, replicate_group: dist.ProcessGroup,
                     momentum: float | None = None, adam_betas: tuple[float, float] | None = None,
                     on_nonfinite: str = "raise", emulation: Emulation | None = None,
                     control_group: dist.ProcessGroup | None = None) -> ShardedExchange:
    """Average every FSDP2 parameter group's gradient shard over ``replicate_group`` through
    rayzip's engine, after FSDP2's reduce-scatter inside the node.

    Call it on every rank after ``fully_shard`` on a 1-D mesh over the node (see
    :func:`hsdp_mesh`), before the first backward.

    Args:
        model: the model, with ``fully_shard`` applied to it and its blocks.
        config: codec, density, collective, segments, corrections.
        replicate_group: the ranks holding the same shard on the other nodes.
        momentum: with ``config.momentum_correction``, SGD's momentum (optimizer momentum 0).
        adam_betas: with ``config.adam_correction``, Adam's betas.
        on_nonfinite: ``"raise"`` or ``"skip"``: every rank of the model raises, or skips the
            step, alike.
        emulation: a slower link than the real one for every send between nodes.
        control_group: the ranks that agree on the control word (default: the world).

    Returns:
        The :class:`ShardedExchange` with the knobs and the step statistics.

    Example::

        exchange = compress_sharded(model, CompressionConfig(codec="group_topk", density=0.01), replicate)
    """
    modules = _fsdp_modules(model)
    control_group = control_group if control_group is not None else dist.group.WORLD
    # FSDP2 inside the node is already the hierarchy: the engine exchanges between nodes only.
    config = dataclasses.replace(config, hierarchy="none")
    groups, exchanges = [], []
    for name, module in modules:
        params = [(n, p) for n, p in _managed(module) if p.requires_grad]
        if not params:
            continue
        mesh = params[0][1].device_mesh
        shard_world = mesh.size()
        exchanges.append(GradientExchange(
            config, sizes=[_padded_shard_numel(p, shard_world) for _, p in params],
            names=[f"{name}.{n}" if name else n for n, _ in params], process_group=replicate_group,
            device=params[0][1].to_local().device, momentum=momentum, adam_betas=adam_betas,
            on_nonfinite=on_nonfinite, emulation=emulation, control_group=control_group))
        groups.append((name, module))
    sharded = ShardedExchange(groups, exchanges)
    for index, (_, module) in enumerate(groups):
        module.set_all_reduce_hook(lambda output, index=index: sharded._hook(index, output))
    return sharded


def local_steps_on_shards(model: torch.nn.Module, replicate_group: dist.ProcessGroup, every: int = 10,
                          compression: CompressionConfig | None = None, **kwargs: Any) -> LocalSteps:
    """DiLoCo on FSDP2: each node trains ``every`` steps with FSDP2 alone (dense inside the
    node, nothing between nodes), then each rank's pseudo-gradient shard crosses to the ranks
    holding the same shard on the other nodes through rayzip's engine, and the outer
    optimizer steps this rank's shards (its state is sharded like the parameters).

    Call it on every rank after ``fully_shard`` on a 1-D mesh over the node (see
    :func:`hsdp_mesh`), registering no all-reduce hook: between synchronizations the nodes
    are independent FSDP2 replicas. The control word and the tuner's H are agreed by the
    whole world, so that every shard group synchronizes, skips or stops at the same step.

    Args:
        model: the model, with ``fully_shard`` applied to it and its blocks.
        replicate_group: the ranks holding the same shard on the other nodes; None: one
            shard group (one node, or FSDP over the world) is the only replica, and a
            synchronization only steps the outer optimizer.
        every: H, the inner steps per synchronization.
        compression: the pseudo-gradients' codec, density and error feedback.
        **kwargs: the rest of :class:`~rayzip.torch.local_steps.LocalSteps`' arguments
            (``outer_lr``, ``outer_momentum``, ``on_nonfinite``, ``tuner``, ``emulation``...).

    Returns:
        The :class:`~rayzip.torch.local_steps.LocalSteps`: call ``gradient_ok`` and
        ``after_inner_step`` around each inner step, as on a replicated model.

    Example::

        model, replicate = shard_model(model, ShardingConfig(mode="hsdp", shard_size=2), ranks_per_node=2)
        local = local_steps_on_shards(model, replicate, every=4,
                                      compression=CompressionConfig(codec="group_topk", density=0.02))
        for step, batch in enumerate(loader):
            loss_fn(model, batch).backward()
            if local.gradient_ok(step):
                optimizer.step()
            optimizer.zero_grad()
            local.after_inner_step()
    """
    _fsdp_modules(model)
    # FSDP2 inside the node is already the hierarchy: the engine exchanges between nodes only.
    compression = dataclasses.replace(compression or CompressionConfig(), hierarchy="none")
    return LocalSteps(model.named_parameters(), every=every, compression=compression, process_group=replicate_group,
                      control_group=dist.group.WORLD, alone=replicate_group is None, **kwargs)
