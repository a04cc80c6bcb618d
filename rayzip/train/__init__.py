"""rayzip inside Ray Train workers: the API for your own ``train_func`` (``prepare_model``,
``report``, ``restore``), and the built-in loop, data and models that ``rayzip run`` uses.

Usage::

    import rayzip.train
    model = rayzip.train.prepare_model(model, compression=rayzip.train.CompressionConfig(codec="group_topk"))
"""

from .api import CompressionConfig, compression_state, prepare_model, report, restore, save_checkpoint

__all__ = ["CompressionConfig", "compression_state", "prepare_model", "report", "restore", "save_checkpoint"]
