"""A node's keeper of in-memory snapshots: the process that outlives the workers.

Each rank writes its snapshot after a step into a pair of slot files in the keeper's
directory, on the node's shared memory (``/dev/shm``): one memory copy, no serialization
through Ray (:mod:`rayzip.train.snapshots`). A worker's death leaves its last committed slot
there; the keeper owns the directory: it bounds the memory that snapshots hold on its node,
lists what it holds, hands it to ranks on other nodes (zstd on the wire), and removes it at
the end of the run.

Like :mod:`rayzip.progress`, this module imports nothing heavy at its top, because Ray
starts the actor in a fresh process that imports the class's module.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

__all__ = ["DEFAULT_MAX_BYTES", "HEADER", "MAGIC", "Keeper", "default_root", "keeper_name", "keeper_prefix",
           "read_header"]

DEFAULT_MAX_BYTES = 8 * 2 ** 30  # what one node's snapshots may hold unless told

MAGIC = b"RZSNAP03"
# magic, committed (1; 2: sealed with its checksum), step, world, the writer's rank, skeleton bytes, data bytes,
# XXH3-64 of the bytes after the header, the index of the same rank's trainer slot whose arrays this one
# refers to (-1: none), and the index of the same rank's stable slot whose entries this one's take (-1:
# none) with the step that slot was written at
HEADER = struct.Struct("<8sIqiiQQQiiq")
HEADER_BYTES = 128  # the arrays start here, the skeleton after them


def keeper_prefix(run_id: str) -> str:
    """The names of a run's keepers start with this."""
    return f"rayzip-keeper-{run_id}-"


def keeper_name(run_id: str, node_id: str) -> str:
    return keeper_prefix(run_id) + node_id


def default_root() -> str:
    """Shared memory where the host has it (a page-cache copy survives the worker's death)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"


def read_header(path: str | os.PathLike) -> dict | None:
    """A slot's header if the slot is committed, else None (torn, empty, or not a slot)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except OSError:
        return None
    if len(raw) < HEADER.size:
        return None
    magic, committed, step, world, rank, skeleton, data, _, base, stable, stable_step = HEADER.unpack(raw)
    if magic != MAGIC or committed not in (1, 2):  # 2: sealed, its checksum written
        return None
    return {"step": step, "world": world, "rank": rank, "skeleton_bytes": skeleton, "data_bytes": data,
            "sealed": committed == 2, "base": base, "stable": stable, "stable_step": stable_step}


