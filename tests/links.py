"""A link emulation that a test slows mid-run: the rate (bytes per second) is read from a file,
again whenever the file changes; empty or 0: no limit."""

from __future__ import annotations

import os

from rayzip.comm import Emulation, Link

__all__ = ["FileLink"]


class FileLink(Emulation):
    def __init__(self, path: str):
        self.path = str(path)
        self._seen: tuple[int, Link | None] | None = None

    def link(self) -> Link | None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if self._seen is None or self._seen[0] != mtime:
            try:
                text = open(self.path).read().strip()
                rate = float(text) if text else 0.0
            except (OSError, ValueError):
                rate = 0.0
            self._seen = (mtime, Link(bandwidth=rate, latency=0.0) if rate > 0 else None)
        return self._seen[1]
