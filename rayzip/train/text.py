"""Byte-level text from the source of Python's standard library, which every machine has.

``dataset.name: python-stdlib``: every ``*.py`` file under ``sysconfig``'s stdlib directory,
leaving out ``site-packages``/``dist-packages`` and test packages (``test``, ``tests``,
``idle_test``: Debian ships them separately, so they would make the data differ between
machines with the same Python). Files are sorted by relative path; a file goes to the
validation split when the CRC32 of its relative path falls in the lowest
``validation_fraction`` of the range, so the split is fixed by file name alone and stays put
as files are added. Tokens are the bytes (vocabulary 256), files joined by a NUL byte.

Training windows are ``context + 1`` bytes at stride ``context`` through the training text.
:class:`ShardSampler` deals them to workers without replacement, in a seeded order per epoch,
and resumes exactly from a count of windows already consumed by the whole group, even at a
different world size.

Usage::

    text = load_python_stdlib(validation_fraction=0.05)
    train = Windows(text.train, context=128)
    sampler = ShardSampler(len(train), batch_size=8, rank=rank, world=world, seed=0, start=consumed)
    for x, y in torch.utils.data.DataLoader(train, batch_size=8, sampler=sampler): ...
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

__all__ = ["ShardSampler", "TextSplits", "Windows", "load_python_stdlib", "stdlib_files"]

_LEFT_OUT = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SEPARATOR = b"\0"


@dataclass(frozen=True)
class TextSplits:
    train: np.ndarray  # uint8 tokens
    validation: np.ndarray
    train_files: int
    validation_files: int
    root: str


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib source file that the dataset reads, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    # A walk that never enters what is left out: site-packages can hold far more files
    # than the stdlib (every rank of a GPT run lists them).
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _LEFT_OUT]
        for name in names:
            if name.endswith(".py"):
                path = Path(directory, name)
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def is_validation(relative: str, fraction: float) -> bool:
    return zlib.crc32(relative.encode()) < fraction * 2 ** 32


def load_python_stdlib(validation_fraction: float = 0.05, max_bytes: int | None = None,
                       root: str | Path | None = None) -> TextSplits:
    """The standard library's source as byte tokens, split by file (see the module docstring).
    ``max_bytes`` caps the training text (the validation text is not capped)."""
    root = str(root or sysconfig.get_paths()["stdlib"])
    train, validation = [], []
    for relative, path in stdlib_files(root):
        (validation if is_validation(relative, validation_fraction) else train).append(path.read_bytes())
    if not train or not validation:
        raise FileNotFoundError(f"python-stdlib: found {len(train)} training and {len(validation)} "
                                f"validation files under {root}")
    train_bytes = SEPARATOR.join(train)
    if max_bytes is not None:
        train_bytes = train_bytes[:max_bytes]
    return TextSplits(np.frombuffer(train_bytes, dtype=np.uint8), np.frombuffer(SEPARATOR.join(validation), dtype=np.uint8),
                      len(train), len(validation), root)


class Windows(torch.utils.data.Dataset):
    """Non-overlapping next-token windows: item i is (tokens[i*c : i*c+c], tokens[i*c+1 : i*c+c+1])."""

    def __init__(self, tokens: np.ndarray, context: int):
        self.tokens, self.context = torch.from_numpy(np.array(tokens, dtype=np.uint8)), context
        self.count = (len(tokens) - 1) // context
        if self.count < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of {context + 1}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.context: i * self.context + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class ShardSampler(torch.utils.data.Sampler[int]):
    """This rank's indices, ``batch_size`` per step, without replacement within an epoch.

    The group reads one stream of indices: the permutations of ``range(n)`` for epochs 0,
    1, 2, ... (seeded by ``(seed, epoch)``) end to end. Each step the group takes the next
    ``batch_size * world`` of them and rank ``r`` takes every ``world``-th from ``r``: no window
    repeats within an epoch, and the ranks' batches are disjoint. ``start`` is the stream
    position (the windows the whole group has consumed), so a group of any size resumes
    exactly where the last one stopped: save :meth:`consumed_after` with a checkpoint.
    Infinite: it runs through epochs."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, seed: int = 0, start: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        if n < 1:
            raise ValueError("no windows to sample")
        self.n, self.batch, self.rank, self.world, self.seed, self.start = n, batch_size, rank, world, seed, start

    def consumed_after(self, steps: int) -> int:
        """The group's stream position after ``steps`` more steps from ``start``."""
        return self.start + steps * self.batch * self.world

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))

    def __iter__(self) -> Iterator[int]:
        glob = self.batch * self.world
        epoch, order = -1, None
        position = self.start
        while True:
            for i in range(position + self.rank, position + glob, self.world):
                if i // self.n != epoch:
                    epoch = i // self.n
                    order = self._order(epoch)
                yield int(order[i % self.n])
            position += glob
