"""``rayzip bench sharded-checkpoint``: a sharded model's checkpoint through
``torch.distributed.checkpoint``, rayzip's storage layer against torch's own
``FileSystemWriter`` in the same run, and ZipNN on the very pieces each rank writes.

Gloo ranks on this machine train jobs/bench-gpt.yaml's GPT with AdamW under FSDP2 (sharded
over every rank, or in shard groups of ``shard_size`` with replicas between them), then save
and load the same state with each writer, interleaved, one coding thread per rank. Also
counted, from the tensors: the bytes each rank holds in parameters, gradients and optimizer
state, against a DDP replica's.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..xp import local_part

__all__ = ["markdown_table", "memory_markdown_table", "render_table", "run_sharded_checkpoint_bench"]

WRITERS = ("rayzip", "torch")


def _leaves(nest):
    if isinstance(nest, dict):
        for value in nest.values():
            yield from _leaves(value)
    elif isinstance(nest, (list, tuple)):
        for value in nest:
            yield from _leaves(value)
    elif isinstance(nest, torch.Tensor):
        yield nest


def _held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes, from the tensors it holds."""
    size = lambda t: local_part(t).numel() * local_part(t).element_size()  # noqa: E731
    params = [p for p in model.parameters()]
    return {"parameters": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(t) for state in optimizer.state.values() for t in _leaves(state))}


