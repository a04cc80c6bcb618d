"""`rayzip bench cluster` without a cluster (issue 4): its methods' specs, its refusals, and
how it summarizes runs."""

from __future__ import annotations

import os

import pytest

from rayzip.bench.netns import ClusterError, preflight
from rayzip.spec import CompressionSpec


def test_missing_tools_are_refused_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no ip, no tc
    with pytest.raises(ClusterError, match="needs root" if os.geteuid() else "'ip' is missing: install the iproute2"):
        preflight()


def test_unknown_method_exits_2():
    from typer.testing import CliRunner

    from rayzip.cli import app

    result = CliRunner().invoke(app, ["bench", "cluster", "--methods", "dense,zip"])
    assert result.exit_code == 2 and "unknown method 'zip'" in result.output
    result = CliRunner().invoke(app, ["bench", "cluster", "--methods", "dense@0.1"])
    assert result.exit_code == 2 and "unknown method 'dense@0.1'" in result.output


def test_fixed_density_methods_and_the_adaptive_method_build_valid_specs():
    from rayzip.bench.cluster import ADAPTIVE, method_compression
    from rayzip.spec import JobSpec

    training = {"optimizer": "sgd", "momentum": 0.9}
    assert method_compression("group_topk@0.05", 10, training)["density"] == 0.05
    spec = JobSpec.model_validate({"name": "a", "training": training, "adaptive": ADAPTIVE,
                                   "compression": method_compression("adaptive", 10, training)})
    assert spec.adaptive.enabled and spec.compression.momentum_correction


def test_the_adaptive_method_runs_the_default_policy_and_adaptive_cost_the_fastest_step():
    from rayzip.bench.cluster import method_spec
    from rayzip.spec import AdaptiveSpec, JobSpec

    base = {"training": {"optimizer": "sgd", "momentum": 0.9}}
    policies = {m: JobSpec.model_validate(method_spec(m, base, m.replace("_", "-"))).adaptive.policy
                for m in ("adaptive", "adaptive_cost")}
    assert policies == {"adaptive": AdaptiveSpec().policy, "adaptive_cost": "cost_model"}
    assert AdaptiveSpec().policy == "time_to_target"


def test_every_method_builds_a_valid_spec_and_ps_methods_get_their_section():
    import yaml

    from rayzip.bench.cluster import DEFAULT_SPEC, METHODS, method_spec
    from rayzip.spec import JobSpec

    base = yaml.safe_load(DEFAULT_SPEC.read_text())
    for method in METHODS:
        JobSpec.model_validate(method_spec(method, base, method.replace("_", "-")))
    ps = JobSpec.model_validate(method_spec("ps@0.05", base, "ps"))
    assert ps.compression.collective == "ps" and ps.compression.density == 0.05
    assert ps.ps.pull == "codec" and ps.ps.cpus_per_shard == 0 and ps.compression.momentum_correction
    assert JobSpec.model_validate(method_spec("ps-dense", base, "ps-dense")).ps.pull == "dense"


def test_scaling_needs_one_worker_among_the_counts():
    from typer.testing import CliRunner

    from rayzip.cli import app

    result = CliRunner().invoke(app, ["bench", "scaling", "--nodes", "2,3"])
    assert result.exit_code == 2 and "--nodes must include 1" in result.output


def test_scaling_refuses_a_worker_count_that_is_not_one():
    from typer.testing import CliRunner

    from rayzip.cli import app

    result = CliRunner().invoke(app, ["bench", "scaling", "--nodes", "1,x,3"])
    assert result.exit_code == 2 and "--nodes must include 1" in result.output and "1,x,3" in result.output


def test_mean_step_time_comes_from_the_training_clock_between_evaluations():
    from rayzip.bench.cluster import mean_step_s

    history = [{"step": 9, "train_s": 1.0}, {"step": 19, "train_s": 3.0}, {"step": 29, "train_s": 4.0},
               {"step": 39, "train_s": None}]
    assert mean_step_s(history, 11, 10 ** 9) == (4.0 - 3.0) / 10
    assert mean_step_s(history, 1, 30) == (4.0 - 1.0) / 20
    assert mean_step_s(history, 25, 10 ** 9) is None  # one point only


