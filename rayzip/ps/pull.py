"""What a pull sends: dense parameters, a lossless XOR delta, or the codec's compressed change.

A shard remembers the copy each worker holds (its *replica*), so a pull can send only the
change. ``lossless`` sends the XOR of the fp32 words against the replica in byte planes,
each coded like a checkpoint stream (leading zero bytes cost almost nothing). ``codec``
sends ``codec.encode(params - replica)``; the worker's copy becomes ``replica + decoded``,
and what the codec dropped stays in ``params - replica`` for the next pull: error feedback
with no residual to store. Both sides run the same numpy operations on the same inputs, so
the shard's replica equals the worker's copy bit for bit.

Usage::

    message, replica = encode_pull("lossless", params, replica, codec)   # on the shard
    copy = decode_pull(message, copy, numel)                             # on the worker
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checkpoint.codecs import Planes, pack_stream, unpack_stream
from ..codecs import get_codec

__all__ = ["PULL_MODES", "decode_pull", "encode_pull", "message_nbytes"]

PULL_MODES = ("dense", "lossless", "codec")
_PLANES = Planes(rotate=1)


def encode_pull(mode: str, params: np.ndarray, replica: np.ndarray | None, codec) -> tuple[dict, np.ndarray]:
    """``(message, the worker's copy once it applies the message)``. A worker with no copy
    yet (``replica`` None) gets the parameters dense, whatever the mode."""
    if mode not in PULL_MODES:
        raise ValueError(f"unknown pull mode {mode!r}; choose from {', '.join(PULL_MODES)}")
    if replica is None or mode == "dense":
        data = np.array(params, dtype=np.float32, copy=True)
        return {"kind": "dense", "data": data}, data
    if mode == "lossless":
        streams, planes_params = _PLANES.encode(params.view(np.uint32), replica.view(np.uint32), np)
        packed = []
        for stream in streams:
            blob, coding = pack_stream(stream)
            packed.append((bytes(blob), coding, int(stream.size)))
        return {"kind": "lossless", "params": planes_params, "streams": packed}, params.copy()
    payload = codec.encode(params - replica)
    copy = replica + codec.decode_flat(payload)
    return {"kind": "codec", "codec": codec.name, "codec_params": codec.params(), "wire": payload.to_bytes()}, copy


def decode_pull(message: dict, held: np.ndarray | None, numel: int) -> np.ndarray:
    """The worker's new copy of the shard (float32, ``numel`` long) from a pull message."""
    kind = message["kind"]
    if kind == "dense":
        data = message["data"]
        if data.size != numel:
            raise ValueError(f"a dense pull holds {data.size} values, the shard has {numel}")
        return data
    if held is None:
        raise ValueError(f"a {kind} pull needs the copy it is a delta against, and this worker holds none")
    if kind == "lossless":
        streams = [unpack_stream(blob, coding, nbytes) for blob, coding, nbytes in message["streams"]]
        return _PLANES.decode(streams, message["params"], numel, np.uint32, held.view(np.uint32), np).view(np.float32)
    if kind == "codec":
        codec = get_codec(message["codec"], **message["codec_params"])
        return held + codec.decode_flat(codec.from_bytes(message["wire"], numel=numel))
    raise ValueError(f"unknown pull message kind {kind!r}")


def message_nbytes(message: dict[str, Any]) -> int:
    """Payload bytes of a pull message (what its kind needs on the wire, without Ray's framing)."""
    kind = message["kind"]
    if kind == "dense":
        return int(message["data"].nbytes)
    if kind == "lossless":
        return sum(len(blob) for blob, _, _ in message["streams"])
    return len(message["wire"])
