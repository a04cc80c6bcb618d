"""How much training a step does under each compression, learned online from the loss curve.

A compressed step is cheaper than a dense one but may also do less: the run needs more of them
to reach the same loss. This model puts a number on "less". It assumes a step at compression
``r`` (1 / kept fraction; 1.0 is dense) advances training by ``e(r) = r ** -gamma`` dense steps,
and learns ``gamma`` from the run's own per-step losses:

* ``tau``, the dense-equivalent step count, grows by ``e(r)`` at each step;
* over the recent steps, ``log(loss)`` is a smooth function of ``tau`` (a polynomial of degree
  ``DEGREE``: a loss curve bends too much for less). Where the
  compression changed, the curve bends at the change unless ``gamma`` is right. The fit is a
  profile likelihood over a grid of ``gamma``: least squares for the curve at each, Gaussian
  noise of unknown variance, times a normal prior on ``gamma``;
* the first dense step after compressed ones also sends what error feedback held back over
  all of them (:mod:`rayzip.torch.dense`), so the loss drops there by more than one dense
  step's training. Each such switch gets a step of its own in the curve, of any height, from
  the next step's loss on: the drop says nothing of ``gamma``, and only what dense steps do
  after it counts. (Read as the dense step's own training, a short dense probe on a slow link
  once made a compressed step look worth a hundredth of what it was, and the controller
  turned compression off.)

With one compression in the window the data say nothing of ``gamma``, and the posterior is the
prior. The policy (:class:`~rayzip.adaptive.policy.TimeToTargetPolicy`) varies the compression
while the posterior is wide, so that it narrows.

Not modelled: a learning-rate schedule that changes at the same step as the compression reads
as a change of efficiency.

Usage::

    model = EfficiencyModel()
    for step, loss, compression in history:
        model.add(step, loss, compression)
    fit = model.fit()
    fit.gamma, fit.sd, fit.efficiency(100.0)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["EfficiencyFit", "EfficiencyModel"]

GAMMAS = np.linspace(0.0, 1.5, 151)  # the grid of the posterior: 1.5 makes 100x worth 1/1000 of a step
DEGREE = 5  # of the curve in tau: lower degrees misread the curve's own bend as efficiency
MIN_POINTS = 24  # steps before a fit is tried: a few times the curve's terms


@dataclass(frozen=True)
class EfficiencyFit:
    gamma: float  # posterior mean
    sd: float  # posterior standard deviation
    points: int  # steps in the fit
    varied: bool  # whether the window held more than one compression

    def efficiency(self, compression: float) -> float:
        """Dense steps' worth of training one step at ``compression`` does."""
        return max(1.0, compression) ** -self.gamma


class EfficiencyModel:
    """The recent steps' losses and compressions, and the posterior of ``gamma`` from them.

    Args:
        prior_gamma: the prior's mean.
        prior_sd: the prior's standard deviation.
        window: how many of the newest steps the fit reads.
    """

    def __init__(self, prior_gamma: float = 0.2, prior_sd: float = 0.2, window: int = 1000):
        self.prior_gamma, self.prior_sd = prior_gamma, prior_sd
        self.points: deque[tuple[int, float, float]] = deque(maxlen=window)

    def add(self, step: int, loss: float, compression: float) -> None:
        """One step's loss (the mean over the ranks' batches) at ``compression`` (1.0: dense).
        Non-finite or non-positive losses are left out. A step at or before the newest one
        (a restart from a checkpoint) drops the steps it goes back over."""
        while self.points and self.points[-1][0] >= step:
            self.points.pop()
        if step >= 0 and math.isfinite(loss) and loss > 0:
            self.points.append((step, math.log(loss), max(1.0, compression)))

    def prior(self) -> EfficiencyFit:
        return EfficiencyFit(self.prior_gamma, self.prior_sd, len(self.points), False)

    def fit(self) -> EfficiencyFit:
        points = list(self.points)
        if len(points) < MIN_POINTS:
            return self.prior()
        steps = np.array([p[0] for p in points], dtype=np.float64)
        y = np.array([p[1] for p in points])
        compressions = np.array([p[2] for p in points])
        if np.ptp(np.log(compressions)) <= 1e-6:  # one compression: nothing to tell gamma by
            return self.prior()
        gaps = np.diff(steps)  # steps the controller did not combine count at the previous compression
        log_prior = -0.5 * ((GAMMAS - self.prior_gamma) / self.prior_sd) ** 2
        n = len(points)
        # Every gamma of the grid at once (a decision fits the whole window each time): tau
        # for each, on [-1, 1] for a well-conditioned fit, the curve's least squares through
        # the normal equations of the polynomial designs, and the residuals themselves.
        steps_worth = compressions[None, :-1] ** -GAMMAS[:, None] * gaps[None, :]
        tau = np.concatenate([np.zeros((len(GAMMAS), 1)), np.cumsum(steps_worth, axis=1)], axis=1)
        tau = 2 * tau / tau[:, -1:] - 1
        flushes = _flush_steps(compressions)
        design = np.empty(tau.shape + (DEGREE + 1 + len(flushes),))
        design[:, :, 0] = 1.0
        for k in range(1, DEGREE + 1):
            design[:, :, k] = design[:, :, k - 1] * tau
        for k, column in enumerate(flushes, start=DEGREE + 1):
            design[:, :, k] = column[None, :]
        transposed = design.transpose(0, 2, 1)
        coef = np.linalg.solve(transposed @ design, transposed @ y[None, :, None])
        rss = np.sum(((design @ coef)[:, :, 0] - y) ** 2, axis=1)
        log_like = -0.5 * n * np.log(np.maximum(rss, 1e-300))
        log_post = log_like + log_prior
        weights = np.exp(log_post - log_post.max())
        weights /= weights.sum()
        mean = float(np.sum(weights * GAMMAS))
        sd = float(math.sqrt(max(0.0, np.sum(weights * (GAMMAS - mean) ** 2))))
        return EfficiencyFit(mean, sd, n, True)


def _flush_steps(compressions: np.ndarray) -> list[np.ndarray]:
    """For each switch from compressed steps to dense ones inside the window, a column that
    is 1 from the point after the first dense step on (a step's loss is taken before its
    update) and 0 before: the residual's flush, as a step in the curve."""
    switches = np.flatnonzero((compressions[1:] == 1.0) & (compressions[:-1] > 1.0)) + 1
    n = len(compressions)
    return [(np.arange(n) > i).astype(np.float64) for i in switches if i < n - 1]
