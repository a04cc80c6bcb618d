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

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import DeltaChain
from ..checkpoint.background import BackgroundWriter, Deferred, SnapshotBuffers, snapshot
from ..checkpoint import load as load_checkpoint
from ..checkpoint import save as save_checkpoint
from ..checkpoint.store import manifest_entry, read_manifest
from ..codecs.memory import reshard_state
from ..torch.optim import load_optimizer
from ..xp import local_part

if TYPE_CHECKING:
    from ..torch.local_steps import LocalSteps

__all__ = ["COPIED", "GroupCheckpoints", "OWN_SHARDS", "Parts", "SplitState", "holder_parts", "load_local_shards",
           "load_optimizer", "load_shards", "load_trainer", "local_shards", "newest_of", "restore_hook",
           "restore_shards", "save_shards", "take_parts", "take_shards", "trainer_step", "unwrap", "write_parts",
           "write_shards", "write_taken"]

SHARDS = "shards"  # a sharded model's folder in a checkpoint: DCP's .metadata and __<rank>/
# A snapshot's restore folder (rayzip.train.snapshots): this rank's own shards, as its slot held
# them (local tensors), for the same layout.
OWN_SHARDS = "own_shards"
# ... and a lost rank's error feedback, from its partial copy on another node's keeper
# (rayzip.train.residual_copy): copied<rank>/, {"memory": {name: array}}.
COPIED = "copied"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


@dataclass
class Parts:
    """What one rank writes into a checkpoint: rank 0's ``trainer`` part (else None) and its
    hook state (None without a hook)."""

    rank: int
    world: int
    trainer: dict | None
    hook: dict | None


class RankState(Protocol):
    """What a loop's exchange keeps of each rank in a checkpoint: the engine's state
    (:class:`rayzip.engine.GradientExchange`), local steps' or the parameter-server client's."""

    @property
    def holders(self) -> dict[int, tuple[int, int]] | None:
        """The ranks whose error feedback a restart on another layout re-shards, each with (its
        index, their count); None: nothing is re-sharded."""

    def state_dict(self) -> dict: ...


class SplitState:
    """A rank state most of whose bytes change only now and then (local steps': at a
    synchronization). A snapshot writes that part once each time it changes, into a slot
    of its own, and each step only the rest (:mod:`rayzip.train.snapshots`)."""

    def split_state_dict(self) -> tuple[dict, int, Callable[[], dict]]:
        """(the part each step changes, the generation of the rest, the rest): the two
        parts' entries together are what a snapshot restores; the rest is the same while
        the generation is."""
        raise NotImplementedError

    def residuals_of(self, rest: dict) -> dict | None:
        """This rank's error feedback in ``rest`` (the part :meth:`split_state_dict` returns
        last), which a snapshot copies in part to another node's keeper
        (:mod:`rayzip.train.residual_copy`); None: none to copy."""
        return None


def take_parts(rank: int, world: int, trainer: Callable[[], dict], state: RankState | None,
               copy: Callable[[Any], Any] | None = None, hook: dict | None = None) -> Parts:
    """This rank's parts of a checkpoint, as they are now: ``trainer()`` on rank 0, with
    ``world_size``, the torch RNG and the hook's holders added, and the hook's state. With
    ``copy`` (:func:`rayzip.checkpoint.background.snapshot`, or one with buffers), every
    tensor is copied to host memory, so the parts can be written while training goes on.
    ``hook``: the hook's state, taken already (instead of ``state.state_dict()``)."""
    content = None
    if rank == 0:
        content = {**trainer(), "world_size": world, "torch_rng": torch.get_rng_state()}
        # The hook's holders: every rank, or each node's leader (None: nothing to re-shard).
        holders = state.holders if state is not None else None
        if holders is not None:
            content["hook_holders"] = {str(r): list(held) for r, held in holders.items()}
    if state is not None:
        hook = {"world_size": world, "hook": state.state_dict() if hook is None else hook}
    if copy is not None:
        content, hook = copy(content), copy(hook)
    return Parts(rank, world, content, hook)


