"""``rayzip bench checkpoint``: rayzip's checkpoint compression against zstd and ZipNN, and the
training stall per checkpoint, on real training state.

Each model (``--model``: ``mlp``, the cluster benchmark's MLP; ``gpt``, the language-model
benchmark's 7.25M-parameter GPT on Python's source; or ``module:function``, see
:func:`user_workload`) is trained with AdamW for ``steps`` steps. The data sets, all from
that run and all measured on the same bytes by every compressor:

* ``weights``: the model's parameters (fp32; tied ones once); ``bf16-weights``: the same cast
  to bf16, as mixed-precision training checkpoints them;
* ``m``, ``v``: AdamW's first and second moments;
* ``all``: weights, m and v together, the whole checkpoint;
* ``delta-k``: ``all`` k steps later, stored by rayzip as an XOR delta against ``all``
  (zstd and ZipNN keep no base and see the raw bytes).

Compressors: ``rayzip`` (:func:`rayzip.checkpoint.encode` / ``decode`` in memory, codec
choice and checksums included, on the usable cores, at most 8; ``save_gbps`` / ``load_gbps``
add the writes and reads of a tmpfs directory), ``rayzip-1t`` (one thread), ``zipnn-1t`` and
``zipnn`` (ZipNN, PyPI ``zipnn``, on each tensor's raw bytes with its dtype, one thread and
its default threads), ``zstd-3`` and ``zstd-19`` (on the raw bytes).

Ratios are raw bytes over stored bytes; speeds are raw GB per second. The compressors take
turns: each round runs every one of them once, so that a slow spell on a shared machine
falls on all of them, in a rotation that moves one compressor on every second round and runs
every second round in reverse, so that none always follows the same one, and each follows
its neighbours as often as it precedes them. Each timed operation starts with its input out
of the caches. A round runs every data set of a model, so that each one's rounds are spread
over the model's whole measurement. The fastest of the timed rounds (after a warm-up
round) counts. There are ``repeat`` of them, or more (up to ``MOST_ROUNDS``) until a model's
rounds have taken ``min_seconds``.

The stall (``stall``, GPT by default): a training loop on the same model checkpoints every
few steps, in turn with rayzip in the background (:class:`rayzip.checkpoint.background.
BackgroundWriter`, as ``rayzip run`` does), rayzip written before the next step, and
``torch.save``; per checkpoint it reports the time the loop waited and how much slower the
steps ran while a background write was in flight.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch


__all__ = ["COMPRESSORS", "DEFAULT_COMPRESSORS", "MODELS", "Workload", "build_workload", "collect_states",
           "measure_stall", "run_checkpoint_bench", "threads_markdown_table", "user_workload"]

SPACINGS = (1, 10, 100)
MODELS = ("mlp", "gpt")
COMPRESSORS = ("rayzip", "rayzip-1t", "zipnn-1t", "zipnn", "zstd-3", "zstd-19")
DEFAULT_COMPRESSORS = ("rayzip", "rayzip-1t", "zipnn-1t", "zipnn", "zstd-3")
JOBS = Path(__file__).resolve().parent / "specs"  # the benchmarks' specs ship with the package


@dataclass
class Workload:
    """A model and how to train it: ``loss(model, generator)`` draws a batch and returns its
    loss; ``optimizer`` builds the AdamW it is trained with."""

    name: str
    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, torch.Generator], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]


def _adamw(lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.01):
    return lambda params: torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def build_workload(model: str, spec_path: Path | None = None, seed: int = 0) -> Workload:
    """``mlp`` (the spec's model and data, default jobs/bench-synthetic.yaml), ``gpt``
    (jobs/bench-gpt.yaml's model, optimizer settings and text, 8 windows a step), or a
    ``module:function`` (:func:`user_workload`)."""
    from ..spec import import_callable, load_spec

    torch.manual_seed(seed)
    if model == "mlp":
        from ..train.data import load_dataset
        from ..train.models import build_model

        spec = load_spec(spec_path or JOBS / "bench-synthetic.yaml")
        x, y, _, _ = load_dataset(spec.dataset, seed)
        net = build_model(spec.model, x.shape[1], int(y.max()) + 1)
        batch = spec.training.batch_size

        def loss(m, generator):
            idx = torch.randint(0, len(x), (batch,), generator=generator)
            device = next(m.parameters()).device
            return torch.nn.functional.cross_entropy(m(x[idx].to(device)), y[idx].to(device))

        return Workload("mlp", net, loss, _adamw())
    if model == "gpt":
        from ..train.gpt import GPT, lm_loss
        from ..train.text import Windows, load_python_stdlib

        spec = load_spec(JOBS / "bench-gpt.yaml")
        m, training = spec.model, spec.training
        text = load_python_stdlib(spec.dataset.validation_fraction, spec.dataset.max_bytes)
        windows = Windows(text.train, m.context)
        net = GPT(vocab=256, layers=m.layers, width=m.width, heads=m.heads, context=m.context)

        def loss(model_, generator):
            idx = torch.randint(0, len(windows), (8,), generator=generator)
            x, y = zip(*(windows[int(i)] for i in idx))
            device = next(model_.parameters()).device
            return lm_loss(model_(torch.stack(x).to(device)), torch.stack(y).to(device))

        return Workload("gpt", net, loss, _adamw(training.lr, training.betas, training.weight_decay))
    net, loss = import_callable(model)()
    return Workload(model, net, loss, _adamw())


def user_workload():
    """What ``--model module:function`` calls: ``function()`` returns ``(model, loss)``, where
    ``loss(model, generator)`` draws a batch with the torch generator and returns its loss.
    This one is an example: a small convolutional network on random images."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    net(torch.zeros(1, 3, 16, 16))

    def loss(model, generator):
        x = torch.randn(16, 3, 16, 16, generator=generator)
        return torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,), generator=generator))

    return net, loss


