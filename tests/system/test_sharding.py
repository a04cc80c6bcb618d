"""Sharded models under `rayzip run` on a local Ray (issue 47): the GPT with FSDP2 over two
"nodes" of two workers each (``sharding.shard_size: 2``), each shard's gradient averaged
between the nodes through group top-k with error feedback, and a killed worker resumed from
the last checkpoint exactly: every rank's shards of the model and AdamW written through
torch.distributed.checkpoint (rayzip's codec as its storage layer) in the background while
training goes on, and its residuals."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rayzip import checkpoint
from rayzip.runner import run_job
from rayzip.train.faults import Faults
from rayzip.spec import JobSpec

from two_nodes import two_node_ray


def _spec(name: str, compression: dict, **sections) -> JobSpec:
    return JobSpec.model_validate({**sections,
        "name": name,
        "model": {"name": "gpt", "layers": 2, "width": 64, "heads": 4, "context": 32},
        "dataset": {"name": "python-stdlib", "max_bytes": 200_000, "eval_windows": 16},
        "training": {"loop": "language_model", "steps": 20, "batch_size": 8, "optimizer": "adamw", "lr": 0.003,
                     "betas": [0.9, 0.95], "grad_clip_norm": 1.0, "eval_every": 10},
        "scaling": {"min_workers": 4, "max_workers": 4, "cpus_per_worker": 0.5, "max_failures": 2},
        "compression": compression,
        "sharding": {"enabled": True, "mode": "hsdp", "shard_size": 2},
        "checkpoint": {"every_steps": 5},  # in the background: the shards' host copies, DCP on its own group
    })


def _replica_held_bytes() -> dict:
    import torch

    from rayzip.train.gpt import GPT
    from rayzip.train.records import held_bytes

    model = GPT(vocab=256, layers=2, width=64, heads=4, context=32)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (2, 32))
    torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
    optimizer.step()
    return held_bytes(model, optimizer)


def _killer():
    """(what was killed, a progress callback that kills a worker 3 steps after a reported checkpoint, once)."""
    killed: dict = {}

    def kill_once(metrics: dict) -> None:
        reported = metrics.get("checkpoint_reported_step")
        if not killed and reported is not None and metrics["step"] >= reported + 3:
            killed.update(step=metrics["step"], reported=reported)
            os.kill(metrics["pid"], signal.SIGKILL)

    return killed, kill_once


@pytest.fixture(scope="module")
def resumed_from_storage(tmp_path_factory):
    """The HSDP job with a worker killed and no snapshots: resumed from the DCP checkpoint."""
    from conftest import _RAY

    _RAY.start()
    killed, kill_once = _killer()
    summary = run_job(_spec("hsdp-killed", {"codec": "group_topk", "density": 0.05}, snapshots={"enabled": False}),
                      storage_path=str(tmp_path_factory.mktemp("hsdp-storage")), on_progress=kill_once)
    return killed, summary


def test_hsdp_with_compressed_shards_between_nodes_resumes_a_killed_worker_exactly(local_ray, resumed_from_storage):
    killed, summary = resumed_from_storage
    assert killed and summary["restarts"] == 1, (killed, summary["resumes"])
    assert summary["steps"] == 20 and summary["world_size"] == 4
    shards = Path(summary["checkpoint"]) / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0", "__1", "__2", "__3"]
    trainer = checkpoint.load(Path(summary["checkpoint"]) / "trainer")
    assert trainer["model"] == {} and trainer["optimizer"] == {}  # nothing gathered to rank 0
    (resume,) = summary["resumes"]
    # From a checkpoint step, never older than the one reported before the kill (a write in
    # flight then may have been reported since).
    assert killed["reported"] + 1 <= resume["resumed_at"] <= killed["step"] + 1, (resume, killed)
    assert resume["resumed_at"] % 5 == 0, resume
    # Weights, AdamW's moments (each rank's DCP shards), each rank's residuals and the data
    # position came back: every redone step repeated rank 0's loss bit for bit.
    replayed = summary["replayed"]
    assert replayed["steps"] >= 1 and replayed["identical"] == replayed["steps"], replayed
    print(f"killed at step {killed['step']}, resumed at {resume['resumed_at']}, {replayed['steps']} steps replayed")
    # Group top-k at 5% between the nodes, against FSDP2's dense exchange of the same shards.
    assert summary["wire_reduction"] > 8 and summary["bytes_source"] == "counted", summary["wire_reduction"]
    # Shards of 2: each rank holds about half of what a DDP replica holds, both counted from
    # the tensors (a DDP replica: the same GPT with AdamW after one step, in this process).
    held, replica = summary["held_bytes"], _replica_held_bytes()
    assert sum(held.values()) <= 0.55 * sum(replica.values()), (held, replica)
    assert held["optimizer"] > 0 and held["gradients"] > 0, held
    print(f"rank 0 holds {sum(held.values()):,} bytes, a DDP replica {sum(replica.values()):,}: "
          f"{sum(held.values()) / sum(replica.values()):.3f}x")
    # It learns: byte-level uniform is 8 bits per byte.
    history = [h["val_loss"] for h in summary["history"]]
    assert max(history) < 6.5 and min(history) < history[0], history


def test_hsdp_resumes_a_killed_worker_from_memory_with_no_step_lost(local_ray, tmp_path, resumed_from_storage):
    """With snapshots (the default), each rank's slot holds its own shards of the model and
    AdamW and its residuals after every step: the restart copies them back on the same
    layout, at the step after the last one done, and the run ends where the run resumed
    from storage ends (that one is exact: every redone step repeated its loss)."""
    killed, kill_once = _killer()
    spec = _spec("hsdp-snapshots", {"codec": "group_topk", "density": 0.05}, snapshots={"enabled": True, "every": 1})
    summary = run_job(spec, storage_path=str(tmp_path), on_progress=kill_once)
    assert killed and summary["restarts"] == 1, (killed, summary["resumes"])
    (resume,) = summary["resumes"]
    assert resume["source"] == "memory" and resume["steps_lost"] == 0, resume
    assert resume["last_step"] + 1 <= resume["resumed_at"] <= resume["last_step"] + 2, resume
    assert summary["steps_redone"] == 0
    _, stored = resumed_from_storage
    assert summary["final_loss"] == stored["final_loss"] and summary["final_val_loss"] == stored["final_val_loss"]
    assert [h["val_loss"] for h in summary["history"]][-1] == [h["val_loss"] for h in stored["history"]][-1]
    (usage,) = summary["snapshot_memory"].values()  # one Ray node: one keeper
    assert usage["held_bytes"] > 0 and usage["refused"] == [], usage


def test_the_controller_turns_compression_off_between_shard_groups_on_a_fast_link(local_ray, tmp_path):
    """The adaptive controller on HSDP: the replicas' timed start-up sync is its first sample
    of the link, the shard exchanges' reports its steps. Between "nodes" on this machine's
    loopback, group top-k's encoding costs more than sending the shards dense: it turns
    compression off between the shard groups, and every rank adopts that at the same step."""
    spec = _spec("hsdp-adaptive", {"codec": "group_topk", "density": 0.01}, snapshots={"enabled": False},
                 adaptive={"enabled": True, "interval": 0.5, "window": 2.0, "min_compression": 4,
                           "max_compression": 200})
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 30})})
    summary = run_job(spec, storage_path=str(tmp_path))
    assert summary["steps"] == 30 and summary["world_size"] == 4
    decisions = summary["adaptive"]["decisions"]
    for d in decisions:
        print("DECISION", d["source"], round(d["compression"], 1), d.get("applied_step"),
              {k: v for k, v in d["inputs"].items() if k in ("probe", "link_probe", "link_separable",
                                                               "predicted_dense_s",
                                                               "predicted_step_s", "compute_s")})
    decided = [d for d in decisions if d["source"] in ("workers", "prometheus")]
    # The replicas' timed start-up sync reached the controller: the first decision came three
    # combined steps in (five without it), with the sync among the link fit's points.
    assert decided and all(d["inputs"]["link_probe"] for d in decided), decisions
    dense = [d for d in decided if d["compression"] == 1.0 and d.get("applied_step") is not None]
    assert dense, decisions
    # Applied: the steps from then on sent the shards dense (with the control word), so the
    # run's bytes between the nodes are far from group top-k's at 1%.
    assert summary["wire_reduction"] < 10, summary["wire_reduction"]
    history = [h["val_loss"] for h in summary["history"]]
    assert max(history) < 6.5, history


def test_local_steps_on_shards_resume_a_killed_worker_exactly(local_ray, tmp_path):
    """DiLoCo on FSDP2: each node trains 5 steps alone, then its pseudo-gradient shards cross
    between the nodes through group top-k; a worker killed inside a round resumes bit for bit
    from the snapshot of the round's start (each rank's shards with the outer momentum, its
    residuals), in memory."""
    spec = _spec("hsdp-local-killed", {"codec": "group_topk", "density": 0.05},
                 local_steps={"enabled": True, "every": 5})
    # Rank 0 kills itself after step 12, inside the round that synchronization 9 began.
    summary = run_job(spec, storage_path=str(tmp_path), faults=Faults(kill_after_steps=(12,)))
    assert summary["restarts"] == 1, summary["resumes"]
    assert summary["steps"] == 20 and summary["world_size"] == 4
    shards = Path(summary["checkpoint"]) / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0", "__1", "__2", "__3"]
    (resume,) = summary["resumes"]
    # Snapshots are taken at synchronizations only: the round's steps are redone, each
    # repeating rank 0's loss of the first attempt bit for bit.
    assert resume["resumed_at"] == 10 and resume["source"] == "memory", resume
    replayed = summary["replayed"]
    assert replayed["steps"] >= 1 and replayed["identical"] == replayed["steps"], replayed
    # Four synchronizations of group top-k at 5%, against dense HSDP's exchange every step.
    assert summary["wire_reduction"] > 5 * 8 and summary["bytes_source"] == "counted", summary["wire_reduction"]
    # It learns (byte-level uniform is 8 bits per byte); 20 steps in rounds of 5 are too few
    # for the two evaluations to be ordered.
    history = [h["val_loss"] for h in summary["history"]]
    assert max(history) < 6.5, history


def test_local_steps_on_shards_lose_a_node_and_go_on_with_half_the_workers(tmp_path):
    """An elastic run (2 to 4 workers) on a real two-node Ray: each node's two workers are a
    shard group. Removing the second node, 3 steps after a reported checkpoint, restarts the
    group on the first alone: DCP reshards the model, the inner optimizer (node 0's) and
    the outer momentum onto the 2 workers left, and training goes on to the end."""
    with two_node_ray() as (cluster, second):
        spec = _spec("hsdp-local-resize", {"codec": "group_topk", "density": 0.05},
                     local_steps={"enabled": True, "every": 5})
        spec = spec.model_copy(update={"scaling": spec.scaling.model_copy(update={"min_workers": 2,
                                                                                  "max_workers": 4})})
        removed: dict = {}

        def remove_node_once(metrics: dict) -> None:
            reported = metrics.get("checkpoint_reported_step")
            if not removed and reported is not None and metrics["step"] >= reported + 3:
                removed.update(step=metrics["step"], world=metrics["world_size"])
                cluster.remove_node(second)

        summary = run_job(spec, storage_path=str(tmp_path), on_progress=remove_node_once)
    assert removed["world"] == 4 and summary["world_size"] == 2, (removed, summary["world_size"])
    assert summary["restarts"] == 1 and summary["steps"] == 20, summary["resumes"]
    (resume,) = summary["resumes"]
    assert resume["resumed_at"] % 5 == 0 and resume["resumed_at"] <= removed["step"] + 1, resume
    history = [h["val_loss"] for h in summary["history"]]
    assert max(history) < 6.5, history
