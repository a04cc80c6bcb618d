"""The control word: what every rank must agree on before a step's payloads cross the wire.

A collective whose ranks disagree does not fail, it hangs: a rank that skips a step, sends
a payload of another size, or leaves early keeps the others waiting until the process
group's timeout. So before each payload exchange every rank all-reduces one small word:

* ``step`` and the compression config (``density`` and ``mode``: enabled, compressed this
  step, value dtype) must be equal on every rank, or every rank raises
  :class:`RankDisagreement` naming the field and its range;
* ``bad``: a rank whose gradient (or its encoding) is not finite marks it here, with its
  rank and the first bad flat index, so that every rank skips the step, or raises, together;
* ``failed``: a rank whose encoding raised anything else says so, and every rank raises;
* ``stop``: any rank may ask every rank to stop after this step;
* ``proposal``: a config change (a controller's decision, usually posted by rank 0 alone)
  that every rank adopts from the next step on.

One all-reduce with MAX over ``[w, -w]`` gives every field's maximum and minimum at once:
``2 * 8 * len(FIELDS)`` bytes, counted like any other collective.

Usage::

    word = ControlWord(step=12, density=0.01, mode=encode_mode(True, True, "fp16"))
    agreed = agree(transport, word)      # the same Agreed on every rank
    agreed.check()                       # RankDisagreement, raised on every rank alike
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, fields

import torch

__all__ = ["Agreed", "ControlWord", "RankDisagreement", "agree", "bad_key", "control_nbytes", "encode_mode",
           "proposal_key"]

_INDEX_BITS = 40  # flat indices below 2**40 (1.1e12 parameters) fit beside the rank
_DTYPES = {None: 0, "fp32": 1, "fp16": 2}


class RankDisagreement(RuntimeError):
    """Ranks reached the same exchange with different steps or configs, or one of them
    failed before it: raised on every rank."""


@dataclass
class ControlWord:
    step: int = 0
    density: int = 0  # the kept fraction's float64 bits (0: the codec has none)
    mode: int = 0  # encode_mode(...)
    bad: int = 0  # bad_key(...) when this rank's gradient is not finite
    failed: int = 0  # world - rank when this rank's encoding raised
    stop: int = 0
    proposal: int = 0  # proposal_key(...) of a config change to adopt, 0 for none

    def __post_init__(self):
        if isinstance(self.density, float):
            self.density = _float_bits(self.density)


FIELDS = tuple(f.name for f in fields(ControlWord))
_AGREE = ("step", "density", "mode")


def control_nbytes(world: int) -> int:
    """Bytes one worker sends for the control word's ring all-reduce."""
    return 2 * (world - 1) * (2 * 8 * len(FIELDS)) // world


def encode_mode(enabled: bool, compressed: bool, value_dtype: str | None) -> int:
    return int(enabled) | int(compressed) << 1 | _DTYPES.get(value_dtype, 3) << 2


def _describe_mode(mode: int) -> str:
    dtype = {v: k for k, v in _DTYPES.items()}.get(mode >> 2, "other")
    return f"enabled={bool(mode & 1)} compressed={bool(mode & 2)} value_dtype={dtype}"


def bad_key(rank: int, world: int, index: int, overflow: bool = False) -> int:
    """Max-reduces to the lowest bad rank, with its first bad flat index, and whether the
    value was finite but beyond the wire type's range."""
    return (world - rank) << (_INDEX_BITS + 1) | int(overflow) << _INDEX_BITS | min(max(index, 0), (1 << _INDEX_BITS) - 1)


def proposal_key(seq: int, compression: float) -> int:
    """A proposal: its sequence number (>= 0) and the compression (1 / kept fraction;
    1 or below: compression off). The highest sequence number wins."""
    if seq < 0 or seq >= 1 << 30:
        raise ValueError(f"proposal sequence numbers run 0 .. 2**30-1, got {seq}")
    bits = struct.unpack("<I", struct.pack("<f", max(0.0, float(compression))))[0]
    return (seq + 1) << 32 | bits


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


@dataclass
class Agreed:
    """The reduced word: each field's minimum and maximum over the ranks."""

    low: ControlWord
    high: ControlWord
    world: int

    def check(self) -> None:
        """Raise :class:`RankDisagreement` (on every rank, since all hold the same word)."""
        problems = []
        for name in _AGREE:
            lo, hi = getattr(self.low, name), getattr(self.high, name)
            if lo != hi:
                if name == "density":
                    lo, hi = _bits_float(lo), _bits_float(hi)
                elif name == "mode":
                    lo, hi = _describe_mode(lo), _describe_mode(hi)
                problems.append(f"{name} ranges over {lo} .. {hi}")
        if problems:
            raise RankDisagreement(
                f"ranks disagree at step {self.low.step}..{self.high.step}: {'; '.join(problems)}. Every rank must "
                "run the same steps and change the config at the same step (set_density/set_enabled on every rank, or "
                "propose() for a change that every rank adopts)")

    @property
    def bad(self) -> tuple[int, int, bool] | None:
        """(lowest rank with a non-finite gradient, its first bad flat index, whether it was an
        overflow of the wire type), or None."""
        key = self.high.bad
        if not key:
            return None
        return self.world - (key >> (_INDEX_BITS + 1)), key & ((1 << _INDEX_BITS) - 1), bool(key >> _INDEX_BITS & 1)

    @property
    def failed(self) -> int | None:
        """The lowest rank whose encoding raised, or None."""
        return self.world - self.high.failed if self.high.failed else None

    @property
    def stop(self) -> bool:
        return bool(self.high.stop)

    @property
    def proposal(self) -> tuple[int, float] | None:
        """(sequence number, compression) of the winning proposal, or None."""
        key = self.high.proposal
        if not key:
            return None
        compression = struct.unpack("<f", struct.pack("<I", key & 0xFFFF_FFFF))[0]
        return (key >> 32) - 1, float(compression)


def agree(transport, word: ControlWord) -> Agreed:
    """All-reduce ``word`` over ``transport``'s group: every rank gets the same :class:`Agreed`."""
    values = list(astuple(word))
    tensor = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=transport.device)
    transport.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    reduced = tensor.cpu().tolist()
    k = len(values)
    return Agreed(low=ControlWord(*[-v for v in reduced[k:]]), high=ControlWord(*reduced[:k]), world=transport.world)
