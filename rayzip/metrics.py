"""Prometheus metrics, exported through Ray's metrics agent on every node.

Workers record one observation per step; the adaptive controller records its decisions.
Ray serves them on each node's metrics export port with the prefix ``ray_``, which is what
a local Prometheus finds through Ray's service-discovery file (``rayzip prometheus-config``)
and what a PodMonitor scrapes under KubeRay. Every series carries ``run`` (the Ray Train
run), ``job`` (the spec's name) and, for workers, ``rank``; scrape with ``honor_labels``
so that this ``job`` is kept rather than renamed ``exported_job``.

Worker series (``ray_`` + name):

==================================  =========  ==========================================
``rayzip_step_seconds``             histogram  whole training step
``rayzip_compute_seconds``          histogram  step minus communication
``rayzip_comm_seconds``             histogram  what the step waited for communication
``rayzip_collective_delay_seconds`` histogram  end-to-end time inside the collective
``rayzip_bytes_sent_total``         counter    bytes this rank sent
``rayzip_dense_bytes_total``        counter    what a dense fp32 ring allreduce would send
``rayzip_wire_reduction``           gauge      dense bytes over sent bytes of the last step (1: dense)
``rayzip_batch_loss``               gauge      the last batch's loss
``rayzip_step``                     gauge      the last step
``rayzip_checkpoint_bytes``         gauge      rank 0's last checkpoint, stored bytes
``rayzip_checkpoint_ratio``         gauge      its raw bytes over stored bytes
==================================  =========  ==========================================

Driver series (the progress actor's), labelled ``run`` and ``job``: ``rayzip_recoveries_total``
(counter, worker-group restarts), ``rayzip_steps_lost_total`` (counter, steps done before a
restart and done again after it) and ``rayzip_recovery_seconds`` (histogram, from the last
step before a restart to the first step after it).

Controller series: ``rayzip_controller_compression`` (gauge, the decided compression, 1 / density; 1 is
off), ``rayzip_controller_decisions_total`` (counter, label ``source``: prometheus,
workers, or held), ``rayzip_controller_pressure`` and ``rayzip_controller_importance``
(gauges, the decision's inputs).

Usage::

    metrics = WorkerMetrics(run="digits-...", job="digits", rank=0)
    metrics.record(step=3, step_s=0.1, comm_s=0.02, network_s=0.01, bytes_sent=4096,
                   dense_bytes=65536, loss=2.3)
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["BUCKETS", "ControllerMetrics", "RecoveryMetrics", "WorkerMetrics", "prometheus_config"]

# Seconds, doubling from 0.5 ms to 33 s: from a small model on loopback to a dense exchange
# over a slow link.
BUCKETS = [0.0005 * 2 ** k for k in range(17)]


@lru_cache(maxsize=None)
def _worker_series():
    from ray.util.metrics import Counter, Gauge, Histogram

    tags = ("run", "job", "rank")
    hist = {name: Histogram(f"rayzip_{name}_seconds", description=text, boundaries=BUCKETS, tag_keys=tags)
            for name, text in (("step", "Training step time."),
                               ("compute", "Step time outside communication."),
                               ("comm", "Hook start to averaged gradient ready."),
                               ("collective_delay", "End-to-end time inside the collective."))}
    counters = {name: Counter(f"rayzip_{name}_total", description=text, tag_keys=tags)
                for name, text in (("bytes_sent", "Bytes this rank sent."),
                                   ("dense_bytes", "Bytes a dense fp32 ring allreduce would send."))}
    gauges = {name: Gauge(f"rayzip_{name}", description=text, tag_keys=tags)
              for name, text in (("wire_reduction", "Dense bytes over sent bytes of the last step (1: dense)."),
                                 ("batch_loss", "Loss of the last batch."),
                                 ("step", "Last step."),
                                 ("checkpoint_bytes", "Stored bytes of the last checkpoint (rank 0's part)."),
                                 ("checkpoint_ratio", "Raw over stored bytes of the last checkpoint."))}
    return hist, counters, gauges


class WorkerMetrics:
    """One rank's per-step series."""

    def __init__(self, run: str, job: str, rank: int):
        self.tags = {"run": run, "job": job, "rank": str(rank)}
        self.hist, self.counters, self.gauges = _worker_series()
        self._checkpoint: tuple[float, float] | None = None

    def record(self, step: int, step_s: float, comm_s: float, network_s: float, bytes_sent: int,
               dense_bytes: int, loss: float) -> None:
        tags = self.tags
        self.hist["step"].observe(step_s, tags=tags)
        self.hist["compute"].observe(max(0.0, step_s - comm_s), tags=tags)
        self.hist["comm"].observe(comm_s, tags=tags)
        self.hist["collective_delay"].observe(network_s, tags=tags)
        if bytes_sent:
            self.counters["bytes_sent"].inc(bytes_sent, tags=tags)
        if dense_bytes:
            self.counters["dense_bytes"].inc(dense_bytes, tags=tags)
        self.gauges["wire_reduction"].set(dense_bytes / bytes_sent if bytes_sent else 1.0, tags=tags)
        self.gauges["batch_loss"].set(loss, tags=tags)
        self.gauges["step"].set(step, tags=tags)
        if self._checkpoint is not None:
            # Ray's metrics agent drops a gauge that is not set again within two export
            # intervals: the last checkpoint's figures are set again every step.
            self._set_checkpoint(*self._checkpoint)

    def record_checkpoint(self, stored_bytes: int, raw_bytes: int) -> None:
        self._checkpoint = (float(stored_bytes), raw_bytes / stored_bytes if stored_bytes else 1.0)
        self._set_checkpoint(*self._checkpoint)

    def _set_checkpoint(self, stored_bytes: float, ratio: float) -> None:
        self.gauges["checkpoint_bytes"].set(stored_bytes, tags=self.tags)
        self.gauges["checkpoint_ratio"].set(ratio, tags=self.tags)


