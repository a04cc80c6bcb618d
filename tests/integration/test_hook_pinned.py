"""The hook's averaged gradients, pinned bit for bit on 2 and 3 gloo ranks (issue 44): a
refactor of the exchange must not change one bit of what training receives.

The scenarios are test_gpu_ranks.py's CPU side: models whose arithmetic is exact in float32
in any order, so the digests depend on the exchange alone, not on the machine's BLAS. Each
digest is SHA-256 over the averaged gradient at every step (every replica's, equal) and
every rank's bytes sent and skips.
A deliberate change of the exchange's arithmetic updates them here, with the reason in the
commit.
"""

from __future__ import annotations

import hashlib

import pytest

from gloo_world import run_world
from test_gpu_ranks import SCENARIOS

PINNED = ("hook_overlap", "hook_serial", "sparse_ring", "dct_4bit", "momentum", "nan_skip")
# Computed at 31833d8 (before this session's refactors) and again after them: equal.
DIGESTS = {
    "hook_overlap@2": "ac9ec3d6c84b7ee995408e57269fe12648307f9287c121e135f461699f21f84e",
    "hook_serial@2": "ac9ec3d6c84b7ee995408e57269fe12648307f9287c121e135f461699f21f84e",
    "sparse_ring@2": "5d94fb8bd820eefce9623703b93bf06585bfa9709e431b03f231e3062ad21369",
    "dct_4bit@2": "8d3a01f1b3b9c29885525f8c4d262e08b321bdcdb629b27aa224a3abfde6c0d7",
    "momentum@2": "23c27aeac402420888cd080187f4cab520512d3e14d809a5862d70e1f290edba",
    "nan_skip@2": "85a6983f583c13a06fe6c6ce82b60a19568149fad534f9a42d3a097c2c0f010f",
    "hook_overlap@3": "c6dfbd7241c4e8794757b02a4a49ab4671702ab9b2e2b2bef72742aa13941cad",
    "hook_serial@3": "c6dfbd7241c4e8794757b02a4a49ab4671702ab9b2e2b2bef72742aa13941cad",
    "sparse_ring@3": "7e7226a575e40dedd29721badc9f600bdc72688c8ec8b28642515a0e15a414f0",
    "dct_4bit@3": "d9ebba792309d3907d68d3c2f44cd6c5322c1c3890982020e16330c5ba390aca",
    "momentum@3": "a954593a36ae593b50d61d715588f90901537f849d21edf4e29f61907300724b",
    "nan_skip@3": "84ef388946ae0b03186593cfbaeb631870126a41309244bf42c1b33e0512f88c",
}


def _results(rank, world):
    out = {}
    for name in PINNED:
        steps = SCENARIOS[name](rank, "cpu")["steps"]
        grads = hashlib.sha256(b"".join(step["grad"].tobytes() for step in steps)).hexdigest()
        out[name] = (grads, [(step["bytes"], step["skipped"]) for step in steps])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_hooks_averaged_gradients_are_the_pinned_ones(world):
    ranks = run_world(_results, world, timeout_s=300)
    got = {}
    for name in PINNED:
        grads = {r[name][0] for r in ranks}
        assert len(grads) == 1, (name, grads)  # every replica received the same average
        sent = [r[name][1] for r in ranks]  # each rank's bytes sent and skips, step by step
        got[f"{name}@{world}"] = hashlib.sha256(f"{grads.pop()} {sent}".encode()).hexdigest()
    assert got == {k: v for k, v in DIGESTS.items() if k.endswith(f"@{world}")}, got
