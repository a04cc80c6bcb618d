"""Delta chains under Ray Train: bases kept where Ray's checkpoint rotation cannot reach them.

Ray's ``CheckpointConfig(num_to_keep)`` deletes old checkpoint directories, so a delta
checkpoint must not refer to a base inside one of them. :class:`DeltaChain` writes a full
*base* into a directory of its own every ``full_every`` checkpoints, and each checkpoint
reported to Ray stores its weights as XOR deltas against the current base, which it names by
absolute path. After each save it deletes the bases that neither the new checkpoint nor the
``keep`` before it refers to. The new one is not registered with Ray yet (a worker lost
before it is would resume from the one before), and Ray holds the ``keep`` most recent
registered ones, so a base goes only once a newer registered checkpoint replaced every
checkpoint that needs it.
The list of bases used travels in the checkpoint itself, so a restarted job continues the
chain where its checkpoint left it.

Usage::

    chain = DeltaChain("/shared/ray_results/run-1/rayzip-bases", full_every=10, keep=2)
    history = chain.save(tmp_dir / "trainer", state, index=n, history=history)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from .store import has_manifest, save

__all__ = ["DeltaChain"]


class DeltaChain:
    """``base_keys``: the top-level entries of the state kept in bases and stored as deltas
    (the weights; optimizer moments change too much between checkpoints to gain from XOR)."""

    def __init__(self, root: str | Path, full_every: int, keep: int, base_keys: tuple[str, ...] = ("model",)):
        if full_every < 1 or keep < 1:
            raise ValueError("full_every and keep must be >= 1")
        self.root = Path(root)
        self.full_every, self.keep, self.base_keys = full_every, keep, base_keys
        self.history: list[str] = []  # bases used by the run's checkpoints so far, oldest first

    def _delta(self, name: str) -> bool:
        return any(name.startswith(f"/{key}/") for key in self.base_keys)

    def save(self, directory: str | Path, state: dict, index: int, history: list[str]) -> list[str]:
        """Write checkpoint number ``index`` of a run whose earlier checkpoints used the bases
        ``history``. The checkpoint stores the updated history under ``"chain"`` (a restarted
        job passes it back); it is also returned."""
        current = self.root / history[-1] if history else None
        if index % self.full_every == 0 or current is None or not has_manifest(current):
            current = self.root / f"base-{index:06d}"
            if current.exists():  # a restart redoing this index: the old base belongs to lost work
                shutil.rmtree(current)
            save(current, {key: state[key] for key in self.base_keys if key in state})
        history = [*history, current.name]
        save(directory, {**state, "chain": history}, base=current, delta=self._delta, absolute_base=True)
        self._collect(history)
        return history

    def _collect(self, history: list[str]) -> None:
        needed = set(history[-(self.keep + 1):])
        for base in self.root.glob("base-*"):
            if base.name not in needed:
                shutil.rmtree(base, ignore_errors=True)
