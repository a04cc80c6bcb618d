"""A real Ray cluster on one Linux machine, its nodes in network namespaces behind shaped links.

One namespace holds a bridge; the head and each worker node get a namespace of their own,
joined to the bridge by a veth pair whose node end is called ``eth0`` everywhere (so gloo
can be pinned with ``GLOO_SOCKET_IFNAME=eth0``). Each worker's ``eth0`` is shaped with tc:
``tbf`` for the rate, and ``netem`` for the latency where the kernel has it. Ray nodes are
started with ``ray start`` inside the namespaces, with token auth. Everything (processes,
namespaces, links) is removed on exit, also on Ctrl-C, SIGTERM or an error.

Usage (as root)::

    with NetnsCluster(nodes=2, bandwidth="100mbit") as cluster:
        cluster.run_in_head([sys.executable, "-m", "rayzip", "run", "jobs/x.yaml"])
        print(cluster.tx_bytes())          # bytes sent on each worker's eth0 so far
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["ClusterError", "NetnsCluster", "leftover_namespaces", "preflight", "rate_bytes"]

SUBNET = "10.213.77"  # private addresses, used only inside namespaces this module creates
IFNAME = "eth0"


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built here, or failed while running."""


def preflight(latency: str | None = None) -> None:
    """Refuse clearly when the machine cannot build the cluster."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces and tc): run it as root")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise ClusterError(f"'{tool}' is missing: install the {package} package")
    if latency and not _qdisc_available("netem"):
        raise ClusterError("this kernel has no netem qdisc (sch_netem), so --latency cannot be emulated; "
                           "leave --latency out or use a kernel with sch_netem")


def _qdisc_available(kind: str) -> bool:
    probe = f"rzprobe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        # a veth pair, as the cluster itself uses: a dummy device needs a module of its own,
        # whose absence would read as a missing qdisc
        _run(["ip", "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1"])
        ok = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "d0", "root", kind],
                            capture_output=True).returncode == 0
    except ClusterError:
        ok = False
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def leftover_namespaces(prefix: str = "rz") -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def remove_namespaces(names: list[str]) -> None:
    """Kill the processes inside ``names``, then delete the namespaces (and so their links)."""
    for ns in names:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    time.sleep(0.5)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_stale_clusters() -> list[str]:
    """Remove namespaces of clusters whose owning process (the pid in rz<pid>-...) is gone."""
    stale = []
    for ns in leftover_namespaces():
        owner = ns[2:].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            stale.append(ns)
    remove_namespaces(stale)
    return stale


class NetnsCluster:
    def __init__(self, nodes: int = 2, bandwidth: str = "100mbit", latency: str | None = None,
                 cpus_per_node: int = 1, python: str = sys.executable):
        if nodes < 1:
            raise ClusterError("nodes must be >= 1")
        self.nodes, self.bandwidth, self.latency = nodes, bandwidth, latency
        self.cpus_per_node = cpus_per_node
        self.python = python
        self.bin = str(Path(python).parent)
        tag = f"{os.getpid()}"
        self.prefix = f"rz{tag}"
        self.bridge_ns = f"{self.prefix}-br"
        self.head_ns = f"{self.prefix}-head"
        self.worker_ns = [f"{self.prefix}-w{i}" for i in range(1, nodes + 1)]
        self.token = secrets.token_hex(32)
        self.tmp = Path(tempfile.mkdtemp(prefix="rayzip-netns-"))
        self.head_ip = f"{SUBNET}.1"
        self.address = f"{self.head_ip}:6379"
        self.dashboard = f"http://{self.head_ip}:8265"
        self._previous_sigterm = None

    # --- environment ------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
               "GLOO_SOCKET_IFNAME": IFNAME, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
               "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        env.update(extra)
        return env

    def node_ip(self, index: int) -> str:
        """index 0 is the head, 1..nodes the workers."""
        return f"{SUBNET}.{index + 1}"

    # --- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        preflight(self.latency)
        remove_stale_clusters()
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            self._build_network()
            self._start_ray()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _build_network(self) -> None:
        _run(["ip", "netns", "add", self.bridge_ns])
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        for index, ns in enumerate([self.head_ns, *self.worker_ns]):
            peer = f"v{self.prefix}{index}"[:15]
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", peer, "type", "veth", "peer", "name", IFNAME, "netns", ns])
            _run(["ip", "link", "set", peer, "netns", self.bridge_ns])
            _run(["ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", peer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_ip(index)}/24", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for ns in self.worker_ns:
            self.shape(ns, self.bandwidth)

    def shape(self, ns: str, rate: str) -> None:
        """(Re)shape a node's eth0: tbf at ``rate``, under netem's delay when latency is set."""
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFNAME, "root"], capture_output=True)
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME]
        # A burst of at least rate/250 bytes (4 ms) keeps tbf from starving fast links.
        burst = max(64 * 1024, rate_bytes(rate) // 250)
        tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "200ms"]
        if self.latency:
            _run([*tc, "root", "handle", "1:", "netem", "delay", self.latency])
            _run([*tc, "parent", "1:", "handle", "2:", *tbf])
        else:
            _run([*tc, "root", "handle", "1:", *tbf])

    def set_bandwidth(self, rate: str) -> None:
        """Change every worker link's rate while the cluster runs."""
        for ns in self.worker_ns:
            self.shape(ns, rate)
        self.bandwidth = rate

    def _start_ray(self) -> None:
        ray = str(Path(self.bin) / "ray")
        _run(["ip", "netns", "exec", self.head_ns, ray, "start", "--head", f"--node-ip-address={self.head_ip}",
              "--port=6379", "--num-cpus=0", "--dashboard-host=0.0.0.0", "--dashboard-port=8265",
              "--disable-usage-stats", f"--temp-dir={self.tmp / 'ray'}"], env=self.env(), timeout=300)
        for index in range(1, self.nodes + 1):
            self._start_worker(index)
        self._wait_for_nodes(self.nodes + 1, timeout=180)

    def _start_worker(self, index: int) -> None:
        _run(["ip", "netns", "exec", self.worker_ns[index - 1], str(Path(self.bin) / "ray"), "start",
              f"--address={self.address}", f"--node-ip-address={self.node_ip(index)}",
              f"--num-cpus={self.cpus_per_node}", "--disable-usage-stats"], env=self.env(), timeout=300)

    def alive_nodes(self) -> int:
        """How many of the cluster's Ray nodes (the head among them) the GCS holds alive
        (0 where the question failed)."""
        probe = ("import ray; ray.init(address='auto', logging_level='ERROR'); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        out = self.run_in_head([self.python, "-c", probe], capture_output=True, text=True,
                               env=self.env(RAY_ADDRESS=self.address), timeout=120)
        lines = out.stdout.strip().splitlines()
        return int(lines[-1]) if out.returncode == 0 and lines and lines[-1].isdigit() else 0

    def _wait_for_nodes(self, count: int, timeout: float) -> None:
        deadline = time.time() + timeout
        alive = 0
        while time.time() < deadline:
            alive = self.alive_nodes()
            if alive == count:
                return
            time.sleep(2)
        raise ClusterError(f"{alive} of the {count} Ray nodes expected are alive after {timeout:.0f} s")

    def kill_node(self, index: int) -> int:
        """Lose worker node ``index`` (1 .. nodes) at once, as a machine that dies: SIGKILL every
        process in its namespace (its raylet, its training worker, its snapshot keeper). Its
        link stays, so peers get refused connections rather than silence. Returns how many
        processes were killed."""
        ns = self.worker_ns[index - 1]
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def node_of(self, pid: int) -> int | None:
        """The worker node (1 .. nodes) whose namespace process ``pid`` runs in, or None (the
        head's, or gone)."""
        found = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.split()
        return self.worker_ns.index(found[0]) + 1 if found and found[0] in self.worker_ns else None

    def replace_node(self, index: int, timeout: float = 180) -> None:
        """After :meth:`kill_node`: wait until the GCS has marked the lost node dead, then
        start a new Ray node in its namespace (same address, a new node id and an empty
        keeper, as a replacement machine), and wait until it is alive."""
        self._wait_for_nodes(self.nodes, timeout)
        self._start_worker(index)
        self._wait_for_nodes(self.nodes + 1, timeout)

    def teardown(self) -> None:
        """Kill every process in the cluster's namespaces, then delete them and their links.

        A second Ctrl-C (or SIGTERM) while this runs is ignored, so cleanup always finishes.
        """
        masked = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            remove_namespaces([*self.worker_ns, self.head_ns, self.bridge_ns])
            shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            for sig, handler in masked.items():
                signal.signal(sig, handler)
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    # --- use ----------------------------------------------------------------------------
    def run_in_head(self, cmd: list[str], on_poll=None, timeout: float | None = None,
                    **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the head's namespace; ``on_poll(proc)`` is called every 0.5 s while
        it runs (to change the links mid-run)."""
        kwargs.setdefault("env", self.env(RAY_ADDRESS=self.address))
        full = ["ip", "netns", "exec", self.head_ns, *cmd]
        if on_poll is None:
            return subprocess.run(full, timeout=timeout, **kwargs)
        capture = kwargs.pop("capture_output", False)
        if capture:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        result = subprocess.CompletedProcess(full, 0)
        with subprocess.Popen(full, **kwargs) as proc:
            deadline = None if timeout is None else time.time() + timeout
            # Drain output on threads, so a chatty job cannot block on a full pipe.
            chunks: dict[str, list] = {"stdout": [], "stderr": []}
            readers = [threading.Thread(target=lambda s=stream, k=key: chunks[k].append(s.read()), daemon=True)
                       for key, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)) if stream is not None]
            for reader in readers:
                reader.start()
            try:
                while proc.poll() is None:
                    if deadline is not None and time.time() > deadline:
                        raise subprocess.TimeoutExpired(full, timeout)
                    on_poll(result)
                    time.sleep(0.5)
            except BaseException:
                # Ctrl-C, SIGTERM or a failed poll: stop the job, or leaving the block would
                # wait for it to end before the cluster is torn down.
                proc.kill()
                raise
            for reader in readers:
                reader.join()
        result.returncode = proc.returncode
        result.stdout = "".join(chunks["stdout"]) if capture else None
        result.stderr = "".join(chunks["stderr"]) if capture else None
        return result

    def tx_bytes(self) -> list[int]:
        """Bytes sent so far on each worker's eth0 (the kernel's own count)."""
        out = []
        for ns in self.worker_ns:
            result = _run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{IFNAME}/statistics/tx_bytes"])
            out.append(int(result.stdout.strip()))
        return out


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def rate_bytes(rate: str) -> int:
    """Bytes per second of a tc rate such as 100mbit or 1gbit."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}
    text = rate.lower()
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    raise ClusterError(f"bandwidth {rate!r} is not a tc rate like 100mbit or 1gbit")
