"""The DDP comm hook: DDP's buckets in, the engine's averaged gradient out.

The hook gathers DDP's buckets into the whole gradient of the trainable parameters, in
parameter order, and hands it to the gradient-exchange engine
(:class:`rayzip.engine.GradientExchange`), which compresses, agrees and averages it segment
by segment. With ``config.overlap`` a worker thread exchanges each segment as soon as
backward has produced it (on CUDA, on a side stream); without it, the exchange runs at the
last bucket. Every bucket's future completes when the step's exchange is done.

A step with compression off (a controller's decision, warm-up, or the lossless ``none``
codec) skips the engine's segments: each bucket is all-reduced in place as DDP's own
allreduce would, with one control word at the last bucket (:mod:`rayzip.torch.dense`).

On a non-finite gradient every rank raises :class:`~rayzip.engine.NonFiniteError`, or with
``on_nonfinite="skip"`` hands DDP a NaN gradient (as plain DDP's would be, so
``GradScaler.step`` skips it and lowers its scale) and sets ``last_step.skipped``.

Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs(config))
    exchange = rayzip.torch.compress(ddp, CompressionConfig(codec="group_topk", density=0.01))
    ...                                   # train as usual
    exchange.set_density(0.05)            # from the next step on; every rank must call it
    exchange.propose(20.0)                # or: one rank proposes, every rank adopts it next step
    print(exchange.last_step)             # bytes_sent, dense_bytes, comm_s of the finished step

With AMP's ``GradScaler``, pass it so that residuals follow the loss scale::

    scaler = torch.amp.GradScaler("cuda")
    exchange = rayzip.torch.compress(ddp, config, grad_scaler=scaler, on_nonfinite="skip")
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .. import cuda
from ..comm import ring_allreduce_bytes
from ..comm.control import bad_key
from ..comm.emulation import Emulation
from ..engine import CompressionConfig, GradientExchange, NonFiniteError
from ..xp import keep_freed_memory
from .dense import DenseSteps
from .optim import default_compression, warn_for_optimizer

__all__ = ["DDPHookState", "compress", "compressed_hook", "ddp_kwargs"]


class DDPHookState:
    """What the hook keeps between DDP's calls: the engine, the flat gradient the buckets are
    copied into, and the step in flight (the worker thread, the buckets' futures).

    Args:
        exchange: the engine; its parameters are ``parameters``, in DDP's order.
        parameters: the trainable parameters (DDP's buckets hold no others).
    """

    def __init__(self, exchange: GradientExchange, parameters: list[torch.Tensor]):
        self.exchange = exchange
        starts = exchange.layout.starts
        self._offsets = {id(p): (starts[i], p.numel()) for i, p in enumerate(parameters)}
        self._segment_of = {id(p): next(k for k, (lo, hi) in enumerate(exchange.segments) if lo <= starts[i] < hi)
                            for i, p in enumerate(parameters) if p.numel()}
        self.overlap = bool(exchange.config.overlap)
        # Dense steps on DDP's buckets, as DDP takes them (see rayzip.torch.dense).
        self.dense_steps = DenseSteps(exchange, self._offsets, self._segment_of)
        self._bucketwise = False  # this step's buckets are all-reduced in place
        self._flat: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._waiting: list[tuple[torch.futures.Future, list[tuple[int, int]], torch.Tensor]] = []
        self._missing: list[int] = []
        self._arrived: list[threading.Event] = []
        self._copied: list = []
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        self._job = None
        self._failure: Exception | None = None
        self._dense_bad: tuple[int, int, bool] | None = None  # the agreed (rank, index, overflow)
        self._copy_s = 0.0
        self._last_bucket_at = 0.0
        self._sent_before = (0, 0)

    def receive(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Copy a bucket into the flat gradient, mark the segments it completes, and start
        the step's exchange: on the worker thread at the first bucket with overlap, else
        inline at the last."""
        start = time.perf_counter()
        buffer = bucket.buffer()
        if bucket.index() == 0:
            self.exchange.begin_step()
            self._bucketwise = self.exchange.goes_whole()
            if self._bucketwise:
                self._start_bucketwise(buffer.device)
            else:
                self._start_flat(buffer.device)
        if self._bucketwise:
            return self._receive_bucketwise(bucket, start)
        spans, completed, pos = [], [], 0
        for p in bucket.parameters():
            offset, n = self._offsets[id(p)]
            self._flat[offset: offset + n].copy_(buffer[pos: pos + n])
            spans.append((offset, n))
            pos += n
            if not n:
                continue
            k = self._segment_of[id(p)]
            self._missing[k] -= n
            if self._missing[k] == 0:
                completed.append(k)
        future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        # The future is listed before its segments are marked: the worker sets the futures it
        # sees once the last segment is done, and one it did not see would never complete.
        self._waiting.append((future, spans, buffer))
        for k in completed:
            if buffer.is_cuda:  # the worker's side stream must see this stream's copies
                self._copied[k] = torch.cuda.Event()
                self._copied[k].record()
            self._arrived[k].set()
        if self.overlap and self._job is None:
            self._job = self._worker().submit(self._run_exchange)
        self._copy_s += time.perf_counter() - start
        if bucket.is_last():
            self._last_bucket_at = time.perf_counter()
            if not self.overlap:
                self._run_exchange()
            # Runs when backward is done, before the step goes on: the step's wait.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
        return future

    def _start_flat(self, device: torch.device) -> None:
        segments = self.exchange.segments
        if self._flat is None or self._flat.device != device:
            self._flat = torch.zeros(self.exchange.numel, dtype=torch.float32, device=device)
            self._out = torch.empty_like(self._flat)
        self._missing = [hi - lo for lo, hi in segments]
        self._arrived = [threading.Event() for _ in segments]
        self._copied = [None] * len(segments)
        for k, missing in enumerate(self._missing):
            if missing == 0:
                self._arrived[k].set()

    # --- dense steps: each bucket all-reduced where it lies ---------------------------------
    def _start_bucketwise(self, device: torch.device) -> None:
        transport = self.exchange.transport
        self._sent_before = (transport.bytes_sent, transport.hops)
        self.exchange.encoder.follow_loss_scale()
        try:
            self.dense_steps.start(device)
        except Exception as exc:  # raised by _finish_step, once DDP has its futures
            self._failure = exc

    def _receive_bucketwise(self, bucket: dist.GradBucket, start: float) -> torch.futures.Future:
        """A dense step's bucket: all-reduced in place; the control word at the last one."""
        buffer = bucket.buffer()
        stats = self.exchange.current
        stats.dense_bytes += ring_allreduce_bytes(4 * buffer.numel(), self.exchange.world)
        stats.numel += buffer.numel()
        stats.buckets.append(buffer.numel())
        future = self.dense_steps.bucket(buffer, bucket.parameters())
        self._copy_s += time.perf_counter() - start
        if bucket.is_last():
            self._last_bucket_at = time.perf_counter()
            exchange = self.exchange
            try:
                index = self.dense_steps.local_bad()
                bad = 0 if index is None else bad_key(exchange.control_rank, exchange.control_world, index)
                agreed, _ = exchange.agree(bad=bad, failure=self._failure)
                self._dense_bad = agreed.bad
            except Exception as exc:
                self._failure = exc
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
        return future

    def _finish_bucketwise(self) -> None:
        exchange = self.exchange
        stats, transport = exchange.current, exchange.transport
        bad, self._dense_bad = self._dense_bad, None
        span_s = self.dense_steps.finish(skip=bad is not None)
        stats.busy_s += span_s
        stats.network_s += span_s
        stats.bytes_sent += transport.bytes_sent - self._sent_before[0]
        stats.hops += transport.hops - self._sent_before[1]
        if bad is not None and self._failure is None:
            # Agreed in the control word: every rank skips (or raises) alike, naming the same rank.
            rank, index, _ = bad
            try:
                exchange.fail_step(f"step {exchange.step}: rank {rank}'s gradient is not finite at "
                                   f"{exchange.layout.where(index)} (compression off)")
            except NonFiniteError as exc:
                self._failure = exc

    # --- compressed steps: the flat gradient through the engine, overlapped with backward ---
    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayzip-exchange")
        return self._executor

    def _wait_for_segment(self, k: int) -> None:
        self._arrived[k].wait()
        if self._copied[k] is not None:
            torch.cuda.current_stream().wait_event(self._copied[k])

    def _run_exchange(self) -> None:
        """The step's exchange, then every bucket's future: the averages, or NaN when the
        step is skipped or failed (a failure is raised by :meth:`_finish_step`)."""
        completed = False
        try:
            with _side_stream(self):
                try:
                    self.exchange.exchange_into(self._flat, self._out, ready=self._wait_for_segment)
                    results = [torch.cat([self._out[o: o + n] for o, n in spans]).to(buffer.dtype)
                               for _, spans, buffer in self._waiting]
                except Exception as exc:
                    results = self._failed(exc)
                # Still on the stream that wrote the results: a CUDA future records its events
                # on the current stream, and DDP's stream waits for those before it reads the
                # results (recorded on another stream, DDP read results still being written).
                completed = True
                self._complete(results)
        except Exception as exc:  # no side stream to be had
            if completed:
                raise
            self._complete(self._failed(exc))

    def _failed(self, exc: Exception) -> list[torch.Tensor]:
        # Raised through DDP's reducer, it would lose its type (DDP casts a future's value
        # to a tensor): DDP gets a NaN gradient and completes, and _finish_step raises.
        self._failure = exc
        return [torch.full((sum(n for _, n in spans),), float("nan"), dtype=buffer.dtype, device=buffer.device)
                for _, spans, buffer in self._waiting]

    def _complete(self, results: list[torch.Tensor]) -> None:
        for (future, _, _), result in zip(self._waiting, results):
            future.set_result(result)

    def _finish_step(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()
        self._waiting = []
        if self._bucketwise:
            self._finish_bucketwise()
        self.exchange.current.comm_s += self._copy_s + time.perf_counter() - self._last_bucket_at
        self._copy_s = 0.0
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        self.exchange.end_step()


@contextmanager
def _side_stream(state: DDPHookState):
    """On CUDA, the exchange runs on the hook's own stream (torch's and cupy's), so that it
    overlaps the backward kernels on the default stream; on the CPU, nothing to do."""
    device = state._flat.device
    if device.type != "cuda":
        yield
        return
    if state._stream is None:
        state._stream = torch.cuda.Stream(device=device)
    with torch.cuda.device(device), torch.cuda.stream(state._stream), cuda.torch_stream(device):
        yield


def compressed_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradient averaged over workers, through the codec.

    Buckets are gathered into the whole gradient, in parameter order, and exchanged in
    fixed segments of whole parameters (``config.segment_mb``), whatever DDP's bucket layout.

    Args:
        state: the hook's state, built by :func:`compress`.
        bucket: DDP's bucket of gradients.
    """
    return state.receive(bucket)


def ddp_kwargs(config: CompressionConfig) -> dict:
    """DDP's arguments for rayzip's hook: with overlap, buckets no larger than a segment, so
    that each segment reaches the hook as soon as backward has produced it (DDP's default
    25 MB buckets would hold most of a small model's gradient until the end of backward).

    Example::

        ddp = DistributedDataParallel(model, **ddp_kwargs(config))
        exchange = compress(ddp, config)
    """
    return {"bucket_cap_mb": config.segment_mb} if config.overlap else {}


def compress(ddp_model: torch.nn.parallel.DistributedDataParallel, config: CompressionConfig | None = None,
             process_group: dist.ProcessGroup | None = None, momentum: float | None = None,
             on_nonfinite: str = "raise", grad_scaler: torch.amp.GradScaler | None = None, adam_betas: tuple[float, float] | None = None,
             emulation: Emulation | None = None, node_key: str | None = None,
             optimizer: torch.optim.Optimizer | str | None = None) -> GradientExchange:
    """Register rayzip's compressed comm hook on ``ddp_model``; returns its engine, whose
    knobs (``set_density``, ``propose``...) and counters (``last_step``, ``totals``) the
    training loop uses.

    Only parameters with ``requires_grad`` are exchanged (frozen layers cost nothing).
    With ``config.overlap`` and no ``process_group``, the hook creates its own group over
    every rank (``dist.new_group``): call it on every rank.

    Args:
        ddp_model: the DDP-wrapped model.
        config: codec, density, collective, segments, corrections; None: the compression
            that holds quality under ``optimizer`` (:func:`rayzip.torch.optim.default_compression`:
            4-bit DCT under Adam, AdamW and other adaptive optimizers, group top-k at 1% under SGD).
        process_group: the ranks to average over (default: the world).
        momentum: with ``config.momentum_correction``, SGD's momentum; build the optimizer
            with momentum 0: the hook applies it, per worker, before compressing.
        on_nonfinite: ``"raise"`` or ``"skip"`` (see the module docstring).
        grad_scaler: AMP's ``GradScaler``, whose scale the residuals then follow.
        adam_betas: with ``config.adam_correction``, Adam's betas; build the optimizer as SGD
            without momentum, weight decay as AdamW's (:func:`rayzip.torch.optim.build_optimizer`
            with ``adam_elsewhere``): the hook sends each worker's Adam direction.
        emulation: a slower link than the real one (:mod:`rayzip.comm.emulation`) for every send.
        node_key: what names this process's node for ``config.hierarchy`` (default:
            ``$RAYZIP_NODE_ID`` or the host name).
        optimizer: the optimizer the training loop uses, or its name ("sgd", "adamw"...): with
            no ``config``, it picks the compression; with one, a sparse codec every step under
            an adaptive optimizer warns once, naming what holds quality there
            (:func:`rayzip.torch.optim.warn_for_optimizer`).

    Example::

        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters())
        exchange = compress(ddp, optimizer=optimizer)     # 4-bit DCT: what holds AdamW's quality
        exchange = compress(ddp, CompressionConfig(codec="group_topk", density=0.01))  # or your own
    """
    if config is None:
        if optimizer is None:
            raise ValueError("compress needs a CompressionConfig, or the optimizer (optimizer=) so that rayzip "
                             "picks the compression that holds quality under it")
        config = default_compression(optimizer)
    else:
        warn_for_optimizer(config, optimizer)
    if config.adam_correction and grad_scaler is not None:
        raise ValueError("adam_correction sends a scale-free Adam direction, which GradScaler would unscale: "
                         "train in bf16 or without GradScaler")
    named = [(name, p) for name, p in ddp_model.module.named_parameters() if p.requires_grad]
    device = named[0][1].device if named else torch.device("cpu")
    keep_freed_memory()  # every step allocates gradient-sized arrays: reuse, do not page-fault them
    if config.overlap and process_group is None:
        # The worker thread's collectives get a group of their own: DDP's (the unused-
        # parameter map, buffer broadcasts) then cannot interleave with them differently on
        # different ranks. Every rank calls compress() at the same point, as new_group needs.
        process_group = dist.new_group(backend=dist.get_backend())
    exchange = GradientExchange(config, sizes=[p.numel() for _, p in named], names=[name for name, _ in named],
                                process_group=process_group, device=device, momentum=momentum,
                                adam_betas=adam_betas, on_nonfinite=on_nonfinite, grad_scaler=grad_scaler,
                                emulation=emulation, node_key=node_key)
    ddp_model.register_comm_hook(DDPHookState(exchange, [p for _, p in named]), compressed_hook)
    return exchange
