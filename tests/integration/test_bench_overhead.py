"""``rayzip bench overhead`` (issue 46: with compression off, a step should cost what plain
DDP's does): real gloo ranks, every step of the hooked variants taken dense through the hook,
and each ratio taken against its DDP baseline's steps of the same round."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rayzip.bench import markdown_table
from rayzip.cli import app


def test_the_overhead_bench_times_dense_hooked_steps_against_ddp_in_the_same_rounds(tmp_path):
    out = tmp_path / "overhead.json"
    result = CliRunner().invoke(app, ["bench", "overhead", "--steps", "3", "--warmup", "1", "--rounds", "2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["commit"] and report["date"] and report["workers"] == 2
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["ddp_sgd", "ddp_again", "ddp_hook", "off", "off_momentum", "ddp_adamw", "off_adam"]
    for name, baseline in (("off", "ddp_sgd"), ("off_momentum", "ddp_sgd"), ("off_adam", "ddp_adamw")):
        row = rows[name]
        assert row["baseline"] == baseline
        assert row["dense_steps"] == 2 * (3 + 1), row  # every step of every round: compression off
        ratios = [m / b for m, b in zip(row["rounds_ms"], rows[baseline]["rounds_ms"])]
        assert row["rounds_ratio"] == pytest.approx(ratios)
        assert len(ratios) == 2 and all(r > 0 for r in ratios)
    assert rows["ddp_sgd"]["ratio"] is None and rows["ddp_sgd"]["dense_steps"] is None
    assert rows["ddp_hook"]["baseline"] == "ddp_sgd" and rows["ddp_hook"]["hook"] == "torch allreduce_hook"
    # The A/A row: a second plain DDP, divided by the first, with no hook of either kind.
    again = rows["ddp_again"]
    assert again["baseline"] == "ddp_sgd" and again["hook"] == "–" and again["dense_steps"] is None
    assert again["rounds_ratio"] == pytest.approx([m / b for m, b in zip(again["rounds_ms"], rows["ddp_sgd"]["rounds_ms"])])
    table = markdown_table(report)
    assert table.count("\n") == len(rows) + 1 and "off_momentum" in table


def test_an_unknown_variant_exits_2_naming_it():
    result = CliRunner().invoke(app, ["bench", "overhead", "--variants", "off,warp"])
    assert result.exit_code == 2 and "warp" in result.output
