"""The library's compression config: checked when built, and what a job spec builds."""

from __future__ import annotations

import pytest

from rayzip.codecs.memory import AdamCorrection, ErrorFeedback, MomentumCorrection, NoMemory
from rayzip.comm import Link
from rayzip.spec import parse_spec
from rayzip.torch import CompressionConfig


@pytest.mark.parametrize("fields, message", [
    ({"codec": "zip"}, "unknown codec 'zip'"),
    ({"codec": "coo"}, "unknown codec 'coo'"),
    ({"codec": "fp16", "density": 0.1}, "density does not apply to codec fp16"),
    ({"codec": "topk", "bits": 4}, r"bits does not apply to codec topk \(it takes density, value_dtype\)"),
    ({"codec": "dct_quant", "keep": 0.5}, "never sends the dropped frequencies"),
    ({"codec": "dct_quant", "collective": "ring"}, "ring collective needs a sparse codec"),
    ({"codec": "qsgd", "collective": "allreduce"}, "cannot be summed"),
    ({"collective": "tree"}, "collective must be one of"),
    ({"hierarchy": "rack"}, "hierarchy must be one of"),
    ({"momentum_correction": True, "adam_correction": True}, "not both"),
    ({"momentum_correction": True, "error_feedback": False}, "works on rayzip's error feedback"),
    ({"segment_mb": 0}, "segment_mb must be > 0"),
    ({"codec": "group_topk", "error_decay": 0.0}, r"error_decay must be in \(0, 1\]"),
    ({"codec": "group_topk", "error_decay": 1.5}, r"error_decay must be in \(0, 1\]"),
    ({"codec": "group_topk", "error_decay": 0.9, "momentum_correction": True}, "fades plain error feedback"),
    ({"codec": "group_topk", "error_decay": 0.9, "error_feedback": False}, "fades plain error feedback"),
    ({"codec": "dct_quant", "combine": "senders"}, "combine senders .* needs a sparse codec"),
    ({"codec": "group_topk", "combine": "senders", "collective": "ring"}, "runs on the allgather or balanced"),
    ({"codec": "group_topk", "combine": "senders", "verify": True}, "does not check combine senders"),
    ({"codec": "group_topk", "combine": "median"}, "combine must be one of mean, senders"),
])
def test_a_config_that_cannot_run_is_refused_when_built(fields, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**fields)


def test_the_codec_and_memory_it_builds():
    config = CompressionConfig(codec="group_topk", density=0.02, value_dtype="int8", packed_indices=True)
    codec = config.build_codec()
    assert (codec.name, codec.density, codec.value_dtype) == ("group_topk", 0.02, "int8")
    assert config.codec_params() == {"density": 0.02, "value_dtype": "int8", "packed_indices": True}
    assert CompressionConfig(codec="qsgd", seed=5).codec_params(rank=3)["seed"] == 8  # independent noise
    assert isinstance(config.build_memory(), ErrorFeedback)
    assert isinstance(config.replace(error_feedback=False).build_memory(), NoMemory)
    assert isinstance(config.replace(momentum_correction=True).build_memory(momentum=0.9), MomentumCorrection)
    assert isinstance(config.replace(adam_correction=True).build_memory(adam_betas=(0.9, 0.99)), AdamCorrection)
    with pytest.raises(ValueError, match="needs the SGD momentum factor"):
        config.replace(momentum_correction=True).build_memory()
    with pytest.raises(ValueError, match="bits does not apply"):
        config.replace(bits=3)  # replace checks again
    with pytest.raises(AttributeError):
        config.density = 0.5  # frozen


def test_a_job_specs_compression_section_builds_the_same_config():
    spec = parse_spec({"name": "x", "compression": {"codec": "group_topk", "density": 0.01, "collective": "ring",
                                                    "momentum_correction": True, "link_mbit": 100,
                                                    "link_latency_ms": 2, "segment_mb": 1, "warmup_steps": 3}})
    assert spec.compression.to_config() == CompressionConfig(
        codec="group_topk", density=0.01, collective="ring", momentum_correction=True,
        link=Link(bandwidth=100e6 / 8, latency=2e-3), segment_mb=1.0, warmup_steps=3)
    ps = parse_spec({"name": "x", "compression": {"codec": "dct_quant", "collective": "ps"}})
    with pytest.raises(ValueError, match="does not run with collective ps"):
        ps.compression.to_config()
    assert ps.compression.build_codec().name == "dct_quant"  # the shards' and workers' codec


def test_sparselocos_outer_updates_build_fading_error_feedback_on_the_allgather():
    config = CompressionConfig(codec="group_topk", density=0.01, value_dtype="2bit", coded_indices=True,
                               error_decay=0.95, combine="senders")
    memory = config.build_memory()
    assert type(memory) is ErrorFeedback and memory.decay == 0.95
    spec = parse_spec({"name": "x", "compression": {"codec": "group_topk", "density": 0.01, "value_dtype": "2bit",
                                                    "coded_indices": True, "error_decay": 0.95,
                                                    "combine": "senders"}})
    assert spec.compression.to_config() == config
    from rayzip.comm import choose_collective
    assert choose_collective("auto", config.build_codec(), combine="senders") == "allgather"
