"""``rayzip bench codecs``: throughput, wire reduction and error of every codec, against memcpy.

Every figure is taken in the same run, on the same array: the plain copy of that array is
the memory-bandwidth reference each codec is compared with (``vs_memcpy``), so the ratios
hold on a noisy, shared machine where absolute GB/s do not.

On ``cuda`` each codec that has a CUDA kernel is timed twice, with the kernel and with the
torch-op path it replaces (``kernel: false``), and the checkpoint's byte-plane transform
(XOR with a base, rotate, split; and the inverse) is timed as well: the GPU's figures are
the kernels' against a device-to-device copy and against torch ops, in one run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .. import cuda
from ..codecs import CodecError, get_codec
from ..xp import keep_freed_memory
from .timing import best_time

__all__ = ["DEFAULT_CODECS", "CodecResult", "markdown_table", "parse_codec_spec", "parse_size", "run_codec_bench"]

DEFAULT_CODECS = [
    "none", "fp16", "bf16", "topk:density=0.01", "randomk:density=0.01",
    "group_topk:density=0.01", "qsgd", "dct_quant",
]


@dataclass
class CodecResult:
    name: str
    params: dict
    wire_reduction: float  # raw bytes over payload bytes
    payload_bytes: int
    encode_gbps: float
    decode_gbps: float
    rel_error: float
    vs_memcpy: float  # encode throughput / memcpy throughput
    decode_vs_memcpy: float
    kernel: bool = True  # False: the torch-op path, with the CUDA kernels turned off
    vs_memcpy_rounds: list[float] = field(default_factory=list)  # encode / copy, each round's


def parse_size(text: str) -> int:
    """Bytes from '64M', '1G', '4096' (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count like 64M or 1G") from None


def parse_codec_spec(spec: str) -> tuple[str, dict]:
    """'group_topk:density=0.01,group_size=512' -> ('group_topk', {...}) with typed values."""
    name, _, args = spec.partition(":")
    params = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise CodecError(f"codec option {item!r} in {spec!r} is not key=value")
        params[key.strip()] = _typed(value.strip())
    return name.strip(), params


def _typed(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _array_module(device: str):
    if device == "cpu":
        return np
    from ..xp import cupy_available

    if not cupy_available():
        raise RuntimeError("--device cuda needs cupy and a CUDA GPU: pip install 'rayzip[gpu]'")
    import cupy

    return cupy


KERNEL_CODECS = ("fp16", "bf16", "group_topk", "qsgd", "dct_quant")  # codecs with a CUDA kernel (rayzip.cuda)


def run_codec_bench(size_bytes: int, specs: list[str], repeat: int = 3, device: str = "cpu",
                    seed: int = 0, progress=None, rounds: int = 1) -> dict:
    """Benchmark each codec spec on ``size_bytes`` of gaussian fp32 data: ``rounds`` rounds,
    each timing the copy and then every codec (fastest of ``repeat`` calls each), so that a
    slow spell of a shared machine falls on a codec and its copy alike. Each row gives the
    medians over the rounds, its ratios to the copy taken round by round."""
    import statistics

    xp = _array_module(device)
    keep_freed_memory()  # as in training (rayzip.torch.compress): allocations reuse memory
    numel = size_bytes // 4
    host = np.random.default_rng(seed).standard_normal(numel, dtype=np.float32)
    x = xp.asarray(host)
    scratch = xp.empty_like(x)
    norm = float(xp.linalg.norm(x))
    cases = []  # (name, codec, kernel)
    for spec in specs:
        name, params = parse_codec_spec(spec)
        codec = get_codec(name, **params)
        for kernel in ((True, False) if device == "cuda" and name in KERNEL_CODECS else (True,)):
            cases.append((name, codec, kernel))
    copies: list[float] = []
    times: list[list[tuple[float, float]]] = [[] for _ in cases]
    finals: list[tuple[float, int]] = [(0.0, 0)] * len(cases)  # (rel. error, payload bytes)
    for round_ in range(rounds):
        memcpy_s, _ = best_time(lambda: xp.copyto(scratch, x), repeat, xp)
        copies.append(memcpy_s)
        for i, (name, codec, kernel) in enumerate(cases):
            if progress:
                progress(f"{name} (round {round_ + 1} of {rounds})")
            with cuda.kernels_on(kernel):
                encode_s, payload = best_time(lambda: codec.encode(x), repeat, xp)
                decode_s, decoded = best_time(lambda: codec.decode(payload), repeat, xp)
            times[i].append((encode_s, decode_s))
            if round_ == rounds - 1:
                finals[i] = (float(xp.linalg.norm(decoded - x)) / norm, payload.nbytes)
            del payload, decoded
    memcpy_gbps = x.nbytes / statistics.median(copies) / 1e9
    results = []
    for (name, codec, kernel), spent, (rel_error, nbytes) in zip(cases, times, finals):
        results.append(CodecResult(
            name=name, params=codec.params(), wire_reduction=x.nbytes / max(nbytes, 1), payload_bytes=nbytes,
            encode_gbps=x.nbytes / statistics.median(e for e, _ in spent) / 1e9,
            decode_gbps=x.nbytes / statistics.median(d for _, d in spent) / 1e9, rel_error=rel_error,
            vs_memcpy=statistics.median(c / e for c, (e, _) in zip(copies, spent)),
            decode_vs_memcpy=statistics.median(c / d for c, (_, d) in zip(copies, spent)), kernel=kernel,
            vs_memcpy_rounds=[c / e for c, (e, _) in zip(copies, spent)],
        ))
    report = {"size_bytes": int(x.nbytes), "device": device, "repeat": repeat, "rounds": rounds,
              "memcpy_gbps": memcpy_gbps, "codecs": [asdict(r) for r in results]}
    if device == "cuda":
        report["device_name"] = xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        report["transforms"] = (_transform_rows(x, scratch, repeat, xp, memcpy_gbps)
                                + _huffman_rows(x, repeat, xp, memcpy_gbps))
        report["sparse_sum"] = _sparse_sum(numel, repeat, xp, seed)
    return report


def _sparse_sum(numel: int, repeat: int, xp, seed: int) -> dict:
    """The ring's chunk accumulation on the GPU: two chunks of 1% of ``numel`` entries each,
    half of their indices shared, summed by the merge kernel and by the array ops (sort)."""
    from ..comm.ring import Chunk

    rng = np.random.default_rng(seed + 1)
    entries = max(1, numel // 100)
    shared = rng.choice(numel, entries // 2, replace=False)
    chunks = []
    for _ in range(2):
        own = rng.choice(numel, entries - shared.size, replace=False)
        indices = np.unique(np.concatenate([shared, own]))
        chunks.append(Chunk(numel, xp.asarray(indices), xp.asarray(rng.standard_normal(indices.size, dtype=np.float32))))
    times, sums = {}, {}
    for kernel in (True, False):
        with cuda.kernels_on(kernel):
            times[kernel], sums[kernel] = best_time(lambda: chunks[0].add(chunks[1]), repeat, xp)
    if not all(bool((getattr(sums[True], f) == getattr(sums[False], f)).all()) for f in ("indices", "values")):
        raise RuntimeError("the merge kernel's chunk sum differs from the array ops'")
    return {"entries_each": int(entries), "kernel_ms": times[True] * 1e3, "array_ops_ms": times[False] * 1e3,
            "speedup": times[False] / times[True]}


def _transform_rows(x, base, repeat: int, xp, memcpy_gbps: float) -> list[dict]:
    """The checkpoint's byte planes of ``x`` XORed with ``base`` and rotated by one (split),
    and back (join), with the CUDA kernel and with array ops, checked to round-trip."""
    from ..checkpoint.transforms import byte_planes, from_byte_planes

    words, base_words = x.view(xp.uint32), base.view(xp.uint32)
    rows = []
    for kernel in (True, False):
        with cuda.kernels_on(kernel):
            split_s, planes = best_time(lambda: byte_planes(words, xp, base=base_words, rotate=1), repeat, xp)
            join_s, back = best_time(lambda: from_byte_planes(planes, xp.uint32, xp, base=base_words, rotate=1),
                                     repeat, xp)
        if not bool((back == words).all()):
            raise RuntimeError("checkpoint byte planes did not round-trip on the GPU")
        split_gbps, join_gbps = x.nbytes / split_s / 1e9, x.nbytes / join_s / 1e9
        rows.append({"name": "xor+rotate+byte planes", "kernel": kernel, "encode_gbps": split_gbps,
                     "decode_gbps": join_gbps, "vs_memcpy": split_gbps / memcpy_gbps,
                     "decode_vs_memcpy": join_gbps / memcpy_gbps})
        del planes, back
    return rows


def _huffman_rows(x, repeat: int, xp, memcpy_gbps: float) -> list[dict]:
    """The checkpoint's Huffman coding of ``x``'s exponent plane (its top byte after the
    rotation by one), into host bytes: coded on the GPU, only the coded bytes copied to the
    host ("kernel"), against the plane copied to the host and coded there by the C kernel on
    every core. Rates are of the plane's bytes; both decode on the host. The two must write
    the same bytes."""
    import os

    from ..checkpoint import device_huffman
    from ..checkpoint.transforms import byte_planes, kernels

    if kernels is None:
        return []
    plane = xp.ascontiguousarray(byte_planes(x.view(xp.uint32), xp, rotate=1)[3])
    threads = len(os.sched_getaffinity(0))
    on_gpu_s, coded = best_time(lambda: device_huffman.encode(plane, 0), repeat, xp)
    on_host_s, host_coded = best_time(lambda: kernels.huffman_encode(xp.asnumpy(plane), 0, None, threads), repeat, xp)
    if coded.tobytes() != host_coded:
        raise RuntimeError("the GPU's Huffman coding differs from the C kernel's")
    decode_s, _ = best_time(lambda: kernels.huffman_decode(host_coded, np.empty(plane.size, np.uint8), threads),
                            repeat, np)
    rows = []
    for kernel, seconds in ((True, on_gpu_s), (False, on_host_s)):
        gbps, decode_gbps = plane.nbytes / seconds / 1e9, plane.nbytes / decode_s / 1e9
        rows.append({"name": "exponent plane, Huffman-coded", "kernel": kernel,
                     "wire_reduction": plane.nbytes / len(host_coded), "encode_gbps": gbps,
                     "decode_gbps": decode_gbps, "vs_memcpy": gbps / memcpy_gbps,
                     "decode_vs_memcpy": decode_gbps / memcpy_gbps, "host_threads": threads})
    return rows


def render_table(report: dict):
    from rich.table import Table

    where = report.get("device_name", report["device"])
    table = Table(title=f"{report['size_bytes'] / 2**20:.0f} MiB fp32 on {where}; memcpy {report['memcpy_gbps']:.2f} GB/s; "
                        f"best of {report['repeat']}, median of {report.get('rounds', 1)} round(s)")
    for col in ("codec", "wire reduction", "enc GB/s", "dec GB/s", "enc/memcpy", "dec/memcpy", "rel err"):
        if col == "codec":
            table.add_column(col, no_wrap=True, min_width=max(len(_label(r)) for r in report["codecs"]))
        else:
            table.add_column(col, justify="right")
    for r in report["codecs"] + report.get("transforms", []):
        table.add_row(_label(r), f"{r.get('wire_reduction', 1.0):.2f}x", f"{r['encode_gbps']:.3f}", f"{r['decode_gbps']:.3f}",
                      f"{r['vs_memcpy']:.3f}", f"{r['decode_vs_memcpy']:.3f}", f"{r.get('rel_error', 0.0):.2e}")
    return table


def _label(row: dict) -> str:
    return row["name"] if row.get("kernel", True) else f"{row['name']} ({_without(row)})"


def _without(row: dict) -> str:
    """What a row without the GPU's kernel timed instead."""
    return "on the host" if "host_threads" in row else "no kernel"



def markdown_table(report: dict) -> str:
    """The report as a Markdown table, for the README (generated, not typed)."""
    head = ["codec", "wire reduction", "encode GB/s", "decode GB/s", "encode / memcpy", "decode / memcpy", "rel. L2 error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["codecs"] + report.get("transforms", []):
        params = ", ".join(f"{k}={v}" for k, v in r.get("params", {}).items() if k in ("density", "bits", "levels"))
        name = f"{r['name']} ({params})" if params else r["name"]
        if not r.get("kernel", True):
            name += f", {_without(r)}"
        lines.append("| " + " | ".join([
            name, f"{r.get('wire_reduction', 1.0):.2f}×", f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}",
            f"{r['vs_memcpy']:.3f}", f"{r['decode_vs_memcpy']:.3f}", f"{r.get('rel_error', 0.0):.3g}"]) + " |")
    return "\n".join(lines)