def collect_states(workload: Workload, steps: int, seed: int = 0) -> dict[str, dict]:
    """{'full': state at ``steps``, 'delta-k': state k steps later} from an AdamW run."""
    model = workload.model
    optimizer = workload.optimizer(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    marks = {steps: "full", **{steps + k: f"delta-{k}" for k in SPACINGS}}
    states = {}
    for step in range(1, max(marks) + 1):
        optimizer.zero_grad()
        workload.loss(model, generator).backward()
        optimizer.step()
        if step in marks:
            states[marks[step]] = _snapshot(model, optimizer)
    return states


def _snapshot(model, optimizer) -> dict:
    opt = optimizer.state_dict()
    return {"model": {k: v.detach().clone() for k, v in _parameters(model).items()},
            "optimizer": {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
                          "param_groups": opt["param_groups"]}}


def _parameters(model) -> dict:
    """The state dict with tied tensors once (a tied GPT's head is its token embedding)."""
    seen, out = set(), {}
    for name, value in model.state_dict().items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key not in seen:
            seen.add(key)
            out[name] = value
    return out


def _bench_view(state: dict) -> dict:
    """The weights and AdamW's moments (not the step counters)."""
    return {"model": state["model"],
            "optimizer": {i: {k: v for k, v in s.items() if v.numel() > 1} for i, s in state["optimizer"]["state"].items()}}


def data_sets(states: dict) -> dict[str, tuple[dict, str | None]]:
    """{name: (state, the data set it is a delta against, or None)}."""
    full = _bench_view(states["full"])
    moments = full["optimizer"]
    sets = {
        "weights": ({"model": full["model"]}, None),
        "m": ({"optimizer": {i: {"exp_avg": s["exp_avg"]} for i, s in moments.items()}}, None),
        "v": ({"optimizer": {i: {"exp_avg_sq": s["exp_avg_sq"]} for i, s in moments.items()}}, None),
        "all": (full, None),
        "bf16-weights": ({"model": {k: v.to(torch.bfloat16) for k, v in full["model"].items()}}, None),
    }
    for k in SPACINGS:
        sets[f"delta-{k}"] = (_bench_view(states[f"delta-{k}"]), "all")
    return sets


def entropy_bound(tensors: list[torch.Tensor]) -> dict[str, float] | None:
    """What an ideal coder of each float tensor's sign and exponent, with the mantissa stored
    as it is, would reach: raw bytes over its bits, with each tensor's own empirical entropy
    of those bits, order 0 (each value alone) and order 1 (given the value before). The
    mantissa of trained weights and moments is near-random, so a lossless float coder that
    codes exponents, as rayzip and ZipNN do, lands near this. None for other dtypes."""
    import numpy as np

    raw = order0 = order1 = 0.0
    for tensor in tensors:
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        width, top = {torch.float32: (32, 9), torch.bfloat16: (16, 9), torch.float16: (16, 6)}[tensor.dtype]
        words = tensor.contiguous().view({32: torch.int32, 16: torch.int16}[width]).numpy().view(f"u{width // 8}")
        prefix = (words.ravel() >> (width - top)).astype(np.int64)
        h0 = _entropy(np.bincount(prefix, minlength=1 << top))
        h1 = h0
        if prefix.size > 1:
            pairs = np.bincount(prefix[:-1] << top | prefix[1:], minlength=1 << (2 * top))
            h1 = min(h0, _entropy(pairs) - _entropy(np.bincount(prefix[:-1], minlength=1 << top)))
        raw += width * prefix.size
        order0 += prefix.size * (h0 + width - top)
        order1 += prefix.size * (h1 + width - top)
    return {"order0": raw / order0, "order1": raw / order1}


def _entropy(counts) -> float:
    import numpy as np

    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _tensors(view: dict) -> list[torch.Tensor]:
    return [*view.get("model", {}).values(), *(v for s in view.get("optimizer", {}).values() for v in s.values())]


EVICT_BYTES = 64 << 20  # twice the last-level cache of this project's machines (32 MB)
_evicting: list = []


def _evict_caches() -> None:
    """Read and write EVICT_BYTES of other memory, so that a timed operation finds no input of
    its own in the CPU's caches. Without it, what ran just before decided: a baseline's input
    is a fresh copy (in cache), rayzip's the state itself, and in a throwaway script on the
    GPT's weights (eight rounds, each order in turn) two threads' encode and decode took 4%
    less at the median right after one thread's than after other work (36.7 against 38.1 ms),
    9% less at best; one thread's the same at the median right after two threads'."""
    import numpy as np

    if not _evicting:
        _evicting.append(np.zeros(EVICT_BYTES, dtype=np.uint8))
    np.bitwise_xor(_evicting[0], 1, out=_evicting[0])


class _Runner:
    """One compressor on one data set. Each :meth:`round` times its operations once, each
    after evicting the caches; the fastest time of each operation over the rounds counts,
    and the median is reported beside it."""

    rounds = None  # timed rounds at most, without a warm-up (None: every round, after one)

    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def _time(self, op: str, fn: Callable[[], Any]) -> Any:
        _evict_caches()
        start = time.perf_counter()
        result = fn()
        self.times.setdefault(op, []).append(time.perf_counter() - start)
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
        for n, (value, back) in enumerate(zip(_tensors(self.state), _tensors(restored), strict=True)):
            words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()]
            if not torch.equal(value.view(words), back.view(words)):  # the benchmark refuses a lossy result
                raise AssertionError(f"rayzip restored tensor {n} inexactly")
        if self.target.exists():
            shutil.rmtree(self.target)
        self._time("save", lambda: checkpoint.save(self.target, self.state, base=self.base, threads=self.threads))
        self._time("load", lambda: checkpoint.load(self.target, threads=self.threads))
        self.stored = manifest["data_bytes"] + len(checkpoint.store.manifest_bytes(manifest))


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


