"""`rayzip bench checkpoint` end to end through the CLI (issue 5), at a tiny scale."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rayzip.bench import markdown_table
from rayzip.cli import app

runner = CliRunner()


def test_bench_checkpoint_compares_rayzip_zstd_and_zipnn_on_the_same_data(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"name": "tiny", "model": {"name": "mlp", "hidden": [256, 256]},
                                    "dataset": {"name": "digits"}}))
    out = tmp_path / "ckpt.json"
    user = "rayzip.bench.checkpoint:user_workload"  # a module:function model (a small CNN)
    result = runner.invoke(app, ["bench", "checkpoint", "--spec", str(spec), "--model", f"mlp,{user}",
                                 "--steps", "3", "--repeat", "2", "--min-seconds", "0", "--compressors", "rayzip,rayzip-1t,zstd-3,zipnn-1t",
                                 "--stall-model", "mlp", "--stall-rounds", "1", "--stall-every", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = report["results"]
    data = ("weights", "m", "v", "all", "bf16-weights", "delta-1", "delta-10", "delta-100")
    assert {(r["model"], r["data"], r["compressor"]) for r in rows} == {
        (m, d, c) for m in ("mlp", user) for d in data for c in ("rayzip", "rayzip-1t", "zstd-3", "zipnn-1t")}
    for r in rows:
        assert r["rounds"] == 2  # --repeat, and no more with --min-seconds 0
        assert r["ratio"] == pytest.approx(r["raw_bytes"] / r["stored_bytes"])
        assert r["compress_gbps"] > 0 and r["decompress_gbps"] > 0
        # The speeds are the fastest rounds'; the medians beside them are no faster.
        assert 0 < r["compress_median_gbps"] <= r["compress_gbps"]
        assert 0 < r["decompress_median_gbps"] <= r["decompress_gbps"]
        # The entropy bound of coding sign and exponent is given for every data set that is
        # not a delta, and no exponent coder with a raw mantissa can beat it by much.
        assert (r["bound_order0"] is None) == r["data"].startswith("delta")
    # Each data set is the same bytes for every compressor; bf16 is half of fp32.
    for model in ("mlp", user):
        size = {d: {r["raw_bytes"] for r in rows if r["model"] == model and r["data"] == d} for d in data}
        assert all(len(v) == 1 for v in size.values())
        assert size["all"] == {next(iter(size["weights"])) + next(iter(size["m"])) + next(iter(size["v"]))}
        assert size["bf16-weights"] == {next(iter(size["weights"])) // 2}
    # The threads table: a row per model and data set, two threads' speed over one thread's,
    # in the fastest rounds and at the medians.
    threads = markdown_table(report, "threads").splitlines()[2:]
    assert len(threads) == 2 * len(data)
    first = next(r for r in rows if r["model"] == "mlp" and r["data"] == "weights" and r["compressor"] == "rayzip")
    one = next(r for r in rows if r["model"] == "mlp" and r["data"] == "weights" and r["compressor"] == "rayzip-1t")
    assert threads[0] == (f"| mlp | weights | {first['compress_gbps'] / one['compress_gbps']:.2f}× | "
                          f"{first['compress_median_gbps'] / one['compress_median_gbps']:.2f}× | "
                          f"{first['decompress_gbps'] / one['decompress_gbps']:.2f}× | "
                          f"{first['decompress_median_gbps'] / one['decompress_median_gbps']:.2f}× |")
    # The comparisons, recomputed from the rows: rayzip's ratio over ZipNN's on the same bytes,
    # and the least speed-up of rayzip's threads over one thread across the data sets.
    comparisons = report["comparisons"]["mlp"]

    def row(data, name):
        return next(r for r in rows if r["model"] == "mlp" and r["data"] == data and r["compressor"] == name)

    assert comparisons["all_ratio_vs_zipnn"] == pytest.approx(row("all", "rayzip")["ratio"]
                                                              / row("all", "zipnn-1t")["ratio"])
    assert comparisons["threads_compress_speedup_min"] == pytest.approx(
        min(row(d, "rayzip")["compress_gbps"] / row(d, "rayzip-1t")["compress_gbps"] for d in data))
    stall = report["stall"]
    assert stall["model"] == "mlp" and [r["method"] for r in stall["rows"]] == ["rayzip-background", "rayzip-sync",
                                                                                "torch.save"]
    sync = statistics.median(next(r for r in stall["rows"] if r["method"] == "rayzip-sync")["stalls_s"])
    for r in stall["rows"]:  # each method's median stall, and over rayzip's synchronous one
        assert r["stall_s"] == statistics.median(r["stalls_s"]) > 0
        assert r["vs_rayzip_sync"] == pytest.approx(r["stall_s"] / sync)
    assert "zipnn-1t" in result.output


def test_the_entropy_bound_is_exact_on_a_known_distribution():
    from rayzip.bench.checkpoint import entropy_bound

    # Half the values in [1, 2), half in [2, 4), mantissas random: one bit of sign and
    # exponent per value, order 0; each half in a run of its own, so order 1 needs almost none.
    mantissa = torch.randint(0, 1 << 23, (1 << 16,), dtype=torch.int32)
    exponent = torch.cat([torch.full((1 << 15,), 127), torch.full((1 << 15,), 128)]).to(torch.int32)
    values = (exponent << 23 | mantissa).view(torch.float32)
    bound = entropy_bound([values])
    assert bound["order0"] == pytest.approx(32 / 24)
    assert bound["order1"] == pytest.approx(32 / 23, rel=1e-3)
    assert entropy_bound([torch.arange(10)]) is None  # integers: no float exponent to code


def test_bench_checkpoint_refuses_unknown_compressors():
    result = runner.invoke(app, ["bench", "checkpoint", "--compressors", "rayzip,lz4"])
    assert result.exit_code == 2 and "lz4" in result.output


def test_each_compressor_follows_its_neighbours_as_often_as_it_precedes_them():
    """In a plain rotation rayzip-1t ran right after rayzip (its data in cache) in four rounds
    of five, and rayzip never right after rayzip-1t."""
    from collections import Counter

    from rayzip.bench.checkpoint import _turns

    names = ["rayzip", "rayzip-1t", "zipnn-1t", "zipnn", "zstd-3"]
    follows = Counter()
    for round_ in range(2 * len(names)):
        order = _turns(names, round_)
        assert sorted(order) == sorted(names)
        follows.update(zip(order, order[1:]))
    for (before, after), times in follows.items():
        assert follows[(after, before)] == times, (before, after)
    assert follows[("rayzip", "rayzip-1t")] > 0
    assert {tuple(_turns(names, r)) for r in range(2 * len(names))} == {
        tuple(names[s:] + names[:s])[::d] for s in range(len(names)) for d in (1, -1)}


def test_bench_sharded_checkpoint_refuses_a_shard_size_that_does_not_divide_the_ranks():
    result = CliRunner().invoke(app, ["bench", "sharded-checkpoint", "--workers", "4", "--shard-size", "3"])
    assert result.exit_code == 2 and "--shard-size 3 must divide --workers 4" in result.output, result.output
