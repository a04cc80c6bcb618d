"""Checkpoints never run code on load, and hostile bytes never crash the decoder (issue 16)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from typer.testing import CliRunner

from bits import assert_same_bits
from rayzip import checkpoint
from rayzip.checkpoint import CheckpointError
from rayzip.checkpoint import store as store_module
from rayzip.checkpoint.store import write_manifest
from rayzip.cli import app

FUZZ_CASES = 400  # bounded: about two seconds


class _Payload:
    """Unpickling this writes a marker file: what an attacker's pickle would do."""

    marker: str = ""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def test_rayzip_state_is_stored_without_pickle_and_round_trips(tmp_path):
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
             "totals": {"loss": float("nan"), "best": float("inf"), "worst": float("-inf"), "steps": 3},
             "scalars": [np.float32(1.5), np.int64(-7), np.uint8(200), np.bool_(True)], "blob": b"\x00\xffraw",
             "hook": {"memory": {"model": np.arange(5, dtype=np.float32)}, "codec": {"calls": 4}, "loss_scale": None}}
    manifest = checkpoint.save(tmp_path / "ckpt", state)
    assert not any(e.get("pickle") for e in manifest["tensors"].values())
    back = checkpoint.load(tmp_path / "ckpt")
    assert np.isnan(back["totals"]["loss"]) and back["totals"]["best"] == float("inf")
    assert back["totals"]["worst"] == float("-inf") and back["totals"]["steps"] == 3
    assert [type(v) for v in back["scalars"]] == [np.float32, np.int64, np.uint8, np.bool_]
    assert back["scalars"] == state["scalars"] and back["blob"] == state["blob"]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    torch.testing.assert_close(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"],
                               rtol=0, atol=0)


def test_an_object_that_needs_pickle_is_refused_unless_allowed(tmp_path):
    with pytest.raises(CheckpointError, match=r"/extra/0: a .*_Payload can only be stored by pickling"):
        checkpoint.save(tmp_path / "refused", {"extra": [_Payload(str(tmp_path / "never"))]})


def test_loading_a_pickled_entry_is_refused_and_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    checkpoint.save(tmp_path / "ckpt", {"weights": torch.ones(3), "evil": _Payload(str(marker))}, allow_pickle=True)
    with pytest.raises(CheckpointError, match=r"manifest.json.zst: entry '/evil' is a pickled object.*refused"):
        checkpoint.load(tmp_path / "ckpt")
    assert not marker.exists()
    result = CliRunner().invoke(app, ["checkpoint", "decompress", str(tmp_path / "ckpt"), "-o",
                                      str(tmp_path / "out.pt")])
    assert result.exit_code != 0 and "pickled object" in result.output and not marker.exists()
    checkpoint.verify(tmp_path / "ckpt")  # checksums are checked without unpickling anything
    assert not marker.exists()
    # Opting in runs it: the caller said it trusts the file.
    checkpoint.load(tmp_path / "ckpt", allow_pickle=True)
    assert marker.read_text() == "code ran"


def test_the_manifest_cannot_point_the_data_file_elsewhere(tmp_path):
    checkpoint.save(tmp_path / "ckpt", {"w": torch.ones(4)})
    manifest = checkpoint.read_manifest(tmp_path / "ckpt")
    manifest["data"] = "../../etc/passwd"
    write_manifest(tmp_path / "ckpt", manifest)
    with pytest.raises(CheckpointError, match="its data file is '../../etc/passwd'"):
        checkpoint.load(tmp_path / "ckpt")


def _fuzz_state() -> dict:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(8192, generator=g)
    return {"model": {"w": weights, "0.bias": torch.randn(7, generator=g), "1.bias": torch.randn(40, generator=g),
                      "half": torch.randn(900, generator=g).bfloat16(),
                      "ids": torch.randint(0, 50, (600,), generator=g), "zeros": torch.zeros(5000)},
            "optimizer": {"exp_avg": torch.randn(8192, generator=g) * 1e-3,
                          "exp_avg_sq": (torch.randn(8192, generator=g) * 1e-4).abs()},
            "step": 12}


def _refresh_checksums(manifest: dict, data: bytes) -> None:
    """What an attacker who can write the files does: make every checksum match again, so the
    mutated bytes reach the decoders instead of stopping at the first checksum."""
    for s in _streams(manifest):
        s["xxh3"] = xxhash.xxh3_64_hexdigest(data[s["offset"]: s["offset"] + s["stored"]])
    manifest["data_bytes"] = len(data)
    manifest["checksum"] = store_module._whole(store_module._stream_hashes(manifest["tensors"], manifest["packs"]))


