"""The controller's cost model of a step and the policy that reads it (issue 22): pure
functions, fed synthetic timings whose latency, bandwidth and codec cost are known."""

from __future__ import annotations

import random

import pytest

from rayzip.adaptive import CostModelPolicy, PolicyInputs, PressurePolicy, StepModel, StepSample, fit_link
from rayzip.adaptive.model import RankStep, combine_ranks
from rayzip.spec import AdaptiveSpec

DENSE_BYTES = 17.4e6  # a 4.35M-parameter gradient's fp32 ring allreduce, 2 workers
MESSAGES = 12  # latency-bound sends per step


class Cluster:
    """Two workers on a link of ``bandwidth`` bytes/s and ``latency`` s per message, with a
    codec whose own time grows with density, and ``noise`` relative jitter."""

    def __init__(self, bandwidth: float, latency: float = 100e-6, compute_s: float = 0.05, noise: float = 0.03,
                 seed: int = 0):
        self.bandwidth, self.latency, self.compute_s, self.noise = bandwidth, latency, compute_s, noise
        self.rng = random.Random(seed)

    def jitter(self, x: float) -> float:
        return x * (1 + self.rng.uniform(-self.noise, self.noise))

    def step(self, compression: float, at: float) -> StepSample:
        density = None if compression == 1.0 else 1.0 / compression
        nbytes, codec = self.payload(density)
        return StepSample(messages=MESSAGES, bytes=nbytes,
                          network_s=self.jitter(MESSAGES * self.latency + nbytes / self.bandwidth),
                          codec_s=self.jitter(codec), compute_s=self.jitter(self.compute_s), density=density,
                          dense_bytes=DENSE_BYTES, at=at)

    @staticmethod
    def payload(density: float | None) -> tuple[float, float]:
        """Bytes (fp16 values + uint16 offsets against fp32) and codec seconds: top-k's
        selection reads the whole gradient (as measured here: tens of ms), and more with k."""
        if density is None:
            return DENSE_BYTES, 0.004
        return 64 + DENSE_BYTES * density, 0.030 + 0.6 * density

    def true_step_s(self, compression: float) -> float:
        nbytes, codec = self.payload(None if compression == 1.0 else 1.0 / compression)
        return self.compute_s + codec + MESSAGES * self.latency + nbytes / self.bandwidth


def run_controller(policy, links: list[tuple[Cluster, int]], start: float = 100.0, steps_per_decision: int = 20,
                   window_s: float = 10.0) -> list[float]:
    """Decisions, one per ``steps_per_decision`` steps (1 s of clock apart), on each cluster
    in turn for its number of decisions; returns the compression in force at each decision."""
    model, compression, t, compressions = StepModel(window_s=window_s), start, 0.0, []
    for cluster, decisions in links:
        for _ in range(decisions):
            for _ in range(steps_per_decision):
                t += 1.0 / steps_per_decision
                model.add(cluster.step(compression, t))
            model.fit(t)
            compression, _ = policy.decide(PolicyInputs(model=model, importance=1.0, current=compression, now=t))
            compressions.append(compression)
    return compressions


def model_at(cluster: Cluster, compression: float, steps: int = 40) -> StepModel:
    """A model fitted to ``steps`` steps at one compression, 0.1 s apart."""
    model = StepModel()
    for i in range(steps):
        model.add(cluster.step(compression, i * 0.1))
    model.fit()
    return model


def spec(**kw) -> AdaptiveSpec:
    return AdaptiveSpec(enabled=True, min_compression=4, max_compression=200, importance_weight=1.0, window=10.0, **kw)


