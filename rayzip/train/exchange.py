"""How a training step's gradients cross the network: one :class:`Exchange` per mode.

* :class:`HookExchange`: DDP with rayzip's compressed comm hook;
* :class:`TorchHookExchange`: DDP with torch's own PowerSGD or fp16 hook (baselines);
* :class:`DenseExchange`: plain DDP allreduce, or a world of one (nothing to exchange);
* :class:`ParameterServerExchange`: no DDP; push to the parameter shards, pull parameters;
* :class:`LocalStepsExchange`: no DDP; H local steps, then a compressed outer update
  (:mod:`rayzip.torch.local_steps`);
* :class:`LocalStepsServerExchange`: no DDP; H local steps, then a compressed push of the
  pseudo-gradient to the shards, whose outer optimizer applies it, and a pull;
* :class:`ShardedModelExchange`: FSDP2 inside a node, each shard averaged across nodes
  through rayzip's engine (:mod:`rayzip.torch.fsdp`), or FSDP2's own HSDP without a codec.

A loop drives every mode the same way::

    exchange = build_exchange(spec, model, rank, world, ps_shards=...)
    start, saved = exchange.restore(ray.train.get_checkpoint(), chain)
    for step in ...:
        exchange.begin_step(step, last=step == steps - 1)
        loss = loss_fn(exchange.model, batch)
        loss.backward()                          # the hook exchanges here
        skipped = exchange.skipped(step)         # every rank's same answer
        exchange.apply(step, lr, skipped)        # optimizer step, or push and pull
        traffic = exchange.traffic(step_s)
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Callable

import ray.train.torch
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..adaptive.every import EveryTuner
from ..checkpoint import DeltaChain
from ..checkpoint import load as load_checkpoint
from ..codecs import NonFiniteError
from ..comm import ring_allreduce_bytes
from ..comm.emulation import Emulation
from ..ps import ParameterServerClient, flat_to_parameters
from ..spec import JobSpec
from ..torch import compress, ddp_kwargs
from ..torch.baselines import register_torch_hook
from ..torch.local_steps import LocalSteps
from ..torch.optim import build_optimizer
from .checkpoints import (LocalStepsState, load_optimizer, load_trainer, restore_hook, restore_shards,
                          take_shards, unwrap, write_shards)
from .snapshots import MAX_SNAPSHOT_SLOTS
from .probe import prepare_timed, sync_replicas
from .records import Traffic, traffic_of

__all__ = ["DenseExchange", "Exchange", "HookExchange", "LocalStepsExchange", "LocalStepsServerExchange",
           "ParameterServerExchange", "ShardedLocalStepsExchange", "ShardedModelExchange",
           "TorchHookExchange", "build_exchange", "compute_time", "restore_collective"]


def compute_time(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], repeats: int = 3) -> float:
    """Forward + backward time of one batch with DDP communication off (``no_sync``)."""
    best = float("inf")
    with model.no_sync():
        for _ in range(repeats + 1):  # the first call warms up
            t0 = time.perf_counter()
            loss_fn().backward()
            best = min(best, time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return best


def nonfinite_gradient(model: torch.nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or Inf, or None."""
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


