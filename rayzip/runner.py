"""``rayzip run``: one job spec, trained by Ray Train's TorchTrainer, with a progress bar.

It connects to ``RAY_ADDRESS`` when that is set (a cluster, or the cluster a Ray Job runs
on) and otherwise starts an embedded local Ray. Workers are elastic between the spec's
min and max, restart on failure up to ``scaling.max_failures``, and resume from the last
checkpoint.

Usage::

    summary = run_job(load_spec("jobs/digits-group-topk.yaml"))
    print(summary["final_test_accuracy"], summary["wire_reduction"])
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from .adaptive import controller_name, start_controller
from .progress import on_this_node, start_progress
from .ps import shard_names, shard_report, start_shards, stop_shards
from .spec import JobSpec, check_allowed_modules
from .train.faults import Faults
from .train.loop import train_loop
from .train.snapshots import start_keepers, stop_keepers

__all__ = ["TrainingFailed", "run_job", "summarize"]


class TrainingFailed(RuntimeError):
    """Every rank stopped together on an error that a retry would only repeat (a non-finite
    gradient under ``training.on_nonfinite: raise``, or ranks that disagree)."""

def _start_keepers(spec: JobSpec, run_id: str) -> dict[str, Any]:
    """One snapshot keeper on each live node where the spec takes snapshots (rayzip.keeper)."""
    if not spec.snapshots.enabled:
        return {}
    return start_keepers(run_id, spec.snapshots.directory, spec.snapshots.max_bytes_per_node,
                         copy_density=spec.snapshots.copy_density)


def _stop_keepers(keepers: dict[str, Any], spec: JobSpec, run_id: str) -> dict[str, dict]:
    """What each node's keeper held at the end ({node id: usage}), every one removed."""
    if not spec.snapshots.enabled:
        return {}
    return stop_keepers(run_id, keepers, spec.snapshots.directory)


def _scaling(spec: JobSpec) -> ScalingConfig:
    s = spec.scaling
    workers = s.min_workers if s.min_workers == s.max_workers else (s.min_workers, s.max_workers)
    return ScalingConfig(num_workers=workers, use_gpu=s.use_gpu,
                         resources_per_worker={"CPU": s.cpus_per_worker, **s.resources_per_worker})


def init_ray(verbose: bool = True) -> str | None:
    """Join $RAY_ADDRESS's cluster, or start an embedded one; the folder of Ray's logs (None
    when Ray was already up). Not ``verbose``: the workers' output (Ray Train's per-report
    lines, checkpoint lines) and Ray's start-up lines stay in that folder, off the console.
    Errors still reach it: a failed worker's traceback comes back in the exception that
    ``fit`` raises."""
    if ray.is_initialized():
        return None
    quiet = {} if verbose else {"log_to_driver": False, "logging_level": logging.WARNING}
    # RAY_ADDRESS (set by users, and by Ray Jobs for an entrypoint) joins that cluster;
    # otherwise start an embedded Ray, never silently joining some other local cluster.
    if os.environ.get("RAY_ADDRESS"):
        context = ray.init(**quiet)
    else:
        # Metrics reach Prometheus every 2 s instead of Ray's default 10 s, so that the
        # adaptive controller's rate() windows hold several points.
        with _own_address():
            context = ray.init(address="local", _system_config={"metrics_report_interval_ms": 2000}, **quiet)
    session = getattr(context, "address_info", {}).get("session_dir")  # Ray's context: only a local start has it
    return os.path.join(session, "logs") if session else None


