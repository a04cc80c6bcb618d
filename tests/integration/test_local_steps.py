"""Local steps with compressed outer updates (issue 23): real gloo ranks, real DDP as the
reference, restarts and resizes."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.adaptive.every import EveryTuner, choose_every
from rayzip.codecs import NonFiniteError, get_codec
from rayzip.comm import ring_allreduce_bytes
from rayzip.comm.control import control_nbytes
from rayzip.spec import parse_spec
from rayzip.torch import CompressionConfig
from rayzip.torch.local_steps import LocalSteps


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _flat(model) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()


def _batch(gen):
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _train_step(model, optimizer, gen) -> None:
    optimizer.zero_grad()
    x, y = _batch(gen)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _ddp_rank(rank, world, steps):
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer, gen = _sgd(ddp.parameters()), torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = _batch(gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return _flat(ddp.module)


def _local_rank(rank, world, steps, every, codec="none", outer=(1.0, 0.0), nan_at=None, policy="raise",
                restart_at=None):
    """Train with LocalSteps; returns (params after each step, bytes sent per step). With
    ``restart_at`` everything is rebuilt from state dicts before that step (a restart)."""
    def build():
        model = _model()
        comp = CompressionConfig(codec=codec, **({"density": 0.05, "collective": "allgather"} if codec == "group_topk"
                                               else {}))
        local = LocalSteps(model.named_parameters(), every=every, outer_lr=outer[0], outer_momentum=outer[1],
                           compression=comp, on_nonfinite=policy)
        return model, local, _sgd(model.parameters())

    model, local, optimizer = build()
    gen = torch.Generator().manual_seed(rank)
    params, sent = [], []
    for step in range(steps):
        if step == restart_at:
            # Inside a round (a snapshot's restart): this rank's own parameters and the round.
            mid = local.mid_round
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict(),
                     local.round_state_dict() if mid else local.state_dict())
            model, local, optimizer = build()
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            (local.load_round_state_dict if mid else local.load_state_dict)(saved[2])
        optimizer.zero_grad()
        x, y = _batch(gen)
        if nan_at == (rank, step):
            x[0, 0] = float("nan")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before = local.state.totals["bytes_sent"]
        try:
            if local.gradient_ok(step):
                optimizer.step()
            local.after_inner_step(force=step == steps - 1)
        except NonFiniteError as exc:
            return "raised", step, str(exc)
        params.append(_flat(model))
        sent.append(local.state.totals["bytes_sent"] - before)
    return params, sent


def test_one_local_step_with_a_plain_outer_sgd_is_ddp():
    steps = 6
    ddp = run_world(_ddp_rank, 2, steps)
    local = run_world(_local_rank, 2, steps, 1)
    np.testing.assert_array_equal(ddp[0], ddp[1])
    for rank in range(2):
        # SGD with momentum and weight decay inside: both linear, so the mean of the ranks'
        # steps is DDP's step; float rounding of the different sums is all that differs.
        np.testing.assert_allclose(local[rank][0][-1], ddp[0], rtol=0, atol=1e-6)


def test_ranks_exchange_only_at_synchronizations_and_agree_there():
    steps, every = 8, 4
    numel = sum(p.numel() for p in _model().parameters())
    results = run_world(_local_rank, 2, steps, every, "group_topk", (0.7, 0.9))
    codec = get_codec("group_topk", density=0.05)
    for step in range(steps):
        synced = (step + 1) % every == 0
        for rank in range(2):
            params, sent = results[rank]
            if not synced:
                assert sent[step] == 0, (rank, step)
        if synced:
            np.testing.assert_array_equal(results[0][0][step], results[1][0][step])
            # the codec's payload to the one other rank, plus the control word's all-reduce
            assert results[0][1][step] == codec.wire_nbytes(numel) + control_nbytes(2), step
        else:
            assert not np.array_equal(results[0][0][step], results[1][0][step]), step  # each its own steps


def test_a_restart_at_a_synchronization_resumes_exactly():
    steps, every = 9, 3
    straight = run_world(_local_rank, 2, steps, every, "group_topk", (0.7, 0.9))
    restarted = run_world(_local_rank, 2, steps, every, "group_topk", (0.7, 0.9), None, "raise", 6)
    for rank in range(2):
        np.testing.assert_array_equal(straight[rank][0][-1], restarted[rank][0][-1])


def test_a_restart_inside_a_round_resumes_exactly():
    steps, every = 9, 3
    straight = run_world(_local_rank, 2, steps, every, "group_topk", (0.7, 0.9))
    restarted = run_world(_local_rank, 2, steps, every, "group_topk", (0.7, 0.9), None, "raise", 7)  # inner step 2 of 3
    for rank in range(2):
        for step in range(7, steps):
            np.testing.assert_array_equal(straight[rank][0][step], restarted[rank][0][step])


def test_a_nan_on_one_rank_stops_every_rank_at_the_next_synchronization():
    results = run_world(_local_rank, 2, 8, 4, "group_topk", (0.7, 0.9), (1, 1), "raise")
    for rank in range(2):
        assert results[rank][:2] == ("raised", 3), results[rank]
        assert "rank 1" in results[rank][2] and "0.weight" in results[rank][2], results[rank][2]


def test_a_nan_under_skip_drops_the_round_on_every_rank():
    spoiled = run_world(_local_rank, 2, 8, 4, "group_topk", (0.7, 0.9), (1, 1), "skip")
    initial = _flat(_model())
    for rank in range(2):
        params, _ = spoiled[rank]
        assert not np.array_equal(params[2], initial)  # the round's inner steps moved this rank
        np.testing.assert_array_equal(params[3], initial)  # the round dropped: back where it began
        assert np.isfinite(params[-1]).all() and not np.array_equal(params[-1], initial)  # the next round counted
    np.testing.assert_array_equal(spoiled[0][0][-1], spoiled[1][0][-1])


def _overlap_rank(rank, world, steps, every, nan_at=None, policy="raise"):
    """LocalSteps with overlap (no codec, outer SGD at learning rate 1): parameters after
    each step and the bytes of the rounds that landed at it, or ("raised", step, message)."""
    model = _model()
    local = LocalSteps(model.named_parameters(), every=every, outer_lr=1.0, outer_momentum=0.0,
                       compression=CompressionConfig(), on_nonfinite=policy, overlap=True)
    optimizer, gen = _sgd(model.parameters()), torch.Generator().manual_seed(rank)
    params, sent = [], []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(gen)
        if nan_at == (rank, step):
            x[0, 0] = float("nan")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        try:
            if local.gradient_ok(step):
                optimizer.step()
            synced = local.after_inner_step(force=step == steps - 1)
        except NonFiniteError as exc:
            return "raised", step, str(exc)
        landed = local.last_sync if synced else None  # the rounds that landed at this step
        sent.append(landed.bytes_sent if landed is not None else 0)
        params.append(_flat(model))
    assert local.state_dict()["rounds"] == -(-steps // every)  # every round landed
    return params, sent


def _overlap_reference(world, steps, every):
    """Delayed averaging in one process, as the overlap's rule states it: at each
    synchronization a rank sends its round's progress, the previous round's mean lands on
    the synchronized parameters, and the rank goes on from them minus its own progress; the
    last step lands everything."""
    models = [_model() for _ in range(world)]
    optimizers = [_sgd(m.parameters()) for m in models]
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    synced = torch.nn.utils.parameters_to_vector(models[0].parameters()).detach().clone()
    bases = [synced.clone() for _ in range(world)]
    pending = None
    for step in range(steps):
        for model, optimizer, gen in zip(models, optimizers, gens):
            optimizer.zero_grad()
            x, y = _batch(gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        last = step == steps - 1
        if (step + 1) % every and not last:
            continue
        deltas = [base - torch.nn.utils.parameters_to_vector(m.parameters()).detach()
                  for base, m in zip(bases, models)]
        if pending is not None:
            synced -= torch.stack(pending).mean(0)
        if last:
            synced -= torch.stack(deltas).mean(0)
            bases = [synced.clone() for _ in range(world)]
        else:
            pending, bases = deltas, [synced - d for d in deltas]
        for base, model in zip(bases, models):
            torch.nn.utils.vector_to_parameters(base.clone(), model.parameters())
    return [_flat(m) for m in models]


def test_with_overlap_a_round_lands_one_round_late_and_the_last_step_lands_all():
    steps, every, world = 10, 3, 2
    numel = sum(p.numel() for p in _model().parameters())
    results = run_world(_overlap_rank, world, steps, every)
    expected = _overlap_reference(world, steps, every)
    for rank in range(world):
        params, sent = results[rank]
        np.testing.assert_allclose(params[-1], expected[rank], rtol=0, atol=1e-5)
        for step in range(steps):
            # A round lands at the next synchronization (the first has none to land); the
            # last step lands the round in flight and its own.
            rounds = 2 if step == steps - 1 else int((step + 1) % every == 0 and step + 1 > every)
            assert sent[step] == rounds * (ring_allreduce_bytes(4 * numel, world) + control_nbytes(world)), step
    np.testing.assert_array_equal(results[0][0][-1], results[1][0][-1])  # the last step lands everything
    # In between, each rank goes on from the synchronized parameters plus its own progress.
    assert not np.array_equal(results[0][0][every - 1], results[1][0][every - 1])


def test_with_overlap_a_nan_stops_every_rank_when_its_round_lands():
    results = run_world(_overlap_rank, 2, 10, 3, (1, 1), "raise")
    for rank in range(2):
        assert results[rank][:2] == ("raised", 5), results[rank]  # sent at step 2, landed at step 5
        assert "rank 1" in results[rank][2] and "0.weight" in results[rank][2], results[rank][2]
    skipped = run_world(_overlap_rank, 2, 10, 3, (1, 1), "skip")
    for rank in range(2):
        assert np.isfinite(skipped[rank][0][-1]).all()
    np.testing.assert_array_equal(skipped[0][0][-1], skipped[1][0][-1])


def _tuned_rank(rank, world, steps, sync_delay_s, straggler_s):
    """LocalSteps with a tuner (H from 2 within 1 .. 16). ``sync_delay_s``: every rank's
    synchronization is that much slower (a slow link); ``straggler_s``: rank 1 computes that
    much longer each step. Each step's compute is given to the tuner (5 ms, plus the straggler's
    sleep), so that only the synchronizations are timed here, for real.
    Returns (synced, H, bytes sent) per step, and the changes."""
    model = _model()
    local = LocalSteps(model.named_parameters(), every=2, outer_lr=0.7, outer_momentum=0.5,
                       compression=CompressionConfig(), tuner=EveryTuner(1, 16, 0.1))
    average = local.state.average

    def slow_link(grad):
        time.sleep(sync_delay_s)
        return average(grad)

    local.state.average = slow_link
    optimizer, gen = _sgd(model.parameters()), torch.Generator().manual_seed(rank)
    trace = []
    for step in range(steps):
        _train_step(model, optimizer, gen)
        if rank == 1:
            time.sleep(straggler_s)
        before = local.state.totals["bytes_sent"]
        synced = local.after_inner_step(force=step == steps - 1,
                                        compute_s=0.005 + (straggler_s if rank == 1 else 0.0))
        trace.append((synced, local.every, local.state.totals["bytes_sent"] - before))
    return trace, local.changes, _flat(model)


def test_every_rank_tunes_h_alike_from_the_synchronization_time():
    steps = 60
    numel = sum(p.numel() for p in _model().parameters())
    dense = ring_allreduce_bytes(4 * numel, 2)
    # A slow link: 0.5 s a synchronization against 5 ms of compute, so H climbs to the bound
    # (15: within 10% of H = 16's step); every rank takes each H at the same step.
    slow = run_world(_tuned_rank, 2, steps, 0.5, 0.0)
    assert slow[0][0] == slow[1][0] and slow[0][1] == slow[1][1]
    trace, changes, _ = slow[0]
    assert changes and trace[-1][1] >= 14, changes
    np.testing.assert_array_equal(slow[0][2], slow[1][2])
    for synced, _, sent in trace:  # the payload, the control word and the tuner's 16-byte word
        assert sent == (dense + control_nbytes(2) + ring_allreduce_bytes(16, 2) if synced else 0)
    # A fast link with a straggler: rank 0 waits 0.1 s a step for rank 1 at every
    # synchronization, which is not the link's time (the tuner takes the shortest). Taken
    # for the link's, that wait would raise H to choose_every(0.1, 0.105, ...); the wire's
    # own time (a few ms, more on a loaded machine) keeps H below it.
    fast = run_world(_tuned_rank, 2, 20, 0.0, 0.1)
    assert fast[0][0] == fast[1][0]
    assert fast[0][0][-1][1] < choose_every(0.1, 0.105, 1, 16, 0.1), fast[0][1]


def test_a_tuned_h_and_its_measurements_come_back_from_a_checkpoint():
    model = _model()
    local = LocalSteps(model.named_parameters(), every=3, tuner=EveryTuner(2, 40, 0.1))
    for _ in range(7):
        local.after_inner_step(compute_s=0.001)
    local.after_inner_step(force=True, compute_s=0.001)
    saved = local.state_dict()
    again = LocalSteps(model.named_parameters(), every=3, tuner=EveryTuner(2, 40, 0.1))
    again.load_state_dict(saved)
    assert again.every == local.every and again.tuner.state_dict() == local.tuner.state_dict()
    fixed = LocalSteps(model.named_parameters(), every=5)
    fixed.load_state_dict(saved)
    assert fixed.every == 5  # a fixed H is this run's, not the checkpoint's


def _spec(**sections):
    return {"name": "t", **sections}


def _local_exchange(rank, world, combine="mean"):
    from rayzip.train.exchange import LocalStepsExchange

    spec = parse_spec(_spec(local_steps={"enabled": True, "every": 2}, training={"eval_every": 2},
                            checkpoint={"every_steps": 2},
                            compression={"codec": "group_topk", "density": 0.05, "collective": "allgather",
                                         "combine": combine}))
    model = _model()
    local = LocalSteps(model.named_parameters(), every=2, compression=spec.compression)
    return LocalStepsExchange(spec, model, rank, world, _sgd(model.parameters()), local)


def _save_local_rank(rank, world, directory, combine="mean"):
    from rayzip.train.loop import save_step
    from rayzip.train.records import Totals

    exchange = _local_exchange(rank, world, combine)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        exchange.begin_step(step, last=False)
        exchange.optimizer.zero_grad()
        x, y = _batch(gen)
        torch.nn.functional.cross_entropy(exchange.model(x), y).backward()
        exchange.apply(step, 0.1, exchange.skipped(step))
    save_step(Path(directory), rank, world, 3, exchange.weights, exchange.state, Totals(), {}, None)
    memory = exchange.local.state.memory.state_dict()
    return ({k: np.asarray(v).copy() for k, v in memory.items()}, _flat(exchange.model),
            exchange.optimizer.state_dict()["state"][0]["momentum_buffer"].numpy().copy(),
            exchange.local.outer.state_dict()["state"][0]["momentum_buffer"].numpy().copy())


def _restore_local_rank(rank, world, directory, combine="mean"):
    import ray.train

    exchange = _local_exchange(rank, world, combine)
    start, _ = exchange.restore(ray.train.Checkpoint.from_directory(directory))
    memory = {k: np.asarray(v).copy() for k, v in exchange.local.state.memory.state_dict().items()}
    restored = (start, memory, _flat(exchange.model),
                exchange.optimizer.state_dict()["state"][0]["momentum_buffer"].numpy().copy(),
                exchange.local.outer.state_dict()["state"][0]["momentum_buffer"].numpy().copy())
    exchange.local.synchronize()  # every rank at the same exchange: no RankDisagreement
    return restored


@pytest.mark.parametrize("old, new", [(3, 2)])  # one direction, for CI time (2 -> 3 passes as well)
def test_a_resize_keeps_the_synchronized_model_the_outer_optimizer_and_pending_error_feedback(old, new):
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        saved = run_world(_save_local_rank, old, directory, timeout_s=60)
        restored = run_world(_restore_local_rank, new, directory, timeout_s=60)
    for rank, (start, _, params, inner, outer) in enumerate(restored):
        assert start == 4
        np.testing.assert_array_equal(params, saved[0][1])  # the synchronized model
        np.testing.assert_array_equal(outer, saved[0][3])  # the outer optimizer, the same on every rank
        np.testing.assert_array_equal(inner, saved[rank % old][2])  # old rank r mod old's inner optimizer
    for key in saved[0][0]:
        before = np.mean([s[0][key] for s in saved], axis=0)
        after = np.sum([r[1][key] for r in restored if key in r[1]], axis=0) / new
        assert np.abs(before).max() > 0  # there was something pending to keep
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combine", ["mean", "senders"])
def test_a_rank_whose_part_was_lost_resumes_local_steps_from_the_survivors_state(combine):
    """A restore without rank 1's part (lost with its node's keeper): rank 1 takes rank 0's
    inner optimizer and rank 0 keeps its own state. Under ``combine: mean`` rank 1's error
    feedback is estimated as the survivors' mean (here rank 0's), so that the pending mean is
    rank 0's rather than half of it; under ``senders`` (an entry sent by one worker alone is
    applied whole) it starts empty, so that rank 1's entries are not spent on rank 0's."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        saved = run_world(_save_local_rank, 2, directory, combine, timeout_s=60)
        shutil.rmtree(Path(directory) / "rank1")
        restored = run_world(_restore_local_rank, 2, directory, combine, timeout_s=60)
    survivor = saved[0][0]
    assert survivor and max(np.abs(v).max() for v in survivor.values()) > 0  # something pending
    for rank, (start, memory, params, inner, outer) in enumerate(restored):
        assert start == 4
        np.testing.assert_array_equal(params, saved[0][1])
        np.testing.assert_array_equal(inner, saved[0][2])
        np.testing.assert_array_equal(outer, saved[0][3])
        if rank == 1 and combine == "senders":
            assert all(not np.any(v) for v in memory.values()), memory
            continue
        assert set(memory) == set(survivor)
        for key in survivor:
            np.testing.assert_array_equal(memory[key], survivor[key])


