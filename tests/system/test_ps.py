"""Parameter-server mode (issue 7): shard actors on a real local Ray, and real Ray Train runs.

The shard tests drive real shard actors from the test process, so they can order pushes and
pulls exactly; the training tests run the whole service: TorchTrainer workers, named shard
actors, checkpoints.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from rayzip import checkpoint
from rayzip.codecs import get_codec
from rayzip.ps import ParameterShard, StaleGeneration
from rayzip.runner import run_job
from rayzip.spec import DatasetSpec, JobSpec, load_spec

from paths import ROOT


def _spec(**ps) -> JobSpec:
    return JobSpec.model_validate({"name": "ps-unit", "training": {"optimizer": "sgd", "momentum": 0.0, "lr": 0.5},
                                   "compression": {"codec": "none", "collective": "ps"}, "ps": ps})


# --- shard actors on a real Ray ---------------------------------------------------------------
def _shard(spec: JobSpec, numel: int, params: np.ndarray):
    shard = ray.remote(ParameterShard).options(num_cpus=0).remote(0, spec.model_dump())
    ray.get(shard.load.remote(0, numel, params, None, 0))
    return shard


def _wire(x: np.ndarray) -> np.ndarray:
    return get_codec("none").encode(x).to_array()


def _pending(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0.3)
    return not ready


def test_sync_shard_waits_for_every_worker_and_follows_membership(local_ray):
    params = np.arange(6, dtype=np.float32)
    shard = _shard(_spec(), 6, params)
    ray.get(shard.begin.remote("g1", 2, 0))
    g0, g1 = np.ones(6, np.float32), 3 * np.ones(6, np.float32)
    pull = shard.pull.remote("g1", 0, 1)
    ray.get(shard.push.remote("g1", 0, 0, 0.5, "none", {}, _wire(g0)))
    assert _pending(pull)  # one of two workers pushed: no step yet
    ray.get(shard.push.remote("g1", 1, 0, 0.5, "none", {}, _wire(g1)))
    assert np.array_equal(ray.get(pull)["data"], params - 0.5 * (g0 + g1) / 2)
    # Rank 1 pushes step 1, then the group is replaced by one of a single worker: the half
    # step is dropped, and from then on one push makes a step. The shard is the same actor.
    ray.get(shard.push.remote("g1", 1, 1, 0.5, "none", {}, _wire(g1)))
    waiting = shard.pull.remote("g1", 1, 2)
    info = ray.get(shard.begin.remote("g2", 1, 1))
    assert info["counters"]["dropped_partial_steps"] == 1 and info["world"] == 1
    with pytest.raises(StaleGeneration):
        ray.get(waiting)  # the old group's pull is released, not left hanging
    with pytest.raises(StaleGeneration):
        ray.get(shard.push.remote("g1", 0, 1, 0.5, "none", {}, _wire(g0)))
    ray.get(shard.push.remote("g2", 0, 1, 0.5, "none", {}, _wire(g0)))
    after = ray.get(shard.pull.remote("g2", 0, 2))
    assert after["step"] == 2 and np.array_equal(after["data"], params - 0.5 * (g0 + g1) / 2 - 0.5 * g0)
    assert [m["world"] for m in ray.get(shard.info.remote())["membership"]] == [2, 1]


def test_async_shard_applies_each_push_and_bounds_staleness(local_ray):
    params = np.zeros(4, dtype=np.float32)
    shard = _shard(_spec(mode="async", staleness=1), 4, params)
    ray.get(shard.begin.remote("g", 2, 0))
    g = np.ones(4, np.float32)
    ray.get(shard.push.remote("g", 0, 0, 1.0, "none", {}, _wire(g)))
    first = ray.get(shard.pull.remote("g", 0, 1))  # 1 step ahead of rank 1: allowed
    assert np.array_equal(first["data"], -g / 2)  # applied on arrival, scaled by 1 / world
    ray.get(shard.push.remote("g", 0, 1, 1.0, "none", {}, _wire(g)))
    blocked = shard.pull.remote("g", 0, 2)  # would be 2 steps ahead of rank 1
    assert _pending(blocked)
    ray.get(shard.push.remote("g", 1, 0, 1.0, "none", {}, _wire(g)))
    assert np.array_equal(ray.get(blocked)["data"], -1.5 * g)


def test_shard_state_round_trips_through_load(local_ray):
    spec = JobSpec.model_validate({"name": "ps-unit", "training": {"optimizer": "adam", "lr": 0.1},
                                   "compression": {"collective": "ps"}})
    shard = _shard(spec, 8, np.ones(8, np.float32))
    ray.get(shard.begin.remote("g", 1, 0))
    for step in range(3):
        ray.get(shard.push.remote("g", 0, step, 0.1, "none", {}, _wire(np.full(8, step + 1.0, np.float32))))
    state = ray.get(shard.state.remote())
    other = ray.remote(ParameterShard).options(num_cpus=0).remote(0, spec.model_dump())
    ray.get(other.load.remote(state["start"], state["stop"], state["params"], state["optimizer"], state["step"]))
    for s in (shard, other):
        ray.get(s.begin.remote("h", 1, 3))
        ray.get(s.push.remote("h", 0, 3, 0.1, "none", {}, _wire(np.full(8, -2.0, np.float32))))
    a, b = (ray.get(s.pull.remote("h", 0, 4))["data"] for s in (shard, other))
    assert np.array_equal(a, b)  # Adam's moments and step count came across exactly


# --- the whole service ------------------------------------------------------------------------
def _job(name: str, compression: dict, ps: dict | None = None, hidden: int = 64, **training) -> JobSpec:
    return JobSpec.model_validate({
        "name": name,
        "model": {"name": "mlp", "hidden": [hidden]},
        "dataset": {"name": "digits"},
        "training": {"steps": 30, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "eval_every": 10, **training},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 0.5},
        "compression": compression,
        **({"ps": {"cpus_per_shard": 0.25, **ps}} if ps is not None else {}),
        "checkpoint": {"every_steps": 0},
    })


def _final_weights(summary: dict) -> dict:
    return checkpoint.load(Path(summary["checkpoint"]) / "trainer")["model"]


def test_ps_training_equals_ddp_allreduce_training(local_ray, tmp_path):
    """Synchronous SGD with momentum, no compression: the shards' parameters after 30 steps
    equal those of DDP allreduce training, within float tolerance."""
    ddp = run_job(_job("ps-equal-ddp", {"codec": "none"}), storage_path=str(tmp_path / "ddp"))
    ps = run_job(_job("ps-equal-ps", {"codec": "none", "collective": "ps"}, {"shards": 2}),
                 storage_path=str(tmp_path / "ps"))
    assert ps["steps"] == ddp["steps"] == 30 and ps["world_size"] == 2
    a, b = _final_weights(ddp), _final_weights(ps)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-6), (name, (a[name] - b[name]).abs().max())
    assert ps["final_test_accuracy"] > 0.8  # training moved the weights
    # Bytes: every step each worker pushes 4 * numel and pulls 4 * numel, counted from the
    # payloads; the shards' own counters agree (plus each worker's first, whole-model pull).
    numel = 64 * 64 + 64 + 64 * 10 + 10
    assert ps["bytes_sent_per_worker"] == ps["bytes_received_per_worker"] == 30 * 4 * numel
    totals = ps["ps"]["totals"]
    assert totals["bytes_pushed"] == 2 * 30 * 4 * numel
    assert totals["bytes_pulled"] == 2 * 31 * 4 * numel
    assert totals["updates"] == 2 * 30 and ps["ps"]["shards"] == 2


def test_local_steps_through_the_shards_equal_local_steps_among_the_workers(local_ray, tmp_path):
    """Local steps in parameter-server mode: 5 inner SGD steps per worker, then the shards'
    outer optimizer (SGD, Nesterov momentum) applies the mean pseudo-gradient. Without a
    codec it is the same arithmetic as local steps averaged among the workers."""
    local = {"enabled": True, "every": 5, "outer_lr": 0.7, "outer_momentum": 0.5}
    among = JobSpec.model_validate({**_job("local-among", {"codec": "none"}).model_dump(), "local_steps": local})
    shards = JobSpec.model_validate({**_job("local-shards", {"codec": "none", "collective": "ps"}, {"shards": 2})
                                     .model_dump(), "local_steps": local})
    a_run = run_job(among, storage_path=str(tmp_path / "among"))
    b_run = run_job(shards, storage_path=str(tmp_path / "shards"))
    assert a_run["steps"] == b_run["steps"] == 30
    a, b = _final_weights(a_run), _final_weights(b_run)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-6), (name, (a[name] - b[name]).abs().max())
    assert b_run["final_test_accuracy"] > 0.8 and b_run["local_every"] == 5
    # 6 synchronizations: each pushes and pulls 4 * numel per worker; inner steps send nothing.
    numel = 64 * 64 + 64 + 64 * 10 + 10
    assert b_run["bytes_sent_per_worker"] == b_run["bytes_received_per_worker"] == 6 * 4 * numel
    assert b_run["dense_bytes_per_worker"] == 30 * 4 * numel  # a dense push every step
    totals = b_run["ps"]["totals"]
    assert totals["updates"] == 2 * 6 and totals["bytes_pushed"] == 2 * 6 * 4 * numel


def test_a_nan_on_one_worker_stops_every_worker_through_the_shards(local_ray, tmp_path):
    """Rank 1's gradient is NaN at step 0: it tells the shards, whose pulls answer rank 0
    with the reason, so both stop at once, instead of rank 0 waiting for rank 1's push."""
    from rayzip.runner import TrainingFailed

    spec = _job("ps-nan", {"codec": "group_topk", "density": 0.05, "collective": "ps"}, {"shards": 2},
                on_nonfinite="raise").model_copy(update={"dataset": DatasetSpec(name="poisoned_data:digits_with_a_nan_shard")})
    started = time.perf_counter()
    with pytest.raises(TrainingFailed, match=r"NonFiniteError: rank 1, step 0, gradient slice of shard 0"):
        run_job(spec, storage_path=str(tmp_path))
    assert time.perf_counter() - started < 120


