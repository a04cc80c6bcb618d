"""rayzip in your own Ray Train loop: compressed gradients and checkpoints in two lines.

Inside a ``train_func`` for ``ray.train.torch.TorchTrainer``::

    import rayzip.train

    def train_func(config):
        model = rayzip.train.prepare_model(build_model(), optimizer="adamw")  # the compression that holds AdamW's quality
        optimizer = torch.optim.AdamW(model.parameters())
        start = rayzip.train.restore(model, optimizer)          # {} on a fresh start, else what you saved
        for step in range(start.get("step", -1) + 1, steps):
            ...                                                  # forward, backward, optimizer.step()
            rayzip.train.report({"loss": loss}, model=model, optimizer=optimizer, extra={"step": step})

``prepare_model`` calls ``ray.train.torch.prepare_model`` and registers rayzip's comm hook on
the DDP model it returns (at world size 1 there is no DDP and nothing to exchange: the same
code runs, and :func:`compression_state` is None). ``report`` writes a compressed rayzip
checkpoint: rank 0 the model, the optimizer and ``extra``, every rank its compression state
(residuals, velocities, codec state, step). ``restore`` reads them back from
``ray.train.get_checkpoint()`` on every rank, re-sharding the compression state when the
world size changed (see :func:`rayzip.train.checkpoints.restore_hook`).

Every rank must call ``report`` and ``restore`` at the same points, as with
``ray.train.report``. ``report(..., background=True)`` writes the checkpoint on a thread while
training goes on and reports it at the next ``report`` or :func:`flush`.

So that a lost worker costs no steps, not only those since the last checkpoint, wrap
``trainer.fit()`` in :func:`keep_snapshots` on the driver and call :func:`snapshot` after each
optimizer step: each rank's state goes to a keeper on its node, outside the worker, and
``restore`` after a restart takes the newest step that every rank's keeper holds before it
reads storage (:mod:`rayzip.train.snapshots`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import ray.train
import ray.train.torch
import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..spec import CompressionSpec, LocalStepsSpec, ShardingSpec
from ..engine.config import CompressionConfig
from ..engine import GradientExchange
from ..torch.fsdp import ShardedExchange, ShardingConfig, compress_sharded, shard_model
from ..torch.hook import compress, ddp_kwargs
from ..torch.local_steps import LocalSteps, LocalStepsConfig, sparseloco_compression
from ..torch.optim import default_compression, warn_for_optimizer
from .checkpoints import (GroupCheckpoints, load_optimizer, load_trainer, newest_of, restore_hook, restore_shards,
                          save_shards, take_parts, take_shards, unwrap, write_parts, write_taken)
from ..keeper import DEFAULT_MAX_BYTES
from .exchange import node_id
from .local import OwnLoopLocalSteps, own_gradient_hook
from .probe import prepare_timed, sync_replicas

__all__ = ["CompressionConfig", "KeptSnapshots", "LocalStepsConfig", "ShardingConfig", "compression_state", "flush",
           "keep_snapshots", "prepare_model", "report", "restore", "save_checkpoint", "snapshot"]

_ATTRIBUTE = "_rayzip_compression_state"


class _ForOptimizer:
    """``prepare_model``'s default compression: the one that holds quality under the
    optimizer it is told of, and none (plain DDP) where it is told of no optimizer."""

    def __repr__(self) -> str:
        return "<the default for the optimizer>"


FOR_OPTIMIZER = _ForOptimizer()


def prepare_model(model: torch.nn.Module,
                  compression: CompressionConfig | CompressionSpec | None | _ForOptimizer = FOR_OPTIMIZER, *,
                  sharding: ShardingConfig | ShardingSpec | None = None,
                  local_steps: LocalStepsConfig | LocalStepsSpec | None = None,
                  momentum: float | None = None, adam_betas: tuple[float, float] | None = None,
                  on_nonfinite: str = "raise", grad_scaler: torch.amp.GradScaler | None = None,
                  optimizer: torch.optim.Optimizer | str | None = None, **prepare_kwargs: Any) -> torch.nn.Module:
    """``ray.train.torch.prepare_model(model, **prepare_kwargs)`` with rayzip's compressed comm
    hook on the DDP model it returns. At world size 1 there is no DDP, nothing to exchange,
    and :func:`compression_state` is None.

    Args:
        model: your model, inside a Ray Train worker.
        compression: the library's config, or a job spec's compression section (converted
            with its ``to_config``); None: plain DDP. Left out: the compression that holds
            quality under ``optimizer``: under AdamW and other adaptive optimizers SparseLoCo's
            wire every step, each rank stepping its own optimizer on its own gradient
            (:func:`_per_step_default`; with ``grad_scaler``, 4-bit DCT, with ``sharding``
            8-bit DCT between the shard groups); under
            SGD group top-k at 1% (:func:`rayzip.torch.optim.default_compression`); plain DDP
            where no optimizer is named.
        sharding: shard the model with FSDP2 instead of DDP
            (:class:`rayzip.torch.fsdp.ShardingConfig`, or a job spec's ``sharding`` section):
            under ``hsdp`` each shard group is a node's workers by default, and ``compression``
            averages each gradient shard between the groups (without a codec, FSDP2's own
            HSDP does, densely); :func:`report` and :func:`restore` then write and read each
            rank's shards through ``torch.distributed.checkpoint``.
        local_steps: train with local steps instead of averaging every gradient
            (:class:`rayzip.train.LocalStepsConfig`, or a job spec's ``local_steps``
            section): each rank's ``optimizer.step()`` is its own, on its own gradient (what
            your code sees after ``backward()`` stays that gradient), and after every H-th
            the ranks' pseudo-gradients are averaged through ``compression`` (left out:
            :func:`rayzip.torch.local_steps.sparseloco_compression`, which holds quality
            under AdamW) and an outer step sets every rank's parameters alike.
            Build one optimizer for the model; your loop calls nothing more
            (:mod:`rayzip.train.local`). :func:`report` and :func:`restore` then need the
            optimizer, which holds each rank's own state. Not with ``sharding``,
            ``grad_scaler`` or a codec's momentum or Adam correction.
        momentum: the SGD momentum, with ``compression.momentum_correction``: build the
            optimizer with momentum 0 where :func:`compression_state` is not None, with this
            momentum where it is.
        adam_betas: Adam's betas, with ``compression.adam_correction``: build the optimizer as
            ``torch.optim.SGD(params, lr, momentum=0, weight_decay=wd)`` where
            :func:`compression_state` is not None, as AdamW where it is.
        on_nonfinite: ``"raise"`` or ``"skip"``, as for :func:`rayzip.torch.compress`.
        grad_scaler: AMP's ``GradScaler``, as for :func:`rayzip.torch.compress`.
        optimizer: the optimizer your loop builds, or its name ("sgd", "adamw"...): without
            ``compression`` it picks one; with a sparse codec every step under an adaptive
            optimizer it warns once, naming what holds quality there.
        **prepare_kwargs: passed to ``ray.train.torch.prepare_model``.

    Returns:
        The prepared model (DDP where the world has more than one rank).

    Example::

        model = rayzip.train.prepare_model(model, optimizer="adamw")  # SparseLoCo's wire every step
        model = rayzip.train.prepare_model(model, compression=CompressionConfig(codec="group_topk", density=0.01))
        model = rayzip.train.prepare_model(model, local_steps=LocalStepsConfig(every=4))  # SparseLoCo's outer updates
    """
    if isinstance(sharding, ShardingSpec):
        sharding = sharding.to_config() if sharding.enabled else None
    if isinstance(local_steps, LocalStepsSpec):
        local_steps = local_steps.to_config() if local_steps.enabled else None
    if compression is FOR_OPTIMIZER and local_steps is None and ray.train.get_context().get_world_size() > 1:
        local_steps = _per_step_default(optimizer, sharding, grad_scaler)
    if local_steps is not None:
        if compression is FOR_OPTIMIZER:
            compression = sparseloco_compression()
        elif isinstance(compression, CompressionSpec):
            compression = compression.to_config()
        return _prepare_local(model, local_steps, compression, sharding, on_nonfinite, grad_scaler, prepare_kwargs)
    if compression is FOR_OPTIMIZER:
        compression = default_compression(optimizer, sharded=sharding is not None) if optimizer is not None else None
        optimizer = None  # chosen for it: nothing to warn of
    if isinstance(compression, CompressionSpec):
        if compression.collective == "ps":
            raise ValueError("collective ps runs parameter-server shards, which `rayzip run` starts; "
                             "in your own loop, choose auto, ring, balanced, allreduce or allgather")
        compression = compression.to_config()
    if compression is not None:
        warn_for_optimizer(compression, optimizer)
    if sharding is not None:
        return _prepare_sharded(model, compression, sharding, momentum, adam_betas, on_nonfinite, grad_scaler)
    if compression is not None and "parallel_strategy_kwargs" not in prepare_kwargs:
        prepare_kwargs["parallel_strategy_kwargs"] = ddp_kwargs(compression)
    prepared, probe = prepare_timed(model, **prepare_kwargs)
    state = None
    if isinstance(prepared, DistributedDataParallel) and compression is not None:
        state = compress(prepared, compression, momentum=momentum if compression.momentum_correction else None,
                         adam_betas=adam_betas if compression.adam_correction else None,
                         on_nonfinite=on_nonfinite, grad_scaler=grad_scaler, node_key=node_id())
        state.link_probe = probe
    object.__setattr__(prepared, _ATTRIBUTE, state)  # a plain attribute, not a submodule
    return prepared


def _per_step_default(optimizer: torch.optim.Optimizer | str | None, sharding=None,
                     grad_scaler: torch.amp.GradScaler | None = None) -> LocalStepsConfig | None:
    """``prepare_model``'s default under an adaptive optimizer (AdamW and its kin): SparseLoCo's
    wire every step (:func:`sparseloco_compression` at H = 1), each rank keeping its unsent
    residual in its weights (``keep_unsent``). Gradient sparsifiers every step cost a
    transformer's quality under AdamW because AdamW scales the late, summed entries by
    statistics of gradients it never saw; here each rank's own AdamW steps on its own
    gradient, and what the wire holds back stays in that rank's weights
    (docs/adr/0011-adamw-default-is-sparseloco-every-step.md). None (the per-step codec of
    :func:`rayzip.torch.optim.default_compression`) under any other optimizer, with a
    ``grad_scaler`` (a rank's scaler skips steps on its own) or with ``sharding``."""
    from ..torch.optim import adaptive

    if optimizer is None or not adaptive(optimizer) or sharding is not None or grad_scaler is not None:
        return None
    return LocalStepsConfig(every=1, keep_unsent=True)


def _prepare_local(model: torch.nn.Module, config: LocalStepsConfig, compression: CompressionConfig | None,
                   sharding, on_nonfinite: str, grad_scaler: torch.amp.GradScaler | None,
                   prepare_kwargs: dict) -> torch.nn.Module:
    if sharding is not None:
        raise ValueError("local steps on a sharded model run under `rayzip run` (sharding.mode hsdp with "
                         "local_steps), not through prepare_model yet")
    if grad_scaler is not None:
        # A scaler skips a rank's step on its own, and the ranks' step counts would part.
        raise ValueError("local steps take no grad_scaler: each rank's optimizer steps on its own, and a skipped "
                         "step would put the ranks' synchronizations apart; use bf16 autocast, which needs none")
    if compression is not None and (compression.momentum_correction or compression.adam_correction):
        raise ValueError("local steps keep momentum in the inner and outer optimizers: set momentum_correction "
                         "and adam_correction to false")
    kwargs = dict(prepare_kwargs.pop("parallel_strategy_kwargs", None) or {})
    # No collective in a forward: after the start, each rank's buffers are its own.
    kwargs.setdefault("forward_sync_buffers", False)
    prepared, _ = prepare_timed(model, parallel_strategy_kwargs=kwargs, **prepare_kwargs)
    context = ray.train.get_context()
    world = context.get_world_size()
    if isinstance(prepared, DistributedDataParallel):
        prepared.register_comm_hook(None, own_gradient_hook)
    # After DDP's broadcast of rank 0's parameters: every rank's round starts from the same.
    local = LocalSteps(unwrap(prepared).named_parameters(), every=config.every, outer_lr=config.outer_lr,
                       outer_momentum=config.outer_momentum, nesterov=config.nesterov, compression=compression,
                       on_nonfinite=on_nonfinite, node_key=node_id(), keep_unsent=config.keep_unsent)
    state = OwnLoopLocalSteps(prepared, local, context.get_world_rank(), world)
    object.__setattr__(prepared, _ATTRIBUTE, state)
    return prepared


def _prepare_sharded(model: torch.nn.Module, compression: CompressionConfig | None, sharding: ShardingConfig,
                     momentum: float | None, adam_betas: tuple[float, float] | None, on_nonfinite: str,
                     grad_scaler: torch.amp.GradScaler | None) -> torch.nn.Module:
    if grad_scaler is not None or (compression is not None and compression.adam_correction):
        raise ValueError("a sharded model takes no grad_scaler or adam_correction yet")
    context = ray.train.get_context()
    model = model.to(ray.train.torch.get_device())
    codec = compression is not None and compression.codec != "none"
    model, replicate = shard_model(model, sharding, context.get_local_world_size(), native_hsdp=not codec)
    state = None
    if replicate is not None:
        state = compress_sharded(model, compression, replicate, on_nonfinite=on_nonfinite,
                                 momentum=momentum if compression.momentum_correction else None)
        state.link_probe = sync_replicas(model, replicate)
    object.__setattr__(model, _ATTRIBUTE, state)
    return model


def snapshot_slots(model: torch.nn.Module) -> int:
    """The snapshots each rank keeps: under local steps a round's and one (a rank runs on
    alone until the next synchronization after another dies), else two."""
    state = compression_state(model)
    return state.snapshot_slots if isinstance(state, OwnLoopLocalSteps) else 2


def _is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def compression_state(model: torch.nn.Module) -> GradientExchange | ShardedExchange | OwnLoopLocalSteps | None:
    """The engine behind a prepared model's hook.

    Args:
        model: a model that :func:`prepare_model` returned.

    Returns:
        Its :class:`~rayzip.engine.GradientExchange` (``last_step``, ``set_density``,
        ``propose``...), a sharded model's :class:`~rayzip.torch.fsdp.ShardedExchange`, under
        local steps a :class:`~rayzip.train.local.OwnLoopLocalSteps` (``local``, ``step``,
        ``synchronize()`` before evaluating inside a round), or
        None at world size 1, for a sharded model with nothing to exchange between shard
        groups, or for a model that :func:`prepare_model` did not prepare.
    """
    return getattr(model, _ATTRIBUTE, None)


def _trainer_part(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict | None):
    state = compression_state(model)
    if isinstance(state, OwnLoopLocalSteps):
        state.bind(optimizer)

    def trainer() -> dict:
        sharded = _is_sharded(model)  # every rank's shards go to save_shards' folder instead
        return {"model": {} if sharded else unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None and not sharded else None,
                "step": state.step - 1 if state is not None else -1, "extra": dict(extra or {})}

    return trainer, state


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> Path:
    """Write this rank's part of a checkpoint into ``directory`` (every rank calls it): rank
    0 the model, optimizer and ``extra`` (tensors, numbers, strings, containers), every rank
    its compression state."""
    directory = Path(directory)
    context = ray.train.get_context()
    trainer, state = _trainer_part(model, optimizer, extra)
    if _is_sharded(model):
        save_shards(directory, model, optimizer)
    write_parts(directory, context.get_world_rank(), context.get_world_size(), trainer, state)
    return directory


_GROUP: GroupCheckpoints | None = None  # this worker's background checkpoints
_PENDING_METRICS: dict = {}  # what the last background report reported


def _group() -> GroupCheckpoints:
    global _GROUP
    if _GROUP is None:
        context = ray.train.get_context()
        device = ray.train.torch.get_device() if torch.cuda.is_available() else torch.device("cpu")
        _GROUP = GroupCheckpoints(context.get_world_size(), device, background=False)
    return _GROUP


def report(metrics: dict, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
           extra: dict | None = None, background: bool = False) -> None:
    """``ray.train.report(metrics)``, with a compressed checkpoint when ``model`` is given.

    With ``background``, the checkpoint is a host snapshot of the model, the optimizer,
    ``extra`` and the compression state, compressed and written on a thread while your loop
    goes on; only the snapshot (a memory copy) delays it. The checkpoint is reported to Ray
    Train at your next ``report`` (or :func:`flush`), which first waits for the write if it
    is still running: a worker lost before then resumes from the checkpoint before, never
    from a half-written one. Call :func:`flush` after the last background report. Every rank
    calls it at the same point.

    Args:
        metrics: what ``ray.train.report`` reports.
        model: with it, a checkpoint of the model, the optimizer, ``extra`` and the
            compression state goes with the report.
        optimizer: saved with the model.
        extra: numbers, strings, tensors and containers to save (your epoch, your data's
            position), which :func:`restore` returns.
        background: write the checkpoint on a thread while training goes on.

    Example::

        rayzip.train.report({"loss": loss}, model=model, optimizer=optimizer, extra={"epoch": epoch})
    """
    global _PENDING_METRICS
    group = _group()
    ready = group.flush()
    if model is not None and background:
        _PENDING_METRICS = dict(metrics)
    if model is not None:
        directory = Path(tempfile.mkdtemp(prefix="rayzip-ckpt-"))
        context = ray.train.get_context()
        trainer, state = _trainer_part(model, optimizer, extra)

        def take(copy):
            if _is_sharded(model):  # every rank writes its shards now (a collective)
                save_shards(directory, model, optimizer)
            return take_parts(context.get_world_rank(), context.get_world_size(), trainer, state, copy)

        ready += group.save(directory, take, lambda parts: write_taken(directory, parts), background=background)
    _report(metrics, ready)


def flush(metrics: dict | None = None) -> None:
    """Wait for a checkpoint that :func:`report` writes in the background, and report it
    with ``metrics`` (default: those of the report that started it); nothing when none is
    pending. Every rank calls it at the same point."""
    ready = _group().flush()
    if ready:
        _report(dict(_PENDING_METRICS if metrics is None else metrics), ready)


def _report(metrics: dict, ready: list[Path]) -> None:
    if not ready:
        ray.train.report(metrics)
    for directory in ready:
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(directory)),
                         delete_local_checkpoint_after_upload=True)


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            checkpoint: ray.train.Checkpoint | None = None) -> dict:
    """Load the latest state into ``model``, ``optimizer`` and the compression state,
    re-sharding error feedback when the world size changed. Every rank calls it.

    Without ``checkpoint``, the newest step that every rank's snapshot keeper holds complete
    (:func:`snapshot`, under :func:`keep_snapshots`), checksums verified, or
    ``ray.train.get_checkpoint()`` where the keepers hold nothing as new: a loop that
    snapshots less often than it reports checkpoints resumes from whichever is newer, by the
    compression state's step count that both hold.

    Args:
        model: the prepared model.
        optimizer: restored where the checkpoint has one.
        checkpoint: this checkpoint, and nothing else (default: memory, then storage).

    Returns:
        The ``extra`` saved with the snapshot or checkpoint, or {} when there is none.

    Example::

        saved = rayzip.train.restore(model, optimizer)
        start_epoch = saved.get("epoch", -1) + 1
    """
    if checkpoint is not None:
        return _restored_from("storage", restore_checkpoint(model, optimizer, checkpoint))
    snapshots = _snapshots(model)
    if snapshots is None:
        return _restore_storage(model, optimizer)
    with snapshots.newest_checkpoint() as memory:  # every rank, together
        checkpoint, source = newest_of(memory, ray.train.get_checkpoint())
        if source == "memory":
            print(f"rayzip: rank {snapshots.rank}: resuming from the newest in-memory snapshot that every rank holds")
        elif memory is not None:
            print(f"rayzip: rank {snapshots.rank}: resuming from the checkpoint in storage, newer than the newest "
                  "in-memory snapshot that every rank holds")
        return _restored_from(source, restore_checkpoint(model, optimizer, checkpoint))


