"""``rayzip bench overhead``: what a step costs through rayzip's hook with compression off,
against plain DDP's step, in the same processes.

With compression off (the adaptive controller's choice on a fast link, warm-up, codec
``none``) the hook takes DDP's own step: each bucket all-reduced where it lies
(:mod:`rayzip.torch.dense`). What it adds, the control word and each rank's NaN check, and
under momentum or Adam correction the optimizer's state kept in the hook, should cost next
to nothing. Here n gloo processes on this machine train the cluster benchmark's MLP
(``jobs/bench-synthetic.yaml``: 64-2048-2048-10, batches of 64), one model per variant,
their steps interleaved one by one, so that load drifting on a shared machine reaches every
variant alike. Each variant is set beside the DDP it replaces:

* ``ddp_again``: a second plain DDP model, the same as ``ddp_sgd``, against it: how far two
  identical models' steps differ on this machine, the floor under which no ratio means anything;
* ``ddp_hook``: DDP with torch's own Python ``allreduce_hook``: what any Python comm hook
  costs over DDP's built-in all-reduce, the floor for rayzip's; against ``ddp_sgd``;
* ``off``: group top-k, switched off, SGD momentum in the optimizer; against ``ddp_sgd``;
* ``off_momentum``: the same under momentum correction (SGD momentum in the hook);
* ``off_adam``: under Adam correction (AdamW's moments in the hook); against ``ddp_adamw``.

A round times ``steps`` steps of every variant after ``warmup`` untimed ones; its figure is
rank 0's median step, and a variant's ratio divides it by its baseline's median of the same
round. Rounds rotate the variants' order. The loopback link is fast, so what is timed is
compute and rayzip's own work, not a network.

Usage::

    report = run_overhead_bench(workers=2, steps=60, rounds=3)
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..torch import CompressionConfig, compress, ddp_kwargs
from ..torch.optim import build_optimizer
from .gloo import run_world
from .tables import Columns, markdown_rows, rich_rows
from .timing import interleaved

__all__ = ["VARIANTS", "markdown_table", "render_table", "run_overhead_bench", "with_baselines"]

BATCH = 64


class _Optimizer(NamedTuple):
    """The job's optimizer settings (:class:`rayzip.torch.optim.OptimizerSettings`)."""

    optimizer: str
    lr: float
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0


SGD = _Optimizer("sgd", lr=0.05, momentum=0.9)
ADAMW = _Optimizer("adamw", lr=1e-3, weight_decay=0.01)


@dataclass(frozen=True)
class Variant:
    """One model's way to train: plain DDP (``corrections`` None; with ``torch_hook``, under
    torch's ``allreduce_hook``) or rayzip's hook with compression off and these memory
    settings, against ``baseline``."""

    optimizer: _Optimizer
    corrections: dict | None = None
    baseline: str | None = None
    torch_hook: bool = False


VARIANTS: dict[str, Variant] = {
    "ddp_sgd": Variant(SGD),
    "ddp_again": Variant(SGD, baseline="ddp_sgd"),
    "ddp_hook": Variant(SGD, baseline="ddp_sgd", torch_hook=True),
    "off": Variant(SGD, {}, "ddp_sgd"),
    "off_momentum": Variant(SGD, {"momentum_correction": True}, "ddp_sgd"),
    "ddp_adamw": Variant(ADAMW),
    "off_adam": Variant(ADAMW, {"adam_correction": True}, "ddp_adamw"),
}


def _model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _build(variant: Variant, hidden: int):
    """(the DDP model, its optimizer, rayzip's engine or None)."""
    if variant.corrections is None:
        ddp = torch.nn.parallel.DistributedDataParallel(_model(hidden))
        if variant.torch_hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, allreduce_hook)
        return ddp, build_optimizer(variant.optimizer, ddp.parameters()), None
    config = CompressionConfig(codec="group_topk", density=0.01, **variant.corrections)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(hidden), **ddp_kwargs(config))
    opt = variant.optimizer
    exchange = compress(ddp, config, momentum=opt.momentum if config.momentum_correction else None,
                        adam_betas=opt.betas if config.adam_correction else None)
    exchange.compress_at(1.0)  # off, as the controller switches it
    optimizer = build_optimizer(opt, ddp.parameters(), momentum_elsewhere=config.momentum_correction,
                                adam_elsewhere=config.adam_correction)
    return ddp, optimizer, exchange


