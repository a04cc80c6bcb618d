"""Compressed gradient communication for torch DDP, as a comm hook with a state object.

For each gradient bucket the hook adds the error-feedback residual, encodes with the codec,
exchanges payloads with the collective that fits the codec (ring, allgather or allreduce),
decodes, averages, and hands DDP the averaged gradient. It counts the bytes this worker
sends and what an fp32 ring allreduce would have sent, per step.

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = rayzip.torch.compress(ddp, CompressionSpec(codec="group_topk", ratio=0.01))
    ...                                   # train as usual
    state.set_ratio(0.05)                 # takes effect at the next step, on every rank that calls it
    print(state.last_step)                # bytes_sent, dense_bytes, comm_s of the finished step
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..codecs import NonFiniteError, get_codec
from ..comm import AllReduce, Transport, make_communicator, ring_allreduce_bytes
from ..spec import CompressionSpec
from ..xp import to_torch

__all__ = ["CompressionState", "StepStats", "compress", "compressed_hook"]


@dataclass
class StepStats:
    """What one worker's hook did during one optimizer step."""

    step: int = 0
    compressed: bool = True
    ratio: float | None = None
    bytes_sent: int = 0  # bytes this worker handed to torch.distributed to send (ps: pushed)
    bytes_received: int = 0  # ps: bytes pulled from the shards
    dense_bytes: int = 0  # an fp32 ring allreduce of the same buckets: 2(n-1)/n * 4 * numel
    comm_s: float = 0.0  # hook entry to averaged gradient, summed over buckets
    network_s: float = 0.0  # of comm_s, inside torch.distributed (wire and waiting for peers)
    numel: int = 0
    buckets: list[int] = field(default_factory=list)  # element count of each exchange (the whole gradient, once)
    verify_max_abs_err: float | None = None
    verify_documented_bytes: int | None = None  # verify mode: bytes_sent by the wire formulas
    messages: list[int] = field(default_factory=list)