def _zipnn(dtype: str, threads: int):
    from zipnn import ZipNN

    codec = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=threads)
    return (lambda raws: [codec.compress(r) for r in raws],
            lambda blobs: [codec.decompress(b) for b in blobs])


def _runner(name: str, view: dict, raws: list[bytes], base: Path | None, target: Path, dtype: str) -> _Runner:
    if name.startswith("rayzip"):
        return _Rayzip(view, base, target, 1 if name == "rayzip-1t" else None)
    if name.startswith("zipnn"):
        return _Baseline(lambda: _zipnn(dtype, 1 if name == "zipnn-1t" else 0), raws)
    level = int(name.split("-")[1])  # zstd-19 is slow: one timed pass is enough to place it
    return _Baseline(lambda: _zstd(level), raws, 1 if level >= 19 else None)


MOST_ROUNDS = 40


def _turns(runners: list, round_: int) -> list:
    """The order of one round: a rotation, one compressor further on every second round, and
    every second round in reverse. Over each two rounds every compressor follows each of its
    neighbours as often as it precedes it (in a plain rotation rayzip-1t ran right after
    rayzip in four rounds of five, rayzip never right after rayzip-1t), so that what a
    compressor leaves behind beyond the caches (:func:`_evict_caches`) falls on all alike."""
    start = round_ // 2 % len(runners)
    order = runners[start:] + runners[:start]
    return order[::-1] if round_ % 2 else order


