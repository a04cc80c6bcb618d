"""``rayzip bench collectives``: each collective's bytes per worker, modelled and measured.

For every worker count n, n gloo processes on this machine train the same small MLP on
their own synthetic batches with rayzip's hook, once per collective (``ring``,
``allgather``, and ``auto``'s choice), and count the payload bytes each worker hands to
torch.distributed per step (the control word left out). Beside them stands
:mod:`rayzip.comm.cost`'s model of each collective for the same segments. Bytes do not
depend on the link, so loopback measures them exactly; the model's ring assumes
independently placed entries, an upper bound for workers whose selections overlap.

Usage::

    report = run_collectives_bench([2, 4, 8], {"codec": "group_topk", "density": 0.01}, steps=8)
"""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from ..comm import COLLECTIVES as COMMUNICATORS, collective_costs
from ..spec import CompressionSpec
from ..torch import compress, ddp_kwargs
from .gloo import run_world
from .tables import markdown_rows, rich_rows

__all__ = ["markdown_table", "render_table", "run_collectives_bench"]

COLLECTIVES = ("ring", "allgather", "balanced", "dense", "auto")
MEASURED = ("ring", "allgather", "balanced", "dense")  # the collectives with a model and a measured column
WIDTH = 1024  # hidden width of the MLP: 1.9M parameters, 7.5 MB of fp32 gradient
BATCH = 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10))


def _batch_source(rank: int):
    """Rank ``rank``'s batches, one per call: its own inputs, one labelling rule for all."""
    gen = torch.Generator().manual_seed(1000 + rank)
    weights = torch.randn(784, 10, generator=torch.Generator().manual_seed(7))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH, 784, generator=gen)
        return x, (x @ weights).argmax(1)

    return batch


def _rank(rank: int, world: int, compression: dict, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for collective in COLLECTIVES:
        spec = CompressionSpec(**{**compression, "collective": collective}).to_config()
        ddp = torch.nn.parallel.DistributedDataParallel(_model(), **ddp_kwargs(spec))
        state = compress(ddp, spec, momentum=0.9 if spec.momentum_correction else None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        batch = _batch_source(rank)
        sent = []
        for _ in range(steps):
            x, y = batch()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            sent.append(state.last_step.bytes_sent - state.last_step.control_bytes)
        out[collective] = {"bytes": sent, "chosen": state.communicator.name,
                           "segments": [hi - lo for lo, hi in state.segments]}
    return out


def run_collectives_bench(worlds: list[int], compression: dict, steps: int = 8, skip: int = 2,
                          progress=lambda world: None) -> dict[str, Any]:
    """Bytes per worker per step of each collective at each world size: the model's and the
    mean measured over every rank and the steps after the first ``skip`` (error feedback's
    start-up)."""
    rows = []
    for world in worlds:
        progress(world)
        ranks = run_world(_rank, world, compression, steps, timeout_s=600)
        spec = CompressionSpec(**compression)
        codec = spec.build_codec()
        segments = ranks[0]["ring"]["segments"]
        model = {name: sum(collective_costs(codec, n, world)[name].bytes for n in segments) for name in MEASURED}
        measured = {c: sum(sum(r[c]["bytes"][skip:]) for r in ranks) / (len(ranks) * (steps - skip))
                    for c in COLLECTIVES}
        cheaper = min(measured[c] for c in MEASURED if not COMMUNICATORS[c].feeds_back)  # auto's candidates
        row = {"workers": world, "numel": sum(segments), "segments": len(segments),
               "auto_chose": ranks[0]["auto"]["chosen"], "measured_auto_bytes": measured["auto"],
               "auto_over_cheaper": measured["auto"] / cheaper if cheaper else None}
        for c in MEASURED:
            row.update({f"model_{c}_bytes": model[c], f"measured_{c}_bytes": measured[c],
                        f"{c}_measured_over_model": measured[c] / model[c] if model[c] else None})
        rows.append(row)
    return {"bench": "collectives", "compression": compression, "steps": steps, "skipped_steps": skip,
            "model": f"MLP 784-{WIDTH}-{WIDTH}-10, synthetic batches of 64 per worker, SGD",
            "machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
            "rows": rows}


def _columns(report: dict) -> list[tuple[str, Any]]:
    """(heading, cell of a row) of every column: each measured collective's model and
    measurement, then auto's choice."""
    cols: list[tuple[str, Any]] = [("workers", lambda r: str(r["workers"]))]
    for c in MEASURED:
        if all(f"model_{c}_bytes" in r for r in report["rows"]):
            cols += [(f"{c}: model", lambda r, c=c: f"{r[f'model_{c}_bytes'] / 1e3:.1f} kB"),
                     (f"{c}: measured", lambda r, c=c: f"{r[f'measured_{c}_bytes'] / 1e3:.1f} kB")]
    cols += [("auto chose", lambda r: r["auto_chose"]),
             ("auto: measured", lambda r: f"{r['measured_auto_bytes'] / 1e3:.1f} kB"),
             ("auto / its cheapest candidate", lambda r: f"{r['auto_over_cheaper']:.3f}")]
    return cols


def render_table(report: dict):
    return rich_rows(f"bytes per worker per step: {report['compression']}", _columns(report), report["rows"])


def markdown_table(report: dict) -> str:
    """The report as a Markdown table, for the docs (generated, not typed)."""
    return markdown_rows(_columns(report), report["rows"])
