"""``rayzip bench checkpoint``: rayzip's checkpoint compression against zstd and ZipNN.

The data come from a real training run: the cluster benchmark's 4.35M-parameter MLP trained
with Adam for ``steps`` steps. ``full`` is weights plus Adam's two moments (fp32) at that
step; ``delta-k`` is the state k steps later, stored by rayzip as an XOR delta against the
``full`` checkpoint. Every compressor runs on the same bytes in the same run:

* ``rayzip``: :func:`rayzip.checkpoint.encode` / ``decode`` in memory, checksums and codec
  choice included, on as many threads as there are usable cores (at most 8);
  ``save_gbps`` / ``load_gbps`` add the writes and reads of a tmpfs directory;
* ``rayzip-1t``: the same on one thread;
* ``zstd-3``, ``zstd-19``: zstandard on the tensors' raw bytes;
* ``zipnn``: ZipNN (PyPI ``zipnn``) on each tensor's raw bytes, as fp32, one thread.

Ratios are raw bytes over stored bytes; speeds are raw GB per second. The compressors take
turns: each round runs every one of them once, so that a slow spell on a shared machine
falls on all of them; the fastest of ``repeat`` rounds (after a warm-up round) counts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


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


class _Runner:
    """One compressor on one data set. Each :meth:`round` times its operations once; the
    fastest time of each operation over the rounds counts."""

    rounds = None  # timed rounds at most, without a warm-up (None: every round, after one)

    def __init__(self):
        self.best: dict[str, float] = {}

    def _time(self, op: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self.best[op] = min(self.best.get(op, float("inf")), time.perf_counter() - start)
        return result

    def round(self) -> None:
        raise NotImplementedError


class _Rayzip(_Runner):
    """Compression and decompression in memory (as the baselines run), then save and load
    through tmpfs files for the cost of the I/O on top."""

    def __init__(self, state: dict, base: Path | None, target: Path, threads: int | None):
        super().__init__()
        self.state, self.base, self.target, self.threads = state, base, target, threads

    def round(self) -> None:
        from .. import checkpoint

        manifest, blobs = self._time("compress", lambda: checkpoint.encode(self.state, base=self.base,
                                                                           threads=self.threads))
        restored = self._time("decompress", lambda: checkpoint.decode(manifest, blobs, threads=self.threads))
        for name, value in self.state["model"].items():  # the benchmark refuses to report a lossy result
            if not torch.equal(value.view(torch.int32), restored["model"][name].view(torch.int32)):
                raise AssertionError(f"rayzip restored {name} inexactly")
        if self.target.exists():
            shutil.rmtree(self.target)
        self._time("save", lambda: checkpoint.save(self.target, self.state, base=self.base, threads=self.threads))
        self._time("load", lambda: checkpoint.load(self.target, threads=self.threads))
        self.stored = manifest["data_bytes"] + len(json.dumps(manifest))


class _Baseline(_Runner):
    def __init__(self, make: Callable, raws: list[bytes], rounds: int | None = None):
        super().__init__()
        self.compress, self.decompress = make()
        self.raws, self.rounds = raws, rounds

    def round(self) -> None:
        # ZipNN 0.5 reorders its input's bytes in place, even a bytes object's: every call
        # gets fresh copies, made outside the timed region.
        inputs = [bytes(bytearray(r)) for r in self.raws]
        blobs = self._time("compress", lambda: self.compress(inputs))
        back = self._time("decompress", lambda: self.decompress(blobs))
        if [bytes(b) for b in back] != self.raws:
            raise AssertionError("a baseline compressor did not round-trip")
        self.stored = sum(len(b) for b in blobs)


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


def run_checkpoint_bench(spec_path: Path, steps: int = 200, repeat: int = 5,
                         compressors: tuple[str, ...] = ("rayzip", "rayzip-1t", "zstd-3", "zstd-19", "zipnn"),
                         log: Callable[[str], None] = print) -> dict:
    """Every compressor runs once per round, in turn, on the same bytes: one warm-up round,
    then ``repeat`` timed rounds, the fastest time of each counting. Interleaving the
    compressors lets a slow spell on a shared machine fall on all of them, not on one."""
    torch.set_num_threads(1)
    log(f"training {spec_path.name} with Adam for {steps + max(SPACINGS)} steps ...")
    states = collect_states(spec_path, steps)
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="rayzip-bench-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        from .. import checkpoint

        views = {data: _bench_view(state) for data, state in states.items()}
        for data, view in views.items():
            raws = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in _tensors(view)]
            raw_bytes = sum(len(r) for r in raws)
            base = None
            if data != "full":
                base = tmp / "base"
                checkpoint.save(base, views["full"])
            runners: dict[str, _Runner] = {}
            for name in compressors:
                if name.startswith("rayzip"):
                    runners[name] = _Rayzip(view, base, tmp / f"ckpt-{name}", 1 if name == "rayzip-1t" else None)
                elif name == "zipnn":
                    runners[name] = _Baseline(_zipnn, raws)
                else:
                    # zstd-19 is slow: one pass, timed, is enough to place it.
                    level = int(name.split("-")[1])
                    runners[name] = _Baseline(lambda level=level: _zstd(level), raws, 1 if level >= 19 else None)
            for runner in runners.values():  # a warm-up round, except for zstd-19's one pass
                if runner.rounds is None:
                    runner.round()
                    runner.best.clear()
            for timed in range(repeat):
                for runner in runners.values():
                    if runner.rounds is None or timed < runner.rounds:
                        runner.round()
            for name, runner in runners.items():
                times = runner.best
                extra = ({"save_gbps": raw_bytes / times["save"] / 1e9, "load_gbps": raw_bytes / times["load"] / 1e9}
                         if "save" in times else {})
                results.append({"data": data, "compressor": name, "raw_bytes": raw_bytes, "stored_bytes": runner.stored,
                                "ratio": raw_bytes / runner.stored, "compress_gbps": raw_bytes / times["compress"] / 1e9,
                                "decompress_gbps": raw_bytes / times["decompress"] / 1e9, **extra})
                row = results[-1]
                log(f"  {data:9s} {name:9s} ratio {row['ratio']:6.3f}  compress {row['compress_gbps']:6.3f} GB/s  "
                    f"decompress {row['decompress_gbps']:6.3f} GB/s"
                    + (f"  (save {extra['save_gbps']:.3f}, load {extra['load_gbps']:.3f} GB/s to tmpfs)" if extra else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"steps": steps, "spacings": list(SPACINGS), "repeat": repeat, "interleaved": True,
            "results": results, "comparisons": _comparisons(results)}


def _comparisons(results: list[dict]) -> dict:
    def get(data, name):
        return next((r for r in results if r["data"] == data and r["compressor"] == name), None)

    out = {}
    zipnn = get("full", "zipnn")
    for name, suffix in (("rayzip", ""), ("rayzip-1t", "_1t")):
        mine = get("full", name)
        if mine and zipnn:
            out[f"full_ratio_vs_zipnn{suffix}"] = mine["ratio"] / zipnn["ratio"]
            out[f"compress_speed_vs_zipnn{suffix}"] = mine["compress_gbps"] / zipnn["compress_gbps"]
            out[f"decompress_speed_vs_zipnn{suffix}"] = mine["decompress_gbps"] / zipnn["decompress_gbps"]
    for k in SPACINGS:
        row = get(f"delta-{k}", "rayzip")
        if row:
            out[f"delta_{k}_ratio"] = row["ratio"]
    return out


def render_table(report: dict):
    from rich.table import Table

    table = Table(title=f"rayzip bench checkpoint: MLP + Adam after {report['steps']} steps (fp32)")
    for col in ("data", "compressor", "ratio", "compress GB/s", "decompress GB/s"):
        table.add_column(col, justify="left" if col in ("data", "compressor") else "right")
    for r in report["results"]:
        table.add_row(r["data"], r["compressor"], f"{r['ratio']:.3f}", f"{r['compress_gbps']:.3f}",
                      f"{r['decompress_gbps']:.3f}")
    return table


def markdown_table(report: dict) -> str:
    """The checkpoint report as the README's Markdown table (generated, not typed)."""
    head = ["data", "compressor", "ratio", "compress GB/s", "decompress GB/s", "save / load GB/s (tmpfs)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        io = (f"{r['save_gbps']:.3f} / {r['load_gbps']:.3f}" if r.get("save_gbps") is not None
              and r.get("load_gbps") is not None else "–")
        lines.append(f"| {r['data']} | {r['compressor']} | {r['ratio']:.3f} | {r['compress_gbps']:.3f} | "
                     f"{r['decompress_gbps']:.3f} | {io} |")
    return "\n".join(lines)
