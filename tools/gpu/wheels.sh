#!/bin/bash
# The wheels tools/gpu/check.sh installs on a lent GPU machine, whose image (Python 3.12, no
# registry) lacks them: pydantic and its needs, and zstandard, at the versions this
# checkout's .venv has, into .whl/ (which .git/info/exclude keeps out of git). Then:
#   device run: bash tools/gpu/check.sh, carrying .whl
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
for package in pydantic pydantic_core annotated-types typing-inspection typing_extensions zstandard; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$package'))")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$package==$version"
done
ls .whl
