"""The language-model task under `rayzip run` on a local Ray (issue 17): a GPT on the
standard library's source trains, and a killed worker resumes the data stream, the weights
and the compression state exactly, from the last complete checkpoint when it dies while the
next one is being written in the background (issue 21), under bf16 autocast; a spec-named user loop on a sharded
model resumes from its DCP shards (issue 47). A spec-named user loop on a replicated model is
tests/system/test_snapshots.py's."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rayzip.bench.chaos import killer
from rayzip.runner import run_job
from rayzip.train.faults import Faults
from rayzip.spec import JobSpec


SLOW_WRITE_S = 4


def _lm_spec(name: str) -> JobSpec:
    return JobSpec.model_validate({
        "name": name,
        "model": {"name": "gpt", "layers": 2, "width": 64, "heads": 4, "context": 32},
        "dataset": {"name": "python-stdlib", "max_bytes": 400_000, "eval_windows": 32},
        "training": {"loop": "language_model", "steps": 60, "batch_size": 8, "optimizer": "adamw", "lr": 0.003,
                     "betas": [0.9, 0.95], "lr_schedule": "cosine", "lr_warmup_steps": 5, "grad_clip_norm": 1.0,
                     "eval_every": 20, "target_val_loss": 5.5, "stop_at_target": False,
                     "mixed_precision": "bf16"},  # the replay below is then bit-exact under autocast too
        "scaling": {"min_workers": 2, "max_workers": 2, "max_failures": 2},
        "compression": {"codec": "group_topk", "density": 0.05},
        "checkpoint": {"every_steps": 20, "num_to_keep": 2},
        "snapshots": {"enabled": False},  # the resume from storage, with a write in flight
    })


def test_a_killed_language_model_worker_resumes_data_weights_and_residuals_exactly(local_ray, tmp_path):
    # Kill rank 0 while a background checkpoint write is in flight (every write here first
    # sleeps SLOW_WRITE_S), once the checkpoint before it was handed to Ray Train and its
    # controller (which polls the workers every 0.5 s here: tests/conftest.py) has had time
    # to take it. The next write begins only after the last one ended, so the kill comes at
    # most one of the driver's 0.5 s polls into a write.
    killed: dict = {}
    handed_at: dict = {}

    def kill_during_a_write(metrics: dict) -> None:
        handed = metrics.get("checkpoint_uploading_step")
        handed = metrics.get("checkpoint_reported_step") if handed is None else handed
        pending = metrics.get("checkpoint_pending_step")
        if killed or handed is None or pending is None or pending <= handed:
            return
        if time.time() - handed_at.setdefault(handed, time.time()) >= 2.0:
            killed.update(step=metrics["step"], reported=handed, pending=pending)
            os.kill(metrics["pid"], signal.SIGKILL)

    summary = run_job(_lm_spec("lm-killed"), storage_path=str(tmp_path), on_progress=kill_during_a_write,
                      faults=Faults(checkpoint_write_delay_s=SLOW_WRITE_S))
    assert killed and summary["restarts"] == 1, (killed, summary["resumes"])
    assert summary["metric"] == "val_loss" and summary["steps"] == 60 and summary["world_size"] == 2
    # It resumed from the last complete checkpoint, not from the one being written.
    assert summary["metrics"]["resumed_from"] == killed["reported"] + 1, (killed, summary["metrics"])
    # The data stream position, weights, AdamW moments, residuals and RNG came back
    # bit-exactly: every redone step repeated rank 0's loss of the first attempt, bit for bit.
    replayed = summary["replayed"]
    assert replayed["steps"] >= 2 and replayed["identical"] == replayed["steps"], replayed
    # The loop waited on checkpoints only for snapshots and for the slowed writes.
    assert summary["metrics"]["checkpoint_stall_s"] > 0
    # The checkpoints Ray kept are rayzip's compressed format, and verify.
    from rayzip import checkpoint

    assert checkpoint.verify(os.path.join(summary["checkpoint"], "trainer"))["tensors"] > 0
    # It learns: byte-level uniform is 8 bits/byte; 5.5 is well on the way down from it.
    history = [h["val_loss"] for h in summary["history"]]
    assert history[0] < 6.5 and history[-1] < history[0], history
    assert summary["reached_target"], history
    assert summary["wire_reduction"] > 5 and summary["bytes_source"] == "counted"


@pytest.mark.parametrize("snapshots", [False, True], ids=["storage", "memory"])
def test_a_user_loop_on_a_sharded_model_resumes_a_killed_worker_exactly(local_ray, tmp_path, snapshots):
    """``rayzip.train.prepare_model(sharding=...)`` through the context: FSDP2 shard groups of
    one worker, each gradient shard averaged between them by group top-k with error feedback;
    ``report`` writes each rank's shards through DCP, ``restore`` reads them back after a
    worker is killed, with each rank's residuals. With ``ctx.snapshot`` after each step,
    ``restore`` reads each rank's own shards from memory instead, and no step is lost."""
    spec = JobSpec.model_validate({
        "name": "sharded-user-loop",
        "training": {"loop": "user_loops:digits_loop", "lr": 0.05,
                     # Steps 110 to 189 are slowed so that the driver's twice-a-second poll lands
                     # among them on any machine; the loop waits for Ray Train to commit each
                     # checkpoint it reports, which a kill would otherwise race.
                     "config": {"hidden": 64, "steps": 300, "checkpoint_every": 100, "snapshots": snapshots,
                                "await_checkpoints_from": 0, "slow_steps": [(110, 190, 0.02)]}},
        "scaling": {"min_workers": 2, "max_workers": 2, "max_failures": 1},
        "compression": {"codec": "group_topk", "density": 0.05, "momentum_correction": True},
        "sharding": {"enabled": True, "mode": "hsdp", "shard_size": 1},
        "checkpoint": {"background": False},
        "snapshots": {"every": 1},  # taken where the loop calls ctx.snapshot
    })
    # Kill rank 0's worker at step 120 or a little later: after the checkpoint of step 99 is
    # committed, before the one of step 199 is reported.
    kill_once, kills = killer((120,))

    summary = run_job(spec, storage_path=str(tmp_path), on_progress=kill_once)
    assert len(kills) == 1 and summary["restarts"] == 1, (kills, summary["resumes"])
    ((killed_at, _pid),) = kills
    assert summary["steps"] == 300
    (resume,) = summary["resumes"]
    replayed = summary["replayed"]
    if snapshots:
        assert resume["source"] == "memory" and resume["steps_lost"] == 0, resume
        assert resume["resumed_at"] > killed_at - 2, (resume, kills)
    else:
        assert resume["source"] == "storage" and resume["resumed_at"] == 100, (resume, kills)
        # The shards of the model and of SGD's state, and each rank's residuals and momentum,
        # came back: the redone steps repeated rank 0's loss of the first attempt bit for bit.
        assert replayed["steps"] >= 1 and replayed["identical"] == replayed["steps"], replayed
    print(f"killed at step {killed_at}, resumed at {resume['resumed_at']}, {replayed['steps']} steps replayed")
    last = summary["metrics"]
    assert last["compressed"] and last["dense_bytes"] / last["bytes_sent"] > 10, last
    assert summary["final_test_accuracy"] >= 0.8, summary
    assert (Path(summary["checkpoint"]) / "shards" / ".metadata").exists()


