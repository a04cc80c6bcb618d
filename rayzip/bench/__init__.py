"""Benchmarks, run as ``rayzip bench ...``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_json"]


def write_json(report: dict, path: Path) -> None:
    """Every benchmark's ``--json``: the report, indented, in a file whose folder is made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
