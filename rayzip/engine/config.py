"""The library's own compression config: what the engine, and so the hook and local steps, are told.

A frozen dataclass, checked when built, with no pydantic and no Ray behind it: the job spec
(:class:`rayzip.spec.CompressionSpec`) validates YAML and builds one of these
(:meth:`~rayzip.spec.CompressionSpec.to_config`).

Usage::

    config = CompressionConfig(codec="group_topk", density=0.01, momentum_correction=True)
    exchange = rayzip.torch.compress(ddp, config, momentum=0.9)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ..codecs import (CODECS, AdamCorrection, CodecError, ErrorFeedback, MomentumCorrection, NoMemory,
                      codec_parameters, get_codec)
from ..codecs.memory import check_error_feedback
from ..comm.collectives import choose_collective
from ..comm.cost import Link

__all__ = ["CODEC_FIELDS", "COLLECTIVES", "HIERARCHIES", "CompressionConfig"]

# The codecs' parameters.
CODEC_FIELDS = ("density", "group_size", "value_dtype", "packed_indices", "coded_indices", "block", "bits", "keep",
                "levels", "bucket_size", "seed")
COLLECTIVES = ("auto", "ring", "balanced", "allreduce", "allgather", "dense")
HIERARCHIES = ("auto", "node", "none")


@dataclass(frozen=True)
class CompressionConfig:
    """How the hook (or local steps) compresses gradients between workers.

    Args:
        codec: one of :data:`rayzip.codecs.CODECS` but ``coo``.
        density: the kept fraction of a sparsifier (topk, randomk, group_topk).
        group_size: group top-k's group (see :mod:`rayzip.codecs.group_topk`).
        value_dtype: the sparsifiers' value type on the wire (fp32, fp16; group top-k also int8
            2bit and 4bit, multiples of a scale per group).
        packed_indices: group top-k's offsets bit-packed.
        coded_indices: group top-k's offsets Elias-Fano coded (fewer bits than packed).
        block: the DCT's block side.
        bits: the DCT's code width.
        keep: the DCT's kept fraction of frequencies.
        levels: QSGD's levels.
        bucket_size: QSGD's bucket.
        seed: random-k's and QSGD's seed.
        error_feedback: keep what the codec left out and add it to the next step's gradient.
        error_decay: the share of the residual kept from one exchange to the next (1: all of
            it). Below 1, what waits too long fades: SparseLoCo's error feedback, which takes
            the place of the outer momentum under local steps (0.95 there).
        momentum_correction: keep SGD momentum on each worker, before compression (DGC).
        adam_correction: keep Adam's moments on each worker and send its direction.
        collective: how the workers combine payloads; ``auto`` picks the cheapest on ``link``.
        combine: ``mean`` averages each entry over every worker; ``senders`` (sparse codecs, on
            the allgather or balanced) over the workers that sent it, as SparseLoCo does.
        link: the link ``collective="auto"`` weighs bytes against messages on.
        hierarchy: ``node``: one compressed exchange per node; ``auto`` when it helps.
        overlap: exchange each segment on a worker thread as soon as backward produced it.
        segment_mb: the segments' size (MiB of fp32, whole parameters).
        warmup_steps: the first steps go uncompressed.
        verify: self-check every step against the mean of every worker's decoded payload.

    Unset codec parameters take the codec's defaults; one the codec does not take is refused.

    Example::

        CompressionConfig(codec="dct_quant", bits=4)
        CompressionConfig(codec="group_topk", density=0.02, value_dtype="int8", packed_indices=True)
        # SparseLoCo's outer updates (local steps): 1%, 2-bit values, fading residuals
        CompressionConfig(codec="group_topk", density=0.01, value_dtype="2bit", coded_indices=True,
                          error_decay=0.95, combine="senders")
    """

    codec: str = "none"
    density: Optional[float] = None
    group_size: Optional[int] = None
    value_dtype: Optional[str] = None
    packed_indices: Optional[bool] = None
    coded_indices: Optional[bool] = None
    block: Optional[int] = None
    bits: Optional[int] = None
    keep: Optional[float] = None
    levels: Optional[int] = None
    bucket_size: Optional[int] = None
    seed: Optional[int] = None
    error_feedback: bool = True
    error_decay: float = 1.0
    momentum_correction: bool = False
    adam_correction: bool = False
    collective: str = "auto"
    combine: str = "mean"
    link: Link = field(default_factory=Link)
    hierarchy: str = "auto"
    overlap: bool = True
    segment_mb: float = 4.0
    warmup_steps: int = 0
    verify: bool = False

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(problem)

    def _problem(self) -> str | None:
        if self.codec not in CODECS or self.codec == "coo":
            return f"unknown codec {self.codec!r}; choose from {', '.join(n for n in CODECS if n != 'coo')}"
        if self.collective not in COLLECTIVES:
            return f"collective must be one of {', '.join(COLLECTIVES)}, got {self.collective!r}"
        if self.hierarchy not in HIERARCHIES:
            return f"hierarchy must be one of {', '.join(HIERARCHIES)}, got {self.hierarchy!r}"
        if self.segment_mb <= 0 or self.warmup_steps < 0:
            return f"segment_mb must be > 0 and warmup_steps >= 0, got {self.segment_mb} and {self.warmup_steps}"
        for name in ("momentum_correction", "adam_correction"):
            if getattr(self, name) and not self.error_feedback:
                return f"{name} works on rayzip's error feedback: set error_feedback true"
        if self.momentum_correction and self.adam_correction:
            return "choose momentum_correction (sgd) or adam_correction (adamw), not both"
        if not 0.0 < self.error_decay <= 1.0:
            return f"error_decay must be in (0, 1], got {self.error_decay}"
        if self.error_decay < 1.0 and (not self.error_feedback or self.momentum_correction or self.adam_correction):
            return "error_decay fades plain error feedback's residuals: set error_feedback true, without " \
                   "momentum_correction or adam_correction"
        if self.combine == "senders" and self.verify:
            return "verify compares with the mean over every worker: it does not check combine senders"
        takes = codec_parameters(self.codec)
        for name in CODEC_FIELDS:
            if getattr(self, name) is not None and name not in takes:
                return (f"{name} does not apply to codec {self.codec} "
                        f"(it takes {', '.join(takes) or 'no parameters'})")
        try:
            codec = self.build_codec()
            if self.error_feedback:
                check_error_feedback(codec)
            choose_collective(self.collective, codec, combine=self.combine)
        except (CodecError, ValueError) as exc:
            return str(exc)
        return None

    def codec_params(self, rank: int = 0) -> dict[str, Any]:
        """The codec's keyword arguments, as :func:`rayzip.codecs.get_codec` takes them; QSGD's
        seed differs by ``rank`` (independent rounding noise averages out)."""
        params = {k: getattr(self, k) for k in CODEC_FIELDS if getattr(self, k) is not None}
        if self.codec == "qsgd":
            params["seed"] = params.get("seed", 0) + rank
        return params

    def build_codec(self, rank: int = 0):
        return get_codec(self.codec, **self.codec_params(rank))

    def build_memory(self, momentum: float | None = None, adam_betas: tuple[float, float] | None = None):
        """The Memory role this config asks for: momentum correction (give the SGD
        ``momentum``), Adam correction (give Adam's ``adam_betas``), error feedback, or none."""
        if self.adam_correction:
            if adam_betas is None:
                raise ValueError("adam_correction needs Adam's betas, with the optimizer built as SGD "
                                 "without momentum (rayzip.torch.optim.build_optimizer does it)")
            return AdamCorrection(tuple(adam_betas))
        if self.momentum_correction:
            if not momentum:
                raise ValueError("momentum_correction needs the SGD momentum factor, "
                                 "with the optimizer built with momentum=0")
            return MomentumCorrection(momentum)
        return ErrorFeedback(self.error_decay) if self.error_feedback else NoMemory()

    def replace(self, **changes) -> "CompressionConfig":
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

