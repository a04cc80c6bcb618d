#!/usr/bin/env bash
# The interpreter `make setup` builds .venv with: the distribution's /usr/bin/python3 where it
# is 3.10 or newer with venv, ensurepip and its C headers (the kernels are C extensions), else
# python3 on the PATH. Debian's and Ubuntu's builds are profile-optimized; pyenv's default
# builds are not, and the tests spend much of their time in the interpreter.
for candidate in /usr/bin/python3 "$(command -v python3)"; do
    if [ -x "$candidate" ] && "$candidate" - <<'PY' 2>/dev/null; then
import os, sys, sysconfig
import ensurepip, venv  # noqa: F401 - Debian ships them in python3-venv
sys.exit(sys.version_info < (3, 10) or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
PY
        echo "$candidate"
        exit 0
    fi
done
echo python3
