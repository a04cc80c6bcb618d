"""CPU seconds by process while a command runs: where a test's or a fit's time goes on a
CPU-bound machine (processes grouped by their command line, digits folded).

    .venv/bin/python tools/cpu_by_process.py -- .venv/bin/python my_fit.py

A process is sampled from /proc/<pid>/stat every 0.2 s; one that exits between samples
loses its last fraction of a second. Ray workers rename themselves (ray::RayTrainWorker,
then the task they run): a process counts under the last name seen.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _snapshot() -> dict[int, tuple[int, str]]:
    seen = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline") as cmdline:
                fields, command = stat.read(), cmdline.read().replace("\0", " ").strip()
        except OSError:
            continue
        after_name = fields.rsplit(")", 1)[1].split()
        name = command or fields.split("(", 1)[1].rsplit(")", 1)[0]
        seen[int(pid)] = (int(after_name[11]) + int(after_name[12]), name[:100])  # utime + stime
    return seen


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit("usage: cpu_by_process.py -- COMMAND...")
    first = _snapshot()
    last = dict(first)
    started = time.perf_counter()
    child = subprocess.Popen(argv[argv.index("--") + 1:])
    while child.poll() is None:
        for pid, value in _snapshot().items():
            first.setdefault(pid, (0, value[1]))  # started during the run: all its CPU counts
            last[pid] = value
        time.sleep(0.2)
    wall = time.perf_counter() - started
    by_name: collections.Counter = collections.Counter()
    for pid, (ticks, name) in last.items():
        by_name[re.sub(r"\d+", "N", name)] += (ticks - first[pid][0]) / TICKS
    print(f"wall {wall:.1f} s, CPU {sum(by_name.values()):.1f} s (exit {child.returncode})")
    for name, seconds in by_name.most_common(30):
        if seconds >= 0.05:
            print(f"{seconds:8.2f}  {name}")


if __name__ == "__main__":
    main(sys.argv)
