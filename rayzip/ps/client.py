"""A worker's side of parameter-server mode: push compressed gradients, pull parameters.

The flattened gradient (parameters in model order) is cut into the shards' slices. Each
slice is a segment of the engine's :class:`~rayzip.engine.SegmentEncoder` (error feedback,
or momentum correction, and the codec), as a segment of an allreduce would be; its wire bytes travel to the shard as a numpy buffer in one actor call (Ray moves
buffers over 100 KB through the object store without pickling them). The pull for the next
step is issued at once behind the push; the worker waits once, for all shards. Bytes are
counted from the payloads: ``bytes_sent`` is what was pushed, ``bytes_received`` what
was pulled.

Usage (inside a Ray Train worker, every rank)::

    client = ParameterServerClient(shard_names, spec, rank, world)
    generation = ...                                  # one id per worker group, from rank 0
    if rank == 0:
        client.begin_group(generation, initial=None or {"params", "optimizer", "step"})
    dist.barrier()
    step = client.join(generation, model)             # pulls the parameters into the model
    ...
    loss.backward()
    client.update(model, step, lr)                    # instead of optimizer.step()
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch

from ..codecs import NonFiniteError
from ..spec import JobSpec
from ..engine import SegmentEncoder, StepStats
from ..xp import asnumpy
from .pull import decode_pull, message_nbytes
from .shard import merge_optimizer_states, slice_optimizer_state

__all__ = ["ParameterServerClient", "flat_gradient", "flat_to_parameters", "set_flat_parameters", "shard_bounds"]


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous slices of the flat fp32 parameters, equal in bytes to within one element."""
    if shards < 1:
        raise ValueError("at least one shard")
    cuts = [numel * i // shards for i in range(shards + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    """The gradient of every parameter, in model order, as one float32 vector (zeros where
    a parameter took no gradient this step)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()])


