"""Benchmarks, run as ``rayzip bench ...``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["markdown_table", "provenance", "write_json"]


def markdown_table(report: dict, part: str | None = None) -> str | None:
    """A ``bench cluster``, ``scaling``, ``collectives`` (real or ``--simulate``), ``codecs``, ``checkpoint``,
    ``sharded-checkpoint``, ``encoder``, ``chaos`` or ``overhead`` report as
    the Markdown table the README shows (generated from the JSON, never typed); None for
    other reports, or for a ``part`` the report does not have (``stall``: a checkpoint
    report's stall table; ``threads``: its speed on its default threads over one thread;
    ``headline``: a cluster report's narrow table for the README and the home page;
    ``memory``: a sharded-checkpoint report's bytes held per rank; ``history``: an encoder
    report's accuracy at each evaluation)."""
    if part is not None:
        if part == "stall" and report.get("stall"):
            from .checkpoint import stall_markdown_table

            return stall_markdown_table(report["stall"])
        if part == "threads" and "results" in report and "comparisons" in report:
            from .checkpoint import threads_markdown_table

            return threads_markdown_table(report)
        if part == "memory" and report.get("bench") == "sharded-checkpoint":
            from .sharded_checkpoint import memory_markdown_table

            return memory_markdown_table(report)
        if part == "history" and report.get("bench") == "encoder":
            from .encoder import history_markdown_table

            return history_markdown_table(report)
        if part == "headline" and "methods" in report:
            from .cluster import headline_markdown_table

            return headline_markdown_table(report)
        return None
    if "codecs" in report and "memcpy_gbps" in report:
        from .codecs import markdown_table as codecs_table

        return codecs_table(report)
    if report.get("bench") == "collectives-simulated" and "rows" in report:
        from .simulate import markdown_table as simulated_table

        return simulated_table(report)
    if report.get("bench") == "overhead":
        from .overhead import markdown_table as overhead_table

        return overhead_table(report)
    if report.get("bench") == "collectives" and "rows" in report:
        from .collectives import markdown_table as collectives_table

        return collectives_table(report)
    if "methods" in report:
        from .cluster import markdown_table as cluster_table

        return cluster_table(report)
    if "rows" in report and "node_counts" in report:
        from .cluster import scaling_markdown_table

        return scaling_markdown_table(report)
    if report.get("bench") == "chaos":
        from .chaos import markdown_table as chaos_table

        return chaos_table(report)
    if report.get("bench") == "encoder":
        from .encoder import markdown_table as encoder_table

        return encoder_table(report)
    if report.get("bench") == "sharded-checkpoint":
        from .sharded_checkpoint import markdown_table as sharded_table

        return sharded_table(report)
    if "results" in report and "comparisons" in report:
        from .checkpoint import markdown_table as checkpoint_table

        return checkpoint_table(report)
    return None


def provenance(checkout: Path | None = None) -> dict:
    """The commit the benchmark ran (``RAYZIP_COMMIT`` where set, for a copy of the tree
    outside its checkout; else ``git rev-parse HEAD`` where the package, or ``checkout``, sits
    in a checkout, with "-dirty" appended when tracked files differ from it, as ``git
    describe --dirty`` marks them; else "unknown") and the UTC time it was written."""
    import datetime
    import os
    import subprocess

    commit = os.environ.get("RAYZIP_COMMIT")
    if not commit:
        where = checkout or Path(__file__).resolve().parent
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, check=True,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
            changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                     check=True, capture_output=True, text=True, timeout=30).stdout.strip()
            commit += "-dirty" if changed else ""
        except (OSError, subprocess.SubprocessError):
            pass
    return {"commit": commit or "unknown", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_json(report: dict, path: Path) -> None:
    """Every benchmark's ``--json``: the report with its commit and date, indented, in a file
    whose folder is made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance(), **report}, indent=2) + "\n")