def run_checkpoint_bench(spec_path: Path | None = None, steps: int = 200, repeat: int = 11,
                         compressors: tuple[str, ...] = DEFAULT_COMPRESSORS, models: tuple[str, ...] = MODELS,
                         stall_model: str | None = "gpt", stall_rounds: int = 5, stall_every: int = 5,
                         log: Callable[[str], None] = print, min_seconds: float = 30.0,
                         stall_device: str = "cpu") -> dict:
    """Every compressor runs once per round on every data set, in turn (a rotation), on the
    same bytes: one warm-up round, then ``repeat`` timed rounds, or more until a model's have
    taken ``min_seconds`` (at most ``MOST_ROUNDS``), the fastest time of each counting.
    Interleaving the compressors lets a slow spell on a shared machine fall on all of them,
    not on one. Then, unless ``stall_model`` is None, :func:`measure_stall` on that model,
    trained on ``stall_device``."""
    torch.set_num_threads(1)
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="rayzip-bench-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        from .. import checkpoint

        for model in models:
            workload = build_workload(model, spec_path)
            log(f"training {workload.name} with AdamW for {steps + max(SPACINGS)} steps ...")
            sets = data_sets(collect_states(workload, steps))
            bases: dict[str, Path] = {}
            prepared = []  # (data, tensors, raw bytes, bound, runners), every data set's
            for data, (view, against) in sets.items():
                tensors = _tensors(view)
                raws = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
                if against is not None and against not in bases:
                    bases[against] = tmp / f"base-{model}-{against}"
                    checkpoint.save(bases[against], sets[against][0])
                dtype = "bfloat16" if tensors[0].dtype == torch.bfloat16 else "float32"
                runners = {name: _runner(name, view, raws, bases.get(against), tmp / f"ckpt-{data}-{name}", dtype)
                           for name in compressors}
                for runner in runners.values():  # a warm-up round, except for zstd-19's one pass
                    if runner.rounds is None:
                        runner.round()
                        runner.times.clear()
                prepared.append((data, tensors, sum(len(r) for r in raws),
                                 entropy_bound(tensors) if against is None else None, runners))
            # A round runs every data set once, so that a data set's rounds are spread over the
            # whole measurement and each encode follows other work, as a checkpoint taken during
            # training does (back to back, a data set's later rounds found their buffers, caches
            # and threads warm from the round before). Within a data set the compressors take
            # turns in the order of _turns: in a fixed order rayzip always followed zstd-3 and
            # ZipNN, which made its two threads look slower than its one thread.
            started, rounds = time.perf_counter(), 0
            while rounds < repeat or (rounds < MOST_ROUNDS and time.perf_counter() - started < min_seconds):
                for *_, runners in prepared:
                    for runner in _turns(list(runners.values()), rounds):
                        if runner.rounds is None or rounds < runner.rounds:
                            runner.round()
                rounds += 1
            for data, tensors, raw_bytes, bound, runners in prepared:
                for name, runner in runners.items():
                    times = {op: min(spent) for op, spent in runner.times.items()}
                    medians = {op: statistics.median(spent) for op, spent in runner.times.items()}
                    extra = ({"save_gbps": raw_bytes / times["save"] / 1e9, "load_gbps": raw_bytes / times["load"] / 1e9}
                             if "save" in times else {})
                    row = {"model": workload.name, "data": data, "compressor": name, "tensors": len(tensors),
                           "rounds": rounds if runner.rounds is None else min(rounds, runner.rounds),
                           "raw_bytes": raw_bytes, "stored_bytes": runner.stored, "ratio": raw_bytes / runner.stored,
                           "compress_gbps": raw_bytes / times["compress"] / 1e9,
                           "decompress_gbps": raw_bytes / times["decompress"] / 1e9, **extra,
                           "compress_median_gbps": raw_bytes / medians["compress"] / 1e9,
                           "decompress_median_gbps": raw_bytes / medians["decompress"] / 1e9,
                           "bound_order0": bound and bound["order0"], "bound_order1": bound and bound["order1"]}
                    results.append(row)
                    log(f"  {workload.name:4s} {data:12s} {name:9s} ratio {row['ratio']:6.3f}  compress "
                        f"{row['compress_gbps']:6.3f} GB/s  decompress {row['decompress_gbps']:6.3f} GB/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"steps": steps, "spacings": list(SPACINGS), "repeat": repeat, "min_seconds": min_seconds,
              "interleaved": True,
              "models": list(models), "results": results, "comparisons": _comparisons(results)}
    if stall_model is not None:
        log(f"training stall per checkpoint on {stall_model} ...")
        report["stall"] = measure_stall(build_workload(stall_model, spec_path), stall_rounds, stall_every, log=log,
                                        device=stall_device)
    return report