class CompressionState:
    """Everything the hook keeps between calls: codec, error feedback, collective, counters."""

    def __init__(self, spec: CompressionSpec, process_group=None, device: torch.device | str = "cpu",
                 momentum: float | None = None, parameters: list[torch.Tensor] | None = None):
        self.spec = spec
        # With the model's parameters, the hook gathers every bucket into one gradient in
        # parameter order and compresses that once per step. What the codec sees (its groups,
        # its top k) then does not depend on how DDP bucketed the parameters, which differs
        # between a job's first step and the rest, so a restarted job repeats the uninterrupted
        # one exactly. Without them, each bucket is compressed on its own.
        self._offsets: dict[int, tuple[int, int]] | None = None
        if parameters:
            starts = [0]
            for p in parameters:
                starts.append(starts[-1] + p.numel())
            self._offsets = {id(p): (starts[i], p.numel()) for i, p in enumerate(parameters)}
            self._numel = starts[-1]
        self._flat: torch.Tensor | None = None
        self._waiting: list[tuple[torch.futures.Future, list[tuple[int, int]], torch.Tensor]] = []
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.transport = Transport(process_group, device=device)
        self.codec = spec.build_codec(rank=self.rank)
        self.memory = spec.build_memory(momentum)
        self.communicator = make_communicator(spec.collective, self.codec, self.transport)
        self.dense_codec = get_codec("none")  # warm-up and compression-off steps
        self.dense = AllReduce(self.transport)
        self.step = 0
        self.enabled = True
        self._pending_ratio: float | None = None
        self._pending_enabled: bool | None = None
        self.current = StepStats(ratio=getattr(self.codec, "ratio", None))
        self.last_step: StepStats | None = None
        self.totals = {"steps": 0, "bytes_sent": 0, "dense_bytes": 0, "comm_s": 0.0, "network_s": 0.0}

    # --- control, applied at step boundaries so that every rank switches together -------
    @property
    def ratio(self) -> float | None:
        return getattr(self.codec, "ratio", None)

    def set_ratio(self, ratio: float) -> None:
        """Use ``ratio`` from the next step on. Call it on every rank for the same step."""
        if not hasattr(self.codec, "ratio"):
            raise ValueError(f"codec {self.codec.name} has no ratio to change")
        self._pending_ratio = float(ratio)

    def set_enabled(self, enabled: bool) -> None:
        """Compression on, or off (dense fp32 allreduce), from the next step on."""
        self._pending_enabled = bool(enabled)

    def _apply_ratio(self, ratio: float) -> None:
        """Swap in the codec at ``ratio``, keeping its state (a seeded codec's call count)."""
        codec = type(self.codec)(**{**self.spec.codec_params(self.rank), "ratio": ratio})
        codec.load_state_dict(self.codec.state_dict())
        self.codec = codec

    def _begin_step(self) -> None:
        if self._pending_ratio is not None:
            self._apply_ratio(self._pending_ratio)
            self._pending_ratio = None
        if self._pending_enabled is not None:
            self.enabled, self._pending_enabled = self._pending_enabled, None
        compressed = self.enabled and self.step >= self.spec.warmup_steps
        self.current = StepStats(step=self.step, compressed=compressed, ratio=self.ratio if compressed else None)
        self.transport.messages = []

    def _end_step(self) -> None:
        self.current.messages = self.transport.messages
        self.last_step = self.current
        self.totals["steps"] += 1
        for key in ("bytes_sent", "dense_bytes", "comm_s", "network_s"):
            self.totals[key] += getattr(self.current, key)
        self.step += 1

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "enabled": self.enabled, "ratio": self.ratio,
                "memory": self.memory.state_dict(), "codec": self.codec.state_dict(),
                "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.enabled = int(state["step"]), bool(state["enabled"])
        if state.get("ratio") is not None and hasattr(self.codec, "ratio"):
            self._apply_ratio(state["ratio"])
        self.memory.load_state_dict(state["memory"])
        self.codec.load_state_dict(state["codec"])
        self.totals.update(state.get("totals", {}))


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradient averaged over workers, through the codec.

    Buckets are gathered into the whole gradient, in parameter order; at the last bucket of
    the step it is compressed and exchanged once, and every bucket's future completes.
    """
    if bucket.index() == 0:
        state._begin_step()
    if state._offsets is None:
        future = torch.futures.Future()
        future.set_result(_exchange(state, bucket.buffer(), f"bucket{bucket.index()}/{bucket.buffer().numel()}",
                                    f"gradient bucket {bucket.index()}"))
        if bucket.is_last():
            state._end_step()
        return future
    start = time.perf_counter()
    buffer = bucket.buffer()
    if state._flat is None:
        state._flat = torch.empty(state._numel, dtype=torch.float32, device=buffer.device)
    spans, pos = [], 0
    for p in bucket.parameters():
        offset, n = state._offsets[id(p)]
        state._flat[offset: offset + n].copy_(buffer[pos: pos + n])
        spans.append((offset, n))
        pos += n
    future = torch.futures.Future()
    state._waiting.append((future, spans, buffer))
    state.current.comm_s += time.perf_counter() - start
    if bucket.is_last():
        average = _exchange(state, state._flat, "model", "gradient")
        for waiting, spans, buffer in state._waiting:
            waiting.set_result(torch.cat([average[o: o + n] for o, n in spans]).to(buffer.dtype))
        state._waiting.clear()
        state._end_step()
    return future


def _exchange(state: CompressionState, grad: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """Compress ``grad`` with error feedback, exchange it, return the average as a tensor."""
    start = time.perf_counter()
    stats = state.current
    sent_before, network_before = state.transport.bytes_sent, state.transport.network_s
    try:
        if stats.compressed:
            payload = state.memory.encode(state.codec, name, grad)
            average = state.communicator.average(state.codec, payload)
            if state.spec.verify:
                _verify(state, payload, average)
                documented = state.communicator.documented_bytes(state.codec, payload)
                stats.verify_documented_bytes = (stats.verify_documented_bytes or 0) + documented
        else:  # through the memory too: it sends what error feedback held back, and momentum
            payload = state.memory.encode(state.dense_codec, name, grad)
            average = state.dense.average(state.dense_codec, payload)
    except NonFiniteError as exc:
        raise NonFiniteError(f"rank {state.rank}, step {state.step}, {what}: {exc}"
                             + _which_parameter(state, exc)) from None
    stats.bytes_sent += state.transport.bytes_sent - sent_before
    stats.dense_bytes += ring_allreduce_bytes(4 * grad.numel(), state.world)
    stats.numel += grad.numel()
    stats.buckets.append(grad.numel())
    result = to_torch(average).to(device=grad.device, dtype=grad.dtype).view_as(grad)
    stats.comm_s += time.perf_counter() - start
    stats.network_s += state.transport.network_s - network_before
    return result


def _which_parameter(state: CompressionState, exc: NonFiniteError) -> str:
    """' (parameter i, element j)' for the first bad flat index, when the hook knows the layout."""
    index = getattr(exc, "first_index", None)
    if index is None or state._offsets is None:
        return ""
    for i, (offset, n) in enumerate(sorted(state._offsets.values())):
        if offset <= index < offset + n:
            return f" (parameter {i} of the model, element {index - offset})"
    return ""


def _verify(state: CompressionState, payload, average) -> None:
    """Compare the collective's average with the mean of every worker's decoded payload."""
    mine = to_torch(state.codec.decode_flat(payload)).float().to(state.transport.device)
    everyone = [torch.empty_like(mine) for _ in range(state.world)]
    dist.all_gather(everyone, mine, group=state.transport.group)  # not counted: a self-check
    reference = torch.stack(everyone).mean(dim=0)
    got = to_torch(average).float().to(reference.device)
    err = float((got - reference).abs().max()) if got.numel() else 0.0
    prior = state.current.verify_max_abs_err or 0.0
    state.current.verify_max_abs_err = max(prior, err)


def compress(ddp_model: torch.nn.parallel.DistributedDataParallel, spec: CompressionSpec,
             process_group=None, momentum: float | None = None) -> CompressionState:
    """Register rayzip's compressed comm hook on ``ddp_model``; returns its state.

    With ``spec.momentum_correction``, pass the SGD ``momentum`` here and build the optimizer
    with momentum 0: the hook applies it, per worker, before compressing.
    """
    device = next(ddp_model.parameters()).device
    state = CompressionState(spec, process_group=process_group, device=device, momentum=momentum,
                             parameters=list(ddp_model.parameters()))
    ddp_model.register_comm_hook(state, compressed_hook)
    return state
