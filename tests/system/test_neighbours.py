"""A `rayzip run` (embedded Ray) beside another Ray on the same host (issue 48): the
neighbour is a `ray start --head` with its dashboard and token auth, in Ray's default
temporary folder, where it names itself the host's current cluster. Ray Train's own actors of
the embedded run must still find their own cluster (its placement-group cleaner asks the
State API whether the run's controller lives), and the run trains to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from own_processes import end_tagged, free_ports, tagged_env

BIN = Path(sys.executable).parent
TINY = """\
name: beside-a-neighbour
model: {name: mlp, hidden: [64]}
dataset: {name: digits}
training: {steps: 600, eval_every: 300}
scaling: {min_workers: 2, max_workers: 2, max_failures: 0}
compression: {codec: group_topk, density: 0.05}
checkpoint: {every_steps: 0}
"""


def test_an_embedded_run_beside_a_neighbour_ray_trains_to_the_end(tmp_path):
    tag, env = tagged_env()
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(32).hex()})
    env.pop("RAY_ADDRESS", None)
    current = Path("/tmp/ray/ray_current_cluster")  # where a default `ray start` names itself
    before = current.read_text() if current.exists() else None
    options = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "node-manager-port", "object-manager-port", "metrics-export-port",
               "runtime-env-agent-port")
    ports = dict(zip(options, free_ports(len(options))))
    start = subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus=1", "--disable-usage-stats",
                            *(f"--{option}={port}" for option, port in ports.items())],
                           env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        assert current.exists() and str(ports["port"]) in current.read_text()  # the neighbour is "current"
        spec = tmp_path / "tiny.yaml"
        spec.write_text(TINY)
        run_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        run = subprocess.run([sys.executable, "-m", "rayzip", "run", str(spec), "--storage-path",
                              str(tmp_path / "results"), "--summary-json", str(tmp_path / "summary.json"),
                              "--verbose"], env=run_env, capture_output=True, text=True, timeout=600)
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-4000:]
        assert (tmp_path / "summary.json").exists()
        # Ray Train's cleaner found its own controller: it neither failed to ask nor saw it dead.
        assert "Failed to query Ray Train Controller actor state" not in output, output[-4000:]
        assert "Found multiple active Ray instances" not in output, output[-4000:]
        assert "Cleaning up placement group" not in output, output[-4000:]
    finally:
        end_tagged(tag, grace_s=2.0)
        if before is None:
            current.unlink(missing_ok=True)
        else:
            current.write_text(before)
