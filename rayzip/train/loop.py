"""The per-worker training loop that ``rayzip run`` hands to Ray Train's TorchTrainer.

``training.loop`` picks what runs on each worker: a built-in task (:mod:`.tasks`:
``classification`` or ``language_model``), driven by :func:`run_task`, or your own
``module:function``, called as ``function(training.config, ctx)`` with a :class:`LoopContext`.

:func:`run_task` is one loop for every exchange mode (:mod:`.exchange`: rayzip's hook,
torch's hooks, plain DDP, parameter server). Rank 0 posts every step's metrics to the
driver's progress actor; all ranks call ``ray.train.report`` at each evaluation and
checkpoint (``training.eval_every``, ``checkpoint.every_steps``), because a report waits for
Ray Train's controller to poll it. After an elastic resize or a failure, Ray Train restarts
the worker group and the loop resumes from ``ray.train.get_checkpoint()``: model, optimizer,
step, byte totals, the data position, and each rank's error-feedback residuals and codec
state (re-sharded when the world size changed).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from ..checkpoint import DeltaChain
from ..checkpoint import inspect as inspect_checkpoint
from ..codecs import NonFiniteError
from ..comm.control import RankDisagreement
from ..spec import BUILTIN_LOOPS, JobSpec, import_callable
from ..torch.lr import learning_rate
from ..torch.optim import build_optimizer
from .checkpoints import GroupCheckpoints, Parts, newest_of, take_parts, take_shards, unwrap, write_taken
from .exchange import Exchange, build_exchange, compute_time
from .faults import Faults
from .records import StepRecord, Totals, held_bytes
from .snapshots import Snapshots, worker_keepers
from .tasks import Task, agreed_accuracy, build_task, shard_plan
from .telemetry import Adoption, Telemetry

__all__ = ["Adoption", "LoopContext", "agreed_accuracy", "run_task", "save_step", "step_parts", "shard_plan", "train_loop"]


def _interface_tx_bytes() -> int | None:
    """Bytes sent so far on gloo's interface, where one is pinned (the emulated cluster)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text()) if ifname else None
    except OSError:
        return None


def _fail_together(exc: Exception, step: int, progress) -> None:
    """Every rank returns; rank 0 tells the driver, which raises it (see run_job). Ray Train
    sees a clean finish, so it does not retry what would fail again at the same batch."""
    print(f"rayzip: stopping every rank at step {step}: {type(exc).__name__}: {exc}")
    if progress is not None:
        ray.get(progress.fail.remote(step, f"{type(exc).__name__}: {exc}"))


def step_parts(rank: int, world: int, step: int, weights, state, totals: Totals, saved: dict,
               copy=None) -> tuple[Parts, int]:
    """This rank's parts of the step's checkpoint (:func:`take_parts`) and the checkpoint's
    number: rank 0 the model, optimizer, step, byte totals and ``saved`` (the task's data
    position and last metric), every rank its hook state. ``weights()``, the (model,
    optimizer) state dicts, is called on rank 0 only (in parameter-server mode it fetches the
    shards' state). With ``copy`` (a snapshot function), host copies that later steps cannot
    change."""
    index = totals.checkpoints
    if rank == 0:
        totals.checkpoints = index + 1

    def trainer() -> dict:
        model_state, optimizer_state = weights()
        return {"model": model_state, "optimizer": optimizer_state, "step": step, "totals": totals.to_dict(),
                **saved}

    return take_parts(rank, world, trainer, state, copy), index


def save_step(directory: Path, rank: int, world: int, step: int, weights, state, totals: Totals,
              saved: dict, chain: DeltaChain | None) -> None:
    """Write this rank's part of the step's checkpoint now (:func:`step_parts`)."""
    parts, index = step_parts(rank, world, step, weights, state, totals, saved)
    write_taken(directory, parts, chain, index)


