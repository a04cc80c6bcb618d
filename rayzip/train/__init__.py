"""rayzip inside Ray Train workers: the API for your own ``train_func`` (``prepare_model``,
``report``, ``restore``, ``Telemetry``), the context a spec-named loop receives
(``LoopContext``), and the built-in tasks, data and models that ``rayzip run`` uses.

Usage::

    import rayzip.train
    model = rayzip.train.prepare_model(model, compression=rayzip.train.CompressionConfig(codec="group_topk"))
"""

from .api import CompressionConfig, compression_state, flush, prepare_model, report, restore, save_checkpoint
from .records import StepRecord, Totals, Traffic
from .telemetry import Telemetry


def __getattr__(name: str):
    # The loop imports Ray Train's torch integration and every task: loaded when asked for.
    if name == "LoopContext":
        from .loop import LoopContext

        return LoopContext
    raise AttributeError(name)


__all__ = ["CompressionConfig", "LoopContext", "StepRecord", "Telemetry", "Totals", "Traffic", "compression_state",
           "flush", "prepare_model", "report", "restore", "save_checkpoint"]
