"""Local steps driven by a user's own ``optimizer.step()`` (``prepare_model(local_steps=...)``,
rayzip.train.local), on real gloo ranks: DDP with a hook that sends nothing, torch's
optimizer hooks counting the inner steps, against LocalSteps driven by hand. Under Ray
Train, with restarts: tests/system/test_snapshots.py."""

from __future__ import annotations

import pytest
import torch

from gloo_world import run_world
from rayzip.torch import CompressionConfig
from rayzip.torch.local_steps import LocalSteps
from rayzip.torch.muon import MuonWithAdamW
from rayzip.train.local import OwnLoopLocalSteps, own_gradient_hook

EVERY, STEPS = 3, 7  # a round of 3, two rounds and a step of the third


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _micro_batches(rank: int, step: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(2)]


def _local(model, policy="raise"):
    return LocalSteps(model.named_parameters(), every=EVERY, outer_lr=1.0, outer_momentum=0.0,
                      compression=CompressionConfig(codec="group_topk", density=0.25, collective="allgather"),
                      on_nonfinite=policy)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _side_by_side(rank, world, make_local):
    """The user's DDP model driven by its optimizer, and the same model by hand with LocalSteps."""
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), forward_sync_buffers=False)
    ddp.register_comm_hook(None, own_gradient_hook)
    adapter = OwnLoopLocalSteps(ddp, make_local(ddp.module), rank, world)
    by_hand = _model()
    return (ddp, adapter, torch.optim.AdamW(ddp.parameters(), lr=1e-2), by_hand, make_local(by_hand),
            torch.optim.AdamW(by_hand.parameters(), lr=1e-2))


def _own_loop_rank(rank, world):
    """The user's loop: DDP, two micro-batches under no_sync(), clipping, optimizer.step()
    and nothing else; beside it, the same model stepped by hand with LocalSteps."""
    ddp, adapter, optimizer, by_hand, local, reference = _side_by_side(rank, world, _local)
    mine, theirs, grads = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        reference.zero_grad()
        first, second = _micro_batches(rank, step)
        with ddp.no_sync():
            torch.nn.functional.cross_entropy(ddp(first[0]), first[1]).backward()
        torch.nn.functional.cross_entropy(ddp(second[0]), second[1]).backward()
        for x, y in (first, second):
            torch.nn.functional.cross_entropy(by_hand(x), y).backward()
        grads.append(torch.equal(_grads(ddp.module), _grads(by_hand)))  # this rank's own, not the mean
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 1.0)
        optimizer.step()
        assert local.gradient_ok(step)
        reference.step()
        local.after_inner_step()
        mine.append(_flat(ddp.module))
        theirs.append(_flat(by_hand))
    assert adapter.optimizer is optimizer and adapter.step == STEPS and adapter.local.rounds == STEPS // EVERY
    traffic = adapter.last_step  # an inner step: nothing sent, against DDP's ring
    return (mine, theirs, grads, traffic.bytes_sent, traffic.dense_bytes,
            (adapter.local.last_sync.bytes_sent, local.last_sync.bytes_sent))


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def test_a_users_optimizer_steps_drive_local_steps_as_by_hand():
    ranks = run_world(_own_loop_rank, 2, timeout_s=120)
    for rank, (mine, theirs, grads, sent, dense, synced) in enumerate(ranks):
        assert all(grads), rank  # after backward the code sees this rank's own gradient
        for step, (a, b) in enumerate(zip(mine, theirs)):
            assert torch.equal(a, b), (rank, step)
        assert sent == 0 and dense == 2 * 4 * sum(p.numel() for p in _model().parameters()) // 2
        assert synced[0] == synced[1] and 0 < synced[0] < dense / 2  # a synchronization's, compressed
    # Inside a round the ranks part; at each synchronization (after steps 3 and 6) they meet.
    (mine0, *_), (mine1, *_) = ranks
    for step in range(STEPS):
        assert torch.equal(mine0[step], mine1[step]) == ((step + 1) % EVERY == 0), step