def write_taken(directory: Path, parts: Parts, chain: DeltaChain | None = None, index: int = 0) -> None:
    """Write :func:`take_parts`' result: rank 0's part to ``trainer/`` (with a chain, its
    weights as XOR deltas against the chain's base, ``index`` being the checkpoint's number),
    the hook state to ``rank{r}/``."""
    if parts.trainer is not None:
        if chain is None:
            save_checkpoint(directory / "trainer", parts.trainer)
        else:
            chain.history = chain.save(directory / "trainer", parts.trainer, index, chain.history)
    if parts.hook is not None:
        save_checkpoint(directory / f"rank{parts.rank}", parts.hook)


def write_parts(directory: Path, rank: int, world: int, trainer: Callable[[], dict], state,
                chain: DeltaChain | None = None, index: int = 0) -> None:
    """:func:`take_parts` and :func:`write_taken` in one call, without copies: rank 0 writes
    ``trainer()`` (called there only), every rank with a hook its state."""
    write_taken(directory, take_parts(rank, world, trainer, state), chain, index)


def load_trainer(path: Path, model: torch.nn.Module | None, chain: DeltaChain | None = None) -> dict:
    """Rank 0's part, applied to the model (unless None: a sharded model loads it itself), the
    RNG and the delta chain's history; a corrupt file raises, naming file and tensor."""
    trainer = load_checkpoint(path / "trainer")
    if chain is not None:
        chain.history = list(trainer.get("chain", []))
    if model is not None:
        unwrap(model).load_state_dict(trainer["model"])
    torch.set_rng_state(trainer["torch_rng"])
    return trainer


def trainer_step(checkpoint) -> int:
    """The step after which a Ray Train checkpoint's trainer part was taken (its ``step``; -1
    where it names none), from the part's manifest alone, read through the checkpoint's own
    filesystem: a checkpoint in cloud storage is not downloaded for it."""
    def read(path: str) -> bytes:
        # compression=None: pyarrow would otherwise inflate the .zst by its name itself
        with checkpoint.filesystem.open_input_stream(path, compression=None) as stream:
            return stream.read()

    step = manifest_entry(read_manifest(f"{checkpoint.path}/trainer", opener=read), "step", -1)
    return step if isinstance(step, int) else -1


