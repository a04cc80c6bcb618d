"""A cost model of one training step, fitted online from what the workers measure.

A synchronous data-parallel step takes ``compute + codec(d) + network``, where ``d`` is the
kept fraction of a sparsifier (``None``: dense, compression off) and

* ``network = alpha * messages + beta * bytes``: a latency per latency-bound message and an
  inverse bandwidth, fitted by least squares to the (messages, bytes, seconds) of recent
  steps. Runs produce varied payloads (dense probes, compression changes), which is what makes the
  two separable; when the recent steps all have one payload size, ``alpha`` stays at its last
  well-determined value (latency seldom changes; bandwidth does) and only ``beta`` is fitted;
* ``codec(d) = c0 + c1 * d``: the exchange's own time outside torch.distributed (encode,
  decode, accumulate), fitted to the compressed steps seen at any time (it does not depend
  on the network); the dense path's own time likewise;
* ``bytes(d) = b0 + b1 * d`` and messages per step, as seen (dense: as reported by the
  workers, which count the fp32 ring allreduce's bytes even while compressing).

The link fit also takes timed transfers outside the steps (:meth:`StepModel.add_link`): DDP's
broadcast of the model at start is a dense-sized payload, which separates latency from
bandwidth before any dense step or probe.

A step's figures are combined across ranks before fitting, so that a slow worker is not read
as a slow network: its peers wait for it *inside* the collective, but the last rank to
arrive waits for nobody, so the **least** network time over the ranks is the transfer
itself; compute is the **largest** (the step waits for the slowest rank), and codec time the
median.

Usage::

    model = StepModel()
    model.add(StepSample(messages=2, bytes=8e6, network_s=0.07, codec_s=0.001, compute_s=0.05, density=None))
    ...
    model.predict(0.01).total_s, model.predict(None).total_s
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["LinkFit", "Prediction", "StepModel", "StepSample", "combine_ranks", "fit_link"]


RECENT_DENSE = 5  # dense steps whose median network time predicts the next (a link may just have changed)


@dataclass(frozen=True)
class StepSample:
    """One step, combined across ranks (:func:`combine_ranks`)."""

    messages: float  # latency-bound sends per worker
    bytes: float  # bytes per worker
    network_s: float
    codec_s: float
    compute_s: float
    density: float | None  # kept fraction; None: dense
    dense_bytes: float = 0.0  # an fp32 ring allreduce of the same gradient, per worker
    at: float = 0.0  # seconds (any clock), for the fitting window


@dataclass(frozen=True)
class RankStep:
    """One rank's report of one step."""

    step_s: float
    comm_s: float
    busy_s: float
    network_s: float
    bytes: float
    messages: float
    dense_bytes: float
    density: float | None
    loss: float = float("nan")  # the rank's batch loss


def combine_ranks(reports: list[RankStep], at: float = 0.0) -> StepSample:
    """One step's sample from every rank's report of it (see the module docstring)."""
    return StepSample(messages=statistics.median(r.messages for r in reports),
                      bytes=statistics.median(r.bytes for r in reports),
                      network_s=min(r.network_s for r in reports),
                      codec_s=statistics.median(max(0.0, r.busy_s - r.network_s) for r in reports),
                      compute_s=max(max(0.0, r.step_s - r.comm_s) for r in reports),
                      density=reports[0].density, dense_bytes=reports[0].dense_bytes, at=at)


@dataclass(frozen=True)
class LinkFit:
    alpha: float  # seconds per latency-bound message
    beta: float  # seconds per byte (1 / bandwidth)
    separable: bool  # both fitted (payload sizes varied), or alpha carried over
    samples: int

    def seconds(self, messages: float, nbytes: float) -> float:
        return self.alpha * messages + self.beta * nbytes


def fit_link(samples: list[StepSample], alpha_prior: float, spread: float = 1.5) -> LinkFit | None:
    """Least squares ``network_s ~ alpha * messages + beta * bytes`` over ``samples``. With
    byte counts spread less than ``spread``-fold (or a fit that comes out negative), alpha is
    held at ``alpha_prior`` and beta fitted alone."""
    rows = [s for s in samples if s.bytes > 0]
    if not rows:
        return None
    m = np.array([s.messages for s in rows], dtype=np.float64)
    b = np.array([s.bytes for s in rows], dtype=np.float64)
    t = np.array([s.network_s for s in rows], dtype=np.float64)
    if b.max() >= spread * b.min():
        (alpha, beta), *_ = np.linalg.lstsq(np.stack([m, b], axis=1), t, rcond=None)
        if alpha >= 0 and beta > 0:
            return LinkFit(float(alpha), float(beta), True, len(rows))
        if beta <= 0 < np.dot(m, t):
            # Payloads that differ this much took the same time: at these sizes the link is
            # all latency, and its bandwidth is beyond what they can measure.
            return LinkFit(float(np.dot(m, t) / np.dot(m, m)), 0.0, True, len(rows))
    beta = float(np.dot(b, np.maximum(t - alpha_prior * m, 0.0)) / np.dot(b, b))
    return LinkFit(alpha_prior, max(beta, 1e-15), False, len(rows))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope; a constant when x does not vary."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if len(points) < 2 or np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())):
        return float(np.median(y)), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