def test_a_lost_rank_under_senders_resumes_with_its_copy_from_another_node():
    """Rank 1's part lost, its partial copy kept (a snapshot's restore writes it beside the
    survivors' parts): rank 1 resumes with that copy's entries as its error feedback, rank 0
    with its own."""
    import shutil
    import tempfile

    from rayzip.checkpoint import save as save_checkpoint
    from rayzip.train.checkpoints import COPIED
    from rayzip.train.residual_copy import pack_residuals, unpack_residuals

    with tempfile.TemporaryDirectory() as directory:
        saved = run_world(_save_local_rank, 2, directory, "senders", timeout_s=60)
        shutil.rmtree(Path(directory) / "rank1")
        copy = unpack_residuals(pack_residuals(saved[1][0], 0.1))
        save_checkpoint(Path(directory) / f"{COPIED}1", {"memory": copy})
        restored = run_world(_restore_local_rank, 2, directory, "senders", timeout_s=60)
    assert any(np.any(v) for v in copy.values()) and any(np.any(v != 0) for v in saved[1][0].values())
    for rank, expected in ((0, saved[0][0]), (1, copy)):
        memory = restored[rank][1]
        assert set(memory) == set(expected)
        for key in expected:
            np.testing.assert_array_equal(memory[key], expected[key])