def _rank(rank: int, world: int, root: str, steps: int, rounds: int, shard_size: int | None) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from zipnn import ZipNN

    from ..checkpoint.dcp import CompressedStorageReader, CompressedStorageWriter
    from ..torch.fsdp import ShardingConfig, shard_model
    from .checkpoint import build_workload

    workload = build_workload("gpt", seed=0)
    ddp_numel = sum(p.numel() for p in workload.model.parameters())
    sharding = ShardingConfig(mode="fsdp") if shard_size is None else ShardingConfig(mode="hsdp", shard_size=shard_size)
    model, _ = shard_model(workload.model, sharding, world, native_hsdp=shard_size is not None)
    optimizer = workload.optimizer(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        workload.loss(model, generator).backward()
        optimizer.step()
    held = _held_bytes(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    writers = {"rayzip": lambda path: CompressedStorageWriter(path, threads=1),
               "torch": lambda path: dcp.FileSystemWriter(path, thread_count=1)}
    readers = {"rayzip": lambda path: CompressedStorageReader(path, threads=1),
               "torch": lambda path: dcp.FileSystemReader(path)}
    times: dict[str, dict[str, list[float]]] = {w: {"save_s": [], "load_s": []} for w in WRITERS}
    for round_ in range(rounds):
        order = WRITERS if round_ % 2 == 0 else WRITERS[::-1]  # neither always goes first
        for name in order:
            path = f"{root}/{name}-{round_}"
            dist.barrier()
            start = time.perf_counter()
            dcp.save(state, storage_writer=writers[name](path))
            dist.barrier()  # the slowest rank's save is the checkpoint's
            times[name]["save_s"].append(time.perf_counter() - start)
            model_target, optim_target = get_state_dict(model, optimizer)
            loaded = {"model": model_target, "optimizer": optim_target}
            dist.barrier()
            start = time.perf_counter()
            dcp.load(loaded, storage_reader=readers[name](path))
            dist.barrier()
            times[name]["load_s"].append(time.perf_counter() - start)
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    # ZipNN on what this rank wrote: its own pieces (a replica's are written once, by DCP's dedup).
    raw = zipped = 0
    codec = ZipNN(input_format="byte", bytearray_dtype="float32", threads=1)
    for tensor in _leaves(state):
        piece = local_part(tensor)
        if piece.dtype == torch.float32 and piece.numel() > 1 and (shard_size is None or rank < shard_size):
            data = piece.detach().contiguous().numpy().tobytes()
            raw, zipped = raw + len(data), zipped + len(codec.compress(data))
    return {"times": times, "held": held, "ddp_held": 4 * ddp_numel * 4, "zipnn_raw": raw, "zipnn_stored": zipped}


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_sharded_checkpoint_bench(workers: int = 4, steps: int = 30, rounds: int = 3, shard_size: int | None = None,
                                 log: Callable[[str], None] = print) -> dict:
    from ..checkpoint.dcp import stored_bytes
    from .gloo import run_world

    if shard_size is not None and (shard_size < 1 or workers % shard_size):
        raise ValueError(f"--shard-size {shard_size} must divide --workers {workers}")
    root = Path(tempfile.mkdtemp(prefix="rayzip-bench-dcp-"))
    try:
        log(f"training the GPT for {steps} steps on {workers} gloo ranks, then {rounds} rounds of saves and loads")
        ranks = run_world(_rank, workers, str(root), steps, rounds, shard_size, timeout_s=1800)
        rayzip = stored_bytes(root / "rayzip-0")
        torch_bytes = _folder_bytes(root / "torch-0")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    slowest = lambda name, key: [max(r["times"][name][key][i] for r in ranks) for i in range(rounds)]  # noqa: E731
    rows = {}
    for name in WRITERS:
        rows[name] = {"save_s": statistics.median(slowest(name, "save_s")),
                      "load_s": statistics.median(slowest(name, "load_s"))}
    rows["rayzip"].update(stored_bytes=rayzip["stored_bytes"], raw_bytes=rayzip["raw_bytes"])
    rows["torch"].update(stored_bytes=torch_bytes, raw_bytes=rayzip["raw_bytes"])
    zipnn_raw, zipnn_stored = sum(r["zipnn_raw"] for r in ranks), sum(r["zipnn_stored"] for r in ranks)
    held = ranks[0]["held"]
    return {
        "bench": "sharded-checkpoint", "model": "gpt (jobs/bench-gpt.yaml)", "workers": workers, "steps": steps,
        "rounds": rounds, "layout": "fsdp" if shard_size is None else f"hsdp, shard groups of {shard_size}",
        "writers": rows,
        "ratio": {"rayzip": rayzip["raw_bytes"] / rayzip["stored_bytes"], "zipnn": zipnn_raw / zipnn_stored,
                  "torch": rayzip["raw_bytes"] / torch_bytes},
        "rayzip_over_zipnn_ratio": (rayzip["raw_bytes"] / rayzip["stored_bytes"]) / (zipnn_raw / zipnn_stored),
        "save_s_rayzip_over_torch": rows["rayzip"]["save_s"] / rows["torch"]["save_s"],
        "load_s_rayzip_over_torch": rows["rayzip"]["load_s"] / rows["torch"]["load_s"],
        "held_bytes_rank0": held, "ddp_held_bytes": ranks[0]["ddp_held"],
        "held_over_ddp": sum(held.values()) / ranks[0]["ddp_held"],
    }


def render_table(report: dict):
    from rich.table import Table

    table = Table(title=f"Sharded checkpoint (DCP) of the GPT on {report['workers']} ranks, {report['layout']}: "
                        f"medians of {report['rounds']} interleaved rounds")
    for column in ("writer", "stored MB", "ratio", "save s", "load s"):
        table.add_column(column, justify="left" if column == "writer" else "right")
    for name, row in report["writers"].items():
        table.add_row(name, f"{row['stored_bytes'] / 1e6:.2f}", f"{row['raw_bytes'] / row['stored_bytes']:.3f}",
                      f"{row['save_s']:.3f}", f"{row['load_s']:.3f}")
    table.add_row("zipnn (same pieces)", "", f"{report['ratio']['zipnn']:.3f}", "", "")
    return table


def markdown_table(report: dict) -> str:
    lines = ["| writer | stored MB | ratio | save s | load s |", "|---|---:|---:|---:|---:|"]
    for name, row in report["writers"].items():
        lines.append(f"| {name} | {row['stored_bytes'] / 1e6:.2f} | {row['raw_bytes'] / row['stored_bytes']:.3f} | "
                     f"{row['save_s']:.3f} | {row['load_s']:.3f} |")
    lines.append(f"| ZipNN on the same pieces | | {report['ratio']['zipnn']:.3f} | | |")
    return "\n".join(lines)


def memory_markdown_table(report: dict) -> str:
    """Rank 0's parameter, gradient and optimizer bytes, against a DDP replica's."""
    held, ddp = report["held_bytes_rank0"], report["ddp_held_bytes"]
    return "\n".join([
        "| each rank holds | parameters MB | gradients MB | optimizer MB | total MB | vs DDP |",
        "|---|---:|---:|---:|---:|---:|",
        f"| {report['layout']}, {report['workers']} ranks | {held['parameters'] / 1e6:.2f} | "
        f"{held['gradients'] / 1e6:.2f} | {held['optimizer'] / 1e6:.2f} | {sum(held.values()) / 1e6:.2f} | "
        f"{report['held_over_ddp']:.3f} |",
        f"| DDP (a whole replica) | {ddp / 4e6:.2f} | {ddp / 4e6:.2f} | {ddp / 2e6:.2f} | {ddp / 1e6:.2f} | 1.000 |"])
