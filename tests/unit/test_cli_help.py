"""Every command's --help says what it does and shows an example (issue 20)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from rayzip.cli import app


def _commands(group, prefix=()):
    yield prefix
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer vendors its own click)
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name)


@pytest.mark.parametrize("path", list(_commands(typer.main.get_command(app))), ids=lambda p: " ".join(p) or "rayzip")
def test_help_shows_an_example(path):
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Example: rayzip " in text or "Example: sudo rayzip " in text, text
    example = text.split("Example: ")[1].split()
    assert example[example.index("rayzip") + 1: example.index("rayzip") + 1 + len(path)] == list(path)