SPARSELOCO = CompressionConfig(codec="group_topk", density=0.05, value_dtype="2bit", coded_indices=True,
                               error_decay=0.95, combine="senders")


def _sparseloco_rank(rank, world, steps, every):
    """Local steps with SparseLoCo's outer updates: at each synchronization, the anchor
    before and after, this rank's pseudo-gradient, and its residuals before and after."""
    model = _model()
    local = LocalSteps(model.named_parameters(), every=every, outer_lr=1.0, outer_momentum=0.0,
                       compression=SPARSELOCO)
    optimizer, gen = _sgd(model.parameters()), torch.Generator().manual_seed(rank)
    memory, names = local.state.memory, local.state.segment_names

    def residual():
        return np.concatenate([np.asarray(memory.residuals[n]).copy() if n in memory.residuals
                               else np.zeros(hi - lo, np.float32)
                               for n, (lo, hi) in zip(names, local.state.segments)])

    rounds = []
    for _ in range(steps):
        _train_step(model, optimizer, gen)
        if local.inner + 1 == local.every:  # this step synchronizes
            anchor = torch.cat([a.reshape(-1) for a in local.anchor]).numpy().copy()
            delta, before = local.pseudo_gradient().numpy().copy(), residual()
        if local.after_inner_step():
            after = torch.cat([a.reshape(-1) for a in local.anchor]).numpy().copy()
            rounds.append((anchor, after, delta, before, residual(), _flat(model)))
    return rounds


