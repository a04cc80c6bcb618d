"""The built-in training tasks of ``rayzip run`` (``training.loop``): what a step computes,
where its batches come from, and what an evaluation measures.

* :class:`Classification` (``classification``): a model on in-memory tensors (digits,
  synthetic, or yours), cross-entropy, test accuracy (higher is better).
* :class:`LanguageModel` (``language_model``): a GPT on byte-level text (``python-stdlib``),
  next-byte cross-entropy, validation loss in bits per byte (lower is better).

Both resume exactly after a restart: :meth:`Task.data_state` goes into every checkpoint and
:meth:`Task.batches` starts from it.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..spec import JobSpec, TrainingSpec
from .data import load_dataset, shard
from .gpt import GPT, lm_loss
from .models import build_model
from .text import ShardSampler, Windows, load_python_stdlib

__all__ = ["Classification", "LanguageModel", "Task", "agreed_accuracy", "build_task", "shard_plan"]


class Task:
    metric = "metric"  # the name evaluations report under
    higher_is_better = True

    def __init__(self, spec: JobSpec, rank: int, world: int, device):
        self.spec, self.rank, self.world, self.device = spec, rank, world, device
        self.target: float | None = None

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def total_steps(self) -> int:
        raise NotImplementedError

    def batches(self, start_step: int, saved: dict | None) -> Iterator:
        """This rank's batches from ``start_step`` on; ``saved`` is :meth:`data_state` of the
        checkpoint resumed from (None on a fresh start)."""
        raise NotImplementedError

    def data_state(self, next_step: int) -> dict:
        """What :meth:`batches` needs to resume at ``next_step``."""
        return {"next_step": next_step}

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        raise NotImplementedError

    def training_loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        """:meth:`loss` for a training step, under ``training.mixed_precision``: autocast
        changes the forward's matmuls only, so the gradients stay float32 and everything
        after backward (the exchange, error feedback, the optimizer) is unchanged."""
        if self.spec.training.mixed_precision == "bf16":
            with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16):
                return self.loss(model, batch)
        return self.loss(model, batch)

    def evaluate(self, model: torch.nn.Module) -> float:
        """The task's metric, identical on every rank."""
        raise NotImplementedError

    def reached(self, value: float | None) -> bool:
        if self.target is None or value is None:
            return False
        return value >= self.target if self.higher_is_better else value <= self.target