def _restore_storage(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    stored = ray.train.get_checkpoint()
    return _restored_from("storage" if stored is not None else "start", restore_checkpoint(model, optimizer, stored))


# Where this worker process's restore() resumed from, for keep_snapshots' record of restarts.
_RESUMED = {"source": "start"}


def _restored_from(source: str, extra: dict) -> dict:
    _RESUMED["source"] = source
    return extra


def restore_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                       checkpoint: ray.train.Checkpoint | None) -> dict:
    """:func:`restore` from ``checkpoint`` only ({} where it is None)."""
    if checkpoint is None:
        return {}
    context = ray.train.get_context()
    with checkpoint.as_directory() as path:
        path = Path(path)
        state = compression_state(model)
        if _is_sharded(model):
            trainer = restore_shards(path, context.get_world_rank(), context.get_world_size(), model, optimizer, state)
            return dict(trainer.get("extra") or {})
        trainer = load_trainer(path, model)
        if optimizer is not None and trainer.get("optimizer") is not None:
            load_optimizer(optimizer, trainer["optimizer"])
        if isinstance(state, OwnLoopLocalSteps):  # each rank's own optimizer and round, after rank 0's
            state.bind(optimizer).restore(path, trainer)
        elif state is not None:
            restore_hook(path, context.get_world_rank(), context.get_world_size(), trainer, state)
    return dict(trainer.get("extra") or {})