def test_the_fit_recovers_known_latency_and_bandwidth_from_noisy_timings():
    rng = random.Random(1)
    alpha, beta = 200e-6, 1 / 12.5e6  # 200 us a message, 100 Mbit/s
    samples = []
    for i in range(200):
        messages, nbytes = rng.choice([2, 6, 12]), 10 ** rng.uniform(3, 7)
        t = (alpha * messages + beta * nbytes) * (1 + rng.uniform(-0.03, 0.03))
        samples.append(StepSample(messages, nbytes, t, 0.0, 0.05, 0.01, at=i))
    fit = fit_link(samples, alpha_prior=1e-3)
    assert fit.separable
    assert fit.alpha == pytest.approx(alpha, rel=0.1) and fit.beta == pytest.approx(beta, rel=0.02)
    # One payload size cannot separate the two: alpha stays at what was known, beta fits.
    same = [StepSample(12, 1e6, alpha * 12 + beta * 1e6, 0.0, 0.05, None, at=i) for i in range(20)]
    held = fit_link(same, alpha_prior=alpha)
    assert not held.separable and held.alpha == alpha and held.beta == pytest.approx(beta, rel=1e-9)


def test_a_straggler_is_read_as_compute_not_as_network():
    transfer, late = 0.005, 0.200  # rank 1 computes 200 ms longer; rank 0 waits for it in the collective
    fast = RankStep(step_s=0.055 + late, comm_s=transfer + late + 0.002, busy_s=transfer + late + 0.002,
                    network_s=transfer + late, bytes=DENSE_BYTES, messages=MESSAGES, dense_bytes=DENSE_BYTES,
                    density=None)
    slow = RankStep(step_s=0.055 + late, comm_s=transfer + 0.002, busy_s=transfer + 0.002, network_s=transfer,
                    bytes=DENSE_BYTES, messages=MESSAGES, dense_bytes=DENSE_BYTES, density=None)
    sample = combine_ranks([fast, slow])
    assert sample.network_s == transfer and sample.compute_s == pytest.approx(0.048 + late)

    def decide(reports, policy):
        model = StepModel()
        for i in range(40):
            model.add(combine_ranks(reports, at=i * 0.1))
        model.fit()
        delay_per_byte = max(r.network_s / r.bytes for r in reports)  # the slowest rank, as Prometheus reads it
        return policy.decide(PolicyInputs(model=model, importance=1.0, current=1.0, now=4.0,
                                          delay_per_byte=delay_per_byte, compute_s=0.05, dense_bytes=DENSE_BYTES))[0]

    punctual = RankStep(0.055, transfer + 0.002, transfer + 0.002, transfer, DENSE_BYTES, MESSAGES, DENSE_BYTES, None)
    # The cost model decides the same with and without the straggler: dense, on this fast link.
    assert decide([punctual, punctual], CostModelPolicy(spec())) == 1.0
    assert decide([fast, slow], CostModelPolicy(spec())) == 1.0
    # The first policy read the straggler's wait as a slow network and compressed.
    assert decide([punctual, punctual], PressurePolicy(spec(policy="pressure"))) == 1.0
    assert decide([fast, slow], PressurePolicy(spec(policy="pressure"))) > 1.0


def test_compression_goes_off_on_a_fast_link_and_stays_off():
    compressions = run_controller(CostModelPolicy(spec()), [(Cluster(bandwidth=1.25e9), 30)])  # 10 Gbit/s
    assert compressions[-1] == 1.0
    first_off = compressions.index(1.0)
    assert first_off <= 4, compressions  # a probe, then two verdicts
    assert all(r == 1.0 for r in compressions[first_off + 2:]), compressions  # no flapping


def test_a_slow_link_gets_the_compression_a_fixed_sweep_would_pick():
    cluster = Cluster(bandwidth=12.5e6)  # 100 Mbit/s
    compressions = run_controller(CostModelPolicy(spec()), [(cluster, 20)])
    best = min([1.0, 4, 8, 16, 32, 64, 100, 200], key=cluster.true_step_s)
    assert cluster.true_step_s(compressions[-1]) <= 1.1 * cluster.true_step_s(best), (compressions, best)
    assert len(set(compressions[-10:])) == 1, compressions  # settled
    # The first probe (an 8x larger payload) showed the bandwidth: dense was never tried.
    assert compressions[0] <= 200 / 8 and 1.0 not in compressions, compressions


