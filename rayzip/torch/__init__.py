"""rayzip for your own torch DDP training loop: compression in two lines.

Usage::

    import rayzip.torch
    from rayzip.spec import CompressionSpec

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = rayzip.torch.compress(ddp, CompressionSpec(codec="group_topk", ratio=0.01))
"""

from ..spec import CompressionSpec
from .hook import CompressionState, StepStats, compress, compressed_hook, ddp_kwargs
from .lr import cosine_lr, learning_rate, scaled_lr

__all__ = ["CompressionSpec", "CompressionState", "StepStats", "compress", "compressed_hook", "cosine_lr", "ddp_kwargs",
           "learning_rate", "scaled_lr"]
