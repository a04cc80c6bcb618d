"""In-memory snapshots after each step, kept off the worker, so that a killed worker loses no step.

After a step, each rank copies what a checkpoint at that step would hold (rank 0's part:
model, optimizer, step, byte totals, data position, RNG; every rank's part: its error
feedback and codec state) into one of its few slot files in its node's keeper directory on
shared memory (:class:`rayzip.keeper.Keeper`). The copy is one pass over the tensors, on the
training thread, so the step is not over before its snapshot is: a worker killed at any
moment leaves the previous slot, or this one, committed. A slot is committed by the last
write of its header, after its bytes; their checksum follows.

On a restart every rank lists every keeper's slots and takes the newest step that the keepers
hold complete (the trainer's part and each saved rank's), every rank agreeing by an
all-reduce; that step's parts become an ordinary checkpoint folder that the loop's restore
reads, so a world that changed size re-shards error feedback as it does from storage. The
built-in loop takes a snapshot at every checkpoint's step too. A user's loop may snapshot less
often than it checkpoints, and a keeper may refuse a snapshot, so the restart reads storage
where its checkpoint is newer than the newest complete snapshot, or where there is none
(:func:`rayzip.train.checkpoints.newest_of`).

The slot format (little-endian): a 128-byte header (:data:`rayzip.keeper.HEADER`), each
array's bytes, 64-byte aligned (their places stay put from step to step, so the copy is one
call), then the nest's skeleton as JSON (tensors and arrays replaced by their index). JSON,
not pickle: reading a slot runs no code from it. A rank that writes the trainer's part too
writes a tensor the two parts share once: its own part refers to the trainer slot written
with it (the header's ``base``), and a restart takes the two together or neither. A rank
state most of whose bytes change only now and then (:class:`~rayzip.train.checkpoints.SplitState`:
local steps' round start, its anchor and error feedback, changes at a synchronization) has
that part written once each time it changes, into one of two stable slots of the rank's; the
rank's slot of each step names it (the header's ``stable``: its index and the step it was
written at) and is taken only while that slot holds it. The checksum (XXH3-64, at memory
speed: CRC-32 took longer than the copy, and its thread took the CPU from training) is
written by a thread after the commit (a "sealed" slot); a reader checks it where it is
written.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import OrderedDict
import mmap
import os
import shutil
import statistics
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from ..keeper import DEFAULT_MAX_BYTES, HEADER, HEADER_BYTES, MAGIC, Keeper, default_root, keeper_name, keeper_prefix
from ..checkpoint import save as save_checkpoint
from .checkpoints import COPIED, OWN_SHARDS, Parts, SplitState, local_shards, take_parts, write_taken
from .residual_copy import pack_residuals, unpack_residuals

__all__ = ["SnapshotError", "Snapshots", "copy_fits", "find_keepers", "keeper_actor", "newest_complete", "placed",
           "read_arrays", "read_part", "read_slot", "start_keeper", "start_keepers", "stop_keepers", "tensor_key",
           "worker_keepers", "write_slot"]

ALIGN = 64
COST_SHARE = 0.05  # snapshots every step while they cost at most this share of it
MEASURED = 5  # auto: snapshots measured once every slot is made (the first write of each is left out)
STABLE_SLOTS = 2  # a rank's slots of a SplitState's stable part
MAX_SNAPSHOT_SLOTS = 33  # the most a rank keeps (local steps: a round's steps and one)
COPY_SHARE = 0.25  # a residual copy may take at most this share of a round, else copies stop,
COPY_FLOOR_S = 0.1  # unless it takes less than this: a small copy's time is latency, not the link's


_KEEPER_ACTOR = None


def keeper_actor():
    """:class:`rayzip.keeper.Keeper` as a Ray actor class (no CPU of its own)."""
    global _KEEPER_ACTOR
    if _KEEPER_ACTOR is None:
        import ray

        _KEEPER_ACTOR = ray.remote(num_cpus=0)(Keeper)
    return _KEEPER_ACTOR


def start_keeper(run_id: str, node_id: str, root: str | None, max_bytes: int, detached: bool = False,
                 known: list[str] = (), every: int | str = "auto", copy_density: float = 0.0):
    """The keeper of ``node_id`` for ``run_id``, started on that node if it is not there yet.
    The driver starts one per node at the start (owned by it, :func:`start_keepers`); a worker
    on a node that joined later starts its node's ``detached``, so that it outlives the worker
    (the driver removes every keeper of the run at the end, :func:`stop_keepers`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = {"lifetime": "detached"} if detached else {}
    return keeper_actor().options(
        name=keeper_name(run_id, node_id), get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False), **options,
    ).remote(root, run_id, node_id, max_bytes, known, every, copy_density)


def start_keepers(run_id: str, root: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                  every: int | str = "auto", copy_density: float = 0.0) -> dict:
    """One keeper on each live node, owned by the caller (the driver): {node id: actor}.
    Named, so that every worker finds its node's; each knows the nodes that had one."""
    import ray

    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    return {node: start_keeper(run_id, node, root, max_bytes, known=nodes, every=every, copy_density=copy_density)
            for node in nodes}