def test_methods_take_their_knob_and_adamw_jobs_get_adam_correction_for_sparse_codecs():
    from rayzip.bench.cluster import method_compression

    adamw = {"optimizer": "adamw"}
    # A dense quantizer sends the gradient with error feedback; AdamW runs on the mean.
    assert method_compression("dct_quant@4", 10, adamw) == {"codec": "dct_quant", "bits": 4, "collective": "allgather"}
    assert method_compression("group_topk@0.05", 10, adamw)["density"] == 0.05
    assert method_compression("group_topk@0.05", 10, adamw)["adam_correction"] is True
    assert "adam_correction" not in method_compression("powersgd", 10, adamw)  # torch's hook: not ours
    assert method_compression("group_topk", 10, {"optimizer": "sgd"})["momentum_correction"] is True
    for bad in ("dct_quant@x", "powersgd@2", "nope", "powersgd:flat", "ps:serial", "dense:flat", "fp16:node"):
        with pytest.raises(ValueError):
            method_compression(bad, 10, adamw)
    # Suffixes: no overlap, no hierarchy, and dense in two levels through rayzip's hook.
    assert method_compression("dct_quant@4:serial", 10, adamw)["overlap"] is False
    assert method_compression("group_topk:flat", 10, adamw)["hierarchy"] == "none"
    assert method_compression("dense:node", 10, adamw) == {"codec": "none", "hierarchy": "node"}
    for method in ("dct_quant@4:serial", "group_topk:flat", "dense:node"):
        CompressionSpec(**method_compression(method, 10, adamw))


def test_rows_compare_with_dense_in_the_same_run():
    from rayzip.bench.cluster import _compare_with_dense

    rows = [{"name": "dense", "time_to_target_s": 300.0, "step_s": 3.0, "compute_probe_s": 0.6, "final_metric": 3.0},
            {"name": "x", "time_to_target_s": 75.0, "step_s": 0.8, "compute_probe_s": 0.6, "final_metric": 3.03},
            {"name": "y", "time_to_target_s": None, "step_s": 0.7, "compute_probe_s": 0.6, "final_metric": 3.5},
            {"name": "z", "error": "boom"}]
    _compare_with_dense(rows)
    dense, x, y = rows[0], rows[1], rows[2]
    assert dense["ideal_speedup"] == pytest.approx(5.0) and dense["speedup_vs_dense"] == pytest.approx(1.0)
    assert x["speedup_vs_dense"] == pytest.approx(4.0) and x["share_of_ideal"] == pytest.approx(0.8)
    assert x["final_vs_dense"] == pytest.approx(0.01)
    assert y["speedup_vs_dense"] is None and y["share_of_ideal"] is None  # never reached the target
    assert "speedup_vs_dense" not in rows[3]


def test_rows_compare_with_the_dense_run_trained_as_they_are():
    from rayzip.bench.cluster import _compare_with_dense

    rows = [{"name": "hsdp:bf16", "time_to_target_s": 540.0, "step_s": 4.5, "final_metric": 2.97},
            {"name": "hsdp", "time_to_target_s": 720.0, "step_s": 5.9, "final_metric": 2.96},
            {"name": "hsdp_local@4:bf16", "time_to_target_s": 180.0, "step_s": 1.8, "final_metric": 2.9},
            {"name": "hsdp_local@4", "time_to_target_s": 360.0, "step_s": 3.0, "final_metric": 2.9},
            {"name": "hsdp_dct8:bf16:muon", "time_to_target_s": 270.0, "step_s": 3.0, "final_metric": 3.0},
            {"name": "hsdp_local@4:bf16, node lost (rank 0)", "time_to_target_s": 270.0, "step_s": 1.8,
             "final_metric": 2.9},
            {"name": "hsdp:bf16:muon, node lost (rank 0)", "time_to_target_s": 90.0, "step_s": 1.0,
             "final_metric": 2.0}]  # never a baseline, and its name parses
    _compare_with_dense(rows)
    assert rows[0]["speedup_vs_dense"] == pytest.approx(1.0) and rows[1]["speedup_vs_dense"] == pytest.approx(1.0)
    assert rows[2]["speedup_vs_dense"] == pytest.approx(3.0)  # against hsdp:bf16, not hsdp
    assert rows[3]["speedup_vs_dense"] == pytest.approx(2.0)
    assert rows[4]["speedup_vs_dense"] == pytest.approx(540 / 270)  # no dense run under Muon: the first
    assert rows[5]["speedup_vs_dense"] == pytest.approx(2.0) and rows[5]["final_vs_dense"] < 0