STALL_METHODS = ("rayzip-background", "rayzip-sync", "torch.save")
GPU_CODING = "rayzip-sync, GPU coding"


def measure_stall(workload: Workload, rounds: int = 5, every: int = 5, directory: Path | None = None,
                  log: Callable[[str], None] = print, device: str = "cpu") -> dict:
    """The time a training loop waits per checkpoint of its model and AdamW state, for each of
    :data:`STALL_METHODS`: rayzip in the background, as ``rayzip run`` takes it
    (:class:`~rayzip.train.checkpoints.GroupCheckpoints` guarding the optimizer: the snapshot
    of what is not left to the writer, the optimizer's next step waiting for the copies that
    are, and any wait for the previous write at the next checkpoint), rayzip written before
    the next step, and ``torch.save``. The loop trains ``every`` steps between checkpoints; the methods take
    turns, ``rounds`` checkpoints each, into files under ``directory`` (default: the temporary
    directory). The background snapshots reuse the host tensors of the one before, once it is
    written, as ``rayzip run`` does (the first round's pays for fresh memory). Also: the mean step time while a background write was in flight against the
    steps with no checkpoint work, as ``step_slowdown``. On ``device`` "cuda" the model trains
    on the GPU, and every method's time includes its copies of the state to the host."""
    from .. import checkpoint
    from ..train.checkpoints import GroupCheckpoints, Parts

    model = workload.model.to(device)
    optimizer = workload.optimizer(model.parameters())
    generator = torch.Generator().manual_seed(1)
    root = Path(tempfile.mkdtemp(prefix="rayzip-stall-", dir=directory))
    background = GroupCheckpoints(world=1, device=device, background=True)
    background.guard(optimizer)
    # On the GPU, also the synchronous save with its Huffman streams coded on the GPU.
    methods = STALL_METHODS + ((GPU_CODING,) if device != "cpu" else ())
    stalls: dict[str, list[float]] = {m: [] for m in methods}
    quiet_steps, busy_steps = [], []

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        workload.loss(model, generator).backward()
        optimizer.step()
        if device != "cpu":
            torch.cuda.synchronize()  # a step's time, not its launches'
        return time.perf_counter() - start

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    try:
        for _ in range(3):  # the optimizer's state exists, the allocator is warm
            step()
        order = list(methods)
        for r in range(rounds):
            for method in order[r % len(order):] + order[: r % len(order)]:
                target = root / f"{method}-{r}"
                start, stalled = time.perf_counter(), background.stall_s
                if method == "rayzip-background":
                    background.save(target, lambda copy: Parts(0, 1, copy(state()), None),
                                    lambda parts, target=target: checkpoint.save(target, parts.trainer))
                elif method == "rayzip-sync":
                    checkpoint.save(target, state())
                elif method == GPU_CODING:
                    checkpoint.save(target, state(), gpu_coding=True)
                else:
                    torch.save(state(), target)
                stall = time.perf_counter() - start
                for _ in range(every):
                    in_flight = background.pending is not None and not background.writer.done()
                    (busy_steps if in_flight else quiet_steps).append(step())
                if method == "rayzip-background":
                    # What the loop waited for since the save: the optimizer's step for the
                    # deferred copies, and the write (the next checkpoint would wait for it).
                    background.flush()
                    stall = background.stall_s - stalled
                stalls[method].append(stall)
                log(f"  {method:18s} stall {stall * 1e3:8.1f} ms")
    finally:
        background.close()
        shutil.rmtree(root, ignore_errors=True)
    rows = [{"method": m, "stall_s": statistics.median(v), "stalls_s": v} for m, v in stalls.items()]
    sync = statistics.median(stalls["rayzip-sync"])
    for row in rows:
        row["vs_rayzip_sync"] = row["stall_s"] / sync
    quiet = statistics.median(quiet_steps) if quiet_steps else None
    busy = statistics.median(busy_steps) if busy_steps else None
    return {"model": workload.name, "device": _device_name(device), "every": every, "rounds": rounds, "rows": rows,
            "step_s": quiet, "step_s_during_write": busy,
            "step_slowdown": busy / quiet if quiet and busy else None,
            "steps_during_write": len(busy_steps)}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device != "cpu" else "cpu"


