"""``rayzip bench collectives --simulate``: the collectives' own code at world sizes this
machine cannot hold as processes.

For every world size n, one process trains :mod:`rayzip.bench.collectives`' MLP as n workers
would: each step, each simulated rank computes the gradient of its own batch (the batches
the real bench's rank r draws), then n threads run what rayzip's hook runs on each rank
(error feedback, the codec, the collective, what the collective cut handed back) over
:class:`~rayzip.comm.inprocess.InProcessTransport`, whose every send is counted as
torch.distributed's are. The mean the collective returns updates the model, so every
collective follows its own trajectory, as in a real run.

It reports, per collective: bytes each worker sends per step (the mean over ranks and the
steps after the first ``skip``), the messages, the fill-in (entries of the sum of every
rank's payload over the entries of one payload: n for disjoint selections, 1 for identical
ones), and the step time modelled on a link of bandwidth B and latency L:
``bytes / B + messages * L``. The real bench (:func:`rayzip.bench.collectives.run_collectives_bench`)
measures the same bytes on gloo processes at small n; :func:`check_against_real` sets the
two side by side.

Usage::

    report = simulate_collectives([2, 8, 64, 256], {"codec": "group_topk", "density": 0.01}, steps=6)
"""

from __future__ import annotations

import platform
import sys
import time
from typing import Any

import numpy as np
import torch

from ..codecs.memory import segment_name
from ..comm import Link, make_communicator
from ..comm.inprocess import InProcessHub, InProcessTransport
from ..engine import SegmentEncoder, plan_segments
from ..spec import CompressionSpec
from .collectives import BATCH, _batch_source, _model

__all__ = ["SIMULATED", "check_against_real", "markdown_table", "simulate_collectives"]

SIMULATED = ("ring", "allgather", "balanced", "dense")


def _simulate_one(world: int, compression: dict, collective: str, steps: int, skip: int) -> dict[str, Any]:
    config = CompressionSpec(**{**compression, "collective": collective}).to_config()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    numel = sum(sizes)
    segments = plan_segments(sizes, int(config.segment_mb * 2**20) // 4)
    names = [segment_name(lo, hi, numel) for lo, hi in segments]
    hub = InProcessHub(world)
    encoders = [SegmentEncoder(config, rank) for rank in range(world)]
    transports = [InProcessTransport(hub, rank) for rank in range(world)]
    communicators = [make_communicator(config.collective, encoders[r].codec, transports[r],
                                       sizes=[hi - lo for lo, hi in segments], link=config.link,
                                       combine=config.combine)
                     for r in range(world)]
    batches = [_batch_source(rank) for rank in range(world)]
    sent = np.zeros((steps, world))
    hops = np.zeros((steps, world))
    fill = []
    for step in range(steps):
        grads = []
        for rank in range(world):
            x, y = batches[rank]()
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]).numpy().copy())
        union = [0] * len(segments)

        def rank_step(rank: int) -> np.ndarray:
            encoder, communicator = encoders[rank], communicators[rank]
            out = np.empty(numel, dtype=np.float32)
            for k, ((lo, hi), name) in enumerate(zip(segments, names)):
                payload = encoder.encode(name, grads[rank][lo:hi], True, communicator.input_scale)
                average = np.asarray(communicator.average(encoder.codec, payload, name))
                if communicator.feeds_back:
                    encoder.memory.add_back(name, *communicator.take_dropped(name), scale=communicator.input_scale)
                if encoder.codec.sparse:
                    indices = hub.gather(rank, encoder.codec.to_coo(payload)[0])
                    if rank == 0:
                        union[k] = (int(np.unique(np.concatenate(indices)).size), int(indices[0].size))
                out[lo:hi] = average
            return out

        before = [(t.bytes_sent, t.hops) for t in transports]
        averages = hub.run(rank_step)
        for rank, t in enumerate(transports):
            sent[step, rank] = t.bytes_sent - before[rank][0]
            hops[step, rank] = t.hops - before[rank][1]
        if encoders[0].codec.sparse:
            fill.append(sum(u for u, _ in union) / max(1, sum(k for _, k in union)))
        offset = 0
        for p in params:
            p.grad.copy_(torch.from_numpy(averages[0][offset:offset + p.numel()]).view_as(p))
            offset += p.numel()
        optimizer.step()
    return {"bytes": float(sent[skip:].mean()), "messages": float(hops[skip:].mean()),
            "fill_in": float(np.mean(fill[skip:])) if fill else None, "chosen": communicators[0].name,
            "segments": len(segments), "numel": numel}


def simulate_collectives(worlds: list[int], compression: dict, steps: int = 6, skip: int = 2,
                         collectives: tuple[str, ...] = SIMULATED, link: Link = Link(bandwidth=12.5e6, latency=1e-4),
                         others_upto: int | None = None, progress=lambda world, collective: None) -> dict[str, Any]:
    """Each collective at each world size, simulated (see the module docstring). Above
    ``others_upto`` workers only the balanced allreduce runs: the ring, the allgather and dense
    decode every worker's entries on every rank, n² work that takes hours at n = 256 here."""
    torch.set_num_threads(1)  # the ranks' threads share the cores
    rows = []
    for world in worlds:
        row: dict[str, Any] = {"workers": world}
        for collective in collectives:
            if others_upto is not None and world > others_upto and collective != "balanced":
                continue
            progress(world, collective)
            start = time.perf_counter()
            result = _simulate_one(world, compression, collective, steps, skip)
            result["modelled_step_s"] = result["bytes"] / link.bandwidth + result["messages"] * link.latency
            result["simulated_s"] = time.perf_counter() - start
            row[collective] = result
        rows.append(row)
    first = rows[0] if rows else None
    for row in rows:  # bytes against the first world size's, collective by collective
        for collective in collectives:
            if collective in row:
                base = first[collective]["bytes"]
                row[collective]["over_first"] = row[collective]["bytes"] / base if base else None
    return {"bench": "collectives-simulated", "compression": compression, "steps": steps, "skipped_steps": skip,
            "others_upto": others_upto,
            "collectives": list(collectives), "link": {"bandwidth": link.bandwidth, "latency": link.latency},
            "model": f"MLP from rayzip.bench.collectives, batches of {BATCH} per simulated worker, SGD",
            "machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
            "rows": rows}


def check_against_real(simulated: dict, real: dict) -> list[dict[str, Any]]:
    """Simulated bytes over the real bench's measured bytes, per world size and collective."""
    out = []
    for real_row in real["rows"]:
        sim = next((r for r in simulated["rows"] if r["workers"] == real_row["workers"]), None)
        if sim is None:
            continue
        for collective in simulated["collectives"]:
            measured = real_row.get(f"measured_{collective}_bytes")
            if measured and collective in sim:
                out.append({"workers": real_row["workers"], "collective": collective, "real": measured,
                            "simulated": sim[collective]["bytes"], "ratio": sim[collective]["bytes"] / measured})
    return out


def markdown_table(report: dict) -> str:
    head = ["workers"]
    for c in report["collectives"]:
        head += [f"{c}: bytes", f"{c}: × first", f"{c}: modelled step"]
    head.append("fill-in")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        cells = [str(r["workers"])]
        for c in report["collectives"]:
            x = r.get(c)
            cells += (["–"] * 3 if x is None else
                      [f"{x['bytes'] / 1e3:.1f} kB", f"{x['over_first']:.2f}", f"{x['modelled_step_s'] * 1e3:.1f} ms"])
        fill = next(r[c]["fill_in"] for c in report["collectives"] if c in r)
        cells.append("" if fill is None else f"{fill:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
