"""Compressed gradient communication for torch DDP, as a comm hook with a state object.

The hook gathers DDP's buckets into the whole gradient of the trainable parameters, in
parameter order. At the last bucket it adds the error-feedback residual, encodes with the
codec, agrees with every other rank on one small control word (step, config, all-finite,
stop; see :mod:`rayzip.comm.control`), exchanges payloads with the collective that fits
the codec (ring, allgather or allreduce), decodes and averages. It counts the bytes this
worker sends and what an fp32 ring allreduce would have sent, per step. With a node
hierarchy (``spec.hierarchy``, :mod:`rayzip.comm.hierarchy`) a node's workers sum densely
first and only the node's leader exchanges compressed payloads, with the other leaders.

A step with compression off (a controller's decision, warm-up, or the lossless ``none``
codec) skips all of that: each bucket is all-reduced in place as DDP's own allreduce
would, with one control word at the last bucket (:mod:`rayzip.torch.dense`).

A NaN or Inf on any rank (a bad batch, an fp16 AMP overflow, an fp16 sum that overflowed on
the wire) is seen by every rank at the same step. With ``on_nonfinite="skip"`` every rank
drops the step: the residuals stay as they were, the gradient handed back is NaN on every
rank (as plain DDP's would be, so ``GradScaler.step`` skips it and lowers its scale), and
``state.last_step.skipped`` is set for loops without a scaler. With ``"raise"`` (the default)
every rank raises :class:`NonFiniteError` naming the rank, parameter and element.

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = rayzip.torch.compress(ddp, CompressionConfig(codec="group_topk", density=0.01))
    ...                                   # train as usual
    state.set_density(0.05)                 # from the next step on; every rank must call it
    state.propose(20.0)                   # or: one rank proposes, every rank adopts it next step
    print(state.last_step)                # bytes_sent, dense_bytes, comm_s of the finished step

With AMP's ``GradScaler``, pass it so that residuals follow the loss scale::

    scaler = torch.amp.GradScaler("cuda")
    state = rayzip.torch.compress(ddp, spec, grad_scaler=scaler, on_nonfinite="skip")
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import bisect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import cuda
from ..codecs import NonFiniteError, WireOverflowError, get_codec
from ..codecs.base import find_nonfinite
from ..codecs.kernels import all_finite
from ..codecs.memory import relayout_state, segment_name
from ..comm import AllReduce, Transport, make_communicator, ring_allreduce_bytes
from ..comm.emulation import Emulation
from ..comm.hierarchy import build_hierarchy
from ..comm.control import ControlWord, RankDisagreement, agree, bad_key, encode_mode, proposal_key
from .config import CompressionConfig
from .dense import DenseSteps
from ..xp import as_array, keep_freed_memory, to_torch

__all__ = ["CompressionState", "NonFiniteError", "RankDisagreement", "StepStats", "compress", "compressed_hook",
           "ddp_kwargs", "plan_segments"]

NONFINITE_POLICIES = ("raise", "skip")


@dataclass
class StepStats:
    """What one worker's hook did during one optimizer step."""

    step: int = 0
    compressed: bool = True
    density: float | None = None  # the kept fraction in force; None: dense, or a codec without one
    bytes_sent: int = 0  # bytes this worker handed to torch.distributed to send (ps: pushed)
    local_bytes: int = 0  # of bytes_sent, those to workers on its own node (hierarchy)
    # hierarchy: what this worker's node sends off the node, by the counts: this worker's
    # bytes off it, and the control word of each other worker there (all they send off it)
    node_bytes: int | None = None
    bytes_received: int = 0  # ps: bytes pulled from the shards
    dense_bytes: int = 0  # an fp32 ring allreduce of the same gradient: 2(n-1)/n * 4 * numel
    control_bytes: int = 0  # of bytes_sent, the control word's all-reduce
    comm_s: float = 0.0  # what the step waited for: the copies into the flat gradient, and
    # from the end of backward to the averaged gradient (all of the exchange without overlap)
    busy_s: float = 0.0  # the exchange's own time, start to end, whether overlapped or not
    network_s: float = 0.0  # of busy_s, inside torch.distributed (wire and waiting for peers)
    numel: int = 0
    buckets: list[int] = field(default_factory=list)  # element count of each segment exchanged
    verify_max_abs_err: float | None = None
    verify_documented_bytes: int | None = None  # verify mode: bytes_sent by the wire formulas
    hops: int = 0  # latency-bound sends (rayzip.comm.transport.Transport.hops)
    skipped: bool = False  # a rank's gradient was not finite: every rank dropped this step
    nonfinite: str | None = None  # why, when skipped
    stop: bool = False  # some rank asked every rank to stop after this step
    adopted: tuple[int, float] | None = None  # (seq, compression) agreed this step, applied from the next


