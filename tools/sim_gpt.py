"""Screen ways of exchanging the GPT benchmark's updates, in one process (issue 46).

W data-parallel workers are simulated in one process: each computes its gradient on its
own batches (the job's ShardSampler), the method under test turns the W gradients into
the step, and the model steps. Model, data, batch, AdamW settings, clipping and schedule
are those of jobs/bench-gpt.yaml; dense here ends where `rayzip run` of that spec does
(3.0352 bits per byte at step 200). It screens methods before they are built into the
engine: headline figures come from `rayzip bench cluster`.

Each run adds (or replaces) its row, under ``--label``, in the JSON file given by
``--json``, with the commit and date; ``--table JSON`` prints the rows as a markdown table
against the dense row. ``--stop-at N`` ends a run that has clearly failed at step N,
keeping the schedule of ``--steps``.

    python tools/sim_gpt.py dense --label dense --json docs/sim-gpt-methods.json
    python tools/sim_gpt.py demo --topk 32 --update sign --label demo --json docs/sim-gpt-methods.json
    python tools/sim_gpt.py --table docs/sim-gpt-methods.json --plot docs/sim-gpt-methods.png

Methods:
  dense   the mean gradient, AdamW (DDP).
  demo    DeMo: each worker's decaying momentum (beta), its 2-D DCT in chunk x chunk tiles,
          the top ``--topk`` coefficients of each tile sent and subtracted; the decoded mean
          feeds AdamW (``--update adamw``) or a sign step at AdamW's learning rate (``sign``).
  topk    group top-k (``--group``, ``--density``) with error feedback, of the gradient
          (``--memory ef``: AdamW on the decoded mean) or of each worker's own Adam direction
          (``--memory adam``: the mean applied by SGD with AdamW's decay; rayzip's
          adam_correction).
  stale   every ``--period`` steps a block of ``--block`` entries sends its window's summed
          gradient (round robin, no offsets on the wire); the gradient AdamW sees holds each
          block's last window mean.
  local   local steps: H = ``--every`` inner AdamW steps per worker, then each pseudo-gradient
          through group top-k with error feedback (runs of ``--run`` entries selected whole;
          ``--support leader``: one worker in turn picks the entries, every worker sends its
          values there), averaged (``--combine senders``: each entry over the workers that
          sent it, as SparseLoCo does), applied with ``--outer-lr``; ``--ef-decay`` scales the
          residual each round (SparseLoCo's error feedback in place of outer momentum);
          ``--restart residual``: each worker goes on from the shared model plus its own unsent
          residual, not from the shared model alone. ``--lose-at N``: rank 0 is lost after
          step N and resumes a step later from rank 1's model and inner optimizer, as from a
          surviving node's keeper, with the residual ``--lost-residual`` names (issue 48).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rayzip.bench import provenance
from rayzip.codecs.dct_quant import dct_matrix
from rayzip.torch.lr import cosine_lr
from rayzip.torch.muon import MuonWithAdamW
from rayzip.train.gpt import GPT, lm_loss
from rayzip.train.text import ShardSampler, Windows, load_python_stdlib

PEAK_LR, BETAS, DECAY, WARMUP, CLIP = 0.002, (0.9, 0.95), 0.1, 20, 1.0  # jobs/bench-gpt.yaml at 2 workers
VALUE_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2, "sign": 1, "lv2": 2}
LEVEL_ROWS = 64  # lv2 sends two fp16 levels per this many rows


class Tiles:
    """Orthonormal DCT of a parameter in h x w tiles (a vector: in runs of w)."""

    def __init__(self, shape, chunk: int):
        self.shape = tuple(shape)
        if len(shape) == 2:
            self.h, self.w = min(chunk, shape[0]), min(chunk, shape[1])
        else:
            self.h, self.w = 1, min(chunk, math.prod(shape))
        self.ch, self.cw = (torch.from_numpy(dct_matrix(n)).float() for n in (self.h, self.w))

    def encode(self, x):  # -> (tiles, h * w)
        if len(self.shape) == 2:
            r, c = self.shape
            t = torch.einsum("yhxw,ah,bw->yxab", x.reshape(r // self.h, self.h, c // self.w, self.w), self.ch, self.cw)
            return t.reshape(-1, self.h * self.w)
        return x.reshape(-1, self.w) @ self.cw.T

    def decode(self, t):
        if len(self.shape) == 2:
            r, c = self.shape
            t = torch.einsum("yxab,ah,bw->yhxw", t.reshape(r // self.h, c // self.w, self.h, self.w), self.ch, self.cw)
            return t.reshape(self.shape)
        return (t @ self.cw).reshape(self.shape)


def quantize(values: torch.Tensor, kind: str) -> torch.Tensor:
    """Each row's values as the wire would carry them."""
    if kind == "fp32":
        return values
    if kind == "bf16":
        return values.bfloat16().float()
    if kind == "sign":  # the sign, times the mean magnitude of 1024 values (whole rows)
        rows, k = values.shape
        per = max(1, 1024 // k)
        magnitude = F.pad(values.abs(), (0, 0, 0, (-rows) % per)).view(-1, per * k).mean(dim=1)
        return values.sign() * magnitude.repeat_interleave(per)[:rows, None]
    if kind == "lv2":  # learned 4 levels: the sign, and which of two magnitudes (split at the median)
        rows, k = values.shape
        blocks = F.pad(values.abs(), (0, 0, 0, (-rows) % LEVEL_ROWS)).view(-1, LEVEL_ROWS * k)
        cut = blocks.median(dim=1, keepdim=True).values
        high = blocks > cut
        low_level = (blocks * ~high).sum(1, keepdim=True) / (~high).sum(1, keepdim=True).clamp_min(1)
        high_level = (blocks * high).sum(1, keepdim=True) / high.sum(1, keepdim=True).clamp_min(1)
        magnitude = torch.where(high, high_level, low_level).view(-1, k)[:rows]
        return values.sign() * magnitude
    bits = int(kind[3:])  # intB: symmetric, one scale per row
    top = 2 ** (bits - 1) - 1
    scale = values.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / top
    return torch.round(values / scale) * scale


def value_bits(kind: str, k: int) -> float:
    """A kept value's bits on the wire; lv2's two levels are spread over the k kept entries of
    each of their LEVEL_ROWS rows."""
    return VALUE_BITS[kind] + (32 / (LEVEL_ROWS * k) if kind == "lv2" else 0)


def combined(total: torch.Tensor, senders: torch.Tensor, workers: int, how: str) -> torch.Tensor:
    """The workers' summed updates averaged: over every worker (``mean``), or each entry over
    the workers that sent it (``senders``, SparseLoCo's)."""
    return total / (workers if how == "mean" else senders.clamp_min(1))


def offset_bits(group: int, k: int) -> float:
    """What a kept entry's offset costs at best: log2 C(group, k) / k."""
    return math.log2(math.comb(group, k)) / k


def top_rows(rows: torch.Tensor, k: int, run: int = 1) -> torch.Tensor:
    """Each row's k largest entries, taken as whole runs of ``run`` consecutive entries."""
    if run == 1:
        return rows.abs().topk(k, dim=1, sorted=False).indices
    energy = rows.reshape(rows.shape[0], -1, run).pow(2).sum(-1)
    top = energy.topk(max(1, k // run), dim=1, sorted=False).indices
    return (top[..., None] * run + torch.arange(run)).reshape(rows.shape[0], -1)


def sparsify(flat: torch.Tensor, group: int, k: int, values: str, run: int = 1, idx=None):
    """``flat`` with all but each group's top k entries (or those at ``idx``) zeroed, the kept
    ones quantized; and the indices."""
    rows = F.pad(flat, (0, (-flat.numel()) % group)).view(-1, group)
    idx = top_rows(rows, k, run) if idx is None else idx
    kept = quantize(torch.gather(rows, 1, idx), values)
    return torch.zeros_like(rows).scatter_(1, idx, kept).reshape(-1)[:flat.numel()], idx


def flat_of(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def set_flat(tensors, flat: torch.Tensor, grad: bool) -> None:
    offset = 0
    for t in tensors:
        part = flat[offset:offset + t.numel()].view_as(t)
        if grad:
            t.grad = part.clone()
        else:
            t.data.copy_(part)
        offset += t.numel()


class Sim:
    def __init__(self, args):
        self.args = args
        text = load_python_stdlib(0.05)
        train, validation = Windows(text.train, 128), Windows(text.validation, 128)
        picks = torch.linspace(0, len(validation) - 1, 128).long().unique()
        self.vx = torch.stack([validation[int(i)][0] for i in picks])
        self.vy = torch.stack([validation[int(i)][1] for i in picks])
        torch.manual_seed(0)
        self.model = GPT(vocab=256, layers=4, width=384, heads=6, context=128)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.loaders = [iter(torch.utils.data.DataLoader(
            train, batch_size=16, sampler=ShardSampler(len(train), 16, r, args.workers, seed=0, start=0),
            generator=torch.Generator().manual_seed(0))) for r in range(args.workers)]
        self.curve: list[tuple[int, float, float]] = []
        self.start = time.time()

    def optimizer(self, model) -> torch.optim.Optimizer:
        """The job's AdamW, or (``--inner muon``) Muon on the hidden matrices with AdamW's settings."""
        if self.args.inner == "muon":
            return MuonWithAdamW(model, lr=PEAK_LR, betas=BETAS, weight_decay=DECAY)
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=PEAK_LR, betas=BETAS,
                                 weight_decay=DECAY)

    def lr(self, step: int) -> float:
        return cosine_lr(PEAK_LR, step, self.args.steps, WARMUP, 0.1)

    def gradient(self, model, rank: int) -> None:
        x, y = next(self.loaders[rank])
        model.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()

    @torch.no_grad()
    def evaluate(self, step: int) -> None:
        self.model.eval()
        total = 0.0
        for s in range(0, len(self.vx), 32):
            logits = self.model(self.vx[s:s + 32])
            total += F.cross_entropy(logits.reshape(-1, 256), self.vy[s:s + 32].reshape(-1), reduction="sum").item()
        self.model.train()
        value = total / self.vy.numel() / math.log(2)
        self.curve.append((step, value, time.time() - self.start))
        print(f"step {step} val {value:.4f} ({time.time() - self.start:.0f} s)", flush=True)

    def last_step(self) -> int:
        return min(self.args.steps, self.args.stop_at or self.args.steps)

    def due(self, step: int) -> bool:
        return step % self.args.eval_every == 0 or step == self.last_step()

    # --- per-step methods: W gradients in, the update out ---------------------------------
    def run_per_step(self, exchange) -> None:
        optimizer = self.optimizer(self.model)
        for step in range(self.last_step()):
            lr = self.lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            grads = []
            for rank in range(self.args.workers):
                self.gradient(self.model, rank)
                grads.append(flat_of(p.grad for p in self.params))
            with torch.no_grad():
                applied = exchange(step, grads, lr)
                if not applied:  # the mean is in .grad: the user's clipping and AdamW
                    torch.nn.utils.clip_grad_norm_(self.params, CLIP)
                    optimizer.step()
            if self.due(step + 1):
                self.evaluate(step + 1)

    def apply(self, update: torch.Tensor, lr: float) -> bool:
        """p -= lr * (update + decay * p): a step taken by the method itself."""
        for p in self.params:
            p.mul_(1 - lr * DECAY)
        set_flat(self.params, flat_of(self.params) - lr * update, grad=False)
        return True

    def dense(self):
        def exchange(step, grads, lr):
            set_flat(self.params, sum(grads) / len(grads), grad=True)
            return False
        return exchange, 1.0

    def demo(self):
        a = self.args
        tiles = [Tiles(p.shape, a.chunk) for p in self.params]
        deltas = [[torch.zeros_like(p) for p in self.params] for _ in range(a.workers)]
        bits = sum(p.numel() // (t.h * t.w) * min(a.topk, t.h * t.w) * (VALUE_BITS[a.values] + math.log2(t.h * t.w))
                   for p, t in zip(self.params, tiles))

        def exchange(step, grads, lr):
            means = []
            for i, (p, t) in enumerate(zip(self.params, tiles)):
                total = 0
                for rank in range(a.workers):
                    g = grads[rank]
                    offset = sum(q.numel() for q in self.params[:i])
                    delta = deltas[rank][i].mul_(a.beta).add_(g[offset:offset + p.numel()].view_as(p))
                    coefficients = t.encode(delta)
                    idx = coefficients.abs().topk(min(a.topk, coefficients.shape[1]), dim=1, sorted=False).indices
                    kept = torch.zeros_like(coefficients).scatter_(
                        1, idx, quantize(torch.gather(coefficients, 1, idx), a.values))
                    delta.sub_(t.decode(kept))
                    total = total + kept
                means.append(t.decode(total / a.workers).reshape(-1))
            mean = torch.cat(means)
            if a.update == "sign":
                return self.apply(mean.sign(), lr)
            set_flat(self.params, mean, grad=True)
            return False
        return exchange, self.numel * 32 / bits

    def topk(self):
        a = self.args
        k = max(1, math.ceil(a.density * a.group))
        residuals = [torch.zeros(self.numel) for _ in range(a.workers)]
        moments = [(torch.zeros(self.numel), torch.zeros(self.numel)) for _ in range(a.workers)]
        bits = self.numel / a.group * k * (value_bits(a.values, k) + offset_bits(a.group, k))

        def exchange(step, grads, lr):
            total, senders = 0, 0
            for rank in range(a.workers):
                g = grads[rank]
                if a.memory == "adam":  # each worker's own Adam direction (adam_correction)
                    m, v = moments[rank]
                    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                    t = step + 1
                    g = (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + 1e-8)
                compensated = g + a.ef_decay * residuals[rank]
                sent, _ = sparsify(compensated, a.group, k, a.values)
                residuals[rank] = compensated - sent
                total = total + sent
                senders = senders + (sent != 0)
            mean = combined(total, senders, a.workers, a.combine)
            if a.memory == "adam":
                return self.apply(mean, lr)
            set_flat(self.params, mean, grad=True)
            return False
        return exchange, self.numel * 32 / bits

    def stale(self):
        a = self.args
        blocks = -(-self.numel // a.block)
        phase = torch.arange(blocks) % a.period
        windows = [torch.zeros(blocks, a.block) for _ in range(a.workers)]
        held = torch.zeros(blocks, a.block)
        bits = self.numel / a.period * (VALUE_BITS[a.values] + 32 / a.block)

        def exchange(step, grads, lr):
            due = phase == step % a.period
            total = torch.zeros(int(due.sum()), a.block)
            for rank in range(a.workers):
                windows[rank] += F.pad(grads[rank], (0, blocks * a.block - self.numel)).view(blocks, a.block)
                sent = quantize(windows[rank][due], a.values)
                windows[rank][due] -= sent  # the quantization error waits for the next window
                total += sent
            held[due] = total / (a.workers * a.period)
            set_flat(self.params, held.reshape(-1)[:self.numel], grad=True)
            return False
        return exchange, self.numel * 32 / bits

    # --- local steps ----------------------------------------------------------------------
    def run_local(self) -> float:
        a = self.args
        k = max(1, math.ceil(a.density * a.group))
        offsets = offset_bits(a.group, k) if a.run == 1 else offset_bits(a.group // a.run, k // a.run) / a.run
        # A shared support: one worker (in turn) sends the offsets, every worker the values.
        per_entry = value_bits(a.values, k) + (offsets / a.workers if a.support == "leader" else offsets)
        ratio = 32 * a.every / (a.density * per_entry)
        workers = [copy.deepcopy(self.model) for _ in range(a.workers)]
        inner = [[p for p in w.parameters() if p.requires_grad] for w in workers]
        optimizers = [self.optimizer(w) for w in workers]
        residuals = [torch.zeros(self.numel) for _ in range(a.workers)]
        # ``--lost-residual estimate``: what a persisted checkpoint and the payloads every rank
        # holds know; kept only for it.
        estimating = bool(a.lose_at) and a.lost_residual == "estimate"
        saved = [torch.zeros(self.numel) for _ in range(a.workers)]
        sent_since = [torch.zeros(self.numel) for _ in range(a.workers)]
        rounds_since = rounds = 0
        self.copy = torch.zeros(self.numel)  # ``--lost-residual copied``: rank 0's, on another node
        for step in range(self.last_step()):
            if a.lose_at and step == a.lose_at + 1:
                # Rank 0's node is lost after step ``lose_at``; it resumes from the survivor's
                # snapshot one step later, with the survivor's inner model and optimizer.
                workers[0].load_state_dict(workers[1].state_dict())
                optimizers[0].load_state_dict(optimizers[1].state_dict())
                residuals[0] = self.lost_residual(residuals, saved, sent_since, rounds_since)
            for rank in range(a.workers):
                for group in optimizers[rank].param_groups:
                    group["lr"] = self.lr(step)
                self.gradient(workers[rank], rank)
                torch.nn.utils.clip_grad_norm_(inner[rank], CLIP)
                optimizers[rank].step()
            if (step + 1) % a.every and step + 1 != self.last_step():
                continue
            with torch.no_grad():
                start = flat_of(self.params)
                total, idx, senders = 0, None, 0
                leader = ((step + 1) // a.every) % a.workers
                order = [leader] + [r for r in range(a.workers) if r != leader]
                for rank in order:
                    compensated = start - flat_of(inner[rank])
                    if a.restart == "global":  # else the residual is in the worker's weights already
                        compensated += a.ef_decay * residuals[rank]
                    sent, chosen = sparsify(compensated, a.group, k, a.values, a.run, idx)
                    if a.support == "leader":
                        idx = chosen
                    residuals[rank] = compensated - sent
                    if estimating:
                        sent_since[rank] = a.ef_decay * sent_since[rank] + sent
                    if rank == 0:
                        self.copy_after_round(rounds, residuals[0], sent)
                    total = total + sent
                    senders = senders + (sent != 0)
                set_flat(self.params, start - a.outer_lr * combined(total, senders, a.workers, a.combine),
                         grad=False)
                rounds_since += 1
                rounds += 1
                if estimating and a.checkpoint_every and (step + 1) % a.checkpoint_every == 0:
                    saved = [r.clone() for r in residuals]
                    sent_since = [torch.zeros(self.numel) for _ in range(a.workers)]
                    rounds_since = 0
                shared = flat_of(self.params)
                for rank, ps in enumerate(inner):
                    # ``--restart residual``: a worker goes on from the shared model plus what it
                    # has not yet sent, so its own next gradients see its unsent updates.
                    # The fading error feedback fades it there.
                    if a.restart == "residual":
                        set_flat(ps, shared - a.ef_decay * residuals[rank], grad=False)
                    else:
                        for p, q in zip(ps, self.params):
                            p.copy_(q)
            if self.due(step + 1):
                self.evaluate(step + 1)
        return ratio

    def copy_after_round(self, rounds: int, residual: torch.Tensor, sent: torch.Tensor) -> None:
        """``--lost-residual copied``: every ``--copy-every`` rounds, each group's largest
        ``--copied-density`` of rank 0's residual (bf16) is copied to another node; between
        copies the copy is kept current from what every rank holds: it fades as the residual
        does, and the entries rank 0 sends are cleared (their residual is a rounding error)."""
        a = self.args
        if a.lost_residual != "copied":
            return
        if rounds % a.copy_every == 0:
            keep = max(1, math.ceil(a.copied_density * a.group))
            self.copy = sparsify(residual, a.group, keep, "bf16")[0]
        else:
            self.copy.mul_(a.ef_decay)[sent != 0] = 0

    def lost_residual(self, residuals, saved, sent_since, rounds_since) -> torch.Tensor:
        """Rank 0's residual after its node was lost (``--lost-residual``): none, the
        survivor's, its own (the oracle), a partial copy kept on another node
        (:meth:`copy_after_round`), or an estimate: its residual at the last
        persisted checkpoint (``--checkpoint-every``; 0: the run's start) carried forward with
        the survivor's pseudo-gradients in place of its own, less what it sent since (every
        rank holds every payload):
        e0 ~ e1 + decay^k (e0_saved - e1_saved) + sum decay^(k-j) (sent1_j - sent0_j)."""
        how = self.args.lost_residual
        if how == "exact":
            return residuals[0]
        if how == "copied":
            return self.copy.clone()
        if how == "empty":
            return torch.zeros(self.numel)
        if how == "survivor":
            return residuals[1].clone()
        carried = self.args.ef_decay ** rounds_since
        return residuals[1] + carried * (saved[0] - saved[1]) + sent_since[1] - sent_since[0]


def table(path: str) -> str:
    """The rows of ``path`` as markdown, each against dense training with the workers' own
    optimizer (the row ``dense``, AdamW; or ``dense, Muon inside`` for ``--inner muon``) and
    against AdamW's."""
    rows = json.loads(Path(path).read_text())["rows"]
    dense = {inner: {s: v for s, v, _ in rows[label]["curve"]}
             for inner, label in (("adamw", "dense"), ("muon", "dense, Muon inside")) if label in rows}

    def versus(value: float, ddp: float | None) -> str:
        return f"{(value / ddp - 1) * 100:+.1f}%" if ddp else "–"

    lines = ["| method | fewer bytes than fp32 | last step | val bpb there | "
             "DDP's there, same optimizer | vs it | vs AdamW DDP |",
             "|---|---|---|---|---|---|---|"]
    for label, row in rows.items():
        step, value, _ = row["curve"][-1]
        inner = row["args"].get("inner", "adamw")
        same, adamw = dense.get(inner, {}).get(step), dense.get("adamw", {}).get(step)
        lines.append(f"| {label} | {row['wire_reduction']:.0f}× | {step} | {value:.4f} | "
                     f"{f'{same:.4f}' if same else '–'} | {versus(value, same)} | {versus(value, adamw)} |")
    return "\n".join(lines)


def plot(path: str, out: str) -> None:
    """Validation loss against step, every row of ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(path).read_text())["rows"]
    fig, ax = plt.subplots(figsize=(12, 5), dpi=120)
    palette = plt.cm.tab20.colors
    for i, (label, row) in enumerate(rows.items()):
        steps, values = zip(*[(s, v) for s, v, _ in row["curve"]])
        dense = row["method"] == "dense"  # DDP under AdamW, and under Muon: black, bold
        ax.plot(steps, values, marker=".", label=f"{label} ({row['wire_reduction']:.0f}x)",
                linewidth=2.5 if dense else 1.2, color="black" if dense else palette[i % 20],
                linestyle=":" if dense and row["args"].get("inner") == "muon" else
                "--" if row["method"] == "local" else "-")
    ax.set_ylim(top=6.0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (bits/byte)")
    ax.set_title("GPT, 2 workers simulated in one process")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", nargs="?", choices=["dense", "demo", "topk", "stale", "local"])
    ap.add_argument("--steps", type=int, default=200, help="the schedule's length")
    ap.add_argument("--stop-at", type=int, default=None, help="end the run at this step")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.999)
    ap.add_argument("--values", default="bf16", choices=sorted(VALUE_BITS))
    ap.add_argument("--update", default="adamw", choices=["adamw", "sign"])
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--group", type=int, default=1024)
    ap.add_argument("--memory", default="ef", choices=["ef", "adam"])
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--run", type=int, default=1)
    ap.add_argument("--support", default="own", choices=["own", "leader"],
                    help="local: each worker's own top k, or the leader's (in turn) for every worker")
    ap.add_argument("--ef-decay", type=float, default=1.0,
                    help="local, topk: the residual is scaled by this before the next input joins it")
    ap.add_argument("--combine", default="mean", choices=["mean", "senders"],
                    help="local, topk: average each entry over every worker, or over those that sent it")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--restart", default="global", choices=["global", "residual"],
                    help="local: after a round each worker restarts from the shared model, or from "
                         "the shared model less its own unsent residual (the error feedback kept in "
                         "the worker's weights)")
    ap.add_argument("--inner", default="adamw", choices=["adamw", "muon"],
                    help="the workers' optimizer (dense and local): the job's AdamW, or Muon on the hidden "
                         "matrices with AdamW's settings (rayzip.torch.muon)")
    ap.add_argument("--lose-at", type=int, default=0,
                    help="local: rank 0 is lost after this step and resumes one step later from rank 1's "
                         "snapshot (issue 48's node loss)")
    ap.add_argument("--lost-residual", default="empty", choices=["empty", "survivor", "exact", "estimate", "copied"],
                    help="local, --lose-at: the residual rank 0 resumes with")
    ap.add_argument("--copied-density", type=float, default=0.1,
                    help="local, --lost-residual copied: the share of rank 0's residual copied to another "
                         "node (each group's largest entries, bf16)")
    ap.add_argument("--copy-every", type=int, default=1,
                    help="local, --lost-residual copied: rounds between copies")
    ap.add_argument("--checkpoint-every", type=int, default=52,
                    help="local, --lose-at: the persisted checkpoint the estimate starts from")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--label", default=None)
    ap.add_argument("--json", default=None, help="add this run's row to this file")
    ap.add_argument("--table", default=None, help="print the rows of this file as markdown, and stop")
    ap.add_argument("--plot", default=None, help="with --table: also plot the curves to this PNG")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        if args.plot:
            plot(args.table, args.plot)
        return
    if args.method is None:
        ap.error("name a method, or --table FILE")
    torch.set_num_threads(1)
    sim = Sim(args)
    if args.method == "local":
        ratio = sim.run_local()
    else:
        exchange, ratio = getattr(sim, args.method)()
        sim.run_per_step(exchange)
    row = {"method": args.method, "args": vars(args), "wire_reduction": ratio, "curve": sim.curve, **provenance()}
    print(json.dumps({"label": args.label, "final": sim.curve[-1], "wire_reduction": ratio}))
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {"rows": {}}
        data["rows"][args.label or args.method] = row
        data.update(commit=row["commit"], date=row["date"])  # the newest row's
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