def test_sparselocos_outer_update_averages_each_entry_over_its_senders_with_fading_residuals():
    rounds = run_world(_sparseloco_rank, 2, 8, 2)
    assert len(rounds[0]) == 4
    for k, ((anchor, after, _, _, _, model0), (anchor1, after1, _, _, _, model1)) in enumerate(zip(*rounds)):
        np.testing.assert_array_equal(after, after1)  # every replica applies the same update
        np.testing.assert_array_equal(model0, model1)
        np.testing.assert_array_equal(anchor, anchor1)
        # What each rank sent: decay x its residual plus its pseudo-gradient, less what it keeps.
        sent = [before * np.float32(0.95) + delta - kept for _, _, delta, before, kept, _ in
                (rounds[r][k] for r in range(2))]
        senders = sum((s != 0).astype(np.float32) for s in sent)
        assert (senders == 1).any() and (senders == 2).any()
        expected = anchor - sum(sent) / np.maximum(senders, 1)  # outer SGD at lr 1, no momentum
        np.testing.assert_allclose(after, expected, rtol=0, atol=1e-6)
        if k:  # the residual fades: what was held and not sent is carried at 0.95
            _, _, delta, before, kept, _ = rounds[0][k]
            unsent = sent[0] == 0
            np.testing.assert_array_equal(kept[unsent], (before * np.float32(0.95) + delta)[unsent])


