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
codes near the entropy of the kept positions) and the kept values in bf16, in order.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

from ..codecs.memory import pending_parts

__all__ = ["COPY_GROUP", "pack_residuals", "unpack_residuals"]

COPY_GROUP = 1024  # a residual's largest entries are taken in groups of this many, as group top-k sends them
_LENGTH = struct.Struct("<I")


def pack_residuals(memory: dict, density: float, group: int = COPY_GROUP) -> bytes:
    """The largest ``density`` of each ``group`` entries of each pending part of a Memory
    state (:meth:`rayzip.codecs.memory.ErrorFeedback.state_dict`: residuals and velocities;
    Adam moments are left out), values in bf16, zstd-compressed.

    Args:
        memory: {name: flat array} of one rank's error feedback.
        density: the share of each group kept, in (0, 1].
        group: entries per group (the last group of an entry may be shorter).

    Example::

        blob = pack_residuals({"model": residual}, density=0.1)
        copy = unpack_residuals(blob)["model"]   # residual's largest 10% of each 1024, else 0
    """
    import zstandard

    if not 0 < density <= 1:
        raise ValueError(f"density is a share of the entries in (0, 1], not {density}")
    keep = max(1, math.ceil(density * group))
    entries, parts = [], []
    for name, held in pending_parts(memory).items():
        flat = torch.from_numpy(np.ascontiguousarray(held, dtype=np.float32).reshape(-1))
        n = flat.numel()
        if n == 0:
            continue
        padded = torch.nn.functional.pad(flat, (0, -n % group)).view(-1, group)
        chosen = padded.abs().topk(min(keep, group), dim=1, sorted=False).indices
        mask = torch.zeros(padded.shape, dtype=torch.bool).scatter_(1, chosen, True).view(-1)[:n]
        values = flat[mask].to(torch.bfloat16).view(torch.int16).numpy()
        entries.append({"name": name, "numel": n, "kept": int(values.size)})
        parts += [np.packbits(mask.numpy()).tobytes(), values.tobytes()]
    head = json.dumps(entries).encode()
    raw = b"".join([_LENGTH.pack(len(head)), head, *parts])
    return zstandard.ZstdCompressor(level=3, write_checksum=True, threads=-1).compress(raw)


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
        n, kept = int(entry["numel"]), int(entry["kept"])
        bits = np.frombuffer(raw, dtype=np.uint8, count=-(-n // 8), offset=at)
        at += bits.size
        values = np.frombuffer(raw, dtype=np.int16, count=kept, offset=at)
        at += values.nbytes
        mask = torch.from_numpy(np.unpackbits(bits, count=n).astype(bool))
        if int(mask.sum()) != kept:
            raise ValueError(f"{where}: entry {entry['name']!r} keeps {int(mask.sum())} entries, its header says {kept}")
        dense = torch.zeros(n, dtype=torch.float32)
        dense[mask] = torch.from_numpy(values.copy()).view(torch.bfloat16).float()
        out[entry["name"]] = dense.numpy()
    if at != len(raw):
        raise ValueError(f"{where}: {len(raw) - at} bytes left after its entries")
    return out
