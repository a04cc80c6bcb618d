"""`rayzip bench checkpoint` end to end through the CLI (issue 5), at a tiny scale."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from rayzip.cli import app

runner = CliRunner()


def test_bench_checkpoint_compares_rayzip_zstd_and_zipnn_on_the_same_data(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"name": "tiny", "model": {"name": "mlp", "hidden": [256, 256]},
                                    "dataset": {"name": "digits"}}))
    out = tmp_path / "ckpt.json"
    result = runner.invoke(app, ["bench", "checkpoint", "--spec", str(spec), "--steps", "3", "--repeat", "2",
                                 "--compressors", "rayzip,rayzip-1t,zstd-3,zipnn", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {(r["data"], r["compressor"]) for r in rows} == {
        (d, c) for d in ("full", "delta-1", "delta-10", "delta-100") for c in ("rayzip", "rayzip-1t", "zstd-3", "zipnn")}
    for r in rows:
        assert {"data", "compressor", "ratio", "compress_gbps", "decompress_gbps"} <= set(r)
        assert r["ratio"] == pytest.approx(r["raw_bytes"] / r["stored_bytes"])
        assert r["compress_gbps"] > 0 and r["decompress_gbps"] > 0
    # Each data set is the same bytes for every compressor.
    for data in ("full", "delta-1"):
        assert len({r["raw_bytes"] for r in rows if r["data"] == data}) == 1
    assert report["comparisons"]["full_ratio_vs_zipnn"] > 0
    assert "zipnn" in result.output


def test_bench_checkpoint_refuses_unknown_compressors():
    result = runner.invoke(app, ["bench", "checkpoint", "--compressors", "rayzip,lz4"])
    assert result.exit_code == 2 and "lz4" in result.output
