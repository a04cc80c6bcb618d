"""Typed records of training: what one step moved and took, and the running totals a
checkpoint carries across restarts.

Usage::

    totals = Totals.from_dict(saved.get("totals"))
    totals.add(record)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ..xp import local_part

__all__ = ["LinkProbe", "StepRecord", "Totals", "Traffic", "held_bytes", "traffic_of"]


def _local_nbytes(tensor) -> int:
    """Bytes of ``tensor`` this rank holds: its local shard where it is a DTensor."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    local = local_part(tensor)
    return local.numel() * local.element_size()


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """What this rank holds of the model's parameters, their gradients and the optimizer's
    state, counted from the tensors (a sharded model's local shards), in bytes. Gradients are
    counted where they exist: call it after backward."""
    params = list(model.parameters())
    return {"parameters": sum(_local_nbytes(p) for p in params),
            "gradients": sum(_local_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_local_nbytes(v) for state in (optimizer.state.values() if optimizer is not None else ())
                             for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)}


@dataclass(frozen=True)
class LinkProbe:
    """One timed dense transfer at start (DDP's broadcast of the model): the busiest link's
    bytes, the seconds it took, and its latency-bound messages."""

    bytes: float
    seconds: float
    messages: float


@dataclass
class Traffic:
    """What one worker's gradient exchange sent and how long it took, for one step."""

    bytes_sent: int = 0  # ps: pushed to the shards
    bytes_received: int = 0  # ps: pulled from the shards
    local_bytes: int = 0  # of bytes_sent, those to workers on the same node (hierarchy)
    node_bytes: int | None = None  # hierarchy: what this worker's node sends off the node
    dense_bytes: int = 0  # an fp32 ring allreduce of the same gradient (ps: a dense push)
    comm_s: float = 0.0  # what the step waited for communication
    busy_s: float = 0.0  # the exchange's own time (rayzip's hook: overlapped with backward, or not)
    network_s: float = 0.0  # of busy_s, inside torch.distributed or waiting on the shards
    messages: int = 0  # latency-bound sends (a ring allreduce counts 2(n-1)); 0: not counted
    compressed: bool = False
    density: float | None = None  # the kept fraction in force (None: dense)
    comm_source: str = "hook"  # hook, ps, or "step minus compute" (plain DDP, torch hooks)
    bytes_source: str = "counted"  # counted, or formula (plain DDP)
    verify_max_abs_err: float | None = None
    verify_documented_bytes: int | None = None
    stop: bool = False  # some rank asked every rank to stop after this step
    local_every: int | None = None  # local steps: H, the inner steps between synchronizations, from now on


def traffic_of(stats, source: str = "hook") -> Traffic:
    """A :class:`Traffic` from the hook's or the ps client's ``StepStats``, which count the
    bytes, the dense equivalent and the timings themselves."""
    return Traffic(bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received, dense_bytes=stats.dense_bytes,
                   local_bytes=stats.local_bytes, node_bytes=stats.node_bytes,
                   comm_s=stats.comm_s, busy_s=stats.busy_s or stats.comm_s, network_s=stats.network_s,
                   messages=stats.hops,
                   compressed=bool(stats.compressed), density=stats.density, comm_source=source,
                   verify_max_abs_err=stats.verify_max_abs_err, verify_documented_bytes=stats.verify_documented_bytes,
                   stop=stats.stop)


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    step_s: float
    traffic: Traffic = field(default_factory=Traffic)
    skipped: bool = False


@dataclass
class Totals:
    """Sums over the run so far, saved in every checkpoint; the training clock excludes
    evaluation and reporting, so time to target compares training."""

    bytes_sent: int = 0
    bytes_received: int = 0
    local_bytes: int = 0
    node_bytes: int | None = None
    dense_bytes: int = 0
    train_s: float = 0.0
    step_s: float = 0.0
    comm_s: float = 0.0
    busy_s: float = 0.0
    network_s: float = 0.0
    timed_steps: int = 0
    skipped_steps: int = 0
    checkpoints: int = 0
    checkpoint_stall_s: float = 0.0  # time the loop waited on checkpoints (snapshots, writes)
    snapshot_s: float = 0.0  # time the loop spent on in-memory snapshots (rayzip.train.snapshots)
    snapshots: int = 0
    time_to_target_s: float | None = None
    steps_to_target: int | None = None
    verify_max_abs_err: float | None = None
    verify_documented_bytes: int | None = None

    @classmethod
    def from_dict(cls, saved: dict | None) -> "Totals":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (saved or {}).items() if k in known})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # scalars only: no deep copy

    def add(self, record: StepRecord) -> None:
        t = record.traffic
        self.step_s += record.step_s
        self.comm_s += t.comm_s
        self.busy_s += t.busy_s
        self.network_s += t.network_s
        self.timed_steps += 1
        self.skipped_steps += int(record.skipped)
        self.bytes_sent += t.bytes_sent
        self.bytes_received += t.bytes_received
        self.local_bytes += t.local_bytes
        if t.node_bytes is not None:
            self.node_bytes = (self.node_bytes or 0) + t.node_bytes
        self.dense_bytes += t.dense_bytes
        if t.verify_max_abs_err is not None:
            self.verify_max_abs_err = max(self.verify_max_abs_err or 0.0, t.verify_max_abs_err)
        if t.verify_documented_bytes is not None:
            self.verify_documented_bytes = (self.verify_documented_bytes or 0) + t.verify_documented_bytes

    def mean(self, name: str) -> float:
        return getattr(self, name) / self.timed_steps if self.timed_steps else 0.0
