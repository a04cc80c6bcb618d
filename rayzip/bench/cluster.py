"""``rayzip bench cluster``: time-to-accuracy of each method on an emulated slow network.

The same job (seed, model, per-worker shard, target) runs once per method on one real Ray
cluster whose worker nodes sit in network namespaces behind tc-shaped links (see
:mod:`.netns`). Baselines run in the same invocation: plain DDP allreduce (no hook), torch's
PowerSGD hook and torch's fp16 hook. For each method it records the time to the target
accuracy, the final accuracy, the mean step time split into compute and communication, the
bytes each worker sent as counted by rayzip (or at the torch.distributed call, for torch's
hooks; by the ring formula for plain DDP), and the bytes the kernel saw leave each worker's
interface during training.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from ..codecs import CODECS
from ..spec import CheckpointSpec, TrainingSpec, load_spec_data, with_overrides
from .netns import NetnsCluster, rate_bytes
from .timing import interleaved

__all__ = ["METHODS", "method_compression", "method_spec", "replica_held_bytes", "run_cluster_bench",
           "run_scaling_bench"]

# The benchmarks' specs ship with the package (jobs/ links to them for the examples).
DEFAULT_SPEC = Path(__file__).resolve().parent / "specs" / "bench-synthetic.yaml"

METHODS: dict[str, dict[str, Any]] = {
    "dense": {"codec": "none"},
    "fp16": {"codec": "none", "torch_hook": "fp16"},
    "powersgd": {"codec": "none", "torch_hook": "powersgd", "powersgd_rank": 2},
    "group_topk": {"codec": "group_topk", "density": 0.01, "collective": "ring"},
    "dct_quant": {"codec": "dct_quant", "bits": 8, "collective": "allgather"},
    "topk": {"codec": "topk", "density": 0.01, "collective": "ring"},
    "qsgd": {"codec": "qsgd", "collective": "allgather"},
    # The controller tunes group top-k's density from the workers' own reports (the Prometheus
    # path is the same policy; tests/system/test_adaptive.py runs it against a real Prometheus):
    # adaptive under its default policy, time_to_target; adaptive_cost under cost_model, which
    # minimises the step time alone.
    "adaptive": {"codec": "group_topk", "density": 0.01, "collective": "ring"},
    "adaptive_cost": {"codec": "group_topk", "density": 0.01, "collective": "ring"},
    # Group top-k with the collective the cost model picks (rayzip.comm.cost: at 1%, the
    # allgather at 2 workers on a fast link, the balanced allreduce from 4), and with each
    # pinned: the balanced allreduce's bytes per worker do not grow with the workers.
    "group_topk_auto": {"codec": "group_topk", "density": 0.01, "collective": "auto"},
    "group_topk_allgather": {"codec": "group_topk", "density": 0.01, "collective": "allgather"},
    "group_topk_balanced": {"codec": "group_topk", "density": 0.01, "collective": "balanced"},
    # Parameter-server mode: one shard per worker node, beside the worker (the nodes' one CPU
    # goes to the worker). ps pushes group top-k and pulls through the same codec; ps-dense
    # pushes and pulls fp32.
    "ps": {"codec": "group_topk", "density": 0.01, "collective": "ps"},
    "ps-dense": {"codec": "none", "collective": "ps"},
    # Local steps (DiLoCo-style): ``local@H`` synchronizes every H steps with a dense fp32
    # outer update, ``local_gtopk@H`` sends the pseudo-gradient through group top-k at 1%,
    # ``local_compact@H`` through group top-k at 2% with int8 values and bit-packed offsets
    # (twice the entries in fewer bytes: 80x a synchronization against 93x);
    # ``@auto`` tunes H (local_steps.adaptive, from H = 10 within 1 .. LOCAL_AUTO_MAX).
    "local": {"codec": "none"},
    "local_gtopk": {"codec": "group_topk", "density": 0.01, "collective": "allgather"},
    "local_balanced": {"codec": "group_topk", "density": 0.01, "collective": "balanced"},
    "local_compact": {"codec": "group_topk", "density": 0.02, "value_dtype": "int8", "packed_indices": True,
                      "collective": "allgather"},
    # ``local_sparse@H``: group top-k at 2% with 4-bit values and Elias-Fano coded offsets:
    # as many entries as local_compact in fewer bits each (2% rather than 1%: on the GPT the
    # count of entries decides the loss; docs/benchmarks/local-steps.md).
    "local_sparse": {"codec": "group_topk", "density": 0.02, "value_dtype": "4bit", "coded_indices": True,
                     "collective": "allgather"},
    # ``local_sparseloco@H``: SparseLoCo's outer updates: group top-k at 1% with 2-bit values
    # (a sign and one of two learned magnitudes) and Elias-Fano offsets, error feedback that
    # fades (0.95 a round) in place of outer momentum, and each entry averaged over the workers
    # that sent it.
    "local_sparseloco": {"codec": "group_topk", "density": 0.01, "value_dtype": "2bit", "coded_indices": True,
                         "collective": "allgather", "error_decay": 0.95, "combine": "senders"},
    # ``sparseloco_step``: SparseLoCo's wire every step (H = 1), each worker going on from the
    # synchronized parameters less its own unsent residual (local_steps.keep_unsent), so its
    # next gradients see its own progress that the wire held back.
    "sparseloco_step": {"codec": "group_topk", "density": 0.01, "value_dtype": "2bit", "coded_indices": True,
                        "collective": "allgather", "error_decay": 0.95, "combine": "senders"},
    # Sharded (FSDP2 inside each node, with --workers-per-node): ``hsdp`` is FSDP2's own HSDP
    # (a dense all-reduce between nodes), ``hsdp_dct`` each shard through 4-bit DCT every step,
    # ``hsdp_dct8`` the same at 8 bits (twice the bytes, for a loss nearer dense: the default on
    # shards under AdamW), ``hsdp_local@H`` local steps on shards with local_sparse's wire.
    "hsdp": {"codec": "none"},
    "hsdp_dct": {"codec": "dct_quant", "bits": 4, "collective": "allgather"},
    "hsdp_dct8": {"codec": "dct_quant", "bits": 8, "collective": "allgather"},
    "hsdp_local": {"codec": "group_topk", "density": 0.02, "value_dtype": "4bit", "coded_indices": True,
                   "collective": "allgather"},
    # ``hsdp_adaptive``: each shard through group top-k, whose density (or dense) the
    # controller sets from the shard exchanges' reports, under its default policy.
    "hsdp_adaptive": {"codec": "group_topk", "density": 0.01, "collective": "allgather"},
}
LOCAL = {"local": 10, "local_gtopk": 10, "local_balanced": 10, "local_compact": 10, "local_sparse": 10,
         "local_sparseloco": 4, "sparseloco_step": 1, "hsdp_local": 4}  # H when the method gives no @H
KEEP_UNSENT = {"sparseloco_step"}  # local_steps.keep_unsent
SHARDED = {"hsdp", "hsdp_dct", "hsdp_dct8", "hsdp_local", "hsdp_adaptive"}
LOCAL_AUTO_MAX = 50  # @auto: the most H, and the evaluation interval (each evaluation synchronizes)
PS = {"ps": {"cpus_per_shard": 0, "pull": "codec"}, "ps-dense": {"cpus_per_shard": 0, "pull": "dense"}}
ADAPTIVE = {"enabled": True, "interval": 2.0, "window": 6.0, "min_compression": 4, "max_compression": 200}
SCALING_SKIP = 10  # bench scaling: steps left out of the step time (start-up)


def _method_name(method: str) -> str:
    """The method a ``NAME@VALUE:MODIFIER`` argument names."""
    return method.partition(":")[0].partition("@")[0]


# Trailing modifiers that change the workers' training, not the method: ``:muon`` (Muon on the
# hidden matrices with AdamW's settings) and ``:bf16`` (bf16 autocast on each forward).
TRAINING_MODIFIERS = {"muon": {"optimizer": "muon"}, "bf16": {"mixed_precision": "bf16"}}


def _modifiers(method: str) -> tuple[str, dict[str, str]]:
    """A method argument's structural modifier ('' for none) and the training fields its
    trailing :data:`TRAINING_MODIFIERS` change."""
    modifiers = method.split(":")[1:]
    training: dict[str, str] = {}
    while modifiers and modifiers[-1] in TRAINING_MODIFIERS:
        training.update(TRAINING_MODIFIERS[modifiers.pop()])
    if len(modifiers) > 1:
        raise ValueError(f"method {method!r}: one modifier at most, then :muon and :bf16 last")
    return (modifiers[0] if modifiers else ""), training


def _method_base(method: str) -> tuple[str, dict[str, Any]]:
    """``group_topk@0.05`` is group_topk at a fixed density of 0.05 (any sparse method takes
    @DENSITY); ``dct_quant@4`` is dct_quant at 4 bits. Suffixes for rayzip's hook methods:
    ``:serial`` runs without overlap (the whole exchange after backward), ``:flat`` without
    the node hierarchy (every worker exchanges compressed), to compare with the default;
    ``dense:node`` is the hierarchy's exchange uncompressed (dense inside and across nodes);
    ``local@H:overlap`` sends each round during the next (local_steps.overlap). Any method
    but the sharded and parameter-server ones may end in ``:muon``: the workers' optimizer
    becomes Muon on the hidden matrices with AdamW's settings (``training.optimizer: muon``).
    Any method may end in ``:bf16``: each forward runs under bf16 autocast
    (``training.mixed_precision: bf16``)."""
    modifier, training = _modifiers(method)
    muon = "optimizer" in training
    method = method.partition(":")[0]
    name, _, value = method.partition("@")
    if muon and (name in SHARDED or name in PS):
        raise ValueError(f"method {method}:muon: Muon needs each weight matrix whole, which shards do not hold")
    hook = METHODS.get(name, {}).get("torch_hook") is None and name not in PS
    allowed = set() if name in SHARDED else {"overlap"} if name in LOCAL else \
        {"serial", "flat"} if hook and METHODS.get(name, {}).get("codec", "none") != "none" else \
        {"node"} if name == "dense" else set()
    if modifier and modifier not in allowed:
        raise ValueError(f"method {method}:{modifier}: only rayzip's hook methods take :serial and :flat, "
                         "dense :node, and local steps :overlap")
    knob = "every" if name in LOCAL else "density" if "density" in METHODS.get(name, {}) else \
        "bits" if "bits" in METHODS.get(name, {}) else None
    if name not in METHODS or (value and knob is None):
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)} "
                         "(sparse ones also as NAME@DENSITY, e.g. group_topk@0.05; dct_quant@BITS; local@H, local@auto)")
    compression = dict(METHODS[name])
    if value and knob == "every":
        if value != "auto" and (not value.isdigit() or int(value) < 1):
            raise ValueError(f"method {method!r}: {value!r} is not a number of local steps")
        return name, compression  # H goes to the local_steps section (method_spec)
    if value:
        try:
            compression[knob] = float(value) if knob == "density" else int(value)
        except ValueError:
            raise ValueError(f"method {method!r}: {value!r} is not a {knob}") from None
    if modifier == "serial":
        compression["overlap"] = False
    elif modifier == "flat":
        compression["hierarchy"] = "none"
    elif modifier == "node":  # rayzip's hook with codec none: dense, in two levels
        compression["hierarchy"] = "node"
    return name, compression


def method_compression(method: str, powersgd_start_iter: int, training: dict | None = None) -> dict[str, Any]:
    """The spec's compression section for ``method``. Sparse methods move SGD momentum into
    the hook (momentum correction) when the job's optimizer has momentum to move; under
    AdamW sparse codecs send each worker's Adam direction (Adam correction), while dense
    quantizers (DCT, QSGD) send the gradient with error feedback and AdamW runs on the
    decompressed mean, as it does on DDP's (on the GPT, DCT at 4 bits ended at 2.975 bits per
    byte this way, against 3.106 with Adam correction and DDP's 3.035)."""
    name, compression = _method_base(method)
    if name in LOCAL:
        return compression  # momentum stays in the inner optimizer
    if name == "powersgd":
        compression["powersgd_start_iter"] = powersgd_start_iter
    training = TrainingSpec.model_validate({**(training or {}), **_training(method)})
    if CODECS[compression["codec"]].sparse and training.optimizer == "sgd" and training.momentum > 0:
        compression["momentum_correction"] = True
    if CODECS[compression["codec"]].sparse and training.optimizer == "adamw" and compression.get("collective") != "ps" \
            and name not in SHARDED:  # a sharded model takes no Adam correction yet: AdamW on the mean
        compression["adam_correction"] = True  # AdamW's moments before compression (AdamCorrection)
    return compression


