"""Local steps in your own loop: what ``prepare_model(model, local_steps=...)`` sets up.

The model stays DDP, so ``no_sync()``, ``.module`` and code written for DDP keep working, but
its comm hook sends nothing: each rank's gradient stays its own, and what your code sees
after ``backward()`` is that rank's gradient, so clipping, logging and AMP keep their
meaning. Each ``optimizer.step()`` over the model's parameters is then an inner step of
:class:`~rayzip.torch.local_steps.LocalSteps`, counted by torch's optimizer hooks; after
every H-th, every rank's pseudo-gradient crosses the wire compressed and the outer optimizer
sets every rank's parameters to the result. Your loop calls nothing more.

A rank whose gradient is not finite skips its inner step (its gradients are dropped before
the optimizer reads them), and every rank learns of it at the next synchronization: under
``on_nonfinite="raise"`` every rank stops there, under ``"skip"`` every rank drops the round.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..comm import ring_allreduce_bytes
from ..engine import StepStats
from ..torch.local_steps import LocalSteps
from .checkpoints import LocalStepsState, SplitState, unwrap
from .snapshots import MAX_SNAPSHOT_SLOTS

__all__ = ["OwnLoopLocalSteps", "own_gradient_hook"]


def own_gradient_hook(state, bucket):  # no annotations: DDP compares them with dist.GradBucket itself
    """A DDP comm hook that sends nothing: every rank keeps its own gradient (a
    ``torch.distributed.GradBucket``'s buffer, as it is)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class OwnLoopLocalSteps(SplitState):
    """A :class:`LocalSteps` driven by your loop's ``optimizer.step()`` calls, and its state
    as :func:`rayzip.train.report`, :func:`~rayzip.train.snapshot` and
    :func:`~rayzip.train.restore` see it (:func:`rayzip.train.compression_state` returns it).

    Attributes:
        local: the :class:`LocalSteps` (``every``, ``rounds``, ``last_sync``...).
        step: the optimizer steps taken so far, on every rank alike.
        optimizer: the optimizer whose steps are counted: the first one to step the model's
            parameters (or the one :func:`rayzip.train.report` or ``restore`` was given).
    """

    link_probe = None  # no start-up link probe: the adaptive controller tunes per-step compression only

    def __init__(self, model: torch.nn.Module, local: LocalSteps, rank: int, world: int):
        self.model, self.local, self.rank, self.world = model, local, rank, world
        self.step = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.skipped = False  # this rank's last inner step was skipped (a non-finite gradient)
        self._ids = {id(p) for p in local.params}  # held by local.params, so the ids stay theirs
        self._stepping = False
        numel = sum(p.numel() for p in local.params)
        self.dense_bytes = ring_allreduce_bytes(4 * numel, world) if world > 1 else 0  # DDP's, a step
        _LIVE.add(self)
        _install_hooks()
        unwrap(model).register_forward_pre_hook(self._before_forward)

    def bind(self, optimizer: torch.optim.Optimizer | None) -> OwnLoopLocalSteps:
        """Count ``optimizer``'s steps (None: keep the one bound)."""
        if optimizer is None or optimizer is self.optimizer:
            return self
        if self.optimizer is not None:
            raise ValueError("local steps count the steps of one optimizer over the model's parameters; a second "
                             f"one ({type(optimizer).__name__}) stepped them too: build one optimizer for the model")
        self.optimizer = optimizer
        self._checkpointed = LocalStepsState(self.local, optimizer, self.rank, self.world, self.model)
        _OWNER[optimizer] = self
        return self

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])

    @torch.no_grad()
    def synchronize(self) -> None:
        """Synchronize now, inside a round (nothing at its end): every rank then holds the
        synchronized parameters, as before an evaluation of the model everyone trains. Every
        rank calls it at the same step."""
        if self.local.mid_round:
            self.local.synchronize(force=True)
            self.local.synced = True
        elif self.local.kept:  # each rank's parameters hold its unsent residual: set them all alike
            self.local.to_synchronized()

    @property
    def codec(self):
        """The codec of the pseudo-gradients, as a per-step exchange's ``codec``; None where
        nothing is exchanged (world size 1)."""
        return self.local.state.codec if self.local.state is not None else None

    @property
    def memory(self):
        """The error feedback of this rank's pseudo-gradients, as a per-step exchange's
        ``memory`` (its ``residuals``...); None where nothing is exchanged (world size 1)."""
        return self.local.state.memory if self.local.state is not None else None

    @property
    def totals(self) -> dict:
        """Bytes sent by this rank's synchronizations so far (``bytes_sent``), and what DDP's
        ring would have sent over as many steps (``dense_bytes``)."""
        sent = self.local.state.totals["bytes_sent"] if self.local.state is not None else 0
        return {"bytes_sent": sent, "dense_bytes": self.step * self.dense_bytes}

    @property
    def last_step(self) -> StepStats:
        """The last step's traffic against DDP's (``dense_bytes``): a synchronization's, or
        nothing sent by an inner step."""
        if self.local.synced and self.local.last_sync is not None:
            return replace(self.local.last_sync, dense_bytes=self.dense_bytes, skipped=self.skipped)
        return StepStats(step=self.step, dense_bytes=self.dense_bytes, skipped=self.skipped)

    def _before_forward(self, module: torch.nn.Module, args) -> None:
        # An evaluation between rounds (a forward in eval mode without autograd) sees the
        # parameters every rank shares, not this rank's own, which hold its unsent residual
        # (keep_unsent): what your code evaluates or exports is the model the ranks train.
        # Nothing crosses the wire and nothing is lost: the residual stays in error feedback,
        # sent from next round. A training forward in eval mode (dropout off) has autograd on
        # and keeps the rank's own parameters.
        if not module.training and not torch.is_grad_enabled() and self.local.kept and not self.local.inner:
            self.local.to_synchronized()

    # --- the optimizer's hooks ------------------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._stepping = True
        self.skipped = not self.local.gradient_ok(self.step)
        if self.skipped:  # an optimizer steps no parameter without a gradient: this rank's step is skipped
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _after_step(self) -> None:
        self._stepping = False
        self.step += 1
        self.local.after_inner_step()

    # --- checkpoints and snapshots (RankState, SplitState) --------------------------------
    def _state(self) -> LocalStepsState:
        if self.optimizer is None:
            raise ValueError("local steps keep each rank's own optimizer state in its checkpoint: give report, "
                             "snapshot or restore the optimizer")
        return self._checkpointed

    @property
    def holders(self) -> dict[int, tuple[int, int]]:
        return self._state().holders

    @property
    def snapshot_slots(self) -> int:
        # A rank runs on alone until the next synchronization after another dies: the step
        # they share may be a round old.
        return min(MAX_SNAPSHOT_SLOTS, self.local.every + 1)

    def state_dict(self) -> dict:
        return self._state().state_dict()

    def split_state_dict(self):
        return self._state().split_state_dict()

    def restore(self, path, trainer: dict) -> None:
        """This rank's part of a checkpoint (see :meth:`LocalStepsState.restore`), and the
        step count it was taken at."""
        self._state().restore(path, trainer)
        self.step = int(trainer["step"]) + 1


