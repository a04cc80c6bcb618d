"""Job specs: validation errors name the field, exit 2, and start nothing (issue 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rayzip.cli import app
from rayzip.spec import JobSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
GOOD = yaml.safe_load((ROOT / "jobs" / "digits-group-topk.yaml").read_text())


def with_change(path: str, value, *more):
    """GOOD with ``path`` set to ``value`` (DELETE removes it); ``more`` are further pairs."""
    spec = json.loads(json.dumps(GOOD))
    changes = [(path, value), *zip(more[::2], more[1::2])]
    for change_path, change in changes:
        *parents, leaf = change_path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        if change is DELETE:
            node.pop(leaf)
        else:
            node[leaf] = change
    return spec


DELETE = object()

BAD_SPECS = [
    ("unknown top-level section", with_change("optimizer", "sgd"), "optimizer: unknown field"),
    ("typo in a field", with_change("training.stpes", 10), "training.stpes: unknown field"),
    ("unknown codec", with_change("compression.codec", "zip"), "compression.codec: unknown codec 'zip'"),
    ("density above 1", with_change("compression.density", 1.5),
     "compression.density: Input should be less than or equal to 1"),
    ("density of 0", with_change("compression.density", 0), "compression.density: Input should be greater than 0"),
    ("error decay above 1", with_change("compression.error_decay", 1.5),
     "compression.error_decay: Input should be less than or equal to 1"),
    ("an unknown combine", with_change("compression.combine", "median"),
     "compression.combine: Input should be 'mean' or 'senders'"),
    ("combine senders on the ring", with_change("compression.combine", "senders", "compression.collective", "ring"),
     "combine senders runs on the allgather or balanced collective, not ring"),
    ("combine senders with parameter servers", with_change("compression.combine", "senders",
                                                           "compression.collective", "ps"),
     "with collective ps the shards average the pushes"),
    ("the old name of density", with_change("compression.ratio", 0.01),
     "compression.ratio: renamed: use compression.density"),
    ("the old name of the controller's most compression", with_change("adaptive.max_ratio", 100),
     "adaptive.max_ratio: renamed: use adaptive.max_compression"),
    ("the old name of the controller's least compression", with_change("adaptive.min_ratio", 2),
     "adaptive.min_ratio: renamed: use adaptive.min_compression"),
    ("bits out of range", with_change("compression.bits", 20), "compression.bits: Input should be less than or equal to 16"),
    ("parameter of another codec", with_change("compression.bits", 4), "compression: bits does not apply to codec group_topk"),
    ("seed for a codec without one", with_change("compression.seed", 3), "compression: seed does not apply to codec group_topk"),
    ("group size 0", with_change("compression.group_size", 0), "compression.group_size: Input should be greater than or equal to 1"),
    ("ring with a codec that cannot sum", with_change("compression", {"codec": "qsgd", "collective": "ring"}),
     "compression: the ring collective needs a sparse codec"),
    ("diverging error feedback", with_change("compression", {"codec": "dct_quant", "keep": 0.5}),
     "compression: dct_quant with keep=0.5 never sends the dropped frequencies"),
    ("max below min workers", with_change("scaling.max_workers", 1), "scaling: max_workers (1) is below min_workers (2)"),
    ("zero workers", with_change("scaling.min_workers", 0), "scaling.min_workers: Input should be greater than or equal to 1"),
    ("negative lr", with_change("training.lr", -0.1), "training.lr: Input should be greater than 0"),
    ("steps and epochs", with_change("training.epochs", 3), "training: give steps or epochs, not both"),
    ("unknown optimizer", with_change("training.optimizer", "lion"), "training.optimizer: Input should be 'sgd', 'adam', 'adamw' or 'muon'"),
    ("muon on a sharded model", with_change("training.optimizer", "muon", "sharding", {"enabled": True, "shard_size": 2}),
     "training.optimizer muon needs each weight matrix whole: not with sharding"),
    ("muon on parameter servers", with_change("training.optimizer", "muon", "compression.collective", "ps"),
     "training.optimizer muon needs each weight matrix whole: not with compression.collective ps"),
    ("unknown dataset", with_change("dataset.name", "imagenet"), "dataset.name: unknown dataset 'imagenet'"),
    ("unknown model", with_change("model.name", "resnet"), "model.name: unknown model 'resnet'"),
    ("bad job name", with_change("name", "My_Job"), "name: must be lowercase letters"),
    ("missing name", with_change("name", DELETE), "name: Field required"),
    ("wrong type", with_change("training.batch_size", "large"), "training.batch_size: Input should be a valid integer"),
    ("momentum correction under adam",
     with_change("training.optimizer", "adam", "compression.momentum_correction", True),
     "compression.momentum_correction moves SGD momentum into the hook: it needs training.optimizer sgd"),
    ("momentum correction without error feedback",
     with_change("compression.momentum_correction", True, "compression.error_feedback", False),
     "compression: momentum_correction works on rayzip's error feedback"),
    ("collective typo", with_change("compression.collective", "rings"), "compression.collective: Input should be 'auto'"),
    ("int8 values for plain top-k", with_change("compression", {"codec": "topk", "value_dtype": "int8"}),
     "compression: value_dtype must be one of ['fp16', 'fp32'], got 'int8'"),
    ("packed offsets for plain top-k", with_change("compression", {"codec": "topk", "packed_indices": True}),
     "compression: packed_indices does not apply to codec topk"),
    ("local steps with one replica", with_change("sharding", {"enabled": True, "mode": "fsdp"},
                                                 "local_steps", {"enabled": True, "every": 5}),
     "local_steps with sharding.mode fsdp: one shard group holds the only replica"),
    ("the controller on one replica", with_change("sharding", {"enabled": True, "mode": "fsdp"},
                                                  "adaptive", {"enabled": True}),
     "adaptive with sharding.mode fsdp: one shard group holds the only replica"),
    ("overlapped local steps on shards", with_change("sharding", {"enabled": True, "shard_size": 2},
                                                     "local_steps", {"enabled": True, "every": 5, "overlap": True}),
     "sharding does not run with local_steps.overlap yet"),
    ("kept residuals on shards", with_change("sharding", {"enabled": True, "shard_size": 2},
                                             "local_steps", {"enabled": True, "every": 5, "keep_unsent": True}),
     "sharding does not run with local_steps.keep_unsent yet"),
]


@pytest.mark.parametrize("label,spec,message", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_exits_2_naming_the_field_and_starts_nothing(tmp_path, label, spec, message):
    import ray

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    for command in ("validate", "run", "submit"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 2, (command, result.output)
        assert message in " ".join(result.output.split()), result.output
    assert not ray.is_initialized()


def test_bad_specs_are_distinct_and_at_least_ten():
    assert len({m for _, _, m in BAD_SPECS}) == len(BAD_SPECS) >= 10


@pytest.mark.parametrize("text,message", [
    ("name: [unclosed", "(yaml)"),
    ("- just\n- a list\n", "expected a mapping of sections"),
])
def test_unparseable_files_exit_2(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and message in result.output


def test_missing_file_exits_2(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "cannot read" in result.output


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_validate(path):
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: ")


def test_synthetic_spec_has_a_gradient_of_at_least_4mb():
    spec = load_spec(ROOT / "jobs" / "synthetic-large.yaml")
    widths = [spec.dataset.features, *spec.model.hidden, spec.dataset.classes]
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    assert 4 * params >= 4_000_000


def test_schema_is_the_models_json_schema():
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema == JobSpec.model_json_schema()
    assert schema["additionalProperties"] is False and "compression" in schema["properties"]


def test_defaults_fill_in_and_codec_params_exclude_unset():
    spec = JobSpec.model_validate({"name": "x", "compression": {"codec": "qsgd", "levels": 63}})
    assert spec.training.steps == 300
    assert spec.compression.codec_params(rank=3) == {"levels": 63, "seed": 3}


CODE_SPEC = """\
name: code-spec
model: {name: "mycorp.models:build"}
dataset: {name: "scratch.data:load"}
"""


def test_validate_says_that_module_function_fields_are_code(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYZIP_ALLOWED_MODULES", raising=False)
    path = tmp_path / "code.yaml"
    path.write_text(CODE_SPEC)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0
    assert "model.name is code: `rayzip run` imports mycorp.models:build and calls it on every worker" in result.output
    assert "dataset.name is code" in result.output and "RAYZIP_ALLOWED_MODULES" in result.output


@pytest.mark.parametrize("command", ["validate", "run"])
def test_the_module_allow_list_is_enforced_naming_the_field(tmp_path, monkeypatch, command):
    path = tmp_path / "code.yaml"
    path.write_text(CODE_SPEC)
    monkeypatch.setenv("RAYZIP_ALLOWED_MODULES", "mycorp, other.pkg")
    result = CliRunner().invoke(app, [command, str(path)])
    assert result.exit_code == 2, result.output
    assert "dataset.name: module 'scratch.data' is not in RAYZIP_ALLOWED_MODULES (mycorp, other.pkg)" in result.output
    assert "model.name" not in result.output  # mycorp.models lies under mycorp
    monkeypatch.setenv("RAYZIP_ALLOWED_MODULES", "")
    result = CliRunner().invoke(app, [command, str(path)])
    assert result.exit_code == 2 and "model.name: module 'mycorp.models'" in result.output
    assert "empty: built-ins only" in result.output


def test_the_allow_list_does_not_match_a_prefix_that_is_not_a_package():
    from rayzip.spec import SpecError, check_allowed_modules, parse_spec

    spec = parse_spec({"name": "x", "model": {"name": "mycorpevil:build"}})
    with pytest.raises(SpecError, match="model.name: module 'mycorpevil'"):
        check_allowed_modules(spec, allowed="mycorp")
    check_allowed_modules(spec, allowed="mycorpevil")
    check_allowed_modules(parse_spec({"name": "y"}), allowed="")  # built-ins need no entry


def test_local_steps_on_shards_validate():
    spec = JobSpec.model_validate(with_change("sharding", {"enabled": True, "shard_size": 2},
                                              "local_steps", {"enabled": True, "every": 5},
                                              "compression.momentum_correction", False))
    assert spec.sharding.mode == "hsdp" and spec.local_steps.every == 5


def test_the_controller_on_hsdp_validates():
    spec = JobSpec.model_validate(with_change("sharding", {"enabled": True, "shard_size": 2},
                                              "adaptive", {"enabled": True}))
    assert spec.sharding.mode == "hsdp" and spec.adaptive.enabled


def test_overrides_set_nested_fields_as_yaml_and_leave_the_input_alone():
    from rayzip.spec import SpecError, with_overrides

    data = {"name": "x", "training": {"lr": 0.1, "betas": [0.9, 0.999]}}
    out = with_overrides(data, ["training.base_world_size=2", "training.betas=[0.9, 0.95]",
                                "local_steps.enabled=true", "name=y"])
    assert out == {"name": "y", "training": {"lr": 0.1, "betas": [0.9, 0.95], "base_world_size": 2},
                   "local_steps": {"enabled": True}}
    assert data == {"name": "x", "training": {"lr": 0.1, "betas": [0.9, 0.999]}}
    # An empty YAML key (``local_steps:``, read as None) is a section to fill, not an error.
    assert with_overrides({"local_steps": None}, ["local_steps.every=4"]) == {"local_steps": {"every": 4}}
    for bad, problem in (("training.lr", "(override)"), ("=3", "(override)"), ("name.x=1", "name.x: name is not a section")):
        with pytest.raises(SpecError) as err:
            with_overrides(data, [bad])
        assert err.value.problems[0].startswith(problem), err.value.problems


@pytest.mark.parametrize("setting, message", [
    ("training.lr=-1", "training.lr:"),
    ("training.lr", "(override)"),
    ("compression.codec=zip", "compression.codec:"),
])
def test_a_bad_override_exits_2_naming_the_field(setting, message):
    import ray

    spec = str(ROOT / "jobs" / "bench-gpt.yaml")
    for command in (["bench", "cluster", "--spec", spec, "--methods", "dense"], ["run", spec]):
        result = runner.invoke(app, [*command, "--set", setting])
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output, result.output
    assert not ray.is_initialized()
