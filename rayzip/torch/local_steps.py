"""Local steps with compressed outer updates (DiLoCo-style synchronization).

Each worker takes H inner steps with its own optimizer on its own batches and exchanges
nothing. Then every worker sends its *pseudo-gradient*, the parameters at the last
synchronization minus its own now, through a :class:`~rayzip.engine.GradientExchange`: the
spec's codec, error feedback (the residual of one round rides on the next) and collective,
with the control word that makes every rank skip, raise or adopt a new compression together. An
outer optimizer (SGD with Nesterov momentum, as in DiLoCo) applies the mean pseudo-gradient
to the synchronized parameters, and every worker goes on from the result. The inner
optimizer's state stays each worker's own.

With ``overlap``, a round's exchange runs on a thread (with a process group of its own)
while the next round's inner steps run, as in streaming DiLoCo's overlapped communication:
the mean lands at the next synchronization, one round late, and each worker goes on from
the synchronized parameters minus its own pseudo-gradient of the round in flight, so its
own progress is not lost while the others' arrives. A forced synchronization (evaluations,
checkpoints, the last step) lands everything, and every rank then holds the same
parameters. On a slow link the wire time hides behind H inner steps of compute.

With a ``tuner`` (:class:`rayzip.adaptive.every.EveryTuner`), H is chosen again after each
synchronization from its measured time against the inner steps' compute: every rank's
slowest compute and the shortest synchronization, all-reduced with one 16-byte word, so
every rank takes the same H at the same step. A process's first synchronization is left out:
it also waits for the ranks' different start-up times.

On a sharded model (FSDP2 on a 1-D mesh over a node's ranks, see
:func:`rayzip.torch.fsdp.shard_model`), each parameter is a DTensor and this rank holds one
shard of it: the inner steps are the node's own FSDP2 training, and a synchronization
exchanges this rank's shards with the ranks that hold the same shards on the other nodes
(``process_group``: the replicate group), so the outer optimizer's state is sharded like the
parameters. The control word is then agreed over ``control_group`` (the world), so a NaN in
any shard drops or stops the round on every rank, and the tuner's H is every rank's.

At H = 1, with no codec and an outer SGD of learning rate 1 without momentum, this is
data-parallel training: the mean of theta - lr * g_r is theta - lr * mean(g), and with SGD
momentum inside, the mean of the workers' buffers follows DDP's buffer (both are linear).

Usage::

    local = LocalSteps(model.named_parameters(), every=10, compression=CompressionConfig(codec="group_topk", density=0.01))
    for batch in loader:
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        if local.gradient_ok(step):          # this rank's own gradient: NaN/Inf skips the inner step
            optimizer.step()
        local.after_inner_step()             # every H-th call synchronizes, on every rank
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Iterable

import torch
import torch.distributed as dist

from .. import cuda
from ..codecs import NonFiniteError
from ..codecs.kernels import all_finite
from ..comm import ring_allreduce_bytes
from ..comm.emulation import Emulation
from ..engine import NONFINITE_POLICIES, GradientExchange, StepStats
from ..engine.config import CompressionConfig
from ..xp import is_dtensor, local_part
from .optim import build_outer_optimizer

__all__ = ["LocalSteps", "LocalStepsConfig", "sparseloco_compression"]


@dataclass(frozen=True)
class LocalStepsConfig:
    """Local steps in your own loop (:func:`rayzip.train.prepare_model`'s ``local_steps``):
    each worker takes ``every`` optimizer steps of its own, then the workers average their
    pseudo-gradients and an outer SGD applies the average.

    The defaults are the setting measured on the GPT benchmark under AdamW, with
    :func:`sparseloco_compression` on the wire: H = 4, and an outer step of the plain
    average (learning rate 1, no momentum), where the fading error feedback stands in for
    DiLoCo's outer momentum (docs/benchmarks/local-steps.md). DiLoCo's own outer optimizer
    is ``outer_lr=0.7, outer_momentum=0.9``.

    Args:
        every: H, the optimizer steps between synchronizations.
        outer_lr: the outer optimizer's learning rate.
        outer_momentum: its momentum.
        nesterov: Nesterov momentum in it.
        keep_unsent: each worker goes on from the synchronized parameters less what error
            feedback still holds of its own pseudo-gradients (not from the synchronized
            parameters alone), so its next gradients see its own progress that compression
            held back. What crosses the wire is unchanged. At H = 1 this is what holds a
            transformer's quality every step (docs/benchmarks/language-model.md).

    Example::

        model = rayzip.train.prepare_model(model, local_steps=LocalStepsConfig(every=4))
    """

    every: int = 4
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    keep_unsent: bool = False

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a whole number of steps >= 1, got {self.every!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must lie in [0, 1), got {self.outer_momentum!r}")


def sparseloco_compression() -> CompressionConfig:
    """SparseLoCo's outer updates: group top-k at 1% with 2-bit values (a sign and one of two
    learned magnitudes) and entropy-coded offsets, error feedback that fades by 0.95 a round,
    and each kept entry averaged over the workers that sent it: the wire that held the GPT
    benchmark's quality under AdamW at the most compression (docs/benchmarks/local-steps.md)."""
    return CompressionConfig(codec="group_topk", density=0.01, value_dtype="2bit", coded_indices=True,
                             collective="allgather", error_decay=0.95, combine="senders")


