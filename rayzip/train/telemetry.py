"""Per-step telemetry from any training loop: Prometheus series, the adaptive controller,
and compression adoption agreed in the hook's control word.

``rayzip run``'s loops use it, and so can your own ``train_func``::

    import rayzip.train

    model = rayzip.train.prepare_model(model, compression=CompressionConfig(codec="group_topk", density=0.01))
    telemetry = rayzip.train.Telemetry(model, run="my-run", controller=controller_name("my-run"))
    for step, batch in enumerate(loader):
        telemetry.begin_step()
        loss = ...; loss.backward(); optimizer.step()
        telemetry.end_step(step, float(loss))          # a StepRecord

``controller`` names an adaptive controller actor started on the driver with
:func:`rayzip.adaptive.start_controller`; its compression decisions reach every rank at the same
step (:class:`Adoption`). Every rank must call ``begin_step``/``end_step`` at every step.
"""

from __future__ import annotations

import math
import time

import ray
import torch

from ..engine import GradientExchange
from ..metrics import WorkerMetrics
from .records import StepRecord, Traffic, traffic_of
from .local import OwnLoopLocalSteps

__all__ = ["Adoption", "Telemetry"]

START_WAIT_S = 5.0  # how long every rank waits, before the first step, for the start decision


class Adoption:
    """Rank 0 takes the controller's latest decision without waiting (``poll`` returns a
    ``{"seq", "compression"}`` decision or None) and proposes it in the step's control word; every
    rank adopts the agreed proposal from the next step on, however late the decision came.
    ``applied(seq, step)`` tells the controller, once, from rank 0."""

    def __init__(self, poll, applied, rank: int, state):
        self.poll, self.applied, self.rank, self.state = poll, applied, rank, state
        self.proposed_seq = self.applied_seq = -1

    @classmethod
    def from_controller(cls, controller, rank: int, state) -> "Adoption":
        pending = [controller.decision.remote()] if rank == 0 else []

        def poll():
            ready, _ = ray.wait(pending, timeout=0)
            if not ready:
                return None
            decision = ray.get(pending[0])
            pending[0] = controller.decision.remote()
            return decision

        return cls(poll, lambda seq, step: controller.applied.remote(seq, step), rank, state)

    def before_step(self) -> None:
        if self.rank != 0:
            return
        latest = self.poll()
        if latest is not None and latest["seq"] > self.proposed_seq and latest["compression"] >= 1.0:
            # Agreed in this step's control word, applied by every rank from the next step.
            self.proposed_seq = latest["seq"]
            self.state.propose(latest["compression"], seq=latest["seq"])

    def after_step(self, step: int) -> None:
        adopted = self.state.last_step.adopted if self.state.last_step is not None else None
        if adopted is not None and adopted[0] > self.applied_seq:
            self.applied_seq = adopted[0]
            if self.rank == 0:
                self.applied(adopted[0], step + 1)


