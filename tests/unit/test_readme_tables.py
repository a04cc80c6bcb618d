"""Every table of the README and the docs that names the JSON it came from is that JSON,
rendered by `rayzip bench table` (no typed figures)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rayzip.bench import markdown_table

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- table from (\S+\.json)(?:#(\w+))? -->\n((?:\|.*\|\n)+)")


def _tables(pages=("README.md",)):
    return [found for page in pages for found in MARKER.findall((ROOT / page).read_text())]


PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))


def test_the_readme_has_a_generated_headline_table():
    assert [source for source, _, _ in _tables()] == ["docs/bench-cluster-100mbit.json"]


def test_the_gpu_page_has_its_generated_tables():
    assert {source for source, _, _ in _tables(("docs/guides/gpu.md",))} == {"docs/bench-codecs-cuda.json",
                                                                       "docs/bench-stall-gpt-cuda.json"}


@pytest.mark.parametrize("source, part, table", _tables(PAGES))
def test_a_generated_table_matches_its_json(source, part, table):
    report = json.loads((ROOT / source).read_text())
    assert table.strip() == markdown_table(report, part or None).strip(), \
        f"regenerate with: rayzip bench table {source}" + (f" --part {part}" if part else "")


def test_bench_table_prints_the_markdown_and_refuses_other_files(tmp_path):
    from typer.testing import CliRunner

    from rayzip.cli import app

    source, part, table = _tables()[0]
    assert part == "headline"  # the README's narrow table; the benchmark page has every column
    result = CliRunner().invoke(app, ["bench", "table", str(ROOT / source), "--part", part])
    assert result.exit_code == 0 and result.output.strip() == table.strip()
    other = tmp_path / "x.json"
    other.write_text('{"rows": []}')
    result = CliRunner().invoke(app, ["bench", "table", str(other)])
    assert result.exit_code == 2 and "not a `rayzip bench cluster` or `bench collectives` report" in result.output


def test_bench_table_redraws_a_cluster_reports_plot_and_refuses_another_kind(tmp_path):
    from typer.testing import CliRunner

    from rayzip.cli import app

    png = tmp_path / "curves.png"
    result = CliRunner().invoke(app, ["bench", "table", str(ROOT / "docs" / "bench-time-to-target-10gbit.json"),
                                      "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    result = CliRunner().invoke(app, ["bench", "table", str(ROOT / "docs" / "bench-collectives.json"),
                                      "--plot", str(tmp_path / "no.png")])
    assert result.exit_code == 2 and "draws `rayzip bench cluster` reports only" in result.output
    assert not (tmp_path / "no.png").exists()


def test_every_benchmark_json_names_its_commit_and_date():
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.json"))
               if not {"commit", "date"} <= set(json.loads(p.read_text()))]
    assert not missing, f"without commit and date (rerun the page's command): {missing}"


def test_every_file_under_docs_is_referenced_by_a_page():
    pages = "".join((ROOT / page).read_text() for page in (*PAGES, "mkdocs.yml"))
    unreferenced = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*"))
                    if p.is_file() and p.suffix != ".md" and p.name not in pages]
    assert not unreferenced, f"delete them, or cite them from a page: {unreferenced}"