def _kept_rank(rank, world, steps, keep, fixed=True, restart_at=None):
    """H = 1 with SparseLoCo's outer updates, with or without keep_unsent. ``fixed``: each
    inner step subtracts this rank's own random update, whatever the parameters (else a
    real SGD step). Per step: the synchronized parameters, this rank's parameters and its
    residual. With ``restart_at`` everything is rebuilt from state dicts before that step."""
    def build():
        model = _model()
        local = LocalSteps(model.named_parameters(), every=1, outer_lr=1.0, outer_momentum=0.0,
                           compression=SPARSELOCO, keep_unsent=keep)
        return model, local, _sgd(model.parameters())

    model, local, optimizer = build()
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(steps):
        if step == restart_at:
            assert local.own_parameters == keep
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict(),
                     local.round_state_dict() if local.own_parameters else local.state_dict())
            model, local, optimizer = build()
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            (local.load_round_state_dict if keep else local.load_state_dict)(saved[2])
        if fixed:
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.01 * torch.randn(p.shape, generator=gen))
        else:
            _train_step(model, optimizer, gen)
        local.after_inner_step(force=step == steps - 1)
        anchor = torch.cat([a.reshape(-1) for a in local.anchor]).numpy().copy()
        out.append((anchor, _flat(model), local.state.residual().numpy().copy()))
    return out


