"""`rayzip bench encoder`'s offline task and its table (issue 46); the fine-tuning itself
needs transformers and the weights' package, and runs as the benchmark."""

from __future__ import annotations

from rayzip.bench import markdown_table
from rayzip.bench.encoder import PACKAGES, docstring_task


def test_the_task_is_fixed_by_the_texts_and_covers_every_package():
    train, validation = docstring_task()
    again = docstring_task()
    assert (train, validation) == again  # no randomness: the same split on every machine with this Python
    assert {label for _, label in train} == set(range(len(PACKAGES))) == {label for _, label in validation}
    assert 0.1 < len(validation) / (len(train) + len(validation)) < 0.3
    assert not {text for text, _ in train} & {text for text, _ in validation}  # split by the text itself
    assert all(20 <= len(text) <= 400 for text, _ in train + validation)


def test_the_report_renders_as_the_page_shows_it():
    rows = [{"setting": "dense", "codec": "none", "accuracy": 0.7, "wire_reduction": 1.0, "median_clip_norm": 2.0,
             "points_vs_dense": 0.0, "clip_norm_vs_dense": 1.0},
            {"setting": "default", "codec": "dct_quant", "accuracy": 0.695, "wire_reduction": 7.1,
             "median_clip_norm": 2.1, "points_vs_dense": -0.5, "clip_norm_vs_dense": 1.05}]
    table = markdown_table({"bench": "encoder", "rows": rows})
    assert table.splitlines()[2] == "| dense | none | 0.7000 | +0.0 pt | 1.0× | 2 | 1.00× |"
    assert table.splitlines()[3] == "| default | dct_quant | 0.6950 | -0.5 pt | 7.1× | 2.1 | 1.05× |"