def _rank(rank: int, world: int, names: list[str], steps: int, warmup: int, rounds: int,
          hidden: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    built = {name: _build(VARIANTS[name], hidden) for name in names}
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 64, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    medians: dict[str, list[float]] = {name: [] for name in names}
    dense_steps = {name: 0 for name in names}
    for round_ in range(rounds):
        order = interleaved(names, round_)
        times: dict[str, list[float]] = {name: [] for name in names}
        for step in range(warmup + steps):
            for name in order:
                ddp, optimizer, exchange = built[name]
                dist.barrier()  # every rank starts the step together, as in a training loop's lockstep
                start = time.perf_counter()
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
                elapsed = time.perf_counter() - start
                if exchange is not None and not exchange.last_step.compressed:
                    dense_steps[name] += 1
                if step >= warmup:
                    times[name].append(elapsed)
        for name in names:
            medians[name].append(statistics.median(times[name]))
    return {"medians": medians, "dense_steps": dense_steps}


def with_baselines(variants: list[str]) -> list[str]:
    """``variants`` in their order, each once, then the baselines they need that they do not
    name; a ValueError names any variant that does not exist."""
    unknown = [n for n in variants if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    names = list(dict.fromkeys(variants))
    for name in list(names):
        base = VARIANTS[name].baseline
        if base is not None and base not in names:
            names.append(base)
    return names


def run_overhead_bench(workers: int = 2, steps: int = 60, warmup: int = 5, rounds: int = 3,
                       hidden: int = 2048, variants: list[str] | None = None) -> dict[str, Any]:
    """Each variant's median step (rank 0's) per round and over the rounds, and its ratio to
    its baseline's in the same round; ``dense_steps``: how many of rank 0's steps the hook
    took uncompressed (all of them, or the bench measured something else)."""
    names = with_baselines(variants or list(VARIANTS))
    ranks = run_world(_rank, workers, names, steps, warmup, rounds, hidden, timeout_s=1800)
    medians, dense = ranks[0]["medians"], ranks[0]["dense_steps"]
    rows = []
    for name in names:
        variant = VARIANTS[name]
        base = variant.baseline
        ratios = [m / b for m, b in zip(medians[name], medians[base])] if base else None
        hook = "rayzip" if variant.corrections is not None else "torch allreduce_hook" if variant.torch_hook else "–"
        rows.append({"variant": name, "baseline": base, "optimizer": variant.optimizer.optimizer, "hook": hook,
                     "corrections": variant.corrections, "step_ms": 1e3 * statistics.median(medians[name]),
                     "rounds_ms": [1e3 * m for m in medians[name]],
                     "ratio": statistics.median(ratios) if ratios else None, "rounds_ratio": ratios,
                     "dense_steps": dense[name] if variant.corrections is not None else None})
    params = sum(p.numel() for p in _model(hidden).parameters())
    return {"bench": "overhead", "workers": workers, "steps": steps, "warmup": warmup, "rounds": rounds,
            "model": f"MLP 64-{hidden}-{hidden}-10 ({params / 1e6:.2f}M parameters), batches of {BATCH} per worker",
            "parameters": params, "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "torch": torch.__version__, "rows": rows}


def _columns() -> Columns:
    return [("variant", lambda r: r["variant"]),
            ("optimizer", lambda r: r["optimizer"] + (" (in the hook)" if r["corrections"] else "")),
            ("hook", lambda r: r["hook"]),
            ("step ms", lambda r: f"{r['step_ms']:.1f} [{min(r['rounds_ms']):.1f}–{max(r['rounds_ms']):.1f}]"),
            ("vs its DDP", lambda r: "–" if r["ratio"] is None else
             f"{r['ratio']:.3f}× [{min(r['rounds_ratio']):.3f}–{max(r['rounds_ratio']):.3f}]"),
            ("baseline", lambda r: r["baseline"] or "–")]


def render_table(report: dict):
    return rich_rows(f"rayzip's hook with compression off against plain DDP: {report['workers']} gloo workers, "
                     f"{report['model']}; medians of {report['rounds']} rounds [min–max]", _columns(), report["rows"])


def markdown_table(report: dict) -> str:
    """The report as a Markdown table, for the docs (generated, not typed)."""
    return markdown_rows(_columns(), report["rows"])
