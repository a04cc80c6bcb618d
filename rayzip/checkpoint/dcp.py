"""rayzip's lossless codec as a storage layer for ``torch.distributed.checkpoint`` (DCP).

DCP plans which rank writes which shard of a sharded state dict (FSDP2's DTensors, an
optimizer's sharded state) and, on load, which stored pieces each rank of a possibly
different world needs: its planner reshards. These classes store what DCP hands them: each
rank writes its own pieces, in parallel, as one rayzip checkpoint (``__<rank>/``: manifest
and ``tensors.bin``, every stream checksummed); the coordinator writes DCP's metadata
(``.metadata``), which maps each piece to its rank's folder and its name there.

Why a ``StorageWriter``/``StorageReader`` pair and not DCP's stream-transform extension
(``FileSystemWriter(_extensions=...)``): an extension sees the bytes of ``torch.save``'d
archives, without dtypes or shapes, while rayzip's codec works per tensor (byte planes by
dtype, exponent coding); the extension API is also marked experimental.

Example::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from rayzip.checkpoint.dcp import CompressedStorageReader, CompressedStorageWriter

    model_state, optim_state = get_state_dict(model, optimizer)     # sharded, no gather
    dcp.save({"model": model_state, "optim": optim_state}, storage_writer=CompressedStorageWriter(path))
    ...                                                             # any world size later
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, storage_reader=CompressedStorageReader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections import defaultdict
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .store import CheckpointError, load, save

__all__ = ["CompressedStorageReader", "CompressedStorageWriter", "stored_bytes"]

METADATA = ".metadata"


@dataclasses.dataclass(frozen=True)
class StoredPiece:
    """Where DCP's metadata finds one piece: its rank's folder, and its name in that folder's
    rayzip checkpoint (``<fully qualified name>@<offsets>`` for a tensor's piece)."""

    folder: str
    name: str


def _name(index: MetadataIndex) -> str:
    offsets = ",".join(str(o) for o in index.offset) if index.offset is not None else ""
    return f"{index.fqn}@{offsets}"


def _is_optimizer_state(name: str) -> bool:
    """Which entries rayzip's codec treats as optimizer moments (it tries the codec that suits
    them first); only the choice's order depends on it, never what is stored."""
    return ".state." in name or name.lstrip("/").startswith(("optim", "optimizer"))


class CompressedStorageWriter(StorageWriter):
    """DCP's storage layer, writing each rank's pieces as a rayzip checkpoint.

    Args:
        path: the checkpoint's folder (created); one such folder per checkpoint.
        threads: coding threads per rank (default: the usable cores, at most 8).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        super().__init__()
        self.path, self.threads = Path(path), threads
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.path.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{rank}") for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        folder: str = plan.storage_data
        state: dict[str, object] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            name = _name(item.index)
            if item.type == WriteItemType.BYTE_IO:
                state[name] = data.getvalue()
                nbytes = len(state[name])
            else:
                tensor = data.detach()
                state[name] = tensor if tensor.device.type == "cpu" else tensor.cpu()
                nbytes = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                       storage_data=StoredPiece(folder, name)))
        save(self.path / folder, state, optimizer_state=_is_optimizer_state, threads=self.threads)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        temporary = self.path / f"{METADATA}.tmp"
        with open(temporary, "wb") as out:
            pickle.dump(metadata, out)
        os.replace(temporary, self.path / METADATA)  # a reader never sees half of it

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)


class CompressedStorageReader(StorageReader):
    """Reads what :class:`CompressedStorageWriter` wrote, into any world size: DCP's planner
    asks each rank for the pieces its shards overlap. A damaged file raises
    :class:`rayzip.checkpoint.CheckpointError` naming the file and the piece.

    Args:
        path: the checkpoint's folder.
        threads: decoding threads (default: the usable cores, at most 8).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        super().__init__()
        self.path, self.threads = Path(path), threads
        self.storage_data: dict = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self.path / METADATA
        try:
            with open(path, "rb") as source:
                metadata = pickle.load(source)  # DCP's own metadata format, as its FileSystemReader reads it
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing: not a finished DCP checkpoint of rayzip's") from None
        except (pickle.UnpicklingError, EOFError, AttributeError) as exc:
            raise CheckpointError(f"{path}: unreadable DCP metadata: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_folder = defaultdict(list)
        for request in plan.items:
            piece: StoredPiece = self.storage_data[request.storage_index]
            by_folder[piece.folder].append((request, piece.name))
        for folder, requests in by_folder.items():
            entries = load(self.path / folder, threads=self.threads)  # checksums checked, names in errors
            for request, name in requests:
                if name not in entries:
                    raise CheckpointError(f"{self.path / folder}: no entry {name!r}, which {METADATA} lists")
                value = entries[name]
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(value))
                    continue
                piece = value
                for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                    piece = piece.narrow(dim, start, length)  # the part of the stored piece asked for
                target = planner.resolve_tensor(request).detach()
                if target.size() != piece.size():
                    raise CheckpointError(f"{self.path / folder}: {name}: a piece of shape {tuple(piece.shape)} "
                                          f"for a target of shape {tuple(target.shape)}")
                target.copy_(piece)
                planner.commit_tensor(request, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)


def stored_bytes(path: str | os.PathLike) -> dict[str, int]:
    """A checkpoint of :class:`CompressedStorageWriter`'s: the raw bytes of its tensors and
    the bytes their coding takes (``tensors.bin`` of every rank's folder)."""
    from .store import inspect

    rows = [inspect(folder) for folder in Path(path).iterdir() if folder.is_dir()]
    return {"raw_bytes": sum(r["raw_bytes"] for r in rows), "stored_bytes": sum(r["stored_bytes"] for r in rows)}
