"""Local steps (issue 23): the spec's rules, the tuner of H, and the benchmark's methods."""

from __future__ import annotations

import pytest

from rayzip.adaptive.every import EveryTuner, choose_every
from rayzip.spec import SpecError, parse_spec


def _spec(**sections):
    return {"name": "t", **sections}


@pytest.mark.parametrize("sections, field", [
    ({"local_steps": {"enabled": True, "every": 4}, "training": {"eval_every": 10}}, "training.eval_every"),
    ({"local_steps": {"enabled": True, "every": 5}, "checkpoint": {"every_steps": 12}, "training": {"eval_every": 5}},
     "checkpoint.every_steps"),
    ({"local_steps": {"enabled": True, "every": 5, "adaptive": True}, "compression": {"collective": "ps"}},
     "collective ps"),
    ({"local_steps": {"enabled": True, "every": 0}}, "local_steps.every"),
    ({"local_steps": {"enabled": True, "every": 10, "adaptive": True, "min_every": 20}}, "local_steps.every"),
    ({"local_steps": {"enabled": True, "every": 10}, "training": {"eval_every": 10}, "checkpoint": {"every_steps": 10},
      "adaptive": {"enabled": True}, "compression": {"codec": "group_topk", "density": 0.01}}, "local_steps.adaptive"),
    ({"local_steps": {"enabled": True, "every": 5, "overlap": True}, "compression": {"collective": "ps"},
      "training": {"eval_every": 5}, "checkpoint": {"every_steps": 5}}, "local_steps.overlap"),
    ({"local_steps": {"enabled": True, "every": 1, "keep_unsent": True, "overlap": True}}, "local_steps.keep_unsent"),
    ({"local_steps": {"enabled": True, "every": 1, "keep_unsent": True},
      "compression": {"codec": "group_topk", "density": 0.01, "error_feedback": False}}, "local_steps.keep_unsent"),
])
def test_the_spec_refuses_what_local_steps_cannot_do(sections, field):
    with pytest.raises(SpecError) as info:
        parse_spec(_spec(**sections))
    assert field in str(info.value), str(info.value)


def test_a_valid_local_steps_spec_parses():
    spec = parse_spec(_spec(local_steps={"enabled": True, "every": 10}, training={"eval_every": 50},
                            checkpoint={"every_steps": 100}, compression={"codec": "group_topk", "density": 0.01}))
    assert spec.local_steps.every == 10 and spec.local_steps.nesterov
    # A tuned H puts no rule on the evaluation and checkpoint steps: they force synchronizations.
    tuned = parse_spec(_spec(local_steps={"enabled": True, "every": 10, "adaptive": True}, training={"eval_every": 7},
                             checkpoint={"every_steps": 13}))
    assert tuned.local_steps.adaptive and tuned.local_steps.max_every == 100


@pytest.mark.parametrize("sync_s, compute_s", [(2.0, 0.9), (23.0, 1.2), (0.02, 1.2), (0.5, 0.001), (1.0, 0.0),
                                               (0.0, 1.0)])
@pytest.mark.parametrize("low, high, slack", [(1, 100, 0.1), (5, 50, 0.03), (1, 1, 0.1), (1, 200, 0.0)])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_tuned_h_is_the_smallest_within_slack_of_the_fastest(sync_s, compute_s, low, high, slack, overlap):
    every = choose_every(sync_s, compute_s, low, high, slack, overlap)
    assert low <= every <= high

    def step(h):  # with overlap a round's synchronization runs during the next round's compute
        return max(compute_s, sync_s / h) if overlap else compute_s + sync_s / h

    fastest = step(high)
    assert every == high or step(every) <= (1 + slack) * fastest * (1 + 1e-12)
    assert every == low or step(every - 1) > (1 + slack) * fastest  # one fewer is too slow


def test_the_tuner_takes_medians_and_its_state_round_trips():
    tuner = EveryTuner(1, 100, 0.1)
    assert tuner.observe(2.0, 0.9) == tuner.observe(2.0, 0.9) == 18
    assert tuner.observe(60.0, 0.9) == 18  # one slow round alone: the median is still 2.0 s
    assert tuner.observe(3.0, 0.9) == choose_every(3.0, 0.9, 1, 100, 0.1)
    again = EveryTuner(1, 100, 0.1)
    again.load_state_dict(tuner.state_dict())
    assert again.observe(0.1, 0.9) == tuner.observe(0.1, 0.9)
    # The H in force is kept while fast enough and at most a quarter above the choice.
    steady = EveryTuner(1, 100, 0.1)
    assert steady.observe(2.0, 0.9, current=20) == 20 and steady.observe(2.0, 0.9, current=23) == 23
    assert steady.observe(2.0, 0.9, current=24) == 18 and steady.observe(2.0, 0.9, current=17) == 18


def test_bench_methods_name_the_local_steps():
    from rayzip.bench.cluster import method_spec

    base = {"name": "b", "training": {"eval_every": 10, "optimizer": "sgd", "momentum": 0.9},
            "checkpoint": {"every_steps": 0}}
    spec = parse_spec(method_spec("local_gtopk@50", base, "x"))
    assert spec.local_steps.enabled and spec.local_steps.every == 50
    assert spec.training.eval_every == 50 and spec.checkpoint.every_steps == 0  # rounded up to a multiple of H
    assert spec.compression.codec == "group_topk" and not spec.compression.momentum_correction
    assert parse_spec(method_spec("local", base, "x")).local_steps.every == 10
    tuned = parse_spec(method_spec("local_gtopk@auto", base, "x"))
    assert tuned.local_steps.adaptive and tuned.local_steps.max_every == tuned.training.eval_every == 50
    with pytest.raises(ValueError, match="not a number of local steps"):
        method_spec("local@ten", base, "x")
    assert not spec.local_steps.overlap
    # :overlap, and the base spec's outer optimizer, which every local method keeps
    outer = {**base, "local_steps": {"outer_lr": 1.0, "outer_momentum": 0.0}}
    overlapped = parse_spec(method_spec("local_gtopk@4:overlap", outer, "x"))
    assert overlapped.local_steps.overlap and overlapped.local_steps.every == 4
    assert (overlapped.local_steps.outer_lr, overlapped.local_steps.outer_momentum) == (1.0, 0.0)
    assert not parse_spec(method_spec("dense", outer, "x")).local_steps.enabled
    with pytest.raises(ValueError, match="local steps :overlap"):
        method_spec("group_topk:overlap", base, "x")
    step = parse_spec(method_spec("sparseloco_step", outer, "x"))
    assert step.local_steps.every == 1 and step.local_steps.keep_unsent
    assert (step.compression.density, step.compression.combine) == (0.01, "senders")
    assert not parse_spec(method_spec("local_sparseloco", outer, "x")).local_steps.keep_unsent
    compact = parse_spec(method_spec("local_compact@4", outer, "x")).compression
    assert (compact.codec, compact.density, compact.value_dtype, compact.packed_indices) == ("group_topk", 0.02, "int8", True)
    assert compact.collective == "allgather" and not compact.adam_correction
