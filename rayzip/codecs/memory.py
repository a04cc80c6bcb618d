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

import re
from typing import Any

import numpy as np

from .base import CodecError
from ..xp import array_module, as_array, asnumpy, is_torch

__all__ = ["AdamCorrection", "ErrorFeedback", "MomentumCorrection", "NoMemory", "check_error_feedback",
           "pending_parts", "relayout_state", "reshard_state", "segment_name"]


def check_error_feedback(codec) -> None:
    """Raise :class:`CodecError` when error feedback with ``codec`` would diverge."""
    issue = codec.error_feedback_issue()
    if issue:
        raise CodecError(issue)


def _on(held, xp):
    """``held`` on ``xp``'s device: restored state is host numpy until the first gradient
    shows where it lives (or ``load_state_dict(..., like=)`` says so up front)."""
    if array_module(held) is xp:
        return held
    return asnumpy(held) if xp is np else xp.asarray(held)


def _check_layout(what: str, name: str, held, flat) -> None:
    if held.shape != flat.shape:
        raise ValueError(f"{what} for {name!r} holds {held.size} elements, "
                         f"the input has {flat.size}: the bucket layout changed")


class ErrorFeedback:
    """Residuals by name. They live on the tensors' device, in float32. ``decay``: the share
    of a residual carried into the next input (1: all of it, so nothing is lost; below 1 a
    value that waits long fades, as in SparseLoCo's ``e = decay * e + delta``)."""

    enabled = True
    # The residual is in the input's own units (what was handed to encode and not yet sent),
    # so a caller may hold it elsewhere: local steps keep it in a worker's weights. The
    # corrections below hold it in units of a velocity or an Adam direction instead.
    residual_in_input_units = True

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = float(decay)
        self.residuals: dict[str, Any] = {}

    def compensate(self, name: str, x):
        """``x`` plus the residual kept under ``name`` (a new float32 array, or torch tensor)."""
        arr, xp = as_array(x)
        flat = arr.reshape(-1)
        residual = self.residuals.get(name)
        if residual is None:
            out = flat.astype(xp.float32)  # always a new array: x is never modified
        else:
            residual = self.residuals[name] = _on(residual, xp)
            _check_layout("error feedback", name, residual, flat)
            if self.decay == 1.0:
                out = xp.add(flat, residual, dtype=xp.float32)
            else:  # decay * residual + x
                out = residual * xp.float32(self.decay)
                out += flat
        out = out.reshape(arr.shape)
        if is_torch(x):
            from ..xp import to_torch

            return to_torch(out)
        return out

    def update(self, name: str, compensated, decoded) -> None:
        comp, xp = as_array(compensated)
        dec, _ = as_array(decoded)
        self.residuals[name] = (comp.reshape(-1) - dec.reshape(-1).astype(xp.float32)).astype(xp.float32)

    def encode(self, codec, name: str, x, scale: float = 1.0):
        """compensate, encode, update: the payload to send for ``x``. With ``scale`` the
        payload carries ``scale * (x + residual)`` (an allreduce sends grad / n); the residual
        stays in the units of ``x``."""
        check_error_feedback(codec)
        return self._encode_compensated(codec, name, self.compensate(name, x), scale)

    def _encode_compensated(self, codec, name: str, compensated, scale: float):
        # compensated is this call's own array, so it may be scaled in place and the codec
        # may turn it into the residual. The residual held before is never written to, so
        # snapshot() stays valid.
        if scale != 1.0:
            compensated *= scale
        payload = codec.encode(compensated)
        residual = codec.residual(compensated, payload)
        if scale != 1.0:
            residual /= scale
        self.residuals[name] = residual
        return payload

    def add_back(self, name: str, indices, values, scale: float = 1.0) -> None:
        """Return to the residual of ``name`` entries of its last payload (global ``indices``,
        ``values`` as sent, at ``scale``) that the collective left out of the sum
        (:class:`rayzip.comm.BalancedAllReduce`): they are sent later, as if the codec had
        not picked them."""
        if not len(indices):
            return
        residual = self.residuals[name]
        xp = array_module(residual)
        # The residual is this step's own array (encode replaced it), so snapshot() holds.
        residual[_on(indices, xp)] += _on(values, xp) / scale if scale != 1.0 else _on(values, xp)

    def snapshot(self) -> dict:
        """The state as it is now, to :meth:`restore` if this step is dropped on every rank.
        Costs nothing: encode replaces arrays instead of writing into them."""
        return {"residuals": dict(self.residuals)}

    def restore(self, snapshot: dict) -> None:
        self.residuals = dict(snapshot["residuals"])

    def rescale(self, factor: float) -> None:
        """Multiply what is held by ``factor``: the gradient's units changed (AMP's loss scale)."""
        for held in self.residuals.values():
            held *= factor

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Residuals as host numpy arrays (for checkpoints)."""
        return {name: asnumpy(r).copy() for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any], like=None) -> None:
        """Restore :meth:`state_dict`'s arrays onto the device of ``like`` (a torch tensor or an
        array; default: the host, moved to the gradient's device at its first use)."""
        self.residuals = {name: _restored(r, like) for name, r in state.items()}


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

    residual_in_input_units = False

    def __init__(self, momentum: float) -> None:
        if not (isinstance(momentum, (int, float)) and 0.0 < momentum < 1.0):
            raise CodecError(f"momentum correction needs a momentum in (0, 1), got {momentum!r}")
        super().__init__()
        self.momentum = float(momentum)
        self.velocities: dict[str, Any] = {}

    def encode(self, codec, name: str, x, scale: float = 1.0):
        check_error_feedback(codec)
        arr, xp = as_array(x)
        flat = arr.reshape(-1)
        velocity = self.velocities.get(name)
        if velocity is None:
            velocity = flat.astype(xp.float32)
        else:
            velocity = _on(velocity, xp)
            _check_layout("momentum", name, velocity, flat)
            velocity = xp.multiply(velocity, self.momentum, dtype=xp.float32)  # a new array: see snapshot()
            velocity += flat
        self.velocities[name] = velocity
        payload = self._encode_compensated(codec, name, self.compensate(name, velocity), scale)
        if codec.sparse:
            velocity[codec.to_coo(payload)[0]] = 0.0
        return payload

    def snapshot(self) -> dict:
        return {**super().snapshot(), "velocities": dict(self.velocities)}

    def restore(self, snapshot: dict) -> None:
        super().restore(snapshot)
        self.velocities = dict(snapshot["velocities"])

    def rescale(self, factor: float) -> None:
        super().rescale(factor)
        for held in self.velocities.values():
            held *= factor

    def reset(self) -> None:
        super().reset()
        self.velocities.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**super().state_dict(),
                **{_VELOCITY + name: asnumpy(v).copy() for name, v in self.velocities.items()}}

    def load_state_dict(self, state: dict[str, Any], like=None) -> None:
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith(_VELOCITY)}, like)
        self.velocities = {k[len(_VELOCITY):]: _restored(v, like) for k, v in state.items() if k.startswith(_VELOCITY)}


