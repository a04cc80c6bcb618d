"""The documentation builds, and its examples work (issue 45).

- The site (`mkdocs.yml`, `docs/`) builds in strict mode: a warning, a broken link or anchor,
  or a docstring the API reference cannot read fails.
- Every code block of the README and the docs is checked by what it is:
  - Python runs, in a process of its own (a block that calls ``dist.init_process_group``
    runs as two real gloo ranks); a block marked ``<!-- excerpt of PATH -->`` must be lines
    of PATH, in order, and PATH is run by its own test;
  - a YAML block marked ``<!-- job spec -->`` is validated as a whole spec; any other YAML
    block must be spec sections, valid over one of the specs in ``jobs/``;
  - each ``rayzip ...`` command line of a shell block is parsed by rayzip's own CLI (its
    command and option names; the command itself is not run); other shell lines (make, pip,
    ray, kubectl) are run by the suite elsewhere, or not at all.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from own_processes import free_port
from paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- (?P<marker>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)


def _blocks(lang: str) -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m["lang"] == lang:
                line = text[: m.start()].count("\n") + 1
                found.append(pytest.param(m["marker"], m["code"], id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def test_the_site_builds_in_strict_mode(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for page in ("index.html", "guides/ddp-hook/index.html", "benchmarks/index.html", "api/index.html"):
        assert (tmp_path / "site" / page).exists(), page


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, page


@pytest.mark.parametrize("marker, code", _blocks("python"))
def test_a_python_example_runs(marker, code, tmp_path):
    if marker and marker.startswith("excerpt of "):
        source = (ROOT / marker.removeprefix("excerpt of ").strip()).read_text().splitlines()
        at = 0
        for line in (l.strip() for l in code.splitlines()):
            if not line or line == "...":
                continue
            while at < len(source) and source[at].strip() != line:
                at += 1
            assert at < len(source), f"not a line of {marker} (in order): {line!r}"
            at += 1
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    if "init_process_group" in code:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        ranks = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outputs = [p.communicate(timeout=300)[0] for p in ranks]
        assert all(p.returncode == 0 for p in ranks), "\n".join(outputs)[-4000:]
        return
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.parametrize("marker, code", _blocks("yaml"))
def test_a_yaml_example_is_a_valid_spec_or_spec_sections(marker, code):
    from rayzip.spec import JobSpec, SpecError, load_spec, parse_spec

    data = yaml.safe_load(code)
    assert isinstance(data, dict)
    if marker == "job spec":
        parse_spec(data)
        return
    assert set(data) <= set(JobSpec.model_fields), \
        "neither a whole spec (mark it <!-- job spec -->) nor spec sections: a YAML example this test cannot check"
    problems = []  # sections: valid over one of the example specs
    for job in sorted((ROOT / "jobs").glob("*.yaml")):
        base = load_spec(job).model_dump()
        try:
            parse_spec({**base, **{k: {**(base.get(k) or {}), **v} if isinstance(v, dict) else v
                                   for k, v in data.items()}})
            return
        except SpecError as exc:
            problems.append(f"over {job.name}: {exc}")
    raise AssertionError("\n".join(problems))


def _commands(code: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", code)
    found = []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        if line.startswith("sudo "):
            line = line.removeprefix("sudo ").strip()
        for prefix in (".venv/bin/rayzip ", "rayzip "):
            if line.startswith(prefix):
                found.append(shlex.split(line[len(prefix):]))
    return found


@pytest.mark.parametrize("marker, code", _blocks("bash"))
def test_a_shell_example_names_real_rayzip_commands_and_options(marker, code):
    from typer.testing import CliRunner

    from rayzip.cli import app

    for args in _commands(code):
        # --help is taken once the command and every option name have parsed; values are not run
        result = CliRunner().invoke(app, [w for w in args if not w.startswith("$")] + ["--help"])
        assert result.exit_code == 0, f"rayzip {' '.join(args)}: {result.output[-1500:]}"
