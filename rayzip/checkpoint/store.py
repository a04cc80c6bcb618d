"""The checkpoint directory: ``manifest.json.zst`` (zstd-compressed JSON) plus ``tensors.bin``.

``save(directory, state, base=...)`` writes any nest of dicts, lists and tuples whose
leaves are tensors (torch, numpy or cupy), numbers (NaN and Inf included, numpy scalars
too), strings, bytes or None; ``load(directory)`` returns the same nest with every tensor
bit-exact. Nothing is pickled: loading a checkpoint never runs code from it. Other objects
need ``save(..., allow_pickle=True)``, and loading them ``load(..., allow_pickle=True)``,
which trusts whoever could write the file.

The manifest (``zstd -dc manifest.json.zst`` prints it; :func:`read_manifest` reads it) lists,
per tensor: name (its path in the nest), dtype, shape, codec and codec
parameters, whether it is a delta against the base, the byte range of each of its streams
in ``tensors.bin`` and how each is coded, and two XXH3-64 checksums, of its stored bytes
and of its restored words. Small tensors of one kind are coded together as a *pack*: the
manifest's ``packs`` hold each pack's codec, streams and checksums, and each member's entry its
place in the pack and the checksum of its own words. The manifest also names the base
checkpoint (by path relative to this one, and the base's own checksum) and carries a checksum
of ``tensors.bin`` as a whole. Every mismatch raises :class:`CheckpointError` naming the file
and the tensor (for a pack's stream, the tensors coded in it).

Usage::

    save("ckpt-10", {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 10})
    save("ckpt-20", state, base="ckpt-10")            # weights stored as XOR deltas
    state = load("ckpt-20")                           # reads ckpt-10 too
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash
import zstandard

from ..xp import asnumpy, is_torch
from .codecs import CODECS, SAMPLE, Factored, choose, choose_delta, on_host, pack_stream, stream_plan, unpack_stream
from .crew import Crew, Pending, completed, threads_for
from .transforms import WORD_DTYPES, tensor_words, words_to_tensor

__all__ = ["CheckpointError", "FORMAT", "decode", "encode", "has_manifest", "inspect", "load", "read_manifest", "save",
           "verify", "write_manifest"]

FORMAT = "rayzip-checkpoint"
VERSION = 6  # 3: packs of small tensors; 4: Huffman streams of 2 MB or more coded in groups;
# 5: the manifest zstd-compressed; 6: the scaled codec
READABLE_VERSIONS = (2, 3, 4, 5, 6)
MANIFEST = "manifest.json.zst"
PLAIN_MANIFEST = "manifest.json"  # versions 2 to 4
MANIFEST_LEVEL = 9  # the manifest is small: a high level costs little and stores it several times smaller
MANIFEST_MOST_BYTES = 1 << 30  # a manifest that inflates beyond this is refused, not parsed
DATA = "tensors.bin"


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored exactly: names the file and the tensor."""


# --- the nest <-> (tree, leaves) ------------------------------------------------------------