@contextlib.contextmanager
def _own_address():
    """While an embedded Ray starts: its GCS on a port chosen here, and RAY_ADDRESS naming it,
    inherited by every process it spawns. Ray Train's own actors (its placement-group cleaner
    asks the State API whether the controller lives) otherwise find "the" cluster on their
    own: another Ray on the same host (its ``ray_current_cluster`` file, or several GCS
    processes), which does not know the controller, so the cleaner removed this run's
    placement group or died. The driver's environment is left as it was."""
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    own = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"{ray.util.get_node_ip_address()}:{port}"}
    before = {k: os.environ.get(k) for k in own}
    os.environ.update(own)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(spec: JobSpec, metrics: dict, wall_s: float) -> dict[str, Any]:
    sent, dense = metrics.get("total_bytes_sent", 0), metrics.get("total_dense_bytes", 0)
    return {
        "name": spec.name,
        "metric": metrics.get("metric"),  # test_accuracy (classification) or val_loss (language_model)
        "final_test_accuracy": metrics.get("test_accuracy"),
        "final_val_loss": metrics.get("val_loss"),  # bits per byte
        "target_accuracy": spec.training.target_accuracy,
        "target_val_loss": spec.training.target_val_loss,
        "reached_target": bool(metrics.get("reached_target")),
        "time_to_target_s": metrics.get("time_to_target_s"),  # training time when first reached
        "steps_to_target": metrics.get("steps_to_target"),
        "steps": metrics.get("step", -1) + 1,
        "wall_s": wall_s,
        "world_size": metrics.get("world_size"),
        "codec": spec.compression.codec,
        "codec_params": spec.compression.codec_params(),
        "collective": spec.compression.collective,
        "bytes_sent_per_worker": sent,  # ps: pushed to the shards
        "bytes_received_per_worker": metrics.get("total_bytes_received", 0),  # ps: pulled from the shards
        "dense_bytes_per_worker": dense,
        "local_bytes_per_worker": metrics.get("total_local_bytes", 0),  # hierarchy: to workers on the node
        "node_bytes": metrics.get("total_node_bytes"),  # hierarchy: off rank 0's node, by the counts
        "bytes_source": metrics.get("bytes_source"),
        "wire_reduction": (dense / sent) if sent else None,
        "final_loss": metrics.get("loss"),
        "verify_max_abs_err": metrics.get("verify_max_abs_err"),
        "verify_documented_bytes": metrics.get("verify_documented_bytes"),
        "train_s": metrics.get("train_s"),
        "mean_step_s": metrics.get("mean_step_s"),
        "mean_comm_s": metrics.get("mean_comm_s"),
        "mean_network_s": metrics.get("mean_network_s"),
        "mean_busy_s": metrics.get("mean_busy_s"),
        "compute_probe_s": metrics.get("compute_probe_s"),
        "comm_source": metrics.get("comm_source"),
        "torch_hook": spec.compression.torch_hook,
        "interface_tx_bytes": metrics.get("interface_tx_bytes"),
        "skipped_steps": metrics.get("skipped_steps", 0),
        "local_every": metrics.get("local_every"),  # local steps: H at the end (tuned or the spec's)
        "local_every_tuned": spec.local_steps.enabled and spec.local_steps.adaptive,
        "held_bytes": metrics.get("held_bytes"),  # rank 0's parameters, gradients, optimizer state
    }


def _chain_dir(storage: str, run_id: str) -> str | None:
    """Where the delta chain's bases live: beside Ray's checkpoints, out of their rotation.
    Cloud storage (a URI) gets self-contained checkpoints instead."""
    if "://" in storage:
        return None
    return os.path.join(os.path.abspath(storage), run_id, "rayzip-bases")