class Exchange:
    """The collective modes' common part: DDP (or a world of one) and a local optimizer."""

    name = "dense"

    def __init__(self, spec: JobSpec, model: torch.nn.Module, rank: int, world: int,
                 optimizer: torch.optim.Optimizer | None, state=None):
        self.spec, self.model, self.rank, self.world = spec, model, rank, world
        self.optimizer, self.state = optimizer, state
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.compute_probe_s = 0.0  # set by the loop on DDP modes (see compute_time)
        self.clips = True  # training.grad_clip_norm applies to what the optimizer receives
        self.skips_together = True  # skipped() is every rank's same answer (local steps: each rank's own)
        # Only the optimizer's step, in apply(), changes the parameters and its state: a
        # background checkpoint may copy them while the next forward and backward run.
        self.only_step_changes_weights = optimizer is not None

    # Whether every rank writes its own shards of the model and optimizer (take_shards, then
    # write_shards, a collective) while weights() returns nothing; otherwise rank 0 writes
    # weights() whole.
    sharded_weights = False
    @property
    def controlled(self):
        """The engine the adaptive controller steers (its proposals and ``last_step``), or
        None: a mode with no per-step compression to tune."""
        return None

    # Whether the loop keeps in-memory snapshots of this mode (rayzip.train.snapshots): a
    # checkpoint's parts at a step, with weights() whole on any rank.
    takes_snapshots = True

    def snapshot_due(self, step: int) -> bool:
        """After ``step``: whether a checkpoint's parts taken now hold the whole state."""
        return True

    @property
    def snapshot_slots(self) -> int:
        """Snapshots each rank keeps: each step's exchange keeps the ranks within a step of
        each other, so the newest step every rank holds is among the last two."""
        return 2

    def take_shards(self, copy: Callable[[Any], Any] | None) -> dict:
        """This rank's shards of the model and optimizer: through ``copy`` (a snapshot to host
        memory), else the live tensors; only where :attr:`sharded_weights`."""
        raise NotImplementedError(f"{type(self).__name__} writes its weights whole")

    def write_shards(self, directory: Path, shards: dict) -> None:
        """Write :meth:`take_shards`' result into the checkpoint ``directory``: every rank, in
        the same order, on the training thread or the background writer's."""
        raise NotImplementedError(f"{type(self).__name__} writes its weights whole")

    @property
    def ddp(self) -> bool:
        return isinstance(self.model, DistributedDataParallel)

    def begin_step(self, step: int, last: bool) -> None:
        """Before forward."""

    def skipped(self, step: int) -> bool:
        """After backward: whether every rank drops this step for a non-finite gradient.
        Under plain DDP or a torch hook every rank holds the same averaged gradient, and at
        world size 1 there is no one to agree with, so each rank's own look is everyone's."""
        name = nonfinite_gradient(self.model)
        if name is not None and self.spec.training.on_nonfinite == "raise":
            raise NonFiniteError(f"step {step}: the gradient of {name} is not finite (rank {self.rank}'s "
                                 "view, the same on every rank)")
        return name is not None

    def apply(self, step: int, lr: float, skipped: bool) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if skipped:
            return
        if self.spec.training.grad_clip_norm is not None and self.clips:
            # The averaged gradient: the same on every rank.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.training.grad_clip_norm)
        self.optimizer.step()

    def dense_step_bytes(self) -> int:
        """What the dense exchange this mode is measured against sends a step: DDP's ring."""
        return ring_allreduce_bytes(4 * self.numel, self.world)

    def traffic(self, step_s: float) -> Traffic:
        """Plain DDP: the ring formula's bytes, and what the step took beyond compute."""
        dense = self.dense_step_bytes()
        comm_s = max(0.0, step_s - self.compute_probe_s) if self.ddp else 0.0
        return Traffic(bytes_sent=dense if self.ddp else 0, dense_bytes=dense, comm_s=comm_s, busy_s=comm_s,
                       network_s=comm_s, comm_source="step minus compute", bytes_source="formula")

    def weights(self) -> tuple[dict, dict]:
        return unwrap(self.model).state_dict(), self.optimizer.state_dict()

    def restore(self, checkpoint, chain: DeltaChain | None = None) -> tuple[int, dict | None]:
        """(next step, rank 0's saved part) from a checkpoint, or (0, None)."""
        return restore_collective(checkpoint, self.rank, self.world, self.model, self.optimizer, self.state, chain)


def restore_collective(checkpoint, rank: int, world: int, model: torch.nn.Module, optimizer, state,
                       chain: DeltaChain | None = None) -> tuple[int, dict | None]:
    """Model, optimizer and hook state from ``checkpoint``: (next step, rank 0's saved part),
    or (0, None) without one."""
    if checkpoint is None:
        return 0, None
    with checkpoint.as_directory() as path:
        path = Path(path)
        trainer = load_trainer(path, model, chain)
        load_optimizer(optimizer, trainer["optimizer"])
        if state is not None:
            restore_hook(path, rank, world, trainer, state)
    return trainer["step"] + 1, trainer


class DenseExchange(Exchange):
    """Plain DDP allreduce, or a world of one."""


class TorchHookExchange(Exchange):
    """torch's own PowerSGD or fp16 comm hook; bytes counted at the torch.distributed call."""

    def __init__(self, *args, counter, **kwargs):
        super().__init__(*args, **kwargs)
        self.counter = counter
        self.name = self.spec.compression.torch_hook

    def traffic(self, step_s: float) -> Traffic:
        traffic = super().traffic(step_s)
        traffic.bytes_sent, traffic.bytes_source = self.counter.take(), "counted"
        return traffic


