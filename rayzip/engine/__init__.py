"""The gradient-exchange engine under every way of training (:class:`GradientExchange`).

It turns one rank's flat gradient into the mean over every rank, through a codec with error
feedback, and holds the knobs, the step statistics and the state a checkpoint keeps. The
adapters in :mod:`rayzip.torch` (the DDP comm hook, local steps) feed it, and the
parameter-server client pushes through its :class:`SegmentEncoder`; it imports neither DDP
nor Ray.
"""

from ..codecs import NonFiniteError
from ..comm.control import RankDisagreement
from .config import CompressionConfig
from .encoder import SegmentEncoder
from .exchange import NONFINITE_POLICIES, GradientExchange
from .stats import StepStats, plan_segments

__all__ = ["CompressionConfig", "GradientExchange", "NONFINITE_POLICIES", "NonFiniteError", "RankDisagreement",
           "SegmentEncoder", "StepStats", "plan_segments"]
