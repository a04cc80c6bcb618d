"""Checkpoints that training does not wait for: a host snapshot now, compression and writes
on a thread while the next steps run.

:func:`snapshot` copies every tensor of a state nest to host memory (a device-to-host copy
for CUDA tensors, a memory copy for CPU ones), so that the optimizer steps that follow cannot
change what is being written. :class:`BackgroundWriter` runs one write at a time on its own
thread; a write submitted while the previous one is still running waits for it (the caller
learns how long), so checkpoints are written, and can be registered, in order.

The copies of tensors that only an optimizer's step changes (its parameters and its state)
can be left to the writer's thread: with ``defer=Deferred.for_optimizer(optimizer)``, the
snapshot copies the rest now and those later, while the next step's forward and backward run,
and :meth:`Deferred.guard` makes the optimizer's next ``step()`` wait until they are made.

A write that dies half-way (the process killed, the disk full) leaves a directory without
a manifest (``manifest.json.zst``), which :func:`rayzip.checkpoint.load` refuses; whoever registers a
checkpoint (Ray Train, a scheduler) must do so only after :meth:`BackgroundWriter.wait`
returned without raising.

Usage::

    writer = BackgroundWriter()
    state = snapshot({"model": model.state_dict(), "optimizer": opt.state_dict()})
    writer.submit(lambda: checkpoint.save(directory, state))   # returns at once
    ...                                                          # training goes on
    writer.wait()                                                # raises what the write raised

    deferred = Deferred.for_optimizer(opt)                       # parameters and moments: later
    state = snapshot({"model": model.state_dict(), "optimizer": opt.state_dict()}, defer=deferred)
    writer.submit(lambda: checkpoint.save(directory, state), first=deferred.finish)
    deferred.guard(opt)                                          # opt.step() waits for the copies
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from ..xp import is_dtensor, is_torch
from .crew import Crew

__all__ = ["BackgroundWriter", "Deferred", "SnapshotBuffers", "snapshot"]


class SnapshotBuffers:
    """Host tensors kept from one snapshot for the next: a snapshot into fresh memory spends
    most of its time on the kernel's first touch of every page, so a writer that is done
    with a snapshot hands its tensors back (:meth:`release`) and the next one copies into them.

    Usage::

        buffers = SnapshotBuffers()
        taken = snapshot(state, buffers=buffers)
        ...                                      # written
        buffers.release(taken)
    """

    def __init__(self) -> None:
        self.free: dict[tuple, list] = {}

    def take(self, shape: tuple, dtype) -> Any:
        kept = self.free.get((tuple(shape), dtype))
        return kept.pop() if kept else torch.empty(shape, dtype=dtype, device="cpu")

    def release(self, nest: Any) -> None:
        """Every torch tensor of ``nest`` (a snapshot no one reads any more) becomes reusable."""
        seen: set[int] = set()
        for tensor in _torch_leaves(nest):
            if id(tensor) not in seen and tensor.device.type == "cpu" and tensor.is_contiguous():
                seen.add(id(tensor))
                self.free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)


def _torch_leaves(obj: Any):
    if is_torch(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _torch_leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _torch_leaves(value)


def snapshot(state: Any, threads: int | None = None, buffers: SnapshotBuffers | None = None,
             defer: Deferred | None = None) -> Any:
    """``state`` with every tensor (torch, numpy, cupy) copied to host memory, a DTensor as a
    DTensor of the same layout over a copy of its own shard; containers are rebuilt, other
    leaves kept. Tensors that share storage (tied weights) share their copy.
    Torch tensors are copied by a :class:`~rayzip.checkpoint.crew.Crew` of ``threads``
    threads (default: the usable cores, at most 8), since the loop waits for the copy, into
    ``buffers`` where it has them; the calling thread copies too, and no threads are started
    per snapshot. Those on the storage ``defer`` covers are left to it: the returned nest
    holds their host tensors, filled once ``defer.finish()`` has run."""
    copies: dict[tuple, Any] = {}
    nest = _copy(state, copies, buffers or SnapshotBuffers())
    now = []
    for source, target in copies.values():
        (defer.jobs if defer is not None and defer.covers(source) else now).append((source, target))
    _copy_all(now, threads)
    return _fill(nest, copies)


def _copy_all(jobs: list[tuple[Any, Any]], threads: int | None) -> None:
    with Crew(threads) as crew:
        done = [crew.submit(target.copy_, source) for source, target in jobs]
        for future in done:
            crew.result(future)


class Deferred:
    """Copies a snapshot leaves for later: of the host tensors on the storages it covers (an
    optimizer's parameters and state, which change only in its ``step()``). The writer's
    thread makes them (:meth:`finish`) before it compresses; the optimizer's next ``step()``
    waits for them (:meth:`guard`), so the snapshot still holds the state at the checkpoint.

    Why: the loop had waited for a copy of the whole state, 10 ms for the GPT workload's 87 MB
    on this 2-core VM, 12% of a sync save in the checkpoint benchmark; the forward and
    backward of the next step take 0.5 s, and change neither parameters nor moments."""

    def __init__(self, storages: set[int] | None = None):
        self.storages = storages or set()
        self.jobs: list[tuple[Any, Any]] = []
        self.done = threading.Event()
        self.waited_s = 0.0

    @classmethod
    def for_optimizer(cls, optimizer) -> Deferred:
        """Covering ``optimizer``'s parameters and its state's tensors."""
        storages = {p.untyped_storage().data_ptr() for group in optimizer.param_groups for p in group["params"]}
        storages |= {t.untyped_storage().data_ptr() for values in optimizer.state.values()
                     for t in values.values() if isinstance(t, torch.Tensor)}
        return cls(storages)

    def covers(self, tensor) -> bool:
        """Host tensors only: a device-to-host copy made on another thread would queue behind
        the next step's kernels on the device, so CUDA state is still copied at once."""
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self.storages

    def finish(self, threads: int | None = None) -> None:
        """Make the copies (the writer's thread, before it reads the snapshot)."""
        try:
            _copy_all(self.jobs, threads)
        finally:
            self.jobs = []
            self.done.set()

    def cancel(self) -> None:
        """Nothing will make the copies (the checkpoint failed before its write started): a
        step waiting for them goes on."""
        self.jobs = []
        self.done.set()

    def wait(self) -> float:
        """Block until :meth:`finish` (or :meth:`cancel`) has run; the seconds waited."""
        if self.done.is_set():
            return 0.0
        start = time.perf_counter()
        self.done.wait()
        waited = time.perf_counter() - start
        self.waited_s += waited
        return waited

    def guard(self, optimizer) -> Any:
        """``optimizer.step()`` waits for :meth:`finish` until it has run; returns the hook's
        handle (removing it is optional: once finished, the hook returns at once)."""
        def before_step(*_) -> None:  # a step pre-hook returning anything else replaces step's arguments
            self.wait()

        return optimizer.register_step_pre_hook(before_step)


class _Slot:
    """Where a torch tensor's copy goes, until the copies are made."""

    def __init__(self, key: tuple):
        self.key = key


class _Shard:
    """A DTensor (a sharded model's parameter or optimizer state) whose local shard goes to
    a slot: filled, it is a DTensor of the same layout over the shard's host copy."""

    def __init__(self, local: _Slot, like):
        self.local, self.mesh, self.placements = local, like.device_mesh, like.placements
        self.shape, self.stride = like.shape, like.stride()


def _fill(obj: Any, copies: dict) -> Any:
    if isinstance(obj, _Slot):
        return copies[obj.key][1]
    if isinstance(obj, _Shard):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(_fill(obj.local, copies), obj.mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride)
    if isinstance(obj, dict):
        return {key: _fill(value, copies) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_fill(value, copies) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(value, copies) for value in obj)
    return obj


def _copy(obj: Any, copies: dict, buffers: SnapshotBuffers) -> Any:
    if is_dtensor(obj):  # its own shard, copied as any tensor is
        return _Shard(_copy(obj.to_local(), copies, buffers), obj)
    if is_torch(obj):
        key = ("torch", obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape),
               tuple(obj.stride()), obj.dtype, str(obj.device))
        if key not in copies:
            source = obj.detach()
            copies[key] = (source, buffers.take(tuple(source.shape), source.dtype))
        return _Slot(key)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if type(obj).__module__.startswith("cupy"):
        return obj.get()
    if isinstance(obj, dict):
        return {key: _copy(value, copies, buffers) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_copy(value, copies, buffers) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_copy(value, copies, buffers) for value in obj)
    return obj


