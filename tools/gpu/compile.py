"""Compile every CUDA kernel source rayzip can ask for with NVRTC, on a machine without a
GPU: syntax and type errors show before a lent GPU's time is spent.

    pip install nvidia-cuda-nvrtc-cu12
    python tools/gpu/compile.py            # exit 1 and the compiler's log on an error
"""

import ctypes
import glob
import itertools
import site
import sys


def nvrtc():
    found = [p for d in [*site.getsitepackages(), *sys.path] for p in glob.glob(f"{d}/nvidia/cuda_nvrtc/lib/libnvrtc.so*")
             if "builtins" not in p]
    if not found:
        sys.exit("no libnvrtc: pip install nvidia-cuda-nvrtc-cu12")
    return ctypes.CDLL(found[0])


def compile_source(lib, source: str, name: str) -> str | None:
    """None when ``source`` compiles for sm_90 without a warning, else the compiler's log."""
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None) == 0
    options = [b"-std=c++17", b"--gpu-architecture=compute_90"]
    result = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode()
    return text if result != 0 or "warning" in text else None


def sources():
    from rayzip.cuda import cast, dct_quant, group_topk, huffman, planes, qsgd, sparse

    for bits, kept, vec in itertools.product((1, 2, 3, 4, 5, 8, 12, 16), (16, 20, 64), (0, 1)):
        yield f"dct_encode b{bits} k{kept} v{vec}", dct_quant._common() + dct_quant._ENCODE % {
            "bits": bits, "kept": kept, "vec": vec}
        for aligned in (0, 1):
            yield f"dct_decode b{bits} k{kept} a{aligned} v{vec}", dct_quant._common() + dct_quant._DECODE % {
                "bits": bits, "kept": kept, "aligned": aligned, "vec": vec}
    for vec in (0, 1):
        yield f"cast v{vec}", cast._SOURCE % {"vec": vec}
    for per in (1, 32, 64):
        yield f"group_topk {per}", group_topk._SOURCE % {"per": per, "column_t": "unsigned short",
                                                         "value_t": "unsigned short"}
    yield "qsgd", qsgd._ENCODE % {"pairs": 8}
    yield "planes", planes._SOURCE
    yield "huffman", huffman._SOURCE
    yield "sparse", sparse._SOURCE


if __name__ == "__main__":
    lib = nvrtc()
    if compile_source(lib, 'extern "C" __global__ void f(int* x) { x[0] = y; }', "planted") is None:
        sys.exit("the compiler accepted a planted error: this check proves nothing")
    failed = 0
    for name, source in sources():
        log = compile_source(lib, source, name.replace(" ", "-"))
        if log is not None:
            failed += 1
            print(f"=== {name}\n{log[:3000]}")
    print(f"{failed} of the kernel sources failed" if failed else "every kernel source compiles")
    sys.exit(1 if failed else 0)