# Every live adapter, and which one (or none) each optimizer that stepped belongs to.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKS: list = []


def _owner(optimizer: torch.optim.Optimizer) -> OwnLoopLocalSteps | None:
    if optimizer not in _OWNER:
        found = next((adapter for adapter in _LIVE if adapter.owns(optimizer)), None)
        if found is not None and any(adapter._stepping for adapter in _LIVE):
            return None  # an optimizer's parts stepping inside its own step (Muon with AdamW)
        if found is not None:
            found.bind(optimizer)
        else:
            _OWNER[optimizer] = None
    return _OWNER[optimizer]


def _pre_hook(optimizer, args, kwargs) -> None:
    adapter = _owner(optimizer)
    if adapter is not None and adapter.optimizer is optimizer and not adapter._stepping:
        adapter._before_step(optimizer)


def _post_hook(optimizer, args, kwargs) -> None:
    adapter = _OWNER.get(optimizer)
    if adapter is not None and adapter._stepping:
        adapter._after_step()


def _install_hooks() -> None:
    """torch's global optimizer hooks, once a process: they see the optimizer your loop
    builds after prepare_model, which prepare_model never sees."""
    if not _HOOKS:
        _HOOKS.extend((register_optimizer_step_pre_hook(_pre_hook), register_optimizer_step_post_hook(_post_hook)))
