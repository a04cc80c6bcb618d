"""The Compressor and Memory roles of one rank (:class:`SegmentEncoder`): the codec, the
lossless codec for dense steps, and the error-feedback memory, which together turn a segment
of gradient into the payload to send.

Every way of exchanging a gradient goes through it: the collectives of
:class:`~rayzip.engine.GradientExchange` and the pushes of the parameter-server client
(:mod:`rayzip.ps.client`), so that a segment is compensated, checked for NaN and Inf, and
encoded the same way whatever carries it.

Example::

    encoder = SegmentEncoder(CompressionConfig(codec="group_topk", density=0.01))
    payload = encoder.encode("seg0", grad)           # raises NonFiniteError on a NaN
    encoder.set_density(0.05)
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import get_codec
from ..codecs.memory import relayout_state
from .config import CompressionConfig

__all__ = ["SegmentEncoder"]


class SegmentEncoder:
    """One rank's codec and error-feedback memory.

    Args:
        config: the :class:`CompressionConfig` whose codec and memory to build.
        rank: this rank, for codecs whose randomness is seeded per rank.
        momentum: SGD's momentum, for ``config.momentum_correction``.
        adam_betas: Adam's betas, for ``config.adam_correction``.
        grad_scaler: AMP's ``GradScaler``, whose loss scale the residuals then follow.
    """

    def __init__(self, config: CompressionConfig, rank: int = 0, momentum: float | None = None,
                 adam_betas: tuple[float, float] | None = None, grad_scaler: torch.amp.GradScaler | None = None):
        self.codec = config.build_codec(rank=rank)
        self.dense_codec = get_codec("none")  # warm-up and compression-off steps
        self.memory = config.build_memory(momentum, adam_betas)
        self.grad_scaler = grad_scaler
        self.loss_scale: float | None = None  # the scale the residuals are in (AMP)

    @property
    def density(self) -> float | None:
        return self.codec.density

    def codec_for(self, compressed: bool):
        """The codec of a compressed step, or the lossless one of a dense step."""
        return self.codec if compressed else self.dense_codec

    def encode(self, name: str, grad, compressed: bool = True, scale: float = 1.0):
        """The payload for segment ``name``: ``scale * (grad + residual)`` encoded, and the
        residual updated. Dense steps go through the memory too, so that they send what error
        feedback held back. Raises :class:`~rayzip.codecs.NonFiniteError` where ``grad`` is
        not finite (or overflows the wire type), with the memory untouched."""
        return self.memory.encode(self.codec_for(compressed), name, grad, scale)

    def follow_loss_scale(self) -> None:
        """Keep residuals in the units of the gradient: AMP scales it by the loss scale."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())
        if self.loss_scale is not None and scale != self.loss_scale:
            self.memory.rescale(scale / self.loss_scale)
        self.loss_scale = scale

    def set_density(self, density: float) -> None:
        """Swap in the codec at ``density``, keeping its state (a seeded codec's call count)."""
        self.codec = self.codec.with_density(density)

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict(), "codec": self.codec.state_dict(), "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict[str, Any], segments: list[tuple[int, int]] | None = None,
                        numel: int | None = None, like=None) -> None:
        """Restore :meth:`state_dict`. With ``segments`` (and the flat ``numel``), residuals
        saved under other segments are cut into these; ``like`` is an array on the device
        they should land on."""
        memory = state["memory"] if segments is None else relayout_state(state["memory"], segments, numel)
        self.memory.load_state_dict(memory, like=like)
        self.codec.load_state_dict(state["codec"])
        self.loss_scale = state.get("loss_scale")