def _training(method: str) -> dict[str, str]:
    """The training fields a method argument changes: ``{"optimizer": "muon"}`` for ``:muon``,
    ``{"mixed_precision": "bf16"}`` for ``:bf16``."""
    return _modifiers(method)[1]


def method_spec(method: str, base: dict, slug: str, powersgd_start_iter: int = 10) -> dict:
    """The whole job spec for one method: ``base`` with the method's compression, and its
    controller or parameter-server section."""
    spec = {**base, "name": f"bench-{slug}",
            "compression": method_compression(method, powersgd_start_iter, base.get("training"))}
    if changed := _training(method):
        spec["training"] = {**spec.get("training", {}), **changed}
    name = _method_name(method)
    if name in ("adaptive", "hsdp_adaptive"):
        spec["adaptive"] = {**ADAPTIVE, "policy": "time_to_target"}
    if name == "adaptive_cost":
        spec["adaptive"] = {**ADAPTIVE, "policy": "cost_model"}
    if name in PS:
        spec["ps"] = dict(PS[name])
    if name in SHARDED:  # shard groups of a node's workers (its Ray node's local world)
        spec["sharding"] = {"enabled": True, "mode": "hsdp"}
    if name in LOCAL:
        value = method.partition(":")[0].partition("@")[2]
        tuned = value == "auto"
        every = int(value) if value and not tuned else LOCAL[name]
        # The base spec's local_steps section (its outer optimizer) holds for every local method.
        spec["local_steps"] = {**base.get("local_steps", {}), "enabled": True, "every": every,
                               "overlap": _modifiers(method)[0] == "overlap", "keep_unsent": name in KEEP_UNSENT,
                               **({"adaptive": True, "max_every": LOCAL_AUTO_MAX} if tuned else {})}
        # Evaluations and checkpoints fall on synchronizations: the next multiple of H (tuned:
        # of its bound, as each forces a synchronization, which would cap H below it).
        every = LOCAL_AUTO_MAX if tuned else every
        training = spec["training"] = dict(spec.get("training", {}))
        eval_every = training.get("eval_every", TrainingSpec().eval_every)
        training["eval_every"] = -(-eval_every // every) * every
        checkpoint = spec["checkpoint"] = dict(spec.get("checkpoint", {}))
        every_steps = checkpoint.get("every_steps", CheckpointSpec().every_steps)
        checkpoint["every_steps"] = -(-every_steps // every) * every
    return spec


def run_cluster_bench(methods: list[str], bandwidth: str, nodes: int, latency: str | None, spec_path: Path,
                      powersgd_start_iter: int = 10, log: Callable[[str], None] = print,
                      budget_steps: int | None = None, drop_to: str | None = None,
                      drop_at_step: int | None = None, workers_per_node: int = 1, repeat: int = 1,
                      kill_node_at_step: int | None = None,
                      lose_ranks: list[int] | None = None,
                      node_loss_from: tuple[str, ...] = ("memory",),
                      overrides: Sequence[str] = (),
                      arms: Sequence[tuple[str, Sequence[str]]] = ()) -> dict[str, Any]:
    """Run every method on one namespace cluster. With ``budget_steps``, each method trains
    exactly that many steps (time to target is still taken where the target is first
    reached), so final accuracies compare at the same budget. With ``drop_to``, every run
    starts at ``bandwidth`` and the links drop to ``drop_to`` once it reaches
    ``drop_at_step``; rows then carry the step time before and after the drop. With
    ``workers_per_node`` above 1, each node holds that many workers (and CPUs), linked
    unshaped inside the node: rayzip's hook then runs its node hierarchy by default.

    With ``repeat`` above 1 every method runs that many times, interleaved (round r runs the
    methods rotated by r, so that no method always runs first or last), and each row holds
    the medians, with every run's figures under ``runs`` and each figure's min and max under
    ``spread`` (see :func:`aggregate_runs`).

    With ``kill_node_at_step``, every method also runs a second time in each round, as
    ``METHOD, node lost``: once it reaches that step the last worker node is lost whole (every
    process in its namespace SIGKILLed: raylet, worker, snapshot keeper) and a replacement node
    starts at its address once Ray has marked it dead. Its row carries the recovery
    (``node_loss``) and its final metric against the uninterrupted run's. With
    ``lose_ranks``, it runs once for each rank listed, as ``METHOD, node lost (rank R)``,
    losing the node that holds that rank (:class:`_NodeLoss`) rather than the last one.

    ``node_loss_from`` says where those runs resume from: ``memory`` (snapshots on, as the
    spec has them) and ``storage`` (snapshots off, ``METHOD, node lost ... from storage``:
    Ray Train's resume from the last checkpoint, the old path). With ``storage``, every run of
    the report writes checkpoints to storage every ``checkpoint.every_steps`` (the default
    where the spec has 0), so that the runs differ in their snapshots alone.

    ``overrides`` (``SECTION.FIELD=VALUE``) change the spec for every method, and are kept in
    the report.

    ``arms`` (``(NAME, overrides)``, :func:`parse_arm`) run every method once per arm in each
    round, as ``METHOD, NAME``, with the arm's overrides on top of the spec (none: the spec as
    it is), interleaved as methods are. Each row then compares its training time per step
    after the first evaluation (``steady_step_s``) with the first arm's in the same round
    (``step_vs_first_arm``: the median of the rounds' ratios, each under
    ``step_vs_first_arm_runs``): the cost of a setting, measured against its baseline
    on the same noisy machine. Not with ``kill_node_at_step`` or ``drop_to``."""
    base = load_spec_data(spec_path, overrides)
    workers = nodes * workers_per_node
    base.setdefault("scaling", {}).update({"min_workers": workers, "max_workers": workers})
    if budget_steps is not None:
        training = base.setdefault("training", {})
        training.pop("epochs", None)
        training.update({"steps": budget_steps, "stop_at_target": False})
    if drop_to is not None:
        base.setdefault("training", {})["eval_every"] = DROP_EVAL_EVERY  # step-time resolution
    training = TrainingSpec.model_validate(base.get("training", {}))
    lm = training.loop == "language_model"
    target = training.target_val_loss if lm else training.target_accuracy
    if kill_node_at_step is not None and not 0 < kill_node_at_step < training.steps:
        raise ValueError(f"kill_node_at_step {kill_node_at_step} is not a step of the run's {training.steps}")
    if kill_node_at_step is not None and nodes < 2:
        raise ValueError("kill_node_at_step needs 2 nodes or more: one must survive with the snapshots")
    if lose_ranks and kill_node_at_step is None:
        raise ValueError("lose_ranks needs kill_node_at_step")
    check_lose_ranks(lose_ranks or [], nodes, workers_per_node)
    check_node_loss_from(node_loss_from)
    if arms and (kill_node_at_step is not None or drop_to is not None):
        raise ValueError("arms compare settings on uninterrupted runs: not with kill_node_at_step or drop_to")
    check_arms(arms)
    if "storage" in node_loss_from and kill_node_at_step is not None:
        checkpoint = base.setdefault("checkpoint", {})
        checkpoint["every_steps"] = checkpoint.get("every_steps") or CheckpointSpec().every_steps
    # (name, method, step at which a node is lost or None, the rank whose node is lost or None: the last node)
    lost = [(f"{NODE_LOST} (rank {r})", r) for r in lose_ranks] if lose_ranks else [(NODE_LOST, None)]
    storage = {**base, "snapshots": {**base.get("snapshots", {}), "enabled": False}}  # Ray Train's resume alone
    # (name, method, kill step, rank, spec)
    entries = ([(f"{m}, {arm}", m, None, None, with_overrides(base, settings, str(spec_path)))
                for m in methods for arm, settings in arms] if arms else
               [(m, m, None, None, base) for m in methods]) + \
        ([(f"{m}{suffix}{FROM_STORAGE if source == 'storage' else ''}", m, kill_node_at_step, r,
           storage if source == "storage" else base)
          for m in methods for suffix, r in lost for source in node_loss_from]
         if kill_node_at_step is not None else [])
    runs: dict[str, list[dict]] = {name: [] for name, *_ in entries}
    with NetnsCluster(nodes=nodes, bandwidth=bandwidth, latency=latency, cpus_per_node=workers_per_node) as cluster:
        log(f"cluster up: {nodes} worker nodes at {bandwidth}" + (f", {latency} latency" if latency else "")
            + (f", {workers_per_node} workers each" if workers_per_node > 1 else ""))
        for round_ in range(repeat):
            for name, method, kill_at, rank, spec in interleaved(entries, round_):
                label = name if repeat == 1 else f"{name} (run {round_ + 1} of {repeat})"
                row = _run_method(cluster, method, label, spec, powersgd_start_iter, drop_to,
                                  drop_at_step, workers_per_node, bandwidth, log, kill_node_at_step=kill_at,
                                  lose_rank=rank)
                runs[name].append({**row, "name": name})
    rows = [aggregate_runs(runs[name]) for name, *_ in entries]
    if arms:
        _compare_with_first_arm(rows, runs, methods, [arm for arm, _ in arms])
    _compare_with_uninterrupted(rows)
    sharded = any(_method_name(m) in SHARDED for m in methods)
    _compare_with_dense(rows)
    _compare_with_best_fixed(rows, "step_s", "step_vs_best_fixed")
    if drop_to is not None:
        for phase in ("before", "after"):
            _compare_with_best_fixed(rows, f"step_ms_{phase}_drop", f"{phase}_vs_best_fixed")
    return {"bandwidth": bandwidth, "latency": latency, "nodes": nodes, "workers_per_node": workers_per_node,
            "repeat": repeat,
            "metric": "val_loss" if lm else "test_accuracy",
            "target": target, "target_accuracy": None if lm else target,
            "stop_at_target": training.stop_at_target, "steps": training.steps,
            "budget_steps": budget_steps, "drop_to": drop_to, "drop_at_step": drop_at_step,
            "kill_node_at_step": kill_node_at_step, "lose_ranks": lose_ranks,
            "node_loss_from": list(node_loss_from) if kill_node_at_step is not None else None,
            "checkpoint_every_steps": base.get("checkpoint", {}).get("every_steps"),
            "spec": str(spec_path), "overrides": list(overrides), "powersgd_start_iter": powersgd_start_iter,
            "arms": [{"name": arm, "overrides": list(settings)} for arm, settings in arms] or None,
            "python": sys.version.split()[0], "methods": rows,
            "ddp_held_bytes": replica_held_bytes(base) if sharded else None}


def check_lose_ranks(ranks: list[int], nodes: int, workers_per_node: int) -> None:
    """Raise ValueError unless the bench can find the node of each rank in ``ranks``."""
    for rank in ranks:
        if not 0 <= rank < nodes * workers_per_node:
            raise ValueError(f"rank {rank} is not one of the run's {nodes * workers_per_node} workers")
        if rank > 0 and (nodes, workers_per_node) != (2, 1):
            # Only rank 0 reports its process id; with two one-worker nodes the others' is the other node.
            raise ValueError(f"rank {rank}'s node is known on 2 nodes of 1 worker only (rank 0's on any)")


def check_node_loss_from(sources: tuple[str, ...]) -> None:
    """Raise ValueError unless ``sources`` names one or more of :data:`NODE_LOSS_SOURCES`."""
    if not sources or set(sources) - set(NODE_LOSS_SOURCES):
        raise ValueError(f"{', '.join(sources) or 'nothing'}: each must be one of {', '.join(NODE_LOSS_SOURCES)}")


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME:SECTION.FIELD=VALUE[;SECTION.FIELD=VALUE...]`` as (NAME, overrides); nothing
    after the colon: the spec as it is (``"snapshots on:"``)."""
    name, sep, settings = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"{text!r} is not NAME:SECTION.FIELD=VALUE[;...] (NAME: alone for the spec as it is)")
    return name.strip(), [s.strip() for s in settings.split(";") if s.strip()]


def check_arms(arms: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Arms are two or more, named apart (their names make the rows')."""
    names = [name for name, _ in arms]
    if arms and len(arms) < 2:
        raise ValueError("arms compare settings: give two or more, the first the baseline")
    if len(set(names)) < len(names):
        raise ValueError(f"arms are named apart: {', '.join(names)}")


def _compare_with_first_arm(rows: list[dict], runs: dict[str, list[dict]], methods: list[str],
                            arms: list[str]) -> None:
    """Each arm's row against its method's first arm: the median over rounds of the ratio of
    their training time per step after the first evaluation (``steady_step_s``; a snapshot's
    copy on the training thread counts) within each round (both ran there, one after the
    other)."""
    by_name = {r["name"]: r for r in rows}
    for method in methods:
        first = runs[f"{method}, {arms[0]}"]
        for arm in arms:
            name = f"{method}, {arm}"
            ratios = [r["steady_step_s"] / b["steady_step_s"] for r, b in zip(runs[name], first)
                      if "error" not in r and "error" not in b and r.get("steady_step_s") and b.get("steady_step_s")]
            row = by_name[name]
            row.update(arm=arm, first_arm=arms[0], step_vs_first_arm_runs=ratios,
                       step_vs_first_arm=statistics.median(ratios) if ratios else None)


def replica_held_bytes(base: dict) -> dict[str, int] | None:
    """What a DDP replica of ``base``'s GPT holds after one optimizer step, counted from its
    tensors as the sharded runs count theirs (None for other models)."""
    import torch

    from ..spec import JobSpec
    from ..torch.optim import build_optimizer
    from ..train.gpt import GPT
    from ..train.records import held_bytes

    spec = JobSpec.model_validate(base)
    m = spec.model
    if m.name != "gpt":
        return None
    model = GPT(vocab=256, layers=m.layers, width=m.width, heads=m.heads, context=m.context, dropout=m.dropout)
    optimizer = build_optimizer(spec.training, model)
    tokens = torch.randint(0, 256, (1, m.context))
    torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 256), tokens.reshape(-1)).backward()
    optimizer.step()
    return held_bytes(model, optimizer)