def flat_to_parameters(model: torch.nn.Module, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """``flat`` cut into the model's parameters, by name, as CPU tensors sharing its memory."""
    out, offset = {}, 0
    for name, p in model.named_parameters():
        out[name] = torch.from_numpy(flat[offset: offset + p.numel()]).view_as(p)
        offset += p.numel()
    return out


@torch.no_grad()
def set_flat_parameters(model: torch.nn.Module, flat: np.ndarray) -> None:
    for p, value in zip(model.parameters(), flat_to_parameters(model, flat).values()):
        p.copy_(value)


class ParameterServerClient:
    """One worker's connection to the shards: the engine's encoder (codec and memory), its copy
    of each slice, counters."""

    # Ranks whose error feedback a checkpoint re-shards on a resize: none. After a resize a
    # worker reloads its own part only where it held the shards' step; else its residuals
    # start afresh (the shards hold the state that must survive).
    holders = None

    def __init__(self, shard_names: list[str], spec: JobSpec, rank: int, world: int, momentum: float | None = None):
        self.shards = [ray.get_actor(name) for name in shard_names]
        self.spec, self.rank, self.world = spec, rank, world
        self.encoder = SegmentEncoder(spec.compression, rank, momentum)
        self.generation: str | None = None
        self.bounds: list[tuple[int, int]] = []
        self.copies: list[np.ndarray | None] = [None] * len(self.shards)
        self.step = 0
        self.last_step: StepStats | None = None
        self.totals = {"steps": 0, "bytes_sent": 0, "bytes_received": 0, "comm_s": 0.0, "network_s": 0.0}

    # --- a worker group's start ------------------------------------------------------------
    def begin_group(self, generation: str, numel: int, initial: dict | None = None) -> int:
        """Rank 0: load the shards from ``initial`` (``params``, optional ``optimizer`` and
        ``step``) if any holds nothing, then start ``generation`` on every shard at the
        furthest step any shard reached. Returns that step."""
        infos = ray.get([s.info.remote() for s in self.shards])
        bounds = shard_bounds(numel, len(self.shards))
        if not all(info["initialized"] for info in infos):
            if initial is None:
                raise ValueError("the parameter shards hold nothing yet and no initial state was given")
            self.load_shards(initial, bounds)
            infos = ray.get([s.info.remote() for s in self.shards])
        elif [(i["start"], i["stop"]) for i in infos] != bounds:
            raise ValueError(f"the shards hold slices {[(i['start'], i['stop']) for i in infos]}, "
                             f"the model needs {bounds}: a different model?")
        step = max(info["step"] for info in infos)
        ray.get([s.begin.remote(generation, self.world, step) for s in self.shards])
        return step

    def load_shards(self, initial: dict, bounds: list[tuple[int, int]]) -> None:
        params = np.asarray(initial["params"], dtype=np.float32)
        optimizer = initial.get("optimizer")
        ray.get([shard.load.remote(a, b, params[a:b],
                                   slice_optimizer_state(optimizer, a, b, params.size) if optimizer else None,
                                   int(initial.get("step", 0)))
                 for shard, (a, b) in zip(self.shards, bounds)])

    def join(self, generation: str, model: torch.nn.Module) -> int:
        """Every rank, after rank 0's :meth:`begin_group`: pull the whole model (dense, as this
        worker holds no copy) and return the step to resume at."""
        self.generation = generation
        numel = sum(p.numel() for p in model.parameters())
        self.bounds = shard_bounds(numel, len(self.shards))
        self.copies = [None] * len(self.shards)
        infos = ray.get([s.info.remote() for s in self.shards])
        self.step = max(info["step"] for info in infos)
        flat, _, _ = self._pull(self.step)
        set_flat_parameters(model, flat)
        return self.step

    # --- a step ---------------------------------------------------------------------------
    def update(self, model: torch.nn.Module, step: int, lr: float) -> StepStats:
        """Push this step's gradient, pull the parameters for the next step into ``model``."""
        start = time.perf_counter()
        compressed = step >= self.spec.compression.warmup_steps
        codec = self.encoder.codec_for(compressed)
        grad = flat_gradient(model)
        stats = StepStats(step=step, compressed=compressed, density=codec.density,
                          numel=grad.numel(), dense_bytes=4 * grad.numel(), buckets=[b - a for a, b in self.bounds])
        pushes = []
        for index, (shard, (a, b)) in enumerate(zip(self.shards, self.bounds)):
            try:
                payload = self.encoder.encode(f"shard{index}", grad[a:b], compressed)
            except NonFiniteError as exc:
                first = exc.first_index
                where = f" (flat element {a + first} of the model)" if first is not None else ""
                self.abort(f"rank {self.rank}, step {step}, gradient slice of shard {index}: {exc}{where}")
            wire = asnumpy(payload.to_array())  # on a GPU, only the compressed bytes reach the host
            stats.bytes_sent += int(wire.nbytes)
            pushes.append(shard.push.remote(self.generation, self.rank, step, lr, codec.name, codec.params(), wire))
        flat, received, network_s = self._pull(step + 1, pushes)
        set_flat_parameters(model, flat)
        stats.bytes_received = received
        stats.network_s = network_s
        stats.comm_s = time.perf_counter() - start
        self.step = step + 1
        self.last_step = stats
        self.totals["steps"] += 1
        for key in ("bytes_sent", "bytes_received", "comm_s", "network_s"):
            self.totals[key] += getattr(stats, key)
        return stats

    def abort(self, reason: str) -> None:
        """Stop every worker of the group: the shards answer their pulls with ``reason``
        (the others would otherwise wait for this worker's push). Raises
        :class:`NonFiniteError` here."""
        ray.get([shard.abort.remote(self.generation, self.rank, reason) for shard in self.shards])
        raise NonFiniteError(reason)

    def _pull(self, step: int, pushes: list | None = None) -> tuple[np.ndarray, int, float]:
        pulls = [shard.pull.remote(self.generation, self.rank, step) for shard in self.shards]
        waited = time.perf_counter()
        if pushes:
            ray.get(pushes)  # a failed push raises here, naming the shard's reason
        messages = ray.get(pulls)
        network_s = time.perf_counter() - waited
        for message in messages:
            if message["kind"] == "abort":  # another worker's gradient was not finite
                raise NonFiniteError(message["reason"])
        received = 0
        for index, (message, (a, b)) in enumerate(zip(messages, self.bounds)):
            self.copies[index] = decode_pull(message, self.copies[index], b - a)
            received += message_nbytes(message)
        return np.concatenate(self.copies), received, network_s

    # --- checkpoints ------------------------------------------------------------------------
    def server_state(self) -> dict:
        """The shards' parameters (flat), merged optimizer state and step."""
        states = ray.get([s.state.remote() for s in self.shards])
        return {"params": np.concatenate([s["params"] for s in states]),
                "optimizer": merge_optimizer_states([s["optimizer"] for s in states],
                                                    [s["stop"] - s["start"] for s in states]),
                "step": min(s["step"] for s in states)}

    def state_dict(self) -> dict:
        return {"step": self.step, **self.encoder.state_dict(), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.encoder.load_state_dict(state)
        self.totals.update(state.get("totals", {}))