@dataclass
class _Run:
    """What run_task keeps across steps besides the model."""

    totals: Totals
    metric: float | None
    skipped_in_a_row: int = 0
    train_start: float = 0.0
    tx_start: int | None = None
    history: list = field(default_factory=list)
    checkpoints: GroupCheckpoints | None = None
    chain: DeltaChain | None = None  # rank 0's, when checkpoints store weights as deltas
    progress: Any = None  # the driver's progress actor, on rank 0
    started: float = 0.0  # the job's start (wall clock)
    resumed_from: int = 0  # the step this attempt started at
    snapshots: Snapshots | None = None  # this rank's in-memory snapshots, where the mode takes them
    resumed_source: str = "start"  # start, memory (a snapshot) or storage (a checkpoint)
    faults: Faults = field(default_factory=Faults)
    attempt: int = 0  # this attempt's index, where faults kill (0: the first; one more per restart)
    checkpoint_steps: dict = field(default_factory=dict)  # checkpoint directory -> its step, until reported
    uploading_step: int | None = None  # the last checkpoint handed to Ray Train, maybe not yet registered
    reported_step: int | None = None  # the last checkpoint Ray Train has taken from this attempt

    def taken(self) -> None:
        """A metrics-only report returned: Ray Train has every checkpoint handed to it before."""
        if self.uploading_step is not None:
            self.reported_step, self.uploading_step = self.uploading_step, None


def run_task(spec: JobSpec, config: dict, task: Task, exchange: Exchange) -> None:
    rank, world = exchange.rank, exchange.world
    faults = config.get("faults") or Faults()
    chain = None
    if rank == 0 and config.get("chain_dir") and spec.checkpoint.full_every > 1:
        chain = DeltaChain(config["chain_dir"], spec.checkpoint.full_every, spec.checkpoint.num_to_keep)
    snapshots = open_snapshots(spec, config, exchange)
    with _newest_snapshot(snapshots) as memory:  # every rank, together
        checkpoint, source = newest_of(memory, ray.train.get_checkpoint())
        start, saved = exchange.restore(checkpoint, chain)
    if source != "start":
        print(f"rayzip: rank {rank}: resuming at step {start} from {source}")
    run = _Run(totals=Totals.from_dict(saved.get("totals") if saved else None),
               metric=(saved.get("metric", saved.get("test_accuracy")) if saved else None),
               checkpoints=GroupCheckpoints(world, task.device, spec.checkpoint.background,
                                            write_delay_s=faults.checkpoint_write_delay_s), chain=chain,
               progress=ray.get_actor(config["progress"]) if config.get("progress") and rank == 0 else None,
               started=float(config.get("t0", time.time())), resumed_from=start, snapshots=snapshots,
               resumed_source=source, faults=faults)
    if faults.kill_after_steps and run.progress is not None:
        run.attempt = _attempt(run.progress)
    if exchange.only_step_changes_weights:
        run.checkpoints.guard(exchange.optimizer)
    try:
        _train(spec, config, task, exchange, run, start, saved)
    finally:
        run.checkpoints.close()
        if snapshots is not None:
            snapshots.close()


def _newest_snapshot(snapshots: Snapshots | None):
    return snapshots.newest_checkpoint() if snapshots is not None else contextlib.nullcontext()


def _attempt(progress) -> int:
    """This attempt's index, from the driver's progress actor before this attempt's first
    step: the restarts it has seen, and one more once any step has run (the restart into
    this attempt shows only at its first step)."""
    seen = ray.get(progress.get_restarts.remote())
    return seen["restarts"] + (1 if seen["steps_run"] else 0)


def open_snapshots(spec: JobSpec, config: dict, exchange: Exchange) -> Snapshots | None:
    """This rank's snapshots, where the spec and the exchange mode take them (None: not)."""
    if not (spec.snapshots.enabled and exchange.takes_snapshots and config.get("keepers") is not None):
        return None
    return Snapshots(_keepers(spec, config), exchange.rank, exchange.world, ray.get_runtime_context().get_node_id(),
                     spec.snapshots.every, slots=exchange.snapshot_slots, sharded=exchange.sharded_weights,
                     copy_density=spec.snapshots.copy_density)


def _keepers(spec: JobSpec, config: dict) -> dict:
    """{node: its keeper's handle, or None where the keeper is gone with its node}; this
    node's keeper started here (detached) when the node joined after the run started."""
    return worker_keepers(config["run_id"])[0]