class Keeper:
    """One node's snapshots of one run (the runner's ``KeeperActor``, one per node).

    Args:
        root: the folder for the run's folder (default: ``/dev/shm``).
        run_id: the run, a folder of its own.
        node_id: this node's Ray id.
        max_bytes: what all the node's slot files may hold together; a rank whose slots would
            pass it takes no more snapshots (its restarts fall back to storage), with a log line.
        known: the nodes that had a keeper when the run started: a worker that finds any one
            keeper learns from it which nodes' keepers are gone (their nodes lost), and what a
            keeper it starts on a node that joined later takes (:meth:`settings`).
        every: the ranks' snapshot interval, for workers that learn it from their keeper
            (:func:`rayzip.train.keep_snapshots`): N steps, or ``"auto"``.
        copy_density: the share of their error feedback that ranks copy to another node's
            keeper (:meth:`hold_copy`), for those workers too.
    """

    def __init__(self, root: str | None, run_id: str, node_id: str, max_bytes: int, known: list[str] = (),
                 every: int | str = "auto", copy_density: float = 0.0):
        self.node_id, self.max_bytes, self.root, self.known = node_id, int(max_bytes), root, list(known)
        self.every, self.copy_density = every, float(copy_density)
        self.path = Path(root or default_root()) / "rayzip-snapshots" / run_id / node_id[:16]
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.reserved: dict[str, int] = {}
        self.refused: set[str] = set()

    def directory(self) -> str:
        return str(self.path)

    def settings(self) -> dict:
        """``root``, ``max_bytes``, ``known``, ``every`` and ``copy_density``, as this keeper was
        started with."""
        return {"root": self.root, "max_bytes": self.max_bytes, "known": self.known, "every": self.every,
                "copy_density": self.copy_density}

    def reserve(self, owner: str, nbytes: int) -> bool:
        """Whether ``owner``'s slots (all of them) may hold ``nbytes``; a refusal is logged once."""
        others = sum(b for o, b in self.reserved.items() if o != owner)
        if others + nbytes > self.max_bytes:
            if owner not in self.refused:
                self.refused.add(owner)
                print(f"rayzip: snapshots on node {self.node_id[:12]} would hold {others + nbytes:,} bytes, over "
                      f"snapshots.max_bytes_per_node {self.max_bytes:,}: {owner} takes no more snapshots, and a "
                      f"restart falls back to the checkpoint in storage")
            self.reserved.pop(owner, None)
            return False
        self.reserved[owner] = nbytes
        return True

    def held_bytes(self) -> int:
        """Bytes the node's slot files take now."""
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())

    def usage(self) -> dict:
        """What the node's snapshots hold now against their bound: ``held_bytes`` (the slot
        files), ``reserved_bytes`` (what the ranks' slots may grow to), ``max_bytes``, and
        ``refused`` (the slot owners that take no more snapshots, over the bound)."""
        return {"held_bytes": self.held_bytes(), "reserved_bytes": sum(self.reserved.values()),
                "max_bytes": self.max_bytes, "refused": sorted(self.refused)}

    def inventory(self) -> dict[str, list[dict]]:
        """{slot owner ("trainer", "rank0", "stable0", ...): its committed slots' headers, with
        ``file``}."""
        held: dict[str, list[dict]] = {}
        for p in sorted(self.path.iterdir()):
            owner, _, index = p.name.rpartition(".")
            header = read_header(p) if index.isdigit() else None
            if header is not None:
                held.setdefault(owner, []).append({**header, "file": p.name})
        return held

    def read(self, name: str) -> bytes | None:
        """A slot file's bytes, zstd-compressed, for a rank on another node (None: gone)."""
        import zstandard

        p = self.path / name
        if p.parent != self.path or not p.is_file():
            return None
        return zstandard.ZstdCompressor(level=1, threads=-1).compress(p.read_bytes())

    def hold_copy(self, owner: str, step: int, blob: bytes) -> bool:
        """Keep ``blob``, a rank on another node's copy of its error feedback after the
        synchronization of ``step`` (:func:`rayzip.train.residual_copy.pack_residuals`), in
        place of that owner's copies but the newest. False, with a log line once, where it
        would take the node's snapshots past ``max_bytes``."""
        old = sorted(self.path.glob(f"copy-{owner}.*"), key=lambda p: int(p.suffix[1:]))
        freed = sum(p.stat().st_size for p in old[:-1])
        if self.held_bytes() - freed + len(blob) > self.max_bytes:
            if f"copy-{owner}" not in self.refused:
                self.refused.add(f"copy-{owner}")
                print(f"rayzip: node {self.node_id[:12]} keeps no more copies of {owner}'s error feedback: they "
                      f"would take its snapshots over snapshots.max_bytes_per_node {self.max_bytes:,}")
            return False
        tmp = self.path / f".copy-{owner}.{int(step)}"
        tmp.write_bytes(blob)
        tmp.rename(self.path / f"copy-{owner}.{int(step)}")  # whole or absent
        for p in old[:-1]:
            if p.name != f"copy-{owner}.{int(step)}":
                p.unlink(missing_ok=True)
        return True

    def copy_of(self, owner: str, step: int) -> bytes | None:
        """``owner``'s copy of its error feedback after the synchronization of ``step``
        (:meth:`hold_copy`), or None."""
        p = self.path / f"copy-{owner}.{int(step)}"
        return p.read_bytes() if p.is_file() else None

    def close(self) -> None:
        """Remove the node's snapshots (the run's end)."""
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in (self.path.parent, self.path.parent.parent):
            try:
                parent.rmdir()  # only when empty: another node's keeper on this host may still hold its own
            except OSError:
                break
