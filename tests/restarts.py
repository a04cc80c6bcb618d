"""The tests' restart through a checkpoint: model, optimizer and hook state saved with
rayzip.checkpoint, then loaded into freshly built ones."""

from __future__ import annotations

from rayzip.checkpoint import store

__all__ = ["reload_from_checkpoint"]


def reload_from_checkpoint(directory, ddp, optimizer, state, build):
    """Save ``ddp``'s model, ``optimizer`` and the hook's ``state`` into ``directory``; return
    a fresh ``(ddp, optimizer, state)`` from ``build()``, loaded from it."""
    store.save(directory, {"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                           "hook": state.state_dict()})
    ddp, optimizer, state = build()
    saved = store.load(directory)
    ddp.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["hook"])
    return ddp, optimizer, state
