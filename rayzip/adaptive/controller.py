"""The adaptive compression controller: a named Ray actor that sets the sparsifier's compression.

Every ``interval`` seconds it gathers its inputs, decides, and publishes a decision; rank 0
of the training run fetches the latest decision without waiting and broadcasts it, so every
worker adopts it at the same step.

**Inputs.** From Prometheus (``/api/v1/query``), over the last ``window`` seconds of the run's
series (see :mod:`rayzip.metrics`):

* per rank, the time spent inside the collective per byte sent,
  ``rate(..._collective_delay_seconds_sum) / rate(..._bytes_sent_total)``; the slowest rank
  counts, since a synchronous step waits for it;
* per rank, the median collective delay,
  ``histogram_quantile(0.5, sum by (le, rank) (rate(..._collective_delay_seconds_bucket)))``,
  recorded with each decision;
* the mean compute time per step, ``rate(..._compute_seconds_sum) / rate(..._count)``.

From the workers directly (every step, fire and forget): batch losses, dense bytes per
step, and each rank's timings, bytes and latency-bound message count, the source of the
window's figures when no Prometheus is configured. The cost model is fitted to these per-step
reports (a step's ranks combined: :func:`~rayzip.adaptive.model.combine_ranks`), since a fit
of latency and bandwidth needs per-step pairs of payload and time that rates average away.

**Policy** (:mod:`rayzip.adaptive.policy`, ``adaptive.policy``). ``cost_model`` fits a model
of the step (:mod:`rayzip.adaptive.model`) to the workers' per-step reports (network time as latency times messages plus bytes over bandwidth, the
codec's own time against density, compute), predicts the step time of dense allreduce and
of each candidate compression, and picks the least compression within ``slack`` of the fastest:
compression off when dense is predicted fastest, with hysteresis. *Sample importance* ``i``
(mean loss of the batches since the last decision over the running mean of all losses)
caps the compression at ``max_compression / i ** importance_weight``: important batches are compressed
less. ``time_to_target``, the default, keeps those rules but divides each candidate's
predicted step by the training one of its steps does, learned from the run's per-step losses
(:mod:`rayzip.adaptive.efficiency`): it minimises the time to the target, not the step.
``pressure``, the first rule, is kept for comparison.

**Robustness.** A Prometheus that is unreachable, slow (``query_timeout``), or answers with
NaN or nothing leaves the last decision in force: the attempt is recorded as ``held``, a
warning is logged once, and each further attempt waits twice as long (up to 8 intervals).
An answer that lacks the series of a rank that reported to the controller within the
window is held the same way, since the slowest rank counts. Training never waits for the
controller. Decisions start once training has run for a window; the cost model starts after a
few combined steps (three once the ranks' timed start-up transfer, DDP's broadcast of the
model, has measured the link: ``report_link``).

Every decision (and every hold) is logged with its inputs and kept in :meth:`history`;
``rayzip_controller_*`` series export them.

Usage::

    controller = start_controller(run_id, spec)      # in the driver, before fitting
    ... workers: controller.report.remote(...); rank 0: controller.decision.remote() ...
    history = ray.get(controller.history.remote())
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from ..spec import AdaptiveSpec
from .efficiency import EfficiencyModel
from .model import RankStep, StepModel, combine_ranks
from .policy import PolicyInputs, make_policy

__all__ = ["AdaptiveController", "Decision", "PrometheusSource", "SourceError", "controller_name", "start_controller"]

log = logging.getLogger("rayzip.adaptive")
MAX_BACKOFF_DOUBLINGS = 3  # retries slow to 8 intervals apart, no further
FIRST_LOOK_S = 0.25  # seconds between looks until the first decision
EARLY_STEPS = 5  # a policy that decides early (the cost model) waits for this many combined steps
EARLY_STEPS_LINK_KNOWN = 3  # ... or this many once a timed start-up transfer has measured the link
PROBE_STEPS = 3  # a probe's steps measured before the controller decides again
STEP_LAG = 8  # a step some rank has not reported this many steps later is combined without it


@dataclass
class Decision:
    seq: int
    compression: float  # compression of the sparsifier, 1 / kept fraction; 1.0: compression off
    source: str  # prometheus, workers, held, initial, or start (before the first step)
    at: float
    inputs: dict = field(default_factory=dict)
    applied_step: int | None = None


class SourceError(RuntimeError):
    """Prometheus gave no usable answer."""


class PrometheusSource:
    """The controller's queries, through Prometheus' HTTP API."""

    def __init__(self, url: str, run: str, window_s: float, timeout_s: float):
        import requests

        self.session = requests.Session()
        self.url, self.run, self.timeout = url.rstrip("/"), run, timeout_s
        self.window = f"{max(1, round(window_s))}s"

    def query(self, promql: str) -> list[dict]:
        try:
            answer = self.session.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=self.timeout)
            answer.raise_for_status()
            body = answer.json()
        except Exception as exc:  # unreachable, slow, or not Prometheus
            raise SourceError(f"{type(exc).__name__}: {exc}") from None
        if body.get("status") != "success":
            raise SourceError(f"query failed: {body.get('error', body)}")
        return body["data"]["result"]

    def by_rank(self, promql: str) -> dict[str, float]:
        values = {}
        for row in self.query(promql):
            value = float(row["value"][1])
            if math.isfinite(value):
                values[row["metric"].get("rank", "")] = value
        if not values:
            raise SourceError(f"no finite values for {promql}")
        return values

    def inputs(self) -> dict[str, Any]:
        sel, w = f'run="{self.run}"', self.window
        delay_per_byte = self.by_rank(f"sum by (rank) (rate(ray_rayzip_collective_delay_seconds_sum{{{sel}}}[{w}])) / "
                                      f"sum by (rank) (rate(ray_rayzip_bytes_sent_total{{{sel}}}[{w}]))")
        p50 = self.by_rank(f"histogram_quantile(0.5, sum by (le, rank) "
                           f"(rate(ray_rayzip_collective_delay_seconds_bucket{{{sel}}}[{w}])))")
        compute = self.by_rank(f"sum by (rank) (rate(ray_rayzip_compute_seconds_sum{{{sel}}}[{w}])) / "
                               f"sum by (rank) (rate(ray_rayzip_compute_seconds_count{{{sel}}}[{w}]))")
        return {"delay_per_byte": max(delay_per_byte.values()), "delay_per_byte_by_rank": delay_per_byte,
                "collective_delay_p50_s_by_rank": p50, "compute_s": sum(compute.values()) / len(compute)}


def controller_name(run_id: str) -> str:
    return f"rayzip-controller-{run_id}"


@ray.remote(num_cpus=0)
class AdaptiveController:
    """See the module docstring. ``initial_compression`` is in force until the first decision."""

    def __init__(self, run: str, job: str, spec: dict, initial_compression: float):
        from ..metrics import ControllerMetrics

        self.spec = AdaptiveSpec.model_validate(spec)
        self.policy = make_policy(self.spec)
        self.model = StepModel(window_s=self.spec.window, alpha_prior=self.spec.latency_prior)
        self.efficiency = EfficiencyModel(self.spec.efficiency_prior, self.spec.efficiency_prior_sd)
        self.steps: dict[int, dict[int, RankStep]] = {}  # step -> rank -> report, until every rank's is in
        self.ranks: set[int] = set()
        self.world: int | None = None  # as the workers report it (a resize changes it)
        self.probing: float | None = None  # the kept fraction (1.0: dense) a probe decision asked for
        self.probe_steps = 0
        self.link_probes: dict[int, tuple[float, float, float]] = {}  # rank -> (messages, bytes, seconds)
        self.link_probed = False
        self.dry_step_in = False  # every rank's dry exchange before the first step (step -1) is a sample
        self.wake = threading.Event()
        self.metrics = ControllerMetrics(run, job)
        self.source = (PrometheusSource(self.spec.prometheus_url, run, self.spec.window, self.spec.query_timeout)
                       if self.spec.prometheus_url else None)
        self.lock = threading.Lock()
        self.reports: deque = deque(maxlen=4096)  # (time, rank, step, loss, step_s, comm_s, network_s, bytes, dense)
        self.first_report: float | None = None
        self.loss_mean: float | None = None
        self.new_losses: list[float] = []
        self.current = Decision(0, float(initial_compression), "initial", time.time())
        self.decisions: list[dict] = [asdict(self.current)]
        self.failures = 0
        self.warned = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rayzip-controller", daemon=True)
        self.thread.start()

    # --- called by workers and the driver ------------------------------------------------
    def report(self, rank: int, step: int, loss: float, step_s: float, comm_s: float, network_s: float,
               bytes_sent: int, dense_bytes: int, busy_s: float | None = None, messages: int = 0,
               density: float | None = None, world: int | None = None) -> None:
        """One rank's step. ``density``: the kept fraction in force (None: dense); ``world``:
        the number of ranks whose reports make up a step (without it, the ranks seen so far)."""
        with self.lock:
            now = time.time()
            self.first_report = self.first_report or now
            if world:
                self.world = world
            self.reports.append((now, rank, step, loss, step_s, comm_s, network_s, bytes_sent, dense_bytes))
            if math.isfinite(loss):
                self.new_losses.append(loss)
            self.ranks.add(rank)
            self.steps.setdefault(step, {})[rank] = RankStep(step_s, comm_s, comm_s if busy_s is None else busy_s,
                                                             network_s, bytes_sent, messages, dense_bytes, density,
                                                             loss)
            self._combine(now)

    def report_link(self, rank: int, nbytes: float, seconds: float, messages: float) -> None:
        """One rank's timed transfer before its first step (DDP's broadcast of the model,
        :mod:`rayzip.train.probe`): ``nbytes`` over the busiest link in ``seconds``."""
        with self.lock:
            self.link_probes[rank] = (float(messages), float(nbytes), float(seconds))

    def _early_steps(self) -> int:
        return EARLY_STEPS_LINK_KNOWN if self.link_probes else EARLY_STEPS

    def _add_link_probe(self, now: float) -> None:
        """The ranks' start-up transfer as one link sample: the slowest rank's time, since
        the transfer (timed after a barrier) is done when its last receiver has it."""
        if self.link_probed or not self.link_probes:
            return
        self.link_probed = True
        messages, nbytes, _ = next(iter(self.link_probes.values()))
        self.model.add_link(messages, nbytes, max(p[2] for p in self.link_probes.values()), at=now)

    def _combine(self, now: float) -> None:
        """Steps every rank has reported, and steps left behind (a rank gone), become samples."""
        newest = max(self.steps)
        for step in sorted(self.steps):
            ranks = self.steps[step]
            # The ranks seen so far are too few to wait for while the first reports come in
            # (the first rank's first step would be combined alone, and the next held back).
            if len(ranks) < (self.world or len(self.ranks)) and step > newest - STEP_LAG:
                break
            del self.steps[step]
            modes = {r.density for r in ranks.values()}
            if len(modes) == 1:  # a step that straddled an adoption has no single mode
                sample = combine_ranks(list(ranks.values()), at=now)
                self.model.add(sample)
                losses = [r.loss for r in ranks.values() if math.isfinite(r.loss)]
                if losses:
                    self.efficiency.add(step, sum(losses) / len(losses), 1.0 / (sample.density or 1.0))
                self.dry_step_in = self.dry_step_in or step == -1
                if len(self.decisions) == 1 and len(self.model.samples) >= self._early_steps():
                    self.wake.set()  # enough steps for a first decision: take it now
                if self.probing is not None and _same_mode(sample.density, self.probing):
                    self.probe_steps += 1
                    if self.probe_steps >= PROBE_STEPS:
                        self.wake.set()  # the probe is measured: decide now, not an interval later

    def start(self) -> dict | None:
        """The decision before the first step, from every rank's dry exchange (step -1) and
        start-up transfer, through the policy's ``start``; None until they are in, or for a
        policy that does not decide before a step. Rank 0 asks, and every rank applies it
        from step 0 (:meth:`rayzip.train.Telemetry.start`)."""
        with self.lock:
            if not self.policy.decides_at_start or not self.dry_step_in:
                return None
            now = time.time()
            self._add_link_probe(now)
            self.model.fit(now)
            started = self.policy.start(PolicyInputs(model=self.model, importance=1.0, current=self.current.compression,
                                                     now=now, efficiency=self.efficiency))
            if started is None:
                return None
            compression, explain = started
            seq = self.current.seq + (1 if compression != self.current.compression else 0)
            self.probing, self.probe_steps = (1.0 / compression if explain.get("probe") else None), 0
            self.current = Decision(seq, compression, "start", now, {**explain, "dense_bytes": self.model.dense_bytes(),
                                                                     "link_probe": self.link_probed})
            self.decisions.append(asdict(self.current))
        self.metrics.record(compression, explain.get("pressure"), 1.0, "start")
        log.info("rayzip controller: compression %.1f before the first step: %s", compression, explain)
        return {"seq": seq, "compression": compression}

    def decision(self) -> dict:
        with self.lock:
            return {"seq": self.current.seq, "compression": self.current.compression}

    def applied(self, seq: int, step: int) -> None:
        with self.lock:
            for entry in reversed(self.decisions):
                if entry["seq"] == seq and entry["source"] != "held":
                    entry["applied_step"] = step
                    break

    def history(self) -> list[dict]:
        with self.lock:
            return [dict(d) for d in self.decisions]

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=10)

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        wait = self._next_wait(ok=True)
        while not self.stopping.is_set():
            self.wake.wait(wait)
            self.wake.clear()
            if self.stopping.is_set():
                break
            try:
                ok = self._decide_once()
            except Exception as exc:  # a bug here must not stop the controller
                log.exception("rayzip controller: decision failed: %s", exc)
                ok = False
            wait = self._next_wait(ok)

    def _next_wait(self, ok: bool) -> float:
        if not ok:
            return self.spec.interval * 2 ** min(self.failures, MAX_BACKOFF_DOUBLINGS)
        # Until the first decision, look often: a cost model may decide after a few steps.
        return self.spec.interval if len(self.decisions) > 1 else min(self.spec.interval, FIRST_LOOK_S)

    def _importance(self) -> float:
        with self.lock:
            fresh, self.new_losses = self.new_losses, []
        if not fresh:
            return 1.0
        recent = sum(fresh) / len(fresh)
        previous = self.loss_mean
        # The running mean moves slowly (a tenth per decision), so a spike stands out.
        self.loss_mean = recent if previous is None else 0.9 * previous + 0.1 * recent
        return recent / previous if previous and previous > 0 else 1.0

    def _worker_inputs(self) -> dict[str, Any] | None:
        horizon = time.time() - self.spec.window
        with self.lock:
            recent = [r for r in self.reports if r[0] >= horizon]
        if not recent:
            return None
        per_rank: dict[int, list] = {}
        for r in recent:
            per_rank.setdefault(r[1], []).append(r)
        delay = {rank: sum(r[6] for r in rows) / max(1, sum(r[7] for r in rows)) for rank, rows in per_rank.items()}
        compute = [max(0.0, r[4] - r[5]) for r in recent]
        return {"delay_per_byte": max(delay.values()), "delay_per_byte_by_rank": {str(k): v for k, v in delay.items()},
                "compute_s": sum(compute) / len(compute)}

    def _reporting_ranks(self) -> set[str]:
        """The ranks that reported to this controller within the last window."""
        horizon = time.time() - self.spec.window
        with self.lock:
            return {str(r[1]) for r in self.reports if r[0] >= horizon}

    def _dense_bytes(self) -> float | None:
        with self.lock:
            return float(self.reports[-1][8]) if self.reports else None

    def _decide_once(self) -> bool:
        with self.lock:
            started = self.first_report
        # Until training has run for a window, rates have too few points to mean anything; a
        # policy that reads only the fitted model starts once it has a few steps.
        if started is None:
            return True
        if time.time() - started < self.spec.window:
            with self.lock:
                fitted = len(self.model.samples)
                early_steps = self._early_steps()
            if not self.policy.decides_early or fitted < early_steps:
                return True
            early = True
        else:
            early = False
        importance = self._importance()
        dense = self._dense_bytes()
        if self.source is not None and not early:
            try:
                inputs, source = self.source.inputs(), "prometheus"
            except SourceError as exc:
                self._hold(str(exc))
                return False
            missing = sorted(self._reporting_ranks() - set(inputs.get("delay_per_byte_by_rank", {})))
            if missing:
                # The slowest rank counts: a decision without some rank's series could be too lax.
                self._hold(f"Prometheus has no series yet for rank(s) {', '.join(missing)}")
                return False
        else:
            inputs, source = self._worker_inputs(), "workers"
            if inputs is None:
                return True
        if inputs["delay_per_byte"] <= 0:
            self._hold("delay per byte is 0: no bytes crossed the network yet")
            return False
        with self.lock:
            self._add_link_probe(time.time())
            self.model.fit(time.time())
            current = self.current.compression
            compression, explain = self.policy.decide(PolicyInputs(
                model=self.model, importance=importance, current=current, now=time.time(),
                delay_per_byte=inputs["delay_per_byte"], compute_s=inputs["compute_s"], dense_bytes=dense,
                efficiency=self.efficiency))
        # link_probe: whether the ranks' start-up transfer is among the link fit's points
        inputs = {**inputs, **explain, "dense_bytes": dense, "link_probe": self.link_probed}
        with self.lock:
            self.failures = 0
            seq = self.current.seq + (1 if compression != self.current.compression else 0)
            self.probing, self.probe_steps = (1.0 / compression if explain.get("probe") else None), 0
            self.current = Decision(seq, compression, source, time.time(), inputs)
            self.decisions.append(asdict(self.current))
        self.metrics.record(compression, explain.get("pressure"), importance, source)
        log.info("rayzip controller: compression %.1f from %s: %s", compression, source,
                 {k: v for k, v in inputs.items() if not isinstance(v, dict)})
        return True

    def _hold(self, reason: str) -> None:
        with self.lock:
            self.failures += 1
            entry = asdict(Decision(self.current.seq, self.current.compression, "held", time.time(), {"reason": reason}))
            self.decisions.append(entry)
        self.metrics.record(self.current.compression, None, None, "held")
        if not self.warned:
            self.warned = True
            log.warning("rayzip controller: Prometheus gave no usable answer (%s); holding compression %.1f and "
                        "retrying with backoff", reason, self.current.compression)


def _same_mode(density: float | None, kept: float) -> bool:
    """Whether a step at ``density`` (None: dense) ran at kept fraction ``kept`` (1.0: dense)."""
    if density is None:
        return kept >= 1.0
    return abs(density - kept) <= 1e-3 * kept


def start_controller(run_id: str, job: str, spec: AdaptiveSpec, initial_compression: float, **options):
    """The run's named controller actor; ``options``: more of the actor's options (where it
    runs)."""
    return AdaptiveController.options(name=controller_name(run_id), **options).remote(
        run_id, job, spec.model_dump(), initial_compression)