def plan_segments(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """Cut a flat gradient of parameters with ``sizes`` (in order) into ``(lo, hi)`` ranges of
    whole parameters, each at least ``cap`` elements but the last, listed from the end of
    the gradient to its start (backward's order).

    >>> plan_segments([10, 10, 10, 10], cap=15)
    [(20, 40), (0, 20)]
    """
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    segments, hi, held = [], starts[-1], 0
    for i in reversed(range(len(sizes))):
        held += sizes[i]
        if held >= max(cap, 1) or i == 0:
            segments.append((starts[i], hi))
            hi, held = starts[i], 0
    return segments


class CompressionState:
    """Everything the hook keeps between calls: codec, error feedback, collective, counters.

    ``parameters`` are the trainable parameters in DDP's order (those with
    ``requires_grad``: DDP's buckets hold no others), ``names`` their names for messages.
    """

    def __init__(self, spec: CompressionConfig, parameters: list[torch.Tensor], process_group=None,
                 device: torch.device | str = "cpu", momentum: float | None = None,
                 adam_betas: tuple[float, float] | None = None, names: list[str] | None = None,
                 on_nonfinite: str = "raise", grad_scaler=None, emulation: Emulation | None = None,
                 node_key: str | None = None):
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {on_nonfinite!r}")
        parameters = list(parameters)
        if not parameters:
            raise ValueError("no trainable parameters: nothing to compress")
        self.spec = spec
        self.on_nonfinite = on_nonfinite
        self._twin = (parameters, process_group, device, momentum, adam_betas, emulation, node_key)  # for dry_run
        self.link_probe = None  # the timed DDP broadcast of the model, where the caller timed it (rayzip.train.probe)
        self.grad_scaler = grad_scaler
        # One gradient in parameter order, cut into segments of whole parameters by size
        # alone: what the codec sees (its groups, its top k) then does not depend on how DDP
        # bucketed the parameters, which differs between a job's first step and the rest, so
        # a restarted job repeats the uninterrupted one exactly. Segments run from the last
        # parameter to the first, the order in which backward produces gradients.
        starts = [0]
        for p in parameters:
            starts.append(starts[-1] + p.numel())
        self._offsets = {id(p): (starts[i], p.numel()) for i, p in enumerate(parameters)}
        self._starts = starts
        self._names = list(names) if names else [f"parameter {i}" for i in range(len(parameters))]
        self._numel = starts[-1]
        self.segments = plan_segments([p.numel() for p in parameters], int(spec.segment_mb * 2**20) // 4)
        self._segment_names = [segment_name(lo, hi, self._numel) for lo, hi in self.segments]
        self._segment_of = {id(p): next(k for k, (lo, hi) in enumerate(self.segments) if lo <= starts[i] < hi)
                            for i, p in enumerate(parameters) if p.numel()}
        self.overlap = bool(spec.overlap)
        self._flat: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._waiting: list[tuple[torch.futures.Future, list[tuple[int, int]], torch.Tensor]] = []
        self._missing: list[int] = []
        self._arrived: list[threading.Event] = []
        self._copied: list = []
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        self._job = None
        self._failure: Exception | None = None
        self._copy_s = 0.0
        self._last_bucket_at = 0.0
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.transport = Transport(process_group, device=device, emulation=emulation)
        # With a hierarchy, each node's leader exchanges its node's sum with the other
        # leaders; the other workers exchange nothing across nodes but the control word.
        self.hierarchy = build_hierarchy(spec.hierarchy, process_group, key=node_key, device=device,
                                         emulation=emulation)
        self._exchanging = self.transport if self.hierarchy is None else self.hierarchy.leaders
        self.codec = spec.build_codec(rank=self.rank)
        self.memory = spec.build_memory(momentum, adam_betas)
        self.communicator = self._communicator()
        self.dense_codec = get_codec("none")  # warm-up and compression-off steps
        self.dense = AllReduce(self._exchanging) if self._exchanging is not None else None
        # Dense steps on DDP's buckets, as DDP takes them (see rayzip.torch.dense).
        self.dense_steps = DenseSteps(self.transport, self.memory, self.segments, self._segment_names,
                                      self._offsets, self._segment_of)
        self._bucketwise = False  # this step's buckets are all-reduced in place
        self.step = 0
        self.enabled = True
        self._pending_density: float | None = None
        self._pending_enabled: bool | None = None
        self._proposal: int = 0
        self._stop = False
        self._requests = threading.Lock()  # propose/request_stop may run while the worker sends
        self._loss_scale: float | None = None  # the scale the residuals are in (AMP)
        self.current = StepStats(density=self.codec.density)
        self.last_step: StepStats | None = None
        self.totals = {"steps": 0, "bytes_sent": 0, "local_bytes": 0, "dense_bytes": 0, "comm_s": 0.0,
                       "busy_s": 0.0, "network_s": 0.0, "skipped": 0}

    # --- control, applied at step boundaries so that every rank switches together -------
    @property
    def density(self) -> float | None:
        """The codec's kept fraction in force (None: a codec that sends every entry)."""
        return self.codec.density

    def set_density(self, density: float) -> None:
        """Keep ``density`` of the entries from the next step on. Call it on every rank for the
        same step (a rank that does not is caught by the control word: every rank raises)."""
        if self.codec.density is None:
            raise ValueError(f"codec {self.codec.name} has no density to change")
        self._pending_density = float(density)

    def set_enabled(self, enabled: bool) -> None:
        """Compression on, or off (dense fp32 allreduce), from the next step on, on every rank."""
        self._pending_enabled = bool(enabled)

    def propose(self, compression: float, seq: int = 0) -> None:
        """Ask every rank to compress at ``compression`` (1 / kept fraction; 1 or less:
        off) from the step after the next exchange. One rank may call it alone (a controller's
        decision reaches rank 0 only); the control word carries it to the others, and the
        highest ``seq`` wins. ``last_step.adopted`` says when it was agreed."""
        with self._requests:
            self._proposal = proposal_key(seq, compression)

    def request_stop(self) -> None:
        """Ask every rank to stop: ``last_step.stop`` is set on every rank after the next
        exchange. A rank whose data ran out, or that was told of its preemption, calls it
        while still running that step."""
        with self._requests:
            self._stop = True

    def dry_run(self, repeats: int = 2) -> "StepStats":
        """A compressed exchange of a seeded random gradient, at the density in force, through
        a twin of this state (the same spec, parameters and process group; its own error
        feedback, codec and counters), so that nothing of the run's state moves: what one
        compressed step's exchange costs on this network and this codec, before the first
        step. Every rank must call it; the last of ``repeats`` counts (the first sets up
        buffers). The adaptive controller's first sample (:class:`rayzip.train.Telemetry`)."""
        parameters, group, device, momentum, adam_betas, emulation, node_key = self._twin
        twin = CompressionState(self.spec, parameters, group, device, momentum=momentum, adam_betas=adam_betas,
                                names=self._names, emulation=emulation, node_key=node_key)
        if self.density is not None:
            twin.set_density(self.density)
        twin.step = self.spec.warmup_steps  # past the warm-up, which would send it dense
        generator = torch.Generator().manual_seed(self.rank)
        grad = (torch.randn(self._numel, generator=generator) * 1e-3).to(device)
        for _ in range(repeats):
            twin.average(grad)
        return twin.last_step

    def _apply_density(self, density: float) -> None:
        """Swap in the codec at ``density``, keeping its state (a seeded codec's call count);
        ``collective: auto`` weighs its choice again at the new density."""
        self.codec = self.codec.with_density(density)
        self.communicator = self._communicator()

    def _communicator(self):
        """The collective for this world size (with a hierarchy: the number of nodes),
        segments and codec (``auto``: by their cost); None on a node's other workers."""
        if self._exchanging is None:
            return None
        return make_communicator(self.spec.collective, self.codec, self._exchanging,
                                 sizes=[hi - lo for lo, hi in self.segments], link=self.spec.link)

    def _begin_step(self) -> None:
        if self._pending_density is not None:
            self._apply_density(self._pending_density)
            self._pending_density = None
        if self._pending_enabled is not None:
            self.enabled, self._pending_enabled = self._pending_enabled, None
        compressed = self.enabled and self.step >= self.spec.warmup_steps
        self.current = StepStats(step=self.step, compressed=compressed, density=self.density if compressed else None)

    def _goes_bucketwise(self) -> bool:
        """Whether this step's gradient crosses whole, bucket by bucket in place: dense (or
        the lossless codec), one group, and no self-check."""
        dense = not self.current.compressed or self.codec.name == "none"
        return dense and self.hierarchy is None and not self.spec.verify

    def _end_step(self) -> None:
        self.last_step = self.current
        self.totals["steps"] += 1
        self.totals["skipped"] += int(self.current.skipped)
        for key in ("bytes_sent", "local_bytes", "dense_bytes", "comm_s", "busy_s", "network_s"):
            self.totals[key] += getattr(self.current, key)
        self.step += 1

    # --- checkpoints ------------------------------------------------------------------
    @property
    def holders(self) -> dict[int, tuple[int, int]]:
        """The ranks that hold error feedback, each with (its index, their count): every rank
        without a hierarchy; with one, each node's leader, indexed by node. A checkpoint keeps
        this map so that a restart on another layout re-shards between holders
        (:func:`rayzip.train.checkpoints.restore_hook`)."""
        if self.hierarchy is None:
            return {r: (r, self.world) for r in range(self.world)}
        groups = self.hierarchy.topology.groups
        return {ranks[0]: (k, len(groups)) for k, ranks in enumerate(groups)}

    def state_dict(self) -> dict:
        return {"step": self.step, "enabled": self.enabled, "density": self.density,
                "memory": self.memory.state_dict(), "codec": self.codec.state_dict(),
                "loss_scale": self._loss_scale, "totals": dict(self.totals), "drained": self.dense_steps.drained}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; residuals and velocities land on this state's device."""
        self.step, self.enabled = int(state["step"]), bool(state["enabled"])
        density = state.get("density", state.get("ratio"))  # "ratio": checkpoints before the rename
        if density is not None and self.codec.density is not None:
            self._apply_density(density)
        memory = relayout_state(state["memory"], self.segments, self._numel)  # saved with other segments, too
        self.memory.load_state_dict(memory, like=torch.empty(0, device=self.transport.device))
        self.codec.load_state_dict(state["codec"])
        self._loss_scale = state.get("loss_scale")
        self.totals.update(state.get("totals", {}))
        self.dense_steps.drained = bool(state.get("drained", False))

    # --- one step's exchange --------------------------------------------------------------
    def average(self, grad: torch.Tensor) -> torch.Tensor:
        """One whole step without DDP: ``grad`` (flat, this rank's) averaged over the ranks.
        Every rank calls it once per step, as the DDP hook does at the last bucket."""
        self._begin_step()
        result = self.exchange(grad)
        self._end_step()
        return result

    def exchange(self, grad: torch.Tensor) -> torch.Tensor:
        """The mean over every rank of ``grad`` (this rank's whole flat gradient) through the
        codec with error feedback, segment by segment; NaN-filled on every rank when the step
        is skipped."""
        start = time.perf_counter()
        flat = grad.detach().reshape(-1)
        out = torch.empty(self._numel, dtype=torch.float32, device=flat.device)
        self._exchange_segments(flat, out)
        self.current.comm_s += time.perf_counter() - start
        return out.to(dtype=grad.dtype).view_as(grad)

    def _exchange_segments(self, flat: torch.Tensor, out: torch.Tensor, ready=None) -> None:
        """Average ``flat`` into ``out``, one segment after another in :attr:`segments`'
        order (``ready(k)`` waits until segment k's gradient is in ``flat``). A skipped step
        restores the error feedback held before it and fills ``out`` with NaN."""
        start = time.perf_counter()
        stats = self.current
        self.dense_steps.drained = False  # each rank's memory goes its own way again
        transports = self._transports()
        sent_before = [t.bytes_sent for t in transports]
        network_before = [t.network_s for t in transports]
        hops_before = [t.hops for t in transports]
        local_before = self.hierarchy.bytes_sent if self.hierarchy is not None else 0
        self._follow_loss_scale()
        snapshot = self.memory.snapshot()
        reason = None
        # A pipeline of two: segment k's payload is on the wire while segment k+1 is encoded
        # and agreed on; k is then finished (decoded, averaged) before k+1's payload is sent.
        in_flight = None
        try:
            for k, (lo, hi) in enumerate(self.segments):
                if ready is not None:
                    ready(k)
                finish, reason = self._start_segment(self._segment_names[k], lo, flat[lo:hi])
                if in_flight is not None:  # the earlier segment's reason comes first, as it would serially
                    reason = self._finish_segment(*in_flight, out) or reason
                    in_flight = None
                if reason is not None:  # every rank has the same reason at the same segment
                    if finish is not None:
                        finish()  # its collective is under way on every rank: let it end
                    break
                in_flight = (finish, lo, hi)
            if in_flight is not None:
                reason = self._finish_segment(*in_flight, out)
        finally:
            stats.bytes_sent += sum(t.bytes_sent for t in transports) - sum(sent_before)
            stats.network_s += sum(t.network_s for t in transports) - sum(network_before)
            stats.hops += sum(t.hops for t in transports) - sum(hops_before)
            if self.hierarchy is not None:
                stats.local_bytes += self.hierarchy.bytes_sent - local_before
                others = (self.hierarchy.local_world - 1) * stats.control_bytes
                stats.node_bytes = stats.bytes_sent - stats.local_bytes + others
            stats.busy_s += time.perf_counter() - start
        if reason is not None:
            self.memory.restore(snapshot)
            message = f"step {self.step}: {reason}"
            if self.on_nonfinite == "raise":
                raise NonFiniteError(message)
            stats.skipped, stats.nonfinite = True, message
            out.fill_(float("nan"))

    def _transports(self) -> list[Transport]:
        """Every transport this rank sends on, each counted once."""
        if self.hierarchy is None:
            return [self.transport]
        return [t for t in (self.transport, self.hierarchy.local, self.hierarchy.leaders) if t is not None]

    def _finish_segment(self, finish, lo: int, hi: int, out: torch.Tensor) -> str | None:
        """Put a started segment's average into ``out[lo:hi]``; why every rank skips the step, if so."""
        average, reason = finish()
        if reason is None:
            out[lo:hi].copy_(average)
        return reason

    def _start_segment(self, name: str, offset: int, grad: torch.Tensor):
        """(a call that finishes this segment, giving (its average, None) or (None, why every
        rank skips the step)), or (None, why every rank skips the step) when it cannot start."""
        stats = self.current
        communicator, codec = (self.communicator, self.codec) if stats.compressed else (self.dense, self.dense_codec)
        hierarchy = self.hierarchy
        payload, bad, failure = None, 0, None
        try:
            if hierarchy is not None:
                # Each worker checks its own gradient, so that a bad one is named, not the
                # node's sum; the leader then encodes the sum only if every part is finite.
                found = find_nonfinite(*as_array(grad.reshape(-1)))
                bad = bad_key(self.rank, self.world, offset + found[1]) if found else 0
                grad = hierarchy.node_share(grad)
                bad = hierarchy.first_bad(bad)
            if bad == 0 and communicator is not None and (hierarchy is None or hierarchy.nodes > 1):
                # through the memory also when dense: it sends what error feedback held back
                payload = self.memory.encode(codec, name, grad, communicator.input_scale)
        except NonFiniteError as exc:  # every codec checks its input; fp16 also its wire type
            bad = bad_key(self.rank, self.world, offset + (exc.first_index or 0),
                          overflow=isinstance(exc, WireOverflowError))
        except Exception as exc:  # raised here alone, it would leave the others waiting
            failure = exc
        agreed, control = self._agree(bad, failure)
        if agreed.bad is not None:
            rank, index, overflow = agreed.bad
            what = (f"overflows the {codec.value_dtype or codec.name} wire type" if overflow
                    else "is not finite")
            return None, f"rank {rank}'s gradient {what} at {self._where(index)}"
        stats.dense_bytes += ring_allreduce_bytes(4 * grad.numel(), self.world)
        stats.numel += grad.numel()
        stats.buckets.append(grad.numel())
        if hierarchy is None:
            pending = communicator.start(codec, payload)
            if not self.spec.verify:  # the caller finishes it once the next segment is under way
                return lambda: self._checked(to_torch(pending()), communicator, codec), None
            average = to_torch(pending())
        else:  # one node alone: its sum is already everyone's mean
            average = to_torch(communicator.average(codec, payload)) if payload is not None else grad
            average = hierarchy.broadcast(average.to(torch.float32).contiguous())
        result = self._checked(average, communicator, codec)
        if self.spec.verify and result[1] is None:
            documented = control
            if payload is not None:
                _verify(self, communicator, codec, payload, average)
                documented += communicator.documented_bytes(codec, payload)
            if hierarchy is not None:
                documented += hierarchy.documented_bytes(grad.numel())
            stats.verify_documented_bytes = (stats.verify_documented_bytes or 0) + documented
        return lambda: result, None

    @staticmethod
    def _checked(average: torch.Tensor, communicator, codec):
        """(average, None), or (None, why every rank skips the step: the sum is not finite)."""
        if not all_finite(average):
            via = communicator.name if communicator is not None else "node's broadcast"
            return None, (f"the averaged gradient is not finite after the {via} (the sum "
                          f"overflowed {codec.value_dtype or codec.name} on the wire)")
        return average, None

    def _agree(self, bad: int = 0, failure: Exception | None = None):
        """(the control word agreed by every rank, the bytes it cost); raises on every rank
        alike when one failed or the ranks disagree. A stop or proposal rides on the next
        word sent; every rank reads it from the same agreement."""
        stats = self.current
        with self._requests:
            stop, self._stop = self._stop, False
            proposal, self._proposal = self._proposal, 0
        word = ControlWord(step=self.step, density=float(self.density or 0.0),
                           mode=encode_mode(self.enabled, stats.compressed, self.codec.value_dtype),
                           bad=bad, failed=self.world - self.rank if failure is not None else 0,
                           stop=int(stop), proposal=proposal)
        control_before = self.transport.bytes_sent
        agreed = agree(self.transport, word)
        control = self.transport.bytes_sent - control_before
        stats.control_bytes += control
        if failure is not None:
            raise failure
        if agreed.failed is not None:
            raise RankDisagreement(f"step {self.step}: rank {agreed.failed} failed to encode its gradient "
                                   "(its own error is in its log); every rank stops")
        agreed.check()
        stats.stop = stats.stop or agreed.stop
        self._adopt(agreed.proposal)
        return agreed, control

    def _adopt(self, proposal: tuple[int, float] | None) -> None:
        if proposal is None:
            return
        if self.current.adopted is not None and self.current.adopted[0] >= proposal[0]:
            return  # a later segment's word repeated an older proposal
        seq, compression = proposal
        self.current.adopted = proposal
        self.compress_at(compression)

    def compress_at(self, compression: float) -> None:
        """From the next step on, compress at ``compression`` (1 / kept fraction; 1 or
        less: off). Every rank must call it for the same step, as :meth:`propose`'s agreed
        proposals do."""
        self._pending_enabled = compression > 1.0
        if compression > 1.0 and self.codec.density is not None:
            self._pending_density = 1.0 / compression

    def _follow_loss_scale(self) -> None:
        """Keep residuals in the units of the gradient: AMP scales it by the loss scale."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())
        if self._loss_scale is not None and scale != self._loss_scale:
            self.memory.rescale(scale / self._loss_scale)
        self._loss_scale = scale

    def _where(self, index: int) -> str:
        """'parameter NAME, element j' for a flat index of the gradient."""
        i = bisect.bisect_right(self._starts, index) - 1
        if 0 <= i < len(self._names):
            return f"{self._names[i]} (parameter {i} of the model), element {index - self._starts[i]}"
        return f"flat element {index}"

    # --- the DDP hook's side: buckets in, segments out, overlapped with backward -----------
    def _receive_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Copy a bucket into the flat gradient, mark the segments it completes, and start
        the step's exchange: on the worker thread at the first bucket with overlap, else
        inline at the last."""
        start = time.perf_counter()
        buffer = bucket.buffer()
        if bucket.index() == 0:
            self._begin_step()
            self._bucketwise = self._goes_bucketwise()
            if self._bucketwise:
                self._start_bucketwise(buffer.device)
        if self._bucketwise:
            return self._receive_bucketwise(bucket, start)
        if bucket.index() == 0:
            if self._flat is None or self._flat.device != buffer.device:
                self._flat = torch.zeros(self._numel, dtype=torch.float32, device=buffer.device)
                self._out = torch.empty_like(self._flat)
            self._missing = [hi - lo for lo, hi in self.segments]
            self._arrived = [threading.Event() for _ in self.segments]
            self._copied = [None] * len(self.segments)
            for k, missing in enumerate(self._missing):
                if missing == 0:
                    self._arrived[k].set()
        spans, completed, pos = [], [], 0
        for p in bucket.parameters():
            offset, n = self._offsets[id(p)]
            self._flat[offset: offset + n].copy_(buffer[pos: pos + n])
            spans.append((offset, n))
            pos += n
            if not n:
                continue
            k = self._segment_of[id(p)]
            self._missing[k] -= n
            if self._missing[k] == 0:
                completed.append(k)
        future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        # The future is listed before its segments are marked: the worker sets the futures it
        # sees once the last segment is done, and one it did not see would never complete.
        self._waiting.append((future, spans, buffer))
        for k in completed:
            if buffer.is_cuda:  # the worker's side stream must see this stream's copies
                self._copied[k] = torch.cuda.Event()
                self._copied[k].record()
            self._arrived[k].set()
        if self.overlap and self._job is None:
            self._job = self._worker().submit(self._run_exchange)
        self._copy_s += time.perf_counter() - start
        if bucket.is_last():
            self._last_bucket_at = time.perf_counter()
            if not self.overlap:
                self._run_exchange()
            # Runs when backward is done, before the step goes on: the step's wait.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
        return future

    def _start_bucketwise(self, device: torch.device) -> None:
        self._sent_before = (self.transport.bytes_sent, self.transport.hops)
        self._follow_loss_scale()
        try:
            self.dense_steps.start(device)
        except Exception as exc:  # raised by _finish_step, once DDP has its futures
            self._failure = exc

    def _receive_bucketwise(self, bucket: dist.GradBucket, start: float) -> torch.futures.Future:
        """A dense step's bucket: all-reduced in place; the control word at the last one."""
        buffer = bucket.buffer()
        stats = self.current
        stats.dense_bytes += ring_allreduce_bytes(4 * buffer.numel(), self.world)
        stats.numel += buffer.numel()
        stats.buckets.append(buffer.numel())
        future = self.dense_steps.bucket(buffer, bucket.parameters())
        self._copy_s += time.perf_counter() - start
        if bucket.is_last():
            self._last_bucket_at = time.perf_counter()
            try:
                self._agree(failure=self._failure)
            except Exception as exc:
                self._failure = exc
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
        return future

    def _finish_bucketwise(self) -> None:
        stats = self.current
        span_s, bad = self.dense_steps.finish()
        stats.busy_s += span_s
        stats.network_s += span_s
        stats.bytes_sent += self.transport.bytes_sent - self._sent_before[0]
        stats.hops += self.transport.hops - self._sent_before[1]
        if bad is not None and self._failure is None:
            # The sum is the same on every rank, so is its first bad element: all skip alike.
            message = (f"step {self.step}: the averaged gradient is not finite at {self._where(bad)} "
                       "(compression off: some rank's gradient was not finite, or the sum overflowed)")
            if self.on_nonfinite == "raise":
                self._failure = NonFiniteError(message)
            else:
                stats.skipped, stats.nonfinite = True, message

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayzip-exchange")
        return self._executor

    def _wait_for_segment(self, k: int) -> None:
        self._arrived[k].wait()
        if self._copied[k] is not None:
            torch.cuda.current_stream().wait_event(self._copied[k])

    def _run_exchange(self) -> None:
        """The step's exchange, then every bucket's future: the averages, or NaN when the
        step is skipped or failed (a failure is raised by :meth:`_finish_step`)."""
        completed = False
        try:
            with _side_stream(self):
                try:
                    self._exchange_segments(self._flat, self._out, ready=self._wait_for_segment)
                    results = [torch.cat([self._out[o: o + n] for o, n in spans]).to(buffer.dtype)
                               for _, spans, buffer in self._waiting]
                except Exception as exc:
                    results = self._failed(exc)
                # Still on the stream that wrote the results: a CUDA future records its events
                # on the current stream, and DDP's stream waits for those before it reads the
                # results (recorded on another stream, DDP read results still being written).
                completed = True
                self._complete(results)
        except Exception as exc:  # no side stream to be had
            if completed:
                raise
            self._complete(self._failed(exc))

    def _failed(self, exc: Exception) -> list[torch.Tensor]:
        # Raised through DDP's reducer, it would lose its type (DDP casts a future's value
        # to a tensor): DDP gets a NaN gradient and completes, and _finish_step raises.
        self._failure = exc
        return [torch.full((sum(n for _, n in spans),), float("nan"), dtype=buffer.dtype, device=buffer.device)
                for _, spans, buffer in self._waiting]

    def _complete(self, results: list[torch.Tensor]) -> None:
        for (future, _, _), result in zip(self._waiting, results):
            future.set_result(result)

    def _finish_step(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()
        self._waiting = []
        if self._bucketwise:
            self._finish_bucketwise()
        self.current.comm_s += self._copy_s + time.perf_counter() - self._last_bucket_at
        self._copy_s = 0.0
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        self._end_step()


@contextmanager
def _side_stream(state: CompressionState):
    """On CUDA, the exchange runs on the state's own stream (torch's and cupy's), so that it
    overlaps the backward kernels on the default stream; on the CPU, nothing to do."""
    device = state._flat.device
    if device.type != "cuda":
        yield
        return
    if state._stream is None:
        state._stream = torch.cuda.Stream(device=device)
    with torch.cuda.device(device), torch.cuda.stream(state._stream), cuda.torch_stream(device):
        yield


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradient averaged over workers, through the codec.

    Buckets are gathered into the whole gradient, in parameter order, and exchanged in
    fixed segments of whole parameters (``spec.segment_mb``), whatever DDP's bucket layout;
    with ``spec.overlap`` a worker thread exchanges each segment as soon as backward has
    produced it. Every bucket's future completes when the step's exchange is done.
    """
    return state._receive_bucket(bucket)


def _verify(state: CompressionState, communicator, codec, payload, average) -> None:
    """Compare the collective's average with the mean of every worker's decoded payload."""
    transport = communicator.transport  # with a hierarchy, the node leaders'
    mine = to_torch(codec.decode_flat(payload)).float().to(transport.device) / communicator.input_scale
    everyone = [torch.empty_like(mine) for _ in range(transport.world)]
    dist.all_gather(everyone, mine, group=transport.group)  # not counted: a self-check
    reference = torch.stack(everyone).mean(dim=0)
    got = average.float().to(reference.device)
    err = float((got - reference).abs().max()) if got.numel() else 0.0
    prior = state.current.verify_max_abs_err or 0.0
    state.current.verify_max_abs_err = max(prior, err)


def ddp_kwargs(spec: CompressionConfig) -> dict:
    """DDP's arguments for rayzip's hook: with overlap, buckets no larger than a segment, so
    that each segment reaches the hook as soon as backward has produced it (DDP's default
    25 MB buckets would hold most of a small model's gradient until the end of backward).

    Usage::

        ddp = DistributedDataParallel(model, **ddp_kwargs(spec))
        state = compress(ddp, spec)
    """
    return {"bucket_cap_mb": spec.segment_mb} if spec.overlap else {}


def compress(ddp_model: torch.nn.parallel.DistributedDataParallel, spec: CompressionConfig,
             process_group=None, momentum: float | None = None, on_nonfinite: str = "raise",
             grad_scaler=None, adam_betas: tuple[float, float] | None = None,
             emulation: Emulation | None = None, node_key: str | None = None) -> CompressionState:
    """Register rayzip's compressed comm hook on ``ddp_model``; returns its state.

    Only parameters with ``requires_grad`` are exchanged (frozen layers cost nothing).
    With ``spec.momentum_correction``, pass the SGD ``momentum`` here and build the optimizer
    with momentum 0: the hook applies it, per worker, before compressing. With
    ``spec.adam_correction``, pass Adam's ``adam_betas`` and build the optimizer as SGD without
    momentum, weight decay as AdamW's (:func:`rayzip.torch.optim.build_optimizer` with
    ``adam_elsewhere``): the hook sends each worker's Adam direction. ``on_nonfinite``:
    ``"raise"`` or ``"skip"`` (see the module docstring); ``grad_scaler``: AMP's
    ``GradScaler``, whose scale the residuals then follow. ``emulation``: a slower link than
    the real one (:mod:`rayzip.comm.emulation`) for every send of the exchange. ``node_key``:
    what names this process's node for ``spec.hierarchy`` (default: ``$RAYZIP_NODE_ID`` or the
    host name). With ``spec.overlap`` and no
    ``process_group``, the hook creates its own group over every rank (``dist.new_group``):
    call it on every rank.
    """
    if spec.adam_correction and grad_scaler is not None:
        raise ValueError("adam_correction sends a scale-free Adam direction, which GradScaler would unscale: "
                         "train in bf16 or without GradScaler")
    named = [(name, p) for name, p in ddp_model.module.named_parameters() if p.requires_grad]
    device = named[0][1].device if named else torch.device("cpu")
    keep_freed_memory()  # every step allocates gradient-sized arrays: reuse, do not page-fault them
    if spec.overlap and process_group is None:
        # The worker thread's collectives get a group of their own: DDP's (the unused-
        # parameter map, buffer broadcasts) then cannot interleave with them differently on
        # different ranks. Every rank calls compress() at the same point, as new_group needs.
        process_group = dist.new_group(backend=dist.get_backend())
    state = CompressionState(spec, parameters=[p for _, p in named], process_group=process_group, device=device,
                             momentum=momentum, adam_betas=adam_betas, names=[name for name, _ in named],
                             on_nonfinite=on_nonfinite, grad_scaler=grad_scaler, emulation=emulation,
                             node_key=node_key)
    ddp_model.register_comm_hook(state, compressed_hook)
    return state
