"""``rayzip bench chaos``: what a killed worker costs, with snapshots and without.

Each round runs one job spec four ways on the local Ray, in an order rotated per round:

- ``plain``: no snapshots, no kills (the uninterrupted run);
- ``snapshots``: snapshots (the spec's ``snapshots.every``), no kills (their cost: training
  time against plain's);
- ``memory``: snapshots, and rank 0's worker process killed at ``kills`` random steps;
- ``storage``: no snapshots, killed at the same steps (Ray Train's resume from the last
  checkpoint in storage, the old path).

Rows report steps lost, seconds per recovery (from the last step before a kill to the first
step after it: the kill lands within a step of the first), the final metric, and whether the
final weights are the plain run's bit for bit. The headline figures are medians over rounds.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from .timing import interleaved

__all__ = ["VARIANTS", "killer", "markdown_table", "run_chaos_bench"]

VARIANTS = ("plain", "snapshots", "memory", "storage")


def killer(steps) -> tuple[Callable[[dict], None], list[tuple[int, int]]]:
    """An ``on_progress`` callback for :func:`rayzip.runner.run_job` that SIGKILLs rank 0's
    worker process the first time it reports a step at or past each of ``steps`` (in order,
    each kill a process of its own), and the (step, pid) of each kill so far. The driver polls
    twice a second: a kill lands at whatever step rank 0 is on then, anywhere inside it.
    (:class:`rayzip.train.Faults` ``kill_after_steps`` kills at a known place instead.)"""
    pending, killed = sorted(steps), []

    def kill(metrics: dict) -> None:
        step = metrics["step"]
        if pending and step >= pending[0] and metrics["pid"] not in {pid for _, pid in killed}:
            pending.pop(0)
            killed.append((step, metrics["pid"]))
            os.kill(metrics["pid"], signal.SIGKILL)

    return kill, killed


def _variant(spec, variant: str, kills: int):
    snapshots = variant in ("snapshots", "memory")
    return spec.model_copy(update={
        "name": f"{spec.name}-{variant}"[:50],
        "snapshots": spec.snapshots.model_copy(update={"enabled": snapshots}),
        "scaling": spec.scaling.model_copy(update={"max_failures": max(spec.scaling.max_failures, kills + 1)})})


def _weights(summary: dict) -> dict:
    from .. import checkpoint

    return checkpoint.load(os.path.join(summary["checkpoint"], "trainer"))["model"]


def _bitwise_equal(a: dict, b: dict) -> bool:
    import torch

    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def run_chaos_bench(spec, kills: int = 5, repeat: int = 3, seed: int = 0,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """``spec`` run as every variant ``repeat`` times, the killed ones at ``kills`` random
    steps (the same in both, drawn per round from ``seed``); the report."""
    from ..runner import run_job

    steps = spec.training.steps
    if steps < 4 * kills + 40:
        raise ValueError(f"training.steps {steps} leaves no room for {kills} kills")
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rayzip-chaos-") as tmp:
        for round_ in range(repeat):
            schedule = sorted(random.Random(seed + round_).sample(range(20, steps - 20), kills))
            weights = {}
            for variant in interleaved(list(VARIANTS), round_):
                log(f"{variant} (round {round_ + 1} of {repeat})")
                kill, killed = killer(schedule if variant in ("memory", "storage") else [])

                summary = run_job(_variant(spec, variant, kills), storage_path=str(Path(tmp) / f"{variant}-{round_}"),
                                  on_progress=kill, verbose=False)
                weights[variant] = _weights(summary)
                resumes = summary["resumes"]
                runs[variant].append({
                    "round": round_, "killed_at": [s for s, _ in killed], "restarts": summary["restarts"],
                    "steps_lost": summary["steps_redone"], "recovery_s": [r["seconds"] for r in resumes],
                    "sources": [r["source"] for r in resumes], "causes": [r.get("cause") for r in resumes],
                    "steps": summary["steps"],
                    "train_s": summary["train_s"], "step_s": summary["train_s"] / summary["steps"],
                    "mean_snapshot_s": summary["metrics"].get("mean_snapshot_s"),
                    "snapshot_every": summary["metrics"].get("snapshot_every"),
                    "snapshot_bytes": summary["metrics"].get("snapshot_bytes"),  # rank 0's, a snapshot
                    "metric": summary["metric"],
                    "final": summary["final_val_loss"] if summary["metric"] == "val_loss"
                    else summary["final_test_accuracy"]})
                log(f"  {runs[variant][-1]['steps_lost']} steps lost, {summary['restarts']} restarts, "
                    f"final {runs[variant][-1]['final']:.4f}")
            for variant in VARIANTS:
                runs[variant][-1]["bitwise_equal_to_plain"] = _bitwise_equal(weights[variant], weights["plain"])
    rows = []
    for variant in VARIANTS:
        done = runs[variant]
        recoveries = [s for r in done for s in r["recovery_s"]]
        rows.append({
            "variant": variant, "kills": sum(len(r["killed_at"]) for r in done),
            "steps_lost": [r["steps_lost"] for r in done],
            "median_recovery_s": statistics.median(recoveries) if recoveries else None,
            "median_step_s": statistics.median(r["step_s"] for r in done),
            "step_vs_plain": statistics.median(r["step_s"] / p["step_s"] for r, p in zip(done, runs["plain"])),
            "median_final": statistics.median(r["final"] for r in done),
            "bitwise_equal": all(r["bitwise_equal_to_plain"] for r in done),
            "mean_snapshot_s": statistics.median(r["mean_snapshot_s"] for r in done)
            if all(r["mean_snapshot_s"] for r in done) else None,
            "runs": done})
    return {"bench": "chaos", "spec": spec.name, "steps": steps, "workers": spec.scaling.max_workers,
            "snapshot_every": spec.snapshots.every,
            "kills_per_run": kills, "repeat": repeat, "seed": seed,
            "checkpoint_every_steps": spec.checkpoint.every_steps, "metric": runs["plain"][0]["metric"],
            "rows": rows}


def markdown_table(report: dict) -> str:
    metric = "accuracy" if report["metric"] == "test_accuracy" else "val loss"
    lines = [f"| run | kills | steps lost (each run) | recovery, median | step vs plain | snapshot every (each run) "
             f"| mean snapshot | final {metric} | weights = plain's |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        recovery = f"{r['median_recovery_s']:.1f} s" if r["median_recovery_s"] is not None else "–"
        snapshot = f"{r['mean_snapshot_s'] * 1e3:.2f} ms" if r["mean_snapshot_s"] else "–"
        every = [x.get("snapshot_every") for x in r["runs"]]
        every = ", ".join(str(x) for x in every) if any(every) else "–"
        lines.append(f"| {r['variant']} | {r['kills']} | {', '.join(str(x) for x in r['steps_lost'])} | {recovery} | "
                     f"{r['step_vs_plain']:.3f}× | {every} | {snapshot} | {r['median_final']:.4f} | "
                     f"{'yes' if r['bitwise_equal'] else 'no'} |")
    return "\n".join(lines)
