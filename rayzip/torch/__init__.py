"""rayzip for your own torch DDP training loop: compression in two lines.

Usage::

    import rayzip.torch

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    exchange = rayzip.torch.compress(ddp, rayzip.torch.CompressionConfig(codec="group_topk", density=0.01))
"""

from ..engine import CompressionConfig, GradientExchange, StepStats
from .hook import compress, compressed_hook, ddp_kwargs
from .lr import cosine_lr, learning_rate, scaled_lr

__all__ = ["CompressionConfig", "GradientExchange", "StepStats", "compress", "compressed_hook", "cosine_lr",
           "ddp_kwargs", "learning_rate", "scaled_lr"]
