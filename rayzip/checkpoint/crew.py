"""The threads that code a checkpoint: the calling thread and helpers kept for the process.

A :class:`Crew` runs the calls of one checkpoint (its tensors' transforms, its streams'
coding, a snapshot's copies). The calling thread submits them and takes the results in its
own order; while it waits for one, it runs queued calls itself.

Usage::

    with Crew(threads) as crew:
        futures = [crew.submit(code, stream) for stream in streams]
        coded = [crew.result(f) for f in futures]
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import Any

__all__ = ["Crew", "Done", "Pending", "completed", "default_threads", "threads_for"]


class Done:
    """A call's result, ready: what :func:`completed` returns. A Future's lock and condition
    cost 3.7 us a call; a GPT checkpoint run on one thread makes some 400 of them."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


Pending = Future | Done  # what Crew.submit and completed return: a call's result, to come or ready


def completed(fn, *args) -> Done:
    """``fn(*args)`` run now, its result ready (a raise is raised here)."""
    return Done(fn(*args))


def threads_for(threads: int | None) -> int:
    """The threads a call asking for ``threads`` gets (None: :func:`default_threads`)."""
    return max(1, threads or default_threads())


def default_threads() -> int:
    """Threads for coding a checkpoint: the cores this process may use, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return min(8, cores)


class Crew:
    """Calls for one checkpoint, run by ``threads`` threads: this one and ``threads - 1``
    helpers kept for the process (with ``threads=1``, each call runs at submit time). A
    thread waiting for a result (:meth:`result`) runs this crew's queued calls meanwhile (not
    another checkpoint's: a snapshot's wait must not take a background save's coding). On exit, calls
    not yet started are cancelled and calls running are waited for, so nothing touches a
    checkpoint's buffers after its call returns.

    The calling thread works rather than waits because two threads were slower than one on
    some data sets when it only waited: every call was a hand-off to a thread that might be
    asleep, and an idle vCPU of a cloud VM wakes in 0.1 ms to 4 ms. Working itself, the caller
    never waits for a helper to wake, only for a call a helper has already started. The
    helpers are kept because starting and joining threads for every checkpoint cost more than
    the work on small ones."""

    def __init__(self, threads: int | None):
        self.workers = threads_for(threads)
        self.helpers = _helpers(self.workers - 1) if self.workers > 1 else None
        self.futures: list[Future] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # A running call may still submit more (a tensor's streams): repeat until none came.
        waited = 0
        while waited < len(self.futures):
            pending = self.futures[waited:]
            for future in pending:
                future.cancel()
            wait(pending)
            waited += len(pending)

    def submit(self, fn, *args) -> Pending:
        if self.helpers is None:
            return completed(fn, *args)
        future = self.helpers.submit(self, fn, *args)
        self.futures.append(future)
        return future

    def result(self, future: Pending) -> Any:
        """``future.result()``, this thread running queued calls until it is done."""
        if self.helpers is None or type(future) is Done:
            return future.result()
        return self.helpers.result(future, self)


class _Helpers:
    """``helpers`` daemon threads running calls from one queue, shared by the checkpoints of
    a process (a forked child makes its own)."""

    def __init__(self, helpers: int):
        self.calls: deque = deque()
        self.lock = threading.Lock()
        self.queued = threading.Condition(self.lock)  # helpers wait here for calls
        self.changed = threading.Condition(self.lock)  # callers wait here for a call or a result
        self.waiting = 0
        for i in range(helpers):
            threading.Thread(target=self._serve, name=f"rayzip-ckpt-{i}", daemon=True).start()

    def submit(self, owner: Crew, fn, *args) -> Future:
        future: Future = Future()
        with self.lock:
            self.calls.append((owner, future, fn, args))
            self.queued.notify()
            if self.waiting:
                self.changed.notify()
        return future

    def result(self, future: Future, owner: Crew) -> Any:
        """``future.result()``, running ``owner``'s queued calls meanwhile."""
        while True:
            with self.lock:
                while not future.done() and (mine := self._first_of(owner)) is None:
                    self.waiting += 1
                    try:
                        self.changed.wait()
                    finally:
                        self.waiting -= 1
                if future.done():
                    return future.result()
                call = self.calls[mine]
                del self.calls[mine]
            self._run(*call)

    def _first_of(self, owner: Crew) -> int | None:
        return next((i for i, call in enumerate(self.calls) if call[0] is owner), None)

    def _serve(self) -> None:
        while True:
            with self.lock:
                while not self.calls:
                    self.queued.wait()
                call = self.calls.popleft()
            self._run(*call)
            # Dropped now, not when the next call comes: while this thread sleeps, the call's
            # arguments (a load's whole input, say) and its future's result would stay alive,
            # and be freed at the start of the next checkpoint, on this thread, holding the GIL
            # while the caller waits for it (unmapping a large buffer takes milliseconds).
            del call

    def _run(self, owner: Crew, future: Future, fn, args) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        with self.lock:
            if self.waiting:
                self.changed.notify_all()


_HELPERS: dict[int, tuple[int, _Helpers]] = {}
_HELPERS_LOCK = threading.Lock()


def _helpers(helpers: int) -> _Helpers:
    """The process's ``helpers`` threads (a forked child makes its own)."""
    with _HELPERS_LOCK:
        pid, kept = _HELPERS.get(helpers, (None, None))
        if kept is None or pid != os.getpid():
            kept = _Helpers(helpers)
            _HELPERS[helpers] = (os.getpid(), kept)
        return kept
