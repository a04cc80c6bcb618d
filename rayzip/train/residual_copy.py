"""A partial copy of a rank's error feedback, kept on another node so that a lost node's ranks
resume with most of what they had not sent yet.

Under local steps with ``combine: senders`` (SparseLoCo's outer updates) a rank's residual is
the part of its pseudo-gradients that top-k has not sent yet. A node's keeper goes with its
node, and with it its ranks' residuals (ADR 0009). After each synchronization each rank
therefore sends the largest entries of each group of its residual to a keeper on another
node: :func:`pack_residuals` here, :meth:`rayzip.keeper.Keeper.hold_copy` there. The restore
of a lost rank takes that copy in place of nothing, where it is of the round being restored
(:func:`unpack_residuals`).

The format: a zstd frame (with its checksum) holding a JSON list of the entries' names and
sizes, then for each entry a bit mask of the entries kept (one bit per element, which zstd
codes near the entropy of the kept positions; left out where every entry is kept), a
float32 scale per group, and the kept values in 4 bits each, in order.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

from ..codecs.kernels import fused
from ..codecs.memory import pending_parts

__all__ = ["COPY_GROUP", "LEVELS", "pack_residuals", "unpack_residuals"]

COPY_GROUP = 1024  # a residual's largest entries are taken in groups of this many, as group top-k sends them
LEVELS = 7  # 4-bit values: -7..7 times the group's scale (15 levels, one code left unused)
_LENGTH = struct.Struct("<I")


def pack_residuals(memory: dict, density: float, group: int = COPY_GROUP) -> bytes:
    """The largest ``density`` of each ``group`` entries of each pending part of a Memory
    state (:meth:`rayzip.codecs.memory.ErrorFeedback.state_dict`: residuals and velocities;
    Adam moments are left out), each kept value in 4 bits (a sign and a level up to 7, of a
    scale per group: the group's largest kept magnitude over 7), zstd-compressed.

    Args:
        memory: {name: flat array} of one rank's error feedback.
        density: the share of each group kept, in (0, 1] (1: every entry, no top-k).
        group: entries per group (the last group of an entry may be shorter).

    Example::

        blob = pack_residuals({"model": residual}, density=1.0)
        copy = unpack_residuals(blob)["model"]   # residual, each entry within half a level
    """
    import zstandard

    if not 0 < density <= 1:
        raise ValueError(f"density is a share of the entries in (0, 1], not {density}")
    keep = max(1, math.ceil(density * group))
    entries, parts = [], []
    for name, held in pending_parts(memory).items():
        host = np.ascontiguousarray(held, dtype=np.float32).reshape(-1)
        n = host.size
        if n == 0:
            continue
        entry = {"name": name, "numel": n, "kept": n, "group": group}
        entries.append(entry)
        if keep == group and fused is not None and group % 2 == 0:  # one pass in C, the same bytes
            scale, packed = np.empty(-(-n // group), dtype="<f4"), np.empty(-(-n // 2), dtype=np.uint8)
            fused.nibbles(host, group, float(LEVELS), scale, packed)
            parts += [scale.data, packed.data]
            continue
        flat = torch.from_numpy(host)
        padded = torch.nn.functional.pad(flat, (0, -n % group)).view(-1, group)
        magnitude = padded.abs()
        if keep < group:
            chosen = magnitude.topk(keep, dim=1, sorted=False).indices
            kept = torch.zeros(padded.shape, dtype=torch.bool).scatter_(1, chosen, True)
            scale = magnitude.mul_(kept).amax(dim=1) / LEVELS
        else:
            kept, scale = None, magnitude.amax(dim=1) / LEVELS
        levels = padded / torch.where(scale > 0, scale, 1.0)[:, None]  # an all-zero group stays zero
        levels = levels.round_().clamp_(-LEVELS, LEVELS).add_(LEVELS + 1).to(torch.uint8).view(-1)[:n]
        mask = kept.view(-1)[:n] if kept is not None else None
        nibbles = (levels[mask] if mask is not None else levels).numpy()
        count = nibbles.size
        if mask is not None and count < n:  # a mask only where some entries are left out
            parts.append(np.packbits(mask.numpy()).tobytes())
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(LEVELS + 1))
        entry["kept"] = count
        parts += [scale.numpy().astype("<f4").tobytes(), (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()]
    head = json.dumps(entries).encode()
    raw = b"".join([_LENGTH.pack(len(head)), head, *parts])
    # One thread: the worker's other cores are training.
    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(raw)


def unpack_residuals(blob: bytes, where: str = "a residual copy") -> dict[str, np.ndarray]:
    """{name: flat float32 array} of :func:`pack_residuals`' copy: the kept entries, zeros
    elsewhere. A copy that does not decode, or fails its checksum, raises ``ValueError``
    naming ``where``."""
    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(blob)
        (length,) = _LENGTH.unpack_from(raw)
        entries = json.loads(raw[_LENGTH.size:_LENGTH.size + length])
    except (zstandard.ZstdError, struct.error, ValueError) as exc:
        raise ValueError(f"{where}: not a residual copy ({exc})") from None
    at, out = _LENGTH.size + length, {}
    for entry in entries:
        n, kept, group = int(entry["numel"]), int(entry["kept"]), int(entry["group"])
        mask = None
        if kept < n:
            bits = np.frombuffer(raw, dtype=np.uint8, count=-(-n // 8), offset=at)
            at += bits.size
            mask = np.unpackbits(bits, count=n).astype(bool)
            if int(mask.sum()) != kept:
                raise ValueError(f"{where}: entry {entry['name']!r} keeps {int(mask.sum())} entries, "
                                 f"its header says {kept}")
        scale = np.frombuffer(raw, dtype="<f4", count=-(-n // group), offset=at)
        at += scale.nbytes
        packed = np.frombuffer(raw, dtype=np.uint8, count=-(-kept // 2), offset=at)
        at += packed.size
        nibbles = np.empty(2 * packed.size, dtype=np.int8)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        values = (nibbles[:kept] - (LEVELS + 1)).astype(np.float32)
        if mask is None:  # every entry kept, in order
            out[entry["name"]] = values * np.repeat(scale, group)[:n]
            continue
        positions = np.flatnonzero(mask)
        dense = np.zeros(n, dtype=np.float32)
        dense[positions] = values * scale[positions // group]
        out[entry["name"]] = dense
    if at != len(raw):
        raise ValueError(f"{where}: {len(raw) - at} bytes left after its entries")
    return out