def _run_method(cluster: NetnsCluster, method: str, label: str, base: dict, powersgd_start_iter: int,
                drop_to: str | None, drop_at_step: int | None, workers_per_node: int, bandwidth: str,
                log: Callable[[str], None], kill_node_at_step: int | None = None,
                lose_rank: int | None = None) -> dict[str, Any]:
    """One `rayzip run` of ``method`` on the cluster: its row, or ``{name, error}``. With
    ``kill_node_at_step``, a worker node is lost there and replaced (:class:`_NodeLoss`): the
    one that holds ``lose_rank``, else the last."""
    slug = re.sub(r"[^a-z0-9]+", "-", method.lower()).strip("-")
    spec = method_spec(method, base, slug, powersgd_start_iter)
    spec_file = cluster.tmp / f"{slug}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    out, progress = cluster.tmp / f"{slug}.json", cluster.tmp / f"{slug}.progress.json"
    out.unlink(missing_ok=True)
    progress.unlink(missing_ok=True)
    if drop_to is not None:
        cluster.set_bandwidth(bandwidth)
    tx_before = cluster.tx_bytes()
    started = time.time()
    log(f"running {label} ...")
    dropper = _Dropper(cluster, progress, drop_to, drop_at_step, log) if drop_to is not None else None
    loss = _NodeLoss(cluster, progress, kill_node_at_step, log, lose_rank) if kill_node_at_step is not None else None
    poll = dropper.poll if dropper is not None else loss.poll if loss is not None else None
    proc = cluster.run_in_head([cluster.python, "-m", "rayzip", "run", str(spec_file), "--summary-json", str(out),
                                "--storage-path", str(cluster.tmp / "results"), "--progress-file", str(progress)],
                               capture_output=True, text=True, timeout=3600, on_poll=poll)
    tx_after = cluster.tx_bytes()
    if proc.returncode != 0 or not out.exists():
        error = _last_error(proc.stdout + proc.stderr)
        log(f"  {label} FAILED: {error}")
        return {"name": method, "error": error, "run_s": time.time() - started}
    summary = json.loads(out.read_text())
    row = _row(method, summary, tx_before, tx_after, time.time() - started, workers_per_node)
    if loss is not None:
        row["node_loss"] = {**loss.record(), "resumes": summary.get("resumes", []),
                            "steps_lost": summary.get("steps_redone"), "restarts": summary.get("restarts")}
        if loss.killed_at is None:
            log(f"  {label}: the run ended before step {kill_node_at_step}; no node was lost")
        else:
            log(f"  {label}: node lost at step {loss.killed_at}; resumes "
                + "; ".join(f"{r.get('cause')} from {r.get('source')} at {r.get('resumed_at')}, "
                            f"{r.get('steps_lost')} steps lost, {r.get('seconds', 0):.1f} s"
                            for r in summary.get("resumes", [])))
    if drop_to is not None:
        row.update(_drop_phases(summary, dropper.dropped_at))
        log(f"  {label}: step {row['step_ms_before_drop']} ms before the drop, {row['step_ms_after_drop']} ms after")
    log(f"  {label}: {row['time_to_target_s']} s to target, final {row['metric']} {row['final_metric']:.4f}, "
        f"step {row['step_s'] * 1e3:.0f} ms" + (f"; controller {timeline_text(row['decisions'])}"
                                               if row["decisions"] else ""))
    return row


