"""The adaptive controller (issue 6): its actor's robustness, and a real 2-worker run
scraped by a real Prometheus (Debian package `prometheus`), with the link slowed mid-run
and Prometheus killed later."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import time

import pytest
import ray
import requests
import yaml

from rayzip.adaptive import AdaptiveController
from rayzip.metrics import prometheus_config
from rayzip.runner import run_job
from rayzip.spec import AdaptiveSpec, JobSpec
from rayzip.train.faults import Faults

from links import FileLink
from own_processes import free_port
from paths import ROOT

PROMETHEUS = shutil.which("prometheus")



# --- a real run -------------------------------------------------------------------------------

DASHBOARD = ROOT / "dashboards" / "rayzip.json"


def evaluate_dashboard(url: str, job: str) -> dict[str, list]:
    """{panel title: [(expr, result rows)]} for every target of the Grafana dashboard, with its
    variables as Grafana would fill them: the job's run, all ranks, a rate interval of 8 s
    (four scrapes), a time range of an hour."""
    rows = requests.get(f"{url}/api/v1/query", params={"query": f'ray_rayzip_step{{job="{job}"}}'},
                        timeout=5).json()["data"]["result"]
    run = rows[0]["metric"]["run"] if rows else "none"
    out = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        results = []
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", "8s").replace("$__range", "1h").replace("$run", run)
                    .replace("$rank", ".*"))
            answer = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=5).json()
            results.append((expr, answer["data"]["result"] if answer.get("status") == "success" else []))
        out[panel["title"]] = results
    return out


@pytest.fixture
def ray_with_fast_metrics(local_ray, tmp_path):
    """The shared Ray (it reports metrics every second) and the file the emulated link reads."""
    link = tmp_path / "rate"
    link.write_text("0")
    return link


@pytest.fixture
def prometheus(tmp_path):
    if PROMETHEUS is None:
        pytest.fail("the prometheus binary is missing: .ci/run installs the Debian package `prometheus`")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    # Ray's head keeps this file up to date in its temp dir (/tmp/ray by default).
    sd = os.path.join(ray._private.worker._global_node.get_temp_dir_path(), "prom_metrics_service_discovery.json")
    config.write_text(yaml.safe_dump(prometheus_config("1s", sd)))
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if requests.get(f"{url}/-/ready", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
    yield url, proc
    proc.kill()
    proc.wait()


def test_controller_holds_its_compression_when_prometheus_is_unreachable(ray_with_fast_metrics):
    spec = AdaptiveSpec(enabled=True, prometheus_url=f"http://127.0.0.1:{free_port()}", interval=0.2,
                        query_timeout=0.5)
    spec.window = 0.1
    controller = AdaptiveController.remote("hold-test", "hold", spec.model_dump(), 50.0)
    # Fewer steps than the cost model's early decision (from the workers' reports) needs:
    # every decision here asks Prometheus.
    for step in range(2):
        controller.report.remote(0, step, 2.0, 0.1, 0.05, 0.04, 1000, 100_000)
    deadline = time.time() + 20
    while time.time() < deadline and not any(d["source"] == "held" for d in ray.get(controller.history.remote())):
        time.sleep(0.1)
    time.sleep(1.5)  # a few more attempts, spaced by the backoff
    ray.get(controller.stop.remote())
    history = ray.get(controller.history.remote())
    held = [d for d in history if d["source"] == "held"]
    assert held and all(d["compression"] == 50.0 for d in history), history
    assert "ConnectionError" in held[0]["inputs"]["reason"]
    # Backoff: 0.2, 0.4, 0.8 s between attempts, not one every 0.2 s.
    assert len(held) <= 5, [d["at"] for d in held]
    ray.kill(controller)


def test_the_first_decision_comes_three_steps_after_the_start_up_transfer(ray_with_fast_metrics):
    # The ranks' start-up broadcast (rayzip.train.probe) put a dense exchange at 16 ms, against
    # 100x steps whose codec takes 43 ms: three steps in, the controller measures dense. Rank 1
    # reports each step first: the controller waits for rank 0's report of it (world 2)
    # rather than combine rank 1's alone and hold back every later step.
    spec = AdaptiveSpec(enabled=True, interval=30.0, window=60.0, min_compression=4, max_compression=200)
    controller = AdaptiveController.remote("early-test", "early", spec.model_dump(), 100.0)
    for rank in (1, 0):
        controller.report_link.remote(rank, 17.4e6, 0.014, 1.0)
    for step in range(3):
        for rank in (1, 0):
            controller.report.remote(rank, step, 2.0, 0.09, 0.045, 0.002, 200_000, 17_400_000, busy_s=0.045,
                                     messages=12, density=0.01, world=2)
    deadline = time.time() + 10
    while time.time() < deadline and len(ray.get(controller.history.remote())) < 2:
        time.sleep(0.05)
    history = ray.get(controller.history.remote())
    ray.get(controller.stop.remote())
    ray.kill(controller)
    assert len(history) >= 2, history
    first = history[1]
    assert first["compression"] == 1.0 and first["inputs"]["probe"] and first["inputs"]["link_separable"], first


def test_the_start_decision_comes_from_the_dry_step_before_any_step(ray_with_fast_metrics):
    # Every rank's dry compressed exchange (step -1: rayzip.train.Telemetry.start) and its
    # start-up broadcast, on a link where dense is fast: the run starts with a dense probe.
    spec = AdaptiveSpec(enabled=True, interval=30.0, window=60.0, min_compression=4, max_compression=200)
    controller = AdaptiveController.remote("start-test", "start", spec.model_dump(), 100.0)
    assert ray.get(controller.start.remote()) is None  # nothing measured yet
    for rank in (1, 0):
        controller.report_link.remote(rank, 17.4e6, 0.014, 1.0)
        controller.report.remote(rank, -1, float("nan"), 0.095, 0.05, 0.002, 200_000, 17_400_000, busy_s=0.05,
                                 messages=12, density=0.01, world=2)
    answer, deadline = None, time.time() + 10
    while answer is None and time.time() < deadline:
        answer = ray.get(controller.start.remote())
    history = ray.get(controller.history.remote())
    ray.get(controller.stop.remote())
    ray.kill(controller)
    assert answer == {"seq": 1, "compression": 1.0}, history
    assert history[-1]["source"] == "start" and history[-1]["inputs"]["probe"], history[-1]


def test_time_to_target_learns_what_a_compressed_step_is_worth_from_the_ranks_losses(ray_with_fast_metrics):
    # Two ranks on a 100 Mbit/s link report steps whose loss follows a known curve in dense
    # steps, where a step at compression r does r ** -0.6 of a dense one; every 10 steps rank 0
    # adopts the controller's newest decision, as rayzip.train does. The controller must vary
    # the compression to learn that, and its posterior must find it.
    gamma, rng = 0.6, random.Random(0)
    spec = AdaptiveSpec(enabled=True, policy="time_to_target", interval=0.2, window=60.0, min_compression=4,
                        max_compression=200)
    controller = AdaptiveController.remote("ttt-test", "ttt", spec.model_dump(), 100.0)
    for rank in (1, 0):
        controller.report_link.remote(rank, 17.4e6, 1.4, 1.0)
    compression, tau, decided = 100.0, 0.0, 1
    for step in range(400):
        density = None if compression <= 1.0 else 1.0 / compression
        network_s = 1.4 * (density or 1.0)
        codec_s = 0.0 if density is None else 0.03 + 0.6 * density
        for rank in (1, 0):
            loss = (0.3 + 2.0 / (1.0 + tau / 40.0)) * math.exp(rng.gauss(0.0, 0.05))
            controller.report.remote(rank, step, loss, 0.05 + network_s + codec_s, network_s + codec_s, network_s,
                                     int(17.4e6 * (density or 1.0)), 17_400_000, busy_s=network_s + codec_s,
                                     messages=2, density=density, world=2)
        tau += compression ** -gamma
        if step % 10 == 9:  # the next block runs under a decision taken after this one's steps
            deadline = time.time() + 10
            while len(history := ray.get(controller.history.remote())) <= decided and time.time() < deadline:
                time.sleep(0.02)
            decided = len(history)
            compression = ray.get(controller.decision.remote())["compression"]
    history = ray.get(controller.history.remote())
    ray.get(controller.stop.remote())
    ray.kill(controller)
    fitted = [d["inputs"] for d in history if d["inputs"].get("gamma_varied")]
    assert fitted, history[-3:]
    assert any(d["inputs"].get("explore") for d in history), "it never explored"
    last = fitted[-1]
    assert last["gamma_sd"] < 0.15 and abs(last["gamma"] - gamma) < 3 * last["gamma_sd"], last
    # What it learned moved it: a step at 200x is worth 0.04 of a dense one, and the link
    # makes dense 11x dearer than 200x; the least time per dense step lies in between.
    assert 4 <= compression <= 60, [round(d["compression"]) for d in history[-10:]]


def test_adaptive_run_follows_prometheus_through_a_link_slowdown_and_a_prometheus_outage(
        ray_with_fast_metrics, prometheus, tmp_path):
    link = ray_with_fast_metrics
    url, prom = prometheus
    spec = JobSpec.model_validate({
        "name": "adaptive-integration",
        "model": {"name": "mlp", "hidden": [256, 256]},
        "dataset": {"name": "digits"},
        "training": {"steps": 450, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "eval_every": 100},
        "scaling": {"min_workers": 2, "max_workers": 2},
        "compression": {"codec": "group_topk", "density": 0.01, "collective": "ring", "momentum_correction": True},
        "checkpoint": {"every_steps": 100},
        "adaptive": {"enabled": True, "prometheus_url": url, "interval": 1.0, "window": 4.0,
                     "min_compression": 4, "max_compression": 400, "importance_weight": 0.0, "query_timeout": 1.0,
                     # Before the slowdown, the least compression within 25% of the fastest: a busy
                     # loopback can look slow enough for the default 3% to sit at max_compression.
                     "slack": 0.25},
    })
    events: dict = {}

    def on_progress(m: dict) -> None:
        if m.get("checkpoint_uploading_step") is not None and "checkpointed_at" not in events:
            # rank 0 sets the checkpoint gauges when a background write is complete, not when
            # the checkpoint is taken: the dashboard's checkpoint panels have data from here on
            events["checkpointed_at"] = time.time()
        if "density" not in m:
            return
        if "slowed" in events and "slow_from" not in events and m["step"] > events["slowed"] \
                and m.get("comm_s", 0.0) >= 0.85:
            # The driver sees the latest step every 0.5 s, so the workers may be steps past
            # "slowed" when the file changes: the slowdown counts from the first step whose
            # wire time shows it (half of a dense step's 1.7 s at 200 kB/s).
            events["slow_from"] = m["step"]
        kept = m["density"] or 1.0  # the kept fraction; None: dense
        if "decided" not in events and kept != 0.01:
            events["decided"] = m["step"]  # the controller's first decision is in force
        elif "decided" in events and "slowed" not in events and m["step"] >= events["decided"] + 40 \
                and kept == 1.0:  # dense, as a fast link should be: room to raise
            link.write_text("200000")  # 200 kB/s: a dense step would take 1.7 s on the wire
            events["slowed"], events["fraction_before"] = m["step"], kept
        elif "slowed" in events and "raised" not in events and kept < events["fraction_before"] / 2:
            events["raised"], events["raised_at"] = m["step"], time.time()  # the controller raised compression
        elif "raised" in events and "killed" not in events and m["step"] >= 110 \
                and time.time() - max(events["raised_at"], events.get("checkpointed_at", float("inf"))) >= 2.5:
            # past the first checkpoint's completed write, and scraped since (metrics every 1 s,
            # scrapes every 1 s)
            events["panels"] = evaluate_dashboard(url, spec.name)  # issue 8: every panel has data
            events["killed_at"] = time.time()
            prom.kill()
            events["killed"] = m["step"]
            link.write_text("0")  # the rest of the run at full speed, to keep the test short

    summary = run_job(spec, storage_path=str(tmp_path), on_progress=on_progress, faults=Faults(FileLink(link)))
    decisions = summary["adaptive"]["decisions"]
    print("EVENTS", {k: v for k, v in events.items() if not k.endswith("_at") and k != "panels"},
          summary["wall_s"], summary["train_s"])
    for d in decisions:
        print("DECISION", d["source"], round(d["compression"], 1), d.get("applied_step"),
              {k: (round(v, 9) if isinstance(v, float) else v) for k, v in d["inputs"].items()
               if k in ("delay_per_byte", "compute_s", "pressure", "beta_s_per_byte", "predicted_dense_s",
                       "predicted_step_s", "probe")})
    assert summary["steps"] == 450, "training finished despite the outage"
    assert "slowed" in events and "raised" in events and "killed" in events, (events, decisions)

    # Every query of every panel of the shipped Grafana dashboard returned data.
    empty = {title: expr for title, results in events["panels"].items() for expr, rows in results if not rows}
    assert not empty, empty

    # Decisions came from Prometheus' answers: each records what the queries returned.
    from_prometheus = [d for d in decisions if d["source"] == "prometheus"]
    assert from_prometheus, decisions
    for d in from_prometheus:
        assert set(d["inputs"]["delay_per_byte_by_rank"]) == {"0", "1"}, d
        assert set(d["inputs"]["collective_delay_p50_s_by_rank"]) == {"0", "1"}, d
        assert d["inputs"]["delay_per_byte"] == max(d["inputs"]["delay_per_byte_by_rank"].values())

    # The compression rose within 20 steps of the slowdown.
    assert "slow_from" in events, events
    applied = [d for d in decisions if d.get("applied_step") is not None]
    before = [d for d in applied if d["applied_step"] <= events["slow_from"]]
    after = [d for d in applied if d["applied_step"] > events["slow_from"]]
    assert before and after, applied
    rise = next(d for d in after if d["compression"] > before[-1]["compression"])
    assert rise["applied_step"] - events["slow_from"] <= 20, (events, rise, before[-1])
    assert rise["inputs"]["pressure"] > 1

    # With Prometheus gone the controller held its compression, and said so. (A hold before the kill,
    # while Prometheus had not scraped every rank yet, held the compression of its own time.)
    held = [d for d in decisions if d["source"] == "held"]
    assert summary["adaptive"]["held"] == len(held)
    held_after_kill = [d for d in held if d["at"] >= events["killed_at"]]
    last_decided = [d for d in decisions if d["source"] == "prometheus"][-1]
    assert held_after_kill, held
    assert all(d["compression"] == last_decided["compression"] for d in held_after_kill)
    assert summary["adaptive"]["final_compression"] == last_decided["compression"]