@lru_cache(maxsize=None)
def _recovery_series():
    from ray.util.metrics import Counter, Histogram

    tags = ("run", "job")
    return (Counter("rayzip_recoveries_total", description="Worker-group restarts.", tag_keys=tags),
            Counter("rayzip_steps_lost_total", description="Steps done before a restart and done again after it.",
                    tag_keys=tags),
            Histogram("rayzip_recovery_seconds", description="From the last step before a restart to the first "
                      "step after it.", boundaries=BUCKETS, tag_keys=tags))


class RecoveryMetrics:
    """A run's restarts, recorded by the driver's progress actor."""

    def __init__(self, run: str, job: str):
        self.tags = {"run": run, "job": job}
        self.recoveries, self.lost, self.seconds = _recovery_series()

    def record(self, steps_lost: int, seconds: float) -> None:
        self.recoveries.inc(1, tags=self.tags)
        if steps_lost:
            self.lost.inc(steps_lost, tags=self.tags)
        self.seconds.observe(seconds, tags=self.tags)


@lru_cache(maxsize=None)
def _controller_series():
    from ray.util.metrics import Counter, Gauge

    tags = ("run", "job")
    return {
        "compression": Gauge("rayzip_controller_compression", description="Decided compression, 1 / density (1: off).",
                             tag_keys=tags),
        "pressure": Gauge("rayzip_controller_pressure", description="Delay per byte over the best seen.", tag_keys=tags),
        "importance": Gauge("rayzip_controller_importance", description="Recent loss over its running mean.",
                            tag_keys=tags),
        "decisions": Counter("rayzip_controller_decisions_total", description="Decisions by the source of their inputs.",
                             tag_keys=(*tags, "source")),
    }


class ControllerMetrics:
    def __init__(self, run: str, job: str):
        self.tags = {"run": run, "job": job}
        self.series = _controller_series()

    def record(self, compression: float, pressure: float | None, importance: float | None, source: str) -> None:
        self.series["compression"].set(compression, tags=self.tags)
        if pressure is not None:
            self.series["pressure"].set(pressure, tags=self.tags)
        if importance is not None:
            self.series["importance"].set(importance, tags=self.tags)
        self.series["decisions"].inc(1, tags={**self.tags, "source": source})


def prometheus_config(scrape_interval: str = "5s",
                      service_discovery: str = "/tmp/ray/prom_metrics_service_discovery.json") -> dict:
    """A prometheus.yml that scrapes every Ray node's metrics port, found through the
    service-discovery file Ray's head keeps up to date."""
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{
            "job_name": "ray",
            "honor_labels": True,  # keep rayzip's own `job` label
            "file_sd_configs": [{"files": [service_discovery], "refresh_interval": scrape_interval}],
        }],
    }
