"""``rayzip bench checkpoint``: rayzip's checkpoint compression against zstd and ZipNN.

The data come from a real training run: the cluster benchmark's 4.35M-parameter MLP trained
with Adam for ``steps`` steps. ``full`` is weights plus Adam's two moments (fp32) at that
step; ``delta-k`` is the state k steps later, stored by rayzip as an XOR delta against the
``full`` checkpoint. Every compressor runs on the same bytes in the same run, single-threaded:

* ``rayzip``: :func:`rayzip.checkpoint.save` / ``load`` into a tmpfs directory, checksums
  and codec choice included;
* ``zstd-3``, ``zstd-19``: zstandard on the tensors' raw bytes;
* ``zipnn``: ZipNN (PyPI ``zipnn``) on each tensor's raw bytes, as fp32, one thread.

Ratios are raw bytes over stored bytes; speeds are raw GB per second.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .timing import best_time

__all__ = ["collect_states", "run_checkpoint_bench"]

SPACINGS = (1, 10, 100)


def collect_states(spec_path: Path, steps: int, seed: int = 0) -> dict[str, dict]:
    """{'full': state at ``steps``, 'delta-k': state k steps later} from a real Adam run."""
    from ..spec import load_spec
    from ..train.data import load_dataset
    from ..train.models import build_model

    spec = load_spec(spec_path)
    torch.manual_seed(seed)
    x, y, _, _ = load_dataset(spec.dataset, seed)
    model = build_model(spec.model, x.shape[1], int(y.max()) + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    marks = {steps: "full", **{steps + k: f"delta-{k}" for k in SPACINGS}}
    states = {}
    for step in range(1, max(marks) + 1):
        idx = torch.randint(0, len(x), (spec.training.batch_size,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
        if step in marks:
            states[marks[step]] = _snapshot(model, optimizer)
    return states


def _snapshot(model, optimizer) -> dict:
    opt = optimizer.state_dict()
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
                          "param_groups": opt["param_groups"]}}


def _bench_view(state: dict) -> dict:
    """What every compressor is measured on: the weights and Adam's moments (not the step
    counters)."""
    return {"model": state["model"],
            "optimizer": {i: {k: v for k, v in s.items() if v.numel() > 1} for i, s in state["optimizer"]["state"].items()}}


def _tensors(view: dict) -> list[torch.Tensor]:
    return [*view["model"].values(), *(v for s in view["optimizer"].values() for v in s.values())]


def _rayzip(state: dict, base_state: dict | None, workdir: Path, repeat: int) -> tuple[int, float, float]:
    from .. import checkpoint

    base = None
    if base_state is not None:
        base = workdir / "base"
        checkpoint.save(base, base_state)
    target = workdir / "ckpt"

    def compress():
        if target.exists():
            shutil.rmtree(target)
        return checkpoint.save(target, state, base=base)

    c_s, manifest = best_time(compress, repeat, np)
    d_s, restored = best_time(lambda: checkpoint.load(target), repeat, np)
    for name, value in state["model"].items():  # the benchmark refuses to report a lossy result
        if not torch.equal(value.view(torch.int32), restored["model"][name].view(torch.int32)):
            raise AssertionError(f"rayzip restored {name} inexactly")
    stored = manifest["data_bytes"] + len((target / "manifest.json").read_bytes())
    return stored, c_s, d_s


def _zstd(level: int):
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    return (lambda raws: [compressor.compress(r) for r in raws],
            lambda blobs: [decompressor.decompress(b) for b in blobs])


def _zipnn():
    from zipnn import ZipNN

    codec = ZipNN(input_format="byte", bytearray_dtype="float32", threads=1)
    return (lambda raws: [codec.compress(r) for r in raws],
            lambda blobs: [codec.decompress(b) for b in blobs])


def _baseline(make, raws: list[bytes], repeat: int) -> tuple[int, float, float]:
    compress, decompress = make()
    c_s = d_s = float("inf")
    for _ in range(repeat):
        # ZipNN 0.5 reorders its input's bytes in place, even a bytes object's: every call
        # gets fresh copies, made outside the timed region.
        inputs = [bytes(bytearray(r)) for r in raws]
        start = time.perf_counter()
        blobs = compress(inputs)
        c_s = min(c_s, time.perf_counter() - start)
        start = time.perf_counter()
        back = decompress(blobs)
        d_s = min(d_s, time.perf_counter() - start)
        if [bytes(b) for b in back] != raws:
            raise AssertionError("a baseline compressor did not round-trip")
    return sum(len(b) for b in blobs), c_s, d_s


def run_checkpoint_bench(spec_path: Path, steps: int = 200, repeat: int = 3,
                         compressors: tuple[str, ...] = ("rayzip", "zstd-3", "zstd-19", "zipnn"),
                         log: Callable[[str], None] = print) -> dict:
    torch.set_num_threads(1)
    log(f"training {spec_path.name} with Adam for {steps + max(SPACINGS)} steps ...")
    states = collect_states(spec_path, steps)
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="rayzip-bench-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        views = {data: _bench_view(state) for data, state in states.items()}
        for data, view in views.items():
            raws = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in _tensors(view)]
            raw_bytes = sum(len(r) for r in raws)
            for name in compressors:
                if name == "rayzip":
                    stored, c_s, d_s = _rayzip(view, None if data == "full" else views["full"], tmp, repeat)
                else:
                    make = _zipnn if name == "zipnn" else (lambda level=int(name.split("-")[1]): _zstd(level))
                    # zstd-19 is slow: one timed pass is enough to place it.
                    stored, c_s, d_s = _baseline(make, raws, 1 if name == "zstd-19" else repeat)
                results.append({"data": data, "compressor": name, "raw_bytes": raw_bytes, "stored_bytes": stored,
                                "ratio": raw_bytes / stored, "compress_gbps": raw_bytes / c_s / 1e9,
                                "decompress_gbps": raw_bytes / d_s / 1e9})
                log(f"  {data:9s} {name:8s} ratio {raw_bytes / stored:6.3f}  "
                    f"compress {raw_bytes / c_s / 1e9:6.3f} GB/s  decompress {raw_bytes / d_s / 1e9:6.3f} GB/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"steps": steps, "spacings": list(SPACINGS), "results": results, "comparisons": _comparisons(results)}


def _comparisons(results: list[dict]) -> dict:
    def get(data, name):
        return next((r for r in results if r["data"] == data and r["compressor"] == name), None)

    out = {}
    mine, zipnn = get("full", "rayzip"), get("full", "zipnn")
    if mine and zipnn:
        out["full_ratio_vs_zipnn"] = mine["ratio"] / zipnn["ratio"]
        out["compress_speed_vs_zipnn"] = mine["compress_gbps"] / zipnn["compress_gbps"]
        out["decompress_speed_vs_zipnn"] = mine["decompress_gbps"] / zipnn["decompress_gbps"]
    for k in SPACINGS:
        row = get(f"delta-{k}", "rayzip")
        if row:
            out[f"delta_{k}_ratio"] = row["ratio"]
    return out


def render_table(report: dict):
    from rich.table import Table

    table = Table(title=f"rayzip bench checkpoint: MLP + Adam after {report['steps']} steps (fp32, one thread)")
    for col in ("data", "compressor", "ratio", "compress GB/s", "decompress GB/s"):
        table.add_column(col, justify="left" if col in ("data", "compressor") else "right")
    for r in report["results"]:
        table.add_row(r["data"], r["compressor"], f"{r['ratio']:.3f}", f"{r['compress_gbps']:.3f}",
                      f"{r['decompress_gbps']:.3f}")
    return table