def test_local_steps_with_muon_inside_resume_a_killed_worker_exactly(local_ray, tmp_path):
    """``training.optimizer: muon`` as the inner optimizer of local steps with SparseLoCo's
    outer updates (issue 46): rank 0 is killed inside a round; the restart from storage
    brings back Muon's momentum and AdamW's moments with the rest, and every redone step
    repeats its loss bit for bit."""
    base = _lm_spec("lm-muon").model_dump()
    spec = JobSpec.model_validate({
        **base,
        "training": {**base["training"], "optimizer": "muon", "steps": 40},
        "compression": {"codec": "group_topk", "density": 0.01, "value_dtype": "2bit", "coded_indices": True,
                        "collective": "allgather", "error_decay": 0.95, "combine": "senders"},
        "local_steps": {"enabled": True, "every": 4, "outer_lr": 1.0, "outer_momentum": 0.0},
        "checkpoint": {"every_steps": 20, "background": False},
    })
    summary = run_job(spec, storage_path=str(tmp_path), faults=Faults(kill_after_steps=(29,)))
    assert summary["restarts"] == 1 and summary["steps"] == 40, summary["resumes"]
    (resume,) = summary["resumes"]
    assert resume["source"] == "storage" and resume["resumed_at"] == 20, resume
    replayed = summary["replayed"]
    assert replayed["steps"] >= 9 and replayed["identical"] == replayed["steps"], replayed
    history = [h["val_loss"] for h in summary["history"]]
    assert history[-1] < history[0] < 8.5, history
    assert summary["wire_reduction"] > 500, summary["wire_reduction"]