def test_repeated_runs_give_medians_with_their_spread():
    from rayzip.bench.cluster import aggregate_runs, markdown_table

    def run(step_s, ttt, final):
        return {"name": "m", "step_s": step_s, "comm_s": step_s / 2, "time_to_target_s": ttt, "final_metric": final,
                "final_accuracy": final, "wire_bytes_counted": 100, "wire_reduction": 4.0, "metric": "test_accuracy",
                "steps_to_target": 7, "history": [{"step": 0}], "compressed": True}

    row = aggregate_runs([run(0.3, 10.0, 0.9), run(0.1, None, 0.8), run(0.2, 12.0, 0.85)])
    assert row["step_s"] == 0.2 and row["spread"]["step_s"] == [0.1, 0.3]
    assert row["final_metric"] == 0.85 and row["wire_bytes_counted"] == 100
    assert row["time_to_target_s"] == 12.0  # the missed run counts as the slowest
    assert row["spread"]["time_to_target_s"] == [10.0, 12.0] and row["reached_runs"] == 2
    assert row["history"] == [{"step": 0}] and all("history" not in r for r in row["runs"])
    assert row["compressed"] is True and row["repeats"] == 3 and row["failed_runs"] == 0
    # Missed by two of three: the median missed too.
    assert aggregate_runs([run(0.1, None, 0.8), run(0.2, None, 0.8), run(0.3, 5.0, 0.9)])["time_to_target_s"] is None
    assert aggregate_runs([run(0.1, 4.0, 0.8), run(0.2, 6.0, 0.8)])["time_to_target_s"] == 5.0
    failed = aggregate_runs([run(0.1, 4.0, 0.8), {"name": "m", "error": "boom"}, run(0.3, 8.0, 0.8)])
    assert failed["failed_runs"] == 1 and failed["repeats"] == 2 and failed["time_to_target_s"] == 6.0
    row.update({"speedup_vs_dense": None, "final_vs_dense": None})
    line = markdown_table({"methods": [row]}).splitlines()[2]
    assert "12.0 s [10.0–12.0], 2 of 3 runs reached it" in line and "200 (100) [100–300]" in line


