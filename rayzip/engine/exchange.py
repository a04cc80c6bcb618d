"""The gradient-exchange engine: one rank's flat gradient in, the mean over every rank out,
through a codec with error feedback.

The gradient is cut into fixed segments of whole parameters (:func:`plan_segments`). For
each segment the engine adds the error-feedback residual and encodes with the codec, agrees
with every other rank on one small control word (step, configuration, all-finite, stop, a
proposal; see :mod:`rayzip.comm.control`), exchanges the payloads with the collective that
fits the codec (ring, allgather or allreduce), decodes and averages. With a node hierarchy
(``config.hierarchy``, :mod:`rayzip.comm.hierarchy`) a node's workers sum densely first and
only the node's leader exchanges compressed payloads, with the other leaders. It counts the
bytes this rank sends and what an fp32 ring allreduce would have sent, per step.

A NaN or Inf on any rank (a bad batch, an fp16 AMP overflow, an fp16 sum that overflowed on
the wire) is seen by every rank at the same segment. With ``on_nonfinite="skip"`` every rank
drops the step: the residuals stay as they were and the mean handed back is NaN on every
rank. With ``"raise"`` (the default) every rank raises :class:`NonFiniteError` naming the
rank, parameter and element.

The engine knows nothing of DDP, threads or CUDA streams: the adapters in
:mod:`rayzip.torch` feed it (DDP's buckets, local steps' pseudo-gradients, a shard of a
sharded model), and each calls :meth:`GradientExchange.average` once per step, or
:meth:`~GradientExchange.begin_step`, :meth:`~GradientExchange.exchange_into` and
:meth:`~GradientExchange.end_step` to wait for segments as they are produced.

Example::

    exchange = GradientExchange(CompressionConfig(codec="group_topk", density=0.01),
                                sizes=[p.numel() for p in params])
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    mean = exchange.average(flat)          # every rank, once per step
    exchange.set_density(0.05)             # from the next step on; every rank
    print(exchange.last_step.bytes_sent)
"""

from __future__ import annotations

import time

import torch

from ..codecs import NonFiniteError, WireOverflowError
from ..codecs.base import find_nonfinite
from ..codecs.kernels import all_finite
from ..codecs.memory import segment_name
from ..comm import AllReduce, Transport, make_communicator, ring_allreduce_bytes
from ..comm.control import ControlWord, RankDisagreement, agree, bad_key, encode_mode
from ..comm.emulation import Emulation
from ..comm.hierarchy import build_hierarchy
from ..xp import as_array, is_torch, to_torch
from .config import CompressionConfig
from .encoder import SegmentEncoder
from .knobs import Knobs
from .stats import TOTALS, FlatLayout, StepStats, plan_segments
from .verify import verify_segment

__all__ = ["GradientExchange", "NONFINITE_POLICIES"]

NONFINITE_POLICIES = ("raise", "skip")


