"""`rayzip submit` and `ray job submit` against a real `ray start --head` with token auth (issue 3)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from own_processes import end_tagged, free_ports, tagged_env


BIN = Path(sys.executable).parent
TINY = """\
name: tiny-submit
model: {name: mlp, hidden: [32]}
dataset: {name: %s}
training: {steps: 20, eval_every: 10}
scaling: {min_workers: 2, max_workers: 2, max_failures: 0}  # a failure fails the job: a retry would fail alike
compression: {codec: group_topk, density: 0.05}
checkpoint: {every_steps: 0}
"""
FAILING_DATASET = '''\
def load(**kwargs):
    raise RuntimeError("dataset storage is unreachable")
'''



@pytest.fixture(scope="module")
def cluster():
    """A head of our own: its own ports and temporary directory, and its processes tagged, so
    that the end stops exactly them (``ray stop`` would stop every Ray of the user's)."""
    token = secrets.token_hex(32)
    tag, env = tagged_env()
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})  # the cluster's Python has rayzip
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="rz-submit-", dir="/tmp")  # short: Ray's socket paths must fit
    options = ("port", "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
               "node-manager-port", "object-manager-port", "metrics-export-port", "runtime-env-agent-port")
    dashboard, *chosen = free_ports(len(options) + 1)
    ports = dict(zip(options, chosen))
    start = subprocess.run([str(BIN / "ray"), "start", "--head", f"--dashboard-port={dashboard}", "--num-cpus=2",
                            "--disable-usage-stats", f"--temp-dir={temp}",
                            *(f"--{option}={port}" for option, port in ports.items())],
                           env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        end_tagged(tag, grace_s=2.0)  # what SIGTERM has not ended by then is killed
        shutil.rmtree(temp, ignore_errors=True)


def _rayzip(args, env, cwd=None):
    return subprocess.run([sys.executable, "-m", "rayzip", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_submit_succeeds_and_exits_0(cluster, tmp_path):
    address, env = cluster
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY % "digits")
    result = _rayzip(["submit", str(spec), "--address", address], env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SUCCEEDED" in result.stdout and "final test accuracy" in result.stdout
    # A quiet console: Ray Train's per-report lines stay in Ray's log folder, which is named.
    assert "Reporting training result" not in result.stdout and "Ray's and the workers' logs: " in result.stdout
    # The submission id is deterministic: the same spec attaches to the finished job, and
    # prints its logs whole.
    again = _rayzip(["submit", str(spec), "--address", address], env)
    assert again.returncode == 0 and "was submitted before (SUCCEEDED)" in again.stdout
    assert "final test accuracy" in again.stdout and "SUCCEEDED" in again.stdout


def test_failed_job_gives_a_nonzero_exit(cluster, tmp_path):
    address, env = cluster
    code = tmp_path / "code"
    code.mkdir()
    (code / "failing_data.py").write_text(FAILING_DATASET)
    spec = tmp_path / "failing.yaml"
    spec.write_text(TINY % "failing_data:load")
    result = _rayzip(["submit", str(spec), "--address", address, "--working-dir", str(code)], env)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "FAILED" in result.stdout and "dataset storage is unreachable" in result.stdout


def test_submit_without_the_token_is_refused(cluster, tmp_path):
    address, env = cluster
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY % "digits")
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    no_token["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "absent")
    result = _rayzip(["submit", str(spec), "--address", address, "--no-wait"], no_token)
    assert result.returncode == 1 and "AuthenticationError" in result.stdout


def test_plain_ray_job_submit_runs_rayzip(cluster, tmp_path):
    """`ray job submit` typed by hand: the job finds the `rayzip` command and the spec in the
    uploaded working directory. (`rayzip submit`, above, runs `python -m rayzip run` as a Ray
    Job and trains; here the job validates the spec, which costs no second training run.)"""
    address, env = cluster
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "tiny.yaml").write_text(TINY % "digits")
    result = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
                             "--", "rayzip", "validate", "jobs/tiny.yaml"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "succeeded" in out.lower() and "ok: tiny-submit: codec group_topk" in out, out[-3000:]
