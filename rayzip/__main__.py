"""``python -m rayzip``: the CLI, for environments whose PATH lacks the console script."""

from .cli import app

app(prog_name="rayzip")