def newest_of(memory, stored) -> tuple[Any, str]:
    """(the checkpoint to resume from, where it comes from: ``memory``, ``storage`` or ``start``).

    The in-memory snapshot (``memory``, a Ray Train checkpoint or None) unless the one in
    storage is newer: a loop that snapshots less often than it checkpoints, a snapshot every
    k steps, or a keeper that refused one. Both parts' steps come from the same counter (the
    compression state's, or the built-in loop's step), so a tie, or parts that name no step,
    keep memory, the faster read. Every rank gets the same two checkpoints (the snapshot step
    is agreed by all-reduce, Ray Train's checkpoint is the run's), so every rank decides the same."""
    if memory is None:
        return stored, "storage" if stored is not None else "start"
    if stored is not None and trainer_step(stored) > trainer_step(memory):
        return stored, "storage"
    return memory, "memory"


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
    (:attr:`rayzip.engine.GradientExchange.holders`, saved in rank 0's part). Restarted on the same layout,
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
        if parts and any(not (path / f"rank{r}").exists() for r in old_holders):
            # A holder's part was lost with its node: every kept holder's error feedback goes
            # in, so that the lost ones' is estimated from them (reshard_state).
            parts = {r: index for r, (index, _) in old_holders.items()}
        saved = {index: load_checkpoint(path / f"rank{r}")["hook"] for r, index in parts.items()
                 if (path / f"rank{r}").exists()}
        # The codec's state (a seeded codec's call count) is the same on every rank.
        template = next(iter(saved.values()), None)
        if template is None:  # any saved rank's (rank 0's may be lost with its node)
            kept = sorted(path.glob("rank*"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else 1 << 30)
            template = load_checkpoint(kept[0])["hook"] if kept else None
        if template is not None:
            old_count = next(iter(old_holders.values()))[1]
            memory = {} if mine is None else \
                reshard_state({i: h["memory"] for i, h in saved.items()}, old_count, mine[1], mine[0],
                              estimate_lost=state.config.combine == "mean")
            # Re-sharded velocities differ between ranks: no longer the dense steps' shared ones.
            # A collective's plans (the balanced allreduce's regions) start afresh on every
            # rank alike: the templates may come from different old ranks.
            state.load_state_dict({**template, "memory": memory, "drained": False, "collective": {}})
        print(f"rayzip: rank {rank}: world size {old_world} -> {world}: error feedback re-sharded from "
              f"rank(s) {sorted(parts) or 'none'}")
    state.step = trainer["step"] + 1


class LocalStepsState(SplitState):
    """A :class:`LocalSteps` as the loop's checkpoints see a hook's state: ``state_dict`` is
    this rank's part, ``holders`` every rank. A snapshot takes the round's start (the
    synchronized parameters, error feedback, the outer optimizer) once a round."""

    def __init__(self, local: LocalSteps, optimizer: torch.optim.Optimizer, rank: int, world: int,
                 model: torch.nn.Module):
        self.local, self.optimizer, self.rank, self.world, self.model = local, optimizer, rank, world, model

    @property
    def holders(self) -> dict[int, tuple[int, int]]:
        return {r: (r, self.world) for r in range(self.world)}

    def state_dict(self) -> dict:
        """At a synchronization; between them (a snapshot's), with this rank's own parameters
        and the round's state (:meth:`LocalSteps.round_state_dict`)."""
        if self.local.own_parameters:
            return {"round": self.local.round_state_dict(), "inner_optimizer": self.optimizer.state_dict(),
                    "own_model": unwrap(self.model).state_dict()}
        return {"local_steps": self.local.state_dict(), "inner_optimizer": self.optimizer.state_dict()}

    def split_state_dict(self) -> tuple[dict, int, Callable[[], dict]]:
        """A snapshot's: the round's start, and this rank's own parameters and inner optimizer
        with the round's inner steps (at a synchronization too: a round of none)."""
        own = {"round_step": self.local.round_step_dict(), "inner_optimizer": self.optimizer.state_dict(),
               "own_model": unwrap(self.model).state_dict()}
        return own, self.local.generation, lambda: {"round": self.local.round_start_dict()}

    def residuals_of(self, rest: dict) -> dict | None:
        """Under ``combine: senders`` only: under ``mean`` a lost rank's residual is estimated
        from the survivors' (:func:`rayzip.codecs.memory.reshard_state`)."""
        compression = rest["round"].get("compression")
        if compression is None or self.local.state.config.combine != "senders":
            return None
        return compression.get("memory") or None

    def _load(self, saved: dict, compression: dict | None = None) -> None:
        load_optimizer(self.optimizer, saved["inner_optimizer"])
        if "round" in saved:  # between synchronizations: this rank's own parameters, then the round
            unwrap(self.model).load_state_dict(saved["own_model"])
            # A snapshot's round is in two parts (split_state_dict), a checkpoint's in one.
            self.local.load_round_state_dict({**saved["round"], **saved.get("round_step", {})},
                                             compression=compression)
        else:
            self.local.load_state_dict(saved["local_steps"], compression=compression)

    def restore(self, path: Path, trainer: dict) -> None:
        """This rank's part when the world is unchanged; after a resize, rank r takes the
        inner optimizer of old rank r mod the old world, and error feedback is re-sharded so
        that the pending mean is kept (:func:`rayzip.codecs.memory.reshard_state`). A rank
        whose part was lost with its node takes the next kept rank's inner optimizer and own
        parameters, and the kept ranks' mean error feedback in place of its own."""
        old_world = int(trainer["world_size"])
        own = path / f"rank{self.rank}"
        if old_world == self.world and own.exists():
            self._load(load_checkpoint(own)["hook"])
            return
        kept = [r for r in range(old_world) if (path / f"rank{r}").exists()]
        if not kept:
            raise FileNotFoundError(f"{path}: the checkpoint lacks the local-steps state of every rank")
        # Old rank r mod the old world; where its part was lost with its node (a snapshot's
        # restore), the next one kept.
        donor = next(r for r in (*range(self.rank % old_world, old_world), *range(old_world)) if r in kept)
        # Every kept rank's error feedback where some were lost: theirs is estimated from them.
        sharded = kept if len(kept) < old_world else [r for r in kept if r % self.world == self.rank]
        parts = {r: load_checkpoint(path / f"rank{r}")["hook"] for r in sorted({donor, *sharded})}
        saved = parts[donor]
        key = "round" if "round" in saved else "local_steps"
        compression = saved[key].get("compression")
        if compression is not None and self.local.state is not None:  # None: a world of one exchanges nothing
            memory = {r: parts[r][key]["compression"]["memory"] for r in sharded}
            # A lost rank's partial copy, kept on another node (a snapshot's restore), in
            # place of the estimate or of nothing.
            memory.update((r, load_checkpoint(path / f"{COPIED}{r}")["memory"]) for r in range(old_world)
                          if r not in kept and (path / f"{COPIED}{r}").exists())
            memory = reshard_state(memory, old_world, self.world, self.rank,
                                   estimate_lost=self.local.state.config.combine == "mean")
            compression = {**compression, "memory": memory,
                           "drained": False, "collective": {}}
        self._load(saved, compression)  # between synchronizations: the donor's own parameters
        print(f"rayzip: rank {self.rank}: world size {old_world} -> {self.world}: local steps resume from rank "
              f"{donor}'s inner optimizer; error feedback re-sharded")


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   optimizer_key: str = "optimizer") -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    # This rank's shards as DTensors, no gather (AdamW's state is created if not yet).
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, optimizer_key: optimizer_state}


