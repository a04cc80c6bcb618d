"""A benchmark's rows as a table, printed (rich) or for the docs (Markdown), from one list of
columns: each a heading and a function of a row giving its cell."""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["Columns", "markdown_rows", "rich_rows"]

Columns = list[tuple[str, Callable[[Any], str]]]


def rich_rows(title: str, columns: Columns, rows: Iterable):
    from rich.table import Table

    table = Table(title=title)
    for head, _ in columns:
        table.add_column(head, justify="right")
    for row in rows:
        table.add_row(*(cell(row) for _, cell in columns))
    return table


def markdown_rows(columns: Columns, rows: Iterable) -> str:
    """The Markdown table the docs show (generated, not typed)."""
    lines = ["| " + " | ".join(head for head, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
    return "\n".join(lines)
