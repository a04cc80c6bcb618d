"""Lossless compressed checkpoints: XOR deltas of weights against a base, prefix-index
mapping of optimizer state, byte planes coded by Huffman (order 0 or 1) or zstd, with a
checksum per tensor.

Usage::

    from rayzip import checkpoint

    checkpoint.save("ckpt-100", {"model": model.state_dict(), "optimizer": opt.state_dict()})
    checkpoint.save("ckpt-110", state, base="ckpt-100")    # deltas against ckpt-100
    state = checkpoint.load("ckpt-110")                     # bit-exact
    manifest, blobs = checkpoint.encode(state)              # the same, in memory
"""

from .chain import DeltaChain
from .store import CheckpointError, decode, encode, has_manifest, inspect, load, read_manifest, save, verify

__all__ = ["CheckpointError", "DeltaChain", "decode", "encode", "has_manifest", "inspect", "load", "read_manifest", "save",
           "verify"]
