"""The DCT encode kernel's variants on a lent GPU, in one run: each must write the same bytes
as the library's kernel on fresh random data, and each is timed with CUDA events against a
device-to-device copy of the same input. Then where the codec's encode spends its host time,
from cProfile on a small input (the kernel's own time there is negligible).

Variants, each the library's source with a change undone:
  library    the column pass reads C from shared memory, codes rounded by one conversion
  const      the column pass reads C[r][i] from the constant bank (lanes' addresses differ)
  rint       codes rounded by rintf, then clamped and converted (a FRND more per code)
  both       both undone: the kernel as it was before these two changes

Run by tools/gpu/check.sh (part ``variants``)."""

import cProfile
import io
import pstats
import statistics

import cupy
import numpy as np

from rayzip.codecs import get_codec
from rayzip.cuda import dct_quant, raw_kernel

_CONST = [("const float c = ct[i * 8 + r];", "const float c = cs[r * 8 + i];"),
          ("if (t < 64) ct[t] = cs[(t & 7) * 8 + (t >> 3)];", ""),
          ("__shared__ float ct[64];", "")]
_RINT = [("code[l] = __float2uint_rn(fminf(fmaxf(q, 0.f), top));",
          "code[l] = (unsigned int)fminf(fmaxf(rintf(q), 0.f), top);")]
UNDO = {"library": [], "const": _CONST, "rint": _RINT, "both": _CONST + _RINT}


def source(bits: int, undo) -> str:
    text = dct_quant._common() + dct_quant._ENCODE % {"bits": bits, "kept": 64, "vec": 1}
    for new, old in undo:
        assert text.count(new) == 1, new
        text = text.replace(new, old)
    return text


def event_ms(call, times: int = 30) -> float:
    for _ in range(3):
        call()
    spent = []
    for _ in range(times):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        call()
        end.record()
        end.synchronize()
        spent.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(spent)


def main() -> None:
    rng = np.random.default_rng()
    blocks = (256 << 20) // 256  # 256 MiB of float32
    x = cupy.asarray(rng.standard_normal(blocks * 64, dtype=np.float32) * rng.lognormal(0, 2, blocks * 64)
                     .astype(np.float32))
    scratch = cupy.empty_like(x)
    slot = cupy.asarray(dct_quant.slots(np.arange(64)))
    flag = cupy.zeros(1, dtype=cupy.int32)
    copy_ms = event_ms(lambda: cupy.copyto(scratch, x))
    print(f"{'variant':9s} {'bits':>4s} {'kernel ms':>9s} {'copy ms':>8s} {'copy/kernel':>11s}  same bytes")
    for bits in (8, 4):
        outputs, rows = {}, []
        for name, undo in UNDO.items():
            kernel = raw_kernel(source(bits, undo), "dct_encode")
            scales = cupy.full(blocks, np.nan, dtype=cupy.float32)
            codes = cupy.full(blocks * 64 * bits // 8, 0xA5, dtype=cupy.uint8)

            def launch():
                kernel((-(-blocks // 32),), (256,), (x, np.int64(blocks), slot, scales, codes, flag))

            launch()
            cupy.cuda.Device().synchronize()
            outputs[name] = (scales.get(), codes.get())
            rows.append((name, event_ms(launch), kernel.num_regs))
        for name, ms, regs in rows:
            same = all(np.array_equal(a, b) for a, b in zip(outputs[name], outputs["library"]))
            print(f"{name:9s} {bits:4d} {ms:9.4f} {copy_ms:8.4f} {copy_ms / ms:11.3f}  {same}  ({regs} registers)")
    codec = get_codec("dct_quant", bits=8)
    small = cupy.asarray(rng.standard_normal(4096, dtype=np.float32))
    for _ in range(50):
        codec.encode(small)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        codec.encode(small)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    print("host time of dct_quant encode on 16 KiB, 2000 calls (cProfile, tottime):")
    print("\n".join(text.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()
