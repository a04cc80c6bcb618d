"""The Memory role: error feedback.

What a lossy codec drops this step is added back to the next step's input, so nothing is
lost for good: ``residual = compensated - decode(encode(compensated))``, kept per bucket
or tensor name. Over T steps the decoded outputs then sum to T * input minus the last
residual, which stays bounded.

Usage::

    memory = ErrorFeedback()
    compensated = memory.compensate("bucket0", grad)
    payload = codec.encode(compensated)
    memory.update("bucket0", compensated, codec.decode(payload))

or, in one call, ``payload = memory.encode(codec, "bucket0", grad)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import CodecError
from ..xp import as_array, asnumpy, is_torch

__all__ = ["ErrorFeedback", "NoMemory", "check_error_feedback"]


def check_error_feedback(codec) -> None:
    """Raise :class:`CodecError` when error feedback with ``codec`` would diverge."""
    issue = codec.error_feedback_issue()
    if issue:
        raise CodecError(issue)


class ErrorFeedback:
    """Residuals by name. They live on the tensors' device, in float32."""

    enabled = True

    def __init__(self) -> None:
        self.residuals: dict[str, Any] = {}

    def compensate(self, name: str, x):
        """``x`` plus the residual kept under ``name`` (a new float32 array, or torch tensor)."""
        arr, xp = as_array(x)
        out = arr.astype(xp.float32).reshape(-1)  # always a copy: x is never modified
        residual = self.residuals.get(name)
        if residual is not None:
            if residual.shape != out.shape:
                raise ValueError(f"error feedback for {name!r} holds {residual.size} elements, "
                                 f"the input has {out.size}: the bucket layout changed")
            out += residual
        out = out.reshape(arr.shape)
        if is_torch(x):
            from ..xp import to_torch

            return to_torch(out)
        return out

    def update(self, name: str, compensated, decoded) -> None:
        comp, xp = as_array(compensated)
        dec, _ = as_array(decoded)
        self.residuals[name] = (comp.reshape(-1) - dec.reshape(-1).astype(xp.float32)).astype(xp.float32)

    def encode(self, codec, name: str, x):
        """compensate, encode, update: the payload to send for ``x``."""
        check_error_feedback(codec)
        compensated = self.compensate(name, x)
        payload = codec.encode(compensated)
        self.update(name, compensated, codec.decode_flat(payload))
        return payload

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Residuals as host numpy arrays (for checkpoints)."""
        return {name: asnumpy(r).copy() for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any], xp=np) -> None:
        self.residuals = {name: xp.asarray(np.asarray(r, dtype=np.float32).reshape(-1))
                          for name, r in state.items()}


class NoMemory(ErrorFeedback):
    """Error feedback switched off: what the codec drops is lost."""

    enabled = False

    def compensate(self, name: str, x):
        return x

    def update(self, name: str, compensated, decoded) -> None:
        pass

    def encode(self, codec, name: str, x):
        return codec.encode(x)