def test_sharded_methods_shard_per_node_and_compare_with_dense_hsdp():
    import yaml

    from rayzip.bench.cluster import _compare_with_dense, markdown_table, method_spec, replica_held_bytes
    from rayzip.spec import JobSpec
    from paths import ROOT

    base = yaml.safe_load((ROOT / "jobs" / "bench-gpt.yaml").read_text())
    base["scaling"] = {"min_workers": 4, "max_workers": 4}
    dense = JobSpec.model_validate(method_spec("hsdp", base, "hsdp"))
    assert dense.sharding.enabled and dense.sharding.mode == "hsdp" and dense.compression.codec == "none"
    assert dense.sharding.shard_size is None  # the workers of each node
    dct = JobSpec.model_validate(method_spec("hsdp_dct", base, "hsdp-dct"))
    assert dct.compression.codec == "dct_quant" and dct.compression.bits == 4 and not dct.compression.adam_correction
    dct8 = JobSpec.model_validate(method_spec("hsdp_dct8:bf16", base, "hsdp-dct8"))
    assert dct8.sharding.enabled and dct8.compression.bits == 8 and dct8.training.mixed_precision == "bf16"
    local = JobSpec.model_validate(method_spec("hsdp_local@8", base, "hsdp-local-8"))
    assert local.local_steps.enabled and local.local_steps.every == 8 and local.sharding.enabled
    assert local.training.eval_every % 8 == 0
    tuned = JobSpec.model_validate(method_spec("hsdp_adaptive", base, "hsdp-adaptive"))
    assert tuned.sharding.enabled and tuned.adaptive.enabled and tuned.adaptive.policy == "time_to_target"
    assert tuned.compression.codec == "group_topk" and not tuned.local_steps.enabled

    replica = replica_held_bytes(base)  # counted from a real GPT and AdamW after one step
    assert replica["gradients"] == replica["parameters"] and replica["optimizer"] == 2 * replica["parameters"]
    half = {k: v // 2 for k, v in replica.items()}
    rows = [{"name": "hsdp", "time_to_target_s": 400.0, "step_s": 4.0, "final_metric": 3.0,
             "wire_bytes_counted": 100e6, "wire_reduction": 1.0, "held_bytes": half},
            {"name": "hsdp_local@4", "time_to_target_s": 100.0, "step_s": 1.0, "final_metric": 3.015,
             "wire_bytes_counted": 0.2e6, "wire_reduction": 500.0, "held_bytes": half}]
    _compare_with_dense(rows)
    assert rows[1]["speedup_vs_dense"] == pytest.approx(4.0) and rows[1]["final_vs_dense"] == pytest.approx(0.005)
    table = markdown_table({"methods": rows, "ddp_held_bytes": replica})
    assert "| hsdp_local@4 | 100.0 s | 4.00× | 3.0150 | +0.5% | 1000 | 0.2 | 500.0× |" in table
    assert table.rstrip().endswith("| 0.500× |"), table


def test_a_muon_suffix_swaps_the_workers_optimizer_and_keeps_the_method():
    import yaml

    from rayzip.bench.cluster import method_compression, method_spec
    from rayzip.spec import JobSpec

    from paths import ROOT

    base = yaml.safe_load((ROOT / "jobs" / "bench-gpt.yaml").read_text())
    for method in ("dense:muon", "group_topk:muon", "local_sparseloco@4:muon", "local@4:overlap:muon"):
        spec = JobSpec.model_validate(method_spec(method, base, "m"))
        assert spec.training.optimizer == "muon", method
        plain = JobSpec.model_validate(method_spec(method.rpartition(":")[0], base, "m"))
        assert plain.training.optimizer == "adamw"
        assert spec.local_steps == plain.local_steps, method
    # Muon on the decoded mean: no Adam correction for a sparse codec, as under AdamW.
    assert "adam_correction" not in method_compression("group_topk:muon", 10, {"optimizer": "adamw"})
    assert method_spec("local@4:overlap:muon", base, "m")["local_steps"]["overlap"] is True
    for bad in ("hsdp:muon", "ps:muon", "local@4:muon:overlap", "dense:node:flat"):
        with pytest.raises(ValueError):
            method_spec(bad, base, "m")


def test_a_bf16_suffix_turns_on_autocast_alone_or_with_muon():
    import yaml

    from rayzip.bench.cluster import method_compression, method_spec
    from rayzip.spec import JobSpec

    from paths import ROOT

    base = yaml.safe_load((ROOT / "jobs" / "bench-gpt.yaml").read_text())
    for method in ("dense:bf16", "sparseloco_step:bf16", "local_sparseloco@4:muon:bf16", "local@4:overlap:bf16",
                   "hsdp_local@4:bf16"):
        spec = JobSpec.model_validate(method_spec(method, base, "m"))
        plain = JobSpec.model_validate(method_spec(method.rpartition(":")[0], base, "m"))
        assert spec.training.mixed_precision == "bf16" and plain.training.mixed_precision == "none", method
        assert spec.compression == plain.compression and spec.local_steps == plain.local_steps, method
    both = JobSpec.model_validate(method_spec("group_topk:bf16:muon", base, "m")).training
    assert (both.optimizer, both.mixed_precision) == ("muon", "bf16")
    assert method_compression("group_topk:bf16", 10, base["training"])["adam_correction"] is True
    for bad in ("hsdp:bf16:muon", "local@4:bf16:overlap", "dense:bf16:node"):
        with pytest.raises(ValueError):
            method_spec(bad, base, "m")


def test_a_lost_nodes_run_is_set_beside_its_uninterrupted_run_and_tabled():
    from rayzip.bench.cluster import NODE_LOST, _compare_with_uninterrupted, markdown_table

    def run(name, final, loss=None):
        return {"name": name, "final_metric": final, "final_accuracy": 0.0, "wire_bytes_counted": 2e6,
                "metric": "val_loss", **({"node_loss": loss} if loss else {})}

    lost = {"node": 2, "killed_at_step": 61, "processes_killed": 9, "replaced_after_s": 31.5, "steps_lost": 1,
            "restarts": 1, "resumes": [{"resumed_at": 61, "source": "memory", "cause": "node_lost",
                                        "steps_lost": 1, "seconds": 42.25}]}
    rows = [run("local@4", 3.0), {**run(f"local@4{NODE_LOST}", 3.006, lost), "copied_bytes": 4.25e6}, run("dense", 3.1),
            {"name": f"dense{NODE_LOST}", "error": "boom"}]
    _compare_with_uninterrupted(rows)
    assert rows[1]["final_vs_uninterrupted"] == pytest.approx(0.002)
    assert "final_vs_uninterrupted" not in rows[0] and "final_vs_uninterrupted" not in rows[3]
    table = markdown_table({"methods": rows, "metric": "val_loss", "kill_node_at_step": 60}).splitlines()
    assert table[0].startswith("| run | node lost at | resumed at | from | cause | steps lost | recovery |")
    assert table[3] == ("| local@4, node lost | 61 | 61 | memory | node_lost | 1 | 42.2 s | 31.5 s | 3.0060 | "
                        "+0.20% | 2.0 | 4.2 |")  # rank 0's residual copies, in MB
    assert table[2].endswith("| 2.0 | – |")  # none taken
    assert table[2].startswith("| local@4 | – | – | – | – | – |")


def test_a_node_loss_needs_a_step_inside_the_run_and_a_node_to_survive(tmp_path):
    from rayzip.bench.cluster import run_cluster_bench

    from paths import ROOT

    spec = ROOT / "jobs" / "bench-gpt.yaml"
    with pytest.raises(ValueError, match="is not a step of the run's 200"):
        run_cluster_bench(["dense"], "100mbit", 2, None, spec, kill_node_at_step=200)
    with pytest.raises(ValueError, match="needs 2 nodes or more"):
        run_cluster_bench(["dense"], "100mbit", 1, None, spec, kill_node_at_step=50)


def test_a_node_loss_by_rank_is_named_for_it_and_refused_where_its_node_is_unknown(tmp_path):
    from rayzip.bench.cluster import NODE_LOST, _compare_with_uninterrupted, check_lose_ranks, run_cluster_bench

    from paths import ROOT

    rows = [{"name": "local@4", "final_metric": 3.0}, {"name": f"local@4{NODE_LOST} (rank 0)", "final_metric": 3.03},
            {"name": f"local@4{NODE_LOST} (rank 1)", "final_metric": 2.97}]
    _compare_with_uninterrupted(rows)
    assert [r.get("final_vs_uninterrupted") for r in rows] == [None, pytest.approx(0.01), pytest.approx(-0.01)]
    check_lose_ranks([0, 1], 2, 1)
    check_lose_ranks([0], 4, 2)  # rank 0 reports its process: found on any cluster
    for ranks, nodes, per_node, match in (([2], 2, 1, "not one of the run's 2 workers"),
                                          ([1], 2, 2, "2 nodes of 1 worker only"), ([-1], 2, 1, "not one")):
        with pytest.raises(ValueError, match=match):
            check_lose_ranks(ranks, nodes, per_node)
    spec = ROOT / "jobs" / "bench-gpt.yaml"
    with pytest.raises(ValueError, match="needs kill_node_at_step"):
        run_cluster_bench(["dense"], "100mbit", 2, None, spec, lose_ranks=[0])
    with pytest.raises(ValueError, match="each must be one of"):
        run_cluster_bench(["dense"], "100mbit", 2, None, spec, kill_node_at_step=50, node_loss_from=("disk",))


@pytest.mark.parametrize("args, says", [(["--lose-ranks", "0"], "needs --kill-node-at-step"),
                                        (["--kill-node-at-step", "9", "--lose-ranks", "0,x"], "invalid literal"),
                                        (["--kill-node-at-step", "9", "--lose-ranks", "0,2"], "rank 2 is not"),
                                        (["--node-loss-from", "storage"], "needs --kill-node-at-step"),
                                        (["--kill-node-at-step", "9", "--node-loss-from", "memory,disk"],
                                         "each must be one of memory, storage")])
def test_the_cli_refuses_a_rank_it_cannot_lose(args, says):
    from typer.testing import CliRunner

    from rayzip.cli import app

    result = CliRunner().invoke(app, ["bench", "cluster", "--nodes", "2", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_repeated_node_losses_give_medians_of_the_recovery_and_each_runs_steps_lost():
    from rayzip.bench.cluster import NODE_LOST, aggregate_runs, markdown_table

    def run(step_s, final, killed_at, lost, seconds, replaced):
        resume = {"resumed_at": killed_at + 1, "source": "memory", "cause": "node_lost", "steps_lost": lost,
                  "seconds": seconds}
        return {"name": f"local@4{NODE_LOST}", "step_s": step_s, "comm_s": 0.1, "final_metric": final,
                "final_accuracy": 0.0, "wire_bytes_counted": 2e6, "time_to_target_s": None, "metric": "val_loss",
                "node_loss": {"node": 2, "killed_at_step": killed_at, "processes_killed": 7, "steps_lost": lost,
                              "replaced_after_s": replaced, "restarts": 1, "resumes": [resume]}}

    row = aggregate_runs([run(1.2, 3.01, 61, 0, 40.0, 20.0), run(1.1, 3.02, 62, 1, 55.0, 30.0),
                          run(1.3, 3.00, 61, 0, 47.0, 24.0)])
    loss = row["node_loss"]
    assert (loss["recovery_s"], loss["spread"]["recovery_s"]) == (47.0, [40.0, 55.0])
    assert (loss["replaced_after_s"], loss["steps_lost"], loss["killed_at_step"]) == (24.0, 0, 61)
    assert [r["resumed_at"] for r in loss["resumes"]] == [62, 63, 62] and len(loss["runs"]) == 3
    line = markdown_table({"methods": [row], "metric": "val_loss", "kill_node_at_step": 60}).splitlines()[2]
    assert line == ("| local@4, node lost | 61, 62, 61 | 62, 63, 62 | memory | node_lost | 0, 1, 0 | "
                    "47.0 s [40.0–55.0] | 24.0 s [20.0–30.0] | 3.0100 [3.0000–3.0200] | – | 2.0 | – |")


def test_arms_compare_each_round_with_the_first_arms_run_and_are_tabled():
    from rayzip.bench.cluster import _compare_with_first_arm, aggregate_runs, markdown_table, parse_arm

    arms = [parse_arm("snapshots off:snapshots.enabled=false"), parse_arm("snapshots on:"),
            parse_arm("no copies: snapshots.copy_density=0 ; snapshots.every=1")]
    assert arms == [("snapshots off", ["snapshots.enabled=false"]), ("snapshots on", []),
                    ("no copies", ["snapshots.copy_density=0", "snapshots.every=1"])]

    def run(name, steady_step_s, copied=0.0):  # the step alone: 0.9 s, the snapshots' copies outside it
        return {"name": name, "step_s": 0.9, "steady_step_s": steady_step_s, "train_step_s": 1.25, "comm_s": 0.05,
                "final_metric": 3.5, "final_accuracy": 0.0,
                "wire_bytes_counted": 2.2e6, "time_to_target_s": None, "metric": "val_loss", "copied_bytes": copied}

    # a slow second round: each round's ratio is taken within it, not across rounds
    runs = {"local@4, snapshots off": [run("local@4, snapshots off", s) for s in (1.00, 2.00, 1.10)],
            "local@4, snapshots on": [run("local@4, snapshots on", s, 65e6) for s in (1.03, 2.10, 1.21)],
            "local@4, no copies": [run("local@4, no copies", s) for s in (1.01, 2.02, 1.111)]}
    rows = [aggregate_runs(v) for v in runs.values()]
    _compare_with_first_arm(rows, runs, ["local@4"], [name for name, _ in arms])
    on = rows[1]
    assert on["step_vs_first_arm_runs"] == [pytest.approx(1.03), pytest.approx(1.05), pytest.approx(1.1)]
    assert on["step_vs_first_arm"] == pytest.approx(1.05)  # the median of the rounds' ratios
    assert rows[0]["step_vs_first_arm"] == 1.0 and rows[2]["step_vs_first_arm"] == pytest.approx(1.01)
    report = {"methods": rows, "metric": "val_loss",
              "arms": [{"name": name, "overrides": settings} for name, settings in arms]}
    table = markdown_table(report).splitlines()
    assert table[0] == ("| run | settings | ms per step | whole run | step ms (comm) | per step vs snapshots off | "
                        "final val bpb | MB sent / worker | MB copied / worker |")
    assert table[2] == ("| local@4, snapshots off | `snapshots.enabled=false` | 1100 [1000–2000] | 1250 | "
                        "900 (50) [900–900] | 1.000× | 3.5000 | 2.2 | – |")
    assert table[3] == ("| local@4, snapshots on | the spec's | 1210 [1030–2100] | 1250 | 900 (50) [900–900] | "
                        "1.050× (1.030, 1.050, 1.100) | 3.5000 | 2.2 | 65.0 |")
    # two workers on one node: still the arms' table, not the hierarchy's
    assert markdown_table({**report, "workers_per_node": 2}).splitlines() == table


def test_the_steady_step_time_leaves_out_the_start_up_and_the_evaluations():
    from rayzip.bench.cluster import _row

    history = [{"step": 19, "train_s": 25.5}, {"step": 39, "train_s": 45.2}, {"step": 79, "train_s": 84.8}]
    summary = {"steps": 80, "train_s": 90.0, "mean_step_s": 1.0, "bytes_sent_per_worker": 2e6,
               "dense_bytes_per_worker": 2e8, "bytes_source": "counted", "final_val_loss": 3.5,
               "final_test_accuracy": None, "metric": "val_loss"}
    steady = lambda h: _row("local@4", {**summary, "history": h}, [0], [0], 100.0)["steady_step_s"]  # noqa: E731
    assert steady(history) == pytest.approx((84.8 - 25.5) / 60)
    assert steady(history[:1]) is None and steady([]) is None


def test_arms_are_named_apart_two_or_more_and_not_with_a_node_loss(tmp_path):
    from rayzip.bench.cluster import parse_arm, run_cluster_bench

    from paths import ROOT

    for text in ("no colon", ":snapshots.enabled=false"):
        with pytest.raises(ValueError, match="is not NAME:SECTION.FIELD=VALUE"):
            parse_arm(text)
    spec = ROOT / "jobs" / "bench-gpt.yaml"
    with pytest.raises(ValueError, match="two or more"):
        run_cluster_bench(["dense"], "100mbit", 2, None, spec, arms=[("on", [])])
    with pytest.raises(ValueError, match="named apart"):
        run_cluster_bench(["dense"], "100mbit", 2, None, spec, arms=[("on", []), ("on", ["a.b=1"])])
    with pytest.raises(ValueError, match="not with kill_node_at_step"):
        run_cluster_bench(["dense"], "100mbit", 2, None, spec, kill_node_at_step=50, arms=[("a", []), ("b", [])])


@pytest.mark.parametrize("args, says", [(["--arm", "on:"], "two or more"),
                                        (["--arm", "off:snapshots.enabled=false", "--arm", "on:", "--drop-to",
                                          "10mbit"], "not with --kill-node-at-step or --drop-to"),
                                        (["--arm", "a:", "--arm", "b:snapshots.every=0"], "snapshots.every")])
def test_the_cli_refuses_an_arm_naming_what_is_wrong(args, says):
    from typer.testing import CliRunner

    from rayzip.cli import app

    result = CliRunner().invoke(app, ["bench", "cluster", "--spec", "jobs/bench-gpt.yaml", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output