def take_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                copy: Callable[[Any], Any] | None = None, optimizer_key: str = "optimizer") -> dict:
    """This rank's shards of an FSDP2 ``model`` and its ``optimizer``: through ``copy``
    (:func:`rayzip.checkpoint.background.snapshot`, or one with buffers: host copies, for a
    write while training goes on), else the live tensors (for a write now). DCP writes one
    copy of what replicas hold alike under one key: where the replicas' optimizers differ
    (local steps), each replica's goes under an ``optimizer_key`` of its own."""
    state = _sharded_state(model, optimizer, optimizer_key)
    return copy(state) if copy is not None else state


def write_shards(directory: Path, shards: dict, process_group: dist.ProcessGroup | None = None) -> None:
    """Every rank writes its shards (:func:`take_shards`) into the checkpoint ``directory``,
    through ``torch.distributed.checkpoint`` with rayzip's codec as the storage layer
    (:mod:`rayzip.checkpoint.dcp`). A collective over ``process_group`` (default: the world):
    every rank calls it, on a thread of its own if the group is its own."""
    import torch.distributed.checkpoint as dcp

    from ..checkpoint.dcp import CompressedStorageWriter

    dcp.save(shards, storage_writer=CompressedStorageWriter(directory / SHARDS), process_group=process_group)


