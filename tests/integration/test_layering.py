"""The library layers stand alone (issue 44): rayzip.torch, rayzip.engine, rayzip.codecs and
rayzip.checkpoint train two gloo ranks through the hook, and save and load a checkpoint, in processes where
importing ray or pydantic fails; and every import in the package points down a layer."""

from __future__ import annotations

import os
import subprocess
import sys

from paths import ROOT

SCRIPT = '''
import sys

class Blocked:
    """Importing ray or pydantic fails in this process and in the ranks it spawns."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "pydantic"):
            raise ImportError(f"{name} is blocked")


sys.meta_path.insert(0, Blocked())

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rayzip.checkpoint
import rayzip.codecs
import rayzip.engine
import rayzip.torch


def rank_main(rank, init):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = rayzip.torch.compress(ddp, rayzip.torch.CompressionConfig(codec="group_topk", density=0.1,
                                                                      momentum_correction=True), momentum=0.9)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(torch.randn(8, 16, generator=gen)),
                                          torch.randint(0, 4, (8,), generator=gen)).backward()
        optimizer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = [None, None]
    dist.all_gather_object(gathered, [w.sum().item() for w in weights])
    assert gathered[0] == gathered[1], gathered  # the replicas agree
    assert state.last_step.compressed and state.last_step.bytes_sent < state.last_step.dense_bytes
    with tempfile.TemporaryDirectory() as where:
        rayzip.checkpoint.save(where, {"model": model.state_dict(), "hook": state.state_dict()})
        back = rayzip.checkpoint.load(where)
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(os.path.join(tmp, "init"),), nprocs=2, join=True, start_method="spawn")
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "pydantic"))
    assert not leaked, leaked
    print("trained without ray and pydantic")
'''


def test_the_hook_and_checkpoints_train_two_ranks_without_ray_or_pydantic(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the tree under test, whatever is installed
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained without ray and pydantic" in result.stdout


def test_every_import_in_the_package_points_down_a_layer():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "layers.py")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "every import points down" in result.stdout


def test_a_replicated_training_worker_does_not_import_dtensor():
    """Importing rayzip's runner and training loop (a driver's, a Ray Train worker's) pulls
    neither DTensor nor DCP nor FSDP: together most of a second of CPU. rayzip's isinstance
    checks look the module up instead (rayzip.xp.is_dtensor). A worker that builds a torch
    optimizer loads them anyway at its first step (torch._dynamo imports FSDP); the
    driver of `rayzip run` builds none."""
    code = ("import sys, ray.train.torch, rayzip.runner, rayzip.train.loop\n"
            "heavy = ('torch.distributed.tensor', 'torch.distributed.checkpoint', 'torch.distributed.fsdp')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "[]", result.stdout