def shard_plan(training: TrainingSpec, train_size: int, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """This rank's training examples, and the steps that every rank runs.

    In ``epochs`` mode the shards differ by up to one example, so epochs are counted over the
    smallest shard (``train_size // world`` examples) on every rank: a rank that ran one step
    longer would wait in a collective for ranks that had already stopped. (Batches are drawn
    from the rank's own shard, so no example is left out for good.)"""
    mine = shard(train_size, rank, world, training.seed)
    if training.steps is not None:
        return mine, training.steps
    return mine, training.epochs * max(1, math.ceil((train_size // world) / training.batch_size))


def agreed_accuracy(accuracy: float | None, device) -> float | None:
    """Rank 0's test accuracy, on every rank."""
    message = torch.tensor([float("nan") if accuracy is None else accuracy], dtype=torch.float64,
                           device=device)  # NCCL broadcasts device tensors only
    dist.broadcast(message, src=0)
    value = float(message.item())
    return None if math.isnan(value) else value


def _batch(seed: int, rank: int, step: int, shard_size: int, batch: int) -> torch.Tensor:
    # A function of (seed, rank, step) only, so a resumed run draws exactly the same batches.
    gen = torch.Generator().manual_seed(hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(0, shard_size, (batch,), generator=gen)


class Classification(Task):
    """Each rank samples batches from its own shard with replacement, as a function of
    (seed, rank, step): a resumed run draws exactly the batches it would have drawn."""

    metric = "test_accuracy"

    def __init__(self, spec: JobSpec, rank: int, world: int, device):
        super().__init__(spec, rank, world, device)
        self.target = spec.training.target_accuracy
        self.x_train, self.y_train, self.x_test, self.y_test = load_dataset(spec.dataset, spec.training.seed)
        self.classes = int(max(self.y_train.max(), self.y_test.max())) + 1
        self.mine, self.steps = shard_plan(spec.training, len(self.x_train), rank, world)

    def build_model(self) -> torch.nn.Module:
        return build_model(self.spec.model, self.x_train.shape[1], self.classes)

    def total_steps(self) -> int:
        return self.steps

    def batches(self, start_step: int, saved: dict | None) -> Iterator:
        training = self.spec.training
        for step in range(start_step, self.steps):
            idx = self.mine[_batch(training.seed, self.rank, step, len(self.mine), training.batch_size)]
            yield self.x_train[idx].to(self.device), self.y_train[idx].to(self.device)

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        """Rank 0's accuracy counts: in asynchronous parameter-server mode each rank
        evaluates its own copy of the model, and a rank that stopped alone, then or at a later
        step from its own stale figure, would leave the others waiting."""
        model.eval()
        correct = 0
        for start in range(0, len(self.x_test), 4096):
            logits = model(self.x_test[start:start + 4096].to(self.device))
            correct += int((logits.argmax(dim=1).cpu() == self.y_test[start:start + 4096]).sum())
        model.train()
        accuracy = correct / len(self.x_test)
        if self.world > 1 and dist.is_initialized():
            accuracy = agreed_accuracy(accuracy, self.device)
        return accuracy


class LanguageModel(Task):
    """Next-byte prediction. Batches come from a ``torch.utils.data.DataLoader`` over
    non-overlapping windows, dealt to ranks without replacement by
    :class:`rayzip.train.text.ShardSampler`, which resumes at the stream position saved in
    the checkpoint (the windows the whole group consumed), whatever the world size. The
    validation loss is the mean over ``dataset.eval_windows`` fixed windows, split among the
    ranks and summed with one all-reduce."""

    metric = "val_loss"
    higher_is_better = False

    def __init__(self, spec: JobSpec, rank: int, world: int, device):
        super().__init__(spec, rank, world, device)
        self.target = spec.training.target_val_loss
        data, context = spec.dataset, spec.model.context
        if spec.model.name != "gpt":
            context = int(spec.model.kwargs.get("context", context))
        text = load_python_stdlib(data.validation_fraction, data.max_bytes)
        self.train = Windows(text.train, context)
        validation = Windows(text.validation, context)
        picks = torch.linspace(0, len(validation) - 1, min(data.eval_windows, len(validation))).long().unique()
        mine = picks[rank::world]
        self.val_x = torch.stack([validation[int(i)][0] for i in mine]) if len(mine) else None
        self.val_y = torch.stack([validation[int(i)][1] for i in mine]) if len(mine) else None
        self.steps = spec.training.steps if spec.training.steps is not None else (
            spec.training.epochs * (len(self.train) // (spec.training.batch_size * world)))
        self.sampler: ShardSampler | None = None
        self.start_step = 0

    def build_model(self) -> torch.nn.Module:
        m = self.spec.model
        if m.name == "gpt":
            return GPT(vocab=256, layers=m.layers, width=m.width, heads=m.heads, context=m.context, dropout=m.dropout)
        return build_model(m, 256, 256)

    def total_steps(self) -> int:
        return self.steps

    def batches(self, start_step: int, saved: dict | None) -> Iterator:
        training = self.spec.training
        position = start_step * training.batch_size * self.world
        if saved is not None and "position" in saved:
            # The saved position holds under any world size; steps since then (a parameter
            # server that ran ahead of the checkpoint) ran at this one.
            position = saved["position"] + (start_step - saved["next_step"]) * training.batch_size * self.world
        self.start_step = start_step
        self.sampler = ShardSampler(len(self.train), training.batch_size, self.rank, self.world,
                                         seed=training.seed, start=position)
        # Its own generator: a DataLoader draws a seed from the global RNG otherwise, which a
        # resumed run (whose loader starts after the restore) would draw at another point.
        loader = torch.utils.data.DataLoader(self.train, batch_size=training.batch_size, sampler=self.sampler,
                                             generator=torch.Generator().manual_seed(training.seed))
        for _, (x, y) in zip(range(start_step, self.steps), loader):
            yield x.to(self.device), y.to(self.device)

    def data_state(self, next_step: int) -> dict:
        return {"next_step": next_step, "position": self.sampler.consumed_after(next_step - self.start_step)}

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return lm_loss(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.val_x is not None:
            for start in range(0, len(self.val_x), 32):
                x, y = self.val_x[start:start + 32].to(self.device), self.val_y[start:start + 32].to(self.device)
                logits = model(x)
                total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                            reduction="sum").double()
                total[1] += y.numel()
        model.train()
        if self.world > 1 and dist.is_initialized():
            dist.all_reduce(total)
        return float(total[0] / total[1]) / math.log(2)  # bits per byte


def build_task(spec: JobSpec, rank: int, world: int, device) -> Task:
    if spec.training.loop == "language_model":
        return LanguageModel(spec, rank, world, device)
    return Classification(spec, rank, world, device)
