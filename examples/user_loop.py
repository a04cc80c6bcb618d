"""Your own Ray Train loop, with rayzip compressing the gradients and the checkpoints.

A plain ``TorchTrainer`` job over ``ray.data`` input (scikit-learn's digits). Against the same
loop without rayzip, three lines differ, each marked ``# rayzip``: ``prepare_model`` comes from
``rayzip.train`` and is told the optimizer, AdamW, for which it picks the compression that
holds quality (SparseLoCo's wire every step: each rank's AdamW steps on its own gradient and
the ranks average what moved, top 1% in 2 bits), and the checkpoint is written by
``rayzip.train.report`` and read by ``rayzip.train.restore``, which carry the compression state
(error-feedback residuals, codec state, step) with the model and optimizer. The evaluation
runs in eval mode, as usual: that is where every rank's weights are the ones they share.

Run it on a local Ray (or ``RAY_ADDRESS``)::

    python examples/user_loop.py --workers 2 --epochs 15
    python examples/user_loop.py --fail-at-epoch 5      # kill rank 0 once, to watch it resume
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import ray
import ray.data
import ray.train
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from sklearn.datasets import load_digits

import rayzip.train


def digits_datasets(seed: int = 0) -> tuple[ray.data.Dataset, ray.data.Dataset]:
    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)
    rows = [{"x": x[i], "y": y[i]} for i in order]
    return ray.data.from_items(rows[400:]), ray.data.from_items(rows[:400])


def train_func(config: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = rayzip.train.prepare_model(model, optimizer="adamw")  # rayzip: the compression that holds AdamW's quality
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    saved = rayzip.train.restore(model, optimizer)  # rayzip: {} on a fresh start
    state = rayzip.train.compression_state(model)  # None at world size 1
    residuals = list(state.memory.residuals.values()) if state and state.memory else []
    resumed = {"epoch": saved.get("epoch"), "hook_step": state.step if state else None,
               "residual_norm": float(sum(np.linalg.norm(np.asarray(r)) for r in residuals)) if residuals else None
               } if saved else None
    rank = ray.train.get_context().get_world_rank()
    train = ray.train.get_dataset_shard("train")
    x_test, y_test = (torch.as_tensor(np.stack(c)) for c in zip(*((r["x"], r["y"]) for r in config["test_rows"])))
    for epoch in range(saved.get("epoch", -1) + 1, config["epochs"]):
        if epoch == config.get("fail_at_epoch") and rank == 0 and not Path(config["fail_marker"]).exists():
            Path(config["fail_marker"]).touch()
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker: Ray Train restarts the group
        sent = dense = 0
        for batch in train.iter_torch_batches(batch_size=config["batch_size"], drop_last=True):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
            optimizer.step()
            if state is not None:
                sent, dense = sent + state.last_step.bytes_sent, dense + state.last_step.dense_bytes
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        model.train()
        metrics = {"epoch": epoch, "loss": float(loss), "test_accuracy": accuracy, "bytes_sent": sent,
                   "dense_bytes": dense, "hook_step": state.step if state else None, "resumed": resumed}
        rayzip.train.report(metrics, model=model, optimizer=optimizer, extra={"epoch": epoch})  # rayzip


def main(argv: list[str] | None = None) -> ray.train.Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fail-at-epoch", type=int, default=None, help="kill rank 0 once at this epoch")
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args(argv)
    train_ds, test_ds = digits_datasets()
    storage = args.storage_path or tempfile.mkdtemp(prefix="rayzip-example-")
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size,
                           "test_rows": test_ds.take_all(), "fail_at_epoch": args.fail_at_epoch,
                           "fail_marker": os.path.join(storage, "failed-once")},
        scaling_config=ScalingConfig(num_workers=args.workers),
        datasets={"train": train_ds},
        run_config=RunConfig(name="rayzip-user-loop", storage_path=storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=2)),
    )
    result = trainer.fit()
    m = result.metrics
    print(f"epoch {m['epoch']}: test accuracy {m['test_accuracy']:.4f}; last epoch sent {m['bytes_sent'] / 1e6:.3f} MB "
          f"per worker against {m['dense_bytes'] / 1e6:.3f} MB dense; resumed: {m['resumed']}")
    return result


if __name__ == "__main__":
    main()
