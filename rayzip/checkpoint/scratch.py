"""Memory that the coding of one checkpoint hands back to the next.

Coding a checkpoint writes about its own size in new arrays: byte planes, coded streams,
decoded planes. Fresh memory from the system costs a page fault per 4 KiB page on first
touch; on the GPT's 87 MB state that was 26,000 faults and a third of a one-thread encode,
and the faults of two threads queue on the same process-wide lock. Checkpoints are taken
again and again, so their buffers are kept here when the arrays over them die, and the next
checkpoint's arrays of a similar size reuse them, already mapped.

A loan is a numpy array over a buffer of the pool: numpy views of it keep it (and so the
buffer) alive, and the buffer returns to the pool only when the last of them is gone, so
a buffer is never handed out twice at once. The pool keeps at most :data:`LIMIT` bytes of
returned buffers (``RAYZIP_CHECKPOINT_SCRATCH_MB``, 0 turns it off); more are given back to
the system.

Usage::

    planes = take(4 * n).reshape(4, n)   # uint8; its contents are undefined, as np.empty's
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import weakref

import numpy as np

__all__ = ["LIMIT", "kept_bytes", "take"]

LIMIT = int(float(os.environ.get("RAYZIP_CHECKPOINT_SCRATCH_MB", "1024")) * (1 << 20))
SMALLEST = 1 << 16  # below this a fresh array costs a few pages at most: not pooled

_lock = threading.Lock()
_free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)  # by capacity, a power of two
_kept = 0
# Finalizers run wherever the last reference drops, maybe inside take() on this thread while
# it holds the lock: they only append here (atomic), and take() files the returns.
_returned: collections.deque = collections.deque()


def _capacity(nbytes: int) -> int:
    """A power of two: a buffer serves any request down to half its size. Pages beyond what
    a loan touches are never mapped, so the rounding costs address space, not memory."""
    return 1 << max(nbytes - 1, 1).bit_length()


def _file_returns() -> None:
    global _kept
    while _returned:
        buffer = _returned.popleft()
        if _kept + len(buffer) <= LIMIT:
            _free[len(buffer)].append(buffer)
            _kept += len(buffer)


def _new_buffer(capacity: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, capacity)  # anonymous: zero pages, mapped on first touch
    if hasattr(mmap, "MADV_HUGEPAGE"):  # the platform's, not ours: Linux only
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)  # where the kernel allows: 512x fewer faults
        except OSError:
            pass
    return buffer


def take(nbytes: int, dtype=np.uint8) -> np.ndarray:
    """A 1-D array of ``nbytes`` bytes viewed as ``dtype``, uninitialised."""
    global _kept
    dtype = np.dtype(dtype)
    if nbytes < SMALLEST or LIMIT <= 0:
        return np.empty(nbytes // dtype.itemsize, dtype=dtype)
    capacity = _capacity(nbytes)
    with _lock:
        _file_returns()
        spare = _free.get(capacity)
        buffer = spare.pop() if spare else None
        if buffer is not None:
            _kept -= capacity
    if buffer is None:
        buffer = _new_buffer(capacity)
    loan = np.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize)
    weakref.finalize(loan, _returned.append, buffer)
    return loan


def kept_bytes() -> int:
    """Bytes of returned buffers the pool holds now."""
    with _lock:
        _file_returns()
        return _kept
