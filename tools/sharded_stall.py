"""The checkpoint stall of the sharded GPT under `rayzip run`: background against synchronous
DCP writes, 3 runs each, interleaved, 4 workers in shard groups of 2 on a local Ray of 2 CPUs
(`.venv/bin/python tools/sharded_stall.py`). Prints each run and the medians as JSON."""
import json
import statistics
import tempfile

import ray

from rayzip.runner import run_job
from rayzip.spec import JobSpec

def spec(background):
    return JobSpec.model_validate({
        "name": f"stall-{'bg' if background else 'sync'}",
        "model": {"name": "gpt", "layers": 4, "width": 384, "heads": 6, "context": 128},
        "dataset": {"name": "python-stdlib", "max_bytes": 400_000, "eval_windows": 16},
        "training": {"loop": "language_model", "steps": 30, "batch_size": 2, "optimizer": "adamw", "lr": 0.001,
                     "eval_every": 30},
        "scaling": {"min_workers": 4, "max_workers": 4, "cpus_per_worker": 0.5},
        "compression": {"codec": "group_topk", "density": 0.05},
        "sharding": {"enabled": True, "mode": "hsdp", "shard_size": 2},
        "checkpoint": {"every_steps": 5, "background": background},
    })

ray.init(address="local", num_cpus=2, log_to_driver=False)
out = {"sync": [], "background": []}
for rnd in range(3):
    for bg in ((False, True) if rnd % 2 == 0 else (True, False)):
        s = run_job(spec(bg), storage_path=tempfile.mkdtemp(), verbose=False)
        m = s["metrics"]
        out["background" if bg else "sync"].append({"stall_s": m["checkpoint_stall_s"], "train_s": m["train_s"], "steps": s["steps"]})
        print(rnd, bg, m["checkpoint_stall_s"], m["train_s"], flush=True)
med = {k: statistics.median(r["stall_s"] for r in v) for k, v in out.items()}
print(json.dumps({"runs": out, "median_stall_s": med, "background_over_sync": med["background"] / med["sync"]}, indent=1))
