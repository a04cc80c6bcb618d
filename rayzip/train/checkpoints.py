"""A worker group's checkpoint in rayzip's compressed format, written and read by every rank.

``trainer/`` is rank 0's part (model, optimizer, RNG, whatever the caller adds); ``rank{r}/``
is each rank's compression state (residuals, velocities, codec state, step). Both the
built-in loop and :mod:`rayzip.train.api` (a user's own loop) write and read them here.

Usage (every rank)::

    write_parts(directory, rank, world, trainer=lambda: {...}, state=hook_state)
    trainer = load_trainer(directory, model)
    restore_hook(directory, rank, world, trainer, hook_state)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import DeltaChain
from ..checkpoint import load as load_checkpoint
from ..checkpoint import save as save_checkpoint
from ..codecs.memory import reshard_state

__all__ = ["holder_parts", "load_optimizer", "load_trainer", "restore_hook", "unwrap", "write_parts"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def write_parts(directory: Path, rank: int, world: int, trainer: Callable[[], dict], state,
                chain: DeltaChain | None = None, index: int = 0) -> None:
    """Rank 0 writes ``trainer()`` (called there only) to ``trainer/``, with ``world_size`` and
    the torch RNG added (with a chain, its weights as XOR deltas against the chain's base,
    ``index`` being the checkpoint's number); every rank with a hook writes ``rank{r}/``."""
    if rank == 0:
        content = {**trainer(), "world_size": world, "torch_rng": torch.get_rng_state()}
        holders = getattr(state, "holders", None)  # the hook's: every rank, or each node's leader
        if holders is not None:
            content["hook_holders"] = {str(r): list(held) for r, held in holders.items()}
        if chain is None:
            save_checkpoint(directory / "trainer", content)
        else:
            chain.history = chain.save(directory / "trainer", content, index, chain.history)
    if state is not None:
        save_checkpoint(directory / f"rank{rank}", {"world_size": world, "hook": state.state_dict()})


def load_trainer(path: Path, model: torch.nn.Module, chain: DeltaChain | None = None) -> dict:
    """Rank 0's part, applied to the model, the RNG and the delta chain's history; a corrupt
    file raises, naming file and tensor."""
    trainer = load_checkpoint(path / "trainer")
    if chain is not None:
        chain.history = list(trainer.get("chain", []))
    unwrap(model).load_state_dict(trainer["model"])
    torch.set_rng_state(trainer["torch_rng"])
    return trainer


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """``optimizer.load_state_dict(saved)``, keeping this run's momentum: the saved param
    groups carry theirs, which lives in the hook (momentum correction) or in the optimizer
    depending on the world size that saved them."""
    momentum = [group.get("momentum") for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, value in zip(optimizer.param_groups, momentum):
        if value is not None:
            group["momentum"] = value


def holder_parts(old_holders: dict[int, tuple[int, int]], new_holder: tuple[int, int] | None) -> dict[int, int]:
    """{old rank: its holder index} of the saved states that a new holder (index, count)
    takes: those whose index is its own modulo the new count (none for a non-holder)."""
    if new_holder is None:
        return {}
    index, count = new_holder
    return {r: i for r, (i, _) in old_holders.items() if i % count == index}


def restore_hook(path: Path, rank: int, world: int, trainer: dict, state) -> None:
    """The hook's state for this rank. Every rank, new ones included, resumes at the
    checkpoint's step (``trainer["step"]`` + 1; a new rank at step 0 would send dense warm-up
    steps while the others ran the ring).

    Error feedback is held by every rank, or with a node hierarchy by each node's leader
    (:attr:`CompressionState.holders`, saved in rank 0's part). Restarted on the same layout,
    each rank loads its own state. Otherwise the holders' states are re-sharded
    (:func:`reshard_state`) from the old holders to the new ones, so that their mean, the
    update still pending, is kept: across a resize, and into or out of a hierarchy."""
    old_world = int(trainer["world_size"])
    saved_map = trainer.get("hook_holders") or {str(r): [r, old_world] for r in range(old_world)}
    old_holders = {int(r): (int(i), int(c)) for r, (i, c) in saved_map.items()}
    new_holders = state.holders
    own = path / f"rank{rank}"
    if old_world == world and old_holders == new_holders and own.exists():
        state.load_state_dict(load_checkpoint(own)["hook"])
    else:
        mine = new_holders.get(rank)  # (index, count), or None on a node's other workers
        parts = holder_parts(old_holders, mine)
        saved = {index: load_checkpoint(path / f"rank{r}")["hook"] for r, index in parts.items()
                 if (path / f"rank{r}").exists()}
        # The codec's state (a seeded codec's call count) is the same on every rank.
        template = next(iter(saved.values()), None)
        if template is None and (path / "rank0").exists():
            template = load_checkpoint(path / "rank0")["hook"]
        if template is not None:
            old_count = next(iter(old_holders.values()))[1]
            memory = {} if mine is None else \
                reshard_state({i: h["memory"] for i, h in saved.items()}, old_count, mine[1], mine[0])
            state.load_state_dict({**template, "memory": memory})
        print(f"rayzip: rank {rank}: world size {old_world} -> {world}: error feedback re-sharded from "
              f"rank(s) {sorted(parts) or 'none'}")
    state.step = trainer["step"] + 1
