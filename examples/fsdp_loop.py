"""HSDP with rayzip in your own torchrun loop: FSDP2 shards the model inside each node, and
each shard's gradient crosses between nodes compressed, with error feedback, by the codec that
holds AdamW's quality on shards (8-bit DCT: rayzip.torch.optim.default_compression). With
``--local-steps H`` (DiLoCo on FSDP2), each node trains H steps alone, and then each rank's
pseudo-gradient shard crosses between nodes through group top-k (``--density``) with error
feedback.

    torchrun --nproc-per-node 4 examples/fsdp_loop.py --shard-size 2      # 2 "nodes" of 2 ranks
    torchrun --nproc-per-node 4 examples/fsdp_loop.py --shard-size 2 --local-steps 4
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/fsdp_loop.py      # shard size: the GPUs per node
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from rayzip.engine import CompressionConfig
from rayzip.torch.fsdp import compress_sharded, hsdp_mesh, local_steps_on_shards
from rayzip.torch.optim import default_compression


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-size", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local-steps", type=int, default=0, help="H: synchronize every H steps (0: every step)")
    parser.add_argument("--density", type=float, default=0.1, help="with --local-steps: the kept fraction")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    train(args, device)
    # Once the model is gone, its reference cycles (FSDP2's hooks) too: a live one holds the
    # group's threads, which can abort Python's exit.
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)],
                                torch.nn.Linear(256, 10)).to(device)
    shard_mesh, replicate = hsdp_mesh(args.shard_size)  # FSDP2 inside a node, rayzip between nodes
    for block in model:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.local_steps:  # nothing crosses between nodes but every H-th step's pseudo-gradient shards
        local = local_steps_on_shards(model, replicate, every=args.local_steps, outer_lr=1.0, outer_momentum=0.0,
                                      compression=CompressionConfig(codec="group_topk", density=args.density,
                                                                    value_dtype="int8", packed_indices=True))
        exchange = None
    else:
        # 8-bit DCT on the shards under AdamW
        exchange = compress_sharded(model, default_compression(optimizer, sharded=True), replicate)

    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    x = torch.randn(512, 256, generator=generator).to(device)
    y = (x[:, :10].argmax(dim=1)).to(device)
    losses = []
    for step in range(args.steps):
        batch = torch.randint(0, len(x), (64,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()  # FSDP2 reduce-scatters in the node; rayzip averages each shard between nodes
        if exchange is None:
            if local.gradient_ok(step):  # a NaN drops the round on every rank at the synchronization
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            local.after_inner_step(force=step == args.steps - 1)
        elif not exchange.last_step.skipped:  # a NaN anywhere skips the step on every rank
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    totals = dict(exchange.totals if exchange is not None else local.state.totals)
    if exchange is None:  # against a dense exchange of the shards at every step
        totals["dense_bytes"] = totals["dense_bytes"] * args.steps // max(1, local.rounds)
    if rank == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; between nodes {totals['bytes_sent']:,} bytes sent, "
              f"{totals['dense_bytes'] / max(totals['bytes_sent'], 1):.1f}x fewer than dense")


if __name__ == "__main__":
    main()