def _nonfinite_rank(rank, world):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), forward_sync_buffers=False)
    ddp.register_comm_hook(None, own_gradient_hook)
    adapter = OwnLoopLocalSteps(ddp, _local(ddp.module, policy="skip"), rank, world)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    start = _flat(ddp.module)
    after = []
    for step in range(2 * EVERY):
        optimizer.zero_grad()
        x, y = _micro_batches(rank, step)[0]
        if rank == 1 and step == 1:
            x = x * float("nan")
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        before = _flat(ddp.module)
        optimizer.step()
        if rank == 1 and step == 1:  # this rank's inner step was skipped, its moments untouched
            assert adapter.skipped and torch.equal(_flat(ddp.module), before)
            assert all(optimizer.state[p]["step"] == 1 for p in ddp.parameters())
        after.append(_flat(ddp.module))
    return start, after, adapter.step, adapter.local.rounds


def test_a_nonfinite_gradient_skips_the_ranks_step_and_drops_the_round_on_every_rank():
    ranks = run_world(_nonfinite_rank, 2, timeout_s=120)
    (start0, after0, steps0, rounds0), (start1, after1, steps1, rounds1) = ranks
    assert steps0 == steps1 == 2 * EVERY and rounds0 == rounds1 == 2
    # The first round is dropped on both ranks: back at the start, together.
    assert torch.equal(after0[EVERY - 1], start0) and torch.equal(after1[EVERY - 1], start1)
    assert torch.equal(start0, start1)
    # The second goes through, on both alike.
    assert torch.equal(after0[-1], after1[-1]) and not torch.equal(after0[-1], start0)


def _muon_rank(rank, world):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), forward_sync_buffers=False)
    ddp.register_comm_hook(None, own_gradient_hook)
    adapter = OwnLoopLocalSteps(ddp, _local(ddp.module), rank, world)
    optimizer = MuonWithAdamW(ddp.module, lr=1e-2)  # steps its Muon and AdamW parts inside its own step
    for step in range(EVERY):
        optimizer.zero_grad()
        x, y = _micro_batches(rank, step)[0]
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    counted = (adapter.step, adapter.local.rounds, adapter.optimizer is optimizer)
    second = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        second.step()
    except ValueError as error:
        return counted, str(error)
    return counted, None


def test_an_optimizer_with_parts_counts_once_and_a_second_optimizer_is_refused():
    for counted, refused in run_world(_muon_rank, 2, timeout_s=120):
        assert counted == (EVERY, 1, True)
        assert refused is not None and "one optimizer" in refused


def test_local_steps_in_a_users_loop_refuse_what_does_not_run_there():
    from rayzip.spec import LocalStepsSpec, parse_spec

    with pytest.raises(ValueError, match="local_steps.adaptive"):
        LocalStepsSpec(enabled=True, adaptive=True).to_config()
    with pytest.raises(ValueError, match="local_steps.overlap"):
        parse_spec({"name": "own", "training": {"loop": "mine:loop"}, "local_steps": {"enabled": True, "overlap": True}})
    with pytest.raises(ValueError, match="local_steps with sharding"):
        parse_spec({"name": "own", "training": {"loop": "mine:loop"}, "local_steps": {"enabled": True},
                    "sharding": {"enabled": True}})
    # A loop of its own reports where it likes: no multiples of H asked of it.
    spec = parse_spec({"name": "own", "training": {"loop": "mine:loop", "eval_every": 10},
                       "checkpoint": {"every_steps": 50}, "local_steps": {"enabled": True, "every": 3}})
    assert spec.local_steps.to_config().every == 3


def _kept_local(model):
    return LocalSteps(model.named_parameters(), every=1, outer_lr=1.0, outer_momentum=0.0,
                      compression=CompressionConfig(codec="group_topk", density=0.05, collective="allgather",
                                                    error_decay=0.95, combine="senders"),
                      keep_unsent=True)