class Telemetry:
    """Records each step: Prometheus (``metrics=True``, through Ray's metrics agent, with run,
    job and rank labels), the controller's inputs, and its decisions' adoption."""

    def __init__(self, model: torch.nn.Module | None = None, run: str = "rayzip", job: str | None = None,
                 controller=None, metrics: bool = True, rank: int | None = None,
                 state: GradientExchange | None = None):
        from .api import compression_state

        if rank is None:
            rank = ray.train.get_context().get_world_rank()
        self.rank = rank
        self.world = (torch.distributed.get_world_size()  # None: the controller counts the ranks it sees
                      if torch.distributed.is_available() and torch.distributed.is_initialized() else None)
        self.state = state if state is not None else (compression_state(model) if model is not None else None)
        self.model = model
        self.metrics = WorkerMetrics(run, job or run, rank) if metrics else None
        if isinstance(controller, str):
            controller = ray.get_actor(controller)
        if controller is not None and isinstance(self.state, OwnLoopLocalSteps):
            raise ValueError("the adaptive controller sets per-step compression, and this model runs local steps "
                             "(prepare_model's default under an adaptive optimizer is SparseLoCo's wire every step): "
                             "give prepare_model a compression=CompressionConfig(...) for the controller to tune")
        self.controller = controller
        self.adoption = (Adoption.from_controller(controller, rank, self.state)
                         if controller is not None and self.state is not None else None)
        self._started: float | None = None
        # The timed start-up sync (rayzip.train.probe), where the caller timed one.
        probe = self.state.link_probe if self.state is not None else None
        if self.controller is not None and probe is not None:
            # Now, not with the first step: a handle's first call waits for the actor's
            # address, and the controller combines a step only once every rank's report is in.
            self.controller.report_link.remote(self.rank, probe.bytes, probe.seconds, probe.messages)

    def start(self, compute_s: float) -> None:
        """Before the first step, on every rank (``rayzip run``'s loops call it): a dry
        compressed exchange (:meth:`~rayzip.engine.GradientExchange.dry_run`), reported
        to the controller as step -1 with ``compute_s`` (a compute-only forward and backward),
        then the controller's start decision, which rank 0 fetches and every rank applies
        from step 0. So a fast link starts dense and a slow one at the compression the cost model
        picks, rather than at the spec's compression until a few steps are measured. Without a
        controller that decides before a step, it changes nothing."""
        if self.controller is None or self.state is None or self.state.link_probe is None:
            return
        dry = self.state.dry_run()
        self._report(StepRecord(step=-1, loss=float("nan"), lr=0.0, step_s=compute_s + dry.comm_s,
                                traffic=traffic_of(dry)))
        torch.distributed.barrier()  # every rank's dry step is on its way before rank 0 asks
        decision = torch.full((2,), float("nan"), dtype=torch.float64, device=self.state.transport.device)
        if self.rank == 0:
            answer = self._start_decision()
            if answer is not None:
                decision[0], decision[1] = answer["seq"], answer["compression"]
        torch.distributed.broadcast(decision, 0)  # NCCL: on the hook's device
        seq, compression = decision.tolist()
        if math.isnan(compression):
            return  # no decision in time: the spec's compression until the controller's first
        seq = int(seq)
        self.state.compress_at(compression)
        if self.adoption is not None:
            self.adoption.proposed_seq = self.adoption.applied_seq = seq  # in force: not proposed again
        if self.rank == 0:
            self.controller.applied.remote(seq, 0)

    def _start_decision(self) -> dict | None:
        """Rank 0: the controller's start decision, once it has every rank's dry step."""
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                answer = ray.get(self.controller.start.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # a controller that is gone or too slow: training does not wait
                return None
            if answer is not None or time.monotonic() >= deadline:
                return answer
            time.sleep(0.02)

    def begin_step(self) -> None:
        if self.adoption is not None:
            self.adoption.before_step()
        self._started = time.perf_counter()

    def end_step(self, step: int, loss: float, lr: float = 0.0) -> StepRecord:
        """For a loop that calls :meth:`begin_step`: the step's record from the hook's counters."""
        step_s = time.perf_counter() - (self._started if self._started is not None else time.perf_counter())
        record = StepRecord(step=step, loss=loss, lr=lr, step_s=step_s, traffic=self._traffic(),
                            skipped=bool(self.state is not None and self.state.last_step.skipped))
        self.record(record)
        return record

    def _traffic(self) -> Traffic:
        if self.state is not None and self.state.last_step is not None:
            return traffic_of(self.state.last_step)
        return Traffic(comm_source="not measured", bytes_source="none")

    def record(self, record: StepRecord) -> None:
        t = record.traffic
        if self.metrics is not None:
            self.metrics.record(record.step, record.step_s, t.comm_s, t.network_s, t.bytes_sent, t.dense_bytes,
                                record.loss)
        if self.controller is not None:
            self._report(record)
        if self.adoption is not None:
            self.adoption.after_step(record.step)

    def _report(self, record: StepRecord) -> None:
        t = record.traffic
        self.controller.report.remote(self.rank, record.step, record.loss, record.step_s, t.comm_s, t.network_s,
                                      t.bytes_sent, t.dense_bytes, busy_s=t.busy_s, messages=t.messages,
                                      density=t.density if t.compressed else None, world=self.world)

    def record_checkpoint(self, stored_bytes: int, raw_bytes: int) -> None:
        if self.metrics is not None:
            self.metrics.record_checkpoint(stored_bytes, raw_bytes)