def _flatten(obj: Any, path: str, tensors: dict[str, Any], objects: dict[str, bytes], allow_pickle: bool):
    if is_torch(obj) or isinstance(obj, np.ndarray) or type(obj).__module__.startswith("cupy"):
        tensors[path] = obj
        return {"$tensor": path}
    if isinstance(obj, dict):
        return {"$dict": [[_key(k, path), _flatten(v, f"{path}/{k}", tensors, objects, allow_pickle)]
                          for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", tensors, objects, allow_pickle) for i, v in enumerate(obj)]
        return {"$list" if isinstance(obj, list) else "$tuple": items}
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":  # numpy scalars, exactly
        return {"$scalar": [obj.dtype.str, _flatten(obj.item(), path, tensors, objects, False)]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else {"$float": repr(obj)}  # JSON has no NaN or Inf
    if isinstance(obj, bytes):
        return {"$bytes": base64.b64encode(obj).decode()}
    if not allow_pickle:
        raise CheckpointError(f"{path or '/'}: a {type(obj).__module__}.{type(obj).__qualname__} can only be "
                              "stored by pickling it, and loading a pickle runs code from the file: store "
                              "tensors, numbers, strings and containers, or pass allow_pickle=True to save "
                              "(and to load)")
    objects[path] = pickle.dumps(obj)
    return {"$pickle": path}


def _key(key: Any, path: str) -> Any:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    raise CheckpointError(f"{path}: dict key {key!r} is not a str or int")


def _unflatten(node: Any, tensors: dict[str, Any], objects: dict[str, bytes], source: Path, allow_pickle: bool):
    if not isinstance(node, dict):
        return node
    if "$tensor" in node:
        return tensors[node["$tensor"]]
    if "$float" in node:
        return float(node["$float"])
    if "$scalar" in node:
        dtype, value = node["$scalar"]
        return np.dtype(dtype).type(value)
    if "$bytes" in node:
        return base64.b64decode(node["$bytes"])
    if "$pickle" in node:
        if not allow_pickle:
            raise CheckpointError(f"{source}: entry {node['$pickle']!r} is a pickled object, and unpickling runs "
                                  "code from the file: refused. Load with allow_pickle=True (rayzip checkpoint "
                                  "decompress --allow-pickle) only if you trust whoever could write it")
        return pickle.loads(objects[node["$pickle"]])
    if "$dict" in node:
        return {k: _unflatten(v, tensors, objects, source, allow_pickle) for k, v in node["$dict"]}
    items = [_unflatten(v, tensors, objects, source, allow_pickle) for v in node.get("$list", node.get("$tuple", []))]
    return items if "$list" in node else tuple(items)


# --- save ---------------------------------------------------------------------------------

def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def save(directory: str | os.PathLike, state: Any, base: str | os.PathLike | None = None,
         optimizer_state: Callable[[str], bool] | None = None, delta: Callable[[str], bool] | None = None,
         absolute_base: bool = False, threads: int | None = None, allow_pickle: bool = False,
         gpu_coding: bool = False) -> dict:
    """Write ``state`` to ``directory``, losslessly compressed.

    Names are paths in the nest: ``/model/fc.weight``.

    Args:
        directory: created if missing; a checkpoint there is replaced.
        state: a nest of dicts, lists and tuples of tensors, numbers, strings and bytes.
        base: a checkpoint directory: tensors present there with the same dtype and shape, and
            for which ``delta(name)`` holds, are stored as XOR deltas against it.
        optimizer_state: marks tensors whose codec choice tries the prefix mapping first
            (default: names under ``optimizer``).
        delta: which tensors may be stored against ``base`` (default: all).
        absolute_base: record the base by absolute path, not relative to ``directory`` (for a
            checkpoint that will be moved, as Ray moves reported ones).
        threads: code streams in parallel (default: the usable cores, at most 8).
        allow_pickle: let other leaves be pickled; without it they raise
            :class:`CheckpointError` naming their path.
        gpu_coding: Huffman-code the streams of CUDA tensors on the GPU, so that only their
            coded bytes cross to the host (needs rayzip's CUDA kernels; the bytes written are
            the same). Off by default: one plane codes faster there, but a whole model's
            checkpoint measured slower (docs/guides/gpu.md).

    Returns:
        The manifest.

    Example::

        checkpoint.save("ckpt-110", state, base="ckpt-100")
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, PLAIN_MANIFEST):  # a checkpoint rewritten here is unreadable until it is whole
        (directory / name).unlink(missing_ok=True)
    with open(directory / DATA, "wb") as out:
        manifest = _encode(state, base, optimizer_state, delta, out.write,
                           None if absolute_base else directory.resolve(), threads, allow_pickle, gpu_coding)
    write_manifest(directory, manifest)
    return manifest


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest file's bytes: compact JSON, zstd-compressed. Its JSON is a tenth of a
    percent of a model's checkpoint (20 KB for the GPT workload's 52 weight tensors: names,
    shapes, stream offsets and checksums), as much as rayzip's coding gains on some layers."""
    return zstandard.ZstdCompressor(level=MANIFEST_LEVEL).compress(json.dumps(manifest, separators=(",", ":")).encode())


def write_manifest(directory: str | os.PathLike, manifest: dict) -> None:
    """Write ``manifest`` into checkpoint ``directory``, atomically: a reader sees the old
    file or the new one whole, and :func:`save` writes it last, after ``tensors.bin``."""
    directory = Path(directory)
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_bytes(manifest_bytes(manifest))
    os.replace(tmp, directory / MANIFEST)
    (directory / PLAIN_MANIFEST).unlink(missing_ok=True)  # a stale version-4 one would mislead its readers


def has_manifest(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a complete checkpoint's manifest (of any version)."""
    return (Path(directory) / MANIFEST).exists() or (Path(directory) / PLAIN_MANIFEST).exists()


def encode(state: Any, base: str | os.PathLike | None = None,
           optimizer_state: Callable[[str], bool] | None = None,
           delta: Callable[[str], bool] | None = None, threads: int | None = None,
           allow_pickle: bool = False, gpu_coding: bool = False) -> tuple[dict, list]:
    """``(manifest, blobs)``: :func:`save` in memory; ``b"".join(blobs)`` is ``tensors.bin``.
    The base, if any, is recorded by absolute path."""
    blobs: list = []
    return _encode(state, base, optimizer_state, delta, blobs.append, None, threads, allow_pickle, gpu_coding), blobs


def _encode(state: Any, base, optimizer_state, delta, write: Callable[[Any], Any],
            relative_to: Path | None, threads: int | None, allow_pickle: bool = False,
            gpu_coding: bool = False) -> dict:
    return _Encoder(state, base, optimizer_state, delta, write, relative_to, threads, allow_pickle, gpu_coding).run()


class _Encoder:
    """One checkpoint's encoding: each tensor's codec choice and transform, and then each of its
    streams, are tasks for the crew of threads (the kernels, zstd and xxhash release the GIL);
    this thread writes the results, in order, and runs queued tasks while it waits for one.
    With as many busy threads as cores, a transform does not preempt the coding of the streams
    before it. A window bounds how many tensors are in flight. Small tensors are packed (see
    :meth:`prepare_pack`); one alone of its kind is coded in a batch with others of that size,
    one task per batch."""

    def __init__(self, state: Any, base, optimizer_state, delta, write: Callable[[Any], Any],
                 relative_to: Path | None, threads: int | None, allow_pickle: bool, gpu_coding: bool = False):
        self.gpu_coding = gpu_coding
        self.tensors: dict[str, Any] = {}
        self.objects: dict[str, bytes] = {}
        self.tree = _flatten(state, "", self.tensors, self.objects, allow_pickle)
        self.is_optimizer = optimizer_state or (lambda name: name.startswith("/optimizer"))
        self.wants_delta = delta or (lambda name: True)
        self.base_tensors, self.base_ref = {}, None
        if base is not None:
            where = Path(base).resolve()
            checksum = read_manifest(where)["checksum"]
            self.base_tensors = _base_words(where, checksum, {n for n in self.tensors if self.wants_delta(n)})
            self.base_ref = {"path": str(where) if relative_to is None else os.path.relpath(where, relative_to),
                             "checksum": checksum}
        self.write, self.threads, self.workers = write, threads, threads_for(threads)
        self.entries: dict[str, dict] = {}
        self.packs: list[dict | None] = []
        self.members: dict[str, dict] = {}
        self.pending: deque = deque()
        self.offset = 0
        # A model's layers repeat: the codec chosen for the largest tensor of a family (same
        # dtype, delta or not, weights or optimizer state, matrix or not, and the last part of
        # the name: "weight" of "/model/blocks.0.mlp.weight", "exp_avg_sq") serves the others,
        # which then skip the trial encodings. Tensors too small to sample take the default
        # codec anyway. The family's first tensor in the order of submission (the largest)
        # decides, whichever thread gets there first: the bytes then do not depend on the
        # threads (when the first thread to arrive decided, two threads sometimes stored a
        # checkpoint larger than one). Its call was queued before any other member's, so the
        # others wait only for a call already running.
        self.family_of: dict[str, tuple | None] = {}  # filled by run(), before any task runs
        self.decided: dict[tuple, Future] = {}  # per family, the choice
        self.leaders: dict[tuple, str] = {}  # per family, the tensor that makes it

    def put(self, blob, nbytes: int, coding: str, digest: str) -> dict:
        self.write(blob)
        stream = {"offset": self.offset, "stored": len(blob), "nbytes": nbytes, "coding": coding, "xxh3": digest}
        self.offset += len(blob)
        return stream

    def base_of(self, name: str) -> Any:
        """The base's words for a tensor stored as a delta, else None."""
        tensor, base_words = self.tensors[name], self.base_tensors.get(name)
        if (base_words is not None and base_words[1] == _dtype_name(tensor)
                and tuple(base_words[2]) == tuple(tensor.shape) and self.wants_delta(name)):
            return base_words[0]
        return None

    def prepare(self, name: str, submit: Callable[..., Pending]) -> tuple[dict, list[Pending], Pending]:
        tensor = self.tensors[name]
        words, xp = tensor_words(tensor)
        words_hash = submit(_hash, asnumpy(words))  # first: another thread checksums while this one codes
        dtype = _dtype_name(tensor)
        base_words = self.base_of(name)
        prior = xp.asarray(base_words) if base_words is not None else None
        codec, against_base = self.choose_for_family(name, words, prior, dtype, xp, tuple(tensor.shape))
        prior = prior if against_base else None
        streams, params = codec.encode(words, prior, xp, shape=tuple(tensor.shape), threads=self.workers)
        entry = {"dtype": dtype, "shape": list(tensor.shape), "codec": codec.name, "params": params,
                 "delta": prior is not None}
        return entry, self.pack_tasks(streams, submit), words_hash

    def pack_tasks(self, streams: list, submit: Callable[..., Pending]) -> list[Pending]:
        """Each stream's packing. The coded ones are submitted first, so that they start while
        this thread checksums the ones stored raw: done here, a checksum costs less than a
        task's hand-off, which holds the GIL. Under ``gpu_coding``, streams on the GPU are
        packed here too: their coding runs on the GPU, queued on this thread's stream behind
        the work that made them."""
        plans = [stream_plan(stream) for stream in streams]
        raw = [plan is not None and plan[0] == "raw" for plan in plans]
        here = [raw[k] or (self.gpu_coding and not on_host(stream)) for k, stream in enumerate(streams)]
        return _coded_first(raw, lambda k: (completed if here[k] else submit)(_pack, streams[k], self.workers,
                                                                               plans[k], self.gpu_coding))

    def family(self, name: str) -> tuple | None:
        """The key of the family whose codec choice ``name`` takes; None if too small to sample."""
        tensor, shape = self.tensors[name], tuple(self.tensors[name].shape)
        if math.prod(shape) <= SAMPLE:
            return None
        return (_dtype_name(tensor), self.base_of(name) is not None, bool(self.is_optimizer(name)),
                Factored.matrix(shape) is not None, _last_part(name), on_host(tensor))  # host-only codecs

    def choose_for_family(self, name: str, words, prior, dtype: str, xp, shape: tuple[int, ...]):
        """``(codec, whether to code against the base)``; False where there is none."""
        key = self.family_of[name]
        if key is None:
            return choose_for(words, prior, dtype, xp, self.is_optimizer(name), shape)
        if self.leaders[key] == name:
            try:
                self.decided[key].set_result(choose_for(words, prior, dtype, xp, self.is_optimizer(name), shape))
            except BaseException as exc:
                self.decided[key].set_exception(exc)
        return self.decided[key].result()

    def prepare_batch(self, names: list[str]) -> list[tuple[dict, list[Pending], Pending]]:
        return [self.prepare(name, completed) for name in names]

    def prepare_pack(self, index: int, names: list[str], submit: Callable[..., Pending]):
        """Small tensors of one kind (dtype, delta or not, weights or optimizer state) coded
        together, as one pack of their words in manifest order: a model's hundreds of biases and
        norms then cost one codec choice, a few streams and their checksums, not that much
        each. Each member keeps its own entry, with its place in the pack and the checksum of
        its words."""
        parts = [tensor_words(self.tensors[name])[0] for name in names]
        dtype, words = _dtype_name(self.tensors[names[0]]), np.concatenate(parts)
        priors = [self.base_of(name) for name in names]
        prior = np.concatenate([np.asarray(p) for p in priors]) if priors[0] is not None else None
        codec, against_base = choose_for(words, prior, dtype, np, self.is_optimizer(names[0]))
        prior = prior if against_base else None
        streams, params = codec.encode(words, prior, np)
        start = 0
        for name, part in zip(names, parts):
            self.members[name] = {"dtype": dtype, "shape": list(self.tensors[name].shape), "codec": "packed",
                                  "params": {}, "delta": prior is not None, "pack": [index, start], "streams": [],
                                  "xxh3": _hash(part)}
            start += part.size
        entry = {"dtype": dtype, "count": int(words.size), "codec": codec.name, "params": params,
                 "delta": prior is not None, "members": names}
        return [(entry, self.pack_tasks(streams, submit), completed(_hash, words))]

    def drain(self, pool: Crew, keep: int) -> None:
        """Write the results of all but ``keep`` tensors in flight, in order."""
        while len(self.pending) > keep:
            keep_entry, prepared = self.pending.popleft()
            for store_entry, (entry, futures, words_hash) in zip(keep_entry, pool.result(prepared)):
                entry["streams"] = [self.put(*pool.result(future)) for future in futures]
                entry["xxh3"] = pool.result(words_hash)
                store_entry(entry)

    def into_entries(self, name: str) -> Callable[[dict], None]:
        return lambda entry: self.entries.__setitem__(name, entry)

    def into_packs(self, index: int) -> Callable[[dict], None]:
        return lambda entry: self.packs.__setitem__(index, entry)

    def run(self) -> dict:
        """Code every tensor and object; the manifest."""
        tensors = self.tensors
        groups = _pack_groups(tensors, lambda name: (self.base_of(name) is not None, bool(self.is_optimizer(name))))
        packed = {name for names in groups for name in names}
        batches = _batches({name: int(tensor.nbytes) for name, tensor in tensors.items() if name not in packed})
        for name in (name for names in batches for name in names):
            self.family_of[name] = key = self.family(name)
            if key is not None and key not in self.leaders:
                self.leaders[key], self.decided[key] = name, Future()
        # The packs, then the largest tensors first, so that the threads end on small ones together.
        with Crew(self.threads) as pool:
            for index, names in enumerate(groups):
                self.packs.append(None)
                self.pending.append(([self.into_packs(index)],
                                     pool.submit(self.prepare_pack, index, names, pool.submit)))
                self.drain(pool, keep=2 * pool.workers)
            for names in batches:
                if tensors[names[0]].nbytes >= SMALL_TENSOR_BYTES:  # alone in its batch
                    self.pending.append(([self.into_entries(names[0])],
                                         pool.submit(lambda name=names[0]: [self.prepare(name, pool.submit)])))
                else:
                    self.pending.append(([self.into_entries(name) for name in names],
                                         pool.submit(self.prepare_batch, names)))
                self.drain(pool, keep=2 * pool.workers)
            self.drain(pool, keep=0)
        entries = {**self.entries, **self.members}
        entries = {name: entries[name] for name in tensors}  # the manifest lists them as the state does
        for name, blob in self.objects.items():
            entries[name] = {"pickle": True, "streams": [self.put(blob, len(blob), "raw", _hash(blob))]}
        return {"format": FORMAT, "version": VERSION, "base": self.base_ref, "data": DATA, "data_bytes": self.offset,
                "checksum": _whole(_stream_hashes(entries, self.packs)), "tree": self.tree, "tensors": entries,
                "packs": self.packs}


def choose_for(words, prior, dtype: str, xp, optimizer_state: bool, shape: tuple[int, ...] | None = None):
    """``(codec, whether to code against the base)`` for a tensor, or a pack, with or without one."""
    if prior is None:
        return choose(words, None, dtype, xp, optimizer_state, shape), False
    return choose_delta(words, prior, dtype, xp, optimizer_state, shape)


def _pack_groups(tensors: dict[str, Any], kind: Callable[[str], tuple]) -> list[list[str]]:
    """Names of the small host tensors to code together, in state order, in packs of up to
    ``PACK_BYTES``: of one dtype and ``kind``, and of one *family* (vectors or matrices, and
    the last part of the name: a model's layer-norm weights, near 1, apart from its biases,
    near 0, whose mantissas are then skewed enough to code). Tensors alone in their family
    are packed with the others of their dtype, kind and last part of the name (a matrix with
    the vectors: the MLP's output layer's 10×2048 first moment with the first moments of its
    biases, not with its second moment, which stored them 6 KB larger); one alone even there
    is not packed. Packing the GPT workload's 35 small weights by family stored them 2.2%
    smaller (5 KB)."""
    families = _grouped([(name, tensor) for name, tensor in tensors.items()
                         if 0 < int(tensor.nbytes) < SMALL_TENSOR_BYTES and on_host(tensor)],
                        lambda name, tensor: (_dtype_name(tensor), *kind(name), len(tensor.shape) >= 2,
                                              _last_part(name)))
    packs = [names for names in families if len(names) > 1]
    alone = {names[0] for names in families if len(names) == 1}
    packs += _grouped([(name, tensor) for name, tensor in tensors.items() if name in alone],
                      lambda name, tensor: (_dtype_name(tensor), *kind(name), _last_part(name)))
    return [names for names in packs if len(names) > 1]


def _grouped(tensors: list[tuple[str, Any]], key: Callable[[str, Any], tuple]) -> list[list[str]]:
    """Names by ``key``, in their order, cut into runs of at most ``PACK_BYTES``."""
    groups: dict[tuple, list[list[str]]] = {}
    sizes: dict[tuple, int] = {}
    for name, tensor in tensors:
        nbytes, group = int(tensor.nbytes), key(name, tensor)
        if group not in groups or sizes[group] + nbytes > PACK_BYTES:
            groups.setdefault(group, []).append([])
            sizes[group] = 0
        groups[group][-1].append(name)
        sizes[group] += nbytes
    return [names for runs in groups.values() for names in runs]


def _last_part(name: str) -> str:
    """``weight`` of ``/model/blocks.0.ln1.weight``, ``exp_avg`` of ``/optimizer/state/0/exp_avg``."""
    return name.rsplit("/", 1)[-1].rsplit(".", 1)[-1]


def _stream_hashes(entries: dict, packs: list) -> list[str]:
    """Every stream's checksum: the tensors' in manifest order, then the packs'."""
    return ([s["xxh3"] for entry in entries.values() for s in entry["streams"]]
            + [s["xxh3"] for pack in packs for s in pack["streams"]])


SMALL_TENSOR_BYTES = 1 << 18  # tensors below this are coded together (and restored) in packs
PACK_BYTES = 1 << 23  # at most this many bytes of them in one pack
BATCH_BYTES = 1 << 21  # of about this many bytes each


def _batches(sizes: dict[str, int]) -> list[list[str]]:
    """Names, largest first: alone from ``SMALL_TENSOR_BYTES`` up, the smaller ones together
    in batches of about ``BATCH_BYTES``."""
    batches, current, size = [], [], 0
    for name in sorted(sizes, key=lambda name: -sizes[name]):
        if sizes[name] >= SMALL_TENSOR_BYTES:
            batches.append([name])
            continue
        current.append(name)
        size += sizes[name]
        if size >= BATCH_BYTES:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    return batches


def _in_order_batches(entries: list[tuple[str, dict]]) -> list[list[tuple[str, dict]]]:
    """Manifest entries in their order, consecutive small ones together (as :func:`_batches`)."""
    batches: list[list[tuple[str, dict]]] = []
    size = BATCH_BYTES
    for name, entry in entries:
        nbytes = _entry_bytes(entry)
        if nbytes >= SMALL_TENSOR_BYTES or size >= BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((name, entry))
        size = BATCH_BYTES if nbytes >= SMALL_TENSOR_BYTES else size + nbytes
    return batches


def _entry_bytes(entry: dict) -> int:
    """An entry's restored size; 0 for one too malformed to say (restoring it names it)."""
    try:
        if entry.get("pickle"):
            return sum(int(s["nbytes"]) for s in entry["streams"])
        return int(np.prod(entry["shape"], dtype=np.int64)) * _itemsize(entry["dtype"])
    except Exception:
        return 0


def _pack(stream, threads: int = 1, plan: tuple[str, int] | None = None,
          gpu_coding: bool = False) -> tuple[Any, int, str, str]:
    blob, coding = pack_stream(stream, threads=threads, plan=plan, gpu_coding=gpu_coding)
    return blob, int(stream.nbytes), coding, _hash(blob)


_BASE_CACHE: dict[tuple, dict] = {}


def _base_words(where: Path, checksum: str, names: set[str]) -> dict:
    """The base's words for ``names``; the last base used stays cached, as a training run
    writes many deltas against one base."""
    key = (str(where), checksum, frozenset(names))
    if key not in _BASE_CACHE:
        _BASE_CACHE.clear()
        _BASE_CACHE[key] = _load_tensors(where, words_only=True, names=names)
    return _BASE_CACHE[key]


# --- load ---------------------------------------------------------------------------------

def read_manifest(directory: str | os.PathLike, opener: Callable[[str], bytes] | None = None) -> dict:
    """The manifest of checkpoint ``directory`` (``manifest.json.zst``, or the plain
    ``manifest.json`` of versions 2 to 4); :class:`CheckpointError` naming the file if it is
    missing or not a manifest. ``opener`` reads a file's bytes by its path (default: the
    local disk's), for a checkpoint on another filesystem: cloud storage, read for its
    manifest alone."""
    read = opener or (lambda path: Path(path).read_bytes())
    directory = str(directory).rstrip("/")
    path = f"{directory}/{MANIFEST}"
    try:
        text = zstandard.ZstdDecompressor().decompress(read(path), max_output_size=MANIFEST_MOST_BYTES)
    except FileNotFoundError:
        path = f"{directory}/{PLAIN_MANIFEST}"
        try:
            text = read(path)
        except FileNotFoundError:
            raise CheckpointError(f"{directory}/{MANIFEST}: no manifest; not a rayzip checkpoint") from None
    except zstandard.ZstdError as exc:
        raise CheckpointError(f"{path}: manifest cannot be decompressed ({exc})") from None
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({exc})") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or manifest.get("version") not in READABLE_VERSIONS):
        raise CheckpointError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    return manifest


def manifest_entry(manifest: dict, key: str, default: Any = None) -> Any:
    """A number, string or None saved at ``key`` of the checkpoint's top-level dict, from its
    manifest alone (no tensor is read); ``default`` where there is none, or it is not such a leaf."""
    tree = manifest.get("tree")
    for name, value in (tree.get("$dict", []) if isinstance(tree, dict) else []):
        if name == key:
            return value if value is None or isinstance(value, (int, float, str)) else default
    return default


def _base_dir(directory: Path, manifest: dict) -> Path | None:
    ref = manifest.get("base")
    if not ref:
        return None
    base = (directory / ref["path"]).resolve()
    if not has_manifest(base):
        raise CheckpointError(f"{directory / MANIFEST}: its base checkpoint {base} is missing")
    found = read_manifest(base)["checksum"]
    if found != ref["checksum"]:
        raise CheckpointError(f"{directory / MANIFEST}: base {base} has checksum {found}, "
                              f"the delta was made against {ref['checksum']}")
    return base


def _load_tensors(directory: Path, words_only: bool = False, names: set[str] | None = None,
                  threads: int | None = None):
    """{name: (words, dtype, shape)} when words_only, else the manifest and restored leaves."""
    manifest = read_manifest(directory)
    if manifest.get("data") != DATA:  # never a path the manifest could point elsewhere with
        raise CheckpointError(f"{directory / MANIFEST}: its data file is {manifest.get('data')!r}, not {DATA!r}")
    data_path = directory / DATA
    try:
        data = data_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{data_path}: missing") from None
    return _decode(manifest, memoryview(data), data_path, _base_dir(directory, manifest), words_only, names, threads)


def decode(manifest: dict, blobs: list, threads: int | None = None, allow_pickle: bool = False) -> Any:
    """Inverse of :func:`encode`; ``threads`` and ``allow_pickle`` as for :func:`load`."""
    manifest, tensors, objects = _decode(manifest, _Pieces(blobs), Path(DATA), _base_dir(Path("/"), manifest),
                                         threads=threads)
    return _unflatten(manifest["tree"], tensors, objects, Path(DATA), allow_pickle)


class _Pieces:
    """``b"".join(blobs)`` without the copy: a slice within one blob is a view of it."""

    def __init__(self, blobs: list):
        self.blobs = [memoryview(b).cast("B") for b in blobs]
        self.starts = np.cumsum([0] + [b.nbytes for b in self.blobs])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, piece: slice):
        i = int(np.searchsorted(self.starts, piece.start, side="right")) - 1
        if i < len(self.blobs) and piece.stop <= self.starts[i + 1]:
            return self.blobs[i][piece.start - self.starts[i]: piece.stop - self.starts[i]]
        return memoryview(b"".join(self.blobs))[piece]


def _decode(manifest: dict, data: memoryview | _Pieces, data_path: Path, base_dir: Path | None,
            words_only: bool = False, names: set[str] | None = None, threads: int | None = None):
    if len(data) != manifest["data_bytes"]:
        raise CheckpointError(f"{data_path}: {len(data)} bytes, the manifest records {manifest['data_bytes']} "
                              f"(truncated or appended); first tensor affected: "
                              f"{_first_beyond(manifest, len(data))}")
    decoder = _Decoder(manifest, data, data_path, base_dir, words_only, threads)
    decoder.run(names)
    if names is None and _whole(_stream_hashes(manifest["tensors"], decoder.packs)) != manifest["checksum"]:
        raise CheckpointError(f"{data_path.parent / MANIFEST}: the stream checksums do not add up to its whole "
                              f"checksum {manifest['checksum']} (the manifest was edited)")
    if words_only:
        return decoder.tensors
    return manifest, decoder.tensors, decoder.objects


class _Decoder:
    """One checkpoint's restoring. Large tensors are restored as a task per stream, then one
    joining them, so that two threads share one large tensor; small ones in batches, a task
    each. Hashing, Huffman decoding and the transforms release the GIL. No task waits for
    another: this thread submits each join once its streams are in. With threads, the largest
    tensors' streams are submitted first, coded before raw, as they take longest; with one,
    every call runs as it is submitted, packs first. Results are taken in manifest order, so
    the first bad tensor in that order is the one an error names."""

    def __init__(self, manifest: dict, data: memoryview | _Pieces, data_path: Path, base_dir: Path | None,
                 words_only: bool, threads: int | None):
        self.manifest, self.data, self.data_path, self.base_dir = manifest, data, data_path, base_dir
        self.words_only, self.threads, self.workers = words_only, threads, threads_for(threads)
        self.packs = manifest.get("packs") or []
        needs_base = any(e.get("delta") for e in manifest["tensors"].values())
        self.base = (_load_tensors(base_dir, words_only=True, threads=threads)
                     if base_dir is not None and needs_base else {})
        self.tensors: dict[str, Any] = {}
        self.objects: dict[str, bytes] = {}

    def named(self, name: str, fn: Callable, *args, what: str | None = None) -> Any:
        """``fn(*args)``, any failure of a decoder on bad input raised as a CheckpointError
        naming the tensor (or ``what``: a pack's tensors)."""
        try:
            return fn(*args)
        except CheckpointError:
            raise
        except Exception as exc:  # a stream or manifest entry that its decoder cannot take
            raise CheckpointError(f"{self.data_path}: {what or f'tensor {name!r}'}: cannot be restored "
                                  f"({type(exc).__name__}: {exc})") from None

    def unpack(self, name: str, entry: dict, s: dict, what: str | None = None) -> np.ndarray:
        """One stream's bytes, checked against its checksum and size."""
        what = what or f"tensor {name!r}"
        blob = self.data[s["offset"]: s["offset"] + s["stored"]]
        if _hash(blob) != s["xxh3"]:
            raise CheckpointError(f"{self.data_path}: {what}: stored bytes fail their checksum (corrupt)")
        try:
            stream = unpack_stream(blob, s["coding"], s["nbytes"], self.workers)
        except Exception as exc:
            raise CheckpointError(f"{self.data_path}: {what}: cannot decompress ({exc})") from None
        if not entry.get("pickle") and s["nbytes"] > _most_stream_bytes(entry):
            raise CheckpointError(f"{self.data_path}: {what}: a stream of {s['nbytes']} bytes is "
                                  "larger than the tensor could need")
        return stream

    def based(self, names: list[str]) -> list[np.ndarray]:
        """The base's words of each of ``names``, stored against it."""
        missing = [name for name in names if name not in self.base]
        if missing:
            raise CheckpointError(f"{self.data_path}: tensor {missing[0]!r} is a delta, but base {self.base_dir} "
                                  "does not hold it")
        return [self.base[name][0] for name in names]

    def restore_pack(self, index: int) -> dict[str, np.ndarray]:
        """{member: its words} of one pack, each checked against its own checksum."""
        pack, data_path = self.packs[index], self.data_path
        names = list(pack["members"])
        what = _pack_label(names)
        dtype, count = pack["dtype"], int(pack["count"])
        streams = [self.unpack(names[0], pack, s, what) for s in pack["streams"]]
        prior = np.concatenate(self.based(names)) if pack["delta"] else None
        words = self.named(names[0], CODECS[pack["codec"]]().decode, streams, pack["params"], count,
                           WORD_DTYPES[_itemsize(dtype)], prior, np, what=what)
        if words.size != count or _hash(words) != pack["xxh3"]:
            raise CheckpointError(f"{data_path}: {what}: restored words fail their checksum")
        restored = {}
        for name in names:
            entry = self.manifest["tensors"][name]
            size = int(np.prod(entry["shape"], dtype=np.int64))
            where, start = entry["pack"]
            if where != index or entry["dtype"] != dtype or not 0 <= start <= count - size:
                raise CheckpointError(f"{data_path}: tensor {name!r}: its place in pack {index} is not there")
            part = words[start: start + size]
            if _hash(part) != entry["xxh3"]:
                raise CheckpointError(f"{data_path}: tensor {name!r}: restored words fail their checksum")
            restored[name] = part
        return restored

    def join(self, name: str, entry: dict, streams: list) -> Any:
        """The tensor's words from its streams, or a pickled object's bytes."""
        if entry.get("pickle"):
            return streams[0].tobytes()
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        prior = self.based([name])[0] if entry["delta"] else None
        codec = CODECS[entry["codec"]]()
        words = codec.decode(streams, entry["params"], count, WORD_DTYPES[_itemsize(dtype)], prior, np, self.workers)
        if words.size != count or _hash(words) != entry["xxh3"]:
            raise CheckpointError(f"{self.data_path}: tensor {name!r}: restored words fail their checksum")
        return words

    def restore_batch(self, batch: list[tuple[str, dict]]) -> list:
        return [self.named(name, lambda n=name, e=entry: self.join(n, e, [self.unpack(n, e, s) for s in e["streams"]]))
                for name, entry in batch]

    def keep(self, name: str, entry: dict, words: np.ndarray) -> None:
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        self.tensors[name] = (words, dtype, shape) if self.words_only else words_to_tensor(words, dtype, shape)

    def submit_streams(self, pool: Crew, name: str, entry: dict) -> list[Pending]:
        streams = entry.get("streams", [])
        return _coded_first([_stored_raw(s) for s in streams],
                            lambda k: pool.submit(self.named, name, self.unpack, name, entry, streams[k]))

    def submit_packs(self, pool: Crew, in_packs: dict[str, Any]) -> dict[int, Pending]:
        work = {}
        for name, where in in_packs.items():
            index = where[0] if isinstance(where, list) and where and isinstance(where[0], int) else None
            if index is None or not 0 <= index < len(self.packs):
                raise CheckpointError(f"{self.data_path}: tensor {name!r}: its pack {where!r} is not in the manifest")
            if index not in work:
                what = f"pack {index} (with tensor {name!r})"
                work[index] = pool.submit(lambda n=name, i=index, w=what: self.named(n, self.restore_pack, i, what=w))
        return work

    def run(self, names: set[str] | None) -> None:
        wanted = [(name, entry) for name, entry in self.manifest["tensors"].items() if names is None or name in names]
        in_packs = {name: entry["pack"] for name, entry in wanted if "pack" in entry}
        wanted = [(name, entry) for name, entry in wanted if name not in in_packs]
        batches = _in_order_batches(wanted)
        large = [i for i, batch in enumerate(batches)
                 if len(batch) == 1 and _entry_bytes(batch[0][1]) >= SMALL_TENSOR_BYTES]
        with Crew(self.threads) as pool:
            started: dict[int, Any] = {}  # per batch, its streams' futures (a large tensor) or its task's
            if pool.workers > 1:
                for i in sorted(large, key=lambda i: -_entry_bytes(batches[i][0][1])):
                    started[i] = self.submit_streams(pool, *batches[i][0])
            pack_work = self.submit_packs(pool, in_packs)
            for i, batch in enumerate(batches):
                if i not in started:
                    started[i] = (self.submit_streams(pool, *batch[0]) if i in large
                                  else pool.submit(self.restore_batch, batch))
            joined: list[tuple[list, Pending]] = []
            for i, batch in enumerate(batches):
                work = started[i]
                if isinstance(work, list):
                    name, entry = batch[0]
                    try:
                        streams = [pool.result(future) for future in work]
                    except CheckpointError:
                        for _, earlier in joined:  # a tensor before this one may be bad too
                            pool.result(earlier)
                        raise
                    work = pool.submit(lambda n=name, e=entry, st=streams: [self.named(n, self.join, n, e, st)])
                joined.append((batch, work))
            for batch, work in joined:
                for (name, entry), restored in zip(batch, pool.result(work)):
                    if entry.get("pickle"):
                        self.objects[name] = restored
                    else:
                        self.keep(name, entry, restored)
            for name, where in in_packs.items():
                restored = pool.result(pack_work[where[0]]).get(name)
                if restored is None:
                    raise CheckpointError(f"{self.data_path}: tensor {name!r}: not among the members of its "
                                          f"pack {where[0]}")
                self.keep(name, self.manifest["tensors"][name], restored)


def _coded_first(raw: list[bool], start: Callable[[int], Pending]) -> list[Pending]:
    """``start(k)`` for every stream k, the coded ones (not ``raw[k]``) first, as their
    coding or decoding takes longest; the futures in the streams' order."""
    futures = {k: start(k) for k in sorted(range(len(raw)), key=lambda k: raw[k])}
    return [futures[k] for k in range(len(raw))]


def _stored_raw(stream: Any) -> bool:
    """Whether a manifest's stream entry says raw (anything else, however malformed, not)."""
    return isinstance(stream, dict) and stream.get("coding") == "raw"


def _most_stream_bytes(entry: dict) -> int:
    """No stream of a tensor (or pack) is larger than two bytes per element (prefix escapes)
    or its raw size."""
    count = int(entry["count"]) if "count" in entry else int(np.prod(entry["shape"], dtype=np.int64))
    return max(2, _itemsize(entry["dtype"])) * count


def _pack_label(names: list[str]) -> str:
    """How errors name a pack: by its tensors."""
    shown = ", ".join(repr(name) for name in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"tensors {shown}{more} (coded together)"


def _hash(data) -> str:
    """XXH3-64 of the bytes, as hex: checksums at memory speed (CRC-32 was a quarter of the
    time of a save)."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data).view(np.uint8) if isinstance(data, np.ndarray) else data)


def _whole(hashes: list[str]) -> str:
    """The checksum of the whole: an XXH3-64 of the streams' checksums, in manifest order. With
    the data size and every stream's own checksum checked, it covers every stored byte."""
    return f"xxh3:{xxhash.xxh3_64_hexdigest(','.join(hashes).encode())}"


def _first_beyond(manifest: dict, size: int) -> str:
    """The tensor (or pack) of the first stream, in file order, that ends past ``size``."""
    cut = [(s["offset"], repr(name)) for name, entry in manifest["tensors"].items() for s in entry["streams"]
           if s["offset"] + s["stored"] > size]
    cut += [(s["offset"], _pack_label(pack["members"])) for pack in manifest.get("packs") or []
            for s in pack["streams"] if s["offset"] + s["stored"] > size]
    return min(cut)[1] if cut else "none"


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def load(directory: str | os.PathLike, threads: int | None = None, allow_pickle: bool = False) -> Any:
    """The state saved in ``directory``, bit for bit, with torch tensors on the CPU.

    Args:
        directory: a checkpoint directory (its base, if any, is read too).
        threads: restore tensors on this many threads (default: the usable cores, at most 8).
        allow_pickle: without it a pickled entry raises :class:`CheckpointError`
            (unpickling runs code from the file).

    Returns:
        The nest that :func:`save` was given.

    Raises:
        CheckpointError: a file or tensor is damaged or missing; the message names both.

    Example::

        state = checkpoint.load("ckpt-110")
    """
    manifest, tensors, objects = _load_tensors(Path(directory), threads=threads)
    return _unflatten(manifest["tree"], tensors, objects, Path(directory) / MANIFEST, allow_pickle)


def verify(directory: str | os.PathLike) -> dict:
    """Restore every tensor (and the base chain) and check every checksum.

    Args:
        directory: a checkpoint directory.

    Returns:
        ``{"tensors": n, "objects": n, "base": path or None}``.

    Raises:
        CheckpointError: naming the file and the tensor that failed.
    """
    manifest, tensors, objects = _load_tensors(Path(directory))
    return {"tensors": len(tensors), "objects": len(objects), "base": (manifest.get("base") or {}).get("path")}


def inspect(directory: str | os.PathLike) -> dict:
    """Per-tensor sizes and codecs, without decompressing."""
    manifest = read_manifest(Path(directory))
    packs = manifest.get("packs") or []
    rows = []
    for name, entry in manifest["tensors"].items():
        raw = (sum(s["nbytes"] for s in entry["streams"]) if entry.get("pickle")
               else int(np.prod(entry["shape"], dtype=np.int64)) * _itemsize(entry["dtype"]))
        stored, codec, params = sum(s["stored"] for s in entry["streams"]), entry.get("codec", "pickle"), entry.get("params", {})
        if "pack" in entry:  # its share of the pack's stored bytes, by raw size
            pack = packs[entry["pack"][0]]
            stored = round(sum(s["stored"] for s in pack["streams"]) * raw / (int(pack["count"]) * _itemsize(pack["dtype"])))
            codec, params = f"{pack['codec']} (packed)", pack["params"]
        rows.append({"name": name, "dtype": entry.get("dtype", "pickle"), "shape": entry.get("shape"),
                     "codec": codec, "params": {k: v for k, v in params.items() if k != "table"},
                     "delta": entry.get("delta", False), "raw_bytes": raw, "stored_bytes": stored})
    raw = sum(r["raw_bytes"] for r in rows)
    return {"base": manifest.get("base"), "checksum": manifest["checksum"], "tensors": rows,
            "raw_bytes": raw, "stored_bytes": manifest["data_bytes"],
            "ratio": raw / manifest["data_bytes"] if manifest["data_bytes"] else None}