def save_shards(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """:func:`take_shards` and :func:`write_shards` now, over the world."""
    write_shards(directory, take_shards(model, optimizer))


def load_shards(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                extra: dict | None = None, optimizer_key: str = "optimizer") -> None:
    """:func:`save_shards`' checkpoint into ``model`` and ``optimizer`` on this world, which
    DCP's planner reshards to (a collective). ``extra``: more entries saved beside them (by
    :func:`take_shards`' caller), as DTensors laid out on this world, loaded in place.
    ``optimizer_key``: where the optimizer's shards were saved (see :func:`take_shards`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from ..checkpoint.dcp import CompressedStorageReader

    state = _sharded_state(model, optimizer, optimizer_key)
    dcp.load({**state, **(extra or {})}, storage_reader=CompressedStorageReader(path / SHARDS))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state[optimizer_key])


def local_shards(shards: Any) -> Any:
    """:func:`take_shards`' nest with each DTensor replaced by this rank's local shard (a view
    of its storage): what a snapshot copies."""
    if isinstance(shards, torch.Tensor):
        return local_part(shards)
    if isinstance(shards, dict):
        return {k: local_shards(v) for k, v in shards.items()}
    if isinstance(shards, list):
        return [local_shards(v) for v in shards]
    return shards


def load_local_shards(saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                      extra: dict | None = None, optimizer_key: str = "optimizer") -> None:
    """:func:`local_shards`' nest, saved by this rank on this layout, into ``model``,
    ``optimizer`` and ``extra`` (as :func:`load_shards` takes them): each local shard copied
    into its live DTensor's, no collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _sharded_state(model, optimizer, optimizer_key)
    _copy_into({**state, **(extra or {})}, saved, "")
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state[optimizer_key])


def _copy_into(live: dict | list, saved: Any, where: str) -> None:
    for key, value in list(live.items() if isinstance(live, dict) else enumerate(live)):
        try:
            held = saved[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"a snapshot's shards lack {where}/{key}: saved on another layout") from None
        if isinstance(value, torch.Tensor):  # a DTensor's local shard is a view: this writes the shard
            local_part(value).copy_(held)
        elif isinstance(value, (dict, list)):
            _copy_into(value, held, f"{where}/{key}")
        else:
            live[key] = held


def restore_shards(path: Path, rank: int, world: int, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None, state, chain: DeltaChain | None = None,
                   extra: dict | None = None, optimizer_key: str | Callable[[dict], str] = "optimizer") -> dict:
    """A sharded model's checkpoint at ``path`` (a collective): rank 0's part (the step, the
    data position, the RNG; no weights), the model's and optimizer's shards resharded to this
    world (:func:`load_shards`; from a snapshot, this rank's own, :func:`load_local_shards`),
    and the exchange's state (``state``, a
    :class:`rayzip.torch.fsdp.ShardedExchange`, or None): this rank's own where the world size
    is the same, else its residuals start afresh at the checkpoint's step (a shard's residual
    belongs to its layout). ``extra`` as for :func:`load_shards`; ``optimizer_key`` too, or
    a function of rank 0's part that names it. Returns rank 0's part."""
    trainer = load_trainer(path, None, chain)
    key = optimizer_key(trainer) if callable(optimizer_key) else optimizer_key
    if (path / OWN_SHARDS).exists():  # a snapshot's restore: this rank's own shards, on the same layout
        load_local_shards(load_checkpoint(path / OWN_SHARDS), model, optimizer, extra, key)
    else:
        load_shards(path, model, optimizer, extra, key)
    if state is not None:
        own = path / f"rank{rank}"
        if int(trainer["world_size"]) == world and own.exists():
            state.load_state_dict(load_checkpoint(own)["hook"])
        else:
            state.start_at(trainer["step"] + 1)
    return trainer


