"""``rayzip bench codecs``: throughput, wire ratio and error of every codec, against memcpy.

Every figure is taken in the same run, on the same array: the plain copy of that array is
the memory-bandwidth reference each codec is compared with (``vs_memcpy``), so the ratios
hold on a noisy, shared machine where absolute GB/s do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..codecs import CodecError, get_codec
from ..xp import keep_freed_memory
from .timing import best_time

__all__ = ["DEFAULT_CODECS", "CodecResult", "markdown_table", "parse_codec_spec", "parse_size", "run_codec_bench"]

DEFAULT_CODECS = [
    "none", "fp16", "bf16", "topk:ratio=0.01", "randomk:ratio=0.01",
    "group_topk:ratio=0.01", "qsgd", "dct_quant",
]


@dataclass
class CodecResult:
    name: str
    params: dict
    ratio: float
    payload_bytes: int
    encode_gbps: float
    decode_gbps: float
    rel_error: float
    vs_memcpy: float  # encode throughput / memcpy throughput
    decode_vs_memcpy: float


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
    """'group_topk:ratio=0.01,group_size=512' -> ('group_topk', {...}) with typed values."""
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


def run_codec_bench(size_bytes: int, specs: list[str], repeat: int = 3, device: str = "cpu",
                    seed: int = 0, progress=None) -> dict:
    """Benchmark each codec spec on ``size_bytes`` of gaussian fp32 data."""
    xp = _array_module(device)
    keep_freed_memory()  # as in training (rayzip.torch.compress): allocations reuse memory
    numel = size_bytes // 4
    host = np.random.default_rng(seed).standard_normal(numel, dtype=np.float32)
    x = xp.asarray(host)
    scratch = xp.empty_like(x)
    memcpy_s, _ = best_time(lambda: xp.copyto(scratch, x), repeat, xp)
    memcpy_gbps = x.nbytes / memcpy_s / 1e9
    norm = float(xp.linalg.norm(x))
    results = []
    for spec in specs:
        name, params = parse_codec_spec(spec)
        codec = get_codec(name, **params)
        if progress:
            progress(name)
        encode_s, payload = best_time(lambda: codec.encode(x), repeat, xp)
        decode_s, decoded = best_time(lambda: codec.decode(payload), repeat, xp)
        encode_gbps, decode_gbps = x.nbytes / encode_s / 1e9, x.nbytes / decode_s / 1e9
        results.append(CodecResult(
            name=name, params=codec.params(), ratio=x.nbytes / max(payload.nbytes, 1),
            payload_bytes=payload.nbytes, encode_gbps=encode_gbps, decode_gbps=decode_gbps,
            rel_error=float(xp.linalg.norm(decoded - x)) / norm,
            vs_memcpy=encode_gbps / memcpy_gbps, decode_vs_memcpy=decode_gbps / memcpy_gbps,
        ))
    return {"size_bytes": int(x.nbytes), "device": device, "repeat": repeat,
            "memcpy_gbps": memcpy_gbps, "codecs": [asdict(r) for r in results]}


def render_table(report: dict):
    from rich.table import Table

    table = Table(title=f"{report['size_bytes'] / 2**20:.0f} MiB fp32 on {report['device']}; "
                        f"memcpy {report['memcpy_gbps']:.2f} GB/s; best of {report['repeat']}")
    for col in ("codec", "ratio", "enc GB/s", "dec GB/s", "enc/memcpy", "dec/memcpy", "rel err"):
        if col == "codec":
            table.add_column(col, no_wrap=True, min_width=max(len(r["name"]) for r in report["codecs"]))
        else:
            table.add_column(col, justify="right")
    for r in report["codecs"]:
        table.add_row(r["name"], f"{r['ratio']:.2f}x", f"{r['encode_gbps']:.3f}", f"{r['decode_gbps']:.3f}",
                      f"{r['vs_memcpy']:.3f}", f"{r['decode_vs_memcpy']:.3f}", f"{r['rel_error']:.2e}")
    return table



def markdown_table(report: dict) -> str:
    """The report as a Markdown table, for the README (generated, not typed)."""
    head = ["codec", "ratio", "encode GB/s", "decode GB/s", "encode / memcpy", "decode / memcpy", "rel. L2 error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["codecs"]:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k in ("ratio", "bits", "levels"))
        name = f"{r['name']} ({params})" if params else r["name"]
        lines.append("| " + " | ".join([
            name, f"{r['ratio']:.2f}×", f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}", f"{r['vs_memcpy']:.3f}",
            f"{r['decode_vs_memcpy']:.3f}", f"{r['rel_error']:.3g}"]) + " |")
    return "\n".join(lines)
