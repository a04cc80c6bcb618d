"""What rayzip's hook costs when compression is off: per-step time of plain DDP, of DDP with
torch's own Python allreduce hook, and of rayzip's hook switched off (codec ``none``; group
top-k switched off, with and without momentum correction), on 2 gloo ranks over loopback, one
thread each. Rounds are interleaved; each row is the median over rounds of each round's median
step, and its ratio to plain DDP's.

    .venv/bin/python tools/off_overhead.py [--rounds 5] [--steps 40]

The model is the cluster benchmark's MLP (64 -> 2048 -> 2048 -> 10, 4.35M parameters): on
this 2-core machine the step is compute-bound, so what the hook adds shows as CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("ddp", "torch-python-hook", "rayzip-none", "rayzip-off", "rayzip-off-momentum")
WARM = 10


def _step_time(mode: str, rank: int, steps: int) -> float:
    import rayzip.torch as rz
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10)))
    momentum = 0.9
    if mode == "torch-python-hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode == "rayzip-none":
        rz.compress(ddp, rz.CompressionConfig(codec="none"))
    elif mode.startswith("rayzip-off"):
        corrected = mode.endswith("momentum")  # the hook keeps the momentum; the optimizer has none
        exchange = rz.compress(ddp, rz.CompressionConfig(codec="group_topk", density=0.01,
                                                         momentum_correction=corrected),
                               momentum=momentum if corrected else None)
        exchange.set_enabled(False)
        momentum = 0.0 if corrected else momentum
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 64, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    times = []
    for _ in range(WARM + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARM:])


def _rank(rank: int, port: int, rounds: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    seen: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            seen[mode].append(_step_time(mode, rank, steps))
    if rank == 0:
        base = statistics.median(seen["ddp"])
        print(f"{'mode':22s} {'step ms':>8s} {'vs DDP':>7s}  rounds (ms)")
        for mode in MODES:
            median = statistics.median(seen[mode])
            rounds_ms = ", ".join(f"{v * 1e3:.1f}" for v in seen[mode])
            print(f"{mode:22s} {median * 1e3:8.2f} {median / base:6.3f}x  {rounds_ms}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.rounds, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