class BackgroundWriter:
    """One thread, one write at a time, in submission order."""

    def __init__(self, delay_s: float = 0.0) -> None:
        # Fault injection: each write first sleeps delay_s, so that a test can kill a worker
        # while a write is certainly in flight.
        self.delay_s = delay_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rayzip-ckpt-writer")
        self._pending: Future | None = None

    @property
    def pending(self) -> bool:
        """A write was submitted and not yet waited for."""
        return self._pending is not None

    def done(self) -> bool:
        """The pending write has finished (or there is none); never blocks."""
        return self._pending is None or self._pending.done()

    def submit(self, write: Callable[[], Any], first: Callable[[], Any] | None = None) -> float:
        """Start ``write()`` on the thread, after ``first()`` if given (a snapshot's deferred
        copies, which training waits for: the fault injection's delay comes after it);
        returns the seconds spent waiting for the previous write to finish first (0 when it
        had)."""
        waited = self.wait()[1]
        def run() -> Any:
            if first is not None:
                first()
            if self.delay_s:
                time.sleep(self.delay_s)
            return write()

        self._pending = self._executor.submit(run)
        return waited

    def wait(self) -> tuple[Any, float]:
        """``(what the pending write returned, seconds waited)``; ``(None, 0.0)`` when none is
        pending. Raises what the write raised."""
        if self._pending is None:
            return None, 0.0
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        result = pending.result()
        return result, time.perf_counter() - start

    def close(self) -> None:
        """Wait for the pending write, then stop the thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