def _streams(manifest: dict) -> list[dict]:
    """Every stream: the tensors' own, and the packs' that hold the small ones together."""
    return [s for e in [*manifest["tensors"].values(), *manifest["packs"]] for s in e["streams"]]


def test_fuzzed_streams_raise_checkpoint_error_and_never_crash(tmp_path, monkeypatch):
    # The prefix mapping first for optimizer state, so its decoder is fuzzed too (an attacker
    # names whatever codec they like in the manifest anyway).
    monkeypatch.setattr("rayzip.checkpoint.codecs.PREFIX_FIRST", True)
    original = _fuzz_state()
    base = tmp_path / "base"
    checkpoint.save(base, original)
    later = {**original, "model": {k: (v + 1e-3 if v.is_floating_point() else v) for k, v in original["model"].items()}}
    source = tmp_path / "source"
    checkpoint.save(source, later, base=base)  # deltas, prefix mapping, planes and Huffman all in play
    clean_manifest = checkpoint.read_manifest(source)
    codings = {s["coding"] for s in _streams(clean_manifest)}
    assert {"huffman", "raw"} <= codings
    assert {"prefix", "planes"} <= {e["codec"] for e in [*clean_manifest["tensors"].values(), *clean_manifest["packs"]]}
    assert any(e["delta"] for e in clean_manifest["tensors"].values())
    assert clean_manifest["packs"] and any(e["codec"] == "packed" for e in clean_manifest["tensors"].values())
    clean_data = (source / "tensors.bin").read_bytes()
    rng = random.Random(16)
    outcomes = {"error": 0, "exact": 0}
    case = tmp_path / "case"
    for _ in range(FUZZ_CASES):
        manifest = json.loads(json.dumps(clean_manifest))
        data = bytearray(clean_data)
        stream = rng.choice(_streams(manifest))
        kind = rng.choice(["flip", "bytes", "truncate", "extend", "nbytes", "zero"])
        start, stored = stream["offset"], stream["stored"]
        if kind == "flip" and stored:
            pos = start + rng.randrange(stored)
            data[pos] ^= 1 << rng.randrange(8)
        elif kind == "bytes" and stored:
            for _ in range(rng.randint(1, 8)):
                data[start + rng.randrange(stored)] = rng.randrange(256)
        elif kind == "zero" and stored:
            cut = rng.randrange(stored)
            data[start + cut: start + stored] = bytes(stored - cut)
        elif kind == "truncate":
            stream["stored"] = rng.randrange(stored + 1)
        elif kind == "extend":  # the stream claims the next stream's bytes too
            stream["stored"] = min(len(data) - start, stored + rng.randint(1, 64))
        elif kind == "nbytes":
            stream["nbytes"] = max(0, stream["nbytes"] + rng.choice([-1, 1, -stream["nbytes"], 7, 1 << 20]))
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir()
        (case / "tensors.bin").write_bytes(bytes(data))
        manifest["base"]["path"] = str(base.resolve())
        _refresh_checksums(manifest, bytes(data))
        write_manifest(case, manifest)
        try:
            back = checkpoint.load(case)
        except CheckpointError as exc:
            assert "tensor" in str(exc) or "tensors.bin" in str(exc), str(exc)
            outcomes["error"] += 1
            continue
        # A mutation the decoder did not notice must not change a single bit anywhere, the
        # optimizer state (where the prefix decoder runs) included: the restored words' own
        # checksum stands behind every tensor.
        assert_same_bits(back, later)
        outcomes["exact"] += 1
    print(f"fuzz: {FUZZ_CASES} mutated checkpoints, {outcomes}")
    assert outcomes["error"] > FUZZ_CASES // 2


def test_truncated_data_file_names_the_first_tensor_affected(tmp_path):
    checkpoint.save(tmp_path / "ckpt", _fuzz_state())
    data = (tmp_path / "ckpt" / "tensors.bin").read_bytes()
    for cut in (0, 1, len(data) // 3, len(data) - 1):
        (tmp_path / "ckpt" / "tensors.bin").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"tensors.bin: \d+ bytes, the manifest records .*first tensor affected: (tensors )?'/"):
            checkpoint.load(tmp_path / "ckpt")
