"""Local steps (issue 23): the example job on a real local Ray, killed and resumed."""

from __future__ import annotations

import os
import signal


from rayzip.runner import run_job
from rayzip.spec import load_spec

from paths import ROOT


def _example(name: str, every_steps: int = 50):
    """jobs/digits-local.yaml for 150 steps whatever the accuracy, a checkpoint every
    ``every_steps``, and a worker group that may restart, from storage (no snapshots)."""
    spec = load_spec(ROOT / "jobs" / "digits-local.yaml")
    return spec.model_copy(update={
        "name": name,
        "training": spec.training.model_copy(update={"steps": 150, "stop_at_target": False}),
        "checkpoint": spec.checkpoint.model_copy(update={"every_steps": every_steps, "background": False}),
        "scaling": spec.scaling.model_copy(update={"max_failures": 2}),
        "snapshots": spec.snapshots.model_copy(update={"enabled": False})})


def test_the_example_job_trains_and_a_killed_worker_resumes_exactly(local_ray, tmp_path):
    killed: dict = {}

    def kill_once(metrics: dict) -> None:
        if not killed and metrics["step"] >= 70:
            killed.update(step=metrics["step"], reported=metrics["checkpoint_reported_step"])
            os.kill(metrics["pid"], signal.SIGKILL)  # rank 0's worker process, between synchronizations

    summary = run_job(_example("local-killed"), storage_path=str(tmp_path), on_progress=kill_once)
    assert killed and summary["restarts"] == 1, (killed, summary["resumes"])
    resumed = summary["metrics"]["resumed_from"]
    assert resumed % 50 == 0 and resumed <= killed["step"], (killed, resumed)
    # Inner optimizers, the outer optimizer, error feedback and the data position came back
    # bit-exactly: every redone step (a synchronization among them: one every 10) repeated
    # rank 0's loss of the first attempt, bit for bit.
    replayed = summary["replayed"]
    assert replayed["steps"] >= 12 and replayed["identical"] == replayed["steps"], replayed
    assert summary["steps"] == 150 and summary["world_size"] == 2
    assert summary["final_test_accuracy"] >= 0.93, summary["history"]
    # 15 synchronizations of group top-k at 5% against 150 fp32 allreduces.
    assert summary["wire_reduction"] > 150, summary