def test_the_example_job_reaches_the_target_and_a_killed_worker_rejoins_the_shards_where_they_are(
        local_ray, tmp_path):
    """The example job users run (group top-k at 1% both ways, momentum correction, 2 shards),
    with rank 0's worker process killed mid-run. Ray Train starts a new worker group; the
    shards keep running (same processes), drop the half-pushed step, wait for the new group's
    size, and the group resumes where the shards are, not at the last checkpoint."""
    spec = load_spec(ROOT / "jobs" / "digits-ps.yaml")
    assert (spec.compression.collective, spec.ps.pull, spec.training.target_accuracy) == ("ps", "codec", 0.93)
    spec = spec.model_copy(update={
        "scaling": spec.scaling.model_copy(update={"max_failures": 2}),
        "checkpoint": spec.checkpoint.model_copy(update={"every_steps": 20})})
    killed: dict = {}

    def kill_once(metrics: dict) -> None:
        if not killed and metrics["step"] >= 30 and metrics.get("checkpoint_reported_step") is not None:
            killed.update(step=metrics["step"], reported=metrics["checkpoint_reported_step"])
            os.kill(metrics["pid"], signal.SIGKILL)

    summary = run_job(spec, storage_path=str(tmp_path), on_progress=kill_once)
    assert killed and summary["restarts"] == 1, (killed, summary["resumes"])
    assert summary["reached_target"] and summary["final_test_accuracy"] >= 0.93, summary["history"]
    assert killed["step"] < summary["steps"], (killed, summary["history"])  # killed before the target
    # The shards were past the last checkpoint: at most the half-pushed step is redone.
    assert summary["steps_redone"] <= 1, summary["resumes"]
    shards = summary["ps"]["per_shard"]
    assert all(len(s["membership"]) == 2 for s in shards)  # a second worker group joined
    # The new group started where the shards were: past the step rank 0 last reported,
    # not back at the checkpoint.
    resumed = shards[0]["membership"][1]["step"]
    assert resumed >= killed["step"] + 1 > killed["reported"] + 1, (resumed, killed)
    # 1% of entries as (u16 offset, fp16 value) per group: ~90x fewer bytes than dense, both ways.
    assert summary["wire_reduction"] > 50
    assert summary["bytes_received_per_worker"] < summary["dense_bytes_per_worker"] / 50
    kept = checkpoint.verify(os.path.join(summary["checkpoint"], "trainer"))
    assert kept["tensors"] > 0