def stop_keepers(run_id: str, keepers: dict, root: str | None = None) -> dict[str, dict]:
    """Remove every node's snapshots of ``run_id``, those of keepers that workers started on
    nodes that joined later too; what each node's held at the end ({node id:
    :meth:`Keeper.usage`}). A keeper whose node is gone cannot: what its node left on this
    host (nodes emulated on one machine) is removed here."""
    import ray

    keepers = {**keepers, **{n: k for n, k in find_keepers(run_id).items() if k is not None}}
    usage = {}
    for node, keeper in keepers.items():
        if keeper is None:
            continue
        try:
            usage[node] = ray.get(keeper.usage.remote(), timeout=30)
            ray.get(keeper.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the node is gone
            pass
        ray.kill(keeper)
    shutil.rmtree(Path(root or default_root()) / "rayzip-snapshots" / run_id, ignore_errors=True)
    return usage


def find_keepers(run_id: str, known: list[str] = ()) -> dict:
    """{node: keeper handle} of every keeper of ``run_id`` now, and None for each node of
    ``known`` whose keeper is gone (with its node)."""
    import ray

    prefix = keeper_prefix(run_id)
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=False):
        name = entry if isinstance(entry, str) else entry.get("name", "")
        if name.startswith(prefix):
            try:
                found[name[len(prefix):]] = ray.get_actor(name)
            except ValueError:  # gone since it was listed
                pass
    return {**{node: None for node in known}, **found}


def worker_keepers(run_id: str) -> tuple[dict, dict]:
    """A worker's view of ``run_id``'s keepers: ({node: handle, or None where the keeper is gone
    with its node}, their :meth:`~rayzip.keeper.Keeper.settings`), its own node's started here
    (detached, with the others' settings) when the node joined after the run started;
    ({}, {}) when the run has none."""
    import ray

    found = find_keepers(run_id)
    settings = None
    for keeper in found.values():
        try:
            settings = ray.get(keeper.settings.remote(), timeout=30)
            break
        except Exception:  # noqa: BLE001 - gone with its node since it was listed: ask another
            continue
    if settings is None:
        return {}, {}
    found = {**{node: None for node in settings["known"]}, **found}
    node = ray.get_runtime_context().get_node_id()
    if found.get(node) is None and node not in settings["known"]:
        found[node] = start_keeper(run_id, node, settings["root"], settings["max_bytes"], detached=True,
                                   known=settings["known"], every=settings["every"],
                                   copy_density=settings.get("copy_density", 0.0))
    return found, settings


def copy_fits(copy_s: float | None, round_s: float | None, share: float = COPY_SHARE,
              floor_s: float = COPY_FLOOR_S) -> bool:
    """Whether residual copies go on: the last one (``copy_s``: packed, sent and acknowledged)
    took at most ``share`` of the round since it was handed over (``round_s``), or under
    ``floor_s``. None: not measured yet (the first copy, or the first round after it)."""
    return copy_s is None or round_s is None or copy_s <= max(share * round_s, floor_s)


class SnapshotError(RuntimeError):
    """A slot that is not what its header says (its file is named)."""


_PLAIN = (type(None), bool, int, float, str)


def tensor_key(t: torch.Tensor) -> tuple:
    """Tensors with the same key hold the same bytes now (views of one storage alike)."""
    return t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())