# -- in-memory snapshots ----------------------------------------------------------------------

# (run, rank, world) -> this worker's Snapshots, or why the run keeps none (said once, then "")
_SNAPSHOTS: dict[tuple, Any] = {}
# run -> keep_snapshots' record of restarts (rank 0 posts each step to it), or None
_RECORDERS: dict[str, Any] = {}


def _recorder_name(run: str) -> str:
    # Not the name `rayzip run` gives its own progress actor: a loop under it that calls
    # snapshot() must not post its steps twice.
    return f"rayzip-recoveries-{run}"


class KeptSnapshots:
    """What :func:`keep_snapshots` kept for a run, filled when its block ends.

    Attributes:
        memory: {node id: what its keeper held at the end (``held_bytes``,
            ``reserved_bytes``, ``max_bytes``, ``refused``)}.
        resumes: one entry per worker-group restart, as in ``rayzip run``'s summary: the last
            step before it (``last_step``), the step it resumed at (``resumed_at``),
            ``steps_lost`` (done before it and again after), ``seconds`` from the last step
            before it to the first after, ``source`` (``memory``, ``storage`` or ``start``),
            ``cause`` (``worker_failure``, ``node_lost`` or ``scale_up``), ``nodes_lost`` and
            the world sizes before and after.
        restarts: how many restarts.
        steps_lost: the steps lost, over all of them.
    """

    def __init__(self) -> None:
        self.memory: dict[str, dict] = {}
        self.resumes: list[dict] = []
        self.restarts = 0
        self.steps_lost = 0

    def __repr__(self) -> str:
        return f"KeptSnapshots(restarts={self.restarts}, steps_lost={self.steps_lost}, nodes={len(self.memory)})"


