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

__all__ = ["ErrorFeedback", "MomentumCorrection", "NoMemory", "check_error_feedback"]


def check_error_feedback(codec) -> None:
    """Raise :class:`CodecError` when error feedback with ``codec`` would diverge."""
    issue = codec.error_feedback_issue()
    if issue:
        raise CodecError(issue)


def _check_layout(what: str, name: str, held, flat) -> None:
    if held.shape != flat.shape:
        raise ValueError(f"{what} for {name!r} holds {held.size} elements, "
                         f"the input has {flat.size}: the bucket layout changed")


class ErrorFeedback:
    """Residuals by name. They live on the tensors' device, in float32."""

    enabled = True

    def __init__(self) -> None:
        self.residuals: dict[str, Any] = {}

    def compensate(self, name: str, x):
        """``x`` plus the residual kept under ``name`` (a new float32 array, or torch tensor)."""
        arr, xp = as_array(x)
        flat = arr.reshape(-1)
        residual = self.residuals.get(name)
        if residual is None:
            out = flat.astype(xp.float32)  # always a new array: x is never modified
        else:
            _check_layout("error feedback", name, residual, flat)
            out = xp.add(flat, residual, dtype=xp.float32)
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
        # compensated is this call's own array, so the codec may turn it into the residual.
        self.residuals[name] = codec.residual(compensated, payload)
        return payload

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Residuals as host numpy arrays (for checkpoints)."""
        return {name: asnumpy(r).copy() for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any], xp=np) -> None:
        self.residuals = {name: xp.asarray(np.asarray(r, dtype=np.float32).reshape(-1))
                          for name, r in state.items()}


class MomentumCorrection(ErrorFeedback):
    """Error feedback on a local momentum: momentum correction with factor masking (DGC).

    Plain error feedback under SGD momentum lets a coordinate's gradient wait in the
    residual, then arrive all at once into a momentum buffer that has moved on, which
    destabilises sparse training. Here each worker keeps its own velocity
    ``u = momentum * u + grad`` and compresses ``u`` plus the residual; the optimizer must
    then run *without* momentum. For a sparse codec the velocity of the entries just sent is
    cleared (momentum factor masking), so stale momentum does not push them again (Lin et
    al., "Deep Gradient Compression", ICLR 2018). Through a lossless codec nothing waits,
    nothing is masked, and the update equals SGD momentum on the averaged gradient.

    Usage::

        memory = MomentumCorrection(0.9)
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.0)   # momentum lives here now
        payload = memory.encode(codec, "bucket0", grad)
    """

    def __init__(self, momentum: float) -> None:
        if not (isinstance(momentum, (int, float)) and 0.0 < momentum < 1.0):
            raise CodecError(f"momentum correction needs a momentum in (0, 1), got {momentum!r}")
        super().__init__()
        self.momentum = float(momentum)
        self.velocities: dict[str, Any] = {}

    def encode(self, codec, name: str, x):
        check_error_feedback(codec)
        arr, xp = as_array(x)
        flat = arr.reshape(-1)
        velocity = self.velocities.get(name)
        if velocity is None:
            velocity = flat.astype(xp.float32)
        else:
            _check_layout("momentum", name, velocity, flat)
            velocity *= self.momentum
            velocity += flat
        self.velocities[name] = velocity
        compensated = self.compensate(name, velocity)
        payload = codec.encode(compensated)
        self.residuals[name] = codec.residual(compensated, payload)
        if codec.sparse:
            velocity[codec.to_coo(payload)[0]] = 0.0
        return payload

    def reset(self) -> None:
        super().reset()
        self.velocities.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**super().state_dict(),
                **{_VELOCITY + name: asnumpy(v).copy() for name, v in self.velocities.items()}}

    def load_state_dict(self, state: dict[str, Any], xp=np) -> None:
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith(_VELOCITY)}, xp)
        self.velocities = {k[len(_VELOCITY):]: xp.asarray(np.asarray(v, dtype=np.float32).reshape(-1))
                           for k, v in state.items() if k.startswith(_VELOCITY)}


_VELOCITY = "velocity:"


class NoMemory(ErrorFeedback):
    """Error feedback switched off: what the codec drops is lost."""

    enabled = False

    def compensate(self, name: str, x):
        return x

    def update(self, name: str, compensated, decoded) -> None:
        pass

    def encode(self, codec, name: str, x):
        return codec.encode(x)