_VELOCITY = "velocity:"
_ADAM = "adam_"  # adam_m:, adam_v:, adam_t: state keys


class AdamCorrection(ErrorFeedback):
    """Error feedback on each worker's own Adam direction: the moments see the dense local
    gradient, before compression.

    Plain error feedback under Adam sends a coordinate's gradient in rare bursts (a sparse
    codec keeps ~1% a step), and Adam's second moment, fed those bursts, shrinks every
    update that follows: training under top-k then barely moves. Here each worker keeps
    ``m = b1 m + (1 - b1) g`` and ``v = b2 v + (1 - b2) g^2`` of its own gradient and
    compresses the bias-corrected direction ``m^ / (sqrt(v^) + eps)`` plus the residual; the
    optimizer then applies the averaged direction with plain SGD (no momentum) at the same
    learning rate, with ``weight_decay`` as AdamW's decoupled decay
    (``p -= lr * (d + wd * p)``). Every direction is applied once, now or later through the
    residual, so the sum of the updates equals the workers' mean Adam updates. Through a
    lossless codec at one worker it is AdamW exactly.

    Usage::

        memory = AdamCorrection(betas=(0.9, 0.95))
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=wd)
        payload = memory.encode(codec, "model", grad)
    """

    residual_in_input_units = False

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise CodecError(f"Adam correction needs betas in [0, 1), got {betas!r}")
        super().__init__()
        self.betas, self.eps = (float(b1), float(b2)), float(eps)
        self.first: dict[str, Any] = {}
        self.second: dict[str, Any] = {}
        self.steps: dict[str, int] = {}

    def encode(self, codec, name: str, x, scale: float = 1.0):
        check_error_feedback(codec)
        arr, xp = as_array(x)
        flat = arr.reshape(-1)
        (b1, b2), t = self.betas, self.steps.get(name, 0) + 1
        m, v = self.first.get(name), self.second.get(name)
        # New arrays each step (snapshot() keeps the old ones), written in place otherwise:
        # this runs on the whole gradient every step.
        term = xp.multiply(flat, 1 - b1, dtype=xp.float32)
        if m is None:
            m, v = term, xp.multiply(flat, flat, dtype=xp.float32)
            v *= 1 - b2
            term = xp.empty_like(m)
        else:
            m, v = _on(m, xp), _on(v, xp)
            _check_layout("Adam moments", name, m, flat)
            m = xp.multiply(m, b1, dtype=xp.float32)
            m += term
            xp.multiply(flat, flat, out=term)
            term *= 1 - b2
            v = xp.multiply(v, b2, dtype=xp.float32)
            v += term
        self.first[name], self.second[name], self.steps[name] = m, v, t
        denominator = xp.multiply(v, 1 / (1 - b2 ** t), out=term)
        xp.sqrt(denominator, out=denominator)
        denominator += self.eps
        direction = xp.multiply(m, 1 / (1 - b1 ** t), dtype=xp.float32)
        direction /= denominator
        if self.residuals.get(name) is not None:
            residual = _on(self.residuals[name], xp)
            _check_layout("error feedback", name, residual, direction)
            direction += residual  # direction is this call's own array: compensate in place
        return self._encode_compensated(codec, name, direction, scale)

    def snapshot(self) -> dict:
        return {**super().snapshot(), "first": dict(self.first), "second": dict(self.second), "steps": dict(self.steps)}

    def restore(self, snapshot: dict) -> None:
        super().restore(snapshot)
        self.first, self.second, self.steps = dict(snapshot["first"]), dict(snapshot["second"]), dict(snapshot["steps"])

    def rescale(self, factor: float) -> None:
        raise CodecError("Adam correction does not follow a loss scale: the direction it sends is scale-free, "
                         "and GradScaler would unscale it; train in bf16 or without GradScaler")

    def reset(self) -> None:
        super().reset()
        self.first.clear()
        self.second.clear()
        self.steps.clear()

    def state_dict(self) -> dict[str, np.ndarray]:
        out = super().state_dict()
        for name in self.first:
            out[f"{_ADAM}m:{name}"] = asnumpy(self.first[name]).copy()
            out[f"{_ADAM}v:{name}"] = asnumpy(self.second[name]).copy()
            out[f"{_ADAM}t:{name}"] = np.array([self.steps[name]], dtype=np.float32)
        return out

    def load_state_dict(self, state: dict[str, Any], like=None) -> None:
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith(_ADAM)}, like)
        self.first = {k[len(_ADAM) + 2:]: _restored(v, like) for k, v in state.items() if k.startswith(_ADAM + "m:")}
        self.second = {k[len(_ADAM) + 2:]: _restored(v, like) for k, v in state.items() if k.startswith(_ADAM + "v:")}
        self.steps = {k[len(_ADAM) + 2:]: int(_restored(v, None)[0]) for k, v in state.items()
                      if k.startswith(_ADAM + "t:")}