@contextlib.contextmanager
def keep_snapshots(run: str | ray.train.RunConfig, every: int | str = "auto",
                   max_bytes_per_node: int = DEFAULT_MAX_BYTES, directory: str | None = None,
                   copy_density: float = 1.0) -> Iterator[dict]:
    """On the driver, around ``trainer.fit()``: a snapshot keeper on each node for the run, so
    that the workers' :func:`snapshot` keeps each step off the worker and :func:`restore`
    resumes a restarted worker group from memory. The keepers are removed, with everything
    they hold, when the block ends.

    A keeper is a Ray actor (no CPU) that owns a folder on its node's shared memory; each
    rank's snapshot is one memory copy into its slots there, so a killed worker process leaves
    it behind. A node that joins later gets its keeper from its first worker. When a node is
    lost with its keeper, the survivors' snapshots still resume the run: the lost ranks' error
    feedback is re-sharded from the survivors', as on a resize, or under local steps with
    ``combine: senders`` taken from its partial copy on another node (``copy_density``).

    Args:
        run: the ``ray.train.RunConfig`` that the trainer is given (the workers find their
            keepers by its ``name``, which Ray Train makes up where you give none), or that name.
        every: snapshot every N steps, or ``"auto"``: every step while a snapshot costs at most
            5% of one, else the fewest steps between them that keep it there (every rank agrees).
        max_bytes_per_node: what one node's snapshots may hold (each rank keeps two); a rank
            past it takes no more, with a log line, and its restarts read storage.
        directory: where each node keeps them (default ``/dev/shm``).
        copy_density: under local steps with ``combine: senders`` on more than one node, the
            share of each group of a rank's error feedback (its largest entries, 4-bit values)
            copied to the next node's keeper after each synchronization; 0: none.

    Each restart is recorded, as ``rayzip run`` records its own: rank 0's :func:`snapshot`
    posts each step to a small actor on the driver's node, which counts the restarts, the
    steps each lost and its recovery time, and exports ``rayzip_recoveries_total``,
    ``rayzip_steps_lost_total`` and ``rayzip_recovery_seconds`` (labels ``run`` and ``job``:
    the run's name) to Prometheus.

    Yields:
        A :class:`KeptSnapshots`, filled when the block ends: what each node's keeper held
        then, and the run's restarts.

    Example::

        run_config = ray.train.RunConfig(name="digits", failure_config=ray.train.FailureConfig(max_failures=3))
        trainer = TorchTrainer(train_func, scaling_config=scaling, run_config=run_config)
        with rayzip.train.keep_snapshots(run_config) as kept:
            result = trainer.fit()
        print(kept.restarts, kept.steps_lost, kept.resumes)
    """
    from ..progress import start_progress
    from .snapshots import start_keepers, stop_keepers

    name = run if isinstance(run, str) else run.name
    if not name:
        raise ValueError("keep_snapshots needs the run's name (the trainer's RunConfig, or its name): the workers "
                         "find their keepers by it")
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every is a number of steps >= 1, or 'auto', got {every!r}")
    if not 0 <= copy_density <= 1:
        raise ValueError(f"copy_density is a share of the entries in [0, 1], got {copy_density!r}")
    keepers = start_keepers(name, directory, max_bytes_per_node, every=every, copy_density=copy_density)
    kept, recorder = KeptSnapshots(), None
    try:
        recorder = start_progress(_recorder_name(name), name, name)
        yield kept
    finally:
        kept.memory.update(stop_keepers(name, keepers, directory))
        if recorder is not None:
            try:
                restarts = ray.get(recorder.get_restarts.remote(), timeout=30)
                kept.resumes = restarts["resumes"]
                kept.restarts, kept.steps_lost = restarts["restarts"], restarts["steps_redone"]
            finally:
                ray.kill(recorder)