class LocalSteps:
    """See the module docstring. ``named_parameters``: (name, parameter) pairs; those with
    ``requires_grad`` are synchronized (frozen ones never change). Without an initialized
    process group, or at world size 1, a synchronization exchanges nothing and only the
    outer optimizer runs. ``emulation``: a slower link than the real one for the
    synchronizations' sends (:mod:`rayzip.comm.emulation`); ``node_key`` as for
    :func:`rayzip.torch.compress`. ``control_group``: the ranks that agree on the control
    word and on H, when more than ``process_group`` must (a sharded model's world).
    ``alone``: this rank's replica is the only one (a sharded model in one shard group):
    nothing is exchanged, and a non-finite round is still agreed over ``control_group``."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], every: int = 10,
                 outer_lr: float = 0.7, outer_momentum: float = 0.5, nesterov: bool = True,
                 compression: CompressionConfig | None = None, process_group=None, on_nonfinite: str = "raise",
                 max_skipped_rounds: int = 10, tuner=None, overlap: bool = False,
                 emulation: Emulation | None = None, node_key: str | None = None, control_group=None,
                 alone: bool = False, keep_unsent: bool = False):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {on_nonfinite!r}")
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("no trainable parameters: nothing to synchronize")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.every, self.on_nonfinite, self.max_skipped_rounds = int(every), on_nonfinite, int(max_skipped_rounds)
        # The synchronized parameters, which the outer optimizer steps: float32 whatever the
        # model's dtype, so that small outer updates are not rounded away.
        self.anchor = [local_part(p).detach().to(torch.float32).clone() for p in self.params]
        self.outer = build_outer_optimizer(self.anchor, outer_lr, outer_momentum, nesterov)
        compression = compression or CompressionConfig()
        exchanging = (not alone and dist.is_available() and dist.is_initialized()
                      and dist.get_world_size(process_group) > 1)
        self.overlap = bool(overlap)
        if self.overlap and (control_group is not None or any(is_dtensor(p) for p in self.params)):
            # The exchange's thread would share the world's group with FSDP2's and the loop's
            # collectives on the training thread.
            raise ValueError("overlap does not run on a sharded model yet")
        self.control_group = control_group
        self.keep_unsent = bool(keep_unsent)
        if self.keep_unsent and self.overlap:
            raise ValueError("keep_unsent and overlap do not combine: with overlap each round already begins "
                             "from this rank's own progress of the round in flight")
        if exchanging and self.overlap and process_group is None:
            # The exchange's thread gets a group of its own, so that its collectives cannot
            # interleave with the caller's (evaluations, metrics) differently on different
            # ranks. Every rank builds LocalSteps at the same point, as new_group needs.
            process_group = dist.new_group(backend=dist.get_backend())
        # Where this rank's current round began: the synchronized parameters, or with
        # overlap, those plus this rank's own progress in the round still in flight.
        # With keep_unsent: those less what error feedback holds of this rank's own progress.
        self.base = [a.clone() for a in self.anchor] if self.overlap or self.keep_unsent else self.anchor
        self._pending: _InFlight | None = None
        self.kept = False  # this round began with the unsent residual kept in the parameters
        self.state = (GradientExchange(compression, [a.numel() for a in self.anchor], names=self.names,
                                       process_group=process_group, device=self.anchor[0].device,
                                       on_nonfinite=on_nonfinite, emulation=emulation, node_key=node_key,
                                       control_group=control_group)
                      if exchanging else None)
        if self.keep_unsent and self.state is not None and not (self.state.memory.enabled and
                                                                self.state.memory.residual_in_input_units):
            raise ValueError("keep_unsent needs plain error feedback on the pseudo-gradients (error_feedback on, "
                             "no momentum or Adam correction): the residual it keeps in the weights is "
                             "held in their units")
        self.world = dist.get_world_size(process_group) if exchanging else 1
        self.rank = dist.get_rank(process_group) if exchanging else 0
        self.inner = 0  # inner steps since the last synchronization
        self.rounds = 0  # synchronizations so far
        # Changes whenever what a synchronization writes does (the anchor, the outer optimizer,
        # error feedback, H): a snapshot writes round_start_dict() once per generation.
        self.generation = 0
        self.synced = False  # the last inner step ended with a synchronization
        self.last_sync: StepStats | None = None
        self.bad: str | None = None  # the parameter of this rank's first non-finite gradient this round
        self.skipped_in_a_row = 0  # synchronizations every rank dropped, in a row
        self.tuner = tuner  # chooses every after each synchronization (None: every is fixed)
        if tuner is not None:
            self.every = min(tuner.high, max(tuner.low, self.every))
        self.compute_s = 0.0  # this round's inner steps, as after_inner_step measured them
        self.sync_s = 0.0  # the last synchronization's time on this rank
        self.changes: list[tuple[int, int]] = []  # (round, H from then on), as the tuner chose
        self.tuned_here = 0  # synchronizations measured for the tuner by this process
        self._mark = time.perf_counter()

    # --- inner steps ----------------------------------------------------------------------
    def gradient_ok(self, step: int) -> bool:
        """Whether this rank's gradient is finite. Inner steps are each rank's own, so a bad
        one is skipped here alone; it also spoils this rank's round, which every rank learns
        at the next synchronization: under ``"raise"`` every rank stops there, naming rank
        and parameter; under ``"skip"`` every rank drops the round."""
        for name, p in zip(self.names, self.params):
            if p.grad is not None and not all_finite(local_part(p.grad)):
                if self.bad is None:
                    self.bad = name
                    print(f"rayzip: rank {self.rank}: the gradient of {name} is not finite at step {step}; "
                          f"the next synchronization {'stops every rank' if self.on_nonfinite == 'raise' else 'is dropped'}")
                return False
        return True

    def after_inner_step(self, force: bool = False, compute_s: float | None = None) -> bool:
        """Count an inner step; synchronize after the H-th since the last (or now, with
        ``force``: every rank must force at the same step). Whether it synchronized.
        ``compute_s``: the inner step's time, for the tuner (default: the time since the
        previous call returned)."""
        now = time.perf_counter()
        self.compute_s += compute_s if compute_s is not None else now - self._mark
        self.inner += 1
        self.synced = force or self.inner >= self.every
        if self.synced:
            self.synchronize(force=force)
        self._mark = time.perf_counter()
        return self.synced

    # --- synchronization ------------------------------------------------------------------
    def pseudo_gradient(self) -> torch.Tensor:
        """Flat float32: where this rank's round began minus its parameters now (NaN at a
        parameter whose gradient was not finite this round, so that the exchange's control
        word tells every rank). Without overlap a round begins at the synchronized
        parameters."""
        parts = []
        for name, base, p in zip(self.names, self.base, self.params):
            delta = (base - local_part(p).detach().to(torch.float32)).reshape(-1)
            if name == self.bad:
                delta = torch.full_like(delta, float("nan"))
            parts.append(delta)
        return torch.cat(parts)

    @torch.no_grad()
    def synchronize(self, force: bool = False) -> None:
        """Average the pseudo-gradients, step the outer optimizer, and set every rank's
        parameters to the result. A round every rank skips (a non-finite average, under
        ``"skip"``) goes back to the synchronized parameters.

        With ``overlap`` (and not ``force``), the round's exchange runs on a thread while the
        next round's inner steps run: the previous round's average lands here, and each rank
        goes on from the synchronized parameters plus its own progress of the round just
        sent. ``force`` lands everything, so that every rank then holds the same parameters."""
        started = time.perf_counter()
        compute_s = self.compute_s / max(1, self.inner)
        delta, own_bad = self.pseudo_gradient(), self.bad is not None
        self.inner, self.bad, self.compute_s = 0, None, 0.0
        landed = self._land() if self._pending is not None else None
        if self.overlap and self.state is not None and not force:
            # The next round begins where this one's own progress took the synchronized parameters.
            for anchor, base, p, (offset, n) in zip(self.anchor, self.base, self.params, self._offsets()):
                if own_bad:  # its progress is not finite: the round is dropped on every rank
                    base.copy_(anchor)
                else:
                    torch.sub(anchor, delta[offset: offset + n].view_as(anchor), out=base)
                local_part(p).copy_(base)
            self._pending = _InFlight(lambda: self._exchange(delta, compute_s, agree=self.tuner is not None),
                                      device=delta.device)
            self.last_sync = landed
            self.sync_s = time.perf_counter() - started
            return
        mean, stats, _ = self._exchange(delta, compute_s, agree=False)
        self._step_outer(mean, stats)
        # A forced synchronization leaves every rank with the same parameters.
        self._restart(keep=not force)
        self.last_sync = _merged(landed, stats) if self.state is not None else None
        self.sync_s = time.perf_counter() - started
        if self.tuner is not None:
            self._choose(*self._agree(compute_s, self.sync_s, self.last_sync))

    def _restart(self, keep: bool) -> None:
        """Set where the next round begins, and the parameters to it: the synchronized ones,
        or (``keep`` and keep_unsent) those less what error feedback holds of this rank's own
        pseudo-gradients, as much of it as the next round's input will carry. The pseudo-gradient
        is then this round's progress alone, and the exchange adds the residual as before, so
        the wire carries the same as without keep_unsent."""
        unsent = None
        self.kept = keep and self.keep_unsent
        if self.kept and self.state is not None:
            unsent = self.state.residual()
            unsent *= self.state.memory.decay
        for anchor, base, p, (offset, n) in zip(self.anchor, self.base, self.params, self._offsets()):
            if unsent is not None:
                torch.sub(anchor, unsent[offset: offset + n].view_as(anchor), out=base)
            elif base is not anchor:
                base.copy_(anchor)
            local_part(p).copy_(base)

    @torch.no_grad()
    def to_synchronized(self) -> None:
        """Between rounds, set every parameter to the synchronized one (with keep_unsent each
        rank's are its own until then), as a forced synchronization leaves them. Nothing is
        lost: the residual stays in error feedback, which the next round sends from."""
        if self.inner:
            raise RuntimeError(f"to_synchronized is called between rounds, not {self.inner} inner steps into one")
        self._restart(keep=False)
        self.generation += 1

    def _offsets(self) -> list[tuple[int, int]]:
        spans, offset = [], 0
        for anchor in self.anchor:
            spans.append((offset, anchor.numel()))
            offset += anchor.numel()
        return spans

    def _exchange(self, delta: torch.Tensor, compute_s: float, agree: bool):
        """The mean pseudo-gradient, the round's stats, and (``agree``) the tuner's agreed
        inputs, measured on this thread (with overlap, the exchange's own thread)."""
        started = time.perf_counter()
        if self.state is None:
            bad = not all_finite(delta)
            if self.control_group is not None:  # the other shards' ranks learn it too
                flag = torch.tensor([1.0 if bad else 0.0], device=delta.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
                bad = bool(flag.item())
            mean, stats = delta, StepStats(skipped=bad)
            if stats.skipped:
                stats.nonfinite = f"synchronization {self.rounds}: the pseudo-gradient is not finite"
                if self.on_nonfinite == "raise":
                    raise NonFiniteError(stats.nonfinite)
        else:
            mean = self.state.average(delta)  # raises on every rank alike under "raise"
            stats = self.state.last_step
        sync_s = time.perf_counter() - started
        stats.busy_s = stats.busy_s or sync_s
        return mean, stats, (self._agree(compute_s, sync_s, stats) if agree else None)

    def _land(self) -> StepStats:
        """Wait for the round in flight and apply it; its stats, with what this thread waited."""
        waited = time.perf_counter()
        pending, self._pending = self._pending, None
        mean, stats, agreed = pending.wait()  # an error every rank raised is raised here, on every rank
        stats.comm_s = time.perf_counter() - waited  # exposed: the rest overlapped inner steps
        self._step_outer(mean, stats)
        if agreed is not None:
            self._choose(*agreed)
        return stats

    def _step_outer(self, mean: torch.Tensor, stats: StepStats) -> None:
        skipped, reason = stats.skipped, stats.nonfinite
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row > self.max_skipped_rounds:  # every rank counts the same rounds
            raise NonFiniteError(f"{self.skipped_in_a_row} synchronizations in a row dropped, the last: {reason}")
        if not skipped:
            for anchor, (offset, n) in zip(self.anchor, self._offsets()):
                anchor.grad = mean[offset: offset + n].view_as(anchor).to(torch.float32)
            self.outer.step()
            for anchor in self.anchor:
                anchor.grad = None
        self.rounds += 1
        self.generation += 1

    def _agree(self, compute_s: float, sync_s: float, stats: StepStats | None) -> tuple[float, float]:
        """Every rank's slowest compute and shortest synchronization: one all-reduced word
        (over ``control_group`` where one is given, even with nothing to exchange), counted
        with the round's control bytes."""
        if self.control_group is not None:  # every shard group takes the same H: the world agrees
            word = torch.tensor([compute_s, -sync_s], dtype=torch.float64, device=self.anchor[0].device)
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=self.control_group)
            sent = ring_allreduce_bytes(word.numel() * word.element_size(), dist.get_world_size(self.control_group))
        elif self.state is None:
            return compute_s, sync_s
        else:
            transport = self.state.transport
            word = torch.tensor([compute_s, -sync_s], dtype=torch.float64, device=transport.device)
            sent = transport.bytes_sent
            transport.all_reduce(word, op=dist.ReduceOp.MAX)
            sent = transport.bytes_sent - sent
        if self.state is not None:
            self.state.totals["bytes_sent"] += sent
        if stats is not None:
            stats.bytes_sent += sent
            stats.control_bytes += sent
        compute_s, sync_s = word.tolist()
        return compute_s, -sync_s

    def _choose(self, compute_s: float, sync_s: float) -> None:
        self.tuned_here += 1
        if self.tuned_here == 1:
            # A process's first synchronization also waits out the ranks' different start-up
            # (imports, data, a restart's restore), which is not the link's time. Every rank
            # leaves out the same one: they start together.
            return
        every = self.tuner.observe(sync_s, compute_s, current=self.every)
        if every != self.every:
            if (dist.get_rank() if self.control_group is not None else self.rank) == 0:
                print(f"rayzip: local steps: H {self.every} -> {every} after synchronization {self.rounds} "
                      f"({sync_s:.3g} s to synchronize, {compute_s:.3g} s of compute a step)")
            self.every = every
            self.changes.append((self.rounds, every))

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Taken at a synchronization (the parameters then equal the synchronized ones, which
        the model's own state dict holds): the outer optimizer, the rounds, and the
        compression state (error feedback of the pseudo-gradients)."""
        if self.inner or self.kept or self._pending is not None:
            where = ("with a round in flight" if self._pending else "after a round that kept this rank's unsent "
                     "residual in its parameters" if self.kept else f"{self.inner} inner steps after one")
            raise RuntimeError(f"a LocalSteps checkpoint is taken at a forced synchronization, not {where}: "
                               "use round_state_dict")
        return self._state()

    def _state(self) -> dict:
        return {"rounds": self.rounds, "every": self.every, "outer": self.outer.state_dict(),
                "compression": self.state.state_dict() if self.state is not None else None,
                "tuner": self.tuner.state_dict() if self.tuner is not None else None}

    @property
    def in_flight(self) -> bool:
        """A round's exchange still runs (overlap)."""
        return self._pending is not None

    @property
    def mid_round(self) -> bool:
        """Inner steps taken since the last synchronization (each rank's parameters are then
        its own)."""
        return self.inner > 0

    @property
    def own_parameters(self) -> bool:
        """Each rank's parameters are its own, not the synchronized ones: inside a round, or
        at the start of one that keeps this rank's unsent residual (keep_unsent). Its state is
        then :meth:`round_state_dict`, with the rank's own parameters."""
        return self.inner > 0 or self.kept

    def round_state_dict(self) -> dict:
        """:meth:`state_dict` at any step between synchronizations, not with a round in
        flight: with the synchronized parameters and this round's inner steps, so that a
        rank that loads it and its own parameters goes on with the round where it was. It is
        :meth:`round_start_dict` (the same through a round) and :meth:`round_step_dict`."""
        return {**self.round_start_dict(), **self.round_step_dict()}

    def round_start_dict(self) -> dict:
        """The part of :meth:`round_state_dict` that only a synchronization changes (it and
        :attr:`generation` change together): the synchronized parameters, the outer
        optimizer, error feedback, H."""
        if self._pending is not None:
            raise RuntimeError("a round is in flight (overlap): its state is taken at a forced synchronization")
        return {**self._state(), "anchor": list(self.anchor), "kept": self.kept}

    def round_step_dict(self) -> dict:
        """The part of :meth:`round_state_dict` that each inner step changes."""
        return {"inner": self.inner, "bad": self.bad, "compute_s": self.compute_s}

    def load_round_state_dict(self, state: dict, compression: dict | None = None) -> None:
        """Restore :meth:`round_state_dict` (this rank's own parameters already loaded)."""
        params = [local_part(p).detach().clone() for p in self.params]
        self.load_state_dict(state, compression)
        with torch.no_grad():
            for anchor, saved in zip(self.anchor, state["anchor"]):
                anchor.copy_(saved)
            self._restart(keep=bool(state.get("kept", False)))  # from the anchor and the residual loaded
            for p, own in zip(self.params, params):
                local_part(p).copy_(own)
        self.inner, self.bad, self.compute_s = int(state["inner"]), state["bad"], float(state["compute_s"])
        self.generation += 1

    def load_state_dict(self, state: dict, compression: dict | None = None) -> None:
        """Restore :meth:`state_dict` onto parameters already loaded with the checkpoint's
        model: they become the synchronized ones. ``compression``: the compression state to
        load instead of the saved one (re-sharded after a resize), or None for the saved."""
        with torch.no_grad():
            for anchor, base, p in zip(self.anchor, self.base, self.params):
                anchor.copy_(local_part(p).detach().to(torch.float32))
                if base is not anchor:
                    base.copy_(anchor)
        self.outer.load_state_dict(state["outer"])
        self.rounds, self.inner, self.bad, self.compute_s = int(state["rounds"]), 0, None, 0.0
        self.kept = False
        self.generation += 1
        if self.tuner is not None:  # a fixed H is the caller's, which may differ from the saved one
            self.every = min(self.tuner.high, max(self.tuner.low, int(state["every"])))
            self.tuner.load_state_dict(state.get("tuner"))
        saved = compression if compression is not None else state.get("compression")
        if self.state is not None and saved is not None:
            self.state.load_state_dict(saved)


def _merged(first: StepStats | None, second: StepStats) -> StepStats:
    """One synchronization's stats from the round that landed in it and its own."""
    if first is None:
        return second
    return replace(second, bytes_sent=first.bytes_sent + second.bytes_sent,
                   control_bytes=first.control_bytes + second.control_bytes,
                   comm_s=first.comm_s + second.comm_s, busy_s=first.busy_s + second.busy_s,
                   network_s=first.network_s + second.network_s, hops=first.hops + second.hops,
                   skipped=first.skipped or second.skipped, nonfinite=first.nonfinite or second.nonfinite)


class _InFlight:
    """One call on a thread of its own; :meth:`wait` returns its result or raises its error.
    On CUDA the thread runs on the caller's current stream, so that it reads the tensors the
    caller queued there only once they are written, and the caller reads its results in order."""

    def __init__(self, call, device: torch.device | None = None):
        self._result, self._error = None, None
        stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, args=(call, stream), name="rayzip-local-sync",
                                        daemon=True)
        self._thread.start()

    def _run(self, call, stream) -> None:
        try:
            if stream is None:
                self._result = call()
            else:
                with torch.cuda.stream(stream), cuda.torch_stream(stream.device):  # cupy's work too
                    self._result = call()
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc

    def wait(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
