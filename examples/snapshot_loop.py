"""Your own Ray Train loop that loses no step when a worker dies: in-memory snapshots.

A plain ``TorchTrainer`` job (an MLP on scikit-learn's digits, group top-k at 5% over the
gradients). Against a loop that only checkpoints, two lines differ, each marked ``# rayzip``:
the driver wraps ``trainer.fit()`` in ``rayzip.train.keep_snapshots``, which starts a keeper
on each node, and the loop calls ``rayzip.train.snapshot`` after each optimizer step, a memory
copy of the model, the optimizer, the compression state and ``extra`` into its node's keeper.
After a restart, ``rayzip.train.restore`` takes the newest step that every rank's keeper holds
before it reads storage, so training goes on from the step where the worker died, not from
the last checkpoint. Checkpoints in storage stay the second line, for a whole cluster lost.

Run it on a local Ray (or ``RAY_ADDRESS``)::

    python examples/snapshot_loop.py --workers 2 --steps 300
    python examples/snapshot_loop.py --kill-at-step 130    # rank 0 dies after step 130: it resumes at 131
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import ray.train
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from sklearn.datasets import load_digits

import rayzip.train


def digits() -> tuple[np.ndarray, ...]:
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = (data.data[order] / 16.0).astype(np.float32), data.target[order].astype(np.int64)
    return x[400:], y[400:], x[:400], y[:400]


def train_func(config: dict) -> None:
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x, y, x_test, y_test = (torch.as_tensor(a) for a in config["data"])
    x, y = x[rank::world], y[rank::world]  # this rank's shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = rayzip.train.prepare_model(model, compression=rayzip.train.CompressionConfig(codec="group_topk",
                                                                                         density=0.05))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    saved = rayzip.train.restore(model, optimizer)  # the newer of memory and storage; {} at the start
    start = saved.get("step", -1) + 1
    for step in range(start, config["steps"]):
        batch = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step * world + rank))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        rayzip.train.snapshot(step, model, optimizer, extra={"step": step})  # rayzip: a lost worker resumes here
        if step == config.get("kill_at_step") and rank == 0 and not Path(config["kill_marker"]).exists():
            Path(config["kill_marker"]).touch()
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker: Ray Train restarts the group
        if (step + 1) % 100 == 0 or step + 1 == config["steps"]:
            with torch.no_grad():
                accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
            rayzip.train.report({"step": step, "loss": loss.item(), "test_accuracy": accuracy, "started_at": start},
                                model=model, optimizer=optimizer, extra={"step": step})


def main(argv: list[str] | None = None) -> tuple[ray.train.Result, rayzip.train.api.KeptSnapshots | None]:
    """The run's result, and what the keepers kept (None with ``--no-snapshots``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at-step", type=int, default=None, help="kill rank 0 once, after this step")
    parser.add_argument("--no-snapshots", action="store_true", help="checkpoints only, the old way")
    parser.add_argument("--every", default="auto", help="snapshot every N steps, or auto (at most 5%% of a step)")
    parser.add_argument("--storage-path", default=None)
    parser.add_argument("--name", default="rayzip-snapshot-loop")
    args = parser.parse_args(argv)
    storage = args.storage_path or tempfile.mkdtemp(prefix="rayzip-example-")
    run_config = RunConfig(name=args.name, storage_path=storage, checkpoint_config=CheckpointConfig(num_to_keep=2),
                           failure_config=FailureConfig(max_failures=2))
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": args.steps, "data": digits(), "kill_at_step": args.kill_at_step,
                           "kill_marker": os.path.join(storage, "killed-once")},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=run_config,
    )
    kept = None
    if args.no_snapshots:
        result = trainer.fit()
    else:
        every = args.every if args.every == "auto" else int(args.every)
        with rayzip.train.keep_snapshots(run_config, every=every) as kept:  # rayzip: a keeper on each node
            result = trainer.fit()
    m = result.metrics
    print(f"step {m['step']}: test accuracy {m['test_accuracy']:.4f}; the last start was at step {m['started_at']}")
    if kept is not None:
        for r in kept.resumes:
            print(f"restart ({r['cause']}): resumed at step {r['resumed_at']} from {r['source']}, "
                  f"{r['steps_lost']} steps lost, {r['seconds']:.1f} s")
        print(f"the keepers held {sum(u['held_bytes'] for u in kept.memory.values()):,} bytes at the end")
    return result, kept


if __name__ == "__main__":
    main()
