"""Two processes on one GPU, NCCL between them, through rayzip's compressed hook: whether
NCCL allows it (recent versions refuse two ranks on one device), and if it does, that both
ranks end with the same weights. Run by tools/gpu/check.sh."""

import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, init, out):
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", 0))
    from rayzip.torch import CompressionSpec, compress, ddp_kwargs

    spec = CompressionSpec(codec="group_topk", ratio=0.05, segment_mb=1.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], **ddp_kwargs(spec))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = compress(ddp, spec)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for _ in range(5):
        x = torch.randn(128, 64, device="cuda", generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), x[:, :10].argmax(1)).backward()
        opt.step()
    np.save(f"{out}-{rank}.npy", torch.cat([p.detach().flatten() for p in ddp.parameters()]).cpu().numpy())
    print(f"rank {rank}: 5 steps, {state.totals}")
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    try:
        mp.start_processes(rank_main, args=(os.path.join(tmp, "init"), os.path.join(tmp, "w")), nprocs=2, join=True,
                           start_method="spawn")
    except Exception as exc:
        print("two ranks on one GPU did not run:", str(exc).splitlines()[-1][:300])
        sys.exit(1)
    a, b = (np.load(os.path.join(tmp, f"w-{r}.npy")) for r in (0, 1))
    print("both ranks equal:", bool(np.array_equal(a, b)), "max |diff|", float(np.abs(a - b).max()))