def _restored(saved, like):
    flat = np.asarray(asnumpy(saved.numpy() if is_torch(saved) else saved), dtype=np.float32).reshape(-1)
    return flat if like is None else _on(flat, as_array(like)[1])


def reshard_state(saved: dict[int, dict], old_world: int, new_world: int, rank: int,
                  estimate_lost: bool = True) -> dict[str, np.ndarray]:
    """This rank's Memory state after the world size went from ``old_world`` to ``new_world``.

    Residuals and velocities hold gradient that each worker computed but has not sent yet;
    the step applies their mean over the workers. Rank r takes the states of the old ranks
    j with j mod new_world == r (``saved`` maps old ranks to their :meth:`state_dict`),
    summed and scaled by new_world / old_world, so that the mean over the new workers equals
    the mean over the old ones: nothing pending is lost on a scale-down, nor counted twice
    on a scale-up. Both states are linear in the gradient (a velocity is a sum of past
    gradients), so the rule holds for momentum correction too.

    ``saved`` may hold old ranks that go to other new ranks; pass every state kept when some
    were lost (a node's keeper gone with its node). An old rank missing from ``saved`` is
    taken to have held the mean of the saved ranks' states: the pending mean is then the
    survivors' mean, an estimate of the lost one, rather than shrunk by the lost ranks' share.
    With ``estimate_lost`` False it is taken to have held nothing: under ``combine="senders"``
    an entry that one worker alone sends is applied whole, so nothing pending is shrunk by a
    lost share, and a copy of the survivors' residuals would spend the lost rank's share of
    the entries on the ones they already send.
    """
    pending = {j: state for j, state in saved.items() if j < old_world}
    lost = [j for j in range(old_world) if j not in pending]
    mine = [pending_parts(state) for j, state in sorted(pending.items()) if j % new_world == rank]
    if estimate_lost and pending and any(j % new_world == rank for j in lost):
        survivors = [pending_parts(state) for state in pending.values()]
        mean = {name: np.mean([state[name] for state in survivors if name in state], axis=0)
                for name in {name for state in survivors for name in state}}
        mine += [mean] * sum(1 for j in lost if j % new_world == rank)
    out: dict[str, np.ndarray] = {}
    for state in mine:
        for name, held in state.items():
            out[name] = held.copy() if name not in out else out[name] + held
    factor = np.float32(new_world / old_world)
    out = {name: held * factor for name, held in out.items()}
    # Adam moments are statistics of each worker's gradient, not pending updates: every new
    # rank takes their mean over all the old ranks saved (and the largest step count).
    moments = [state for state in saved.values() if any(k.startswith(_ADAM) for k in state)]
    for name in {k for state in moments for k in state if k.startswith(_ADAM)}:
        held = [_restored(state[name], None) for state in moments if name in state]
        out[name] = np.max(held, axis=0) if name.startswith(_ADAM + "t:") else np.mean(held, axis=0)
    return out


