"""``rayzip bench cluster``: time-to-accuracy of each method on an emulated slow network.

The same job (seed, model, per-worker shard, target) runs once per method on one real Ray
cluster whose worker nodes sit in network namespaces behind tc-shaped links (see
:mod:`.netns`). Baselines run in the same invocation: plain DDP allreduce (no hook), torch's
PowerSGD hook and torch's fp16 hook. For each method it records the time to the target
accuracy, the final accuracy, the mean step time split into compute and communication, the
bytes each worker sent as counted by rayzip (or at the torch.distributed call, for torch's
hooks; by the ring formula for plain DDP), and the bytes the kernel saw leave each worker's
interface during training.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from ..codecs import CODECS
from ..spec import TrainingSpec
from .netns import NetnsCluster

__all__ = ["METHODS", "method_compression", "run_cluster_bench"]

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "jobs" / "bench-synthetic.yaml"

METHODS: dict[str, dict[str, Any]] = {
    "dense": {"codec": "none"},
    "fp16": {"codec": "none", "torch_hook": "fp16"},
    "powersgd": {"codec": "none", "torch_hook": "powersgd", "powersgd_rank": 2},
    "group_topk": {"codec": "group_topk", "ratio": 0.01, "collective": "ring"},
    "dct_quant": {"codec": "dct_quant", "bits": 8, "collective": "allgather"},
    "topk": {"codec": "topk", "ratio": 0.01, "collective": "ring"},
    "qsgd": {"codec": "qsgd", "collective": "allgather"},
}


def method_compression(method: str, powersgd_start_iter: int, training: dict | None = None) -> dict[str, Any]:
    """The spec's compression section for ``method``. Sparse methods move SGD momentum into
    the hook (momentum correction) when the job's optimizer has momentum to move."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    compression = dict(METHODS[method])
    if method == "powersgd":
        compression["powersgd_start_iter"] = powersgd_start_iter
    training = TrainingSpec.model_validate(training or {})
    if CODECS[compression["codec"]].sparse and training.optimizer == "sgd" and training.momentum > 0:
        compression["momentum_correction"] = True
    return compression


def run_cluster_bench(methods: list[str], bandwidth: str, nodes: int, latency: str | None, spec_path: Path,
                      powersgd_start_iter: int = 10, log: Callable[[str], None] = print,
                      budget_steps: int | None = None) -> dict[str, Any]:
    """Run every method on one namespace cluster. With ``budget_steps``, each method trains
    exactly that many steps (time to target is still taken where the target is first
    reached), so final accuracies compare at the same budget."""
    base = yaml.safe_load(spec_path.read_text())
    base.setdefault("scaling", {}).update({"min_workers": nodes, "max_workers": nodes})
    if budget_steps is not None:
        training = base.setdefault("training", {})
        training.pop("epochs", None)
        training.update({"steps": budget_steps, "stop_at_target": False})
    target = base.get("training", {}).get("target_accuracy")
    rows = []
    with NetnsCluster(nodes=nodes, bandwidth=bandwidth, latency=latency) as cluster:
        log(f"cluster up: {nodes} worker nodes at {bandwidth}" + (f", {latency} latency" if latency else ""))
        for method in methods:
            spec = {**base, "name": f"bench-{method.replace('_', '-')}",
                    "compression": method_compression(method, powersgd_start_iter, base.get("training"))}
            spec_file = cluster.tmp / f"{method}.yaml"
            spec_file.write_text(yaml.safe_dump(spec))
            out = cluster.tmp / f"{method}.json"
            tx_before = cluster.tx_bytes()
            started = time.time()
            log(f"running {method} ...")
            proc = cluster.run_in_head([cluster.python, "-m", "rayzip", "run", str(spec_file), "--summary-json", str(out),
                                        "--storage-path", str(cluster.tmp / "results")],
                                       capture_output=True, text=True, timeout=3600)
            tx_after = cluster.tx_bytes()
            if proc.returncode != 0 or not out.exists():
                error = _last_error(proc.stdout + proc.stderr)
                rows.append({"name": method, "error": error, "run_s": time.time() - started})
                log(f"  {method} FAILED: {error}")
                continue
            summary = json.loads(out.read_text())
            rows.append(_row(method, summary, tx_before, tx_after, time.time() - started))
            log(f"  {method}: {rows[-1]['time_to_target_s']} s to target, final acc {rows[-1]['final_accuracy']:.4f}")
    dense = next((r for r in rows if r["name"] == "dense" and "error" not in r), None)
    for row in rows:
        ok = dense and dense["time_to_target_s"] and row.get("time_to_target_s")
        row["speedup_vs_dense"] = dense["time_to_target_s"] / row["time_to_target_s"] if ok else None
    return {"bandwidth": bandwidth, "latency": latency, "nodes": nodes, "target_accuracy": target,
            "budget_steps": budget_steps,
            "spec": str(spec_path), "powersgd_start_iter": powersgd_start_iter,
            "python": sys.version.split()[0], "methods": rows}


