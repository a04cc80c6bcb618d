"""The adaptive controller's pressure policy, its spec checks, and its Prometheus source's
failure, without a cluster (issue 6)."""

from __future__ import annotations


import pytest

from rayzip.adaptive import PressurePolicy, PrometheusSource, SourceError
from rayzip.spec import AdaptiveSpec, SpecError, parse_spec

from own_processes import free_port


# --- the first (pressure) policy, a pure function ------------------------------------------

def test_pressure_policy_turns_compression_off_when_the_network_is_not_the_bottleneck():
    policy = PressurePolicy(AdaptiveSpec(enabled=True, policy="pressure", off_below=0.1))
    # 1 MB dense at 1 ns/byte = 1 ms of communication against 50 ms of compute: 2% of a step.
    compression, explain = policy.compression_for(delay_per_byte=1e-9, compute_s=0.05, dense_bytes=1e6, importance=1.0)
    assert compression == 1.0 and explain["dense_comm_share"] < 0.1


def test_pressure_policy_compresses_more_under_delay_and_less_for_important_batches():
    spec = AdaptiveSpec(enabled=True, min_compression=4, max_compression=200, delay_weight=1.0, importance_weight=1.0,
                        comm_budget=0.25)
    policy = PressurePolicy(spec)
    # 1 MB at 10 ns/byte: 10 ms of dense communication; fitting it into 25% of 5 ms of compute
    # takes 8x compression.
    base, explain = policy.compression_for(1e-8, 0.005, 1e6, 1.0)
    assert explain["pressure"] == 1 and base == pytest.approx(8)
    slower, explain = policy.compression_for(5e-8, 0.005, 1e6, 1.0)
    assert explain["pressure"] == pytest.approx(5) and slower == pytest.approx(40)
    important, _ = policy.compression_for(5e-8, 0.005, 1e6, 2.0)
    assert important == pytest.approx(20)
    assert policy.compression_for(1e-5, 0.005, 1e6, 1.0)[0] == 200  # clamped to max_compression
    assert policy.compression_for(1e-8, 0.005, 1e6, 100.0)[0] == 4  # and to min_compression


def test_spec_refuses_adaptive_without_a_density_to_tune():
    with pytest.raises(SpecError, match="adaptive.enabled tunes a sparsifier"):
        parse_spec({"name": "x", "compression": {"codec": "dct_quant"}, "adaptive": {"enabled": True}})
    with pytest.raises(SpecError, match="adaptive.max_compression|max_compression"):
        parse_spec({"name": "x", "compression": {"codec": "topk"},
                    "adaptive": {"enabled": True, "min_compression": 10, "max_compression": 5}})



def test_an_unreachable_prometheus_is_a_source_error():
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", "run", 5, 0.5)
    with pytest.raises(SourceError):
        source.inputs()
