"""The ``rayzip`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(help="Elastic PyTorch training on Ray that compresses what crosses the network.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks: each prints a table, writes JSON with --json, and "
                             "compares against its baseline in the same run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()


@bench_app.command("codecs")
def bench_codecs(
    size: str = typer.Option("64M", help="Bytes of fp32 gradient per codec (K/M/G suffixes)."),
    codecs: Optional[str] = typer.Option(
        None, help="Codecs to run, ';'-separated, each NAME or NAME:key=value,... "
                   "(default: every codec, sparse ones at ratio 0.01)."),
    repeat: int = typer.Option(3, min=1, help="Timed repetitions; the fastest counts."),
    device: str = typer.Option("cpu", help="cpu (numpy) or cuda (cupy)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """Encode/decode GB/s, wire ratio and error of every codec, against memcpy."""
    from .bench.codecs import DEFAULT_CODECS, parse_size, render_table, run_codec_bench, write_json
    from .codecs import CodecError

    try:
        specs = [s for s in codecs.split(";") if s.strip()] if codecs else DEFAULT_CODECS
        size_bytes = parse_size(size)
        with console.status("benchmarking") as status:
            report = run_codec_bench(size_bytes, specs, repeat=repeat, device=device,
                                     progress=lambda name: status.update(f"benchmarking {name}"))
    except (CodecError, ValueError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    console.print(render_table(report))
    if json_path:
        write_json(report, json_path)
        console.print(f"wrote {json_path}")


def main() -> None:  # pragma: no cover - console entry point
    app()