def snapshot(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: dict | None = None) -> None:
    """Keep this rank's state after ``step`` in its node's keeper (:func:`keep_snapshots` on the
    driver), so that a restart's :func:`restore` resumes here: what :func:`report` would
    checkpoint (the model, the optimizer, ``extra`` and the compression state), as a memory
    copy. Every rank calls it after the same steps. Nothing, after one log line, where the
    driver keeps no snapshots for this run.

    For a bitwise resume, ``extra`` holds what your loop needs to redo the next step exactly:
    the step, your data's position, RNG states your model draws from.

    Args:
        step: the step just done; ``restore`` returns ``extra`` of the newest one kept.
        model: the prepared model.
        optimizer: kept with it.
        extra: numbers, strings, tensors and containers, as for :func:`report`.

    Example::

        optimizer.step()
        rayzip.train.snapshot(step, model, optimizer, extra={"step": step})
    """
    snapshots = _snapshots(model, asked=True)
    if snapshots is None:
        return
    shards = (lambda: take_shards(model, optimizer)) if _is_sharded(model) else None
    snapshots.after_step(step, *_trainer_part(model, optimizer, extra), shards=shards)
    if snapshots.rank == 0:
        _post_step(step, snapshots.world)


def _post_step(step: int, world: int) -> None:
    """Rank 0's step to keep_snapshots' recorder: a new process, or a step at or before the
    last one, is a restart there."""
    run = ray.train.get_context().get_experiment_name()
    if run not in _RECORDERS:
        try:
            _RECORDERS[run] = ray.get_actor(_recorder_name(run))
        except ValueError:  # keepers started some other way: nothing records the restarts
            _RECORDERS[run] = None
    recorder = _RECORDERS[run]
    if recorder is not None:  # fire and forget, as rayzip run's progress
        recorder.update.remote({"step": step, "pid": os.getpid(), "world_size": world,
                                "resumed_source": _RESUMED["source"]})


