"""Decision rules for the adaptive controller: inputs in, a compression out (1.0: off).

A policy is any object with ``decide(inputs: PolicyInputs) -> (compression, explain)`` (and, if it
can decide before the first step, ``start`` with the same signature), built from
the job's :class:`~rayzip.spec.AdaptiveSpec` (``adaptive.policy``: ``cost_model``, the
default, ``time_to_target``, ``pressure``, or ``module:Class`` for your own). ``explain`` is a flat dict recorded
with the decision. Policies do no I/O and may keep state between decisions.

* :class:`CostModelPolicy` predicts each candidate's step time from the fitted
  :class:`~rayzip.adaptive.model.StepModel` and picks the least compression whose predicted
  step is within ``slack`` of the fastest, dense included (auto-off), under a compression cap that
  important batches lower. It switches only for a predicted gain above ``hysteresis``, and a
  marginal switch between dense and compressed must be the verdict of two decisions in a row.
  While compressing with no recent dense step, it probes, a few steps at a time (the
  controller decides again as soon as the probe's steps are in): first a payload 8x larger
  than the chosen one, if no payloads so far were varied enough to separate latency from
  bandwidth (small payloads on a fast link are all latency, which extrapolates to any dense
  time at all); then dense, if the model now gives dense a chance (within 2x of the chosen
  step) or still cannot tell. On a slow link the first rung shows the bandwidth and the
  second is skipped. Symmetrically, while dense with no compressed step in ``probe_every``,
  it probes the fastest compression, if the model puts it within 2x of dense. A switch off is
  always measured first: with no dense step in the window, a decision for dense becomes a
  dense probe, and its measurement decides.
  Candidate compressions stay within 8x of the kept fractions measured (the codec's time is
  fitted, not known, beyond them), so the compression moves there step by step. Its ``start``
  decides before the first step, from the start-up measurements (the timed broadcast of the
  model and one dry compressed step): a fast link starts dense (a dense probe), a slow one
  at the chosen compression, no less compression than the dry step's, with no probe.
* :class:`TimeToTargetPolicy` (``time_to_target``) keeps the cost model's rules and divides
  each candidate's predicted step by the training one of its steps does
  (:mod:`~rayzip.adaptive.efficiency`, learned from the loss curve), so it minimises the time
  to the target rather than the step; it varies the compression while that is uncertain, and
  turns compression off only where the cost model would probe dense.
* :class:`PressurePolicy` is the first rule, kept for comparison: compression in proportion
  to delay per byte over the best seen. It reads fixed latency as pressure (a smaller
  payload has a larger delay per byte) and does not see codec time.

Usage::

    policy = make_policy(AdaptiveSpec(enabled=True))
    compression, explain = policy.decide(PolicyInputs(model=model, importance=1.0, current=100.0))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..spec import AdaptiveSpec, import_callable
from .efficiency import EfficiencyFit, EfficiencyModel
from .model import Prediction, StepModel

__all__ = ["CostModelPolicy", "Policy", "PolicyInputs", "PressurePolicy", "TimeToTargetPolicy", "make_policy"]

FLIP_WITHOUT_CONFIRMATION = 2.0  # a flip this much faster is taken at once (a link that dropped)
PROBE_WITHIN = 2.0  # probe dense only while the model puts it within this factor of the chosen step
CAP_TOLERANCE = 1.05  # the importance cap forces less compression only when it binds by more than this
PROBE_PAYLOAD = 8.0  # the first rung: a payload this much larger than the chosen one


@dataclass
class PolicyInputs:
    model: StepModel  # fitted to the workers' per-step reports
    importance: float  # recent batch loss over its running mean
    current: float  # the compression in force (1.0: dense)
    now: float = 0.0  # the model's clock
    delay_per_byte: float | None = None  # this window's, slowest rank (Prometheus or the workers)
    compute_s: float | None = None  # this window's mean compute per step
    dense_bytes: float | None = None
    efficiency: EfficiencyModel | None = None  # the run's losses against compression (time_to_target)


class Policy:
    """A controller's policy: :meth:`decide` once a window, and optionally :meth:`start`
    before the first step. A policy from ``spec.policy: module:function`` subclasses it."""

    decides_early: bool = False  # decides from the fitted model alone, before a whole window
    decides_at_start: bool = False  # its start() decides before the first step

    def decide(self, inputs: PolicyInputs) -> tuple[float, dict]:
        raise NotImplementedError

    def start(self, inputs: PolicyInputs) -> tuple[float, dict] | None:
        """The decision before the first step, from the start-up measurements; None: this
        policy waits for the first window."""
        return None


def make_policy(spec: AdaptiveSpec) -> Policy:
    if spec.policy == "cost_model":
        return CostModelPolicy(spec)
    if spec.policy == "pressure":
        return PressurePolicy(spec)
    if spec.policy == "time_to_target":
        return TimeToTargetPolicy(spec)
    policy = import_callable(spec.policy)(spec)
    if not isinstance(policy, Policy):
        raise TypeError(f"adaptive.policy {spec.policy} made a {type(policy).__name__}, not a "
                        "rayzip.adaptive.policy.Policy: subclass it (decide, and start to decide before a step)")
    return policy


def _cap(spec: AdaptiveSpec, importance: float) -> float:
    return min(spec.max_compression, max(spec.min_compression, spec.max_compression / importance ** spec.importance_weight))


class CostModelPolicy(Policy):
    """See the module docstring."""

    decides_early = True  # it reads the fitted model only: a few steps are enough to start
    decides_at_start = True

    def __init__(self, spec: AdaptiveSpec):
        self.spec = spec
        self.flip_verdicts = 0  # decisions in a row that called for a dense/compressed flip
        self.probing_from: float | None = None  # the compression a probe interrupted
        self.probe: float | None = None  # the compression being probed (1.0: dense)
        self.payload_probed_at: float | None = None
        self.best_dense_network: float | None = None
        self.predicted: tuple[float, dict[float, Prediction]] | None = None  # the last cap and predictions

    def cost(self, compression: float, prediction: Prediction) -> float:
        """What the policy minimises for a candidate: here, its predicted step time."""
        return prediction.total_s

    def choosable(self, predictions: dict[float, Prediction]) -> dict[float, Prediction]:
        """The candidates a decision may pick from: here, all of them."""
        return predictions

    def candidates(self, cap: float, seen: tuple[float, float] | None) -> list[float]:
        """Dense, and compressions from ``min_compression`` to ``cap`` (two per octave) no further than
        PROBE_PAYLOAD from the kept fractions measured: outside them the codec's time is
        extrapolated, so the controller moves there one measured step at a time."""
        lo = self.spec.min_compression
        count = max(1, math.ceil(2 * math.log2(cap / lo))) if cap > lo else 0
        compressions = [lo * (cap / lo) ** (i / count) for i in range(count)] + [cap]
        if seen is not None:
            least, most = 1.0 / seen[1] / PROBE_PAYLOAD, 1.0 / seen[0] * PROBE_PAYLOAD
            inside = [r for r in compressions if least <= r <= most]
            compressions = inside or [min(compressions, key=lambda r: min(abs(math.log(r * seen[0])), abs(math.log(r * seen[1]))))]
        return [1.0] + compressions

    def decide(self, inputs: PolicyInputs) -> tuple[float, dict]:
        model = inputs.model
        current = self.probing_from if self.probing_from is not None else inputs.current
        probed = self.probe
        self.probing_from = self.probe = None
        if not model.ready:
            return current, {"reason": "no steps fitted yet"}
        if probed is not None:  # a probe just measured both modes: its verdict needs no second one
            self.flip_verdicts = max(self.flip_verdicts, 1)
        cap, predictions, now_p, explain = self._predict(inputs, current)
        target = explain["target"]
        choice = self._switch(current, target, now_p, predictions, cap)
        explain["flip_verdicts"] = self.flip_verdicts
        probe = self._probe(model, inputs.now, choice, predictions, predictions.get(choice, now_p), current)
        explain["after_probe"] = probed
        if probe is not None:
            self.probing_from, self.probe = (current if choice == 1.0 else choice), probe
            explain["probe"] = True
            return probe, explain
        return choice, explain

    def start(self, inputs: PolicyInputs) -> tuple[float, dict]:
        """The decision before the first step, from the start-up measurements alone (the
        start-up broadcast and one dry compressed step at ``inputs.current``): the least
        compression within ``slack`` of the fastest, dense or no less than ``current``, with
        no probe; a start on dense is a dense probe, which the next decision, once its steps
        are measured, confirms or not."""
        if not inputs.model.ready:
            return inputs.current, {"reason": "no start-up measurements"}
        # One measured density says nothing of how the codec's time grows with k (top-k's
        # selection does), so less compression than the dry step's would be a guess.
        _, _, _, explain = self._predict(inputs, inputs.current, at_least=min(inputs.current, self.spec.max_compression))
        target = explain["target"]
        if target == 1.0 and inputs.current != 1.0:
            self.probing_from, self.probe = inputs.current, 1.0
            explain["probe"] = True
        return target, explain

    def _predict(self, inputs: PolicyInputs, current: float, at_least: float = 1.0,
                 ) -> tuple[float, dict[float, Prediction], Prediction, dict]:
        """The importance cap, each candidate's predicted step (dense, and compressions of at least
        ``at_least``), the current compression's, and the record of them (``target``: the least
        compression within slack of the fastest)."""
        spec, model = self.spec, inputs.model
        cap = _cap(spec, inputs.importance)
        predictions = {r: model.predict(None if r == 1.0 else 1.0 / r) for r in self.candidates(cap, model.densities())
                       if r == 1.0 or r >= at_least}
        self.predicted = cap, predictions
        target = _least_within_slack(self.choosable(predictions), spec.slack, self.cost)
        now_p = model.predict(None if current == 1.0 else 1.0 / min(current, spec.max_compression))
        link = model.link
        dense_network = predictions[1.0].network_s
        self.best_dense_network = min(self.best_dense_network or dense_network, dense_network)
        explain = {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "link_separable": link.separable,
                   # how much slower a dense exchange would be now than at its best in this run
                   "pressure": dense_network / self.best_dense_network if self.best_dense_network else 1.0,
                   "importance": inputs.importance, "cap": cap, "target": target,
                   "predicted_step_s": predictions[target].total_s, "predicted_current_s": now_p.total_s,
                   "predicted_dense_s": predictions[1.0].total_s, "compute_s": predictions[1.0].compute_s,
                   "dense_comm_share": _share(predictions[1.0]), "probe": False}
        return cap, predictions, now_p, explain

    def _switch(self, current: float, target: float, now_p: Prediction, predictions: dict[float, Prediction],
                cap: float) -> float:
        spec, best = self.spec, predictions[target]
        if current > CAP_TOLERANCE * cap:
            # Important batches: less compression now, whatever the speed; but not off, which
            # is a switch of mode that the rules below decide.
            self.flip_verdicts = 0
            return _least_within_slack({r: p for r, p in predictions.items() if r != 1.0}, spec.slack, self.cost)
        now_cost, best_cost = self.cost(min(current, spec.max_compression), now_p), self.cost(target, best)
        faster = now_cost > (1 + spec.hysteresis) * best_cost
        gentler = target < current / 1.25  # same speed within slack, less compression
        if target == current or not (faster or gentler):
            self.flip_verdicts = 0
            return current
        if (target == 1.0) != (current == 1.0):  # compression off or on
            self.flip_verdicts += 1
            if self.flip_verdicts < 2 and now_cost < FLIP_WITHOUT_CONFIRMATION * best_cost:
                return current
        self.flip_verdicts = 0
        return target

    def _probe(self, model: StepModel, now: float, choice: float, predictions: dict[float, Prediction],
               chosen: Prediction, current: float) -> float | None:
        """The compression to probe next (1.0: dense), or None (see the module docstring)."""
        dense = predictions[1.0]
        newest_dense = model.dense[-1].at if model.dense else None
        if choice == 1.0:
            # Off on a prediction alone would run dense until the next decision: measure first.
            measured = newest_dense is not None and now - newest_dense <= model.window_s
            if current != 1.0:
                return 1.0 if not measured else None
            # Staying dense on compressed steps measured long ago (the dry step before the
            # first, perhaps): measure the fastest compression again, if it may beat dense.
            newest = model.compressed[-1].at if model.compressed else None
            compression, fastest = min(((r, p) for r, p in predictions.items() if r != 1.0), key=lambda rp: rp[1].total_s,
                                 default=(None, None))
            stale = newest is not None and now - newest > self.spec.probe_every
            return compression if stale and compression is not None and fastest.total_s <= PROBE_WITHIN * dense.total_s else None
        if newest_dense is not None and now - newest_dense <= self.spec.probe_every:
            return None
        if not model.alpha_known:
            if self.payload_probed_at is None or now - self.payload_probed_at > self.spec.probe_every:
                self.payload_probed_at = now
                return max(self.spec.min_compression, choice / PROBE_PAYLOAD)
            return 1.0  # the larger payload did not settle latency against bandwidth: measure dense
        return 1.0 if dense.total_s <= PROBE_WITHIN * chosen.total_s else None


class TimeToTargetPolicy(CostModelPolicy):
    """The cost model's rules, with another objective: the predicted time to the target.

    A candidate's cost is its predicted step time over the training one of its steps does, in
    dense steps (:class:`~rayzip.adaptive.efficiency.EfficiencyModel`, learned online from the
    run's loss curve): the time per dense step's worth of training. Whatever the target, the
    time to it is that times the dense steps still needed, which every candidate shares, so
    the least cost is the shortest time to the target. Importance still caps the compression.

    While the efficiency is uncertain enough to change the choice (the choices at the posterior
    mean of ``gamma`` plus and minus one standard deviation differ, and either would cost more
    than ``hysteresis`` if the other end were true), every other decision
    takes one of those two choices in turn: the loss curve under both is what narrows the
    posterior. A probe of the cost model's comes first, and dense is chosen or explored only
    where the cost model would probe it (:meth:`choosable`).

    Example::

        policy = make_policy(AdaptiveSpec(enabled=True, policy="time_to_target"))
        compression, explain = policy.decide(PolicyInputs(model=model, importance=1.0, current=100.0,
                                                          efficiency=efficiency_model))
    """

    def __init__(self, spec: AdaptiveSpec):
        super().__init__(spec)
        self.fit = EfficiencyFit(spec.efficiency_prior, spec.efficiency_prior_sd, 0, False)
        self.explorations = 0  # decisions taken while the efficiency could change the choice

    def cost(self, compression: float, prediction: Prediction) -> float:
        return prediction.total_s / self.fit.efficiency(compression)

    def choosable(self, predictions: dict[float, Prediction]) -> dict[float, Prediction]:
        """Dense only where the cost model would probe it: within PROBE_WITHIN of the fastest
        compressed step. On a slower link the efficiency alone never turns compression off: a
        wrong estimate there costs more than any other (each dense step is many compressed
        ones), and the least compression offered does nearly what a dense step does anyway."""
        fastest = min((p.total_s for r, p in predictions.items() if r != 1.0), default=math.inf)
        if predictions[1.0].total_s > PROBE_WITHIN * fastest:
            return {r: p for r, p in predictions.items() if r != 1.0}
        return predictions

    def decide(self, inputs: PolicyInputs) -> tuple[float, dict]:
        if inputs.efficiency is not None:
            self.fit = inputs.efficiency.fit()
        choice, explain = super().decide(inputs)
        self._explain(explain, choice)
        if explain.get("probe") or self.predicted is None or not inputs.model.ready:
            return choice, explain
        predictions = self.choosable(self.predicted[1])  # dense explored only where it may be chosen
        high, low = self._cost_at(self.fit.gamma + self.fit.sd), self._cost_at(max(0.0, self.fit.gamma - self.fit.sd))
        less, more = (_least_within_slack(predictions, self.spec.slack, cost) for cost in (high, low))
        # What a wrong guess would cost: at either end, the other end's choice against its own.
        regret = max(high(more, predictions[more]) / high(less, predictions[less]),
                     low(less, predictions[less]) / low(more, predictions[more])) - 1
        explain["exploration_regret"] = regret
        if less != more and regret > self.spec.hysteresis:
            # Every other decision explores, each end in turn: half the steps at the best
            # choice on what is known, and both ends measured as often.
            self.explorations += 1
            turn = self.explorations % 4
            if turn in (1, 3):
                choice = less if turn == 1 else more
                explain["explore"] = True
            explain.update(explore_less=less, explore_more=more)
            self._explain(explain, choice)
        return choice, explain

    def start(self, inputs: PolicyInputs) -> tuple[float, dict]:
        if inputs.efficiency is not None:
            self.fit = inputs.efficiency.fit()
        compression, explain = super().start(inputs)
        self._explain(explain, compression)
        return compression, explain

    def _cost_at(self, gamma: float):
        fit = replace(self.fit, gamma=gamma)
        return lambda r, p: p.total_s / fit.efficiency(r)

    def _explain(self, explain: dict, choice: float) -> None:
        explain.update(gamma=self.fit.gamma, gamma_sd=self.fit.sd, gamma_varied=self.fit.varied,
                       efficiency=self.fit.efficiency(choice))
        predicted = self.predicted[1].get(choice) if self.predicted else None
        if predicted is not None:
            explain["predicted_s_per_dense_step"] = self.cost(choice, predicted)


def _least_within_slack(predictions: dict[float, Prediction], slack: float, cost=lambda r, p: p.total_s) -> float:
    """The least compression whose cost (by default, its predicted step) is within ``slack``
    of the least."""
    costs = {r: cost(r, p) for r, p in predictions.items()}
    least = min(costs.values())
    return min(r for r, c in costs.items() if c <= (1 + slack) * least)


def _share(dense: Prediction) -> float:
    return dense.network_s / dense.total_s if dense.total_s > 0 else 0.0


class PressurePolicy(Policy):
    """The first rule (see the module docstring): delay per byte against the best seen."""

    def __init__(self, spec: AdaptiveSpec):
        self.spec = spec
        self.best_delay_per_byte: float | None = None

    def decide(self, inputs: PolicyInputs) -> tuple[float, dict]:
        if inputs.delay_per_byte is None or inputs.compute_s is None or inputs.dense_bytes is None:
            return inputs.current, {"reason": "no window inputs yet"}
        return self.compression_for(inputs.delay_per_byte, inputs.compute_s, inputs.dense_bytes, inputs.importance)

    def compression_for(self, delay_per_byte: float, compute_s: float, dense_bytes: float,
                  importance: float) -> tuple[float, dict]:
        spec = self.spec
        if self.best_delay_per_byte is None or delay_per_byte < self.best_delay_per_byte:
            self.best_delay_per_byte = delay_per_byte
        pressure = delay_per_byte / self.best_delay_per_byte
        dense_comm_s = dense_bytes * delay_per_byte
        share = dense_comm_s / (dense_comm_s + compute_s) if dense_comm_s + compute_s > 0 else 0.0
        explain = {"pressure": pressure, "importance": importance, "dense_comm_share": share,
                   "best_delay_per_byte": self.best_delay_per_byte}
        if share < spec.off_below:
            return 1.0, explain
        # The compression that fits a step's communication, on the best link seen, into the
        # budget share of its compute; then more with more delay, less for important batches.
        fitting = dense_bytes * self.best_delay_per_byte / (spec.comm_budget * max(compute_s, 1e-6))
        explain["fitting_compression"] = fitting
        compression = fitting * pressure ** spec.delay_weight / importance ** spec.importance_weight
        return min(spec.max_compression, max(spec.min_compression, compression)), explain
