"""In-memory snapshots under `rayzip run` on a real local Ray (issue 48): rank 0's worker
process is killed three times at random steps; every restart resumes from the node keeper's
snapshot of the last step done, so no step is done twice, and the final weights are the
uninterrupted run's bit for bit."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from rayzip import checkpoint
from rayzip.bench.chaos import killer
from rayzip.keeper import default_root
from rayzip.runner import run_job
from rayzip.train import Faults
from rayzip.spec import load_spec

from paths import ROOT
from two_nodes import two_node_ray

STEPS = 400


def _digits(name: str, snapshots: bool):
    """The default job (group top-k at 1% over the sparse ring), ``STEPS`` steps whatever
    the accuracy, a checkpoint every 100, and room for the restarts."""
    spec = load_spec(ROOT / "jobs" / "digits-group-topk.yaml")
    return spec.model_copy(update={
        "name": name,
        "training": spec.training.model_copy(update={"steps": STEPS, "eval_every": 100}),
        "scaling": spec.scaling.model_copy(update={"max_failures": 6}),
        "snapshots": spec.snapshots.model_copy(update={"enabled": snapshots, "every": 1})})


def _final_weights(summary: dict) -> dict:
    return checkpoint.load(os.path.join(summary["checkpoint"], "trainer"))["model"]


def _assert_bitwise_equal(mine: dict, theirs: dict) -> None:
    assert list(mine) == list(theirs)
    for name in mine:
        assert torch.equal(mine[name].view(torch.int32), theirs[name].view(torch.int32)), name


def test_three_killed_workers_lose_no_step_and_end_bitwise_equal(local_ray, tmp_path):
    plain = run_job(_digits("snap-plain", snapshots=False), storage_path=str(tmp_path / "plain"))
    assert plain["restarts"] == 0 and plain["steps"] == STEPS

    # Not near the end: the last step takes no snapshot (its checkpoint goes to storage), so a
    # kill there redoes it.
    kill, killed = killer(random.Random(48).sample(range(20, STEPS - 150), 3))

    summary = run_job(_digits("snap-killed", snapshots=True), storage_path=str(tmp_path / "killed"),
                      on_progress=kill)
    assert len(killed) == 3 and summary["restarts"] == 3, (killed, summary["resumes"])
    assert summary["steps"] == STEPS
    # Every restart resumed from memory, past the last step rank 0 reported: at the next one,
    # or one further when the kill fell between a step's committed snapshot and its report.
    for resume in summary["resumes"]:
        assert resume["source"] == "memory" and resume["steps_lost"] == 0, summary["resumes"]
        assert resume["last_step"] + 1 <= resume["resumed_at"] <= resume["last_step"] + 2 and resume["seconds"] > 0
        assert resume["cause"] == "worker_failure" and resume["nodes_lost"] == [], resume
    assert summary["steps_redone"] == 0
    # Weights, momentum, error feedback, velocities, RNG and the data position came back
    # exactly: the killed run ends where the uninterrupted run (no snapshots at all) ends.
    _assert_bitwise_equal(_final_weights(summary), _final_weights(plain))
    assert summary["final_test_accuracy"] == plain["final_test_accuracy"]
    assert summary["metrics"]["snapshot_every"] == 1 and summary["metrics"]["mean_snapshot_s"] > 0
    # What the node held at the end: rank 0's two slots and rank 1's, under the bound.
    (usage,) = summary["snapshot_memory"].values()
    assert 2 * summary["metrics"]["snapshot_bytes"] < usage["held_bytes"] <= usage["reserved_bytes"], usage
    assert usage["reserved_bytes"] <= usage["max_bytes"] and usage["refused"] == [], usage
    assert plain["snapshot_memory"] is None
    # The keepers removed the run's snapshots at its end.
    assert not (Path(default_root()) / "rayzip-snapshots" / summary["run_id"]).exists()


def _local(name: str, snapshots: bool, **checkpoint):
    """jobs/digits-local.yaml (local steps, H = 10, group top-k on the pseudo-gradients) for
    300 steps whatever the accuracy."""
    spec = load_spec(ROOT / "jobs" / "digits-local.yaml")
    return spec.model_copy(update={
        "name": name,
        "training": spec.training.model_copy(update={"steps": 300, "stop_at_target": False}),
        "scaling": spec.scaling.model_copy(update={"max_failures": 4}),
        "checkpoint": spec.checkpoint.model_copy(update=checkpoint),
        "snapshots": spec.snapshots.model_copy(update={"enabled": snapshots, "every": 1})})


def test_local_steps_killed_inside_a_round_lose_no_step_and_end_bitwise_equal(local_ray, tmp_path):
    """Local steps resume exactly both ways, and the two ways agree bit for bit.

    From storage (no snapshots): inner optimizers, the outer optimizer, error feedback and
    the data position come back from the checkpoint, and every redone step repeats rank 0's
    loss of the first attempt. From memory: between synchronizations each rank's snapshot
    holds its own parameters, its inner optimizer and the round's state (its start in a
    slot written once a round), so a kill inside a round or at its end loses nothing (H + 1
    slots: the rank left alive runs on to the round's end). Two independent restores that
    end on the same bits are each exact; the run resumed from storage stands in for the
    uninterrupted one (the three-kill test has that baseline for a run without local steps)."""
    # Rank 0 kills itself inside the round after the checkpoint at step 49.
    stored = run_job(_local("snap-local-storage", snapshots=False, every_steps=50, background=False),
                     storage_path=str(tmp_path / "storage"), faults=Faults(kill_after_steps=(72,)))
    assert stored["restarts"] == 1 and stored["metrics"]["resumed_from"] == 50, stored["resumes"]
    replayed = stored["replayed"]
    assert replayed["steps"] >= 12 and replayed["identical"] == replayed["steps"], replayed
    assert stored["steps"] == 300 and stored["world_size"] == 2
    assert stored["final_test_accuracy"] >= 0.93, stored["history"]
    # 30 synchronizations of group top-k at 5% against 300 fp32 allreduces.
    assert stored["wire_reduction"] > 150, stored["wire_reduction"]
    # Rank 0 kills itself after a step inside a round and after a round's last step (rounds
    # end at every 10th step): a kill from the driver lands where rank 0 spends its time,
    # which on a loaded machine is the synchronization between rounds.
    kills = (65, 139)
    summary = run_job(_local("snap-local-killed", snapshots=True), storage_path=str(tmp_path / "killed"),
                      faults=Faults(kill_after_steps=kills))
    assert summary["restarts"] == 2, summary["resumes"]
    # Each resumed at the step after its kill, inside its round.
    assert [r["resumed_at"] for r in summary["resumes"]] == [k + 1 for k in kills], summary["resumes"]
    for resume in summary["resumes"]:
        assert resume["source"] == "memory" and resume["steps_lost"] == 0, summary["resumes"]
    _assert_bitwise_equal(_final_weights(summary), _final_weights(stored))


def test_a_lost_node_resumes_from_the_surviving_keepers_snapshot(tmp_path):
    """A 2-worker run on a real two-node Ray, one worker per node, with local steps under
    SparseLoCo's ``combine: senders``. Removing the second node takes that node's worker and
    keeper with it, and a new node joins in its place: the restart resumes from the
    surviving keeper's snapshot of the last step (the weights, the round's start, the
    survivor's inner optimizer and data position), not from storage, and trains to the end.
    The lost rank's replacement takes its error feedback from the copy it sent to the
    surviving node's keeper after its last synchronization (``snapshots.copy_density``)."""
    with two_node_ray() as (cluster, second):
        spec = _local("snap-node-lost", snapshots=True)
        spec = spec.model_copy(update={
            "compression": spec.compression.model_copy(update={"combine": "senders", "error_decay": 0.95}),
            "scaling": spec.scaling.model_copy(update={"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1})})
        removed: dict = {}

        def remove_node_once(metrics: dict) -> None:
            if not removed and metrics["step"] >= 125:  # inside a round (H = 10)
                removed.update(step=metrics["step"], world=metrics["world_size"])
                cluster.remove_node(second)
                cluster.add_node(num_cpus=1)  # the replacement machine, its keeper empty

        summary = run_job(spec, storage_path=str(tmp_path), on_progress=remove_node_once)
    assert removed["world"] == 2 and summary["world_size"] == 2, (removed, summary["world_size"])
    assert summary["restarts"] == 1 and summary["steps"] == 300, summary["resumes"]
    (resume,) = summary["resumes"]
    # From memory, not from the checkpoint at step 99: at most the step in flight is redone.
    assert resume["source"] == "memory" and resume["steps_lost"] <= 1, resume
    assert resume["resumed_at"] > 100, resume
    assert resume["cause"] == "node_lost" and len(resume["nodes_lost"]) == 1, resume
    assert (resume["world_before"], resume["world_after"]) == (2, 2), resume
    # The lost rank (whichever rank the second node held) came back with its copy.
    assert len(summary["metrics"]["resumed_copies"]) == 1, summary["metrics"]
    assert summary["final_test_accuracy"] >= 0.9, summary["history"]


def _user_loop(name: str, snapshots: bool, snapshot_steps: list[int] | None = None):
    from rayzip.spec import JobSpec

    return JobSpec.model_validate({
        "name": name,
        "training": {"loop": "user_loops:digits_loop", "lr": 0.05,
                     "config": {"hidden": 64, "steps": 400, "checkpoint_every": 100, "snapshots": snapshots,
                                "await_checkpoints_from": 200, "slow_steps": [(110, 190, 0.02), (330, 400, 0.02)],
                                **({"snapshot_steps": snapshot_steps} if snapshot_steps else {})}},
        "scaling": {"min_workers": 2, "max_workers": 2, "max_failures": 3},
        "compression": {"codec": "group_topk", "density": 0.05, "momentum_correction": True},
        "snapshots": {"enabled": snapshots, "every": 1},
    })


def test_a_user_loop_snapshots_through_the_context_and_resumes_from_the_newer_copy(local_ray, tmp_path):
    """A spec-named user loop (``training.loop: module:function``) trains through the
    context and is killed twice. While it calls ``ctx.snapshot`` after each step,
    ``ctx.restore`` reads memory and loses no step; once it has stopped, and the checkpoint in
    storage is newer than its last snapshot, it reads storage. The run ends where the
    uninterrupted run ends, bit for bit."""
    plain = run_job(_user_loop("snap-user-plain", snapshots=False), storage_path=str(tmp_path / "plain"))
    # The user's report is the summary's last metrics; the context's model exchanged
    # compressed gradients (group top-k at 5%: over 10x fewer bytes than a dense ring).
    assert plain["final_test_accuracy"] >= 0.85, plain
    assert plain["steps"] == 400 and plain["world_size"] == 2
    last = plain["metrics"]
    assert last["compressed"] and last["dense_bytes"] / last["bytes_sent"] > 10, last
    assert checkpoint.verify(os.path.join(plain["checkpoint"], "rank1"))["tensors"] > 0  # rank 1's compression state
    # Snapshots after steps 0 to 189 only, checkpoints after 99, 199 and 299. The first kill,
    # at step 120 or a little later (wherever rank 0 is when the driver polls; steps 110 to
    # 189 and from 330 on are slowed so that a poll lands among them), resumes from memory at
    # the next step; the second, past step 330, from the checkpoint in storage, newer than the
    # snapshot of step 189 (from step 200 the loop waits for Ray Train to commit each
    # checkpoint it reports, which a kill would otherwise race).
    kill, killed = killer((120, 330))
    summary = run_job(_user_loop("snap-user-killed", snapshots=True, snapshot_steps=list(range(190))),
                      storage_path=str(tmp_path / "killed"), on_progress=kill)
    assert len(killed) == 2 and summary["restarts"] == 2, (killed, summary["resumes"])
    first, second = summary["resumes"]
    assert first["source"] == "memory" and first["steps_lost"] == 0 and first["resumed_at"] < 190, first
    assert second["source"] == "storage" and second["resumed_at"] in (200, 300), second
    _assert_bitwise_equal(_final_weights(summary), _final_weights(plain))


def test_local_steps_in_a_user_loop_resume_inside_a_round_from_memory_and_storage(local_ray, tmp_path):
    """``training.loop: module:function`` with ``local_steps``: ``ctx.prepare_model`` gives the
    loop local steps (rayzip.train.local), and its own ``optimizer.step()`` calls drive them.
    H = 3, so the checkpoints after steps 99 and 199 fall inside rounds. Rank 0 is killed
    twice: first while the loop snapshots (at step 120 or a little later), and the restart
    resumes from memory inside its round with no step lost; then past step 330, once the
    loop has stopped snapshotting after step 189, and the restart resumes from the
    checkpoint in storage (after step 199, inside its round, or after step 299): every
    redone step repeats rank 0's loss of the first attempt bit for bit (each rank's own
    parameters, inner optimizer, the round's start, error feedback and the outer optimizer
    came back). The checkpoints are written in the loop, not in the background, and from
    step 200 the loop waits for Ray Train to commit each, so that storage holds the one
    after step 299 when the second kill comes."""
    from rayzip.spec import JobSpec

    spec = JobSpec.model_validate({
        "name": "local-user-loop",
        "training": {"loop": "user_loops:digits_loop", "lr": 0.05,
                     "config": {"hidden": 64, "steps": 400, "checkpoint_every": 100, "snapshots": True,
                                "snapshot_steps": list(range(190)), "await_checkpoints_from": 200,
                                "slow_steps": [(110, 190, 0.02), (330, 400, 0.02)]}},
        "scaling": {"min_workers": 2, "max_workers": 2, "max_failures": 3},
        # SparseLoCo's outer updates, at 5% of this small MLP
        "compression": {"codec": "group_topk", "density": 0.05, "value_dtype": "2bit", "coded_indices": True,
                        "collective": "allgather", "error_decay": 0.95, "combine": "senders"},
        "local_steps": {"enabled": True, "every": 3, "outer_lr": 1.0, "outer_momentum": 0.0},
        "checkpoint": {"background": False},
        "snapshots": {"enabled": True, "every": 1},
    })
    kill, killed = killer((120, 330))
    summary = run_job(spec, storage_path=str(tmp_path), on_progress=kill)
    assert len(killed) == 2 and summary["restarts"] == 2, (killed, summary["resumes"])
    first, second = summary["resumes"]
    assert first["source"] == "memory" and first["steps_lost"] == 0 and first["resumed_at"] < 190, first
    assert second["source"] == "storage" and second["resumed_at"] in (200, 300), second
    replayed = summary["replayed"]
    assert replayed["steps"] >= 20 and replayed["identical"] == replayed["steps"], replayed
    last = summary["metrics"]
    assert summary["steps"] == 400 and last["world_size"] == 2
    assert summary["final_test_accuracy"] >= 0.85, summary["history"]
    # 134 synchronizations of 2-bit values at 5% against 400 fp32 allreduces.
    assert summary["wire_reduction"] > 100, summary["wire_reduction"]


def _snapshot_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("snapshot_loop", ROOT / "examples" / "snapshot_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_plain_torchtrainer_loop_resumes_from_memory_and_ends_bitwise_equal(local_ray, tmp_path):
    """examples/snapshot_loop.py: a user's own train_func under a plain TorchTrainer, the
    driver's `keep_snapshots(every=1)` around `fit()`, `rayzip.train.snapshot` after each step. Rank 0
    killed after step 130 (checkpoints at 99 and 199) resumes at 131 from memory, and the run
    ends where the same loop without keepers (its snapshot() a no-op) ends, bit for bit."""
    example = _snapshot_example()
    plain, kept = example.main(["--steps", "300", "--no-snapshots", "--name", "snap-plain-loop",
                                "--storage-path", str(tmp_path / "plain")])
    assert plain.metrics["started_at"] == 0 and kept is None
    killed, kept = example.main(["--steps", "300", "--kill-at-step", "130", "--every", "1", "--name", "snap-killed-loop",
                                 "--storage-path", str(tmp_path / "killed")])
    assert (tmp_path / "killed" / "killed-once").exists()
    assert killed.metrics["started_at"] == 131, killed.metrics  # not 100, the checkpoint's
    # The driver's record of it, as rayzip run's summary has it: one restart, from memory,
    # after step 130, with no step lost.
    assert kept.restarts == 1 and kept.steps_lost == 0, kept.resumes
    (resume,) = kept.resumes
    assert (resume["last_step"], resume["resumed_at"], resume["source"]) == (130, 131, "memory"), resume
    assert resume["cause"] == "worker_failure" and resume["seconds"] > 0, resume
    assert (resume["world_before"], resume["world_after"]) == (2, 2), resume
    _assert_bitwise_equal(*(checkpoint.load(os.path.join(r.checkpoint.path, "trainer"))["model"]
                            for r in (killed, plain)))
    assert killed.metrics["test_accuracy"] == plain.metrics["test_accuracy"] >= 0.9
    # The node's keeper held both ranks' slots, and nothing is left once the block ends.
    (usage,) = kept.memory.values()
    assert 0 < usage["held_bytes"] <= usage["reserved_bytes"] <= usage["max_bytes"] and usage["refused"] == []
    assert not (Path(default_root()) / "rayzip-snapshots" / "snap-killed-loop").exists()
