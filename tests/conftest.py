"""Shared fixtures, and the lanes: a test's folder is its marker.

- ``tests/unit``: pure functions and codecs, in this process (``make test-unit``);
- ``tests/integration``: real gloo process groups and processes of the test's own;
- ``tests/system``: real Ray, Prometheus, Ray Jobs, network namespaces.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from own_processes import proc_stat
from paths import TESTS

LANES = ("unit", "integration", "system")
# Ray Train's controller notices a finished worker group at its health check, every 2 s by
# default: the tests' many short runs would each wait for it. Inherited by every Ray the
# tests start.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray Train starts a preemption watcher actor (a process of its own) with every run; no test
# preempts a node, and on 2 cores each such process costs every run seconds of CPU.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# After a node is lost, Ray Train's stale view of the cluster can ask for the old group size
# once; its placement group then waits this long (60 s by default) before the group restarts
# with the workers that are left. A placement group the cluster can hold is ready in well
# under a second, even on 2 loaded cores.
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "4")
_STARTED = time.perf_counter()
_STARTED_AT = time.time()
_SPENT = dict.fromkeys(LANES, 0.0)  # seconds of setup, call and teardown, by lane


def pytest_collection_modifyitems(config, items):
    lane_of = {}
    for item in items:
        lane = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else None
        if lane not in LANES:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(LANES)}}}/")
        item.add_marker(getattr(pytest.mark, lane))
        lane_of[item] = LANES.index(lane)
    # The fast lanes first; in a lane, the tests that want the shared Ray run one after another,
    # after those that must not have it (their own clusters, benchmarks), so that it starts
    # once rather than again after each of those. The sort is stable: modules keep their order.
    items.sort(key=lambda item: (lane_of[item], "local_ray" in item.fixturenames))


def pytest_runtest_logreport(report):
    for lane in LANES:
        if f"tests/{lane}/" in report.nodeid:
            _SPENT[lane] += report.duration


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def _orphaned_ray_processes() -> list[str]:
    """Ray processes started during this run and left behind (their parent is init): a test
    that leaked them slowed every test after it, by the CPU they burn."""
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    tick = os.sysconf("SC_CLK_TCK")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = proc_stat(entry.name)
        try:
            name = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            stat = None
        if stat is None:  # gone meanwhile
            continue
        started = boot + int(stat[19]) / tick
        if stat[1] == "1" and started >= _STARTED_AT and ("ray::" in name or name.endswith(("raylet", "gcs_server"))):
            found.append(f"{entry.name} {name} ({(int(stat[11]) + int(stat[12])) / tick:.0f} CPU-s)")
    return found


@pytest.hookimpl(trylast=True)  # the last line of the run, after the slowest tests
def pytest_terminal_summary(terminalreporter):
    orphans = _orphaned_ray_processes()
    if orphans:
        terminalreporter.write_line(f"rayzip tests: Ray processes left behind: {'; '.join(orphans)}")
    spent = ", ".join(f"{lane} {_clock(seconds)}" for lane, seconds in _SPENT.items() if seconds)
    terminalreporter.write_line(f"rayzip tests: {_clock(time.perf_counter() - _STARTED)} (min:s) in all; by lane: {spent}")


class _SharedRay:
    """A real local Ray (2 CPUs) kept from one test to the next while they all want one:
    starting it costs seconds each module would pay again. A test that does not ask for it
    (its own cluster, a benchmark's, no Ray at all) gets a machine without it, since an idle
    Ray's daemons take CPU from what that test times. Workers import helper modules in tests/
    (poisoned_data, user_loops, links) by name, through PYTHONPATH; metrics are reported every
    second, for the adaptive tests that read them through Prometheus."""

    up = False

    def start(self) -> None:
        import ray

        if not self.up:
            ray.init(address="local", num_cpus=2, _system_config={"metrics_report_interval_ms": 1000},
                     runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}})
            self.up = True

    def stop(self) -> None:
        if self.up:  # import ray only where it was started: the GPU machine has no Ray
            import ray

            ray.shutdown()
            self.up = False


_RAY = _SharedRay()


def pytest_runtest_setup(item):
    if "local_ray" not in item.fixturenames:
        _RAY.stop()


def pytest_sessionfinish(session):
    _RAY.stop()


@pytest.fixture
def local_ray():
    """The shared local Ray (see :class:`_SharedRay`)."""
    _RAY.start()