def _comparisons(results: list[dict]) -> dict:
    """Per model: rayzip against ZipNN (ratio on ``all`` and on ``weights``; compression and
    decompression speed on ``all`` against ZipNN on one thread, rayzip on its default threads
    and on one), the delta ratios, and the least speed-up of rayzip's threads over one thread
    across the data sets; each speed comparison of the fastest rounds, and with ``_median``
    of the medians."""
    out: dict[str, dict] = {}
    threads = _thread_speedups(results)
    for model in dict.fromkeys(r["model"] for r in results):
        def get(data, name):
            return next((r for r in results if r["model"] == model and r["data"] == data and r["compressor"] == name),
                        None)

        mine: dict[str, float] = {}
        for data in ("all", "weights"):
            rayzip, zipnn = get(data, "rayzip"), get(data, "zipnn-1t") or get(data, "zipnn")
            if rayzip and zipnn:
                mine[f"{data}_ratio_vs_zipnn"] = rayzip["ratio"] / zipnn["ratio"]
        zipnn_1t = get("all", "zipnn-1t")
        for speed, tail in (("gbps", ""), ("median_gbps", "_median")):  # fastest rounds, and medians
            for op in ("compress", "decompress"):
                field = f"{op}_{speed}"
                for name, suffix in (("rayzip", ""), ("rayzip-1t", "_1t")):
                    row = get("all", name)
                    if row and zipnn_1t and field in zipnn_1t:
                        mine[f"{op}_speed_vs_zipnn_1t{suffix}{tail}"] = row[field] / zipnn_1t[field]
                speedups = [each[field] for (of, _), each in threads.items() if of == model and field in each]
                if speedups:
                    mine[f"threads_{op}_speedup_min{tail}"] = min(speedups)
        for k in SPACINGS:
            row = get(f"delta-{k}", "rayzip")
            if row:
                mine[f"delta_{k}_ratio"] = row["ratio"]
        out[model] = mine
    return out