def test_keep_unsent_moves_each_rank_to_its_own_residual_and_sends_the_same():
    steps = 6
    kept, plain = run_world(_kept_rank, 2, steps, True), run_world(_kept_rank, 2, steps, False)
    for rank in range(2):
        for step in range(steps):
            anchor, own, residual = kept[rank][step]
            # The wire is the same: inner updates that ignore the parameters give the same
            # synchronized parameters and residuals (to float rounding of base - own).
            np.testing.assert_allclose(anchor, plain[rank][step][0], rtol=0, atol=1e-6)
            np.testing.assert_allclose(residual, plain[rank][step][2], rtol=0, atol=1e-6)
            if step < steps - 1:
                assert np.abs(residual).max() > 0
                np.testing.assert_allclose(own, anchor - np.float32(0.95) * residual, rtol=0, atol=1e-7)
                np.testing.assert_array_equal(plain[rank][step][1], plain[rank][step][0])  # plain: the anchor
            else:  # the last step forces: every rank holds the synchronized parameters
                np.testing.assert_array_equal(own, anchor)
    np.testing.assert_array_equal(kept[0][-1][1], kept[1][-1][1])


def test_keep_unsent_changes_training_and_a_restart_resumes_it_exactly():
    steps = 7
    straight = run_world(_kept_rank, 2, steps, True, False)
    plain = run_world(_kept_rank, 2, steps, False, False)
    # Real gradients see each rank's own residual, so the run is not the plain one.
    assert not np.allclose(straight[0][-1][0], plain[0][-1][0], rtol=0, atol=1e-6)
    restarted = run_world(_kept_rank, 2, steps, True, False, 4)
    for rank in range(2):
        for step in range(4, steps):
            for a, b in zip(straight[rank][step], restarted[rank][step]):
                np.testing.assert_array_equal(a, b)


def test_keep_unsent_takes_plain_error_feedback_only():
    with pytest.raises(ValueError, match="keep_unsent and overlap"):
        LocalSteps(_model().named_parameters(), every=1, keep_unsent=True, overlap=True)
