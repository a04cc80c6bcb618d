"""Job specs: pydantic models loaded from YAML, strict about every field.

Usage::

    spec = load_spec("jobs/digits-group-topk.yaml")    # raises SpecError naming bad fields
    codec = spec.compression.build_codec(rank=0)
"""

from __future__ import annotations

import copy
import importlib

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .codecs import CODECS
from .comm.cost import Link
from .engine.config import CODEC_FIELDS, CompressionConfig
from .keeper import DEFAULT_MAX_BYTES

__all__ = [
    "CheckpointSpec", "CompressionSpec", "DatasetSpec", "JobSpec", "LocalStepsSpec", "MetricsSpec", "ModelSpec",
    "ParameterServerSpec", "ScalingSpec", "SpecError", "TrainingSpec", "check_allowed_modules", "code_references",
    "load_spec", "load_spec_data", "parse_spec", "with_overrides",
]

BUILTIN_MODELS = ("mlp", "gpt")
BUILTIN_DATASETS = ("digits", "synthetic", "python-stdlib")
BUILTIN_LOOPS = ("classification", "language_model")
TEXT_DATASETS = ("python-stdlib",)
_GPT_FIELDS = ("layers", "width", "heads", "context", "dropout")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


# Fields a spec may still carry from before a rename: refused, naming the new field.
RENAMED = {("compression", "ratio"): "compression.density (the kept fraction: 0.01 sends 1% of the entries)",
           ("adaptive", "min_ratio"): "adaptive.min_compression (1 / density: 4 keeps 25% of the entries)",
           ("adaptive", "max_ratio"): "adaptive.max_compression (1 / density: 200 keeps 0.5% of the entries)"}


