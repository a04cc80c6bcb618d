"""Processes a test started, found by a tag in their environment: a test marks the processes
it starts (and so everything they start) with ``RAYZIP_TEST_RUN=<tag>``, and finds or ends
exactly those, never another Ray or anything else on the machine. The ports they listen on
are free ones of their own (:func:`free_port`, :func:`free_ports`).

Usage::

    tag, env = tagged_env()
    subprocess.run([...], env=env)        # ray start, a benchmark, ...
    assert tagged_pids(tag) == set()      # nothing of it left behind
    end_tagged(tag)                       # or end what is left, by process id
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

__all__ = ["end_tagged", "free_port", "free_ports", "proc_stat", "tagged_env", "tagged_pids"]

VARIABLE = "RAYZIP_TEST_RUN"


def tagged_env(base: dict | None = None) -> tuple[str, dict]:
    tag = uuid.uuid4().hex
    return tag, {**(os.environ if base is None else base), VARIABLE: tag}


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state, parent, ...: field
    3 of proc(5) is index 0 here), or None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _live(pid: int | str) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def tagged_pids(tag: str) -> set[int]:
    """Live processes (not zombies) whose environment carries ``tag``."""
    marker = f"{VARIABLE}={tag}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if _live(entry.name):
            found.add(int(entry.name))
    return found


def _with_descendants(pids: set[int]) -> set[int]:
    """``pids`` and every live process below them."""
    children: dict[int, set[int]] = {}
    for entry in Path("/proc").iterdir():
        stat = proc_stat(entry.name) if entry.name.isdigit() else None
        if stat is not None:
            children.setdefault(int(stat[1]), set()).add(int(entry.name))
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if _live(pid)}


def end_tagged(tag: str, grace_s: float = 10.0) -> set[int]:
    """SIGTERM every process carrying ``tag`` and every process below one, SIGKILL what is
    left after ``grace_s``; the ids that had to be killed.

    The processes below count because Ray starts its dashboard and runtime-env agents without
    the environment it was given: left behind by their raylet, they spin on a core, trying to
    tell a GCS that is gone, for as long as the machine runs (every later test pays for it)."""
    doomed = _with_descendants(tagged_pids(tag))
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while (_alive(doomed) or tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    stubborn = _alive(doomed) | tagged_pids(tag)
    for pid in stubborn:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stubborn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nothing listens on now. Each socket stays
    bound until all are chosen: ports taken one at a time can repeat, because a port is free
    again as soon as its socket closes (Ray refuses to start when two components share one)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
