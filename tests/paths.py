"""Where the tests find the repository: ``ROOT`` (the clone) and ``TESTS`` (this folder, whose
helper modules Ray's workers import by name)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

__all__ = ["ROOT", "TESTS"]
