"""Parameter-server mode: shard actors on CPUs hold the parameters and their optimizer state;
workers push compressed gradients and pull parameters (``compression.collective: ps``).

Usage (what ``rayzip run`` does for a spec with ``collective: ps``)::

    shards = start_shards(run_id, spec)       # one async actor per node with CPUs, by default
    names = shard_names(run_id, len(shards))  # workers: ParameterServerClient(names, spec, rank, world)
    print(shard_report(shards))               # counters and membership changes of each shard
    stop_shards(shards)
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..spec import JobSpec
from .client import ParameterServerClient, flat_gradient, flat_to_parameters, set_flat_parameters, shard_bounds
from .pull import PULL_MODES, decode_pull, encode_pull, message_nbytes
from .shard import ParameterShard, StaleGeneration, merge_optimizer_states, slice_optimizer_state

__all__ = [
    "PULL_MODES", "ParameterServerClient", "ParameterShard", "StaleGeneration", "decode_pull", "encode_pull",
    "flat_gradient", "flat_to_parameters", "merge_optimizer_states", "message_nbytes", "set_flat_parameters", "shard_bounds",
    "shard_names", "shard_report", "slice_optimizer_state", "start_shards", "stop_shards",
]

READY_TIMEOUT_S = 60.0


def shard_names(run_id: str, count: int) -> list[str]:
    return [f"rayzip-ps-{run_id}-{index}" for index in range(count)]


def start_shards(run_id: str, spec: JobSpec) -> list:
    """Start the shard actors of one run; returns their handles, which keep them alive (the
    workers find them by :func:`shard_names`). Shards outlive worker groups:
    a resize or a failed worker changes only how many pushes they wait for. A shard whose
    process dies is restarted empty, and the next worker group reloads every shard from the
    last checkpoint."""
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    count = spec.ps.shards or max(1, len(nodes))
    names = shard_names(run_id, count)
    shard_actor = ray.remote(ParameterShard)
    actors = []
    for index, name in enumerate(names):
        strategy = (NodeAffinitySchedulingStrategy(nodes[index]["NodeID"], soft=True)
                    if spec.ps.shards is None and nodes else "SPREAD")
        actors.append(shard_actor.options(name=name, num_cpus=spec.ps.cpus_per_shard, max_restarts=-1,
                                          scheduling_strategy=strategy).remote(index, spec.model_dump()))
    try:
        ray.get([actor.info.remote() for actor in actors], timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        stop_shards(actors)
        raise RuntimeError(f"{count} parameter shards of {spec.ps.cpus_per_shard} CPU each did not start within "
                           f"{READY_TIMEOUT_S:.0f} s: the cluster has {ray.available_resources().get('CPU', 0)} "
                           "CPUs free. Lower ps.cpus_per_shard or ps.shards, or add CPUs.") from None
    return actors


def shard_report(shards: list) -> list[dict]:
    """Each shard's counters, step, version and membership history."""
    return ray.get([shard.info.remote() for shard in shards])


def stop_shards(shards: list) -> None:
    for shard in shards:
        ray.kill(shard)