def pending_parts(state: dict) -> dict[str, np.ndarray]:
    """A saved Memory state's pending parts (residuals, velocities) as flat arrays."""
    return {name: _restored(held, None) for name, held in state.items() if not name.startswith(_ADAM)}


def segment_name(lo: int, hi: int, numel: int) -> str:
    """The name a gradient segment's state is kept under: ``model`` when it is the whole
    gradient, else ``model@lo:hi`` (flat element range)."""
    return "model" if (lo, hi) == (0, numel) else f"model@{lo}:{hi}"


_SEGMENT = re.compile(r"^(?P<kind>.*?)model(?:@(?P<lo>\d+):(?P<hi>\d+))?$")


def relayout_state(state: dict[str, Any], segments: list[tuple[int, int]], numel: int) -> dict[str, Any]:
    """A :meth:`ErrorFeedback.state_dict` saved under one cut of the flat gradient into
    segments (:func:`segment_name`), recut to ``segments``: a job restarted with another
    ``segment_mb`` keeps its residuals, velocities and moments, element for element."""
    wanted = {segment_name(lo, hi, numel) for lo, hi in segments}
    kinds: dict[str, list[tuple[int, int, Any]]] = {}
    out: dict[str, Any] = {}
    for key, held in state.items():
        match = _SEGMENT.match(key)
        if match is None:
            out[key] = held
            continue
        lo, hi = (int(match["lo"]), int(match["hi"])) if match["lo"] is not None else (0, numel)
        kinds.setdefault(match["kind"], []).append((lo, hi, held))
    for kind, parts in kinds.items():
        if {segment_name(lo, hi, numel) for lo, hi, _ in parts} == wanted:
            out.update({kind + segment_name(lo, hi, numel): held for lo, hi, held in parts})
            continue
        if kind == _ADAM + "t:":  # a step count, the same for every segment
            count = max(float(_restored(held, None)[0]) for _, _, held in parts)
            out.update({kind + name: np.array([count], dtype=np.float32) for name in wanted})
            continue
        parts.sort(key=lambda part: part[0])
        flat = np.concatenate([_restored(held, None) for _, _, held in parts]) if parts else np.zeros(0, np.float32)
        covered = [(lo, hi) for lo, hi, _ in parts]
        if flat.size != numel or covered[0][0] != 0 or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise ValueError(f"saved {kind or 'error feedback'} state covers elements {covered} of a gradient "
                             f"of {numel}: it was saved for another model")
        out.update({kind + segment_name(lo, hi, numel): flat[lo:hi].copy() for lo, hi in segments})
    return out


class NoMemory(ErrorFeedback):
    """Error feedback switched off: what the codec drops is lost."""

    enabled = False

    def compensate(self, name: str, x):
        return x

    def update(self, name: str, compensated, decoded) -> None:
        pass

    def add_back(self, name: str, indices, values, scale: float = 1.0) -> None:
        pass  # nothing is held: what the collective leaves out is lost, as the codec's drop is

    def encode(self, codec, name: str, x, scale: float = 1.0):
        return codec.encode(x * scale if scale != 1.0 else x)