class HookExchange(Exchange):
    """rayzip's compressed comm hook: the hook counts bytes and times the exchange, and the
    step's control word tells every rank whether to skip, stop or adopt a new compression."""

    name = "rayzip"

    @property
    def controlled(self):
        return self.state

    def begin_step(self, step: int, last: bool) -> None:
        if last:
            self.state.request_stop()  # every rank learns it at this step's exchange, even one that counted more

    def skipped(self, step: int) -> bool:
        return bool(self.state.last_step.skipped)

    def traffic(self, step_s: float) -> Traffic:
        return traffic_of(self.state.last_step)


class ParameterServerExchange(Exchange):
    """Push the gradient to the shards, which step; pull the parameters for the next step.

    Live shards hold the truth, so a new worker group resumes where they are, not at the
    checkpoint; shards that hold nothing (a new run, or a shard restarted after its process
    died) are loaded from the checkpoint, or from this model at step 0."""

    name = "ps"
    takes_snapshots = False  # the live shards hold the truth, and a new group resumes where they are
    every = 1  # training steps per push (local steps: H), for the shards' count of pushes

    def __init__(self, spec: JobSpec, model: torch.nn.Module, rank: int, world: int, client: ParameterServerClient):
        super().__init__(spec, model, rank, world, optimizer=None, state=client)
        self.client = client

    def skipped(self, step: int) -> bool:
        return False  # the client's encode raises on a non-finite gradient

    def apply(self, step: int, lr: float, skipped: bool) -> None:
        self.client.update(self.model, step, lr)

    def traffic(self, step_s: float) -> Traffic:
        return traffic_of(self.client.last_step, source="ps")

    def weights(self) -> tuple[dict, dict]:
        """The shards hold the authoritative parameters and the optimizer state; buffers are
        the worker's."""
        server = self.client.server_state()
        return {**self.model.state_dict(), **flat_to_parameters(self.model, server["params"])}, server["optimizer"]

    def restore(self, checkpoint, chain: DeltaChain | None = None) -> tuple[int, dict | None]:
        trainer, saved = None, None
        if checkpoint is not None:
            with checkpoint.as_directory() as path:
                trainer = load_trainer(Path(path), self.model, chain)
                mine = Path(path) / f"rank{self.rank}"
                saved = load_checkpoint(mine) if mine.exists() else None
        generation = [uuid.uuid4().hex if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(generation, src=0)
        if self.rank == 0:
            initial = {"params": torch.nn.utils.parameters_to_vector(self.model.parameters()).detach().cpu().numpy(),
                       "optimizer": trainer["optimizer"] if trainer else None,
                       "step": (trainer["step"] + 1) // self.every if trainer else 0}
            self.client.begin_group(generation[0], sum(p.numel() for p in self.model.parameters()), initial)
        if dist.is_initialized():
            dist.barrier()
        pushes = self.client.join(generation[0], self.model)
        start = pushes * self.every
        if saved is not None and saved["hook"]["step"] == pushes:
            self.state.load_state_dict(saved["hook"])
        elif saved is not None:
            print(f"rayzip: rank {self.rank} resumes at step {start}, its checkpoint holds step "
                  f"{saved['hook']['step'] * self.every}: error-feedback residuals reset")
        self.joined()
        return start, trainer

    def joined(self) -> None:
        """After the pull that resumes this worker group."""


class LocalStepsServerExchange(ParameterServerExchange):
    """Local steps in parameter-server mode: H inner steps with this worker's own optimizer,
    exchanging nothing; then the pseudo-gradient (the parameters of the last pull minus its
    own) is pushed through the codec with error feedback, the shards' outer optimizer (SGD
    with Nesterov momentum) applies the mean (sync), or each push on arrival (async), and the
    pull is the new synchronized model. The shards count pushes, so training step s is
    round s // H: H is fixed (the spec refuses a tuned one), and evaluations and checkpoints
    fall on synchronizations. Each rank's checkpoint part holds its inner optimizer."""

    def __init__(self, spec: JobSpec, model: torch.nn.Module, rank: int, world: int, client: ParameterServerClient,
                 optimizer: torch.optim.Optimizer):
        super().__init__(spec, model, rank, world, client)
        self.optimizer, self.every = optimizer, spec.local_steps.every
        self.only_step_changes_weights = False  # each pull writes the parameters
        self.state = _ServerLocalState(client, optimizer)
        self.skips_together = False  # inner steps are each rank's own
        self.inner, self.synced = 0, False
        self.anchor: list[torch.Tensor] = []

    def joined(self) -> None:
        self.anchor = [p.detach().clone() for p in self.model.parameters()]
        self.inner = 0

    def begin_step(self, step: int, last: bool) -> None:
        self._last = last

    def skipped(self, step: int) -> bool:
        """This rank's own gradient: under ``raise`` every worker stops (through the shards,
        :meth:`ParameterServerClient.abort`); under ``skip`` this rank skips the inner step."""
        name = nonfinite_gradient(self.model)
        if name is not None and self.spec.training.on_nonfinite == "raise":
            self.client.abort(f"step {step}: rank {self.rank}'s gradient of {name} is not finite")
        return name is not None

    def apply(self, step: int, lr: float, skipped: bool) -> None:
        Exchange.apply(self, step, lr, skipped)  # the inner step
        self.inner += 1
        self.synced = self._last or self.inner >= self.every
        if self.synced:
            with torch.no_grad():
                for p, anchor in zip(self.model.parameters(), self.anchor):
                    p.grad = anchor - p.detach() if p.requires_grad else None  # frozen: pushed as zeros
            self.client.update(self.model, step // self.every, self.spec.local_steps.outer_lr)
            self.model.zero_grad(set_to_none=True)
            self.joined()

    def traffic(self, step_s: float) -> Traffic:
        if self.synced:
            traffic = traffic_of(self.client.last_step, source="ps")
        else:
            traffic = Traffic(comm_source="local step")
        traffic.dense_bytes = 4 * self.numel  # a dense push every step, as plain ps would send
        traffic.local_every = self.every
        return traffic


class _ServerLocalState:
    """The client's state and this rank's inner optimizer, as one checkpoint part."""

    holders = None  # as the client's: nothing to re-shard

    def __init__(self, client: ParameterServerClient, optimizer: torch.optim.Optimizer):
        self.client, self.optimizer = client, optimizer

    def state_dict(self) -> dict:
        return {**self.client.state_dict(), "inner_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.client.load_state_dict(state)
        load_optimizer(self.optimizer, state["inner_optimizer"])


class _Rounds:
    """The step of both local-steps exchanges: an inner step, then a synchronization every H
    (forced at evaluations, checkpoints and the last step), and the traffic of each step
    against what the per-step dense exchange sends (``dense_step_bytes``: DDP's, or dense
    HSDP's between nodes)."""

    local: LocalSteps

    def begin_step(self, step: int, last: bool) -> None:
        # Every rank knows these steps alike. Under a fixed H the spec puts evaluations and
        # checkpoints on synchronizations; under a tuned one they force them.
        every_ckpt = self.spec.checkpoint.every_steps
        self._force = (last or (step + 1) % self.spec.training.eval_every == 0
                       or bool(every_ckpt and (step + 1) % every_ckpt == 0))
        self._started = time.perf_counter()

    def apply(self, step: int, lr: float, skipped: bool) -> None:
        Exchange.apply(self, step, lr, skipped)  # the inner step
        self.local.after_inner_step(force=self._force, compute_s=time.perf_counter() - self._started)

    def traffic(self, step_s: float) -> Traffic:
        dense = self.dense_step_bytes()
        if self.local.synced and self.local.last_sync is not None:
            traffic = traffic_of(self.local.last_sync)
            traffic.dense_bytes, traffic.local_every = dense, self.local.every
            return traffic
        return Traffic(dense_bytes=dense, comm_source="local step", local_every=self.local.every)


class LocalStepsExchange(_Rounds, Exchange):
    """No DDP: each step is this rank's own inner step; every ``local_steps.every`` steps (and
    at the last) the workers synchronize through :class:`~rayzip.torch.local_steps.LocalSteps`.
    Checkpoints fall on synchronizations (the spec requires it), where every rank's
    parameters are the synchronized ones: rank 0's part holds them with its inner optimizer,
    and each rank's part its own inner optimizer, the outer optimizer and its error feedback."""

    name = "local_steps"

    def __init__(self, spec: JobSpec, model: torch.nn.Module, rank: int, world: int,
                 optimizer: torch.optim.Optimizer, local: LocalSteps):
        super().__init__(spec, model, rank, world, optimizer, state=LocalStepsState(local, optimizer, rank, world, model))
        self.local = local
        self.skips_together = False  # inner steps are each rank's own; a round is dropped together
        self.only_step_changes_weights = False  # a synchronization writes the parameters

    def skipped(self, step: int) -> bool:
        return not self.local.gradient_ok(step)

    def snapshot_due(self, step: int) -> bool:
        # Between synchronizations each rank's part holds its own parameters (not with a
        # round in flight: overlap snapshots at the forced synchronizations only).
        return not self.local.in_flight

    @property
    def snapshot_slots(self) -> int:
        # A rank runs on alone until the next synchronization after another dies: the step
        # they share may be a round old. (A tuned H past the cap falls back to storage.)
        spec = self.spec.local_steps
        return min(MAX_SNAPSHOT_SLOTS, (spec.max_every if spec.adaptive else spec.every) + 1)

    def restore(self, checkpoint, chain: DeltaChain | None = None) -> tuple[int, dict | None]:
        if checkpoint is None:
            return 0, None
        with checkpoint.as_directory() as path:
            path = Path(path)
            trainer = load_trainer(path, self.model, chain)
            load_optimizer(self.optimizer, trainer["optimizer"])
            self.state.restore(path, trainer)
        return trainer["step"] + 1, trainer


class ShardedModelExchange(Exchange):
    """FSDP2: the model's parameters, gradients and optimizer state are sharded over each
    node's workers; with ``state`` (a :class:`rayzip.torch.fsdp.ShardedExchange`) each shard's
    gradient is averaged across nodes by rayzip's engine, else FSDP2 does it (``fsdp``, or
    FSDP2's own HSDP). Checkpoints go through ``torch.distributed.checkpoint``: every rank
    writes its own shards, compressed by rayzip's codec (:mod:`rayzip.checkpoint.dcp`), with
    no gather; DCP's planner reshards them on load, so a restart on another world size
    resumes."""

    name = "fsdp"
    sharded_weights = True  # a snapshot holds each rank's own shards: a restart onto the same layout

    def __init__(self, *args, nodes: int, shard_world: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.nodes, self.shard_world = nodes, shard_world
        # Checkpoints take host copies of the shards at once (take_shards): there are no
        # copies of the optimizer's own tensors to defer to the writer.
        self.only_step_changes_weights = False
        # DCP's planning is a collective: on the background writer's thread it needs a group
        # of its own, apart from the training's (every rank builds the exchange alike).
        self.checkpoint_group = dist.new_group(backend="gloo") if self.world > 1 else None

    @property
    def controlled(self):
        return self.state  # rayzip's engine between nodes; None under FSDP2's own exchange

    def begin_step(self, step: int, last: bool) -> None:
        if self.state is not None and last:
            self.state.request_stop()

    def skipped(self, step: int) -> bool:
        if self.state is not None:
            return bool(self.state.last_step.skipped)
        # Each rank holds its own shards' gradients: every rank takes the worst look.
        name = nonfinite_gradient(self.model)
        flag = torch.tensor([0.0 if name is None else 1.0], device=next(self.model.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.spec.training.on_nonfinite == "raise":
            where = f"the gradient of {name}" if name is not None else "another rank's gradient shard"
            raise NonFiniteError(f"step {step}: {where} is not finite (rank {self.rank}'s view)")
        return bool(flag.item())

    def traffic(self, step_s: float) -> Traffic:
        """Bytes between nodes, against a dense exchange of the same shards between nodes:
        rayzip's engine counts them; FSDP2's own all-reduce by the ring formula."""
        if self.state is not None:
            return traffic_of(self.state.last_step)
        between = self.dense_step_bytes()
        return Traffic(bytes_sent=between, dense_bytes=between, comm_s=0.0, busy_s=0.0, network_s=0.0,
                       comm_source="none", bytes_source="formula")

    def dense_step_bytes(self) -> int:
        """What a dense exchange of this rank's shards between the nodes sends a step (dense
        HSDP's all-reduce)."""
        return ring_allreduce_bytes(4 * self.numel // self.shard_world, self.nodes) if self.nodes > 1 else 0

    def weights(self) -> tuple[dict, dict]:
        return {}, {}  # in write_shards' folder

    def take_shards(self, copy: Callable[[Any], Any] | None) -> dict:
        return take_shards(self.model, self.optimizer, copy)

    def write_shards(self, directory: Path, shards: dict) -> None:
        write_shards(directory, shards, self.checkpoint_group)

    def restore(self, checkpoint, chain: DeltaChain | None = None) -> tuple[int, dict | None]:
        """The model's and optimizer's shards, resharded to this world by DCP's planner; each
        rank's residuals where the world size is the same (a shard's residual belongs to its
        layout)."""
        if checkpoint is None:
            return 0, None
        with checkpoint.as_directory() as path:
            trainer = restore_shards(Path(path), self.rank, self.world, self.model, self.optimizer, self.state,
                                     chain)
        return trainer["step"] + 1, trainer


class ShardedLocalStepsExchange(_Rounds, ShardedModelExchange):
    """Local steps on shards (DiLoCo on FSDP2): each node trains with FSDP2 alone, and every
    ``local_steps.every`` steps (and at evaluations, checkpoints and the last) each rank's
    pseudo-gradient shard is averaged with the same shard's on the other nodes
    (:func:`rayzip.torch.fsdp.local_steps_on_shards`). Checkpoints fall on synchronizations
    and go through DCP: the model's and inner optimizer's shards, and the outer optimizer's
    momentum as DTensors laid out like the parameters, so a restart on another world size
    reshards it too; each rank's part holds its error feedback (kept where the world size is
    the same: a shard's residual belongs to its layout)."""

    name = "local_steps"
    controlled = None  # local steps tune H themselves (local_steps.adaptive)

    def __init__(self, *args, local: LocalSteps, **kwargs):
        super().__init__(*args, state=_ShardedLocalState(local), **kwargs)
        self.local = local
        self.skips_together = False  # inner steps are each node's own; a round is dropped together
        params = [p for p in self.model.parameters() if p.requires_grad]
        # The node's ranks skip an inner step together: FSDP2's next collectives (and
        # clipping's) run over them. Nothing crosses between nodes for it.
        self.node_group = params[0].device_mesh.get_group() if self.shard_world > 1 else None
        self.device = params[0].to_local().device  # NCCL's groups take the device's tensors

    def skipped(self, step: int) -> bool:
        ok = self.local.gradient_ok(step)
        if self.node_group is None:
            return not ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.node_group)
        return bool(flag.item())

    def snapshot_due(self, step: int) -> bool:
        # At synchronizations: the parameters are then the synchronized ones, which the
        # shards hold, with the outer momentum (a kill inside a round redoes its steps).
        return not self.local.own_parameters

    def _inner_key(self, nodes: int) -> str:
        """Where this node's inner optimizer is saved, among ``nodes``: the nodes' inner
        optimizers differ (each trained on its own batches), and DCP would keep one copy of
        what the shard layout says is replicated. After a resize node k takes the state of
        node k modulo the old count, as local steps do on a replicated model."""
        return f"inner_optimizer.node{(self.rank // self.shard_world) % max(1, nodes)}"

    def take_shards(self, copy: Callable[[Any], Any] | None) -> dict:
        shards = take_shards(self.model, self.optimizer, None, optimizer_key=self._inner_key(self.nodes))
        outer = self.state.outer_shards()
        if outer:
            shards["outer"] = outer
        return copy(shards) if copy is not None else shards

    def restore(self, checkpoint, chain: DeltaChain | None = None) -> tuple[int, dict | None]:
        if checkpoint is None:
            return 0, None
        outer = self.state.outer_shards(fresh=True)
        with checkpoint.as_directory() as path:
            trainer = restore_shards(Path(path), self.rank, self.world, self.model, self.optimizer, self.state,
                                     chain, extra={"outer": outer} if outer else None,
                                     optimizer_key=lambda saved: self._inner_key(
                                         int(saved["world_size"]) // self.shard_world))
        self.state.load_outer(outer)
        return trainer["step"] + 1, trainer


class _ShardedLocalState:
    """A :class:`LocalSteps` on shards as the checkpoints see it: each rank's part holds its
    error feedback and rounds; the outer momentum travels with the shards through DCP."""

    holders = None  # a shard's residual belongs to its layout: nothing to re-shard

    def __init__(self, local: LocalSteps):
        self.local = local

    def outer_shards(self, fresh: bool = False) -> dict:
        """The outer optimizer's momentum, one DTensor per parameter laid out as it is (zeros
        to load into, with ``fresh``); empty without momentum."""
        from torch.distributed.tensor import DTensor

        if not self.local.outer.param_groups[0]["momentum"]:
            return {}
        out = {}
        for name, anchor, p in zip(self.local.names, self.local.anchor, self.local.params):
            held = self.local.outer.state.get(anchor, {}).get("momentum_buffer")
            local = torch.zeros_like(anchor) if fresh or held is None else held
            out[name] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
        return out

    def load_outer(self, outer: dict) -> None:
        for name, anchor in zip(self.local.names, self.local.anchor):
            if name in outer:
                self.local.outer.state[anchor]["momentum_buffer"] = outer[name].to_local().clone()

    def state_dict(self) -> dict:
        state = self.local.state_dict()
        # The momentum is in the DCP shards; the saved optimizer keeps its settings only.
        state["outer"] = {"state": {}, "param_groups": state["outer"]["param_groups"]}
        return {"local_steps": state}

    def load_state_dict(self, state: dict) -> None:
        self.local.load_state_dict(state["local_steps"])

    def start_at(self, step: int) -> None:
        """After a resize: the loaded shards become the synchronized parameters; error
        feedback starts afresh (the outer momentum comes from the DCP shards)."""
        local = self.local
        local.load_state_dict({"rounds": step // max(1, local.every), "every": local.every,
                               "outer": {"state": {}, "param_groups": local.outer.state_dict()["param_groups"]},
                               "compression": None, "tuner": None})
        if local.state is not None:
            local.state.step = local.rounds
        print(f"rayzip: rank {dist.get_rank()}: local steps on shards resume on a new layout at step {step}: "
              "outer momentum resharded, error feedback starts afresh")


def node_id() -> str:
    """This worker's Ray node: what groups workers by node for the hierarchy (namespaced nodes
    of one machine share its host name)."""
    return ray.get_runtime_context().get_node_id()


def build_exchange(spec: JobSpec, model: torch.nn.Module, rank: int, world: int,
                   ps_shards: list[str] | None = None, emulation: Emulation | None = None) -> Exchange:
    """Prepare ``model`` for Ray Train (DDP unless in parameter-server mode or at world size
    1) and wrap it in the exchange its spec asks for, with its optimizer. ``emulation``: a
    slower link for rayzip's own exchanges (:mod:`rayzip.comm.emulation`)."""
    comp, training = spec.compression, spec.training
    if spec.sharding.enabled:
        return _sharded(spec, model, rank, world, emulation)
    if spec.local_steps.enabled and comp.collective == "ps":
        model = ray.train.torch.prepare_model(model, parallel_strategy=None)
        client = ParameterServerClient(ps_shards, spec, rank, world)
        return LocalStepsServerExchange(spec, model, rank, world, client, build_optimizer(training, model))
    if spec.local_steps.enabled:
        # Inner steps exchange nothing: no DDP. Every rank starts from the same weights (the
        # seed) and each synchronization sets them alike.
        model = ray.train.torch.prepare_model(model, parallel_strategy=None)
        local = spec.local_steps
        synced = LocalSteps(model.named_parameters(), every=local.every, outer_lr=local.outer_lr,
                            outer_momentum=local.outer_momentum, nesterov=local.nesterov,
                            compression=comp.to_config(),
                            on_nonfinite=training.on_nonfinite, max_skipped_rounds=training.max_skipped_steps,
                            tuner=_every_tuner(spec), overlap=local.overlap, emulation=emulation, node_key=node_id(),
                            keep_unsent=local.keep_unsent)
        return LocalStepsExchange(spec, model, rank, world, build_optimizer(training, model), synced)
    if comp.collective == "ps":
        # The shards combine gradients: no DDP allreduce underneath.
        model = ray.train.torch.prepare_model(model, parallel_strategy=None)
        momentum = training.momentum if comp.momentum_correction else None
        client = ParameterServerClient(ps_shards, spec, rank, world, momentum=momentum)
        return ParameterServerExchange(spec, model, rank, world, client)
    hooked = comp.torch_hook is None and (comp.codec != "none" or comp.verify or comp.momentum_correction
                                          or comp.hierarchy == "node")
    config = comp.to_config() if hooked else None
    model, probe = prepare_timed(model, parallel_strategy="ddp",
                                 parallel_strategy_kwargs=ddp_kwargs(config) if hooked else None)
    ddp = isinstance(model, DistributedDataParallel)
    if ddp and comp.torch_hook is not None:
        counter = register_torch_hook(model, comp.torch_hook, comp.powersgd_rank, comp.powersgd_start_iter)
        return TorchHookExchange(spec, model, rank, world, build_optimizer(training, model),
                                 counter=counter)
    if ddp and hooked:
        state = compress(model, config, momentum=training.momentum if comp.momentum_correction else None,
                         adam_betas=tuple(training.betas) if comp.adam_correction else None,
                         on_nonfinite=training.on_nonfinite, emulation=emulation, node_key=node_id(),
                         optimizer=training.optimizer)
        state.link_probe = probe
        optimizer = build_optimizer(training, model, momentum_elsewhere=comp.momentum_correction,
                                    adam_elsewhere=comp.adam_correction)
        exchange = HookExchange(spec, model, rank, world, optimizer, state=state)
        # Under Adam correction the optimizer receives the averaged Adam direction, which the
        # moments already bound; at world size 1 (no hook) it is AdamW on the gradient, clipped.
        exchange.clips = not comp.adam_correction
        return exchange
    # At world size 1 there is no hook, so momentum stays in the optimizer.
    return DenseExchange(spec, model, rank, world, build_optimizer(training, model))



def _every_tuner(spec: JobSpec) -> EveryTuner | None:
    """The tuner of H where ``local_steps.adaptive`` asks for one."""
    local = spec.local_steps
    if not local.adaptive:
        return None
    # Evaluations and checkpoints force synchronizations: no H above their interval runs,
    # so none is the fastest to compare with.
    due = [spec.training.eval_every, spec.checkpoint.every_steps or local.max_every]
    return EveryTuner(local.min_every, max(local.min_every, min(local.max_every, *due)), local.slack,
                      overlap=local.overlap)


def _sharded(spec: JobSpec, model: torch.nn.Module, rank: int, world: int, emulation: Emulation | None) -> Exchange:
    """FSDP2 on this worker's device, the shards' exchange between nodes (rayzip's engine when
    there is a codec, FSDP2's own HSDP without one)."""
    from ..torch.fsdp import compress_sharded, local_steps_on_shards, shard_group_size, shard_model

    comp, training, sharding = spec.compression, spec.training, spec.sharding.to_config()
    model = model.to(ray.train.torch.get_device())
    per_node = ray.train.get_context().get_local_world_size()
    shard_world = shard_group_size(sharding, world, per_node)
    local = spec.local_steps
    native = comp.codec == "none" and not comp.verify and not local.enabled
    model, replicate = shard_model(model, sharding, per_node, native_hsdp=native)
    if local.enabled:  # the spec asks for replicas: hsdp over more than one node
        synced = local_steps_on_shards(model, replicate, every=local.every, compression=comp.to_config(),
                                       outer_lr=local.outer_lr, outer_momentum=local.outer_momentum,
                                       nesterov=local.nesterov, on_nonfinite=training.on_nonfinite,
                                       max_skipped_rounds=training.max_skipped_steps, tuner=_every_tuner(spec),
                                       emulation=emulation, node_key=node_id())
        return ShardedLocalStepsExchange(spec, model, rank, world, build_optimizer(training, model.parameters()),
                                         local=synced, nodes=world // shard_world, shard_world=shard_world)
    state = None
    if replicate is not None:
        state = compress_sharded(model, comp.to_config(), replicate,
                                 momentum=training.momentum if comp.momentum_correction else None,
                                 on_nonfinite=training.on_nonfinite, emulation=emulation)
        state.link_probe = sync_replicas(model, replicate)
    optimizer = build_optimizer(training, model.parameters(), momentum_elsewhere=comp.momentum_correction)
    return ShardedModelExchange(spec, model, rank, world, optimizer, state=state, nodes=world // shard_world,
                                shard_world=shard_world)
