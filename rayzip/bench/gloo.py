"""Run a function on N real gloo ranks (processes of their own) and collect what each returns:
``rayzip bench collectives`` and the tests' multi-rank cases.

The ranks fork from a server process that has imported torch once, so a world starts in well
under a second instead of each rank importing torch anew. With CUDA they are spawned fresh
instead: a CUDA context does not survive a fork.

Usage::

    results = run_world(fn, 4, arg)      # [fn(rank, 4, arg) for each rank], raised if one failed
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world"]

# What the fork server imports once: torch's import dominates a rank's start-up.
PRELOAD = ["torch", "torch.distributed", "numpy", "rayzip.codecs", "rayzip.comm", "rayzip.torch"]


def _entry(rank: int, world: int, init_file: str, out_dir: str, fn, args, timeout_s: float | None = None) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The ranks share the machine's cores: each with a thread per core, they would contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, **kwargs)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # ship the failure to the parent, which re-raises it
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    # A failed fn leaves its DDP model alive in reference cycles through its traceback; its
    # reducer must go before the process group it points to, not at interpreter exit.
    gc.collect()
    dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout_s: float | None = None):
    """``[fn(rank, world, *args) for each rank]``, run in ``world`` gloo processes. With
    ``timeout_s``, a collective that waits longer fails (gloo's default is 30 minutes)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world, init_file, tmp, fn, args, timeout_s), nprocs=world, join=True,
                           start_method=_start_method())
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as fh:
                status, value = pickle.load(fh)
            if status == "error":
                raise AssertionError(f"rank {rank} failed: {value}")
            results.append(value)
        return results


def _start_method() -> str:
    import torch

    if torch.cuda.is_available():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first world
    return "forkserver"