def _train(spec: JobSpec, config: dict, task: Task, exchange: Exchange, run: _Run, start: int,
           saved: dict | None) -> None:
    training, rank, world, steps, progress = spec.training, exchange.rank, exchange.world, task.total_steps(), run.progress
    batches = task.batches(start, saved.get("data") if saved else None)
    first = next(batches, None)
    if first is None:
        return
    batches = itertools.chain([first], batches)
    if exchange.ddp:
        rng = torch.get_rng_state()  # a probe with dropout would shift a resumed run's draws
        exchange.compute_probe_s = compute_time(exchange.model, lambda: task.training_loss(exchange.model, first))
        torch.set_rng_state(rng)
    telemetry = Telemetry(rank=rank, run=config.get("run_id", spec.name), job=spec.name,
                          metrics=spec.metrics.enabled, state=exchange.controlled,
                          controller=ray.get_actor(config["controller"]) if config.get("controller") else None)
    if exchange.ddp:
        telemetry.start(exchange.compute_probe_s)  # the controller's decision before the first step
    run.train_start = time.perf_counter() - run.totals.train_s
    run.tx_start = _interface_tx_bytes()
    model = exchange.model
    for step, batch in zip(range(start, steps), batches):
        telemetry.begin_step()
        exchange.begin_step(step, last=step == steps - 1)
        t0 = time.perf_counter()
        lr = learning_rate(training, world, step, steps)
        model.zero_grad(set_to_none=True)
        loss = task.training_loss(model, batch)
        try:
            loss.backward()  # the comm hook compresses and exchanges here
            skipped = exchange.skipped(step)
            run.skipped_in_a_row = run.skipped_in_a_row + 1 if skipped else 0
            if exchange.skips_together and run.skipped_in_a_row > training.max_skipped_steps:
                raise NonFiniteError(f"{run.skipped_in_a_row} steps in a row skipped for non-finite gradients, "
                                     f"the last at step {step}")
            exchange.apply(step, lr, skipped)  # local steps synchronize here
        except (NonFiniteError, RankDisagreement) as exc:
            # Raised on every rank at once (the control word, or a gradient every rank
            # holds): end the run together, without a retry that would replay the same batch.
            _fail_together(exc, step, progress)
            return
        step_s = time.perf_counter() - t0
        # may be NaN on one rank: the gradients decide, on every rank
        record = StepRecord(step=step, loss=float(loss.detach()), lr=lr, step_s=step_s,
                            traffic=exchange.traffic(step_s), skipped=skipped)
        telemetry.record(record)
        run.totals.add(record)
        if _after_step(spec, task, exchange, telemetry, run, record, steps):
            break


