"""rayzip inside Ray Train workers: the API for your own ``train_func`` (``prepare_model``,
``report``, ``restore``, ``Telemetry``), the context a spec-named loop receives
(``LoopContext``), and the built-in tasks, data and models that ``rayzip run`` uses.

Usage::

    import rayzip.train
    model = rayzip.train.prepare_model(model, optimizer="adamw")   # the compression that holds AdamW's quality
"""

from importlib import import_module

# Every name is loaded when first asked for: the API and the loop import Ray Train, and the
# package's other modules (checkpoints, the GPT, the text data) are used where Ray is not.
_WHERE = {"CompressionConfig": "api", "compression_state": "api", "flush": "api", "keep_snapshots": "api",
          "prepare_model": "api", "report": "api", "restore": "api", "save_checkpoint": "api", "snapshot": "api",
          "ShardingConfig": "api", "LocalStepsConfig": "api", "StepRecord": "records", "Totals": "records", "Traffic": "records",
          "Telemetry": "telemetry", "LoopContext": "loop", "Faults": "faults"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rayzip.train' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["CompressionConfig", "Faults", "LocalStepsConfig", "LoopContext", "ShardingConfig", "StepRecord", "Telemetry", "Totals", "Traffic",
           "compression_state", "flush", "keep_snapshots", "prepare_model", "report", "restore", "save_checkpoint",
           "snapshot"]
