"""The language-model page's screening table is tools/sim_gpt.py's rendering of its JSON (issue 46):
no typed figures there either."""

from __future__ import annotations

import importlib.util
import json
import re

from paths import ROOT

PAGE = ROOT / "docs" / "benchmarks" / "language-model.md"
MARKER = re.compile(r"<!-- table from tools/sim_gpt\.py --table (\S+\.json) -->\n((?:\|.*\|\n)+)")


def _sim():
    spec = importlib.util.spec_from_file_location("sim_gpt", ROOT / "tools" / "sim_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_screening_table_is_the_rendered_json():
    found = MARKER.findall(PAGE.read_text())
    assert len(found) == 1, "the page shows the screening table once, under its marker"
    source, table = found[0]
    assert table.strip() == _sim().table(str(ROOT / source)).strip(), \
        f"regenerate with: python tools/sim_gpt.py --table {source}"


def test_the_screening_json_names_its_commit_date_and_dense_row():
    source = MARKER.findall(PAGE.read_text())[0][0]
    data = json.loads((ROOT / source).read_text())
    assert {"commit", "date", "rows"} <= set(data) and "dense" in data["rows"]
    for row in data["rows"].values():
        assert {"commit", "date", "curve", "wire_reduction", "args"} <= set(row)