def aggregate_runs(runs: list[dict]) -> dict[str, Any]:
    """One row for a method's runs: each numeric figure's median, its [min, max] under
    ``spread``, and the runs themselves under ``runs`` (without their histories). A run that
    missed the target counts as slower than every run that reached it, so the median time to
    target is None ("missed") when half the runs or more missed. The history (for plots) is
    the run of median step time's. Failed runs are counted in ``failed_runs``; with none
    left, the row is the first failure."""
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {**runs[0], "failed_runs": len(runs)}
    by_step = sorted(ok, key=lambda r: r["step_s"])
    row = dict(by_step[(len(by_step) - 1) // 2])
    row["spread"] = {}
    for key, value in ok[0].items():
        values = [r.get(key) for r in ok]
        if key == "time_to_target_s" or isinstance(value, bool):
            continue
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            row[key] = statistics.median(values)
            row["spread"][key] = [min(values), max(values)]
    times = [r.get("time_to_target_s") for r in ok]
    median = statistics.median(math.inf if t is None else t for t in times)  # a miss: slower than any time
    row["time_to_target_s"] = None if math.isinf(median) else median
    reached = [t for t in times if t is not None]
    row["spread"]["time_to_target_s"] = [min(reached), max(reached)] if reached else None
    row["reached_runs"] = len(reached)
    row["repeats"] = len(ok)
    row["failed_runs"] = len(runs) - len(ok)
    row["runs"] = [{k: v for k, v in r.items() if k != "history"} for r in ok]
    losses = [r["node_loss"] for r in ok if r.get("node_loss")]
    if losses:
        row["node_loss"] = aggregate_node_losses(losses)
    return row


def aggregate_node_losses(losses: list[dict]) -> dict[str, Any]:
    """A node-loss row's repeated runs: each run's record under ``runs``, and the medians of
    the step it was lost at, the steps lost, the recovery (the first resume's seconds from
    the last step before the loss to the first after it) and the replacement's start, with
    their [min, max] under ``spread``. ``resumes`` are every run's, in order."""
    figures = {"killed_at_step": [loss.get("killed_at_step") for loss in losses],
               "steps_lost": [loss.get("steps_lost") for loss in losses],
               "recovery_s": [(loss.get("resumes") or [{}])[0].get("seconds") for loss in losses],
               "replaced_after_s": [loss.get("replaced_after_s") for loss in losses]}
    out: dict[str, Any] = {"runs": losses, "resumes": [r for loss in losses for r in loss.get("resumes") or []],
                           "spread": {}}
    for key, values in figures.items():
        known = [v for v in values if v is not None]
        out[key] = statistics.median(known) if known else None
        out["spread"][key] = [min(known), max(known)] if known else None
    return out


def _compare_with_best_fixed(rows: list[dict], key: str, into: str) -> None:
    """Each row's ``key`` over the lowest among the methods without a controller (DDP and
    every fixed-density run in the same report)."""
    fixed = [r[key] for r in rows if "error" not in r and r.get("decisions") is None and r.get(key)]
    for r in rows:
        r[into] = r[key] / min(fixed) if fixed and r.get(key) and "error" not in r else None


def _baseline(rows: list[dict], method: str) -> dict | None:
    """The dense row ``method`` compares with: DDP's, or dense HSDP's (the baseline that holds
    what a sharded method holds), trained as ``method`` is (``:bf16`` against ``dense:bf16``)
    where the run has that one, else the first."""
    dense = sorted((r for r in rows if "error" not in r and NODE_LOST not in r["name"]
                    and _method_name(r["name"]) in ("dense", "hsdp") and not _modifiers(r["name"])[0]),
                   key=lambda r: _method_name(r["name"]) != "dense")
    same = [r for r in dense if _training(r["name"]) == _training(method.partition(NODE_LOST)[0])]
    return (same or dense or [None])[0]


def _compare_with_dense(rows: list[dict]) -> None:
    """Each row against plain DDP in the same run: speed-up to the target, the ideal
    speed-up (DDP's step time over its compute-only step: what no compressor can beat), the
    share of it reached, and the final metric's relative difference at the same budget."""
    for row in rows:
        if "error" in row:
            continue
        dense = _baseline(rows, row["name"])
        ideal = (dense["step_s"] / dense["compute_probe_s"]) if dense and dense.get("compute_probe_s") else None
        ok = dense and dense["time_to_target_s"] and row.get("time_to_target_s")
        row["speedup_vs_dense"] = dense["time_to_target_s"] / row["time_to_target_s"] if ok else None
        row["step_speedup_vs_dense"] = dense["step_s"] / row["step_s"] if dense and row["step_s"] else None
        row["ideal_speedup"] = ideal
        row["share_of_ideal"] = row["speedup_vs_dense"] / ideal if ideal and row["speedup_vs_dense"] else None
        row["final_vs_dense"] = ((row["final_metric"] - dense["final_metric"]) / dense["final_metric"]
                                 if dense and dense["final_metric"] else None)


DROP_EVAL_EVERY = 10
SETTLE_STEPS = 20  # after the drop, steps left out while queues drain and the controller reacts


class _Dropper:
    """A poll callback for the running job: drops the links once it reaches the step, and
    keeps the step it did (``dropped_at``)."""

    def __init__(self, cluster, progress: Path, drop_to: str, drop_at_step: int, log: Callable[[str], None]):
        self.cluster, self.progress, self.log = cluster, progress, log
        self.drop_to, self.drop_at_step = drop_to, drop_at_step
        self.dropped_at: int | None = None

    def poll(self, proc) -> None:
        step = _next_step(self.progress) if self.dropped_at is None else None
        if step is not None and step >= self.drop_at_step:
            self.cluster.set_bandwidth(self.drop_to)
            self.dropped_at = step
            self.log(f"  links dropped to {self.drop_to} at step {step}")


def _reported(progress: Path) -> dict:
    """The running job's latest report (rank 0's metrics), or {} before the first."""
    try:
        return json.loads(progress.read_text())
    except (OSError, ValueError):
        return {}


def _next_step(progress: Path) -> int | None:
    """The step the running job is on (the last it reported, plus one), or None before its
    first report."""
    step = _reported(progress).get("step")
    return step + 1 if step is not None else None


NODE_LOST = ", node lost"  # the name of a method's run with a node lost (kill_node_at_step)
FROM_STORAGE = " from storage"  # ... and resumed from storage, its snapshots off
NODE_LOSS_SOURCES = ("memory", "storage")


class _NodeLoss:
    """A poll callback for the running job: once it reaches the step, loses a worker node
    whole and starts its replacement (:meth:`NetnsCluster.kill_node`,
    :meth:`NetnsCluster.replace_node`). The node is the last one, or with ``rank`` the one
    that holds it: rank 0's is found from the process id it reports with each step, and on
    two nodes any other rank's is the other node."""

    def __init__(self, cluster, progress: Path, at_step: int, log: Callable[[str], None],
                 rank: int | None = None):
        self.cluster, self.progress, self.at_step, self.log, self.rank = cluster, progress, at_step, log, rank
        self.node = cluster.nodes
        self.killed_at: int | None = None
        self.processes = 0
        self.replaced_after_s: float | None = None

    def poll(self, proc) -> None:
        step = _next_step(self.progress) if self.killed_at is None else None
        if step is None or step < self.at_step:
            return
        if self.rank is not None:
            holder = self.cluster.node_of(_reported(self.progress).get("pid", -1))
            if holder is None:  # recorded as such (rank None), not guessed
                self.log(f"  rank 0's process is on no worker node: losing node {self.node}, not rank {self.rank}'s")
                self.rank = None
            else:
                self.node = holder if self.rank == 0 else 3 - holder
        self.killed_at = step
        started = time.monotonic()
        self.processes = self.cluster.kill_node(self.node)
        self.log(f"  node {self.node} lost at step {step} ({self.processes} processes killed)")
        self.cluster.replace_node(self.node)
        self.replaced_after_s = time.monotonic() - started
        self.log(f"  node {self.node} replaced after {self.replaced_after_s:.1f} s")

    def record(self) -> dict[str, Any]:
        return {"node": self.node, "rank": self.rank, "killed_at_step": self.killed_at,
                "processes_killed": self.processes, "replaced_after_s": self.replaced_after_s}


def _compare_with_uninterrupted(rows: list[dict]) -> None:
    """Each node-loss row's final metric against its method's uninterrupted run in the same
    report."""
    plain = {r["name"]: r for r in rows if "error" not in r}
    for row in rows:
        if NODE_LOST in row["name"] and "error" not in row:
            base = plain.get(row["name"].partition(NODE_LOST)[0])
            row["final_vs_uninterrupted"] = ((row["final_metric"] - base["final_metric"]) / base["final_metric"]
                                             if base and base["final_metric"] else None)


def mean_step_s(history: list[dict], first: int, last: int) -> float | None:
    """Mean training step time between the evaluations at steps ``first`` and ``last``
    (counted from 1), from the training clock at each; None with fewer than two inside."""
    inside = [(h["step"] + 1, h["train_s"]) for h in history
              if h.get("train_s") is not None and first <= h["step"] + 1 <= last]
    if len(inside) < 2:
        return None
    (s0, t0), (s1, t1) = inside[0], inside[-1]
    return (t1 - t0) / (s1 - s0)


def _drop_phases(summary: dict, dropped_at: int | None) -> dict[str, Any]:
    """Mean training step time before the drop and after it (past SETTLE_STEPS)."""
    history = summary.get("history", [])

    def mean_ms(first: int, last: int) -> float | None:
        seconds = mean_step_s(history, first, last)
        return 1000 * seconds if seconds is not None else None

    if dropped_at is None:
        return {"dropped_at_step": None, "step_ms_before_drop": None, "step_ms_after_drop": None}
    return {"dropped_at_step": dropped_at,
            "step_ms_before_drop": mean_ms(DROP_EVAL_EVERY, dropped_at - 1),
            "step_ms_after_drop": mean_ms(dropped_at + SETTLE_STEPS, 10 ** 9),
            "controller": summary.get("adaptive")}


def _last_error(output: str) -> str:
    """The most telling line of a failed run's output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for needle in ("enforce fail", "Error:", "error:"):
        hits = [line for line in lines if needle in line]
        if hits:
            return hits[-1][:400]
    return lines[-1][:400] if lines else "no output"


def _row(method: str, s: dict, tx_before: list[int], tx_after: list[int], run_s: float,
         workers_per_node: int = 1) -> dict[str, Any]:
    mean_step, mean_comm = s.get("mean_step_s") or 0.0, s.get("mean_comm_s") or 0.0
    network = s["bytes_sent_per_worker"] - (s.get("local_bytes_per_worker") or 0)
    return {
        "name": method,
        "time_to_target_s": s.get("time_to_target_s"),
        "steps_to_target": s.get("steps_to_target"),
        "metric": s.get("metric") or "test_accuracy",
        "final_metric": s["final_val_loss"] if s.get("metric") == "val_loss" else s["final_test_accuracy"],
        "final_accuracy": s["final_test_accuracy"],
        "compute_probe_s": s.get("compute_probe_s"),  # DDP modes: forward + backward with communication off
        "steps": s["steps"],
        "step_s": mean_step,
        # The training time per step with what the training thread does between steps for
        # the run's state (a snapshot's copy) in it; evaluations and reports left out.
        "train_step_s": s["train_s"] / s["steps"] if s.get("train_s") and s.get("steps") else None,
        # The same after the first evaluation: without the start-up (the first batches, and
        # the first snapshots, which make their slot files), what a long run pays per step.
        "steady_step_s": mean_step_s(s.get("history") or [], 1, 10 ** 9),
        "comm_s": mean_comm,
        # The exchange's own time: with rayzip's overlap, partly under backward, so above comm_s.
        "busy_s": s.get("mean_busy_s"),
        # Of busy_s, the time inside torch.distributed (wire and waiting for the slower peer);
        # the rest is the codec's CPU work. Equal to comm_s where the hook is torch's own.
        "network_s": s.get("mean_network_s"),
        "compute_s": max(0.0, mean_step - mean_comm),
        "comm_source": s.get("comm_source"),
        "wire_bytes_counted": s["bytes_sent_per_worker"],  # ps: pushed
        # Of those, what did not go to workers on the same node (the hierarchy's local sums)
        "wire_bytes_network": network,
        "wire_bytes_pulled": s.get("bytes_received_per_worker") if s.get("ps") else None,
        "bytes_source": s["bytes_source"],
        "wire_bytes_interface": s.get("interface_tx_bytes"),  # rank 0's eth0 during training
        "local_bytes": s.get("local_bytes_per_worker"),  # hierarchy: to workers on the same node
        # Hierarchy: what rank 0's node sent off the node by rayzip's counts (its leader's bytes
        # off it, and each other worker's control word), to set beside wire_bytes_interface.
        "node_bytes": s.get("node_bytes"),
        "interface_vs_counted": _interface_vs_counted(s, workers_per_node),
        "interface_bytes_whole_run": statistics.mean(a - b for a, b in zip(tx_after, tx_before)),
        "dense_bytes": s["dense_bytes_per_worker"],
        # Over the bytes that leave the worker's node where the hierarchy knows them apart.
        "wire_reduction": s["dense_bytes_per_worker"] / network if network else None,
        "history": s.get("history", []),
        "decisions": decision_timeline(s.get("adaptive")),
        "efficiency": last_efficiency(s.get("adaptive")),
        "run_s": run_s,
        "held_bytes": s.get("held_bytes"),  # rank 0's parameters, gradients, optimizer state
        # Rank 0's copies of its error feedback to another node's keeper (snapshots.copy_density),
        # since its last restart: outside rayzip's wire counts, on the interface.
        "copied_bytes": (s.get("metrics") or {}).get("copied_bytes"),
        "resumed_copies": (s.get("metrics") or {}).get("resumed_copies"),  # lost ranks resumed from their copies
    }


def decision_timeline(adaptive: dict | None) -> list[dict] | None:
    """The controller's decisions that took effect: the step each was applied from, the
    compression (1.0: off) and whether it was a dense probe; None for a run without a controller."""
    if not adaptive:
        return None
    return [{"step": d["applied_step"], "compression": d["compression"], "probe": bool(d.get("inputs", {}).get("probe")),
             # time_to_target: the efficiency's posterior, and whether the decision explored
             **{k: d["inputs"][k] for k in ("gamma", "gamma_sd", "explore") if k in d.get("inputs", {})}}
            for d in adaptive["decisions"] if d.get("applied_step") is not None]


def last_efficiency(adaptive: dict | None) -> dict | None:
    """The time-to-target policy's last posterior of gamma (a step at compression r does
    r ** -gamma dense steps of training); None for other runs."""
    for d in reversed((adaptive or {}).get("decisions", [])):
        if "gamma" in d.get("inputs", {}):
            return {"gamma": d["inputs"]["gamma"], "gamma_sd": d["inputs"]["gamma_sd"],
                    "varied": d["inputs"].get("gamma_varied")}
    return None


def timeline_text(decisions: list[dict] | None, most: int = 8) -> str:
    """``100×, off@31 (probe), 144×@52, ...``: each compression from the step it took effect."""
    if not decisions:
        return "–"
    parts = [("off" if d["compression"] <= 1.0 else f"{d['compression']:.0f}×") + f"@{d['step']}" + (" (probe)" if d["probe"] else "")
             for d in decisions]
    return ", ".join(parts[:most]) + (f", … {len(parts) - most} more" if len(parts) > most else "")


def _interface_vs_counted(s: dict, workers_per_node: int) -> float | None:
    """Rank 0's interface bytes over what rayzip counted leaving its node: the node's count
    with a hierarchy, rank 0's own when it is alone on its node. None where the bytes are a
    formula (plain DDP) or the node's count is unknown (several workers, no hierarchy)."""
    iface, counted = s.get("interface_tx_bytes"), s.get("node_bytes")
    if counted is None and workers_per_node == 1:
        counted = s.get("bytes_sent_per_worker")
    return iface / counted if iface and counted and s.get("bytes_source") == "counted" else None


def run_scaling_bench(methods: list[str], node_counts: list[int], bandwidth: str, spec_path: Path,
                      steps: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Weak scaling: each method at each worker count, every worker with the same batch, on a
    fresh namespace cluster per count. Throughput T_N = N * batch / step time, the step time
    taken past the first ``SCALING_SKIP`` steps; efficiency E(N) = T_N / (N * T_1)."""
    rows = []
    batch = TrainingSpec.model_validate(yaml.safe_load(spec_path.read_text()).get("training", {})).batch_size
    for nodes in node_counts:
        report = run_cluster_bench(methods, bandwidth, nodes, None, spec_path, log=log, budget_steps=steps)
        for r in report["methods"]:
            row = {"name": r["name"], "workers": nodes, "error": r.get("error")}
            if "error" not in r:
                step_s = mean_step_s(r.get("history", []), SCALING_SKIP + 1, 10 ** 9)
                step_s = step_s if step_s is not None else r["step_s"]
                per_step = max(r["steps"], 1)
                ring_bytes = r["dense_bytes"] / per_step  # 2(n-1)/n * S: a dense fp32 ring allreduce
                row.update({"step_s": step_s, "compute_s": r["compute_s"], "comm_s": r["comm_s"],
                            "bytes_per_step": r["wire_bytes_counted"] / per_step, "ring_formula_bytes": ring_bytes,
                            "ring_formula_s": ring_bytes / rate_bytes(bandwidth),
                            "throughput": nodes * batch / step_s, "wire_bytes_counted": r["wire_bytes_counted"],
                            "wire_bytes_pulled": r.get("wire_bytes_pulled"), "final_accuracy": r["final_accuracy"]})
            rows.append(row)
    for row in rows:
        one = next((r for r in rows if r["name"] == row["name"] and r["workers"] == 1 and not r.get("error")), None)
        ok = one is not None and not row.get("error")
        row["efficiency"] = row["throughput"] / (row["workers"] * one["throughput"]) if ok else None
    return {"bandwidth": bandwidth, "steps": steps, "batch_per_worker": batch, "spec": str(spec_path),
            "node_counts": node_counts, "cpu_cores": os.cpu_count(), "python": sys.version.split()[0], "rows": rows}



def render_scaling_table(report: dict):
    from rich.table import Table

    table = Table(title=f"rayzip bench scaling: {report['bandwidth']} links, {report['steps']} steps, "
                        f"batch {report['batch_per_worker']} per worker, {report['cpu_cores']} CPU cores in all")
    for col in ("method", "workers", "step ms", "compute ms", "comm ms", "MB/step", "ring formula MB (ms)",
                "examples/s", "E(N)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in report["rows"]:
        if r.get("error"):
            table.add_row(r["name"], str(r["workers"]), "failed", "-", "-", "-", "-", "-", "-")
            continue
        ring = (f"{r['ring_formula_bytes'] / 1e6:.2f} ({r['ring_formula_s'] * 1e3:.0f})"
                if r.get("ring_formula_bytes") is not None else "-")
        table.add_row(r["name"], str(r["workers"]), f"{r['step_s'] * 1e3:.0f}", f"{r['compute_s'] * 1e3:.0f}",
                      f"{r['comm_s'] * 1e3:.0f}",
                      f"{r['bytes_per_step'] / 1e6:.2f}" if r.get("bytes_per_step") is not None else "-", ring,
                      f"{r['throughput']:.0f}", f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-")
    return table


def _spread(row: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """' [min–max]' of a repeated figure, or '' for a single run."""
    bounds = row.get("spread", {}).get(key)
    if not bounds:
        return ""
    return " [" + fmt.format(bounds[0] * scale) + "–" + fmt.format(bounds[1] * scale) + "]"


def _number(value, fmt: str, missing: str = "–") -> str:
    """``fmt`` of ``value``, or ``missing`` for None."""
    return missing if value is None else fmt.format(value)


def _markdown(head: list[str], rows: list[dict], cells, failed=lambda r: [r["name"], f"failed: {r['error'][:60]}"]) -> str:
    """A Markdown table: ``cells(row)`` for each row, ``failed(row)``'s leading cells (the
    rest left empty) for a row that holds an error."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("error"):
            lead = failed(r)
            lines.append("| " + " | ".join(lead) + " |" + " |" * (len(head) - len(lead)))
        else:
            lines.append("| " + " | ".join(cells(r)) + " |")
    return "\n".join(lines)


def _network(row: dict) -> int:
    """Bytes a worker sent, less those to workers on its own node (reports before the
    hierarchy have no such split)."""
    return row.get("wire_bytes_network", row["wire_bytes_counted"])


def render_table(report: dict):
    from rich.table import Table

    budget = report.get("budget_steps")
    lm = report.get("metric") == "val_loss"
    target = report.get("target", report.get("target_accuracy"))
    per_node = report.get("workers_per_node", 1)
    table = Table(title=f"rayzip bench cluster: {report['nodes']} nodes"
                        + (f" x {per_node} workers" if per_node > 1 else "") + f" at {report['bandwidth']}, "
                        f"target {'validation loss' if lm else 'accuracy'} {target}"
                        + (f", {budget or report.get('steps')} steps each"
                           if budget or report.get("stop_at_target") is False else ", stopping at the target"))
    for col in ("method", "to target", "vs DDP", "of ideal", "final bpb" if lm else "final acc", "step ms (comm)",
                "MB sent", "MB pulled", "MB off node", "MB on iface", "iface/counted", "wire reduction"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for r in report["methods"]:
        if "error" in r:
            table.add_row(r["name"], "failed", *["-"] * 10)
            continue
        ttt = (f"{r['time_to_target_s']:.1f} s " + (_spread(r, "time_to_target_s", "{:.1f}") or
                                                     f"({r.get('steps_to_target')} steps)")
               if r["time_to_target_s"] else "missed")
        speed = f"{r['speedup_vs_dense']:.2f}x" if r["speedup_vs_dense"] else "-"
        iface = f"{r['wire_bytes_interface'] / 1e6:.2f}" if r["wire_bytes_interface"] is not None else "-"
        share = f"{r['share_of_ideal']:.0%}" if r.get("share_of_ideal") else "-"
        final = r.get("final_metric", r.get("final_accuracy"))
        table.add_row(r["name"], ttt, speed, share, f"{final:.4f}",
                      f"{r['step_s'] * 1e3:.0f} ({r['comm_s'] * 1e3:.0f})" + _spread(r, "step_s", "{:.0f}", 1e3), f"{_network(r) / 1e6:.2f}",
                      f"{r['wire_bytes_pulled'] / 1e6:.2f}" if r.get("wire_bytes_pulled") is not None else "-",
                      f"{r['node_bytes'] / 1e6:.2f}" if r.get("node_bytes") is not None else "-", iface,
                      f"{r['interface_vs_counted']:.3f}" if r.get("interface_vs_counted") else "-",
                      f"{r['wire_reduction']:.1f}x" if r["wire_reduction"] else "-")
    return table


def markdown_table(report: dict) -> str:
    """The cluster report as a Markdown table, for the README (generated, not typed)."""
    if report.get("arms"):  # whatever the methods and the layout: the settings are what it compares
        return _arms_table(report)
    if any(_method_name(r["name"]) in SHARDED for r in report["methods"]):
        return _sharded_table(report)
    if report.get("workers_per_node", 1) > 1:
        return _hierarchy_table(report)
    if report.get("drop_to"):
        return _drop_table(report)
    if report.get("kill_node_at_step"):
        return _node_loss_table(report)
    lm = report.get("metric") == "val_loss"
    rows = [r for r in report["methods"] if "error" not in r]
    pulled = any(r.get("wire_bytes_pulled") is not None for r in rows)
    iface = any(r.get("wire_bytes_interface") for r in rows)
    head = ["method", "time to target", "vs DDP", "of ideal", "steps to target",
            "final val bpb" if lm else "final acc", "final vs DDP", "step ms (comm)",
            "MB pushed / worker" if pulled else "MB sent / worker"] + (["MB pulled / worker"] if pulled else []) \
        + (["MB on rank 0's eth0"] if iface else []) + ["wire reduction"]
    controlled = any(r.get("decisions") for r in rows)
    head += ["step vs best fixed", "controller"] if controlled else []

    def cells(r: dict) -> list[str]:
        ttt = (f"{r['time_to_target_s']:.1f} s" + _spread(r, "time_to_target_s", "{:.1f}")
               if r.get("time_to_target_s") else "not reached")
        if r.get("repeats") and 0 < r.get("reached_runs", r["repeats"]) < r["repeats"]:
            ttt += f", {r['reached_runs']} of {r['repeats']} runs reached it"
        return ([r["name"], ttt, _number(r.get("speedup_vs_dense") or None, "{:.2f}×"),
                 _number(r.get("share_of_ideal") or None, "{:.0%}"), str(r.get("steps_to_target") or "–"),
                 f"{r.get('final_metric', r.get('final_accuracy')):.4f}", _number(r.get("final_vs_dense"), "{:+.1%}"),
                 f"{r['step_s'] * 1e3:.0f} ({r['comm_s'] * 1e3:.0f})" + _spread(r, "step_s", "{:.0f}", 1e3),
                 f"{_network(r) / 1e6:.1f}"]
                + ([_mb(r.get("wire_bytes_pulled"))] if pulled else [])
                + ([_mb(r.get("wire_bytes_interface"))] if iface else [])
                + [_number(r.get("wire_reduction") or None, "{:.1f}×")]
                + ([_number(r.get("step_vs_best_fixed"), "{:.2f}×"), timeline_text(r.get("decisions"))]
                   if controlled else []))
    return _markdown(head, report["methods"], cells)


def headline_markdown_table(report: dict) -> str:
    """The cluster report's headline columns, narrow enough for the README: time to target,
    its speed-up, the final quality, the step and the bytes."""
    lm = report.get("metric") == "val_loss"
    head = ["method", "time to target", "vs DDP", "final val bpb" if lm else "final acc", "step ms",
            "MB sent / worker", "wire reduction"]

    def cells(r: dict) -> list[str]:
        return [r["name"], f"{r['time_to_target_s']:.1f} s" if r.get("time_to_target_s") else "not reached",
                _number(r.get("speedup_vs_dense") or None, "{:.2f}×"),
                f"{r.get('final_metric', r.get('final_accuracy')):.4f}", f"{r['step_s'] * 1e3:.0f}",
                f"{_network(r) / 1e6:.1f}", _number(r.get("wire_reduction") or None, "{:.1f}×")]

    return _markdown(head, report["methods"], cells)


def _node_loss_table(report: dict) -> str:
    """Each method uninterrupted and with a node lost: where the lost run resumed, from
    where, the steps it did again, how long from the last step before the loss to the first
    after it, and its final metric against the uninterrupted run's."""
    lm = report.get("metric") == "val_loss"
    head = ["run", "node lost at", "resumed at", "from", "cause", "steps lost", "recovery", "replacement up after",
            "final val bpb" if lm else "final acc", "vs uninterrupted", "MB sent / worker", "MB copied / worker"]

    def cells(r: dict) -> list[str]:
        loss = r.get("node_loss") or {}
        resumes = loss.get("resumes") or []
        each = lambda key, fmt="{}": ", ".join(fmt.format(x.get(key)) for x in resumes) or "–"  # noqa: E731
        if "runs" in loss:  # repeated: each run's step and steps lost, the medians [min–max] of the times
            runs = loss["runs"]
            return [r["name"], ", ".join(str(x.get("killed_at_step")) for x in runs), each("resumed_at"),
                    ", ".join(sorted({str(x.get("source")) for x in resumes})) or "–",
                    ", ".join(sorted({str(x.get("cause")) for x in resumes})) or "–",
                    ", ".join(str(x.get("steps_lost")) for x in runs),
                    _number(loss.get("recovery_s"), "{:.1f} s") + _spread(loss, "recovery_s", "{:.1f}"),
                    _number(loss.get("replaced_after_s"), "{:.1f} s") + _spread(loss, "replaced_after_s", "{:.1f}"),
                    f"{r.get('final_metric', r.get('final_accuracy')):.4f}" + _spread(r, "final_metric", "{:.4f}"),
                    _number(r.get("final_vs_uninterrupted"), "{:+.2%}"), f"{_network(r) / 1e6:.1f}", _copied(r)]
        return [r["name"], str(loss.get("killed_at_step") or "–"), each("resumed_at"), each("source"), each("cause"),
                str(loss["steps_lost"]) if loss else "–", each("seconds", "{:.1f} s"),
                _number(loss.get("replaced_after_s"), "{:.1f} s"),
                f"{r.get('final_metric', r.get('final_accuracy')):.4f}",
                _number(r.get("final_vs_uninterrupted"), "{:+.2%}"), f"{_network(r) / 1e6:.1f}", _copied(r)]

    return _markdown(head, report["methods"], cells)


def _arms_table(report: dict) -> str:
    """Each method under each arm: its settings, its training time per step after the first
    evaluation (a snapshot's copy in it) and over the whole run, the step alone (comm in
    brackets), the median of its rounds' ratios to the first arm's (each round's after it),
    its final metric and bytes."""
    lm = report.get("metric") == "val_loss"
    settings = {a["name"]: "; ".join(f"`{o}`" for o in a["overrides"]) or "the spec's" for a in report["arms"]}
    first = report["arms"][0]["name"]
    head = ["run", "settings", "ms per step", "whole run", "step ms (comm)", f"per step vs {first}",
            "final val bpb" if lm else "final acc", "MB sent / worker", "MB copied / worker"]

    def cells(r: dict) -> list[str]:
        each = ", ".join(f"{x:.3f}" for x in r.get("step_vs_first_arm_runs") or [])
        ratio = _number(r.get("step_vs_first_arm"), "{:.3f}×") + (f" ({each})" if r.get("arm") != first and each
                                                                   else "")
        return [r["name"], settings.get(r.get("arm"), "–"),
                _number(r["steady_step_s"] * 1e3 if r.get("steady_step_s") else None, "{:.0f}")
                + _spread(r, "steady_step_s", "{:.0f}", 1e3),
                _number(r["train_step_s"] * 1e3 if r.get("train_step_s") else None, "{:.0f}"),
                f"{r['step_s'] * 1e3:.0f} ({r['comm_s'] * 1e3:.0f})" + _spread(r, "step_s", "{:.0f}", 1e3), ratio,
                f"{r.get('final_metric', r.get('final_accuracy')):.4f}", f"{_network(r) / 1e6:.1f}", _copied(r)]

    return _markdown(head, report["methods"], cells)


def _copied(row: dict) -> str:
    """Rank 0's residual copies in MB; "–" where it took none (or the report predates them)."""
    return _number((row.get("copied_bytes") or 0) / 1e6 or None, "{:.1f}")


def _mb(nbytes) -> str:
    return _number(None if nbytes is None else nbytes / 1e6, "{:.1f}")


def _drop_table(report: dict) -> str:
    """A run whose links dropped mid-way: step time before and after, against the best fixed
    method in the same phase."""
    head = ["method", "to target", "vs DDP", f"final acc ({report.get('budget_steps') or report.get('steps')} steps)",
            "step ms before the drop", "vs best fixed", "step ms after", "vs best fixed", "MB sent", "controller"]

    def cells(r: dict) -> list[str]:
        ttt = f"{r['time_to_target_s']:.1f} s ({r.get('steps_to_target')} steps)" if r.get("time_to_target_s") \
            else "not reached"
        return [r["name"], ttt, _number(r.get("speedup_vs_dense"), "{:.2f}×"), f"{r['final_accuracy']:.4f}",
                _number(r.get("step_ms_before_drop"), "{:.0f}"), _number(r.get("before_vs_best_fixed"), "{:.2f}×"),
                _number(r.get("step_ms_after_drop"), "{:.0f}"), _number(r.get("after_vs_best_fixed"), "{:.2f}×"),
                _mb(_network(r)), _drop_timeline(r)]
    return _markdown(head, report["methods"], cells)


def _drop_timeline(r: dict) -> str:
    decisions = r.get("decisions")
    if decisions and r.get("dropped_at_step"):
        return timeline_text(decisions) + f" (drop@{r['dropped_at_step']})"
    return timeline_text(decisions)


def scaling_markdown_table(report: dict) -> str:
    """A ``bench scaling`` report as the README's Markdown table."""
    head = ["method", "workers", "step ms", "compute ms", "comm ms", "MB / step", "ring formula MB",
            "examples/s", "E(N)"]

    def cells(r: dict) -> list[str]:
        per_step, ring = r.get("bytes_per_step"), r.get("ring_formula_bytes")
        return [r["name"], str(r["workers"]), f"{r['step_s'] * 1e3:.0f}", f"{r['compute_s'] * 1e3:.0f}",
                f"{r['comm_s'] * 1e3:.0f}", _number(None if per_step is None else per_step / 1e6, "{:.2f}"),
                _number(None if ring is None else ring / 1e6, "{:.2f}"), f"{r['throughput']:.0f}",
                _number(r.get("efficiency"), "{:.2f}")]
    return _markdown(head, report["rows"], cells, failed=lambda r: [r["name"], str(r["workers"]), "failed"])


def _sharded_table(report: dict) -> str:
    """Sharded methods: time to target and final loss against dense HSDP, bytes between
    nodes, and what each rank holds against a DDP replica (both counted from tensors)."""
    replica = sum((report.get("ddp_held_bytes") or {}).values()) or None
    head = ["method", "time to target", "vs dense HSDP", "final val bpb", "final vs dense HSDP", "step ms",
            "MB between nodes / worker", "wire reduction", "MB held / rank", "held vs DDP"]

    def cells(r: dict) -> list[str]:
        held = sum((r.get("held_bytes") or {}).values()) or None
        ttt = (f"{r['time_to_target_s']:.1f} s" + _spread(r, "time_to_target_s", "{:.1f}")
               if r.get("time_to_target_s") else "not reached")
        return [r["name"], ttt, _number(r.get("speedup_vs_dense") or None, "{:.2f}×"),
                f"{r['final_metric']:.4f}", _number(r.get("final_vs_dense"), "{:+.1%}"),
                f"{r['step_s'] * 1e3:.0f}" + _spread(r, "step_s", "{:.0f}", 1e3), f"{_network(r) / 1e6:.1f}",
                _number(r.get("wire_reduction") or None, "{:.1f}×"), _mb(held),
                _number(held / replica if held and replica else None, "{:.3f}×")]
    return _markdown(head, report["methods"], cells)


def _hierarchy_table(report: dict) -> str:
    """Several workers per node: what left rank 0's node, counted and on its interface."""
    head = ["method", "final acc", "step ms (comm)", "MB sent / worker (hierarchy: off its node)",
            "MB off rank 0's node, counted", "MB on rank 0's interface", "interface / counted"]

    def cells(r: dict) -> list[str]:
        node, iface = r.get("node_bytes"), r.get("wire_bytes_interface") or None
        return [r["name"], f"{r['final_accuracy']:.4f}", f"{r['step_s'] * 1e3:.0f} ({r['comm_s'] * 1e3:.0f})",
                f"{_network(r) / 1e6:.2f}", _number(None if node is None else node / 1e6, "{:.2f}"),
                _number(None if iface is None else iface / 1e6, "{:.2f}"),
                _number(r.get("interface_vs_counted") or None, "{:.3f}")]
    return _markdown(head, report["methods"], cells)


def render_drop_table(report: dict):
    """Step time before and after the links drop, against the best fixed method."""
    from rich.table import Table

    table = Table(title=f"links {report['bandwidth']} -> {report['drop_to']} at step {report['drop_at_step']}")
    for col in ("method", "step ms before", "vs best fixed", "step ms after", "vs best fixed ", "final acc"):
        table.add_column(col, justify="left" if col == "method" else "right")

    for r in report["methods"]:
        if "error" in r:
            continue
        table.add_row(r["name"], _number(r.get("step_ms_before_drop"), "{:.0f}", "-"),
                      _number(r.get("before_vs_best_fixed"), "{:.2f}x", "-"),
                      _number(r.get("step_ms_after_drop"), "{:.0f}", "-"),
                      _number(r.get("after_vs_best_fixed"), "{:.2f}x", "-"), f"{r['final_accuracy']:.4f}")
    return table


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = report.get("metric") or "test_accuracy"
    target = report.get("target", report.get("target_accuracy"))
    controlled = [r for r in report["methods"] if r.get("decisions")]
    if controlled:
        fig, (ax, compression_ax) = plt.subplots(2, 1, figsize=(7, 6.4), dpi=120, gridspec_kw={"height_ratios": [2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in report["methods"]:
        points = [(h["train_s"], h[metric]) for h in r.get("history", []) if h.get(metric) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=".", label=r["name"])
    if controlled:
        for r in controlled:  # the compression in force from each applied decision to the run's end
            steps = [d["step"] for d in r["decisions"]] + [r.get("steps") or r["decisions"][-1]["step"]]
            factors = [d["compression"] for d in r["decisions"]]
            compression_ax.step(steps, factors + factors[-1:], where="post", label=r["name"])
        if report.get("drop_to") and controlled[0].get("dropped_at_step"):
            compression_ax.axvline(controlled[0]["dropped_at_step"], color="grey", linestyle=":", label="link drop")
        compression_ax.set_yscale("log")
        compression_ax.set_xlabel("step")
        compression_ax.set_ylabel("compression, 1 / density (1: off)")
        compression_ax.grid(alpha=0.3)
        compression_ax.legend()
    if target:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation loss (bits/byte)" if metric == "val_loss" else "test accuracy")
    ax.set_title(f"{report['nodes']} nodes at {report['bandwidth']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