def _snapshots(model: torch.nn.Module, asked: bool = False):
    """This worker's snapshots of the run, made on the first call (every rank's first call at
    the same point: they agree whether the run keeps any), or None; where ``asked`` (by
    :func:`snapshot`), a run without them says so once."""
    import torch.distributed as dist

    from .snapshots import Snapshots, worker_keepers

    context = ray.train.get_context()
    key = (context.get_experiment_name(), context.get_world_rank(), context.get_world_size())
    if key not in _SNAPSHOTS:
        run, rank, world = key
        keepers, settings = worker_keepers(run)
        kept = torch.tensor([1 if keepers else 0])
        if world > 1 and dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                kept = kept.to(ray.train.torch.get_device())
            dist.all_reduce(kept, op=dist.ReduceOp.MIN)  # all ranks in Snapshots' collectives, or none
        if not keepers:
            _SNAPSHOTS[key] = (f"rayzip: rank {rank}: no snapshot keepers for run {run!r} "
                               "(rayzip.train.keep_snapshots on the driver starts them): snapshot() keeps nothing, "
                               "and restarts resume from the checkpoint in storage")
        elif not int(kept):
            _SNAPSHOTS[key] = (f"rayzip: rank {rank}: other ranks found no snapshot keepers for run {run!r}: "
                               "snapshot() keeps nothing, and restarts resume from the checkpoint in storage")
        else:
            _SNAPSHOTS[key] = Snapshots(keepers, rank, world, ray.get_runtime_context().get_node_id(),
                                        settings["every"], slots=snapshot_slots(model), sharded=_is_sharded(model),
                                        copy_density=settings.get("copy_density", 0.0))
    found = _SNAPSHOTS[key]
    if isinstance(found, str):  # why there are none, said once, by the first snapshot()
        if asked and found:
            print(found)
            _SNAPSHOTS[key] = ""
        return None
    return found
