#!/bin/bash
# The GPU checks (issue 50) on a lent CUDA machine, in one call of at most 9 minutes:
#   bash tools/gpu/check.sh [tests] [bench] [profile] [variants] [stall] [job]   (default: all but job)
# Output lands in $OUT (default /tmp/rayzip-gpu): logs, the codec table's JSON, the stall's;
# at most 8 files, as the device tool brings back.
# Python packages the machine lacks travel as wheels in .whl/ (pydantic and its needs,
# zstandard: `bash tools/gpu/wheels.sh` fetches them); Ray, only for `job`, as
# .whl/ray-min.tar.xz.
# The device's copy of .git can lag the tree that was sent (it named an older HEAD, "-dirty"):
# send a committed tree and run it as `RAYZIP_COMMIT=<that commit> bash tools/gpu/check.sh`, so
# that the JSON files name what ran.
set -u
OUT=${OUT:-/tmp/rayzip-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=${*:-tests bench profile variants stall}
want() { [[ " $parts " == *" $1 "* ]]; }
started=$(date +%s)
echo "=== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, cupy, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
if want job && [ -f .whl/ray-min.tar.xz ]; then tar -xJf .whl/ray-min.tar.xz -C /tmp/site || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD
if python3 setup.py -q build_ext --inplace > /tmp/rayzip-build.log 2>&1; then echo "host C kernels built"
else echo "host C kernels NOT built (the numpy/torch paths run on the host):"; tail -3 /tmp/rayzip-build.log; fi
if want tests; then
  echo "=== GPU tests: every codec and kernel against the host's, two ranks on one GPU over gloo"
  timeout 260 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -W error::pytest.PytestUnraisableExceptionWarning \
    tests/integration/test_gpu.py tests/integration/test_gpu_ranks.py tests/integration/test_gpu_fsdp.py \
    tests/unit/test_cuda_seam.py tests/unit/test_device_huffman.py > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/pytest-gpu.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20
  echo "warnings:"; sed -n '/warnings summary/,/-- Docs/p' "$OUT/pytest-gpu.log" | grep -E "Warning" | sort | uniq -c
fi
if want bench; then
  echo "=== rayzip bench codecs --device cuda --size 256M, medians of 3 interleaved rounds"
  timeout 130 python3 -m rayzip bench codecs --device cuda --size 256M --repeat 10 --rounds 3 \
    --codecs "none;fp16;bf16;topk:density=0.01;randomk:density=0.01;group_topk:density=0.01;qsgd;dct_quant;dct_quant:bits=4" \
    --json "$OUT/bench-codecs-cuda.json" > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; tail -30 "$OUT/bench.log"
fi
if want profile; then
  echo "=== kernel time against wall time per call (256 MiB)"
  timeout 60 python3 tools/gpu/kernel_time.py > "$OUT/kernel-time.log" 2>&1
  echo "profile exit $?"; grep -v -i warn "$OUT/kernel-time.log" | tail -20
fi
if want variants; then
  echo "=== the DCT encode kernel's variants, bitwise and timed; the encode's host time"
  timeout 90 python3 tools/gpu/dct_variants.py > "$OUT/variants.log" 2>&1
  echo "variants exit $?"; head -12 "$OUT/variants.log"
fi
if want stall; then
  echo "=== the GPT's background checkpoint on the GPU: training stall per checkpoint"
  timeout 120 python3 -m rayzip bench checkpoint --model none --compressors rayzip --stall-model gpt \
    --stall-device cuda --json "$OUT/bench-stall-gpt-cuda.json" > "$OUT/stall.log" 2>&1
  echo "stall exit $?"; tail -9 "$OUT/stall.log"
fi
if want job; then
  echo "=== rayzip run: the GPT on one GPU worker"
  timeout 400 python3 -m rayzip run tools/gpu/gpt-one-gpu.yaml --summary-json "$OUT/gpt-gpu-summary.json" 2>&1 | tail -25
fi
echo "=== done in $(( $(date +%s) - started )) s"