def test_a_link_that_drops_is_followed_within_two_decisions():
    policy = CostModelPolicy(spec())
    compressions = run_controller(policy, [(Cluster(bandwidth=1.25e9), 15), (Cluster(bandwidth=12.5e6, seed=1), 10)])
    assert compressions[14] == 1.0  # dense on the fast link
    slow = Cluster(bandwidth=12.5e6)
    assert compressions[16] > 1.0 and slow.true_step_s(compressions[16]) <= 1.2 * min(slow.true_step_s(r) for r in (32, 64, 200))


def test_near_the_break_even_point_it_does_not_flap():
    # A link where dense and the best compression are within a few percent of each other.
    cluster = Cluster(bandwidth=0.55e9, noise=0.05, seed=3)
    compressions = run_controller(CostModelPolicy(spec()), [(cluster, 40)])
    flips = sum(1 for a, b in zip(compressions, compressions[1:]) if (a == 1.0) != (b == 1.0))
    assert flips <= 3, compressions  # the probe out and back, and at most one real switch


def test_important_batches_cap_the_compression():
    # Dense and two compressions measured recently on a slow link: decisions, not probes. A calm
    # batch keeps the most compression; a batch 4x as important is capped at 200 / 4, which
    # on this link is the fastest compression the cap allows.
    cluster = Cluster(bandwidth=12.5e6)
    model = StepModel()
    for i in range(60):
        model.add(cluster.step((1.0, 25.0, 200.0)[i % 3], i * 0.1))
    model.fit()
    calm, calm_explain = CostModelPolicy(spec()).decide(PolicyInputs(model=model, importance=1.0, current=200.0,
                                                                     now=6.0))
    important, explain = CostModelPolicy(spec()).decide(PolicyInputs(model=model, importance=4.0, current=200.0,
                                                                     now=6.0))
    assert not calm_explain["probe"] and not explain["probe"], (calm_explain, explain)
    assert calm == 200.0 and explain["cap"] == 50.0 and important == 50.0, (calm, important)


def test_the_importance_cap_lowers_the_compression_but_never_switches_compression_off():
    # On a fast link dense may look fastest by extrapolation; a binding cap still only lowers
    # the compression (a switch off goes through hysteresis and a measured dense step).
    model = model_at(Cluster(bandwidth=1.25e9), 200.0)
    policy = CostModelPolicy(spec())
    compression, explain = policy.decide(PolicyInputs(model=model, importance=2.0, current=200.0, now=4.0))
    assert 1.0 < compression <= explain["cap"] == 100.0, (compression, explain)
    # A cap within 5% of the compression in force forces nothing: the usual rules run, and with
    # nothing but these small payloads measured they probe a larger one first.
    policy = CostModelPolicy(spec())
    compression, explain = policy.decide(PolicyInputs(model=model, importance=1.01, current=200.0, now=4.0))
    assert explain["probe"] and compression == 200 / 8, (compression, explain)


def test_policy_is_pluggable_by_import_path():
    from rayzip.adaptive import make_policy

    assert isinstance(make_policy(spec(policy="pressure")), PressurePolicy)
    assert isinstance(make_policy(spec(policy="rayzip.adaptive.policy:CostModelPolicy")), CostModelPolicy)
    with pytest.raises(ValueError, match="unknown adaptive policy"):
        spec(policy="fastest")