def render_table(report: dict):
    from rich.table import Table

    table = Table(title=f"rayzip bench checkpoint: AdamW state after {report['steps']} steps")
    for col in ("model", "data", "compressor", "ratio", "compress GB/s", "decompress GB/s"):
        table.add_column(col, justify="left" if col in ("model", "data", "compressor") else "right")
    for r in report["results"]:
        table.add_row(r["model"], r["data"], r["compressor"], f"{r['ratio']:.3f}", f"{r['compress_gbps']:.3f}",
                      f"{r['decompress_gbps']:.3f}")
    return table


def markdown_table(report: dict) -> str:
    """The checkpoint report as the README's Markdown table (generated, not typed): one row
    per model, data set and compressor, with the entropy bound of coding sign and exponent
    (order 0 / order 1) where the data set is not a delta."""
    head = ["model", "data", "compressor", "ratio", "compress GB/s", "decompress GB/s", "save / load GB/s (tmpfs)",
            "bound o0 / o1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        io_ = (f"{r['save_gbps']:.3f} / {r['load_gbps']:.3f}" if r.get("save_gbps") is not None
               and r.get("load_gbps") is not None else "–")
        bound = (f"{r['bound_order0']:.3f} / {r['bound_order1']:.3f}" if r.get("bound_order0") is not None
                 and r.get("bound_order1") is not None else "–")
        lines.append(f"| {r.get('model', 'mlp')} | {r['data']} | {r['compressor']} | {r['ratio']:.3f} | "
                     f"{r['compress_gbps']:.3f} | {r['decompress_gbps']:.3f} | {io_} | {bound} |")
    return "\n".join(lines)


SPEED_FIELDS = ("compress_gbps", "compress_median_gbps", "decompress_gbps", "decompress_median_gbps")


def _thread_speedups(results: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (model, data set) with both rows: rayzip's speed on its default threads over
    ``rayzip-1t``'s, for each of SPEED_FIELDS both rows have (older reports have no medians)."""
    rows = {(r["model"], r["data"], r["compressor"]): r for r in results}
    return {(model, data): {field: many[field] / one[field] for field in SPEED_FIELDS if field in many and field in one}
            for (model, data, name), many in rows.items()
            if name == "rayzip" and (one := rows.get((model, data, "rayzip-1t"))) is not None}


def threads_markdown_table(report: dict) -> str | None:
    """rayzip on its default threads against one thread, per model and data set: the ratio of
    their speeds in their fastest rounds (what the main table shows), and of their medians
    where the report has them. None if the report has no ``rayzip-1t`` rows."""
    lines = ["| model | data | compress, fastest | compress, median | decompress, fastest | decompress, median |",
             "|---|---|---|---|---|---|"]
    for (model, data), speedups in _thread_speedups(report["results"]).items():
        cells = [f"{speedups[field]:.2f}×" if field in speedups else "–" for field in SPEED_FIELDS]
        lines.append(f"| {model} | {data} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else None


def stall_markdown_table(stall: dict) -> str:
    """The stall measurement as a Markdown table: per method, the median time the loop waited
    per checkpoint and its ratio to rayzip's sync save; then the steps taken while a
    background write was in flight against those without."""
    lines = ["| method | stall per checkpoint | vs rayzip sync | every checkpoint (ms) |", "|---|---|---|---|"]
    for row in stall["rows"]:
        each = ", ".join(f"{s * 1e3:.1f}" for s in row["stalls_s"])
        lines.append(f"| {row['method']} | {row['stall_s'] * 1e3:.1f} ms | {row['vs_rayzip_sync']:.3f} | {each} |")
    if stall.get("step_slowdown") is not None:
        lines.append(f"| steps during a background write | {stall['step_s_during_write'] * 1e3:.0f} ms a step | "
                     f"{stall['step_slowdown']:.2f}× the {stall['step_s'] * 1e3:.0f} ms without | "
                     f"{stall['steps_during_write']} steps |")
    return "\n".join(lines)