def _kept_own_loop_rank(rank, world):
    """keep_unsent at H = 1 in the user's loop, against LocalSteps by hand; then the loop's
    synchronize() before an evaluation."""
    ddp, adapter, optimizer, by_hand, local, reference = _side_by_side(rank, world, _kept_local)
    same = []
    for step in range(4):
        optimizer.zero_grad()
        reference.zero_grad()
        x, y = _micro_batches(rank, step)[0]
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        torch.nn.functional.cross_entropy(by_hand(x), y).backward()
        optimizer.step()
        reference.step()
        local.after_inner_step()
        same.append(torch.equal(_flat(ddp.module), _flat(by_hand)))
    kept = adapter.local.kept
    own = _flat(ddp.module)
    adapter.synchronize()  # as before an evaluation: every rank on the synchronized parameters
    anchor = torch.cat([a.flatten() for a in adapter.local.anchor])
    return same, kept, own, _flat(ddp.module), anchor


def test_keep_unsent_in_a_users_loop_steps_as_by_hand_and_meets_before_an_evaluation():
    ranks = run_world(_kept_own_loop_rank, 2, timeout_s=120)
    for same, kept, own, synced, anchor in ranks:
        assert all(same) and kept
        assert not torch.equal(own, anchor)  # between rounds each rank holds its own residual
        assert torch.equal(synced, anchor)
    assert torch.equal(ranks[0][3], ranks[1][3])


def _eval_forward_rank(rank, world):
    """keep_unsent at H = 1: a forward in train mode, or in eval mode with autograd on, leaves
    this rank's own parameters; one in eval mode under no_grad (an evaluation, with no
    synchronize() called) sets the shared ones, sending nothing; the next step keeps the
    residual again."""
    ddp, adapter, optimizer, *_ = _side_by_side(rank, world, _kept_local)
    x, y = _micro_batches(rank, 0)[0]

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    step()
    step()
    own = _flat(ddp.module)
    with torch.no_grad():
        ddp(x)  # train mode: a forward of the rank's own model
    unchanged = torch.equal(_flat(ddp.module), own)
    sent = adapter.totals["bytes_sent"]
    ddp.eval()
    ddp(x)  # eval mode with autograd on: a training forward with dropout off
    unchanged = unchanged and torch.equal(_flat(ddp.module), own)
    with torch.no_grad():
        ddp(x)
    ddp.train()
    anchor = torch.cat([a.flatten() for a in adapter.local.anchor])
    evaluated = _flat(ddp.module)
    quiet = adapter.totals["bytes_sent"] == sent
    step()
    return unchanged, torch.equal(evaluated, anchor), quiet, evaluated, adapter.local.kept, adapter.codec.name


def test_an_evaluation_in_eval_mode_sees_the_shared_parameters_without_a_call():
    ranks = run_world(_eval_forward_rank, 2, timeout_s=120)
    for unchanged, at_anchor, quiet, _, kept_again, codec in ranks:
        assert unchanged and at_anchor and quiet and kept_again
        assert codec == "group_topk"  # the pseudo-gradients' codec, as a per-step exchange reports its own
    assert torch.equal(ranks[0][3], ranks[1][3])  # every rank evaluated the same model


def test_the_adaptive_controller_refuses_local_steps_naming_the_config_to_pass():
    from rayzip.train.telemetry import Telemetry

    model = _model()
    state = OwnLoopLocalSteps(model, LocalSteps(model.named_parameters(), every=1), rank=0, world=1)
    with pytest.raises(ValueError, match="compression=CompressionConfig"):
        Telemetry(state=state, controller=object(), rank=0, metrics=False)
    assert Telemetry(state=state, rank=0, metrics=False).controller is None  # metrics alone are fine
    assert state.codec is None and state.memory is None  # world size 1: nothing exchanged
