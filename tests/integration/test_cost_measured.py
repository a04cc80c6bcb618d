"""The collectives' cost model and ``collective: auto`` (issue 18)."""

from __future__ import annotations




def test_measured_bytes_match_the_model_and_auto_sends_the_least():
    from rayzip.bench.collectives import run_collectives_bench

    report = run_collectives_bench([2, 4], {"codec": "group_topk", "density": 0.01}, steps=4, skip=1)
    for row in report["rows"]:
        assert row["measured_allgather_bytes"] == row["model_allgather_bytes"]  # fixed-size payloads
        # The model places every worker's entries independently: an upper bound on the fill-in.
        assert 0.9 < row["ring_measured_over_model"] <= 1.0
        assert row["auto_chose"] == "allgather" and row["auto_over_cheaper"] <= 1.05
