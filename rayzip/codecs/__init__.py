"""Gradient codecs (the Compressor role) and error feedback (the Memory role).

Usage::

    from rayzip.codecs import get_codec, ErrorFeedback

    codec = get_codec("group_topk", density=0.01)
    memory = ErrorFeedback()
    payload = memory.encode(codec, "bucket0", grad)   # payload.to_bytes() is the wire
    grad_hat = codec.decode(payload)
"""

from __future__ import annotations

import inspect
from typing import Any

from .base import Codec, CodecError, Field, NonFiniteError, Payload, WireOverflowError
from .cast import BFloat16, Float16, NoCompression
from .coo import Coo
from .dct_quant import DCTQuant
from .group_topk import GroupTopK
from .memory import AdamCorrection, ErrorFeedback, MomentumCorrection, NoMemory
from .qsgd import QSGD
from .randomk import RandomK
from .topk import TopK

__all__ = [
    "AdamCorrection",
    "CODECS",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Field",
    "MomentumCorrection",
    "NoMemory",
    "NonFiniteError",
    "WireOverflowError",
    "Payload",
    "codec_parameters",
    "get_codec",
]

CODECS: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (NoCompression, Float16, BFloat16, TopK, RandomK, GroupTopK, QSGD, DCTQuant, Coo)
}


def codec_parameters(name: str) -> dict[str, object]:
    """The parameters ``name`` accepts, with their defaults."""
    cls = _lookup(name)
    return {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self"}


def get_codec(name: str, **params: Any) -> Codec:
    """A codec by name.

    Args:
        name: one of :data:`CODECS` (``none``, ``fp16``, ``bf16``, ``topk``, ``randomk``,
            ``group_topk``, ``qsgd``, ``dct_quant``).
        **params: the codec's parameters (``density``, ``group_size``, ``bits``...).

    Returns:
        The codec.

    Raises:
        CodecError: an unknown name or parameter, naming it.

    Example::

        codec = get_codec("group_topk", density=0.01)
    """
    cls = _lookup(name)
    allowed = codec_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise CodecError(f"codec {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                         f"it takes {sorted(allowed) or 'none'}")
    return cls(**params)


def _lookup(name: str) -> type[Codec]:
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; choose from {sorted(CODECS)}") from None