def test_async_workers_with_lossless_pulls_stop_together_at_the_target(local_ray, tmp_path):
    """Bounded-staleness asynchronous updates: each worker evaluates its own copy, so rank 0's
    decision to stop at the target is broadcast; a rank stopping alone would leave the other
    waiting on its clock (this run hung before that)."""
    spec = _job("ps-async", {"codec": "group_topk", "density": 0.05, "collective": "ps", "momentum_correction": True},
                {"shards": 2, "mode": "async", "staleness": 2, "pull": "lossless"}, hidden=128, steps=300,
                target_accuracy=0.93, eval_every=25)
    summary = run_job(spec, storage_path=str(tmp_path))
    assert summary["reached_target"] and summary["steps"] < 300, summary["history"]
    totals = summary["ps"]["totals"]
    assert totals["updates"] == totals["pushes"] == 2 * 2 * summary["steps"]  # every push applied on arrival
    # Lossless pulls: XOR deltas against each worker's copy, bit-exact and several times smaller.
    assert summary["bytes_received_per_worker"] < summary["dense_bytes_per_worker"] / 3


def test_a_killed_shard_is_reloaded_from_the_last_checkpoint(local_ray, tmp_path):
    """A shard's process dies: Ray restarts the actor empty, the workers' next call to it
    fails, Ray Train starts a new worker group, and that group reloads every shard from a
    compressed checkpoint: never one older than the last Ray Train had taken before the kill.
    (Checkpoints are written in the background and taken at the next report, so the one in
    flight at the kill may be lost: at most two intervals are redone.)"""
    spec = _job("ps-shard-lost", {"codec": "none", "collective": "ps"}, {"shards": 2}, steps=120, eval_every=20)
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"every_steps": 20})})
    killed: dict = {}

    def kill_shard(metrics: dict) -> None:
        taken = metrics.get("checkpoint_reported_step")
        if not killed and metrics["step"] >= 50 and taken is not None:
            name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith("rayzip-ps-ps-shard-lost-") and a["name"].endswith("-0"))
            info = ray.get(ray.get_actor(name).info.remote())
            killed.update(step=metrics["step"], taken=taken, pid=info["pid"])
            os.kill(info["pid"], signal.SIGKILL)

    summary = run_job(spec, storage_path=str(tmp_path), on_progress=kill_shard)
    assert killed and summary["restarts"] >= 1 and summary["steps"] == 120, summary
    restarted, survivor = summary["ps"]["per_shard"]
    assert restarted["pid"] != killed["pid"]
    # The survivor kept running and saw both groups; the restarted shard only the new one,
    # which began at a checkpointed step (a multiple of the interval), before the kill and
    # not before the checkpoint Ray Train had taken.
    assert len(survivor["membership"]) >= 2 and len(restarted["membership"]) == 1
    resumed = restarted["membership"][0]["step"]
    assert resumed % 20 == 0 and killed["taken"] + 1 <= resumed <= killed["step"] + 1, (resumed, killed)
    (resume,) = summary["resumes"]
    assert resume["resumed_at"] == resumed, summary["resumes"]
    assert 0 <= summary["steps_redone"] <= 2 * 20, summary["resumes"]
    # Every shard's parameters and optimizer state and the workers' data position came back
    # bit-exactly: the redone steps repeated rank 0's loss of the first attempt, bit for bit.
    replayed = summary["replayed"]
    assert replayed["identical"] == replayed["steps"] == summary["steps_redone"], (replayed, summary["resumes"])
    assert summary["final_test_accuracy"] > 0.85, summary["history"]
