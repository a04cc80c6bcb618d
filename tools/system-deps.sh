#!/usr/bin/env bash
# What `make test` needs beyond Python packages: Prometheus (the adaptive controller's tests
# run a real one) and a C compiler (the checkpoint and codec kernels). Installed from
# Debian's packages where apt-get is there and we are root; otherwise a message says what to
# install, and the exit status is 1.
set -euo pipefail
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing ${missing[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    exit 0
fi
echo "make test needs: ${missing[*]}" >&2
echo "  Debian/Ubuntu: sudo apt-get install ${missing[*]}" >&2
echo "  elsewhere: Prometheus from https://prometheus.io/download/ on the PATH, and a C compiler" >&2
exit 1
