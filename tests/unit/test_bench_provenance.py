"""A benchmark's JSON names the commit it ran, and says when the tree had changes beyond it."""

import re
import subprocess

from rayzip.bench import provenance


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_the_commit_is_marked_dirty_only_while_tracked_files_differ(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYZIP_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    clean = provenance(tmp_path)["commit"]
    assert re.fullmatch(r"[0-9a-f]{40}", clean)
    (tmp_path / "new.txt").write_text("untracked\n")  # not part of what ran from git's view
    assert provenance(tmp_path)["commit"] == clean
    (tmp_path / "a.txt").write_text("two\n")
    assert provenance(tmp_path)["commit"] == clean + "-dirty"


def test_a_copy_outside_its_checkout_takes_the_commit_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYZIP_COMMIT", "abc123")
    assert provenance(tmp_path)["commit"] == "abc123"
    monkeypatch.delenv("RAYZIP_COMMIT")
    assert provenance(tmp_path)["commit"] == "unknown"  # no checkout there
