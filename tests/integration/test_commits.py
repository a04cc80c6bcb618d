"""Commit subjects a history can be scanned by (issue 45): from the first commit of the docs
issue on, each subject is at most 72 characters, starts with an area prefix
(``hook: ``, ``ckpt, docs: ``) and then an imperative verb in lower case."""

from __future__ import annotations

import re
import subprocess

import pytest

from paths import ROOT

FIRST = "be9c832"  # bench: name the cluster tables' column wire reduction
SUBJECT = re.compile(r"^[a-z0-9_./-]+(, [a-z0-9_./-]+)*: [a-z]")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_every_subject_since_the_rule_is_short_and_prefixed():
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: no history to check")
    if _git("cat-file", "-e", f"{FIRST}^{{commit}}").returncode != 0:
        pytest.skip(f"a shallow clone: commit {FIRST} is not in its history")
    subjects = _git("log", "--no-merges", "--format=%h %s", f"{FIRST}^..HEAD").stdout.splitlines()
    assert subjects, "no commits since the rule"
    bad = [line for line in subjects
           if len(line.split(" ", 1)[1]) > 72 or not SUBJECT.match(line.split(" ", 1)[1])]
    assert not bad, "subjects over 72 characters or without an area prefix:\n" + "\n".join(bad)