def _after_step(spec: JobSpec, task: Task, exchange: Exchange, telemetry: Telemetry, run: _Run,
                record: StepRecord, steps: int) -> bool:
    """Evaluate, report and checkpoint where due; whether every rank stops here."""
    training, step, totals, t = spec.training, record.step, run.totals, record.traffic
    progress, started = run.progress, run.started
    rank, world = exchange.rank, exchange.world
    last = step == steps - 1
    evaluate = (step + 1) % training.eval_every == 0 or last
    totals.train_s = time.perf_counter() - run.train_start
    paused = time.perf_counter()
    if evaluate:
        run.metric = task.evaluate(exchange.model)
    reached = task.reached(run.metric)
    if reached and totals.time_to_target_s is None:
        totals.time_to_target_s, totals.steps_to_target = totals.train_s, step + 1
    done = last or (reached and training.stop_at_target) or t.stop
    metrics = {
        "step": step, "loss": record.loss, "lr": record.lr, "world_size": world,
        "step_s": record.step_s, "comm_s": t.comm_s, "compute_probe_s": exchange.compute_probe_s,
        "mean_step_s": totals.mean("step_s"), "mean_comm_s": totals.mean("comm_s"),
        "mean_network_s": totals.mean("network_s"), "mean_busy_s": totals.mean("busy_s"), "comm_source": t.comm_source,
        "train_s": totals.train_s, "evaluated": evaluate,
        "interface_tx_bytes": (_interface_tx_bytes() - run.tx_start) if run.tx_start is not None else None,
        "bytes_sent": t.bytes_sent, "dense_bytes": t.dense_bytes,
        "total_bytes_sent": totals.bytes_sent, "total_dense_bytes": totals.dense_bytes,
        "total_bytes_received": totals.bytes_received, "total_local_bytes": totals.local_bytes,
        "total_node_bytes": totals.node_bytes, "collective": "ps" if exchange.name == "ps" else None,
        "bytes_source": t.bytes_source, "compressed": t.compressed, "density": t.density, "local_every": t.local_every,
        "verify_max_abs_err": totals.verify_max_abs_err,  # worst step so far
        "verify_documented_bytes": totals.verify_documented_bytes,
        "metric": task.metric, task.metric: run.metric, "reached_target": totals.time_to_target_s is not None,
        "time_to_target_s": totals.time_to_target_s, "steps_to_target": totals.steps_to_target,
        "elapsed_s": time.time() - started, "done": done, "pid": os.getpid(), "skipped": record.skipped,
        "skipped_steps": totals.skipped_steps,
        # this rank's parameters, gradients and optimizer state, counted from its tensors
        "held_bytes": held_bytes(unwrap(exchange.model), exchange.optimizer) if evaluate else None,
    }
    checkpoints = run.checkpoints
    ready = _checkpoint(spec, task, exchange, run, step, done)
    if not done:
        _snapshot(spec, task, exchange, run, record)
    metrics.update({"resumed_source": run.resumed_source, "snapshot_every": run.snapshots.every if run.snapshots else None,
                    "mean_snapshot_s": (totals.snapshot_s / totals.snapshots) if totals.snapshots else None,
                    "snapshot_bytes": run.snapshots.bytes if run.snapshots else None,
                    # what this rank's error feedback copies took to another node's keeper, all of them
                    "copied_bytes": run.snapshots.copied_bytes if run.snapshots else None,
                    # the lost ranks whose error feedback the restore took from their copies
                    "resumed_copies": run.snapshots.restored_copies if run.snapshots else None})
    metrics.update({"checkpoint_stall_s": totals.checkpoint_stall_s, "resumed_from": run.resumed_from,
                    "checkpoint_reported_step": run.reported_step, "checkpoint_uploading_step": run.uploading_step,
                    "checkpoint_pending_step": run.checkpoint_steps.get(checkpoints.pending)})
    kills = run.faults.kill_after_steps
    if rank == 0 and step in kills and kills.index(step) == run.attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        for directory in ready:
            sizes = inspect_checkpoint(directory / "trainer")
            telemetry.record_checkpoint(sizes["stored_bytes"], sizes["raw_bytes"])
    if progress is not None:
        progress.update.remote(metrics)  # fire and forget: per-step progress costs nothing
    # ray.train.report blocks until Ray Train's controller polls (every 2 s by default), so
    # it runs at evaluations and at checkpoints ready to report; every rank reaches it at the
    # same steps (GroupCheckpoints agrees on when a background write is complete).
    for directory in ready:
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(directory)),
                         checkpoint_upload_mode=(ray.train.CheckpointUploadMode.ASYNC if checkpoints.background
                                                 else ray.train.CheckpointUploadMode.SYNC),
                         delete_local_checkpoint_after_upload=True)
    # A report returns once there is room in a one-slot queue that the controller drains when
    # it polls, after every earlier report (an asynchronous upload's too) is in it: when a
    # metrics-only report returns, Ray Train has taken every checkpoint handed to it before.
    if evaluate and not ready:
        ray.train.report(metrics)
        run.taken()
    if ready and not done and not checkpoints.background:
        # The checkpoint just reported is not yet taken: a worker lost now would send the job
        # back two intervals, so report again to wait until it is. (In the background the loop
        # does not wait: a loss before the next report goes back to the one before.)
        ray.train.report(metrics)
        run.taken()
    run.train_start += time.perf_counter() - paused
    return done


def _snapshot(spec: JobSpec, task: Task, exchange: Exchange, run: _Run, record: StepRecord) -> None:
    """This rank's snapshot of the step where one is due (a checkpoint's step always), on the
    training thread: the step is not over before its snapshot is (rayzip.train.snapshots)."""
    snapshots, step, every = run.snapshots, record.step, spec.checkpoint.every_steps
    if snapshots is None or not exchange.snapshot_due(step):
        return
    if not snapshots.due(step, forced=bool(every and (step + 1) % every == 0)):
        return

    def trainer() -> dict:
        model_state, optimizer_state = exchange.weights()
        chain = {"chain": list(run.chain.history)} if run.chain is not None else {}
        return {"model": model_state, "optimizer": optimizer_state, "step": step, "totals": run.totals.to_dict(),
                "data": task.data_state(step + 1), "metric": run.metric, **chain}

    shards = exchange.take_shards(None) if exchange.sharded_weights else None
    took = snapshots.take(step, trainer, exchange.state, record.step_s, shards=shards)
    run.totals.snapshot_s += took
    run.totals.snapshots += 1
    run.train_start -= took  # on the training thread: training time


