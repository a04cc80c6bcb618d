"""`rayzip submit` refuses a working directory with credentials before it contacts any
cluster (issue 16): the command itself, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_submit_refuses_before_contacting_any_cluster(tmp_path):
    src = tmp_path / "code"
    _tree(src, {"train.py": "", ".env": "AWS_SECRET_ACCESS_KEY=x\n"})
    spec = tmp_path / "job.yaml"
    spec.write_text("name: tiny\n")
    env = {**os.environ, "RAY_ADDRESS": "http://127.0.0.1:9"}  # nothing listens there
    result = subprocess.run([sys.executable, "-m", "rayzip", "submit", str(spec), "--working-dir", str(src)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to ship .env" in result.stdout
