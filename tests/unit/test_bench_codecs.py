"""`rayzip bench codecs` end to end through the CLI (issue 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rayzip.bench.codecs import DEFAULT_CODECS, parse_codec_spec, parse_size
from rayzip.cli import app

runner = CliRunner()


def test_bench_codecs_reports_every_codec_against_memcpy(tmp_path):
    out = tmp_path / "codecs.json"
    result = runner.invoke(app, ["bench", "codecs", "--size", "1M", "--repeat", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["size_bytes"] == 1 << 20 and report["memcpy_gbps"] > 0
    names = [c["name"] for c in report["codecs"]]
    assert names == [parse_codec_spec(s)[0] for s in DEFAULT_CODECS]
    for c in report["codecs"]:
        assert {"name", "wire_reduction", "encode_gbps", "decode_gbps", "rel_error", "vs_memcpy"} <= set(c)
        assert c["encode_gbps"] > 0 and c["decode_gbps"] > 0
        assert c["vs_memcpy"] == pytest.approx(c["encode_gbps"] / report["memcpy_gbps"])
        assert c["wire_reduction"] == pytest.approx(report["size_bytes"] / c["payload_bytes"])
    by_name = {c["name"]: c for c in report["codecs"]}
    assert by_name["none"]["rel_error"] == 0 and by_name["none"]["wire_reduction"] == 1
    assert by_name["group_topk"]["wire_reduction"] >= 50
    for name in names:
        assert name in result.output


def test_bench_codecs_takes_codec_options():
    result = runner.invoke(app, ["bench", "codecs", "--size", "256K", "--repeat", "1",
                                 "--codecs", "group_topk:density=0.1,group_size=256;dct_quant:bits=4"])
    assert result.exit_code == 0, result.output
    assert "group_topk" in result.output and "dct_quant" in result.output


@pytest.mark.parametrize("args,message", [
    (["--codecs", "zip"], "unknown codec 'zip'"),
    (["--codecs", "topk:density=2"], "density must be in"),
    (["--codecs", "topk:ratio"], "not key=value"),
    (["--size", "lots"], "not a byte count"),
])
def test_bench_codecs_bad_input_exits_2(args, message):
    result = runner.invoke(app, ["bench", "codecs", "--repeat", "1", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_parse_size():
    assert parse_size("64M") == 64 << 20 and parse_size("1G") == 1 << 30
    assert parse_size("4096") == 4096 and parse_size("2MiB") == 2 << 20