def _checkpoint(spec: JobSpec, task: Task, exchange: Exchange, run: _Run, step: int, done: bool) -> list[Path]:
    """Take a checkpoint where one is due (every ``checkpoint.every_steps``, and the last);
    the checkpoint directories every rank has finished writing, to report now."""
    every, checkpoints, totals = spec.checkpoint.every_steps, run.checkpoints, run.totals
    stalled = checkpoints.stall_s
    ready = checkpoints.poll()  # a background write that every rank has completed
    if (every and (step + 1) % every == 0) or done:
        directory = Path(tempfile.mkdtemp(prefix="rayzip-ckpt-"))
        parts: dict = {}

        def take(copy) -> Parts:
            if exchange.sharded_weights:  # this rank's shards: host copies for a write in the background
                parts["shards"] = exchange.take_shards(copy)
            taken, parts["index"] = step_parts(exchange.rank, exchange.world, step, exchange.weights,
                                               exchange.state, totals,
                                               {"data": task.data_state(step + 1), "metric": run.metric}, copy)
            return taken

        run.checkpoint_steps[directory] = step
        def write(taken: Parts) -> None:
            if "shards" in parts:  # every rank's own shards, through DCP (a collective)
                exchange.write_shards(directory, parts.pop("shards"))
            write_taken(directory, taken, run.chain, parts["index"])

        ready += checkpoints.save(directory, take, write)
    if done:
        ready += checkpoints.flush()  # the run ends with its last checkpoint reported
    totals.checkpoint_stall_s += checkpoints.stall_s - stalled
    for directory in ready:
        run.uploading_step = run.checkpoint_steps.pop(directory)
    return ready