def _encode(value: Any, arrays: list, refs: dict | None = None) -> Any:
    """The skeleton of ``value``, its arrays appended to ``arrays``; a tensor whose
    :func:`tensor_key` is in ``refs`` becomes a reference to that array of the base slot."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict or kind is OrderedDict:
        return {"__d": [[_encode(k, arrays, refs), _encode(v, arrays, refs)] for k, v in value.items()]}
    if kind is list:
        return [v if type(v) in _PLAIN else _encode(v, arrays, refs) for v in value]
    if isinstance(value, torch.Tensor):
        if refs and value.numel():
            index = refs.get(tensor_key(value))
            if index is not None:
                return {"__r": index}
        arrays.append(value.detach())
        return {"__a": len(arrays) - 1, "dtype": str(value.dtype)[6:], "shape": list(value.shape), "kind": "torch"}
    if kind is tuple:
        return {"__t": [_encode(v, arrays, refs) for v in value]}
    if isinstance(value, np.ndarray) and value.dtype != object:
        arrays.append(value)
        return {"__a": len(arrays) - 1, "dtype": value.dtype.str, "shape": list(value.shape), "kind": "numpy"}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return {"__np": value.dtype.str, "v": value.item()}
    if kind is bytes:
        return {"__b": value.hex()}
    if kind is torch.dtype:
        return {"__dtype": str(value)[6:]}
    if isinstance(value, dict):
        return {"__d": [[_encode(k, arrays, refs), _encode(v, arrays, refs)] for k, v in value.items()]}
    raise TypeError(f"a snapshot holds tensors, arrays, numbers, strings and containers of them, not {kind!r}")


def _decode(value: Any, arrays: list, base: list | None = None) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays, base) for v in value]
    if not isinstance(value, dict):
        return value
    if "__a" in value:
        return arrays[value["__a"]]
    if "__r" in value:
        if base is None:
            raise SnapshotError("a snapshot refers to its trainer slot's arrays, and was read without them")
        return base[value["__r"]]
    if "__d" in value:
        return {_decode(k, arrays, base): _decode(v, arrays, base) for k, v in value["__d"]}
    if "__t" in value:
        return tuple(_decode(v, arrays, base) for v in value["__t"])
    if "__np" in value:
        return np.dtype(value["__np"]).type(value["v"])
    if "__b" in value:
        return bytes.fromhex(value["__b"])
    if "__dtype" in value:
        return getattr(torch, value["__dtype"])
    raise SnapshotError(f"unknown entry in a snapshot's skeleton: {sorted(value)}")


def _nbytes(a) -> int:
    return a.numel() * a.element_size() if isinstance(a, torch.Tensor) else a.nbytes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Slot:
    """One slot file, mapped, with views onto its arrays' places kept while their layout
    holds (a step's snapshot then copies every tensor in one call); it grows when a
    snapshot does."""

    def __init__(self, path: Path):
        self.path, self.size, self.map, self.fd = path, 0, None, None
        self.layout: tuple | None = None
        self.views: list = []

    def mapped(self, size: int) -> mmap.mmap:
        if size > self.size:
            self.close()
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(self.fd, size)
            self.map, self.size = mmap.mmap(self.fd, size), size
        return self.map

    def place(self, arrays: list, skeleton_bytes: int) -> tuple[list, int]:
        """Views onto each array's place in the data region, and the region's bytes."""
        layout = tuple((a.dtype, _nbytes(a)) for a in arrays)
        if layout != self.layout:
            self.views, self.layout = [], None
        data = sum(_align(n) for _, n in layout)
        needed = HEADER_BYTES + data + skeleton_bytes
        if needed > self.size:
            self.close()
            self.mapped(needed + max(4096, skeleton_bytes))  # room for the skeleton to grow
        if self.layout is None:
            at = HEADER_BYTES
            for dtype, n in layout:
                if isinstance(dtype, torch.dtype):
                    self.views.append(torch.frombuffer(self.map, dtype=torch.uint8, count=n, offset=at).view(dtype)
                                      if n else None)
                else:
                    self.views.append(np.frombuffer(self.map, dtype=np.uint8, count=n, offset=at).view(dtype))
                at += _align(n)
            self.layout = layout
        return self.views, data

    def close(self) -> None:
        self.views, self.layout = [], None  # they hold the map's buffer
        if self.map is not None:
            self.map.close()
            os.close(self.fd)
            self.map = self.fd = None
        self.size = 0


def write_slot(slot: _Slot, nest: Any, step: int, world: int, rank: int, seal: bool = True,
               refs: dict | None = None, base: int = -1, keys: dict | None = None,
               stable: tuple[int, int] = (-1, -1)) -> int:
    """Copy ``nest`` into ``slot`` and commit it; the bytes it takes. ``seal``: its checksum
    now, else later by :func:`seal_slot` (a committed slot is whole without it: a worker
    killed before the commit leaves it uncommitted). ``refs`` ({:func:`tensor_key`: array
    index}) and ``base``: tensors held by the slot of index ``base`` already, written there
    by the same rank at the same step, become references to it. ``keys``: filled with this
    slot's own {:func:`tensor_key`: array index}, the ``refs`` of a slot that refers to it.
    ``stable``: (index, step) of the same rank's stable slot whose entries complete this one's."""
    arrays: list = []
    skeleton = json.dumps(_encode(nest, arrays, refs), separators=(",", ":")).encode()
    if keys is not None:
        keys.update((tensor_key(a), i) for i, a in enumerate(arrays) if isinstance(a, torch.Tensor) and a.numel())
    views, data = slot.place(arrays, len(skeleton))
    m = slot.map
    m[8:12] = b"\0\0\0\0"  # uncommitted while its bytes change
    dst, src = [], []
    for view, a in zip(views, arrays):
        if isinstance(a, torch.Tensor):
            if view is not None:
                dst.append(view)
                src.append(a.reshape(-1))
        else:
            view[:] = a.reshape(-1)
    if dst:
        torch._foreach_copy_(dst, src)
    end = HEADER_BYTES + data + len(skeleton)
    m[HEADER_BYTES + data:end] = skeleton
    m[:HEADER.size] = HEADER.pack(MAGIC, 0, step, world, rank, len(skeleton), data, 0, base, *stable)
    m[8:12] = COMMITTED  # the commit: the last write
    if seal:
        seal_slot(slot, end)
    return end


COMMITTED, SEALED = (1).to_bytes(4, "little"), (2).to_bytes(4, "little")
_AT = struct.calcsize("<8sIqiiQQ")
_SUM = slice(_AT, _AT + 8)  # the checksum field, after the data's bytes


def _checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)  # releases the GIL: on a thread, beside training


def seal_slot(slot: _Slot, size: int) -> None:
    """Write the checksum of a committed slot's bytes, then mark it sealed: a reader checks it."""
    with memoryview(slot.map) as view:
        digest = _checksum(view[HEADER_BYTES:size])
    slot.map[_SUM] = digest.to_bytes(8, "little")
    slot.map[8:12] = SEALED


def read_slot(path: str | os.PathLike, raw: bytes | np.ndarray | None = None,
              base: list | None = None) -> tuple[dict, Any]:
    """(header, nest) of a committed slot, from its file or its bytes; a slot that is not
    committed, or whose bytes do not match their checksum, raises :class:`SnapshotError`.
    ``base``: the arrays of the slot it refers to (header ``base``), from :func:`read_arrays`."""
    header, skeleton, arrays = read_arrays(path, raw)
    return header, _decode(skeleton, arrays, base)


def read_arrays(path: str | os.PathLike, raw: bytes | np.ndarray | None = None) -> tuple[dict, Any, list]:
    """(header, skeleton, arrays) of a committed slot (:func:`read_slot`, undecoded)."""
    buf = np.fromfile(path, dtype=np.uint8) if raw is None else np.frombuffer(raw, dtype=np.uint8).copy()
    if len(buf) < HEADER.size:
        raise SnapshotError(f"{path}: not a snapshot slot ({len(buf)} bytes)")
    magic, committed, step, world, rank, skel_n, data_n, digest, base, stable, stable_step = HEADER.unpack(
        buf[:HEADER.size].tobytes())
    if magic != MAGIC or committed not in (1, 2):
        raise SnapshotError(f"{path}: not a committed snapshot slot")
    end = HEADER_BYTES + data_n + skel_n
    if len(buf) < end:
        raise SnapshotError(f"{path}: snapshot of step {step} is cut short ({len(buf)} of {end} bytes)")
    if committed == 2 and _checksum(buf[HEADER_BYTES:end]) != digest:
        raise SnapshotError(f"{path}: snapshot of step {step} fails its checksum (XXH3-64)")
    skeleton = json.loads(buf[HEADER_BYTES + data_n:end].tobytes())
    header = {"step": step, "world": world, "rank": rank, **({"base": base} if base >= 0 else {}),
              **({"stable": (stable, stable_step)} if stable >= 0 else {})}
    return header, skeleton, slot_arrays(skeleton, buf, HEADER_BYTES)


def slot_arrays(skeleton: Any, buf: np.ndarray, data_start: int) -> list:
    """The arrays a skeleton describes, in their order, copied out of ``buf``."""
    specs: list[dict] = []

    def collect(v):
        if isinstance(v, list):
            for x in v:
                collect(x)
        elif isinstance(v, dict):
            if "__a" in v:
                specs.append(v)
            for x in v.values():
                collect(x)

    collect(skeleton)
    specs.sort(key=lambda s: s["__a"])
    arrays, at = [], _align(data_start)
    for s in specs:
        if s["kind"] == "torch":
            dtype = getattr(torch, s["dtype"])
            n = math.prod(s["shape"]) * torch.empty((), dtype=dtype).element_size()
            t = torch.from_numpy(buf[at:at + n].copy()).view(dtype) if n else torch.empty(0, dtype=dtype)
            arrays.append(t.reshape(s["shape"]))
        else:
            dtype = np.dtype(s["dtype"])
            n = math.prod(s["shape"]) * dtype.itemsize
            arrays.append(buf[at:at + n].view(dtype).reshape(s["shape"]).copy())
        at = _align(at + n)
    return arrays


def read_part(name: str, arrays_of: Callable[[str], tuple[dict, Any, list]], where: str = "") -> tuple[dict, Any]:
    """(header, nest) of slot ``name`` with what it refers to: the arrays of its trainer
    slot, and the entries of its stable slot (into its ``hook``). ``arrays_of``: a slot's
    :func:`read_arrays` by its name (the same node's)."""
    header, skeleton, arrays = arrays_of(name)
    base = None
    if "base" in header:  # arrays it shares with the same rank's trainer slot of the same step
        written, _, base = arrays_of(f"trainer.{header['base']}")
        if (written["step"], written["rank"]) != (header["step"], header["rank"]):
            raise SnapshotError(f"{name}{where} refers to trainer.{header['base']}, which holds "
                                f"rank {written['rank']}'s step {written['step']} now")
    nest = _decode(skeleton, arrays, base)
    if "stable" in header:  # the entries of its state that only change now and then
        index, step = header["stable"]
        stable = f"stable{header['rank']}.{index}"
        written, rest, more = arrays_of(stable)
        if (written["step"], written["rank"]) != (step, header["rank"]):
            raise SnapshotError(f"{name}{where} refers to {stable} of step {step}, which holds "
                                f"rank {written['rank']}'s step {written['step']} now")
        nest["hook"].update(_decode(rest, more))
    return header, nest


def placed(held: dict[str, dict[str, list[dict]]]) -> tuple[dict, dict]:
    """Where each step's parts are, from the keepers' inventories ({node: {owner: slot
    headers}}): ({step: {owner: (node, file)}}, {step: world}). A rank's slot counts only
    while the trainer and stable slots it refers to hold what it refers to; the trainer's
    part is the lowest rank's (rank 0's RNG)."""
    where: dict[int, dict[str, tuple[str, str]]] = {}
    worlds: dict[int, int] = {}
    writer: dict[int, int] = {}
    for node, owners in held.items():
        held_here = {(s["file"], s["step"], s["rank"]) for slots in owners.values() for s in slots}
        for owner, slots in owners.items():
            if owner.startswith("stable"):
                continue  # taken with the rank slots that refer to them
            for s in slots:
                if owner == "trainer":
                    if s["rank"] < writer.get(s["step"], s["rank"] + 1):
                        writer[s["step"]], worlds[s["step"]] = s["rank"], s["world"]
                        where.setdefault(s["step"], {})["trainer"] = (node, s["file"])
                    continue
                if s["base"] >= 0 and (f"trainer.{s['base']}", s["step"], s["rank"]) not in held_here:
                    continue  # what it refers to is gone, or holds another step now
                if s["stable"] >= 0 and (f"stable{s['rank']}.{s['stable']}", s["stable_step"],
                                         s["rank"]) not in held_here:
                    continue
                where.setdefault(s["step"], {}).setdefault(owner, (node, s["file"]))
    return where, worlds


def newest_complete(where: dict, worlds: dict, held: dict, lost: list, world: int | None = None) -> int:
    """The newest step of :func:`placed` with the trainer's part and every saved rank's (-1:
    none); with nodes ``lost``, the ranks no surviving keeper ever held are not needed.
    ``world``: only a step saved by a world of that size, with every rank's part (each holds
    shards of its own)."""
    surviving = {owner for owners in held.values() for owner in owners if owner.startswith("rank")}
    best = -1
    for step, owners in where.items():
        saved = worlds.get(step)
        if saved is None or world is not None and saved != world:
            continue
        needed = {f"rank{r}" for r in range(saved)}
        if lost and world is None:
            needed &= surviving
        if needed <= set(owners):
            best = max(best, step)
    return best


class Snapshots:
    """This rank's snapshots (the built-in loop's; see the module's docstring). Every rank
    builds its own at the same point (a collective finds each node's first rank).

    Args:
        keepers: {node id: keeper actor handle} of the run (the runner's; None where the keeper
            is gone with its node).
        rank, world: this rank and the world.
        node_id: this rank's node.
        every: snapshot every N steps, or ``"auto"``: every step while a snapshot costs at
            most 5% of one, else the fewest steps between them that keep it there (agreed by
            every rank after the first few, all taken).
        slots: the snapshots each rank keeps, newest first: 2 where ranks are never more than a
            step apart (each step's exchange), more where one may run ahead of another that
            died (local steps: a round's inner steps and its start).
        sharded: each rank's slot holds its own shards of the model and optimizer (FSDP2,
            :meth:`take`'s ``shards``): a restart takes a snapshot only onto a world of the
            same size, with every rank's slot (a lost node's shards are gone with it).
        copy_density: where a rank state's part that changes now and then holds error
            feedback to copy (:meth:`SplitState.residuals_of`: local steps under ``combine:
            senders``), the share of each group of it that goes to the next node's keeper each
            time that part is written (:mod:`rayzip.train.residual_copy`), so that a lost
            node's ranks resume with it; 0: none.
    """

    def __init__(self, keepers: dict, rank: int, world: int, node_id: str, every: int | str, slots: int = 2,
                 sharded: bool = False, copy_density: float = 0.0):
        import ray

        self.ray, self.keepers, self.rank, self.world, self.node_id = ray, keepers, rank, world, node_id
        self.sharded = sharded
        self.keeper = keepers.get(node_id)
        self.directory = Path(ray.get(self.keeper.directory.remote())) if self.keeper is not None else None
        # The trainer's part (rank 0's) is written by the first rank on every node too, so that
        # each node's keeper holds the weights on its own. By Ray node, not by Ray Train's local
        # rank, which counts by IP address (nodes that share a host share one).
        nodes = [node_id]
        if dist.is_available() and dist.is_initialized() and world > 1:
            nodes = [None] * world
            dist.all_gather_object(nodes, node_id)
        self.writes_trainer = rank == 0 or nodes.index(node_id) == rank
        self.fixed = None if every == "auto" else int(every)
        self.every = self.fixed or 1
        self.slots = {}
        self.slot_count = int(slots)
        self.sealing: dict = {}  # slot -> its pending seal
        self.sealer = ThreadPoolExecutor(1, thread_name_prefix="rayzip-seal")
        self.count = 0
        self.reserved = 0
        self.enabled = self.keeper is not None
        self.costs: list[tuple[float, float]] = []  # (snapshot s, step s) of the first snapshots
        self.total_s = 0.0
        self.taken = 0
        self.last_end: float | None = None  # when :meth:`after_step` last returned
        self.bytes = 0  # what this rank's last snapshot wrote (its slots on this node's shared memory)
        # A SplitState's part that changes now and then: its generation written last, the
        # stable slot's (index, step) holding it, stable slots written, and the largest.
        self.stable_generation: int | None = None
        self.stable_at = (-1, -1)
        self.stable_count = 0
        self.stable_bytes = self.step_bytes = 0
        # The next node's keeper (by id, cyclic) holds this rank's residual copies: one node
        # per node, so that the copies spread over the nodes.
        live = sorted(n for n, k in keepers.items() if k is not None)
        self.peer = keepers[live[(live.index(node_id) + 1) % len(live)]] \
            if copy_density and node_id in live and len(live) > 1 and not sharded else None
        self.copy_density = float(copy_density)
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="rayzip-copy")  # off the training thread
        self.copied_bytes = 0  # what this rank's copies took on the wire, all of them
        self.copy_failed = False
        self.copying = None  # the copy on its way
        self.copy_s: float | None = None  # the last copy's seconds, from its handing over to its keeper's ack
        self.copied_at: float | None = None  # when the last copy was handed over
        self.copies_behind = False  # a round went without one, the last still on its way (said once)
        self.restored_copies: list[int] = []  # the lost ranks whose copies the last restore took
        if not self.enabled:
            print(f"rayzip: rank {rank}: no snapshot keeper on node {node_id[:12]} (it joined after the run started): "
                  "its restarts fall back to the checkpoint in storage")

    def due(self, step: int, forced: bool) -> bool:
        """Whether ``step`` is snapshotted: every rank's same answer (a rank whose snapshots
        are off still goes through :meth:`take`, for the agreement on the interval)."""
        return forced or (step + 1) % self.every == 0

    def after_step(self, step: int, trainer: Callable[[], dict], state,
                   shards: Callable[[], dict] | None = None) -> None:
        """:meth:`take` where ``step`` is :meth:`due`, its step's time measured from the end of
        this call after the step before (a user loop's steps: it has no timer of its own);
        ``shards`` makes a sharded model's nest only where one is taken."""
        now = time.perf_counter()
        step_s = now - self.last_end if self.last_end is not None else 0.0
        if self.due(step, forced=False):
            self.take(step, trainer, state, step_s, shards=shards() if shards is not None else None)
        self.last_end = time.perf_counter()

    def take(self, step: int, trainer: Callable[[], dict], state, step_s: float, shards: dict | None = None) -> float:
        """Write this rank's parts of ``step`` into the next slot (:func:`take_parts`: rank 0's
        ``trainer()``, here on the first rank of every node too, and the hook's ``state``;
        where :attr:`sharded`, this rank's ``shards``, :func:`take_shards`' live nest); the
        seconds it took."""
        t0 = time.perf_counter()
        if self.enabled:
            hook = stable = None
            if isinstance(state, SplitState):
                hook, generation, rest = state.split_state_dict()
                stable = generation, rest, state.residuals_of
            parts = take_parts(0 if self.writes_trainer else self.rank, self.world, trainer, state, hook=hook)
            parts.rank = self.rank
            if shards is not None:
                parts.hook = {**(parts.hook or {}), "shards": local_shards(shards)}
            self._write(step, parts, stable)
        took = time.perf_counter() - t0
        self.total_s += took
        self.taken += 1
        # Auto: the first snapshots make the slots and reserve their memory (a slot's first
        # write touches fresh pages, several times slower: under local steps there are H + 1
        # slots); the next few are the cost, against the same steps' time.
        if self.fixed is None and self.taken > self.slot_count and len(self.costs) < MEASURED:
            self.costs.append((took, step_s))
            if len(self.costs) == MEASURED:
                self.every = self._agreed_every()
        return took

    def _slot(self, owner: str, index: int) -> _Slot:
        """A slot of this rank's, its last seal done (a few snapshots ago: long done)."""
        slot = self.slots.setdefault((owner, index), _Slot(self.directory / f"{owner}.{index}"))
        pending = self.sealing.pop(slot, None)
        if pending is not None:
            pending.result()
        return slot

    def _commit(self, slot: _Slot, size: int) -> int:
        self.sealing[slot] = self.sealer.submit(seal_slot, slot, size)
        return size

    def _write(self, step: int, parts: Parts, stable: tuple[int, Callable[[], dict], Callable] | None = None) -> None:
        index, written = self.count % self.slot_count, 0
        if stable is not None and stable[0] != self.stable_generation:
            # Written once a generation, into the older of two slots: the rank slots a restart
            # may take (the last round's and this one's) refer to the newer two.
            at = (self.stable_count % STABLE_SLOTS, step)
            rest = stable[1]()
            size = self._commit(slot := self._slot(f"stable{self.rank}", at[0]),
                                write_slot(slot, rest, step, self.world, self.rank, seal=False))
            memory = stable[2](rest) if self.peer is not None else None
            if memory:  # its arrays are the state dict's own copies: the thread may read them
                self._copy(step, memory)
            self.stable_generation, self.stable_at = stable[0], at
            self.stable_count += 1
            self.stable_bytes = max(self.stable_bytes, slot.size)  # the file, room to grow included
            written += size
        owners = [("trainer", parts.trainer)] if self.writes_trainer and parts.trainer is not None else []
        owners.append((f"rank{self.rank}", parts.hook if parts.hook is not None else {}))
        # What the rank's part shares with the trainer's (under local steps, inside a round:
        # its own parameters and inner optimizer) is written once, in the trainer's slot.
        shared: dict = {}
        files = 0
        for owner, nest in owners:
            slot, trainer = self._slot(owner, index), owner == "trainer"
            written += self._commit(slot, write_slot(
                slot, nest, step, self.world, self.rank, seal=False, refs=None if trainer else shared,
                base=index if shared and not trainer else -1, keys=shared if trainer else None,
                stable=self.stable_at if stable is not None and not trainer else (-1, -1)))
            files += slot.size
        self.count += 1
        self.bytes = written
        self.step_bytes = max(self.step_bytes, files)
        need = self.slot_count * self.step_bytes + (STABLE_SLOTS if stable is not None else 0) * self.stable_bytes
        if need > self.reserved:  # every slot file, each as big as the biggest so far
            if not self.ray.get(self.keeper.reserve.remote(f"rank{self.rank}", need)):
                self.enabled = False
                self.close(remove=True)
            self.reserved = need

    def _copy(self, step: int, memory: dict) -> None:
        """Hand the copy of ``step`` to the copier, unless the last one is still on its way
        (a link too slow for a copy a round): then this round goes without, said once, and
        a restart inside it resumes the lost rank without its residual."""
        if self.copying is not None and not self.copying.done():
            if not self.copies_behind:
                print(f"rayzip: rank {self.rank}: its last error-feedback copy is still on its way at step {step}: "
                      "rounds go without one while the link is busy")
            self.copies_behind = True
            return
        now = time.perf_counter()
        if not copy_fits(self.copy_s, now - self.copied_at if self.copied_at is not None else None):
            print(f"rayzip: rank {self.rank}: an error-feedback copy took {self.copy_s:.2f} s of a "
                  f"{now - self.copied_at:.2f} s round, over {COPY_SHARE:.0%}: no more copies (set "
                  "snapshots.copy_density lower); a lost node's ranks resume without their residual")
            self.peer = None
            return
        self.copied_at = now
        self.copying = self.copier.submit(self._send_copy, step, memory)

    def _send_copy(self, step: int, memory: dict) -> None:
        """On the copier's thread: this rank's residual copy to the peer keeper, the training
        thread not waiting (a copy that fails is said once; a restart then goes without)."""
        try:
            t0 = time.perf_counter()
            blob = pack_residuals(memory, self.copy_density)
            if self.ray.get(self.peer.hold_copy.remote(f"rank{self.rank}", step, blob), timeout=600):
                self.copied_bytes += len(blob)
            self.copy_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - the peer's node lost, or the copy refused
            if not self.copy_failed:
                self.copy_failed = True
                print(f"rayzip: rank {self.rank}: the copy of its error feedback after step {step} did not reach "
                      f"the next node's keeper ({type(exc).__name__}: {exc})")

    def _agreed_every(self) -> int:
        cost = statistics.median(c for c, _ in self.costs)
        step = statistics.median(s for _, s in self.costs)
        every = max(1, math.ceil(cost / (COST_SHARE * step))) if step > 0 else 1
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            t = torch.tensor([every], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank snapshots the same steps
            every = int(t)
        if every > 1:
            print(f"rayzip: rank {self.rank}: a snapshot takes {cost * 1e3:.1f} ms of a {step * 1e3:.1f} ms step: "
                  f"one every {every} steps")
        return every

    def close(self, remove: bool = False) -> None:
        self.copier.shutdown(wait=False, cancel_futures=True)  # the run's end: a copy is of no more use
        for pending in self.sealing.values():
            pending.result()
        self.sealing.clear()
        for slot in self.slots.values():
            slot.close()
            if remove:
                slot.path.unlink(missing_ok=True)
        self.slots.clear()

    # -- a restart -----------------------------------------------------------------------

    def newest(self) -> tuple[int, dict] | None:
        """The newest step the keepers hold complete, agreed by every rank, with where its
        parts are: (step, {owner: (node id, file)}); None when there is none.

        Complete: the trainer's part and every saved rank's. When a node's keeper is gone (the
        node with it), the ranks that no surviving keeper ever held are taken as that node's:
        a step is then complete without them, and their error feedback is lost (the restore
        takes the survivors' mean in its place: :func:`rayzip.codecs.memory.reshard_state`)."""
        held, lost = {}, []
        for node, keeper in self.keepers.items():
            try:
                if keeper is None:
                    raise LookupError("no such actor")
                held[node] = self.ray.get(keeper.inventory.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - a lost node's keeper: its slots are gone with it
                lost.append(node)
                print(f"rayzip: rank {self.rank}: the snapshot keeper of node {node[:12]} is gone "
                      f"({type(exc).__name__}); its slots are lost")
        where, worlds = placed(held)
        best = newest_complete(where, worlds, held, lost, self.world if self.sharded else None)
        agreed = self._agree(best)
        if agreed < 0:
            return None
        missing = sorted(set(f"rank{r}" for r in range(worlds[agreed])) - set(where[agreed]))
        if missing:
            print(f"rayzip: rank {self.rank}: step {agreed} is restored without {', '.join(missing)} "
                  f"(lost with node(s) {', '.join(n[:12] for n in lost)}): their error feedback is taken from "
                  "their copies on other nodes where kept, else estimated as the restore's combine rule says")
        return agreed, where[agreed]

    def _agree(self, step: int) -> int:
        if not (dist.is_available() and dist.is_initialized() and self.world > 1):
            return step
        t = torch.tensor([step, -step], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        high, low = int(t[0]), -int(t[1])
        if high != low:  # ranks that saw different keepers: storage is what they all see alike
            print(f"rayzip: rank {self.rank}: ranks found different newest snapshots ({low}..{high}); "
                  "resuming from storage")
            return -1
        return high

    @contextlib.contextmanager
    def newest_checkpoint(self):
        """The newest complete snapshot (:meth:`newest`, every rank together) as a Ray Train
        checkpoint in a folder removed afterwards, or None."""
        import ray.train

        found = self.newest()
        directory = self.checkpoint(*found) if found is not None else None
        try:
            yield ray.train.Checkpoint.from_directory(str(directory)) if directory is not None else None
        finally:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def checkpoint(self, step: int, owners: dict[str, tuple[str, str]]) -> Path:
        """Step ``step``'s parts, read (from this node's folder, else through its node's
        keeper) and written as a checkpoint folder for the loop's restore."""
        directory = Path(tempfile.mkdtemp(prefix="rayzip-snapshot-"))
        trainer, read = None, {}  # the trainer slot is read once, for the rank slots that refer to it too
        saved_world, rounds = self.world, set()
        for owner, (node, name) in sorted(owners.items()):
            if self.sharded and owner not in ("trainer", f"rank{self.rank}"):
                continue  # another rank's shards and state: that rank's restore reads them
            header, nest = self._read(node, name, read)
            if header["step"] != step:  # the slot was written again since it was listed
                raise SnapshotError(f"{name} on node {node[:12]} holds step {header['step']}, not {step}")
            if owner == "trainer":
                trainer, saved_world = nest, header["world"]
                continue
            if "stable" in header:
                rounds.add(header["stable"][1])  # the step whose synchronization its stable part holds
            shards = nest.pop("shards", None)
            if shards is not None:
                save_checkpoint(directory / OWN_SHARDS, shards)
            if nest:  # the rank's own, as a checkpoint holds it
                write_taken(directory, Parts(header["rank"], header["world"], None, nest))
        write_taken(directory, Parts(0, self.world, trainer, None))
        lost = [r for r in range(saved_world) if f"rank{r}" not in owners]
        if lost and len(rounds) == 1 and not self.sharded:
            self._copied(directory, lost, rounds.pop())
        return directory

    def _copied(self, directory: Path, lost: list[int], synchronized: int) -> None:
        """The lost ranks' copies of their error feedback after the synchronization of step
        ``synchronized`` (that of the survivors' stable parts), from the surviving keepers,
        into ``directory`` for the restore; a rank with none resumes without."""
        for r in lost:
            for node, keeper in sorted(self.keepers.items()):
                try:
                    blob = self.ray.get(keeper.copy_of.remote(f"rank{r}", synchronized), timeout=300) \
                        if keeper is not None else None
                except Exception:  # noqa: BLE001 - that keeper is gone too
                    blob = None
                if blob is not None:
                    where = f"copy-rank{r}.{synchronized} on node {node[:12]}"
                    save_checkpoint(directory / f"{COPIED}{r}", {"memory": unpack_residuals(blob, where)})
                    self.restored_copies.append(r)
                    print(f"rayzip: rank {self.rank}: rank {r}'s error feedback resumes from its copy after step "
                          f"{synchronized}, kept on node {node[:12]} ({len(blob):,} bytes)")
                    break
            else:
                print(f"rayzip: rank {self.rank}: no copy of rank {r}'s error feedback after step {synchronized} "
                      "survives: it resumes without")

    def _read(self, node: str, name: str, read: dict) -> tuple[dict, Any]:
        """A slot's header and nest; ``read`` holds the slots read so far, {(node, name): arrays}."""
        return read_part(name, lambda other: self._read_arrays(node, other, read), f" on node {node[:12]}")

    def _read_arrays(self, node: str, name: str, read: dict) -> tuple[dict, Any, list]:
        if (node, name) not in read:
            read[node, name] = self._fetch(node, name)
        return read[node, name]

    def _fetch(self, node: str, name: str) -> tuple[dict, Any, list]:
        if node == self.node_id and self.directory is not None:
            return read_arrays(self.directory / name)
        import zstandard

        packed = self.ray.get(self.keepers[node].read.remote(name), timeout=300)
        if packed is None:
            raise SnapshotError(f"{name} is gone from node {node[:12]}'s keeper")
        return read_arrays(f"{name} (node {node[:12]})", zstandard.ZstdDecompressor().decompress(packed))