def run_job(spec: JobSpec, storage_path: str | None = None,
            on_progress: Callable[[dict], None] | None = None, verbose: bool = True,
            on_logs: Callable[[str], None] | None = None, faults: Faults | None = None) -> dict[str, Any]:
    """Train ``spec`` to completion; returns the summary (see :func:`summarize`). Not
    ``verbose``: the workers' output goes to Ray's log folder only, which ``on_logs`` is told.
    ``faults``: what the run is made to suffer on purpose (:class:`rayzip.train.faults.Faults`)."""
    check_allowed_modules(spec)  # $RAYZIP_ALLOWED_MODULES, before any worker imports the spec's code
    logs = init_ray(verbose)
    if logs and on_logs is not None:
        on_logs(logs)
    run_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    storage = storage_path or os.environ.get("RAYZIP_STORAGE_PATH") or os.path.expanduser("~/ray_results")
    progress_name = f"rayzip-progress-{run_id}"
    progress = start_progress(progress_name, run_id if spec.metrics.enabled else None, spec.name)
    controller = None
    if spec.adaptive.enabled:
        controller = start_controller(run_id, spec.name, spec.adaptive,
                                      initial_compression=1.0 / (spec.compression.density or 0.01),
                                      scheduling_strategy=on_this_node())
    shards = start_shards(run_id, spec) if spec.compression.collective == "ps" else None
    keepers = _start_keepers(spec, run_id)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"spec": spec.model_dump(), "progress": progress_name, "t0": time.time(),
                           "chain_dir": _chain_dir(storage, run_id), "run_id": run_id,
                           "controller": controller_name(run_id) if controller is not None else None,
                           "ps_shards": shard_names(run_id, len(shards)) if shards else None,
                           "keepers": list(keepers),  # the nodes that had one at the start
                           "faults": faults},
        scaling_config=_scaling(spec),
        run_config=RunConfig(
            name=run_id,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=spec.scaling.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.num_to_keep),
        ),
    )
    kept: dict[str, dict] = {}
    try:
        outcome, wall_s = _fit_watching(trainer, progress, on_progress)
    finally:
        kept = _stop_keepers(keepers, spec, run_id)
    history = ray.get(progress.get_history.remote())
    failure = ray.get(progress.get_failure.remote())
    restarts = ray.get(progress.get_restarts.remote())
    ray.kill(progress)
    ps_report = None
    if shards is not None:
        ps_report = ps_summary(spec, shard_report(shards))
        stop_shards(shards)
    adaptive = None
    if controller is not None:
        ray.get(controller.stop.remote())
        adaptive = adaptive_summary(ray.get(controller.history.remote()))
        ray.kill(controller)
    if "error" in outcome:
        raise outcome["error"]
    if failure is not None:  # every rank stopped together (rayzip.train.loop)
        raise TrainingFailed(f"training stopped at step {failure['step']}: {failure['message']}")
    result = outcome["result"]
    summary = summarize(spec, result.metrics or {}, wall_s)
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    summary["history"] = history
    summary["metrics"] = dict(result.metrics or {})  # the last report, as the loop (yours too) wrote it
    summary["run_id"] = run_id
    summary["adaptive"] = adaptive
    summary["ps"] = ps_report
    # What the snapshots held on each node at the end, against snapshots.max_bytes_per_node.
    summary["snapshot_memory"] = kept or None
    # steps_run, restarts, steps_redone, resumes; replayed: of the redone steps whose loss rank 0
    # reported in both attempts, how many repeated it bit for bit (all, when a resume is exact)
    summary.update(restarts)
    return summary


def _fit_watching(trainer: TorchTrainer, progress, on_progress: Callable[[dict], None] | None):
    """``trainer.fit()`` on a thread of its own while this one hands ``on_progress`` the
    latest metrics: ({"result": ...} or {"error": ...}, the fit's wall seconds)."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    started = time.time()
    thread = threading.Thread(target=fit, name="rayzip-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)
        if on_progress is not None:
            latest = ray.get(progress.get.remote())
            if latest:
                on_progress(latest)
    return outcome, time.time() - started


def adaptive_summary(decisions: list[dict]) -> dict:
    """The controller's decisions, and how many came from each source (held: kept the last)."""
    sources: dict[str, int] = {}
    for d in decisions:
        sources[d["source"]] = sources.get(d["source"], 0) + 1
    return {"decisions": decisions, "sources": sources, "held": sources.get("held", 0),
            "final_compression": decisions[-1]["compression"] if decisions else None}


def ps_summary(spec: JobSpec, shards: list[dict]) -> dict:
    """The parameter shards at the end of a run: counters summed, and each shard's own."""
    keys = shards[0]["counters"] if shards else {}
    return {"shards": len(shards), "mode": spec.ps.mode, "pull": spec.ps.pull,
            "worker_groups": len(shards[0]["membership"]) if shards else 0,
            "totals": {k: sum(s["counters"][k] for s in shards) for k in keys},
            "per_shard": [{k: s[k] for k in ("index", "start", "stop", "step", "version", "pid", "counters",
                                             "membership")} for s in shards]}


def write_summary(summary: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