def _last_error(output: str) -> str:
    """The most telling line of a failed run's output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for needle in ("enforce fail", "Error:", "error:"):
        hits = [line for line in lines if needle in line]
        if hits:
            return hits[-1][:400]
    return lines[-1][:400] if lines else "no output"


def _row(method: str, s: dict, tx_before: list[int], tx_after: list[int], run_s: float) -> dict[str, Any]:
    mean_step, mean_comm = s.get("mean_step_s") or 0.0, s.get("mean_comm_s") or 0.0
    return {
        "name": method,
        "time_to_target_s": s.get("time_to_target_s"),
        "steps_to_target": s.get("steps_to_target"),
        "final_accuracy": s["final_test_accuracy"],
        "steps": s["steps"],
        "step_s": mean_step,
        "comm_s": mean_comm,
        # Of comm_s, the time inside torch.distributed (wire and waiting for the slower peer);
        # the rest is the codec's CPU work. Equal to comm_s where the hook is torch's own.
        "network_s": s.get("mean_network_s"),
        "compute_s": max(0.0, mean_step - mean_comm),
        "comm_source": s.get("comm_source"),
        "wire_bytes_counted": s["bytes_sent_per_worker"],
        "bytes_source": s["bytes_source"],
        "wire_bytes_interface": s.get("interface_tx_bytes"),  # rank 0's eth0 during training
        "interface_bytes_whole_run": statistics.mean(a - b for a, b in zip(tx_after, tx_before)),
        "dense_bytes": s["dense_bytes_per_worker"],
        "wire_compression": s["dense_bytes_per_worker"] / s["bytes_sent_per_worker"] if s["bytes_sent_per_worker"] else None,
        "history": s.get("history", []),
        "run_s": run_s,
    }


def render_table(report: dict):
    from rich.table import Table

    budget = report.get("budget_steps")
    table = Table(title=f"rayzip bench cluster: {report['nodes']} nodes at {report['bandwidth']}, "
                        f"target accuracy {report['target_accuracy']}"
                        + (f", {budget} steps each" if budget else ", stopping at the target"))
    for col in ("method", "to target", "vs DDP", "final acc", "step ms (comm)", "MB sent",
                "MB on iface", "compression"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for r in report["methods"]:
        if "error" in r:
            table.add_row(r["name"], "failed", "-", "-", "-", "-", "-", "-")
            continue
        ttt = (f"{r['time_to_target_s']:.1f} s ({r.get('steps_to_target')} steps)"
               if r["time_to_target_s"] else "missed")
        speed = f"{r['speedup_vs_dense']:.2f}x" if r["speedup_vs_dense"] else "-"
        iface = f"{r['wire_bytes_interface'] / 1e6:.2f}" if r["wire_bytes_interface"] is not None else "-"
        table.add_row(r["name"], ttt, speed, f"{r['final_accuracy']:.4f}",
                      f"{r['step_s'] * 1e3:.0f} ({r['comm_s'] * 1e3:.0f})", f"{r['wire_bytes_counted'] / 1e6:.2f}",
                      iface, f"{r['wire_compression']:.1f}x" if r["wire_compression"] else "-")
    return table


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in report["methods"]:
        points = [(h["train_s"], h["test_accuracy"]) for h in r.get("history", []) if h.get("test_accuracy") is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=".", label=r["name"])
    if report["target_accuracy"]:
        ax.axhline(report["target_accuracy"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{report['nodes']} nodes at {report['bandwidth']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
