"""Muon for a model's hidden matrices and AdamW for the rest, as one optimizer.

Muon (Jordan et al. 2024) orthogonalizes each weight matrix's momentum with a few
Newton-Schulz iterations before stepping. It is meant for the hidden layers' 2-D weights
only: embeddings, a head tied to them, norms and biases keep AdamW (the recipe of Muon's
authors and of Moonlight). Torch's own ``torch.optim.Muon`` does the matrices, with
``adjust_lr_fn="match_rms_adamw"`` (Moonlight's scaling: each update's RMS made AdamW's), so
one learning rate, schedule and weight decay serve both parts and a spec tuned for AdamW
carries over unchanged.

The two inner optimizers share this one's ``param_groups`` and ``state``, so learning-rate
schedules, ``zero_grad``, ``state_dict`` and ``load_state_dict`` (checkpoints, snapshots)
see one optimizer.

Usage::

    optimizer = MuonWithAdamW(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    loss.backward()
    optimizer.step()
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MuonWithAdamW", "muon_parameters"]


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters Muon steps (2-D weights that no ``nn.Embedding`` holds,
    so a head tied to an embedding stays out) and those AdamW steps (the rest), each in the
    model's order, each parameter once."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices, rest = [], []
    for p in model.parameters():  # a shared (tied) parameter comes once
        if p.requires_grad:
            (matrices if p.dim() == 2 and id(p) not in embedded else rest).append(p)
    return matrices, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on ``model``'s hidden matrices, AdamW on its other parameters (:func:`muon_parameters`).

    Args:
        model: the module whose trainable parameters are stepped.
        lr: the learning rate of both parts (Muon's is scaled to match AdamW's update RMS).
        betas: AdamW's betas; Muon's momentum is ``betas[0]`` unless ``momentum`` is given.
        weight_decay: decoupled weight decay of both parts.
        momentum: Muon's momentum (Nesterov), by default AdamW's first beta.
        fused: AdamW's fused kernel, where torch has it for the parameters.

    Example::

        optimizer = MuonWithAdamW(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        for group in optimizer.param_groups:   # one schedule for both parts
            group["lr"] = 5e-4
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.1, momentum: float | None = None, fused: bool | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError("MuonWithAdamW takes the model (to tell its embeddings from its hidden matrices), "
                            f"not {type(model).__name__}")
        matrices, rest = muon_parameters(model)
        if not matrices:
            raise ValueError("muon: the model has no hidden 2-D weight for Muon to step; use adamw")
        self._parts: list[torch.optim.Optimizer] = [torch.optim.Muon(
            matrices, lr=lr, weight_decay=weight_decay, momentum=betas[0] if momentum is None else momentum,
            nesterov=True, adjust_lr_fn="match_rms_adamw")]
        if rest:
            self._parts.append(torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused))
        super().__init__([g for o in self._parts for g in o.param_groups], {"lr": lr})
        self._share()

    def _share(self) -> None:
        """Point the parts at this optimizer's groups and state (after a load too, which
        replaces both)."""
        groups = iter(self.param_groups)
        for part in self._parts:
            part.param_groups = [next(groups) for _ in part.param_groups]
            part.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        return loss
