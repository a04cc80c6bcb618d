"""A parameter-server shard: a contiguous slice of the flattened parameters, its optimizer
state, and the bookkeeping of one worker group (a *generation*).

Workers push encoded gradients; the shard decodes each one. In ``sync`` mode it sums a
step's pushes and applies the optimizer once every current worker has pushed, with the
mean; in ``async`` mode it applies each push on arrival, scaled by 1 / world, and a pull
waits only while the puller runs more than ``staleness`` steps ahead of the slowest worker.
A new worker group (after an elastic resize or a failure) calls :meth:`ParameterShard.begin`
with its world size: the shard drops a step left half-pushed and from then on waits for that
many workers. The shard itself keeps running, with its parameters and optimizer state.

The class is plain Python; :func:`rayzip.ps.start_shards` runs it as an async Ray actor.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import torch

from ..codecs import get_codec
from ..spec import JobSpec
from ..torch.optim import build_optimizer, build_outer_optimizer, load_optimizer
from .pull import encode_pull, message_nbytes

__all__ = ["ParameterShard", "StaleGeneration", "merge_optimizer_states", "slice_optimizer_state"]


class StaleGeneration(RuntimeError):
    """A push or pull from a worker group that a newer one has replaced."""


class ParameterShard:
    def __init__(self, index: int, spec: dict):
        spec = JobSpec.model_validate(spec)
        self.index = index
        self.training, self.compression, self.ps = spec.training, spec.compression, spec.ps
        self.local_steps = spec.local_steps
        self.start = self.stop = 0
        self.param: torch.Tensor | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0  # sync: the step being gathered; async: the slowest worker's clock
        self.version = 0  # optimizer updates applied
        self.generation: str | None = None
        self.world = 0
        self.failure: str | None = None  # a worker's reason to stop this group (abort)
        self.total: np.ndarray | None = None
        self.arrived: set[int] = set()
        self.clocks: dict[int, int] = {}
        # What each worker holds: rank -> replica id -> array. Workers in step share a replica,
        # and a transition (from replica, at version) is encoded once for all of them.
        self.held: dict[int, int] = {}
        self.replicas: dict[int, np.ndarray] = {}
        self.transitions: dict[tuple[int | None, int], tuple[int, dict]] = {}
        self._next_replica = 0
        self._codecs: dict[tuple, Any] = {}
        self._pull_codec = spec.compression.build_codec() if spec.ps.pull == "codec" else None
        self._changed: asyncio.Condition | None = None
        self.counters = {"pushes": 0, "updates": 0, "pulls": 0, "dense_pulls": 0, "bytes_pushed": 0,
                         "bytes_pulled": 0, "generations": 0, "dropped_partial_steps": 0}
        self.membership: list[dict] = []

    # --- state -------------------------------------------------------------------------
    def info(self) -> dict:
        return {"index": self.index, "start": self.start, "stop": self.stop, "initialized": self.param is not None,
                "step": self.step, "version": self.version, "generation": self.generation, "world": self.world,
                "counters": dict(self.counters), "membership": list(self.membership), "pid": os.getpid(),
                "replicas": len(self.replicas)}

    def load(self, start: int, stop: int, params: np.ndarray, optimizer_state: dict | None, step: int) -> None:
        """Take ``params`` (this shard's slice, ``stop - start`` floats) and optimizer state."""
        if params.size != stop - start:
            raise ValueError(f"shard {self.index}: {params.size} values for the slice [{start}, {stop})")
        self.start, self.stop = start, stop
        self.param = torch.nn.Parameter(torch.tensor(np.asarray(params, dtype=np.float32)))
        if self.local_steps.enabled:  # pushes are pseudo-gradients: the outer optimizer applies them
            local = self.local_steps
            self.optimizer = build_outer_optimizer([self.param], local.outer_lr, local.outer_momentum, local.nesterov)
        else:
            self.optimizer = build_optimizer(self.training, [self.param],
                                             momentum_elsewhere=self.compression.momentum_correction)
        if optimizer_state is not None:
            load_optimizer(self.optimizer, optimizer_state)
        self.step, self.version = int(step), 0
        self.generation, self.world = None, 0
        self._reset_group()

    def state(self) -> dict:
        """Parameters, optimizer state and step, for a checkpoint."""
        self._require_loaded()
        return {"start": self.start, "stop": self.stop, "params": self.param.detach().numpy().copy(),
                "optimizer": self.optimizer.state_dict(), "step": self.step}

    def _require_loaded(self) -> None:
        if self.param is None:
            raise RuntimeError(f"parameter shard {self.index} holds no parameters yet (load() first)")

    def _reset_group(self) -> None:
        self.total, self.arrived = None, set()
        self.held.clear()
        self.replicas.clear()
        self.transitions.clear()

    # --- membership ----------------------------------------------------------------------
    async def begin(self, generation: str, world: int, step: int) -> dict:
        """A new worker group of ``world`` workers takes over, resuming at ``step``."""
        self._require_loaded()
        if step < self.step:
            raise ValueError(f"shard {self.index} is at step {self.step}; cannot resume at {step}")
        if self.arrived:
            self.counters["dropped_partial_steps"] += 1
        self.generation, self.world, self.step = generation, int(world), int(step)
        self.failure = None
        self.clocks = {rank: self.step for rank in range(self.world)}
        self._reset_group()
        self.counters["generations"] += 1
        self.membership.append({"generation": generation, "world": self.world, "step": self.step})
        await self._notify()
        return self.info()

    async def abort(self, generation: str, rank: int, reason: str) -> None:
        """Worker ``rank`` stops its group (a non-finite gradient): every pull waiting or to
        come answers with ``reason``, so that every worker stops, none waits for a push that
        will not come."""
        if generation == self.generation and self.failure is None:
            self.failure = reason
        await self._notify()

    # --- push and pull --------------------------------------------------------------------
    async def push(self, generation: str, rank: int, step: int, lr: float, codec: str, codec_params: dict,
                   wire) -> None:
        """Worker ``rank``'s encoded gradient for ``step``."""
        self._check_generation(generation, rank)
        decoder = self._decoder(codec, codec_params)
        grad = decoder.decode_flat(decoder.from_bytes(wire, numel=self.stop - self.start))
        self.counters["pushes"] += 1
        self.counters["bytes_pushed"] += int(wire.nbytes)
        if self.ps.mode == "async":
            self._apply(grad / self.world, lr)
            self.clocks[rank] = step + 1
            self.step = min(self.clocks.values())
        else:
            if step != self.step or rank in self.arrived:
                raise ValueError(f"shard {self.index}: rank {rank} pushed step {step}, but the shard is "
                                 f"gathering step {self.step}" + (" and has its push already" if rank in self.arrived else ""))
            self.total = grad.copy() if self.total is None else np.add(self.total, grad, out=self.total)
            self.arrived.add(rank)
            if len(self.arrived) == self.world:
                self._apply(self.total / self.world, lr)
                self.total, self.arrived = None, set()
                self.step += 1
        await self._notify()

    async def pull(self, generation: str, rank: int, step: int) -> dict:
        """The parameters ``rank`` needs to compute ``step``: in sync mode once every push of
        the step before is applied, in async mode once the slowest worker is within
        ``staleness`` steps. Returns the pull message with the shard's step and version."""
        self._check_generation(generation, rank)
        if self.ps.mode == "async":
            ready = lambda: min(self.clocks.values()) >= step - self.ps.staleness  # noqa: E731
        else:
            ready = lambda: self.step >= step  # noqa: E731
        condition = self._condition()
        async with condition:
            await condition.wait_for(lambda: ready() or self.generation != generation or self.failure is not None)
        self._check_generation(generation, rank)
        if self.failure is not None:
            return {"kind": "abort", "reason": self.failure, "step": self.step, "version": self.version}
        message = self._message_for(rank)
        self.counters["pulls"] += 1
        self.counters["dense_pulls"] += message["kind"] == "dense"
        self.counters["bytes_pulled"] += message_nbytes(message)
        return {**message, "step": self.step, "version": self.version}

    def _message_for(self, rank: int) -> dict:
        source = self.held.get(rank)
        key = (source, self.version)
        if key not in self.transitions:
            replica = self.replicas.get(source) if source is not None else None
            message, copy = encode_pull(self.ps.pull, self.param.detach().numpy(), replica, self._pull_codec)
            self._next_replica += 1
            self.replicas[self._next_replica] = copy
            self.transitions[key] = (self._next_replica, message)
        target, message = self.transitions[key]
        self.held[rank] = target
        in_use = set(self.held.values())
        for rid in [r for r in self.replicas if r not in in_use]:
            del self.replicas[rid]
        for old in [k for k in self.transitions if k[1] != self.version]:
            del self.transitions[old]
        return message

    def _apply(self, grad: np.ndarray, lr: float) -> None:
        self.param.grad = torch.from_numpy(np.ascontiguousarray(grad, dtype=np.float32))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.param.grad = None
        self.version += 1
        self.counters["updates"] += 1

    def _decoder(self, name: str, params: dict):
        key = (name, tuple(sorted(params.items())))
        if key not in self._codecs:
            self._codecs[key] = get_codec(name, **params)
        return self._codecs[key]

    def _check_generation(self, generation: str, rank: int) -> None:
        self._require_loaded()
        if generation != self.generation:
            raise StaleGeneration(f"shard {self.index}: rank {rank} belongs to worker group {generation}, "
                                  f"which group {self.generation} replaced")
        if not 0 <= rank < self.world:
            raise ValueError(f"shard {self.index}: rank {rank} is outside the group of {self.world}")

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the actor's event loop, where it is awaited
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        condition = self._condition()
        async with condition:
            condition.notify_all()


def merge_optimizer_states(states: list[dict], sizes: list[int]) -> dict:
    """One optimizer state dict for the whole flat parameter from the shards' state dicts:
    per-element buffers (momentum, Adam's moments) are concatenated in shard order, scalars
    (Adam's step) are taken from the first shard."""
    merged: dict[str, Any] = {}
    per_shard = [s["state"].get(0, {}) for s in states]
    for key, first in per_shard[0].items():
        if torch.is_tensor(first) and first.dim() == 1 and first.numel() == sizes[0]:
            merged[key] = torch.cat([s[key] for s in per_shard])
        else:
            merged[key] = first
    return {"state": {0: merged} if merged else {}, "param_groups": states[0]["param_groups"]}


def slice_optimizer_state(state: dict, start: int, stop: int, total: int) -> dict:
    """A shard's part of :func:`merge_optimizer_states`' output."""
    mine = {key: value[start:stop].clone() if torch.is_tensor(value) and value.dim() == 1 and value.numel() == total
            else value for key, value in state["state"].get(0, {}).items()}
    return {"state": {0: mine} if mine else {}, "param_groups": state["param_groups"]}
