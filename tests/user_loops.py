"""A user's own training loop for ``training.loop: user_loops:digits_loop`` (imported by the
workers through PYTHONPATH in the tests' runtime_env)."""

from __future__ import annotations

import time

import ray.train
import torch
import torch.nn.functional as F

from rayzip.train import compression_state
from rayzip.train.data import digits, shard


def digits_loop(config: dict, ctx) -> None:
    """An MLP on this rank's shard of digits, through the context's compressed model,
    optimizer, telemetry and checkpoints."""
    from rayzip.spec import DatasetSpec

    torch.manual_seed(0)
    x, y, x_test, y_test = digits(DatasetSpec(), seed=0)
    mine = shard(len(x), ctx.rank, ctx.world, seed=0)
    model = ctx.prepare_model(torch.nn.Sequential(torch.nn.Linear(64, config["hidden"]), torch.nn.ReLU(),
                                                  torch.nn.Linear(config["hidden"], 10)))
    optimizer = ctx.build_optimizer(model.parameters())
    start = ctx.restore(model, optimizer).get("step", -1) + 1
    every = config.get("checkpoint_every")
    for step in range(start, config["steps"]):
        ctx.telemetry.begin_step()
        gen = torch.Generator().manual_seed(1000 * step + ctx.rank)  # a step's batch, in any attempt
        idx = mine[torch.randint(0, len(mine), (32,), generator=gen)]
        for group in optimizer.param_groups:
            group["lr"] = ctx.learning_rate(step, config["steps"])
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        if config.get("snapshots") and step in config.get("snapshot_steps", (step,)):
            ctx.snapshot(step, model, optimizer, extra={"step": step})
        record = ctx.telemetry.end_step(step, float(loss))
        for lo, hi, seconds in config.get("slow_steps", ()):
            if lo <= step < hi:  # a model's compute: long enough for the driver's twice-a-second poll to land here
                time.sleep(seconds)
        if every and (step + 1) % every == 0 and step + 1 < config["steps"]:
            ctx.report({"step": step, "loss": float(loss)}, model=model, optimizer=optimizer, extra={"step": step})
            if step >= config.get("await_checkpoints_from", config["steps"]):
                # Ray Train's controller takes a report when it next polls the workers (every
                # few seconds): a kill before then loses it. A test that kills where it needs
                # the newest checkpoint in storage waits from there for each to be committed.
                ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        if step + 1 == config["steps"]:
            if ctx.spec.local_steps.enabled:  # every rank: evaluate the model they all train
                compression_state(model).synchronize()
            with torch.no_grad():
                accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
            totals = compression_state(model).totals if compression_state(model) is not None else {}
            ctx.report({"step": step, "loss": float(loss), "test_accuracy": accuracy,
                        "bytes_sent": record.traffic.bytes_sent, "dense_bytes": record.traffic.dense_bytes,
                        "compressed": record.traffic.compressed, "world_size": ctx.world,
                        # the run's, which the summary's wire_reduction reads
                        "total_bytes_sent": totals.get("bytes_sent", 0), "total_dense_bytes": totals.get("dense_bytes", 0)},
                       model=model, optimizer=optimizer, extra={"step": step})
