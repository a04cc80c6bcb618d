"""The optimizer a job spec's ``training`` section names, for workers and parameter shards alike.

Any object with the settings of :class:`OptimizerSettings` will do (the job spec's
``TrainingSpec`` is one): this module does not import the spec.

Usage::

    optimizer = build_optimizer(spec.training, model)    # or model.parameters(), but for muon
    load_optimizer(optimizer, saved)  # a checkpoint's state, keeping this run's settings
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..xp import is_dtensor

__all__ = ["OptimizerSettings", "adaptive", "build_optimizer", "build_outer_optimizer", "default_compression",
           "fused_where_possible", "load_optimizer", "warn_for_optimizer"]

# Optimizers that scale each entry by its own running statistics (Adam's family and its
# relatives): a gradient entry held back for a few steps and sent at once is mis-scaled by
# them. By class and by the names a job spec or a user gives.
ADAPTIVE = tuple(getattr(torch.optim, name) for name in
                 ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Adafactor")
                 if hasattr(torch.optim, name))
# MuonWithAdamW is one of them: its AdamW part steps the embeddings, head and norms.
ADAPTIVE_NAMES = {cls.__name__.lower() for cls in ADAPTIVE} | {"muon"}


class OptimizerSettings(Protocol):
    """What :func:`build_optimizer` reads."""

    optimizer: str  # sgd, adam, adamw or muon
    lr: float
    momentum: float
    betas: tuple[float, float]
    weight_decay: float


def build_outer_optimizer(params, lr: float, momentum: float, nesterov: bool) -> torch.optim.SGD:
    """Local steps' outer optimizer (DiLoCo's): SGD on the pseudo-gradients, with Nesterov
    momentum where there is momentum to apply it to."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=bool(nesterov and momentum > 0))


def build_optimizer(training: OptimizerSettings, params, momentum_elsewhere: bool = False,
                    adam_elsewhere: bool = False) -> torch.optim.Optimizer:
    """SGD (with the spec's momentum, or none when ``momentum_elsewhere``: momentum correction
    keeps it on the workers), Adam, AdamW, or Muon on the hidden matrices with AdamW on the
    rest (:class:`~rayzip.torch.muon.MuonWithAdamW`, AdamW's settings for both), at the spec's
    base learning rate. With ``adam_elsewhere`` (Adam correction: the hook sends each worker's
    AdamW direction), SGD without momentum whose L2 term is AdamW's decoupled decay:
    ``p -= lr * (d + wd * p)``. Fused where torch has the kernel (:func:`fused_where_possible`).

    ``params`` is the model or its parameters; muon needs the model, to tell its embeddings
    from its hidden matrices."""
    if training.optimizer == "muon":
        from .muon import MuonWithAdamW

        if momentum_elsewhere or adam_elsewhere:
            raise ValueError("momentum and Adam correction move SGD's or AdamW's state into the hook; "
                             "training.optimizer muon has none there")
        if not isinstance(params, torch.nn.Module):
            raise TypeError("training.optimizer muon needs the model, not its parameters: "
                            "build_optimizer(training, model)")
        return MuonWithAdamW(params, lr=training.lr, betas=tuple(training.betas),
                             weight_decay=training.weight_decay)
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    if adam_elsewhere:
        return fused_where_possible(torch.optim.SGD, params, lr=training.lr, momentum=0.0,
                                    weight_decay=training.weight_decay)
    if training.optimizer == "sgd":
        momentum = 0.0 if momentum_elsewhere else training.momentum
        return fused_where_possible(torch.optim.SGD, params, lr=training.lr, momentum=momentum,
                                    weight_decay=training.weight_decay)
    cls = torch.optim.Adam if training.optimizer == "adam" else torch.optim.AdamW
    return fused_where_possible(cls, params, lr=training.lr, betas=tuple(training.betas),
                                weight_decay=training.weight_decay)