class GradientExchange(Knobs):
    """Codec, error feedback, collective, control word and counters of one rank's exchange.

    Args:
        config: a :class:`CompressionConfig` (codec, density, collective,
            segments, warm-up, corrections).
        sizes: the element count of each parameter, in the order of the flat gradient.
        names: the parameters' names, for messages (default ``parameter i``).
        process_group: the ranks to average over (default: the world).
        device: where residuals, payloads and the mean live.
        momentum: SGD's momentum, for ``config.momentum_correction``.
        adam_betas: Adam's betas, for ``config.adam_correction``.
        on_nonfinite: ``"raise"`` or ``"skip"`` (see the module docstring).
        grad_scaler: AMP's ``GradScaler``, whose scale the residuals then follow.
        emulation: a slower link than the real one for every send (:mod:`rayzip.comm.emulation`).
        node_key: what names this process's node for ``config.hierarchy``.
        control_group: the ranks that agree on the control word (default: ``process_group``).
            A sharded model's replicas average over a group of their own, while every rank
            of the model must stop, skip or raise at the same step: there it is the world.
    """

    def __init__(self, config: CompressionConfig, sizes: list[int], names: list[str] | None = None,
                 process_group: torch.distributed.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 momentum: float | None = None, adam_betas: tuple[float, float] | None = None,
                 on_nonfinite: str = "raise", grad_scaler: torch.amp.GradScaler | None = None,
                 emulation: Emulation | None = None, node_key: str | None = None,
                 control_group: torch.distributed.ProcessGroup | None = None):
        super().__init__()
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {on_nonfinite!r}")
        sizes = [int(n) for n in sizes]
        if not sizes:
            raise ValueError("no trainable parameters: nothing to compress")
        self.config, self.on_nonfinite = config, on_nonfinite
        self._twin = dict(sizes=sizes, names=names, process_group=process_group, device=device, momentum=momentum,
                          adam_betas=adam_betas, emulation=emulation, node_key=node_key,
                          control_group=control_group)  # for dry_run
        self.link_probe = None  # the timed DDP broadcast of the model, where the caller timed it (rayzip.train.probe)
        # What the codec sees (its groups, its top k) depends on the segments alone, never on
        # how an adapter delivers the gradient (DDP buckets differ between a job's first step
        # and the rest), so a restarted job repeats the uninterrupted one exactly. Segments
        # run from the last parameter to the first, the order in which backward produces them.
        self.layout = FlatLayout(sizes, names)
        self.numel = self.layout.numel
        self.segments = plan_segments(sizes, int(config.segment_mb * 2**20) // 4)
        self.segment_names = [segment_name(lo, hi, self.numel) for lo, hi in self.segments]
        self.rank, self.world = torch.distributed.get_rank(process_group), torch.distributed.get_world_size(process_group)
        self.transport = Transport(process_group, device=device, emulation=emulation)
        # The control word's ranks: bad gradients and failures are named by their rank there.
        self.control = self.transport if control_group is None else Transport(control_group, device=device,
                                                                                emulation=emulation)
        self.control_rank, self.control_world = self.control.rank, self.control.world
        # With a hierarchy, each node's leader exchanges its node's sum with the other
        # leaders; the other workers exchange nothing across nodes but the control word.
        self.hierarchy = build_hierarchy(config.hierarchy, process_group, key=node_key, device=device,
                                         emulation=emulation)
        if control_group is not None and self.hierarchy is not None:
            raise ValueError("a control group of its own and a node hierarchy do not combine")
        self._exchanging = self.transport if self.hierarchy is None else self.hierarchy.leaders
        self.encoder = SegmentEncoder(config, self.rank, momentum, adam_betas, grad_scaler)
        self.communicator = self._communicator()
        self.dense = AllReduce(self._exchanging) if self._exchanging is not None else None
        self.drained = False  # every rank's memory was averaged by a dense step (rayzip.torch.dense)
        self.step = 0
        self.current = StepStats(density=self.codec.density)
        self.last_step: StepStats | None = None
        self.totals = {"steps": 0, "skipped": 0, **dict.fromkeys(TOTALS, 0)}

    @property
    def density(self) -> float | None:
        return self.encoder.density

    @property
    def codec(self):
        return self.encoder.codec

    @property
    def memory(self):
        return self.encoder.memory

    def dry_run(self, repeats: int = 2) -> StepStats:
        """A compressed exchange of a seeded random gradient, at the density in force, through
        a twin of this engine (the same configuration and process group; its own error
        feedback, codec and counters), so that nothing of the run's state moves: what one
        compressed step's exchange costs on this network and this codec, before the first
        step. Every rank must call it; the last of ``repeats`` counts (the first sets up
        buffers). The adaptive controller's first sample (:class:`rayzip.train.Telemetry`)."""
        twin = GradientExchange(self.config, **self._twin)
        if self.density is not None:
            twin.set_density(self.density)
        twin.step = self.config.warmup_steps  # past the warm-up, which would send it dense
        generator = torch.Generator().manual_seed(self.rank)
        grad = (torch.randn(self.numel, generator=generator) * 1e-3).to(self.transport.device)
        for _ in range(repeats):
            twin.average(grad)
        return twin.last_step

    def _communicator(self):
        """The collective for this world size (with a hierarchy: the number of nodes),
        segments and codec (``auto``: by their cost); None on a node's other workers."""
        if self._exchanging is None:
            return None
        return make_communicator(self.config.collective, self.codec, self._exchanging,
                                 sizes=[hi - lo for lo, hi in self.segments], link=self.config.link,
                                 combine=self.config.combine)

    def _apply_density(self, density: float) -> None:
        """Swap in the codec at ``density``, keeping its state (a seeded codec's call count);
        ``collective: auto`` weighs its choice again at the new density."""
        self.encoder.set_density(density)
        self.communicator = self._communicator()

    # --- steps ------------------------------------------------------------------------------
    def begin_step(self) -> StepStats:
        """Apply the requests made since the last step; this step's statistics."""
        density = self._take_pending()
        if density is not None:
            self._apply_density(density)
        compressed = self.enabled and self.step >= self.config.warmup_steps
        self.current = StepStats(step=self.step, compressed=compressed, density=self.density if compressed else None)
        return self.current

    def goes_whole(self) -> bool:
        """Whether this step's gradient may cross uncompressed, as it lies: dense (or the
        lossless codec), one group, and no self-check (:mod:`rayzip.torch.dense`)."""
        dense = not self.current.compressed or self.codec.name == "none"
        return dense and self.hierarchy is None and not self.config.verify

    def end_step(self) -> None:
        self.last_step = self.current
        self.totals["steps"] += 1
        self.totals["skipped"] += int(self.current.skipped)
        for key in TOTALS:
            self.totals[key] += getattr(self.current, key)
        self.step += 1

    def average(self, grad: torch.Tensor) -> torch.Tensor:
        """One whole step: ``grad`` (this rank's, flat or not) averaged over the ranks. Every
        rank calls it once per step."""
        self.begin_step()
        start = time.perf_counter()
        flat = grad.detach().reshape(-1)
        out = torch.empty(self.numel, dtype=torch.float32, device=flat.device)
        self.exchange_into(flat, out)
        self.current.comm_s += time.perf_counter() - start
        self.end_step()
        return out.to(dtype=grad.dtype).view_as(grad)

    def exchange_into(self, flat: torch.Tensor, out: torch.Tensor, ready=None) -> None:
        """Average ``flat`` into ``out``, one segment after another in :attr:`segments`'
        order (``ready(k)`` waits until segment k's gradient is in ``flat``). A skipped step
        restores the error feedback held before it and fills ``out`` with NaN."""
        start = time.perf_counter()
        stats = self.current
        self.drained = False  # each rank's memory goes its own way again
        transports = self._transports()
        before = [(t.bytes_sent, t.network_s, t.hops) for t in transports]
        local_before = self.hierarchy.bytes_sent if self.hierarchy is not None else 0
        self.encoder.follow_loss_scale()
        snapshot = self.memory.snapshot()
        reason = None
        # A pipeline of two: segment k's payload is on the wire while segment k+1 is encoded
        # and agreed on; k is then finished (decoded, averaged) before k+1's payload is sent.
        in_flight = None
        try:
            for k, (lo, hi) in enumerate(self.segments):
                if ready is not None:
                    ready(k)
                finish, reason = self._start_segment(self.segment_names[k], lo, flat[lo:hi])
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
            after = [(t.bytes_sent, t.network_s, t.hops) for t in transports]
            stats.bytes_sent += sum(a[0] - b[0] for a, b in zip(after, before))
            stats.network_s += sum(a[1] - b[1] for a, b in zip(after, before))
            stats.hops += sum(a[2] - b[2] for a, b in zip(after, before))
            if self.hierarchy is not None:
                stats.local_bytes += self.hierarchy.bytes_sent - local_before
                others = (self.hierarchy.local_world - 1) * stats.control_bytes
                stats.node_bytes = stats.bytes_sent - stats.local_bytes + others
            stats.busy_s += time.perf_counter() - start
        if reason is not None:
            self.memory.restore(snapshot)
            self.fail_step(f"step {self.step}: {reason}")
            out.fill_(float("nan"))

    def fail_step(self, message: str) -> None:
        """Every rank found this step's gradient not finite: raise, or mark the step skipped."""
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message)
        self.current.skipped, self.current.nonfinite = True, message

    def _transports(self) -> list[Transport]:
        """Every transport this rank sends on, each counted once."""
        extra = [] if self.control is self.transport else [self.control]
        if self.hierarchy is None:
            return [self.transport, *extra]
        return [t for t in (self.transport, self.hierarchy.local, self.hierarchy.leaders) if t is not None] + extra

    @staticmethod
    def _finish_segment(finish, lo: int, hi: int, out: torch.Tensor) -> str | None:
        """Put a started segment's average into ``out[lo:hi]``; why every rank skips the step, if so."""
        average, reason = finish()
        if reason is None:
            out[lo:hi].copy_(average)
        return reason

    def _start_segment(self, name: str, offset: int, grad: torch.Tensor):
        """(a call that finishes this segment, giving (its average, None) or (None, why every
        rank skips the step)), or (None, why every rank skips the step) when it cannot start."""
        stats = self.current
        communicator = self.communicator if stats.compressed else self.dense
        codec = self.encoder.codec_for(stats.compressed)
        hierarchy = self.hierarchy
        payload, bad, failure = None, 0, None
        try:
            if hierarchy is not None:
                # Each worker checks its own gradient, so that a bad one is named, not the
                # node's sum; the leader then encodes the sum only if every part is finite.
                found = find_nonfinite(*as_array(grad.reshape(-1)))
                bad = bad_key(self.control_rank, self.control_world, offset + found[1]) if found else 0
                grad = hierarchy.node_share(grad)
                bad = hierarchy.first_bad(bad)
            if bad == 0 and communicator is not None and (hierarchy is None or hierarchy.nodes > 1):
                # through the memory also when dense: it sends what error feedback held back
                payload = self.encoder.encode(name, grad, stats.compressed, communicator.input_scale)
        except NonFiniteError as exc:  # every codec checks its input; fp16 also its wire type
            bad = bad_key(self.control_rank, self.control_world, offset + (exc.first_index or 0),
                          overflow=isinstance(exc, WireOverflowError))
        except Exception as exc:  # raised here alone, it would leave the others waiting
            failure = exc
        agreed, control = self.agree(bad, failure)
        if agreed.bad is not None:
            rank, index, overflow = agreed.bad
            what = (f"overflows the {codec.value_dtype or codec.name} wire type" if overflow
                    else "is not finite")
            return None, f"rank {rank}'s gradient {what} at {self.layout.where(index)}"
        stats.dense_bytes += ring_allreduce_bytes(4 * grad.numel(), self.world)
        stats.numel += grad.numel()
        stats.buckets.append(grad.numel())
        if hierarchy is None:
            pending = communicator.start(codec, payload, name)
            if not self.config.verify:  # the caller finishes it once the next segment is under way
                return lambda: _checked(self._fed_back(name, communicator, pending), communicator, codec), None
            average = self._fed_back(name, communicator, pending)
        else:  # one node alone: its sum is already everyone's mean
            if payload is not None:
                average = self._fed_back(name, communicator, lambda: communicator.average(codec, payload, name))
            else:
                average = grad
            average = hierarchy.broadcast(average.to(torch.float32).contiguous())
        result = _checked(average, communicator, codec)
        if self.config.verify and result[1] is None:
            verify_segment(stats, communicator, codec, payload, average, control, hierarchy, grad.numel(), name)
        return lambda: result, None

    def _fed_back(self, name: str, communicator, finish) -> torch.Tensor:
        """``finish()``'s average; what the collective left out of this rank's payload goes
        back to its error feedback (a skipped step restores the memory as it was anyway)."""
        average = to_torch(finish())
        if communicator.feeds_back:
            self.encoder.memory.add_back(name, *communicator.take_dropped(name), scale=communicator.input_scale)
        return average

    def agree(self, bad: int = 0, failure: Exception | None = None):
        """(the control word agreed by every rank, the bytes it cost); raises on every rank
        alike when one failed or the ranks disagree. A stop or proposal rides on the next
        word sent; every rank reads it from the same agreement."""
        stats = self.current
        stop, proposal = self._take_requests()
        word = ControlWord(step=self.step, density=float(self.density or 0.0),
                           mode=encode_mode(self.enabled, stats.compressed, self.codec.value_dtype),
                           bad=bad, failed=self.control_world - self.control_rank if failure is not None else 0,
                           stop=int(stop), proposal=proposal)
        control_before = self.control.bytes_sent
        agreed = agree(self.control, word)
        control = self.control.bytes_sent - control_before
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
        self.current.adopted = proposal
        self.compress_at(proposal[1])

    # --- checkpoints ------------------------------------------------------------------------
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

    def residual(self) -> torch.Tensor:
        """This rank's error-feedback residual over the whole flat input (float32, on this
        engine's device; zero where nothing is held yet): what it was handed and has not sent."""
        out = torch.zeros(self.numel, dtype=torch.float32, device=self.transport.device)
        for name, (lo, hi) in zip(self.segment_names, self.segments):
            held = self.memory.residuals.get(name)
            if held is not None:
                held = held if is_torch(held) else to_torch(held)
                out[lo:hi].copy_(held.reshape(-1))
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "enabled": self.enabled, "density": self.density, **self.encoder.state_dict(),
                "totals": dict(self.totals), "drained": self.drained,
                "collective": self.communicator.state_dict() if self.communicator is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; residuals and velocities land on this engine's device,
        cut into its segments whatever the saved ones were."""
        self.step, self.enabled = int(state["step"]), bool(state["enabled"])
        density = state.get("density", state.get("ratio"))  # "ratio": checkpoints before the rename
        if density is not None and self.codec.density is not None:
            self._apply_density(density)
        self.encoder.load_state_dict(state, self.segments, self.numel, like=torch.empty(0, device=self.transport.device))
        self.totals.update(state.get("totals", {}))
        self.drained = bool(state.get("drained", False))
        if self.communicator is not None:  # a plan made for another world size or layout is not used
            self.communicator.load_state_dict(state.get("collective") or {})


def _checked(average: torch.Tensor, communicator, codec):
    """(average, None), or (None, why every rank skips the step: the sum is not finite)."""
    if not all_finite(average):
        via = communicator.name if communicator is not None else "node's broadcast"
        return None, (f"the averaged gradient is not finite after the {via} (the sum "
                      f"overflowed {codec.value_dtype or codec.name} on the wire)")
    return average, None