@dataclass(frozen=True)
class Prediction:
    density: float | None
    messages: float
    bytes: float
    network_s: float
    codec_s: float
    compute_s: float

    @property
    def exchange_s(self) -> float:
        return self.network_s + self.codec_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exchange_s


class StepModel:
    """Samples in, predictions out (see the module docstring). The link is fitted to the
    samples of the last ``window_s`` seconds; codec time and payload sizes remember the
    last ``memory`` samples of each mode."""

    def __init__(self, window_s: float = 10.0, alpha_prior: float = 1e-4, memory: int = 512):
        self.window_s, self.alpha = window_s, alpha_prior
        self.samples: deque[StepSample] = deque(maxlen=4 * memory)
        self.compressed: deque[StepSample] = deque(maxlen=memory)
        self.dense: deque[StepSample] = deque(maxlen=memory)
        self.link_only: deque[StepSample] = deque(maxlen=memory)  # timed transfers outside steps
        self.link: LinkFit | None = None
        self.fitted_at = 0.0
        self.alpha_known = False  # some window's payloads varied enough to fit the latency
        self.added = 0  # samples added so far: what compute_s' memo is valid for
        self._compute: tuple[tuple[int, float], float] | None = None

    def add(self, sample: StepSample) -> None:
        self.samples.append(sample)
        self.added += 1
        (self.dense if sample.density is None else self.compressed).append(sample)

    def add_link(self, messages: float, nbytes: float, seconds: float, at: float) -> None:
        """A timed transfer outside the steps (DDP's broadcast of the model at start): a
        point for the link fit only, since it has no compute or codec time and is not an
        allreduce."""
        self.link_only.append(StepSample(messages=messages, bytes=nbytes, network_s=seconds, codec_s=0.0,
                                         compute_s=0.0, density=None, at=at))

    def densities(self) -> tuple[float, float] | None:
        """The lowest and highest kept fraction measured (compressed steps only)."""
        seen = [s.density for s in self.compressed]
        return (min(seen), max(seen)) if seen else None

    def _window(self, samples, end: float) -> list[StepSample]:
        """Those of ``samples`` within the window ending at ``end``."""
        return [s for s in samples if s.at >= end - self.window_s]

    def fit(self, now: float | None = None) -> LinkFit | None:
        """Refit the link to the window ending at ``now`` (the newest sample's time)."""
        if not self.samples:
            return self.link
        now = self.samples[-1].at if now is None else now
        self.fitted_at = now
        fit = fit_link(self._window(self.link_only, now) + self._window(self.samples, now), self.alpha)
        if fit is not None:
            self.link = fit
            if fit.separable:
                self.alpha = fit.alpha  # carried over while the payloads stop varying
                self.alpha_known = True
        return self.link

    @property
    def ready(self) -> bool:
        return self.link is not None and bool(self.compressed or self.dense)

    def dense_bytes(self) -> float:
        newest = self.samples[-1] if self.samples else None
        return float(newest.dense_bytes) if newest is not None else 0.0

    def compute_s(self, now: float | None = None) -> float:
        if not self.samples:
            return 0.0
        now = self.samples[-1].at if now is None else now
        # A decision predicts every candidate from the same samples: the median once.
        if self._compute is None or self._compute[0] != (self.added, now):
            recent = self._window(self.samples, now) or [self.samples[-1]]
            self._compute = (self.added, now), float(statistics.median(s.compute_s for s in recent))
        return self._compute[1]

    def predict(self, density: float | None) -> Prediction:
        """The step at kept fraction ``density`` (None: dense) on the link as fitted now."""
        if self.link is None:
            raise RuntimeError("no samples fitted yet")
        compute = self.compute_s()
        if density is None:
            seen = list(self.dense)
            nbytes = self.dense_bytes()
            # Before any dense step: a ring allreduce's 2(n-1) messages per bucket are not
            # known, so the compressed steps' count stands in (the same buckets).
            messages = statistics.median(s.messages for s in (seen or self.compressed))
            codec = statistics.median(s.codec_s for s in seen) if seen else 0.0
            recent = self._window(seen, self.fitted_at)[-RECENT_DENSE:]
            if recent:  # measured beats modelled: a dense allreduce also costs its reduction
                network = float(statistics.median(s.network_s for s in recent))
                return Prediction(None, messages, nbytes, network, codec, compute)
        else:
            seen = list(self.compressed)
            if not seen:  # nothing compressed yet: bytes in proportion to the dense count
                nbytes, messages, codec = density * self.dense_bytes(), statistics.median(
                    s.messages for s in self.dense), 0.0
            else:
                b0, b1 = _line([(s.density, s.bytes) for s in seen])
                if b1 == 0.0:  # one density seen: payload in proportion to it
                    ref = statistics.median(s.density for s in seen)
                    b0, b1 = 0.0, b0 / ref if ref > 0 else 0.0
                nbytes = max(0.0, b0 + b1 * density)
                messages = statistics.median(s.messages for s in seen)
                c0, c1 = _line([(s.density, s.codec_s) for s in seen])
                codec = max(0.0, c0 + c1 * density)
        return Prediction(density, messages, nbytes, self.link.seconds(messages, nbytes), codec, compute)
