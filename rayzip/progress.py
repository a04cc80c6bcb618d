"""The driver's view of a run: rank 0 posts each step's metrics to a :class:`Progress` actor,
and the driver polls it for the progress bar, the restarts and the exact-replay check.

It sits in a module of its own that imports nothing but the standard library, because Ray
starts the actor in a fresh process that imports the class's module: from ``rayzip.runner``,
that process would import torch and Ray Train first, several seconds of CPU on every run.
"""

from __future__ import annotations

import struct
import time
from typing import Callable

__all__ = ["Progress", "on_this_node", "start_progress"]


def on_this_node():
    """Where the driver's own actors go: the driver's node, so that losing a worker node
    (which elastic training survives) does not take the run's bookkeeping with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def start_progress(name: str, run: str | None = None, job: str | None = None):
    """A :class:`Progress` actor named ``name`` on the driver's node (no CPU); ``run`` and
    ``job`` label its recovery series in Prometheus (none without them)."""
    import ray

    return ray.remote(num_cpus=0)(Progress).options(name=name, scheduling_strategy=on_this_node()).remote(run, job)


def _dead_nodes() -> set[str]:
    """The cluster's nodes that Ray's control store lists as dead (one call to it)."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}


class Progress:
    """Rank 0 posts each step's metrics here (:func:`start_progress`); the driver polls it
    for the progress bar. Each restart is a recovery: the steps it lost (done before it and
    redone after), the seconds from the last step before it to the first step after, and
    where it resumed from (``memory``: a snapshot; ``storage``: a checkpoint), also exported
    to Prometheus when ``run`` and ``job`` are given, and its cause (:meth:`_cause`).

    Args:
        run, job: the labels of the recovery series in Prometheus.
        dead_nodes: the cluster's dead nodes now (default: Ray's list); read at the first
            step and at each restart, never per step.
    """

    def __init__(self, run: str | None = None, job: str | None = None,
                 dead_nodes: Callable[[], set[str]] | None = None):
        self.tags = {"run": run, "job": job} if run and job else None
        self.dead_nodes = dead_nodes or _dead_nodes
        self.dead: set[str] | None = None  # dead before the run's first step, then at the last restart
        self.updated = 0.0
        self.latest: dict | None = None
        self.failure: dict | None = None
        self.history: list[dict] = []  # one entry per evaluation: the accuracy-over-time curve
        self.restarts = {"steps_run": 0, "restarts": 0, "steps_redone": 0, "resumes": []}
        # Rank 0's loss at each step of this attempt, and the earlier attempt's at the steps a
        # resume redoes: an exact resume repeats them bit for bit.
        self.losses: dict[int, float] = {}
        self.before: dict[int, float] = {}
        self.replayed = {"steps": 0, "identical": 0, "first_difference": None}

    def update(self, metrics: dict) -> None:
        step = metrics["step"]
        if self.dead is None:
            self.dead = self.dead_nodes()
        # A new rank-0 process, or a step at or before the last one seen, means a new worker
        # group: it resumed from a checkpoint (or, in parameter-server mode, where the shards are).
        if self.latest is not None and (step <= self.latest["step"] or metrics.get("pid") != self.latest.get("pid")):
            self.restarts["restarts"] += 1
            # Posts are fire and forget, so a rank killed right after a step can take that
            # step's post with it. A resume at `step` proves step - 1 was done before the
            # failure, whatever reached this actor.
            last = max(self.latest["step"], step - 1)
            lost = max(0, last - step + 1)
            seconds = time.monotonic() - self.updated
            self.restarts["steps_redone"] += lost
            self.restarts["resumes"].append({"last_step": last, "resumed_at": step, "steps_lost": lost,
                                             "seconds": seconds, "source": metrics.get("resumed_source"),
                                             **self._cause(metrics)})
            self._export(lost, seconds)
            self.history = [h for h in self.history if h["step"] < step]
            # Steps an earlier attempt reached and the last did not stay comparable too.
            self.before.update({s: v for s, v in self.losses.items() if s >= step})
            self.losses = {s: v for s, v in self.losses.items() if s < step}
        self.restarts["steps_run"] += 1
        self.latest, self.updated = metrics, time.monotonic()
        loss = metrics.get("loss")
        if loss is not None:
            self.losses[step] = loss
            if step in self.before:
                first = self.before.pop(step)
                self.replayed["steps"] += 1
                if struct.pack("<d", first) == struct.pack("<d", loss):
                    self.replayed["identical"] += 1
                elif self.replayed["first_difference"] is None:
                    self.replayed["first_difference"] = step
        if metrics.get("evaluated"):
            self.history.append({k: metrics.get(k) for k in ("step", "train_s", "elapsed_s", "test_accuracy", "val_loss",
                                                                   "loss", "local_every")})

    def _cause(self, metrics: dict) -> dict:
        """The restart's ``cause``, as the driver can tell from outside the workers:
        ``node_lost`` (a node of the cluster died since the last restart), ``scale_up`` (the
        group came back larger: Ray Train grew it onto resources that appeared), else
        ``worker_failure`` (a worker process died or raised); with the nodes lost and the
        world sizes."""
        dead = self.dead_nodes()
        lost, self.dead = sorted(dead - self.dead), dead
        before, after = self.latest.get("world_size"), metrics.get("world_size")
        if lost:
            cause = "node_lost"
        elif before is not None and after is not None and after > before:
            cause = "scale_up"
        else:
            cause = "worker_failure"
        return {"cause": cause, "nodes_lost": lost, "world_before": before, "world_after": after}

    def _export(self, lost: int, seconds: float) -> None:
        if self.tags is not None:
            from .metrics import RecoveryMetrics  # here: the actor starts without Ray's metrics

            RecoveryMetrics(**self.tags).record(lost, seconds)

    def get(self) -> dict | None:
        return self.latest

    def fail(self, step: int, message: str) -> None:
        """Every rank stopped together at ``step`` (rayzip.train.loop)."""
        self.failure = {"step": step, "message": message}

    def get_failure(self) -> dict | None:
        return self.failure

    def get_history(self) -> list[dict]:
        return self.history

    def get_restarts(self) -> dict:
        return {**self.restarts, "resumes": list(self.restarts["resumes"]), "replayed": dict(self.replayed)}