def fused_where_possible(cls: type[torch.optim.Optimizer], params, **settings) -> torch.optim.Optimizer:
    """``cls(params, fused=True, **settings)``: one vectorized kernel over all the tensors.
    On CPU torch's default is a loop of per-tensor ops (AdamW over the 7.25M-parameter GPT:
    14.2 ms a step against 4.7 ms fused, one thread). Torch's default where the fused kernel
    cannot take the parameters (sparse or integer tensors, other devices, torch before 2.4 on
    CPU), and for a sharded model's DTensors: some fused kernels (SGD's) have no sharding rule,
    which only the first step would find."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    if tensors and all(p.is_floating_point() and p.layout == torch.strided and p.device.type in ("cpu", "cuda")
                       and not is_dtensor(p) for p in tensors):
        try:
            return cls(params, fused=True, **settings)
        except RuntimeError:  # this torch has no fused kernel for these parameters
            pass
    return cls(params, **settings)


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """``optimizer.load_state_dict(saved)``, keeping this run's momentum: the saved param
    groups carry theirs, which lives in the hook (momentum correction) or in the optimizer
    depending on the world size that saved them. This run's kernel choice (``fused``,
    ``foreach``) is kept too: a checkpoint saved without the fused kernel does not turn it off."""
    kept = [{k: group[k] for k in ("momentum", "fused", "foreach")
             if k in group and (k != "momentum" or group[k] is not None)}
            for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, values in zip(optimizer.param_groups, kept):
        group.update(values)


def adaptive(optimizer: torch.optim.Optimizer | str | None) -> bool:
    """Whether ``optimizer`` (or its name) scales each entry by its own running statistics:
    Adam's family, Adagrad, RMSprop, Adafactor and the like, and rayzip's Muon (AdamW steps
    its embeddings and norms). Plain SGD is not; nor is an optimizer rayzip does not know."""
    from .muon import MuonWithAdamW

    if isinstance(optimizer, str):
        return optimizer.lower() in ADAPTIVE_NAMES
    return isinstance(optimizer, (*ADAPTIVE, MuonWithAdamW))


def default_compression(optimizer: torch.optim.Optimizer | str | None, sharded: bool = False):
    """The per-step gradient compression that holds quality under ``optimizer`` (an
    optimizer, or its name), for :func:`rayzip.torch.compress` when it is given the optimizer
    and no config (and :func:`rayzip.train.prepare_model` under SGD, or with sharding; under an
    adaptive optimizer it otherwise compresses each rank's own update instead, see its
    ``compression``).

    - Under an adaptive optimizer (Adam, AdamW, Adagrad, RMSprop...): DCT every step
      (``dct_quant``), a quantizer that sends every entry every step, so the optimizer's
      per-entry statistics see what they would see under DDP; sparsifiers every step do not
      (docs/benchmarks/language-model.md). 4 bits on a replicated model's gradient, 8 bits on
      a sharded one's flat shards (``sharded``), where 4 bits cost a transformer's loss
      (docs/adr/0012-sharded-adamw-default-is-8-bit-dct.md).
    - Under SGD, or an optimizer rayzip does not know: group top-k at 1% with error feedback.

    The gradient your code sees after ``backward()`` is the decoded mean gradient under
    either: clipping, logging and ``GradScaler`` keep their meaning.

    Args:
        optimizer: the optimizer, or its name ("adamw", "sgd"...).
        sharded: the gradient is FSDP2's shards (:func:`rayzip.torch.fsdp.compress_sharded`).

    Example::

        config = default_compression("adamw")                # CompressionConfig(codec="dct_quant", bits=4)
        config = default_compression("adamw", sharded=True)  # CompressionConfig(codec="dct_quant", bits=8)
    """
    from ..engine import CompressionConfig

    if optimizer is None:
        raise ValueError("default_compression needs the optimizer, or its name (\"adamw\", \"sgd\"...)")
    if adaptive(optimizer):
        return CompressionConfig(codec="dct_quant", bits=8 if sharded else 4)
    return CompressionConfig(codec="group_topk", density=0.01)


def warn_for_optimizer(config, optimizer: torch.optim.Optimizer | str | None, stacklevel: int = 3) -> str | None:
    """Warn once where ``config`` (a :class:`~rayzip.engine.CompressionConfig`) sends a sparse
    gradient every step to an adaptive ``optimizer`` (:func:`adaptive`): Adam divides each
    entry by its own second moment, so the entries a sparsifier holds back for a few steps arrive as one
    large, badly scaled update, and a transformer's quality suffers. Returns the message."""
    if optimizer is None or not adaptive(optimizer) or config.codec not in ("topk", "randomk", "group_topk"):
        return None
    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    message = (f"codec {config.codec} sends a sparse gradient every step, which costs a transformer's quality "
               f"under {name}: for an adaptive optimizer compress each step with codec='dct_quant' (bits=4, what "
               "rayzip.torch.compress picks for it), or sparsify what each rank's own optimizer moved rather than "
               "its gradient, with local steps: rayzip.train.prepare_model's default for it (give it the optimizer "
               "and no config) sends group top-k that way every step, and rayzip.torch.LocalSteps does in your "
               "own loop. See the codecs guide, 'Under Adam and AdamW'.")
    if config.adam_correction:
        message += (" With adam_correction the hook sends Adam's direction and your code sees it after "
                    "backward(), not a gradient: clip_grad_norm_ there scales every update down.")
    import warnings

    warnings.warn(message, UserWarning, stacklevel=stacklevel)
    return message