class GroupCheckpoints:
    """A worker group's checkpoints, written in the background and reported in order.

    Every rank calls :meth:`save` at the same steps. With ``background``, :meth:`save` takes
    a host snapshot (:func:`take_parts` with copies) and returns while a thread compresses and
    writes it; a save that finds the previous write still running waits for it first, so at
    most one is in flight and they complete in order. A background checkpoint is ready to
    report once every rank's write has completed: :meth:`poll` (every rank, every step)
    agrees on that with one all-reduce of a flag while a write is pending, and :meth:`flush`
    waits for it. Only then is it handed back for ``ray.train.report``, so a rank lost during a
    write never leaves a reported checkpoint that cannot be loaded: the job resumes from the
    last complete one. ``stall_s`` sums the time this rank's loop waited on checkpoints
    (snapshots, sync writes, waits for a previous write).

    Usage (every rank)::

        checkpoints = GroupCheckpoints(world=2, device="cpu", background=True)
        ready = checkpoints.poll()                                  # every step
        if due:
            ready += checkpoints.save(directory, take, write)       # take(copy or None) -> Parts
        for directory in ready: ray.train.report(metrics, checkpoint=...)
    """

    def __init__(self, world: int, device, background: bool = True, write_delay_s: float = 0.0) -> None:
        self.world, self.device, self.background = world, device, background
        self.write_delay_s = write_delay_s  # fault injection (rayzip.train.faults)
        self.writer: BackgroundWriter | None = None  # started by the first background save
        self.pending: Path | None = None
        self.stall_s = 0.0
        self.buffers = SnapshotBuffers()  # the last written snapshot's host tensors, for the next
        self._writing: Parts | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # see guard()
        self._deferred: Deferred | None = None

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Let background snapshots leave ``optimizer``'s parameters and state to the writer's
        thread, its ``step()`` waiting until they are copied (the wait counts as stall). Only
        for a loop in which nothing else changes them between a checkpoint and that step: the
        plain DDP and comm-hook exchanges, not local steps (whose synchronization writes the
        parameters before forward) or the parameter server's."""
        self.optimizer = optimizer
        optimizer.register_step_pre_hook(lambda *_: self._copied())

    def _copied(self) -> None:
        if self._deferred is not None:
            self.stall_s += self._deferred.wait()

    def _snapshot(self, nest: Any) -> Any:
        return snapshot(nest, buffers=self.buffers, defer=self._deferred)

    def save(self, directory: Path, take: Callable[[Callable[[Any], Any] | None], Parts],
             write: Callable[[Parts], None],
             background: bool | None = None) -> list[Path]:
        """Checkpoint into ``directory`` (in the background unless ``background`` says
        otherwise); returns the directories now ready to report, oldest first (a previous
        background write waited for, and this one when not in the background)."""
        start = time.perf_counter()
        ready = self._finish()
        background = self.background if background is None else background
        deferred = Deferred.for_optimizer(self.optimizer) if background and self.optimizer is not None else None
        self._deferred = deferred
        try:
            parts = take(self._snapshot if background else None)
            if not background:
                write(parts)
                ready.append(directory)
            else:
                self.writer = self.writer or BackgroundWriter(self.write_delay_s)
                self.writer.submit(lambda: write(parts), first=None if deferred is None else deferred.finish)
                self.pending, self._writing = directory, parts
        except BaseException:
            if deferred is not None:
                deferred.cancel()  # its write never started: the optimizer's step must not wait for it
            raise
        self.stall_s += time.perf_counter() - start
        return ready

    def poll(self) -> list[Path]:
        """The pending directory once every rank's write has completed (agreed by every rank
        at the same step), else nothing. Without a process group, nothing until
        :meth:`flush`."""
        if self.pending is None:
            return []
        done = self.writer.done()
        if self.world > 1:
            if not dist.is_initialized():
                return []
            flag = torch.tensor([1 if done else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        if not done:
            return []
        start = time.perf_counter()
        ready = self._finish()  # done everywhere: this only collects the result
        self.stall_s += time.perf_counter() - start
        return ready

    def flush(self) -> list[Path]:
        """Wait for the pending write; its directory, ready to report (every rank calls this
        at the same point)."""
        start = time.perf_counter()
        ready = self._finish()
        self.stall_s += time.perf_counter() - start
        return ready

    def _finish(self) -> list[Path]:
        if self.pending is None:
            return []
        directory, self.pending = self.pending, None
        written, self._writing = self._writing, None
        self.writer.wait()  # raises what the write raised
        if written is not None:  # written and dropped: the next snapshot copies into its tensors
            self.buffers.release([written.trainer, written.hook])
        return [directory]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