@pytest.mark.parametrize("bandwidth, dense_first", [(1.25e9, True), (12.5e6, False)])
def test_the_start_up_broadcast_separates_latency_from_bandwidth_before_any_probe(bandwidth, dense_first):
    # DDP's broadcast of the model at start (rayzip.train.probe), timed: a dense-sized payload.
    cluster = Cluster(bandwidth=bandwidth)
    model, policy = StepModel(), CostModelPolicy(spec())
    model.add_link(messages=1, nbytes=DENSE_BYTES / 2, seconds=cluster.latency + DENSE_BYTES / 2 / bandwidth, at=0.0)
    for i in range(3):  # the three compressed steps the controller waits for
        model.add(cluster.step(200.0, 0.1 * (i + 1)))
    model.fit()
    assert model.alpha_known and model.link.beta == pytest.approx(1 / bandwidth, rel=0.1)
    compression, explain = policy.decide(PolicyInputs(model=model, importance=1.0, current=200.0, now=0.3))
    # No payload probe: on a fast link the first decision measures dense at once; on a slow
    # one it keeps compressing and never tries dense.
    assert compression == 1.0 if dense_first else (compression > 1.0 and not explain["probe"]), (compression, explain)
    # The broadcast is a link sample only: no dense step to predict from, no compute of 0.
    assert not model.dense and model.compute_s() == pytest.approx(cluster.compute_s, rel=0.05)


@pytest.mark.parametrize("bandwidth, dense_first", [(1.25e9, True), (12.5e6, False)])
def test_the_start_decision_reads_the_dry_step_and_the_start_up_broadcast(bandwidth, dense_first):
    # Before the first step: the broadcast of the model, and one dry compressed exchange with
    # the compute probe's time (rayzip.train.Telemetry.start), are all the model has.
    cluster = Cluster(bandwidth=bandwidth)
    model, policy = StepModel(), CostModelPolicy(spec())
    model.add_link(messages=1, nbytes=DENSE_BYTES / 2, seconds=cluster.latency + DENSE_BYTES / 2 / bandwidth, at=0.0)
    model.add(cluster.step(100.0, 0.0))
    model.fit(0.0)
    compression, explain = policy.start(PolicyInputs(model=model, importance=1.0, current=100.0, now=0.0))
    best = min([1.0, 4, 8, 16, 32, 64, 100, 200], key=cluster.true_step_s)
    if dense_first:  # a dense probe: the next decision, after its steps, confirms it
        assert compression == 1.0 == best and explain["probe"], (compression, explain)
        for i in range(3):
            model.add(cluster.step(1.0, 0.1 * (i + 1)))
        model.fit(0.3)
        decided, _ = policy.decide(PolicyInputs(model=model, importance=1.0, current=1.0, now=0.3))
        assert decided == 1.0
    else:  # compressing from step 0 at a compression near the best, with no probe
        assert compression >= 100.0 and not explain["probe"], (compression, explain)  # no less than the dry step's
        assert cluster.true_step_s(compression) <= 1.1 * cluster.true_step_s(best), (compression, best)


def test_a_run_kept_dense_by_a_slow_dry_step_probes_compression_and_takes_it():
    # 1 Gbit/s, where compressing is about twice as fast as dense, but the only compressed
    # step measured (the dry step before the first) took 300 ms of codec time: the start is
    # dense. After probe_every (30 s here) without a compressed step, the controller measures
    # the fastest compression, and compresses.
    cluster = Cluster(bandwidth=125e6)
    assert cluster.true_step_s(100.0) < 0.6 * cluster.true_step_s(1.0)
    model, policy = StepModel(), CostModelPolicy(spec(probe_every=30.0))
    slow = cluster.step(100.0, 0.0)
    model.add(StepSample(slow.messages, slow.bytes, slow.network_s, 0.3, slow.compute_s, slow.density,
                         dense_bytes=DENSE_BYTES, at=0.0))
    compression, t, compressions = 1.0, 0.0, []
    for _ in range(60):  # a decision a second
        for _ in range(10):
            t += 0.1
            model.add(cluster.step(compression, t))
        model.fit(t)
        compression, _ = policy.decide(PolicyInputs(model=model, importance=1.0, current=compression, now=t))
        compressions.append(compression)
    first = next(i for i, r in enumerate(compressions) if r != 1.0)
    assert 28 <= first <= 31, compressions  # dense until the probe is due
    assert compressions[-1] > 1.0 and all(r > 1.0 for r in compressions[first + 2:]), compressions
