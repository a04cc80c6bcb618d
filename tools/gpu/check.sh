#!/bin/bash
# Issue 19's checks on a lent CUDA machine (the device tool), in one call:
#   bash tools/gpu/check.sh [tests] [bench] [nccl] [job]     (default: all four)
# Python packages the machine lacks travel as wheels in .whl/ (pydantic, zstandard, ...), and
# Ray as .whl/ray-min.tar.xz (the wheel without its Java jars, dashboard build, RLlib and
# Serve, which would not fit in a call). Output lands in $OUT.
set -u
OUT=${OUT:-/tmp/rayzip-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=${*:-tests bench nccl job profile}
want() { [[ " $parts " == *" $1 "* ]]; }
echo "=== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, cupy, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
if [ -f .whl/ray-min.tar.xz ]; then tar -xJf .whl/ray-min.tar.xz -C /tmp/site || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD
if python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then echo "host C kernels built"
else echo "host C kernels NOT built (the numpy/torch paths run on the host):"; tail -3 "$OUT/build.log"; fi
if want tests; then
  echo "=== GPU tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
fi
if want bench; then
  echo "=== rayzip bench codecs --device cuda --size 256M"
  timeout 90 python3 -m rayzip bench codecs --device cuda --size 256M --repeat 20 \
    --codecs "none;fp16;bf16;topk:ratio=0.01;randomk:ratio=0.01;group_topk:ratio=0.01;qsgd;dct_quant;dct_quant:bits=4" \
    --json "$OUT/bench-codecs-cuda.json" 2>&1 | tail -30
fi
if want nccl; then
  echo "=== two NCCL ranks on one GPU"
  timeout 120 python3 tools/gpu/two_ranks.py 2>&1 | tail -15
fi
if want job; then
  echo "=== rayzip run: the GPT on one GPU worker"
  timeout 400 python3 -m rayzip run tools/gpu/gpt-one-gpu.yaml --summary-json "$OUT/gpt-gpu-summary.json" 2>&1 | tail -25
fi
if want profile; then
  echo "=== kernel time against wall time per encode (256 MiB)"
  timeout 200 python3 tools/gpu/profile.py 2>&1 | grep -v -i warn | tail -30
fi