class SpecError(ValueError):
    """An invalid job spec; ``str()`` lists each bad field as ``path: message``."""

    def __init__(self, problems: list[str], source: str = "spec"):
        self.problems = problems
        super().__init__(f"{source}: invalid job spec\n" + "\n".join(f"  {p}" for p in problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def import_callable(path: str):
    """The object that ``module:function`` names (the module imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _builtin_or_import_path(value: str, builtins: tuple[str, ...], what: str) -> str:
    if value in builtins or _IMPORT_PATH.match(value):
        return value
    raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(builtins)} or 'module:function'")


class ModelSpec(_Strict):
    name: str = Field("mlp", description="Built-in model (mlp, gpt) or 'module:function' returning an nn.Module.")
    hidden: list[int] = Field([256, 256], description="mlp: hidden layer widths.")
    layers: int = Field(4, ge=1, description="gpt: transformer blocks.")
    width: int = Field(384, ge=8, description="gpt: model width (a multiple of heads).")
    heads: int = Field(6, ge=1, description="gpt: attention heads.")
    context: int = Field(128, ge=2, description="gpt: tokens per training window.")
    dropout: float = Field(0.0, ge=0, lt=1, description="gpt: dropout in attention and MLP.")
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments for a 'module:function' model.")

    @model_validator(mode="after")
    def _fields_fit_the_model(self):
        # Compared with the defaults, not with the fields written: a dumped spec sets them all.
        changed = {f for f in (*_GPT_FIELDS, "hidden") if getattr(self, f) != type(self).model_fields[f].default}
        if self.name != "gpt" and changed.intersection(_GPT_FIELDS):
            raise ValueError(f"{', '.join(sorted(changed.intersection(_GPT_FIELDS)))} apply to model gpt only")
        if self.name != "mlp" and "hidden" in changed:
            raise ValueError("hidden applies to model mlp only")
        if self.name == "gpt" and self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a multiple of heads ({self.heads})")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _builtin_or_import_path(v, BUILTIN_MODELS, "model")

    @field_validator("hidden")
    @classmethod
    def _hidden(cls, v: list[int]) -> list[int]:
        if any(w < 1 for w in v):
            raise ValueError("every hidden width must be >= 1")
        return v


class DatasetSpec(_Strict):
    name: str = Field("digits", description="digits (scikit-learn), synthetic, python-stdlib (byte-level "
                                            "text: the source of Python's standard library, see "
                                            "rayzip.train.text), or 'module:function' returning "
                                            "(x_train, y_train, x_test, y_test).")
    samples: int = Field(20_000, ge=10, description="synthetic: total examples.")
    features: int = Field(64, ge=1, description="synthetic: input width.")
    classes: int = Field(10, ge=2, description="synthetic: number of classes.")
    label_noise: float = Field(0.0, ge=0, lt=0.5, description="synthetic: fraction of labels replaced at random.")
    test_fraction: float = Field(0.25, gt=0, lt=1, description="Share of examples held out for testing.")
    validation_fraction: float = Field(0.05, gt=0, lt=1, description="python-stdlib: share of files (by a "
                                                                     "hash of the path) held out.")
    max_bytes: Optional[int] = Field(None, ge=1024, description="python-stdlib: cap on the training text.")
    eval_windows: int = Field(128, ge=1, description="python-stdlib: validation windows evaluated, evenly "
                                                     "spread over the validation text, shared among the ranks.")
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments for a 'module:function' dataset.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _builtin_or_import_path(v, BUILTIN_DATASETS, "dataset")


class TrainingSpec(_Strict):
    steps: Optional[int] = Field(None, ge=1, description="Optimizer steps (give steps or epochs; default 300).")
    epochs: Optional[int] = Field(None, ge=1, description="Passes over each worker's shard.")
    batch_size: int = Field(64, ge=1, description="Examples per worker per step.")
    loop: str = Field("classification", description="The per-worker training loop: classification, "
                                                    "language_model, or 'module:function' called as "
                                                    "function(config, ctx) with training.config and a "
                                                    "rayzip.train.LoopContext.")
    config: dict[str, Any] = Field({}, description="Handed to a 'module:function' loop as its config.")
    optimizer: Literal["sgd", "adam", "adamw", "muon"] = Field(
        "sgd", description="muon: Muon on the model's hidden matrices and AdamW on the rest (embeddings, "
                           "head, norms, biases), both with lr, betas and weight_decay (Muon's step scaled to "
                           "AdamW's RMS, so an AdamW spec carries over).")
    lr: float = Field(0.05, gt=0, description="Learning rate at base_world_size workers.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="constant (after lr_warmup_steps, which ramp from lr up to the scaled lr), or "
                                "cosine: a linear warm-up from 0 over lr_warmup_steps, then a cosine decay "
                                "to min_lr_ratio * lr at the last step.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: the final learning rate over the peak.")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd momentum.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam/adamw betas.")
    weight_decay: float = Field(0.0, ge=0)
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="bf16: each training forward and its loss run under torch.autocast in bfloat16; "
                            "weights, gradients, the exchange and the optimizer stay float32, and evaluation "
                            "runs in float32. (fp16 would need a gradient scaler, which the built-in loops do "
                            "not run.)")
    grad_clip_norm: Optional[float] = Field(None, gt=0, description="Clip the averaged gradient's global "
                                                                    "norm (every rank holds the same one).")
    seed: int = Field(0, ge=0)
    target_accuracy: Optional[float] = Field(None, gt=0, le=1, description="classification: test accuracy to "
                                                                         "reach; the time it first is reached "
                                                                         "is recorded.")
    target_val_loss: Optional[float] = Field(None, gt=0, description="language_model: validation loss to reach, "
                                                                     "in bits per byte.")
    stop_at_target: bool = Field(True, description="Stop once the target is reached (false: run every step, "
                                                   "to compare final accuracy at the same budget).")
    eval_every: int = Field(50, ge=1, description="Steps between test-set evaluations.")
    base_world_size: int = Field(1, ge=1, description="lr = lr * world_size / base_world_size.")
    lr_warmup_steps: int = Field(0, ge=0, description="Ramp the scaled lr up linearly over these steps.")
    on_nonfinite: Literal["raise", "skip"] = Field(
        "raise", description="A NaN/Inf gradient on any rank: every rank stops the run with an error naming "
                             "the rank and parameter (raise), or every rank drops that step (skip).")
    max_skipped_steps: int = Field(10, ge=1, description="skip: raise after this many skipped steps in a row.")

    @field_validator("loop")
    @classmethod
    def _loop(cls, v: str) -> str:
        return _builtin_or_import_path(v, BUILTIN_LOOPS, "loop")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v

    @model_validator(mode="after")
    def _target_fits_the_loop(self):
        if self.target_val_loss is not None and self.loop != "language_model":
            raise ValueError("target_val_loss applies to loop language_model (use target_accuracy)")
        if self.target_accuracy is not None and self.loop == "language_model":
            raise ValueError("loop language_model measures validation loss: use target_val_loss")
        if self.config and self.loop in BUILTIN_LOOPS:
            raise ValueError("config is for a 'module:function' loop")
        if self.mixed_precision != "none" and self.loop not in BUILTIN_LOOPS:
            raise ValueError("mixed_precision is for the built-in loops: a 'module:function' loop runs its "
                             "own torch.autocast")
        return self

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.steps is None and self.epochs is None:
            self.steps = 300
        return self


class ScalingSpec(_Strict):
    min_workers: int = Field(2, ge=1)
    max_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    resources_per_worker: dict[str, float] = Field({}, description="Extra Ray resources per worker.")
    max_failures: int = Field(3, ge=-1, description="Worker-group restarts allowed (-1: unlimited).")

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers})")
        return self


class CompressionSpec(_Strict):
    """How gradients cross the network. Codec parameters left unset take the codec's defaults."""

    codec: str = Field("none", description=f"One of {', '.join(n for n in CODECS if n != 'coo')}.")
    density: Optional[float] = Field(None, gt=0, le=1, description="Kept fraction (topk, randomk, group_topk): "
                                                                    "0.01 sends 1% of the entries.")
    group_size: Optional[int] = Field(None, ge=1, description="group_topk group length G.")
    value_dtype: Optional[Literal["fp16", "fp32", "int8", "2bit", "4bit"]] = Field(
        None, description="Sparse codecs' value type; int8, 2bit and 4bit (group_topk): multiples of a scale "
                          "per group (2bit, 4bit: a sign and one of 2 or 8 magnitudes).")
    packed_indices: Optional[bool] = Field(None, description="group_topk: offsets bit-packed at ceil(log2 "
                                                             "group_size) bits.")
    coded_indices: Optional[bool] = Field(None, description="group_topk: offsets Elias-Fano coded, about "
                                                            "log2(group_size / k) + 2 bits each.")
    block: Optional[int] = Field(None, ge=2, description="dct_quant block side n.")
    bits: Optional[int] = Field(None, ge=1, le=16, description="dct_quant bits per coefficient.")
    keep: Optional[float] = Field(None, gt=0, le=1, description="dct_quant kept zig-zag fraction.")
    levels: Optional[int] = Field(None, ge=1, le=32767, description="qsgd levels s.")
    bucket_size: Optional[int] = Field(None, ge=1, description="qsgd entries per norm.")
    seed: Optional[int] = Field(None, ge=0, description="randomk/qsgd seed.")
    error_feedback: bool = True
    error_decay: float = Field(1.0, gt=0, le=1, description="Share of the error-feedback residual carried into the "
                               "next exchange (1: all of it). Below 1 what waits long fades: SparseLoCo's error "
                               "feedback for local steps' outer updates (0.95 there).")
    momentum_correction: bool = Field(
        False, description="Keep SGD momentum on each worker, before compression, and clear it where "
                           "entries are sent (DGC). Needs error_feedback and optimizer sgd with momentum; "
                           "the optimizer then runs with momentum 0.")
    adam_correction: bool = Field(
        False, description="Keep Adam's moments on each worker, on its own dense gradient, and compress "
                           "the Adam direction with error feedback (see rayzip.codecs.memory.AdamCorrection). "
                           "Needs error_feedback and optimizer adamw; the optimizer then runs as SGD without "
                           "momentum, with AdamW's decoupled weight decay.")
    collective: Literal["auto", "ring", "balanced", "allreduce", "allgather", "dense", "ps"] = Field(
        "auto", description="How workers combine gradients: a collective among them (auto picks ring, "
                            "allreduce, allgather or dense to fit the codec and the number of workers; dense: a "
                            "sparse payload scattered into a vector and all-reduced), or ps: push "
                            "to parameter-server shards and pull parameters (see the ps section). balanced "
                            "(sparse codecs, by name only) cuts the sum back to about k entries, so its bytes "
                            "per worker do not grow with the workers; what it cuts waits in error feedback.")
    combine: Literal["mean", "senders"] = Field(
        "mean", description="How the collective averages each entry: over every worker (mean), or over the workers "
                            "that sent it (senders: sparse codecs, on the allgather or balanced; SparseLoCo's).")
    warmup_steps: int = Field(0, ge=0, description="Send the first steps uncompressed.")
    link_mbit: float = Field(1000.0, gt=0, description="The workers' link rate that collective auto assumes "
                                                       "when it weighs bytes against messages.")
    link_latency_ms: float = Field(0.05, ge=0, description="The link's one-way latency that collective auto assumes.")
    hierarchy: Literal["auto", "node", "none"] = Field(
        "auto", description="Workers on one node average densely among themselves and one compressed exchange "
                            "per node crosses the network (node); auto does so when several nodes each hold "
                            "several workers; none: every worker exchanges compressed payloads.")
    overlap: bool = Field(True, description="Exchange each gradient segment on a worker thread as soon as backward "
                                            "has produced it, under the rest of backward (rayzip's hook).")
    segment_mb: float = Field(4.0, gt=0, description="Size of the segments the gradient is exchanged in (MiB of "
                                                     "fp32, whole parameters, cut from the last parameter back); "
                                                     "fixed by the model, not by DDP's buckets.")
    verify: bool = Field(False, description="Self-check each step: compare the collective's average "
                                            "with the mean of all workers' decoded payloads (extra, uncounted traffic).")
    torch_hook: Optional[Literal["powersgd", "fp16"]] = Field(
        None, description="Baselines: torch's own PowerSGD or fp16 DDP hook instead of rayzip's (codec none).")
    powersgd_rank: int = Field(2, ge=1, description="torch PowerSGD matrix_approximation_rank.")
    powersgd_start_iter: int = Field(1000, ge=2, description="torch PowerSGD start_powerSGD_iter (its default: 1000).")

    @field_validator("codec")
    @classmethod
    def _codec(cls, v: str) -> str:
        if v not in CODECS or v == "coo":
            raise ValueError(f"unknown codec {v!r}; choose from {', '.join(n for n in CODECS if n != 'coo')}")
        return v

    @model_validator(mode="after")
    def _codec_fits(self):
        if self.collective == "ps" and (self.verify or self.torch_hook is not None):
            raise ValueError("verify and torch_hook work on collectives among the workers, not with collective ps")
        if self.hierarchy == "node" and (self.collective == "ps" or self.torch_hook is not None):
            raise ValueError("hierarchy node works in rayzip's hook among the workers: not with collective ps "
                             "or a torch_hook")
        if self.torch_hook is not None and (self.codec != "none" or self.verify):
            raise ValueError(f"torch_hook {self.torch_hook} replaces rayzip's hook: use codec none, verify false")
        for name in ("momentum_correction", "adam_correction"):
            if getattr(self, name) and (not self.error_feedback or self.torch_hook is not None):
                raise ValueError(f"{name} works on rayzip's error feedback: "
                                 "set error_feedback true and leave torch_hook unset")
        if self.momentum_correction and self.adam_correction:
            raise ValueError("choose momentum_correction (sgd) or adam_correction (adamw), not both")
        if self.combine != "mean" and self.collective == "ps":
            raise ValueError("combine senders works in the allgather among the workers; with collective ps "
                             "the shards average the pushes")
        if self.adam_correction and self.collective == "ps":
            raise ValueError("adam_correction runs on collectives among the workers; with collective ps the "
                             "shards run the optimizer")
        self._config()  # the library's own checks: the codec's parameters, error feedback, the collective
        return self

    def _config(self) -> CompressionConfig:
        # A shard decodes every push, so with collective ps any codec fits: checked as allgather.
        collective = "allgather" if self.collective == "ps" else self.collective
        return CompressionConfig(
            codec=self.codec, **{k: getattr(self, k) for k in CODEC_FIELDS},
            error_feedback=self.error_feedback, error_decay=self.error_decay,
            momentum_correction=self.momentum_correction, adam_correction=self.adam_correction,
            collective=collective, combine=self.combine, link=self.link(),
            hierarchy=self.hierarchy, overlap=self.overlap, segment_mb=self.segment_mb,
            warmup_steps=self.warmup_steps, verify=self.verify)

    def to_config(self) -> CompressionConfig:
        """The library's config (:class:`rayzip.torch.CompressionConfig`) for rayzip's hook and
        local steps."""
        if self.collective == "ps" or self.torch_hook is not None:
            raise ValueError(f"rayzip's hook does not run with collective {self.collective} "
                             f"or torch_hook {self.torch_hook}")
        return self._config()

    def codec_params(self, rank: int = 0) -> dict[str, Any]:
        return self._config().codec_params(rank)

    def link(self) -> Link:
        """The link ``collective: auto`` weighs its choice on."""
        return Link(bandwidth=self.link_mbit * 1e6 / 8, latency=self.link_latency_ms / 1e3)

    def build_codec(self, rank: int = 0):
        return self._config().build_codec(rank)

    def build_memory(self, momentum: float | None = None, adam_betas: tuple[float, float] | None = None):
        """The Memory role this spec asks for (:meth:`CompressionConfig.build_memory`)."""
        return self._config().build_memory(momentum, adam_betas)


class CheckpointSpec(_Strict):
    every_steps: int = Field(50, ge=0, description="Report a checkpoint every N steps (0: only at the end).")
    num_to_keep: int = Field(2, ge=1)
    full_every: int = Field(10, ge=1, description="Write a full base of the weights every K checkpoints; "
                                                  "the checkpoints store weights as XOR deltas against it "
                                                  "(1: every checkpoint self-contained).")
    background: bool = Field(True, description="Snapshot the state to host memory at the step, then compress "
                                               "and write it on a thread while training goes on; it is "
                                               "reported to Ray Train once every rank's write is complete. "
                                               "false: write it before the next step.")


class SnapshotsSpec(_Strict):
    """In-memory snapshots after each step, kept by a keeper on each node (shared memory,
    outside the worker processes), so that a restarted worker group resumes at the step
    where the failure struck instead of at the last checkpoint (rayzip.train.snapshots)."""

    enabled: bool = Field(True, description="Snapshot each rank's state after a step; a restart resumes from the "
                                            "newest step that every rank's snapshot holds, else from storage.")
    every: int | Literal["auto"] = Field("auto", description="Snapshot every N steps; auto: every step while a "
                                                             "snapshot costs at most 5% of one, else the fewest "
                                                             "steps between them that keep it there.")
    max_bytes_per_node: int = Field(DEFAULT_MAX_BYTES, gt=0, description="What a node's snapshots may hold (two slots "
                                                                  "per rank); a rank past it takes no more, "
                                                                  "with a log line.")
    directory: str | None = Field(None, description="Where each node keeps them (default /dev/shm, shared "
                                                    "memory).")
    copy_density: float = Field(1.0, ge=0, le=1, description="Local steps under combine: senders, on more than "
                                "one node: after each synchronization each rank sends this share of its error "
                                "feedback (the largest of each 1024 entries, 4-bit values) to the next node's "
                                "keeper, so that a lost node's ranks resume with it; 0: none.")

    @field_validator("every")
    @classmethod
    def _every_positive(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("snapshots.every is a number of steps >= 1, or auto")
        return v


class LocalStepsSpec(_Strict):
    """Local steps with compressed outer updates (DiLoCo-style): each worker takes ``every``
    inner steps with ``training``'s optimizer on its own batches, exchanging nothing; then the
    workers average their pseudo-gradients (the parameters at the last synchronization minus
    their own) through ``compression``'s codec, error feedback and collective, and an outer
    optimizer, SGD with Nesterov momentum, applies the average. With ``adaptive``, H is
    chosen again after every synchronization (rayzip.adaptive.every)."""

    enabled: bool = False
    every: int = Field(10, ge=1, description="H: inner steps between synchronizations (1: every step); with "
                                             "adaptive, the first H.")
    adaptive: bool = Field(False, description="Tune H after every synchronization: the smallest H in [min_every, "
                                              "max_every] whose step (compute + synchronization / H, measured) is "
                                              "within slack of max_every's. Evaluations and checkpoints then "
                                              "synchronize on their own steps.")
    min_every: int = Field(1, ge=1, description="adaptive: the least H.")
    max_every: int = Field(100, ge=1, description="adaptive: the most H.")
    slack: float = Field(0.1, ge=0, lt=1, description="adaptive: the smallest H whose predicted step is within "
                                                      "this share of max_every's.")
    outer_lr: float = Field(0.7, gt=0, description="The outer optimizer's learning rate (DiLoCo: 0.7).")
    outer_momentum: float = Field(0.5, ge=0, lt=1, description="The outer optimizer's momentum (DiLoCo, at H "
                                                               "in the hundreds under AdamW: 0.9).")
    nesterov: bool = Field(True, description="Nesterov momentum in the outer optimizer.")
    overlap: bool = Field(False, description="Send each round's pseudo-gradient while the next round's inner "
                                             "steps run: the average lands one round late (each worker goes on "
                                             "from the synchronized parameters plus its own progress of the round "
                                             "in flight), and the link's time hides behind compute. Evaluations, "
                                             "checkpoints and the last step still synchronize in full.")
    keep_unsent: bool = Field(False, description="Each worker goes on from the synchronized parameters less what "
                                                 "error feedback still holds of its own pseudo-gradients, so its "
                                                 "next gradients see its own progress that compression held back; "
                                                 "the wire is unchanged. With every: 1 this is rayzip's per-step "
                                                 "method that holds a transformer's quality under AdamW.")

    def to_config(self):
        """The library's :class:`rayzip.torch.local_steps.LocalStepsConfig`, for a loop of your
        own (``training.loop: module:function``); a tuned or overlapped H runs in rayzip's
        built-in loops only."""
        from .torch.local_steps import LocalStepsConfig

        for field, on in (("local_steps.adaptive", self.adaptive), ("local_steps.overlap", self.overlap)):
            if on:
                raise ValueError(f"{field} runs in rayzip's built-in loops only, not in a loop of your own; "
                                 f"set {field} to false")
        return LocalStepsConfig(every=self.every, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                                nesterov=self.nesterov, keep_unsent=self.keep_unsent)


class ShardingSpec(_Strict):
    """FSDP2 sharding: ``fsdp`` shards the model over every worker; ``hsdp`` shards it over
    each node's workers (``shard_size``), dense inside the node, and averages each shard
    across nodes through ``compression``'s codec and error feedback (rayzip.torch.fsdp).
    With ``codec: none`` under ``hsdp``, FSDP2's own HSDP all-reduces between nodes. With
    ``local_steps`` under ``hsdp``, each node trains H steps with FSDP2 alone, then each
    pseudo-gradient shard crosses between nodes through ``compression``'s codec (DiLoCo on
    FSDP2)."""

    enabled: bool = False
    mode: Literal["fsdp", "hsdp"] = Field("hsdp", description="fsdp: one shard group of every worker; hsdp: "
                                                            "shard groups of shard_size workers, replicated.")
    shard_size: Optional[int] = Field(None, ge=1, description="hsdp: workers per shard group (default: the "
                                                              "workers per node).")
    blocks: list[str] = Field([], description="Class names of the modules sharded one by one (default: the "
                                              "entries of every ModuleList, else the model's children).")

    def to_config(self):
        """The library's :class:`rayzip.torch.fsdp.ShardingConfig`."""
        from .torch.fsdp import ShardingConfig  # FSDP2's import, only where a job shards

        return ShardingConfig(mode=self.mode, shard_size=self.shard_size, blocks=tuple(self.blocks))


class ParameterServerSpec(_Strict):
    """Parameter-server mode (``compression.collective: ps``): shard actors on CPUs hold the
    parameters and their optimizer state; workers push compressed gradients and pull parameters."""

    shards: Optional[int] = Field(None, ge=1, description="Shard actors (default: one per node with CPUs).")
    cpus_per_shard: float = Field(1.0, ge=0, description="CPUs each shard actor reserves.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: a shard applies a step once every current worker pushed it. async: "
                            "it applies each push on arrival, and a worker waits only when it runs more "
                            "than `staleness` steps ahead of the slowest.")
    staleness: int = Field(2, ge=0, description="async: steps a worker may run ahead of the slowest.")
    pull: Literal["dense", "lossless", "codec"] = Field(
        "dense", description="What a pull sends: dense fp32 parameters; lossless, the XOR delta against "
                             "the worker's copy in compressed byte planes; or codec, the change since the "
                             "worker's copy through the compression codec, whose error the next pull carries.")


class MetricsSpec(_Strict):
    enabled: bool = Field(True, description="Export per-step Prometheus metrics through Ray's metrics agent "
                                            "(rayzip_* with run, job and rank labels).")


class AdaptiveSpec(_Strict):
    """The adaptive compression controller (see rayzip.adaptive). Ratios here are compression
    compression of the sparsifier, 1 / its density: 100 keeps 1% of the entries."""

    enabled: bool = False
    policy: str = Field("time_to_target", description="Decision rule: time_to_target (each compression's predicted "
                        "step time over the training a step does at it, learned from the loss curve: the shortest "
                        "time to any target), cost_model (the predicted step time alone, dense included, from a "
                        "fitted model of the step), "
                        "pressure (the first rule: compression in proportion to delay per byte), or "
                        "'module:Class' built from this section.")
    prometheus_url: Optional[str] = Field(
        None, description="Prometheus server to query (http://host:9090). Unset: the workers' own reports only.")
    interval: float = Field(2.0, gt=0, description="Seconds between decisions.")
    window: float = Field(10.0, gt=0, description="Seconds of history each Prometheus rate() covers.")
    min_compression: float = Field(4.0, ge=1, description="Least compression while compressing.")
    max_compression: float = Field(200.0, ge=1, description="Most compression.")
    importance_weight: float = Field(0.5, ge=0, description="Exponent on batch importance (loss over its "
                                                            "running mean): important batches are compressed less.")
    delay_weight: float = Field(1.0, ge=0, description="pressure: exponent on network pressure (delay per byte "
                                                       "over the best seen): more delay, more compression.")
    off_below: float = Field(0.1, ge=0, lt=1, description="pressure: send dense (compression off) while "
                                                          "dense communication would take less than this share of a step.")
    comm_budget: float = Field(0.25, gt=0, description="pressure: on the best link seen, compress until "
                                                       "communication takes this share of compute time.")
    query_timeout: float = Field(2.0, gt=0, description="Seconds before a Prometheus query counts as failed.")
    slack: float = Field(0.03, ge=0, lt=1, description="cost_model: the least compression whose predicted step "
                                                       "is within this share of the fastest.")
    hysteresis: float = Field(0.05, ge=0, lt=1, description="cost_model: switch only for a predicted step "
                                                            "this share faster (or for less compression).")
    probe_every: float = Field(60.0, gt=0, description="cost_model: seconds between dense probes while "
                                                       "compressing, when dense may be faster.")
    efficiency_prior: float = Field(0.2, ge=0, le=1.5, description="time_to_target: the prior mean of gamma, where a "
                                    "step at compression r does r ** -gamma dense steps' worth of training.")
    efficiency_prior_sd: float = Field(0.2, gt=0, description="time_to_target: the prior's standard deviation.")
    latency_prior: float = Field(1e-4, ge=0, description="cost_model: seconds per message until payload sizes "
                                                          "vary enough to fit it.")

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        return _builtin_or_import_path(value, ("cost_model", "time_to_target", "pressure"), "adaptive policy")

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_compression < self.min_compression:
            raise ValueError(f"max_compression ({self.max_compression}) is below min_compression ({self.min_compression})")
        if self.prometheus_url is not None and not re.match(r"https?://", self.prometheus_url):
            raise ValueError("prometheus_url must start with http:// or https://")
        return self


class JobSpec(_Strict):
    name: str = Field(..., description="Job name: lowercase letters, digits and '-', at most 50 characters.")
    model: ModelSpec = ModelSpec()
    dataset: DatasetSpec = DatasetSpec()
    training: TrainingSpec = TrainingSpec()
    scaling: ScalingSpec = ScalingSpec()
    compression: CompressionSpec = CompressionSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    metrics: MetricsSpec = MetricsSpec()
    adaptive: AdaptiveSpec = AdaptiveSpec()
    ps: ParameterServerSpec = ParameterServerSpec()
    local_steps: LocalStepsSpec = LocalStepsSpec()
    sharding: ShardingSpec = ShardingSpec()
    snapshots: SnapshotsSpec = SnapshotsSpec()

    @field_validator("ps")
    @classmethod
    def _ps_only_with_ps(cls, v: ParameterServerSpec, info: ValidationInfo) -> ParameterServerSpec:
        compression = info.data.get("compression")
        # Compared with the defaults, not with the fields written: a dumped spec sets them all.
        if compression is not None and compression.collective != "ps" and v != ParameterServerSpec():
            raise ValueError("the ps section applies only with compression.collective: ps")
        return v

    @field_validator("adaptive")
    @classmethod
    def _adaptive_not_with_ps(cls, v: AdaptiveSpec, info: ValidationInfo) -> AdaptiveSpec:
        compression = info.data.get("compression")
        if v.enabled and compression is not None and compression.collective == "ps":
            raise ValueError("the adaptive controller tunes collectives among the workers, not collective ps")
        return v

    @model_validator(mode="after")
    def _adaptive_has_a_knob(self):
        c = self.compression
        if self.adaptive.enabled and (c.codec not in ("topk", "randomk", "group_topk") or c.torch_hook is not None):
            raise ValueError(f"adaptive.enabled tunes a sparsifier's density: it needs compression.codec topk, "
                             f"randomk or group_topk on rayzip's hook (got {c.codec})")
        return self

    @model_validator(mode="after")
    def _task_fits(self):
        loop, model, data = self.training.loop, self.model.name, self.dataset.name
        if loop == "language_model" and data not in TEXT_DATASETS:
            raise ValueError(f"training.loop language_model reads text: dataset.name must be one of "
                             f"{', '.join(TEXT_DATASETS)} (got {data})")
        if loop == "language_model" and model not in ("gpt",) and model in BUILTIN_MODELS:
            raise ValueError(f"training.loop language_model needs a language model: model.name gpt "
                             f"or 'module:function' (got {model})")
        if loop == "classification" and (model == "gpt" or data in TEXT_DATASETS):
            raise ValueError(f"model {model} on dataset {data} is a language model: set training.loop: language_model")
        if self.compression.collective == "ps" and self.training.grad_clip_norm is not None:
            raise ValueError("training.grad_clip_norm clips the workers' averaged gradient; with collective ps "
                             "the shards average it")
        return self

    @model_validator(mode="after")
    def _sharding_fits(self):
        if not self.sharding.enabled:
            return self
        c = self.compression
        local = self.local_steps
        if self.sharding.mode != "hsdp":
            alone = [what for what, on in (("local_steps", local.enabled), ("adaptive", self.adaptive.enabled)) if on]
            if alone:
                raise ValueError(f"{alone[0]} with sharding.mode fsdp: one shard group holds the only replica, so "
                                 "nothing crosses between replicas to tune or synchronize; use sharding.mode hsdp "
                                 "(each node a replica)")
        others = [what for what, on in (("compression.collective: ps", c.collective == "ps"),
                                        ("local_steps.overlap", local.enabled and local.overlap),
                                        ("local_steps.keep_unsent", local.enabled and local.keep_unsent),
                                        ("compression.torch_hook", c.torch_hook is not None),
                                        ("compression.hierarchy: node", c.hierarchy == "node"),
                                        ("compression.adam_correction", c.adam_correction)) if on]
        if others:
            raise ValueError(f"sharding does not run with {', '.join(others)} yet")
        return self

    @model_validator(mode="after")
    def _muon_sees_whole_matrices(self):
        if self.training.optimizer != "muon":
            return self
        # Newton-Schulz orthogonalizes a whole weight matrix: a shard or a flat slice is none.
        where = [what for what, on in (("sharding", self.sharding.enabled),
                                       ("compression.collective ps without local_steps (the shards run the "
                                        "optimizer on flat slices)",
                                        self.compression.collective == "ps" and not self.local_steps.enabled))
                 if on]
        if where:
            raise ValueError(f"training.optimizer muon needs each weight matrix whole: not with {where[0]}; "
                             "use adamw there")
        return self

    @model_validator(mode="after")
    def _adam_has_a_home(self):
        if self.compression.adam_correction and self.training.optimizer != "adamw":
            raise ValueError("compression.adam_correction moves AdamW's moments into the hook: it needs "
                             f"training.optimizer adamw (got {self.training.optimizer})")
        return self

    @model_validator(mode="after")
    def _local_steps_fit(self):
        local, c = self.local_steps, self.compression
        if not local.enabled:
            return self
        if c.collective == "ps" and local.adaptive:
            raise ValueError("local_steps.adaptive with compression.collective ps: the shards count "
                             "synchronizations, and a new worker group resumes at their count times H, so H must "
                             "be fixed there")
        if c.collective == "ps" and local.overlap:
            raise ValueError("local_steps.overlap with compression.collective ps: pushes to the shards are "
                             "synchronous; set local_steps.overlap to false")
        if local.keep_unsent and local.overlap:
            raise ValueError("local_steps.keep_unsent with local_steps.overlap: an overlapped round already begins "
                             "from each worker's own progress in flight; set one of them to false")
        if local.keep_unsent and (c.collective == "ps" or not c.error_feedback):
            raise ValueError("local_steps.keep_unsent keeps error feedback's residual in each worker's weights: it "
                             "needs compression.error_feedback and a collective other than ps")
        if c.torch_hook is not None:
            raise ValueError(f"local_steps sends its pseudo-gradients through rayzip's codecs, not torch's "
                             f"{c.torch_hook} hook")
        if c.momentum_correction or c.adam_correction:
            raise ValueError("local_steps keeps momentum in the inner and outer optimizers: set "
                             "compression.momentum_correction and compression.adam_correction to false")
        if self.adaptive.enabled:
            raise ValueError("adaptive.enabled tunes the density of per-step compression; local steps keep the spec's "
                             "density and tune H themselves: set local_steps.adaptive instead")
        if ":" in self.training.loop:
            # A loop of your own: prepare_model counts its optimizer steps, and its reports
            # may fall inside a round (each rank's own parameters go with them).
            local.to_config()  # names what does not run there
            for what, on in (("compression.collective ps", c.collective == "ps"), ("sharding", self.sharding.enabled)):
                if on:
                    raise ValueError(f"local_steps with {what} runs in rayzip's built-in loops only, not in a loop "
                                     "of your own")
            return self
        every = local.every
        if local.adaptive:
            if not local.min_every <= every <= local.max_every:
                raise ValueError(f"local_steps.every ({every}), the first H, must lie within min_every "
                                 f"({local.min_every}) and max_every ({local.max_every})")
            return self  # evaluations and checkpoints synchronize on their own steps
        if self.training.eval_every % every:
            raise ValueError(f"training.eval_every ({self.training.eval_every}) must be a multiple of "
                             f"local_steps.every ({every}): the synchronized model is the one evaluated")
        if self.checkpoint.every_steps % every:
            raise ValueError(f"checkpoint.every_steps ({self.checkpoint.every_steps}) must be a multiple of "
                             f"local_steps.every ({every}): checkpoints are taken at synchronizations")
        return self

    @model_validator(mode="after")
    def _momentum_has_a_home(self):
        t = self.training
        if self.compression.momentum_correction and (t.optimizer != "sgd" or t.momentum == 0):
            raise ValueError("compression.momentum_correction moves SGD momentum into the hook: it needs "
                             f"training.optimizer sgd with momentum > 0 (got {t.optimizer}, momentum {t.momentum})")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?", v):
            raise ValueError("must be lowercase letters, digits and '-', start with a letter, "
                             "end with a letter or digit, at most 50 characters")
        return v


ALLOWED_MODULES_ENV = "RAYZIP_ALLOWED_MODULES"


def code_references(spec: JobSpec) -> list[tuple[str, str]]:
    """``(field, "module:function")`` for each field whose value rayzip imports and calls: a
    spec that names one runs that code on every worker."""
    fields = (("model.name", spec.model.name), ("dataset.name", spec.dataset.name), ("training.loop", spec.training.loop))
    return [(field, value) for field, value in fields if _IMPORT_PATH.match(value)]


def check_allowed_modules(spec: JobSpec, allowed: str | None = None, source: str = "spec") -> None:
    """Refuse code the operator has not allowed. ``allowed`` (default: $RAYZIP_ALLOWED_MODULES)
    is a comma-separated list of modules; a module matches an entry or lies under it
    (``models`` allows ``models.vit``). Unset: any module. Set but empty: built-ins only."""
    allowed = os.environ.get(ALLOWED_MODULES_ENV) if allowed is None else allowed
    if allowed is None:
        return
    entries = [e.strip() for e in allowed.split(",") if e.strip()]
    problems = []
    for field, value in code_references(spec):
        module = value.partition(":")[0]
        if not any(module == e or module.startswith(e + ".") for e in entries):
            problems.append(f"{field}: module {module!r} is not in {ALLOWED_MODULES_ENV} "
                            f"({', '.join(entries) or 'empty: built-ins only'})")
    if problems:
        raise SpecError(problems, source)


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            renamed = RENAMED.get(tuple(err["loc"]))
            msg = f"renamed: use {renamed}" if renamed else "unknown field"
        out.append(f"{path}: {msg}")
    return out


def _require_mapping(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise SpecError([f"(top level): expected a mapping of sections, got {type(data).__name__}"], source)


def parse_spec(data: Any, source: str = "spec") -> JobSpec:
    _require_mapping(data, source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_problems(exc), source) from None


def with_overrides(data: dict, assignments: Sequence[str], source: str = "spec") -> dict:
    """``data`` (a spec's mapping) with each ``SECTION.FIELD=VALUE`` set, VALUE read as YAML
    (``training.base_world_size=2``, ``training.betas=[0.9, 0.95]``); a new dict. Fields are
    checked when the result is parsed; a malformed assignment raises :class:`SpecError`."""
    data = copy.deepcopy(data)
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            raise SpecError([f"(override): {assignment!r} is not SECTION.FIELD=VALUE"], source)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError([f"{key}: {exc}".replace("\n", " ")], source) from None
        node = data
        for part in path[:-1]:
            if node.get(part) is None:  # absent, or an empty YAML key (``local_steps:``)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise SpecError([f"{key}: {part} is not a section"], source)
        node[path[-1]] = value
    return data


def load_spec_data(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """The YAML mapping of the spec at ``path``, with ``overrides`` (:func:`with_overrides`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError([f"(file): cannot read {path}: {exc.strerror}"], str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([f"(yaml): {exc}".replace("\n", " ")], str(path)) from None
    _require_mapping(data, str(path))
    return with_overrides(data, overrides, str(path))


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    return parse_spec(load_spec_data(path, overrides), str(path))
