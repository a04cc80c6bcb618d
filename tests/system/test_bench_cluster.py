"""`rayzip bench cluster`: a real 2-node Ray cluster in network namespaces, at tiny scale (issue 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rayzip.bench.netns import ClusterError, _qdisc_available, leftover_namespaces, preflight

from own_processes import tagged_env, tagged_pids

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")


def _netem_here() -> bool:
    """The test's own probe: a netem qdisc on a veth pair in a namespace of its own."""
    name = f"rzt{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "a1"], check=True)
        return subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "a0", "root", "netem",
                               "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@needs_root
def test_latency_is_emulated_where_the_kernel_has_netem_and_refused_where_not():
    if _netem_here():
        assert _qdisc_available("netem")
        preflight("1ms")
    else:
        assert not _qdisc_available("netem")
        with pytest.raises(ClusterError, match="no netem qdisc"):
            preflight("1ms")
    preflight()  # without --latency, netem is not needed
    assert leftover_namespaces("rzprobe") == []  # the probes removed their namespaces


@needs_root
def test_an_interrupted_bench_stops_its_job_instead_of_waiting_for_it():
    """Ctrl-C (or SIGTERM, or a failing poll) while a job runs in the head's namespace kills
    the job, so that the cluster's teardown follows at once. A real process in a namespace
    of the test's own; only the cluster around it is left out."""
    import time
    from types import SimpleNamespace

    from rayzip.bench.netns import NetnsCluster

    name = f"rzi{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        head = SimpleNamespace(head_ns=name, address="", env=lambda **kw: dict(os.environ))
        started: list[int] = []

        def interrupt(result):
            started.append(1)
            if len(started) > 2:
                raise KeyboardInterrupt

        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            NetnsCluster.run_in_head(head, ["sleep", "60"], on_poll=interrupt, capture_output=True, text=True)
        assert time.monotonic() - began < 30  # waiting for the job would take its 60 s
        assert subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split() == []
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


LOSABLE = """\
name: tiny-node-loss
model: {name: mlp, hidden: [64]}
dataset: {name: digits}
training: {steps: 300, eval_every: 100, lr: 0.1}
scaling: {min_workers: 2, max_workers: 2}
compression: {codec: group_topk, density: 0.05, collective: allgather}
checkpoint: {every_steps: 0}
snapshots: {every: 1}
"""


@needs_root
def test_a_node_lost_whole_is_replaced_and_the_run_resumes_from_the_survivors_snapshot(tmp_path):
    """Three runs on a 2-node namespace cluster, and nothing left behind: the uninterrupted
    one, and two with --kill-node-at-step --lose-ranks 0, where the node that holds rank 0
    has its every process SIGKILLed (raylet, worker, keeper) and a new Ray node starts at its
    address. With --node-loss-from memory,storage every run checkpoints to storage every 50
    steps; the first lost run resumes from the surviving node's keeper with no step lost, the
    second (snapshots off) from the last checkpoint in storage. One test for all: each cluster
    costs a minute of CI."""
    spec = tmp_path / "losable.yaml"
    spec.write_text(LOSABLE)
    out = tmp_path / "bench.json"
    tag, env = tagged_env()
    bench = subprocess.Popen([sys.executable, "-m", "rayzip", "bench", "cluster", "--bandwidth", "1gbit",
                              "--nodes", "2", "--spec", str(spec), "--methods", "group_topk", "--repeat", "1",
                              "--kill-node-at-step", "100", "--lose-ranks", "0", "--node-loss-from",
                              "memory,storage", "--json", str(out),
                              "--plot", str(tmp_path / "bench.png")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = bench.communicate(timeout=1200)
    assert bench.returncode == 0, stdout[-4000:] + stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["bandwidth"] == "1gbit" and report["nodes"] == 2
    rows = {r["name"]: r for r in report["methods"]}
    assert set(rows) == {"group_topk", "group_topk, node lost (rank 0)", "group_topk, node lost (rank 0) from storage"}
    assert report["node_loss_from"] == ["memory", "storage"] and report["checkpoint_every_steps"] == 50
    for row in rows.values():
        assert row["wire_bytes_counted"] > 0 and row["wire_bytes_interface"] > 0  # the kernel saw gloo's traffic
        assert set(row) >= {"time_to_target_s", "final_accuracy", "step_s", "comm_s", "speedup_vs_dense"}
        assert row["wire_reduction"] > 5, row["wire_reduction"]  # group top-k at 5%, against a dense ring
    assert (tmp_path / "bench.png").stat().st_size > 0
    lost = rows["group_topk, node lost (rank 0)"]
    loss = lost["node_loss"]
    assert loss["rank"] == 0 and loss["node"] in (1, 2), loss  # found from rank 0's process, not the fallback
    assert loss["killed_at_step"] >= 100 and loss["processes_killed"] >= 2 and loss["replaced_after_s"] > 0, loss
    (resume,) = loss["resumes"]
    assert resume["cause"] == "node_lost" and resume["source"] == "memory", resume
    assert resume["steps_lost"] <= 1 and resume["resumed_at"] >= 100, resume
    assert (resume["world_before"], resume["world_after"]) == (2, 2), resume  # on the replacement node
    assert lost["steps"] == 300 and rows["group_topk"]["steps"] == 300
    assert lost["final_accuracy"] > 0.8 and lost["final_vs_uninterrupted"] is not None
    assert "| group_topk, node lost (rank 0) |" in stdout  # the node-loss table
    stored = rows["group_topk, node lost (rank 0) from storage"]
    (resume,) = stored["node_loss"]["resumes"]
    assert resume["cause"] == "node_lost" and resume["source"] == "storage", resume
    # Checkpoints every 50 steps: the resume redoes the steps since the last one before the loss.
    killed = stored["node_loss"]["killed_at_step"]
    assert resume["resumed_at"] % 50 == 0 and resume["resumed_at"] <= killed, (resume, killed)
    assert stored["steps"] == 300 and stored["final_accuracy"] > 0.8
    assert leftover_namespaces(f"rz{bench.pid}-") == []
    assert tagged_pids(tag) == set(), "the benchmark left processes behind"