class LoopContext:
    """What ``rayzip run`` gives a ``training.loop: module:function`` on each worker::

        def my_loop(config: dict, ctx: rayzip.train.LoopContext) -> None:
            model = ctx.prepare_model(MyNet())            # DDP with the spec's compression
            optimizer = ctx.build_optimizer(model.parameters())
            extra = ctx.restore(model, optimizer)         # {} on a fresh start
            for step in range(extra.get("step", -1) + 1, config["steps"]):
                ctx.telemetry.begin_step()
                ...                                        # forward, backward, optimizer.step()
                ctx.snapshot(step, model, optimizer, extra={"step": step})  # a lost worker resumes here
                ctx.telemetry.end_step(step, float(loss))  # Prometheus, controller, progress
                if (step + 1) % 50 == 0:
                    ctx.report({"loss": float(loss)}, model=model, optimizer=optimizer, extra={"step": step})
    """

    def __init__(self, spec: JobSpec, config: dict):
        context = ray.train.get_context()
        self.spec, self._config = spec, config
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.model: torch.nn.Module | None = None
        self._telemetry: Telemetry | None = None
        self._progress = ray.get_actor(config["progress"]) if config.get("progress") and self.rank == 0 else None
        self._snapshots: Snapshots | None = None
        self.resumed_source = "start"

    def prepare_model(self, model: torch.nn.Module, **prepare_kwargs: Any) -> torch.nn.Module:
        """:func:`rayzip.train.prepare_model` with the spec's compression and sharding sections."""
        from .api import prepare_model

        self.model = prepare_model(model, compression=self.spec.compression, sharding=self.spec.sharding,
                                   local_steps=self.spec.local_steps,
                                   on_nonfinite=self.spec.training.on_nonfinite,
                                   momentum=self.spec.training.momentum if self.spec.compression.momentum_correction
                                   else None, adam_betas=tuple(self.spec.training.betas),
                                   optimizer=self.spec.training.optimizer, **prepare_kwargs)
        return self.model

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        """The spec's ``training`` optimizer (momentum in the hook under momentum correction),
        for ``params``: the model, or its parameters (muon needs the model)."""
        from .api import compression_state

        hooked = self.model is not None and compression_state(self.model) is not None
        comp = self.spec.compression
        return build_optimizer(self.spec.training, params, momentum_elsewhere=hooked and comp.momentum_correction,
                               adam_elsewhere=hooked and comp.adam_correction)

    def learning_rate(self, step: int, total_steps: int) -> float:
        return learning_rate(self.spec.training, self.world, step, total_steps)

    @property
    def telemetry(self) -> Telemetry:
        if self._telemetry is None:
            controller = self._config.get("controller")
            self._telemetry = _ProgressTelemetry(self._progress, context=self, model=self.model, rank=self.rank,
                                                 run=self._config.get("run_id", self.spec.name), job=self.spec.name,
                                                 metrics=self.spec.metrics.enabled,
                                                 controller=ray.get_actor(controller) if controller else None)
        return self._telemetry

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """:func:`rayzip.train.restore`: from the newest in-memory snapshot that every rank took
        (:meth:`snapshot`), unless the checkpoint in storage is newer or there is none. Every
        rank calls it."""
        from .api import restore_checkpoint

        with _newest_snapshot(self._open_snapshots(model)) as memory:  # every rank, together
            checkpoint, self.resumed_source = newest_of(memory, ray.train.get_checkpoint())
            return restore_checkpoint(model, optimizer, checkpoint)

    def snapshot(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict | None = None) -> None:
        """Keep this rank's state after ``step`` in its node's keeper (the spec's ``snapshots``),
        so that a restart's :meth:`restore` resumes here: what :meth:`report` would checkpoint,
        as a memory copy. Every rank calls it after the same steps; ``extra`` is what
        :meth:`restore` returns (your step, your data's position); for a sharded model, each
        rank's own shards (a restart onto another world size reads storage). Nothing where
        snapshots are off."""
        from .api import _is_sharded, _trainer_part

        snapshots = self._open_snapshots(model)
        if snapshots is not None:
            shards = (lambda: take_shards(model, optimizer)) if _is_sharded(model) else None
            snapshots.after_step(step, *_trainer_part(model, optimizer, extra), shards=shards)

    def _open_snapshots(self, model: torch.nn.Module) -> Snapshots | None:
        from .api import _is_sharded, snapshot_slots

        if self._snapshots is None and self.spec.snapshots.enabled and self._config.get("keepers") is not None:
            self._snapshots = Snapshots(_keepers(self.spec, self._config), self.rank,
                                        self.world, ray.get_runtime_context().get_node_id(),
                                        self.spec.snapshots.every, slots=snapshot_slots(model),
                                        sharded=_is_sharded(model), copy_density=self.spec.snapshots.copy_density)
        return self._snapshots

    def report(self, metrics: dict, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
               background: bool | None = None) -> None:
        """:func:`rayzip.train.report`; ``background`` defaults to the spec's
        ``checkpoint.background`` (call :meth:`flush` after the last one)."""
        from .api import report

        background = self.spec.checkpoint.background if background is None else background
        report(metrics, model=model, optimizer=optimizer, extra=extra, background=background)

    def flush(self, metrics: dict | None = None) -> None:
        """:func:`rayzip.train.flush`: report a checkpoint still being written."""
        from .api import flush

        flush(metrics)


class _ProgressTelemetry(Telemetry):
    """A user loop's steps also reach ``rayzip run``'s progress bar (rank 0)."""

    def __init__(self, progress, context: LoopContext, **kwargs):
        super().__init__(**kwargs)
        self.progress, self.context = progress, context

    def record(self, record: StepRecord) -> None:
        super().record(record)
        if self.progress is not None:
            t = record.traffic
            self.progress.update.remote({"step": record.step, "loss": record.loss, "pid": os.getpid(),
                                         "world_size": self.context.world, "evaluated": False,
                                         "bytes_sent": t.bytes_sent,
                                         "compressed": t.compressed, "density": t.density,
                                         "resumed_source": self.context.resumed_source})


def train_loop(config: dict) -> None:
    spec = JobSpec.model_validate(config["spec"])
    if spec.training.loop not in BUILTIN_LOOPS:
        ctx = LoopContext(spec, config)
        try:
            import_callable(spec.training.loop)(dict(spec.training.config), ctx)
            ctx.flush()  # a last checkpoint the loop reported in the background
        finally:
            if ctx._snapshots is not None:
                ctx._snapshots.close()
        return
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(spec.training.seed)  # identical initial weights on every worker
    task = build_task(spec, rank, world, ray.train.torch.get_device())
    faults = config.get("faults") or Faults()
    exchange = build_exchange(spec, task.build_model(), rank, world, ps_shards=config.get("ps_shards"),
                              emulation=faults.emulation)
    run_task(spec, config, task, exchange)
