"""The per-worker training loop that ``rayzip run`` hands to Ray Train's TorchTrainer.

Each worker trains on its own shard and sends gradients through rayzip's comm hook. Rank 0
posts every step's metrics to the driver's progress actor; all ranks call
``ray.train.report`` at each evaluation and checkpoint (``training.eval_every``,
``checkpoint.every_steps``), because a report waits for Ray Train's controller to poll it. After an
elastic resize or a failure, Ray Train restarts the worker group and the loop resumes from
``ray.train.get_checkpoint()``: model, optimizer, step, byte totals, and (when the world
size is unchanged) each rank's error-feedback residuals and codec state.

In parameter-server mode (``compression.collective: ps``) the model is not wrapped in DDP:
after backward, each worker pushes its gradient to the shard actors and pulls the updated
parameters (:mod:`rayzip.ps`), and a new worker group resumes where the shards are.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import uuid
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import DeltaChain
from ..checkpoint import inspect as inspect_checkpoint
from ..checkpoint import load as load_checkpoint
from ..codecs import NonFiniteError
from ..comm.control import RankDisagreement
from ..comm import ring_allreduce_bytes
from ..metrics import WorkerMetrics
from ..ps import ParameterServerClient, flat_to_parameters
from ..spec import JobSpec, TrainingSpec
from ..torch import compress, scaled_lr
from ..torch.baselines import register_torch_hook
from ..torch.optim import build_optimizer
from .checkpoints import load_optimizer, load_trainer, restore_hook, unwrap, write_parts
from .data import load_dataset, shard
from .models import build_model

__all__ = ["Adoption", "agreed_accuracy", "shard_plan", "train_loop"]


def shard_plan(training: TrainingSpec, train_size: int, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """This rank's training examples, and the steps that every rank runs.

    In ``epochs`` mode the shards differ by up to one example, so epochs are counted over the
    smallest shard (``train_size // world`` examples) on every rank: a rank that ran one step
    longer would wait in a collective for ranks that had already stopped. (Batches are drawn
    from the rank's own shard, so no example is left out for good.)"""
    mine = shard(train_size, rank, world, training.seed)
    if training.steps is not None:
        return mine, training.steps
    return mine, training.epochs * max(1, math.ceil((train_size // world) / training.batch_size))


def _batch(seed: int, rank: int, step: int, shard_size: int, batch: int) -> torch.Tensor:
    # A function of (seed, rank, step) only, so a resumed run draws exactly the same batches.
    gen = torch.Generator().manual_seed(hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(0, shard_size, (batch,), generator=gen)


@torch.no_grad()
def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(x), 4096):
        logits = model(x[start:start + 4096].to(device))
        correct += int((logits.argmax(dim=1).cpu() == y[start:start + 4096]).sum())
    model.train()
    return correct / len(x)


def _interface_tx_bytes() -> int | None:
    """Bytes sent so far on gloo's interface, where one is pinned (the emulated cluster)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text()) if ifname else None
    except OSError:
        return None


def _compute_time(model: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor, repeats: int = 3) -> float:
    """Forward + backward time of one batch with DDP communication off (no_sync)."""
    best = float("inf")
    with model.no_sync():
        for _ in range(repeats + 1):  # the first call warms up
            t0 = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            best = min(best, time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return best


class Adoption:
    """Rank 0 takes the controller's latest decision without waiting (``poll`` returns a
    ``{"seq", "ratio"}`` decision or None) and proposes it in the step's control word; every
    rank adopts the agreed proposal from the next step on, however late the decision came.
    ``applied(seq, step)`` tells the controller, once, from rank 0."""

    def __init__(self, poll, applied, rank: int, state):
        self.poll, self.applied, self.rank, self.state = poll, applied, rank, state
        self.proposed_seq = self.applied_seq = -1

    @classmethod
    def from_controller(cls, controller, rank: int, state) -> "Adoption":
        pending = [controller.decision.remote()] if rank == 0 else []

        def poll():
            ready, _ = ray.wait(pending, timeout=0)
            if not ready:
                return None
            decision = ray.get(pending[0])
            pending[0] = controller.decision.remote()
            return decision

        return cls(poll, lambda seq, step: controller.applied.remote(seq, step), rank, state)

    def before_step(self) -> None:
        if self.rank != 0:
            return
        latest = self.poll()
        if latest is not None and latest["seq"] > self.proposed_seq and latest["ratio"] >= 1.0:
            # Agreed in this step's control word, applied by every rank from the next step.
            self.proposed_seq = latest["seq"]
            self.state.propose(latest["ratio"], seq=latest["seq"])

    def after_step(self, step: int) -> None:
        adopted = self.state.last_step.adopted if self.state.last_step is not None else None
        if adopted is not None and adopted[0] > self.applied_seq:
            self.applied_seq = adopted[0]
            if self.rank == 0:
                self.applied(adopted[0], step + 1)


def _skip_step(state, model: torch.nn.Module, step: int, rank: int, policy: str) -> bool:
    """Whether every rank drops this step for a non-finite gradient. rayzip's hook agreed on
    it in the control word; under plain DDP or a torch hook every rank holds the same
    averaged gradient, and at world size 1 there is no one to agree with, so each rank's
    own look is everyone's."""
    if state is not None:
        return bool(state.last_step.skipped)
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            if policy == "raise":
                raise NonFiniteError(f"step {step}: the gradient of {name} is not finite (rank {rank}'s view, "
                                     "the same on every rank)")
            return True
    return False


def _fail_together(exc: Exception, step: int, progress) -> None:
    """Every rank returns; rank 0 tells the driver, which raises it (see run_job). Ray Train
    sees a clean finish, so it does not retry what would fail again at the same batch."""
    print(f"rayzip: stopping every rank at step {step}: {type(exc).__name__}: {exc}")
    if progress is not None:
        ray.get(progress.fail.remote(step, f"{type(exc).__name__}: {exc}"))


def agreed_accuracy(accuracy: float | None, device) -> float | None:
    """Rank 0's test accuracy, on every rank."""
    message = torch.tensor([float("nan") if accuracy is None else accuracy], dtype=torch.float64,
                           device=device)  # NCCL broadcasts device tensors only
    dist.broadcast(message, src=0)
    value = float(message.item())
    return None if math.isnan(value) else value


def _save(directory: Path, rank: int, world: int, step: int, weights, state, totals: dict,
          accuracy: float | None, chain: DeltaChain | None) -> None:
    """Each rank writes its part of the step's checkpoint (:func:`write_parts`): rank 0 the
    model, optimizer, step and byte totals, every rank its hook state. ``weights()``, the
    (model, optimizer) state dicts, is called on rank 0 only (in parameter-server mode it
    fetches the shards' state)."""
    index = totals.get("checkpoints", 0)
    if rank == 0:
        totals["checkpoints"] = index + 1

    def trainer() -> dict:
        model_state, optimizer_state = weights()
        return {"model": model_state, "optimizer": optimizer_state, "step": step, "totals": totals,
                "test_accuracy": accuracy}

    write_parts(directory, rank, world, trainer, state, chain, index)


def _restore(checkpoint, rank: int, world: int, model, optimizer, state, chain: DeltaChain | None):
    """(next step, byte totals, last accuracy) from a checkpoint, or a fresh start."""
    if checkpoint is None:
        return 0, {}, None
    with checkpoint.as_directory() as path:
        path = Path(path)
        trainer = load_trainer(path, model, chain)
        load_optimizer(optimizer, trainer["optimizer"])
        if state is not None:
            restore_hook(path, rank, world, trainer, state)
    return trainer["step"] + 1, trainer["totals"], trainer["test_accuracy"]


def _server_weights(model: torch.nn.Module, client: ParameterServerClient) -> tuple[dict, dict]:
    """(model state, optimizer state) for a checkpoint in parameter-server mode: the shards
    hold the authoritative parameters and the optimizer state; buffers are the worker's."""
    server = client.server_state()
    return {**model.state_dict(), **flat_to_parameters(model, server["params"])}, server["optimizer"]


def _restore_ps(checkpoint, rank: int, model, client: ParameterServerClient, chain: DeltaChain | None):
    """Start this worker group on the parameter shards: (next step, byte totals, last accuracy).

    Live shards hold the truth, so the group resumes where they are, not at the checkpoint;
    shards that hold nothing (a new run, or a shard restarted after its process died) are
    loaded from the checkpoint, or from this model at step 0."""
    trainer, saved = None, None
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            trainer = load_trainer(Path(path), model, chain)
            mine = Path(path) / f"rank{rank}"
            saved = load_checkpoint(mine) if mine.exists() else None
    generation = [uuid.uuid4().hex if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(generation, src=0)
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        initial = {"params": torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy(),
                   "optimizer": trainer["optimizer"] if trainer else None,
                   "step": trainer["step"] + 1 if trainer else 0}
        client.begin_group(generation[0], numel, initial)
    if dist.is_initialized():
        dist.barrier()
    start = client.join(generation[0], model)
    if saved is not None and saved["hook"]["step"] == start:
        client.load_state_dict(saved["hook"])
    elif saved is not None:
        print(f"rayzip: rank {rank} resumes at step {start}, its checkpoint holds step {saved['hook']['step']}: "
              "error-feedback residuals reset")
    if trainer is None:
        return start, {}, None
    return start, trainer["totals"], trainer["test_accuracy"]


def train_loop(config: dict) -> None:
    spec = JobSpec.model_validate(config["spec"])
    training = spec.training
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    progress = ray.get_actor(config["progress"]) if config.get("progress") and rank == 0 else None
    started = float(config.get("t0", time.time()))

    torch.manual_seed(training.seed)  # identical initial weights on every worker
    x_train, y_train, x_test, y_test = load_dataset(spec.dataset, training.seed)
    classes = int(max(y_train.max(), y_test.max())) + 1
    comp = spec.compression
    ps_mode = comp.collective == "ps"
    # In parameter-server mode the shards combine gradients: no DDP allreduce underneath.
    model = ray.train.torch.prepare_model(build_model(spec.model, x_train.shape[1], classes),
                                          parallel_strategy=None if ps_mode else "ddp")
    device = ray.train.torch.get_device()
    ddp = isinstance(model, DistributedDataParallel)
    hooked = ddp and comp.torch_hook is None and (comp.codec != "none" or comp.verify or comp.momentum_correction)
    state = compress(model, comp, momentum=training.momentum if comp.momentum_correction else None,
                     on_nonfinite=training.on_nonfinite) if hooked else None
    counter = (register_torch_hook(model, comp.torch_hook, comp.powersgd_rank, comp.powersgd_start_iter)
               if ddp and comp.torch_hook else None)
    # At world size 1 there is no hook, so momentum stays in the optimizer.
    client = (ParameterServerClient(config["ps_shards"], spec, rank, world,
                                    momentum=training.momentum if comp.momentum_correction else None)
              if ps_mode else None)
    optimizer = None if ps_mode else build_optimizer(
        training, model.parameters(), momentum_elsewhere=state is not None and comp.momentum_correction)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)

    mine, steps = shard_plan(training, len(x_train), rank, world)
    compute_probe_s = _compute_time(model, x_train[mine[:training.batch_size]].to(device),
                                    y_train[mine[:training.batch_size]].to(device)) if ddp else 0.0
    chain = None
    if rank == 0 and config.get("chain_dir") and spec.checkpoint.full_every > 1:
        chain = DeltaChain(config["chain_dir"], spec.checkpoint.full_every, spec.checkpoint.num_to_keep)
    if client is not None:
        start, totals, accuracy = _restore_ps(ray.train.get_checkpoint(), rank, model, client, chain)
        weights = lambda: _server_weights(model, client)  # noqa: E731
    else:
        start, totals, accuracy = _restore(ray.train.get_checkpoint(), rank, world, model, optimizer, state, chain)
        weights = lambda: (unwrap(model).state_dict(), optimizer.state_dict())  # noqa: E731
    totals = {"bytes_sent": 0, "bytes_received": 0, "dense_bytes": 0, "train_s": 0.0, "step_s": 0.0, "comm_s": 0.0, "network_s": 0.0,
              "timed_steps": 0, "skipped_steps": 0, **totals}
    every = spec.checkpoint.every_steps
    run_id = config.get("run_id", spec.name)
    metrics_out = WorkerMetrics(run_id, spec.name, rank) if spec.metrics.enabled else None
    controller = ray.get_actor(config["controller"]) if config.get("controller") else None
    adoption = Adoption.from_controller(controller, rank, state) if controller is not None and state is not None else None
    train_start = time.perf_counter() - totals["train_s"]
    tx_start = _interface_tx_bytes()

    skipped_in_a_row = 0
    for step in range(start, steps):
        if adoption is not None:
            adoption.before_step()
        if state is not None and step == steps - 1:
            state.request_stop()  # every rank learns it at this step's exchange, even one that counted more
        t0 = time.perf_counter()
        lr = scaled_lr(training.lr, world, training.base_world_size, step, training.lr_warmup_steps)
        for group in optimizer.param_groups if optimizer is not None else ():
            group["lr"] = lr
        idx = mine[_batch(training.seed, rank, step, len(mine), training.batch_size)]
        x, y = x_train[idx].to(device), y_train[idx].to(device)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        try:
            loss.backward()  # the comm hook compresses and exchanges here
            skipped = _skip_step(state, model, step, rank, training.on_nonfinite) if client is None else False
        except (NonFiniteError, RankDisagreement) as exc:
            # Raised on every rank at once (the control word, or a gradient every rank
            # holds): end the run together, without a retry that would replay the same batch.
            _fail_together(exc, step, progress)
            return
        skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
        if skipped_in_a_row > training.max_skipped_steps:
            _fail_together(NonFiniteError(f"{skipped_in_a_row} steps in a row skipped for non-finite gradients, "
                                          f"the last at step {step}"), step, progress)
            return
        if client is not None:
            client.update(model, step, lr)  # push, the shards step, pull
        elif not skipped:
            optimizer.step()
        step_s = time.perf_counter() - t0

        stats = client.last_step if client is not None else state.last_step if state is not None else None
        dense_bytes = stats.dense_bytes if client is not None else ring_allreduce_bytes(4 * numel, world)
        if stats is not None:
            bytes_sent, comm_s, network_s = stats.bytes_sent, stats.comm_s, stats.network_s
        else:  # plain DDP or a torch hook: comm time is what the step took beyond compute
            bytes_sent = counter.take() if counter is not None else dense_bytes
            comm_s = max(0.0, step_s - compute_probe_s) if ddp else 0.0
            network_s = comm_s
        loss_value = float(loss.detach())  # may be NaN on one rank: the gradients decide, on every rank
        if metrics_out is not None:
            metrics_out.record(step, step_s, comm_s, network_s, bytes_sent, dense_bytes, loss_value)
        if controller is not None:
            controller.report.remote(rank, step, loss_value, step_s, comm_s, network_s, bytes_sent, dense_bytes)
        totals["step_s"] += step_s
        totals["comm_s"] += comm_s
        totals["network_s"] += network_s
        totals["timed_steps"] += 1
        totals["skipped_steps"] += int(skipped)
        if adoption is not None:
            adoption.after_step(step)
        totals["bytes_sent"] += bytes_sent
        totals["bytes_received"] += stats.bytes_received if stats is not None else 0
        totals["dense_bytes"] += dense_bytes
        if stats is not None and stats.verify_max_abs_err is not None:
            totals["verify_max_abs_err"] = max(totals.get("verify_max_abs_err", 0.0), stats.verify_max_abs_err)
        if stats is not None and stats.verify_documented_bytes is not None:
            totals["verify_documented_bytes"] = totals.get("verify_documented_bytes", 0) + stats.verify_documented_bytes

        last = step == steps - 1
        evaluate = (step + 1) % training.eval_every == 0 or last
        # Training time excludes evaluation and reporting, so time-to-accuracy compares training.
        totals["train_s"] = time.perf_counter() - train_start
        paused = time.perf_counter()
        if evaluate:
            accuracy = _accuracy(model, x_test, y_test, device)
        if evaluate and world > 1 and dist.is_initialized():
            # Rank 0's accuracy counts: in asynchronous parameter-server mode each rank
            # evaluates its own copy of the model, and a rank that stopped alone, then or at a
            # later step from its own stale figure, would leave the others waiting.
            accuracy = agreed_accuracy(accuracy, device)
        reached = training.target_accuracy is not None and accuracy is not None and accuracy >= training.target_accuracy
        if reached and totals.get("time_to_target_s") is None:
            totals["time_to_target_s"], totals["steps_to_target"] = totals["train_s"], step + 1
        done = last or (reached and training.stop_at_target) or bool(stats is not None and getattr(stats, "stop", False))
        metrics = {
            "step": step, "loss": loss_value, "lr": lr, "world_size": world,
            "step_s": step_s, "comm_s": comm_s, "compute_probe_s": compute_probe_s,
            "mean_step_s": totals["step_s"] / totals["timed_steps"], "mean_comm_s": totals["comm_s"] / totals["timed_steps"],
            "mean_network_s": totals["network_s"] / totals["timed_steps"],
            "comm_source": ("ps" if client is not None else "hook") if stats is not None else "step minus compute",
            "train_s": totals["train_s"], "evaluated": evaluate,
            "interface_tx_bytes": (_interface_tx_bytes() - tx_start) if tx_start is not None else None,
            "bytes_sent": bytes_sent, "dense_bytes": dense_bytes,
            "total_bytes_sent": totals["bytes_sent"], "total_dense_bytes": totals["dense_bytes"],
            "total_bytes_received": totals["bytes_received"], "collective": "ps" if client is not None else None,
            "bytes_source": "counted" if stats is not None or counter is not None else "formula",
            "compressed": bool(stats.compressed) if stats else False,
            "ratio": stats.ratio if stats else None,
            "verify_max_abs_err": totals.get("verify_max_abs_err"),  # worst step so far
            "verify_documented_bytes": totals.get("verify_documented_bytes"),
            "test_accuracy": accuracy, "reached_target": totals.get("time_to_target_s") is not None,
            "time_to_target_s": totals.get("time_to_target_s"), "steps_to_target": totals.get("steps_to_target"), "elapsed_s": time.time() - started,
            "done": done, "pid": os.getpid(), "skipped": skipped,
            "skipped_steps": totals["skipped_steps"],
        }
        checkpoint = None
        if (every and (step + 1) % every == 0) or done:
            tmp = Path(tempfile.mkdtemp(prefix="rayzip-ckpt-"))
            _save(tmp, rank, world, step, weights, client or state, totals, accuracy, chain)
            if rank == 0 and metrics_out is not None:
                sizes = inspect_checkpoint(tmp / "trainer")
                metrics_out.record_checkpoint(sizes["stored_bytes"], sizes["raw_bytes"])
            checkpoint = ray.train.Checkpoint.from_directory(str(tmp))
        if progress is not None:
            progress.update.remote(metrics)  # fire and forget: per-step progress costs nothing
        # ray.train.report blocks until Ray Train's controller polls (every 2 s by default), so
        # it runs at evaluations and checkpoints only; every rank reaches it at the same steps.
        if evaluate or checkpoint is not None:
            ray.train.report(metrics, checkpoint=checkpoint, delete_local_checkpoint_after_upload=checkpoint is not None)
        if checkpoint is not None and not done:
            # A report waits only for room in a one-slot queue that the controller drains when
            # it polls, so the checkpoint just reported is not yet registered: a worker lost now
            # would send the job back two intervals. Reporting again waits until it is.
            ray.train.report(metrics)
        train_start += time.perf_counter() - paused
        if done:
            break
