"""The ``rayzip`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import typer
from rich.console import Console

app = typer.Typer(help="Elastic PyTorch training on Ray that compresses what crosses the network.",
                  epilog="Example: rayzip run jobs/digits-group-topk.yaml", no_args_is_help=True,
                  add_completion=False)
bench_app = typer.Typer(help="Benchmarks: each prints a table, writes JSON with --json, and "
                             "compares against its baseline in the same run.",
                        epilog="Example: rayzip bench codecs --json out/bench-codecs.json", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
checkpoint_app = typer.Typer(help="Inspect, verify and decompress rayzip checkpoints.",
                             epilog="Example: rayzip checkpoint verify ~/ray_results/RUN/checkpoint_000001/trainer",
                             no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")
k8s_app = typer.Typer(help="KubeRay manifests for a job spec.",
                      epilog="Example: rayzip k8s render jobs/synthetic-gpu.yaml -o k8s", no_args_is_help=True)
app.add_typer(k8s_app, name="k8s")
# Tables are read in logs and CI output too: do not squeeze them to 80 columns there.
console = Console(width=None if sys.stdout.isatty() else 120)


def _load_or_exit(path: Path, overrides: Sequence[str] = ()):
    """The parsed spec (with ``overrides``, SECTION.FIELD=VALUE), or exit 2 with every bad
    field named (nothing else is started)."""
    from .spec import SpecError, load_spec

    try:
        return load_spec(path, overrides)
    except SpecError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)


@app.command()
def validate(spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec (YAML).")):
    """Check a job spec: exit 0 when valid, 2 naming each bad field.

    Example: rayzip validate jobs/digits-group-topk.yaml
    """
    from .spec import ALLOWED_MODULES_ENV, code_references

    spec = _load_or_exit(spec_path)
    _allowed_or_exit(spec, spec_path)
    s, c = spec.scaling, spec.compression
    feedback = f", error_decay {c.error_decay}" if c.error_decay != 1.0 else ""
    combine = f", combine {c.combine}" if c.combine != "mean" else ""
    console.print(f"ok: {spec.name}: codec {c.codec} {c.codec_params()}{feedback}, "
                  f"collective {c.collective}{combine}, workers {s.min_workers}..{s.max_workers}",
                  highlight=False)
    for field, value in code_references(spec):
        console.print(f"note: {field} is code: `rayzip run` imports {value} and calls it on every worker, "
                      f"with the job's privileges. Run specs only from people you would let run code; "
                      f"{ALLOWED_MODULES_ENV} limits which modules a spec may name.", highlight=False, soft_wrap=True)


def _allowed_or_exit(spec, spec_path: Path) -> None:
    from .spec import SpecError, check_allowed_modules

    try:
        check_allowed_modules(spec, source=str(spec_path))
    except SpecError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)


@app.command()
def schema():
    """Print the job spec's JSON schema.

    Example: rayzip schema > spec.schema.json
    """
    from .spec import JobSpec

    print(json.dumps(JobSpec.model_json_schema(), indent=2))


@app.command()
def run(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec (YAML)."),
    summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Write the run summary here."),
    storage_path: Optional[str] = typer.Option(None, help="Ray Train storage for checkpoints "
                                                          "(default: $RAYZIP_STORAGE_PATH or ~/ray_results)."),
    progress_file: Optional[Path] = typer.Option(None, "--progress-file",
                                                 help="Keep the latest step's metrics here as JSON (for tools)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's and the workers' output here too "
                                                                 "(by default it goes to Ray's log folder, "
                                                                 "printed at the start)."),
    overrides: Optional[list[str]] = typer.Option(
        None, "--set", help="SECTION.FIELD=VALUE (VALUE as YAML) set in the spec; repeatable, "
                            "e.g. --set training.mixed_precision=bf16."),
):
    """Train a job spec on Ray ($RAY_ADDRESS, or an embedded local Ray).

    Example: rayzip run jobs/digits-group-topk.yaml --summary-json out/summary.json
    """
    spec = _load_or_exit(spec_path, overrides or ())
    _allowed_or_exit(spec, spec_path)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .runner import run_job, write_summary

    total = spec.training.steps
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
               TimeElapsedColumn(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(spec.name, total=total, status="starting Ray")

        def show(m: dict) -> None:
            if progress_file is not None:
                tmp = progress_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(m, default=str))
                tmp.replace(progress_file)
            metric = _metric_text(m.get("metric"), m.get(m.get("metric") or "test_accuracy"))
            reduction = m["dense_bytes"] / m["bytes_sent"] if m.get("bytes_sent") and m.get("dense_bytes") else float("nan")
            bar.update(task, completed=m["step"] + 1,
                       status=f"loss {m['loss']:.3f}  {metric}  wire {reduction:.1f}x  workers {m.get('world_size', '-')}")

        try:
            summary = run_job(spec, storage_path=storage_path, on_progress=show, verbose=verbose,
                              on_logs=lambda logs: console.print(f"Ray's and the workers' logs: {logs}",
                                                                 highlight=False, soft_wrap=True))
        except Exception as exc:  # training failed on the cluster: say so, exit non-zero
            console.print(f"[red]training failed:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
    console.print(_summary_table(summary))
    if summary_json:
        write_summary(summary, summary_json)
        console.print(f"wrote {summary_json}")


@app.command()
def submit(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec (YAML)."),
    address: Optional[str] = typer.Option(None, help="Ray dashboard address, e.g. http://head:8265 "
                                                     "(default: $RAY_ADDRESS, then the local cluster)."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Return once submitted."),
    resubmit: bool = typer.Option(False, help="Run again even if this spec was submitted before."),
    working_dir: Optional[Path] = typer.Option(None, help="A folder of your code to ship with the job "
                                                          "(for module:function models and datasets); "
                                                          ".gitignore and .rayignore are honoured, symlinks out "
                                                          "of it left out, credential files refused."),
):
    """Run a job spec on a Ray cluster via the Jobs API; exit with the job's status.

    Example: rayzip submit jobs/digits-group-topk.yaml --address http://head:8265
    """
    spec = _load_or_exit(spec_path)
    from .package import SecretFileError
    from .submit import submit_job

    try:
        job_id, status = submit_job(spec_path, spec, address=address, wait=not no_wait, resubmit=resubmit,
                                    working_dir=working_dir, echo=lambda line: print(line, flush=True))
    except (SecretFileError, FileNotFoundError) as exc:  # nothing was sent
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    except Exception as exc:  # connection, auth or API errors: one clear line, no traceback
        console.print(f"[red]submit failed:[/red] {type(exc).__name__}: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if status is None:
        console.print(f"{job_id} submitted; follow it with: ray job logs -f {job_id}", highlight=False)
        return
    console.print(f"job {job_id}: {status}", highlight=False)
    raise typer.Exit(0 if status == "SUCCEEDED" else 1)


@app.command("prometheus-config")
def prometheus_config_command(
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write here (default: print)."),
    scrape_interval: str = typer.Option("5s", help="Prometheus scrape and evaluation interval."),
    service_discovery: str = typer.Option("/tmp/ray/prom_metrics_service_discovery.json",
                                          help="Ray's service-discovery file (on the head node)."),
):
    """A prometheus.yml that scrapes every Ray node's metrics, rayzip's included.

    Example: rayzip prometheus-config > prometheus.yml
    """
    import yaml

    from .metrics import prometheus_config

    text = yaml.safe_dump(prometheus_config(scrape_interval, service_discovery), sort_keys=False)
    if out is None:
        print(text, end="")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"wrote {out}; run: prometheus --config.file={out}", highlight=False)


def _metric_text(metric: str | None, value: float | None) -> str:
    label = "val bpb" if metric == "val_loss" else "acc"
    return f"{label} {value:.3f}" if value is not None else f"{label} -"


def _summary_table(summary: dict):
    from rich.table import Table

    table = Table(title=f"rayzip run: {summary['name']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    reduction = summary["wire_reduction"]
    lm = summary.get("metric") == "val_loss"
    value, target = ((summary.get("final_val_loss"), summary.get("target_val_loss")) if lm
                     else (summary["final_test_accuracy"], summary["target_accuracy"]))
    rows = [
        ("final validation loss (bits/byte)" if lm else "final test accuracy", f"{value:.4f}" if value is not None else "-"),
        ("target reached", {True: "yes", False: "no"}[summary["reached_target"]] if target is not None else "no target"),
        ("steps", str(summary["steps"])),
        ("workers", str(summary["world_size"])),
        ("codec", " ".join([summary["codec"], *(f"{k}={v}" for k, v in summary["codec_params"].items())])),
    ]
    ps = summary.get("ps")
    if ps:  # pushes compare with a dense fp32 push; pulls are reported beside them
        rows += [
            ("pushed per worker", f"{summary['bytes_sent_per_worker'] / 1e6:.3f} MB (counted)"),
            ("a dense fp32 push would send", f"{summary['dense_bytes_per_worker'] / 1e6:.3f} MB"),
            ("pulled per worker", f"{summary['bytes_received_per_worker'] / 1e6:.3f} MB ({ps['pull']})"),
            ("parameter shards", f"{ps['shards']} ({ps['mode']}), {ps['worker_groups']} worker group(s)"),
        ]
    else:
        rows += [
            ("sent per worker", f"{summary['bytes_sent_per_worker'] / 1e6:.3f} MB ({summary['bytes_source']})"),
            ("fp32 ring allreduce would send", f"{summary['dense_bytes_per_worker'] / 1e6:.3f} MB"),
        ]
    if summary.get("local_every") is not None:
        seen = [h["local_every"] for h in summary.get("history", []) if h.get("local_every")]
        tuned = f" (tuned; {min(seen)}..{max(seen)} at evaluations)" if summary.get("local_every_tuned") and seen else ""
        rows.append(("local steps between synchronizations", f"{summary['local_every']}{tuned}"))
    rows += [
        ("wire reduction", f"{reduction:.1f}x" if reduction else "-"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    if summary.get("restarts"):
        replayed = summary.get("replayed") or {}
        same = (f"; {replayed['identical']} of {replayed['steps']} redone steps repeated their loss exactly"
                if replayed.get("steps") else "")
        rows.append(("restarts", f"{summary['restarts']}, {summary['steps_redone']} steps redone{same}"))
        for i, r in enumerate(summary.get("resumes", []), 1):
            lost = f" {', '.join(n[:12] for n in r['nodes_lost'])}" if r.get("nodes_lost") else ""
            rows.append((f"recovery {i}", f"{r.get('cause', '?').replace('_', ' ')}{lost} after step {r['last_step']}: "
                                          f"resumed at {r['resumed_at']} from {r.get('source') or 'storage'}, "
                                          f"{r['steps_lost']} steps lost, {r['seconds']:.1f} s"))
    memory = summary.get("snapshot_memory")
    if memory:
        most = max(memory.values(), key=lambda u: u["held_bytes"])
        refused = sorted({o for u in memory.values() for o in u["refused"]})
        rows.append(("snapshots in memory", f"{most['held_bytes'] / 1e6:.1f} MB on the fullest of {len(memory)} "
                                            f"node(s), of {most['max_bytes'] / 1e6:.0f} MB allowed"
                                            + (f"; over it: {', '.join(refused)}" if refused else "")))
    adaptive = summary.get("adaptive")
    if adaptive:
        sources = ", ".join(f"{k} {v}" for k, v in adaptive["sources"].items())
        rows.append(("controller decisions", f"{sources}; final compression {adaptive['final_compression']:.1f}"))
    for key, value in rows:
        table.add_row(key, value)
    return table


def _write_report(report: dict, json_path: Optional[Path]) -> None:
    if json_path:
        from .bench import write_json

        write_json(report, json_path)
        console.print(f"wrote {json_path}")


def _cluster_bench_inputs(methods: str, spec: Optional[Path], latency: Optional[str] = None,
                          overrides: Sequence[str] = ()):
    """(methods, spec path) for a namespace-cluster benchmark; exit 2 on a bad method or spec
    (with ``overrides`` set), or when this machine cannot build the cluster."""
    from .bench.cluster import DEFAULT_SPEC, method_compression
    from .bench.netns import ClusterError, preflight

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    spec_path = spec or DEFAULT_SPEC
    try:
        for method in chosen:
            method_compression(method, 10)  # refuses unknown methods
        _load_or_exit(spec_path, overrides)
        preflight(latency)
    except (ValueError, ClusterError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    return chosen, spec_path


def _run_cluster(run):
    """``run(log)``'s report; exit 1 when the cluster fails."""
    from .bench.netns import ClusterError

    try:
        return run(lambda line: console.print(line, highlight=False))
    except (ClusterError, RuntimeError) as exc:
        console.print(f"[red]benchmark failed:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@bench_app.command("codecs")
def bench_codecs(
    size: str = typer.Option("64M", help="Bytes of fp32 gradient per codec (K/M/G suffixes)."),
    codecs: Optional[str] = typer.Option(
        None, help="Codecs to run, ';'-separated, each NAME or NAME:key=value,... "
                   "(default: every codec, sparse ones at density 0.01)."),
    repeat: int = typer.Option(3, min=1, help="Timed repetitions; the fastest counts."),
    rounds: int = typer.Option(1, min=1, help="Rounds, each timing the copy and every codec; rows give "
                                              "the medians, ratios to the copy of the same round."),
    device: str = typer.Option("cpu", help="cpu (numpy) or cuda (cupy)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """Encode/decode GB/s, wire reduction and error of every codec, against memcpy.

    Example: rayzip bench codecs --size 64M --json out/bench-codecs.json
    """
    from .bench.codecs import DEFAULT_CODECS, parse_size, render_table, run_codec_bench
    from .codecs import CodecError

    try:
        specs = [s for s in codecs.split(";") if s.strip()] if codecs else DEFAULT_CODECS
        size_bytes = parse_size(size)
        with console.status("benchmarking") as status:
            report = run_codec_bench(size_bytes, specs, repeat=repeat, device=device, rounds=rounds,
                                     progress=lambda name: status.update(f"benchmarking {name}"))
    except (CodecError, ValueError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    console.print(render_table(report))
    if "sparse_sum" in report:
        sums = report["sparse_sum"]
        console.print(f"sparse chunk sum, 2 x {sums['entries_each']} entries: merge kernel {sums['kernel_ms']:.3f} ms, "
                      f"array ops {sums['array_ops_ms']:.3f} ms ({sums['speedup']:.1f}x)")
    _write_report(report, json_path)


@bench_app.command("encoder")
def bench_encoder(
    settings: str = typer.Option("dense,default,dct,group_topk,group_topk_adam,local_steps",
                                 help="Settings, comma-separated: dense, default, dct, group_topk, "
                                      "group_topk_adam, local_steps."),
    steps: int = typer.Option(148, min=1, help="Optimizer steps per fine-tune (2 micro-batches each)."),
    repeat: int = typer.Option(1, min=1, help="Runs per setting, interleaved; rows give the medians."),
    workers: int = typer.Option(2, min=1, help="Ray Train workers."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """A pretrained encoder fine-tuned in your own train_func, dense against rayzip's settings.

    Example: rayzip bench encoder --repeat 3 --json docs/bench-encoder.json
    """
    from .bench.encoder import markdown_table, run_encoder_bench

    chosen = [s.strip() for s in settings.split(",") if s.strip()]
    try:
        report = run_encoder_bench(chosen, steps=steps, repeat=repeat, workers=workers,
                                   log=lambda line: console.print(line, highlight=False))
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    except RuntimeError as exc:
        console.print(f"[red]benchmark failed:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(markdown_table(report))
    _write_report(report, json_path)


@bench_app.command("chaos")
def bench_chaos(
    spec: Path = typer.Option(Path("jobs/digits-group-topk.yaml"), help="Job spec (YAML)."),
    kills: int = typer.Option(5, min=1, help="Worker processes killed per run, at random steps."),
    steps: Optional[int] = typer.Option(None, min=1, help="Training steps (default: the spec's)."),
    checkpoint_every: Optional[int] = typer.Option(None, min=1, help="Steps between checkpoints in storage "
                                                                      "(default: the spec's)."),
    every: str = typer.Option("auto", help="snapshots.every of the runs with snapshots: auto, or steps."),
    repeat: int = typer.Option(3, min=1, help="Rounds; each runs every variant, in a rotated order."),
    seed: int = typer.Option(0, help="Draws the kill steps (round r: seed + r)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """Killed workers with snapshots in memory against Ray Train's resume from storage.

    Example: rayzip bench chaos --steps 800 --json docs/bench-chaos-digits.json
    """
    from .bench.chaos import markdown_table, run_chaos_bench

    job = _load_or_exit(spec)
    if steps is not None:
        job = job.model_copy(update={"training": job.training.model_copy(update={"steps": steps})})
    if checkpoint_every is not None:
        job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"every_steps": checkpoint_every})})
    job = job.model_copy(update={"snapshots": job.snapshots.model_copy(
        update={"every": int(every) if every.isdigit() else every})})
    try:
        job = type(job).model_validate(job.model_dump())  # the options checked as the spec's own fields
        report = run_chaos_bench(job, kills=kills, repeat=repeat, seed=seed,
                                 log=lambda line: console.print(line, highlight=False))
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    console.print(markdown_table(report))
    _write_report(report, json_path)


@bench_app.command("collectives")
def bench_collectives(
    workers: str = typer.Option("2,4,8", help="Worker counts, comma-separated (gloo processes on this machine)."),
    codec: str = typer.Option("group_topk", help="A sparse codec: group_topk, topk or randomk."),
    density: float = typer.Option(0.01, help="Kept fraction of a sparse codec."),
    steps: int = typer.Option(8, min=3, help="Training steps per collective (the first 2 are left out)."),
    simulate: bool = typer.Option(False, "--simulate", help="Run every worker count in this process, each rank "
                                                            "a thread (rayzip.bench.simulate): up to hundreds."),
    real_upto: int = typer.Option(8, help="With --simulate, also run the worker counts up to this many as real "
                                          "gloo processes and set their bytes beside the simulated ones (0: none)."),
    link_mbit: float = typer.Option(100.0, help="With --simulate, the link rate of the modelled step time."),
    latency_ms: float = typer.Option(0.1, help="With --simulate, the link's latency per message."),
    others_upto: int = typer.Option(64, help="With --simulate, run the ring and the allgather up to this many "
                                             "workers (their n² decoding takes hours at hundreds), the balanced "
                                             "allreduce at every count."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """Bytes per worker of the ring, the allgather, the balanced allreduce and auto's choice,
    modelled and measured (or simulated, with --simulate).

    Example: rayzip bench collectives --workers 2,4,8 --json out/bench-collectives.json

    Example: rayzip bench collectives --simulate --workers 2,4,8,16,64,256 --json out/bench-collectives-simulated.json
    """
    from pydantic import ValidationError

    from .bench.collectives import render_table, run_collectives_bench
    from .spec import CompressionSpec

    parts = [w.strip() for w in workers.split(",") if w.strip()]
    if not parts or not all(w.isdigit() and int(w) >= 2 for w in parts):
        console.print(f"[red]error:[/red] --workers takes worker counts of 2 or more, got {workers}")
        raise typer.Exit(2)
    compression = {"codec": codec, "density": density}
    try:
        CompressionSpec(**compression, collective="ring")
    except ValidationError as exc:
        console.print(f"[red]error:[/red] {exc.errors()[0]['msg']}")
        raise typer.Exit(2)
    worlds = [int(w) for w in parts]
    if simulate:
        from .bench.simulate import check_against_real, markdown_table, simulate_collectives
        from .comm import Link

        link = Link(bandwidth=link_mbit * 1e6 / 8, latency=latency_ms * 1e-3)
        with console.status("simulating") as status:
            report = simulate_collectives(worlds, compression, steps=steps, link=link, others_upto=others_upto,
                                          progress=lambda n, c: status.update(f"{n} workers: {c}"))
            real_worlds = [w for w in worlds if w <= real_upto]
            if real_worlds:
                status.update("the real run")
                real = run_collectives_bench(real_worlds, compression, steps=steps)
                report["against_real"] = check_against_real(report, real)
        console.print(markdown_table(report))
        for row in report.get("against_real", []):
            console.print(f"{row['workers']} workers, {row['collective']}: simulated / real bytes {row['ratio']:.4f}")
        _write_report(report, json_path)
        return
    with console.status("benchmarking") as status:
        report = run_collectives_bench(worlds, compression, steps=steps,
                                       progress=lambda n: status.update(f"{n} workers"))
    console.print(render_table(report))
    _write_report(report, json_path)


@bench_app.command("overhead")
def bench_overhead(
    workers: int = typer.Option(2, min=2, help="gloo processes on this machine."),
    steps: int = typer.Option(60, min=3, help="Timed steps of each variant per round."),
    warmup: int = typer.Option(5, min=0, help="Untimed steps of each variant before each round's."),
    rounds: int = typer.Option(3, min=1, help="Rounds, each in a rotated order; the table gives their medians."),
    variants: Optional[str] = typer.Option(None, help="Variants, comma-separated (default: all): "
                                                      "ddp_sgd, ddp_again, ddp_hook, off, off_momentum, ddp_adamw, off_adam."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """A step through rayzip's hook with compression off, against plain DDP's in the same run.

    Example: rayzip bench overhead --rounds 3 --json docs/bench-overhead.json
    """
    from .bench.overhead import render_table, run_overhead_bench

    chosen = [v.strip() for v in variants.split(",") if v.strip()] if variants else None
    try:
        with console.status("benchmarking"):
            report = run_overhead_bench(workers=workers, steps=steps, warmup=warmup, rounds=rounds, variants=chosen)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    console.print(render_table(report))
    _write_report(report, json_path)


@bench_app.command("cluster")
def bench_cluster(
    bandwidth: str = typer.Option("100mbit", help="Link rate of each worker node (tc rate: 100mbit, 1gbit)."),
    nodes: int = typer.Option(2, min=1, help="Worker nodes."),
    workers_per_node: int = typer.Option(1, "--workers-per-node", min=1,
                                         help="Training workers (and CPUs) per node, unshaped among themselves; "
                                              "above 1, rayzip's hook averages each node densely first "
                                              "(compression.hierarchy auto; a method:flat suffix turns it off)."),
    latency: Optional[str] = typer.Option(None, help="Added one-way delay, e.g. 1ms (needs netem)."),
    spec: Optional[Path] = typer.Option(None, help="Job spec (default: jobs/bench-synthetic.yaml)."),
    methods: str = typer.Option("dense,powersgd,fp16,group_topk,dct_quant",
                                help="Comma-separated methods; NAME:muon trains NAME with Muon inside (the "
                                     "spec's AdamW settings), NAME:bf16 under bf16 autocast."),
    powersgd_start_iter: int = typer.Option(10, help="torch PowerSGD start_powerSGD_iter (torch's default, 1000, "
                                                     "would leave it uncompressed for a short run)."),
    budget_steps: Optional[int] = typer.Option(None, "--budget-steps", min=1,
                                               help="Train every method exactly this many steps instead of "
                                                    "stopping at the target, so final accuracies compare."),
    drop_to: Optional[str] = typer.Option(None, "--drop-to", help="Drop the links to this rate mid-run "
                                                                  "(e.g. 100mbit), at --drop-at-step."),
    drop_at_step: int = typer.Option(100, "--drop-at-step", min=1, help="Step at which the links drop."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Runs per method, interleaved; the table shows "
                                                         "medians with [min–max]."),
    kill_node_at_step: Optional[int] = typer.Option(
        None, "--kill-node-at-step", min=1, help="Also run each method with its last worker node lost whole at "
                                                 "this step (every process SIGKILLed) and replaced, beside the "
                                                 "uninterrupted run."),
    lose_ranks: Optional[str] = typer.Option(
        None, "--lose-ranks", help="With --kill-node-at-step: comma-separated ranks; each gets a run that loses "
                                   "the node holding that rank, not the last node (ranks above 0: 2 nodes "
                                   "of 1 worker)."),
    node_loss_from: str = typer.Option(
        "memory", "--node-loss-from", help="With --kill-node-at-step: comma-separated, memory and/or storage; "
                                           "storage adds each lost-node run again with snapshots off (the resume "
                                           "from the last checkpoint), and every run then checkpoints to storage."),
    overrides: Optional[list[str]] = typer.Option(
        None, "--set", help="SECTION.FIELD=VALUE (VALUE as YAML) set in the spec for every method; repeatable, "
                            "e.g. --set training.base_world_size=2."),
    arms: Optional[list[str]] = typer.Option(
        None, "--arm", help="NAME:SECTION.FIELD=VALUE[;...]: run every method under each arm's settings (NAME: "
                            "alone, the spec as it is), interleaved, each against the first arm's time per step "
                            "in the same round; repeatable, two or more, e.g. --arm 'off:snapshots.enabled=false' "
                            "--arm 'on:'."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write accuracy-vs-time PNG here."),
):
    """Time-to-accuracy on a real Ray cluster in network namespaces with shaped links (root).

    Example: sudo rayzip bench cluster --bandwidth 100mbit --methods dense,group_topk --json out/cluster.json
    """
    from .bench.cluster import plot, render_table, run_cluster_bench

    chosen, spec_path = _cluster_bench_inputs(methods, spec, latency, overrides or ())
    if kill_node_at_step is not None and (drop_to or nodes < 2):
        console.print("[red]error:[/red] --kill-node-at-step needs 2 nodes or more, and no --drop-to")
        raise typer.Exit(2)
    ranks = _lose_ranks_or_exit(lose_ranks, kill_node_at_step, nodes, workers_per_node)
    sources = _node_loss_from_or_exit(node_loss_from, kill_node_at_step)
    chosen_arms = _arms_or_exit(arms or [], spec_path, overrides or (), kill_node_at_step is not None or bool(drop_to))
    report = _run_cluster(lambda log: run_cluster_bench(
        chosen, bandwidth, nodes, latency, spec_path, powersgd_start_iter, log=log, budget_steps=budget_steps,
        drop_to=drop_to, drop_at_step=drop_at_step if drop_to else None, workers_per_node=workers_per_node,
        repeat=repeat, kill_node_at_step=kill_node_at_step, lose_ranks=ranks, node_loss_from=sources,
        overrides=overrides or (), arms=chosen_arms))
    console.print(render_table(report))
    if drop_to:
        from .bench.cluster import render_drop_table

        console.print(render_drop_table(report))
    _write_report(report, json_path)  # first: a table that fails to render loses no run
    if kill_node_at_step is not None or chosen_arms:
        from .bench.cluster import markdown_table

        print(markdown_table(report))
    if plot_path:
        plot(report, plot_path)
        console.print(f"wrote {plot_path}")


def _arms_or_exit(texts: list[str], spec_path: Path, overrides: Sequence[str],
                  interrupted: bool) -> list[tuple[str, list[str]]]:
    """``--arm`` options as (NAME, overrides), each arm's spec checked; or exit 2 naming the
    arm, or the field, that is wrong."""
    from .bench.cluster import check_arms, parse_arm

    try:
        arms = [parse_arm(t) for t in texts]
        check_arms(arms)
        if arms and interrupted:
            raise ValueError("arms compare settings on uninterrupted runs: not with --kill-node-at-step or --drop-to")
    except ValueError as exc:
        console.print(f"[red]error:[/red] --arm: {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)
    for _, settings in arms:
        _load_or_exit(spec_path, [*overrides, *settings])
    return arms


def _node_loss_from_or_exit(text: str, kill_node_at_step: int | None) -> tuple[str, ...]:
    """``--node-loss-from`` as a tuple, or exit 2 naming what is wrong with it."""
    from .bench.cluster import check_node_loss_from

    sources = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    try:
        check_node_loss_from(sources)
    except ValueError as exc:
        console.print(f"[red]error:[/red] --node-loss-from {text}: {exc}", soft_wrap=True)
        raise typer.Exit(2)
    if sources != ("memory",) and kill_node_at_step is None:
        console.print("[red]error:[/red] --node-loss-from needs --kill-node-at-step")
        raise typer.Exit(2)
    return sources


def _lose_ranks_or_exit(text: str | None, kill_node_at_step: int | None, nodes: int,
                        workers_per_node: int) -> list[int] | None:
    """``--lose-ranks`` as a list, or exit 2 naming what is wrong with it."""
    from .bench.cluster import check_lose_ranks

    if text is None:
        return None
    try:
        if kill_node_at_step is None:
            raise ValueError("it needs --kill-node-at-step")
        ranks = [int(r) for r in text.split(",")]
        check_lose_ranks(ranks, nodes, workers_per_node)
    except ValueError as exc:
        console.print(f"[red]error:[/red] --lose-ranks {text}: {exc}", soft_wrap=True)
        raise typer.Exit(2)
    return ranks


@bench_app.command("table")
def bench_table(report_json: Path = typer.Argument(..., help="A `bench cluster` or `bench collectives` "
                                                               "--json report."),
                part: Optional[str] = typer.Option(None, help="A second table of the report (stall: a "
                                                             "checkpoint report's stall table; threads: its "
                                                             "default threads over one thread; headline: a "
                                                             "cluster report's narrow table; memory: a "
                                                             "sharded-checkpoint report's bytes per rank; "
                                                             "history: an encoder report's accuracy at each "
                                                             "evaluation)."),
                plot_path: Optional[Path] = typer.Option(None, "--plot", help="Also draw a `bench cluster` "
                                                                               "report's plot here, from the JSON.")):
    """Print a benchmark report as the Markdown table the README shows (generated from the JSON).

    Example: rayzip bench table docs/bench-codecs.json
    """
    import json

    from .bench import markdown_table

    try:
        report = json.loads(report_json.read_text())
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] cannot read {report_json}: {exc}")
        raise typer.Exit(2)
    table = markdown_table(report, part)
    if table is None:
        console.print(f"[red]error:[/red] {report_json} is not a `rayzip bench cluster` or `bench collectives` report",
                      soft_wrap=True)
        raise typer.Exit(2)
    print(table)
    if plot_path:
        if "methods" not in report or "bandwidth" not in report:
            console.print(f"[red]error:[/red] --plot draws `rayzip bench cluster` reports only, not {report_json}",
                          soft_wrap=True)
            raise typer.Exit(2)
        from .bench.cluster import plot

        plot(report, plot_path)


@bench_app.command("scaling")
def bench_scaling(
    methods: str = typer.Option("ps,dense", help="Comma-separated methods (as for bench cluster)."),
    nodes: str = typer.Option("1,2,3", help="Worker counts, comma-separated; 1 must be among them."),
    bandwidth: str = typer.Option("100mbit", help="Link rate of each worker node."),
    steps: int = typer.Option(60, min=20, help="Steps per run."),
    spec: Optional[Path] = typer.Option(None, help="Job spec (default: jobs/bench-synthetic.yaml)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """Scaling efficiency E(N) = T_N / (N * T_1) of each method, T the examples per second (root).

    Example: sudo rayzip bench scaling --nodes 1,2,4,8 --methods dense,group_topk_auto
    """
    from .bench.cluster import render_scaling_table, run_scaling_bench

    parts = [n.strip() for n in nodes.split(",") if n.strip()]
    if not all(n.isdigit() and int(n) >= 1 for n in parts) or "1" not in parts:
        console.print(f"[red]error:[/red] --nodes must include 1 (E(N) is relative to one worker) "
                      f"and hold only worker counts, got {nodes}")
        raise typer.Exit(2)
    counts = sorted({int(n) for n in parts})
    chosen, spec_path = _cluster_bench_inputs(methods, spec)
    report = _run_cluster(lambda log: run_scaling_bench(chosen, counts, bandwidth, spec_path, steps, log=log))
    console.print(render_scaling_table(report))
    _write_report(report, json_path)


@bench_app.command("sharded-checkpoint")
def bench_sharded_checkpoint(
    workers: int = typer.Option(4, min=1, help="Gloo ranks on this machine."),
    steps: int = typer.Option(30, min=1, help="AdamW steps of the GPT before the checkpoint."),
    rounds: int = typer.Option(3, min=1, help="Interleaved rounds, each saving and loading with every writer; "
                                              "rows give the medians of the slowest rank."),
    shard_size: Optional[int] = typer.Option(None, help="HSDP shard groups of this many ranks (default: FSDP "
                                                        "over every rank)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """A sharded model's checkpoint through torch.distributed.checkpoint: rayzip's storage layer
    against torch's FileSystemWriter (bytes, save and load seconds), ZipNN's ratio on the same
    pieces, and each rank's parameter, gradient and optimizer bytes against DDP's.

    Example: rayzip bench sharded-checkpoint --json out/bench-sharded-checkpoint.json
    """
    from .bench.sharded_checkpoint import render_table, run_sharded_checkpoint_bench

    try:
        import zipnn  # noqa: F401
    except ImportError:
        console.print("[red]error:[/red] the ZipNN baseline needs `pip install zipnn`", highlight=False)
        raise typer.Exit(2)
    try:
        report = run_sharded_checkpoint_bench(workers, steps, rounds, shard_size,
                                              log=lambda line: console.print(line, highlight=False))
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2)
    console.print(render_table(report))
    console.print(f"ratio rayzip / ZipNN: {report['rayzip_over_zipnn_ratio']:.3f}; save rayzip / torch: "
                  f"{report['save_s_rayzip_over_torch']:.3f}; load: {report['load_s_rayzip_over_torch']:.3f}; "
                  f"rank 0 holds {report['held_over_ddp']:.3f}x DDP's bytes", highlight=False)
    _write_report(report, json_path)


@bench_app.command("checkpoint")
def bench_checkpoint(
    model: str = typer.Option("mlp,gpt", help="Comma-separated models: mlp (the spec's), gpt (jobs/bench-gpt.yaml's), "
                                              "or module:function returning (model, loss(model, generator))."),
    spec: Optional[Path] = typer.Option(None, help="Job spec whose MLP and data to train (default: "
                                                     "jobs/bench-synthetic.yaml)."),
    steps: int = typer.Option(200, min=1, help="AdamW steps before the full checkpoint."),
    repeat: int = typer.Option(11, min=1, help="Timed rounds, every compressor once per round; the fastest "
                                                "of each counts (the JSON gives the median too)."),
    min_seconds: float = typer.Option(30.0, min=0.0, help="More rounds (up to 40) until a model's have taken "
                                                          "this long: a round of the MLP's takes seconds."),
    compressors: Optional[str] = typer.Option(None, help="Comma-separated compressors (default: rayzip, "
                                                         "rayzip-1t, zipnn-1t, zipnn, zstd-3; -1t: one thread; "
                                                         "also zstd-19)."),
    stall_model: str = typer.Option("gpt", help="Model whose training stall per checkpoint is measured "
                                                "('none': skip)."),
    stall_rounds: int = typer.Option(5, min=1, help="Checkpoints per method in the stall measurement."),
    stall_every: int = typer.Option(5, min=1, help="Training steps between checkpoints there."),
    stall_device: str = typer.Option("cpu", help="Where the stall model trains: cpu or cuda."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
):
    """Checkpoint ratio and speed (rayzip against zstd and ZipNN) on real training state, and the
    training stall per checkpoint (rayzip in the background, rayzip sync, torch.save).

    Example: rayzip bench checkpoint --json out/bench-checkpoint.json
    The stall alone, on a GPU: rayzip bench checkpoint --model none --stall-device cuda
    """
    from .bench.checkpoint import COMPRESSORS, DEFAULT_COMPRESSORS, render_table, run_checkpoint_bench

    chosen = tuple(c.strip() for c in compressors.split(",") if c.strip()) if compressors else DEFAULT_COMPRESSORS
    models = tuple(m.strip() for m in model.split(",") if m.strip())
    if stall_device not in ("cpu", "cuda"):
        console.print(f"[red]error:[/red] --stall-device {stall_device}: use cpu or cuda", highlight=False)
        raise typer.Exit(2)
    unknown = [c for c in chosen if c not in COMPRESSORS]
    if unknown:
        console.print(f"[red]error:[/red] unknown compressor(s) {', '.join(unknown)}; "
                      f"choose from {', '.join(COMPRESSORS)}", highlight=False)
        raise typer.Exit(2)
    bad = [m for m in models + (stall_model,) if m not in ("mlp", "gpt", "none") and ":" not in m]
    if bad:
        console.print(f"[red]error:[/red] --model/--stall-model {', '.join(bad)}: use mlp, gpt or module:function",
                      highlight=False)
        raise typer.Exit(2)
    if any(c.startswith("zipnn") for c in chosen):
        try:
            import zipnn  # noqa: F401
        except ImportError:
            console.print("[red]error:[/red] the zipnn baseline needs `pip install zipnn` "
                          "(or leave it out with --compressors)", highlight=False)
            raise typer.Exit(2)
    report = run_checkpoint_bench(spec, steps, repeat, chosen, tuple(m for m in models if m != "none"),
                                  stall_model=None if stall_model == "none" else stall_model,
                                  stall_rounds=stall_rounds, stall_every=stall_every,
                                  log=lambda line: console.print(line, highlight=False), min_seconds=min_seconds,
                                  stall_device=stall_device)
    console.print(render_table(report))
    for name, values in report["comparisons"].items():
        for key, value in values.items():
            console.print(f"{name} {key}: {value:.3f}", highlight=False)
    _write_report(report, json_path)


@k8s_app.command("render")
def k8s_render(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec (YAML)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write one file per manifest into this "
                                                                 "directory (default: print them)."),
    image: str = typer.Option("rayzip:0.1.0", help="Container image with rayzip installed (k8s/Dockerfile)."),
    namespace: Optional[str] = typer.Option(None, help="Kubernetes namespace."),
    gpus_per_worker: Optional[int] = typer.Option(None, min=0, help="GPUs per worker pod "
                                                                    "(default: 1 if scaling.use_gpu, else 0)."),
    worker_memory: str = typer.Option("16Gi", help="Memory per worker pod."),
    storage_path: Optional[str] = typer.Option(None, help="Ray Train storage shared by all pods "
                                                          "(s3://..., gs://... or a shared volume)."),
    ttl: int = typer.Option(3600, min=0, help="Seconds the RayJob's cluster stays after the job ends."),
):
    """ConfigMap, RayJob and RayCluster for SPEC: name, workers and GPUs come from the spec.

    Example: rayzip k8s render jobs/synthetic-gpu.yaml > rayjob.yaml
    """
    import yaml

    from .k8s import render

    spec = _load_or_exit(spec_path)
    try:
        manifests = render(spec, spec_path.read_text(), image=image, namespace=namespace,
                           gpus_per_worker=gpus_per_worker, worker_memory=worker_memory,
                           storage_path=storage_path, ttl_seconds=ttl)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2)
    if out is None:
        print(yaml.safe_dump_all(manifests.values(), sort_keys=False), end="")
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, manifest in manifests.items():
        (out / name).write_text(yaml.safe_dump(manifest, sort_keys=False))
        console.print(f"wrote {out / name}", highlight=False)


def _checkpoint_or_exit(action):
    from .checkpoint import CheckpointError

    try:
        return action()
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@checkpoint_app.command("inspect")
def checkpoint_inspect(path: Path = typer.Argument(..., help="Checkpoint directory."),
                       as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")):
    """Per-tensor codec, dtype, shape and compression, without decompressing.

    Example: rayzip checkpoint inspect ~/ray_results/RUN/checkpoint_000001/trainer
    """
    from rich.table import Table

    from .checkpoint import inspect

    info = _checkpoint_or_exit(lambda: inspect(path))
    if as_json:
        print(json.dumps(info, indent=2))
        return
    table = Table(title=f"{path}: {info['raw_bytes'] / 1e6:.2f} MB -> {info['stored_bytes'] / 1e6:.2f} MB "
                        f"({info['ratio'] or 0:.3f}x)" + (f", delta against {info['base']['path']}" if info["base"] else ""))
    for col in ("tensor", "dtype", "shape", "codec", "delta", "raw MB", "ratio"):
        table.add_column(col, justify="right" if col in ("raw MB", "ratio") else "left")
    for row in info["tensors"]:
        params = ",".join(f"{k}={v}" for k, v in row["params"].items())
        table.add_row(row["name"], row["dtype"], str(row["shape"]), row["codec"] + (f" ({params})" if params else ""),
                      "yes" if row["delta"] else "", f"{row['raw_bytes'] / 1e6:.3f}",
                      f"{row['raw_bytes'] / row['stored_bytes']:.3f}" if row["stored_bytes"] else "-")
    console.print(table)


@checkpoint_app.command("verify")
def checkpoint_verify(path: Path = typer.Argument(..., help="Checkpoint directory.")):
    """Restore every tensor, base chain included, and check every checksum. Exit 1 on any fault.

    Example: rayzip checkpoint verify ~/ray_results/RUN/checkpoint_000001/trainer
    """
    from .checkpoint import verify

    summary = _checkpoint_or_exit(lambda: verify(path))
    console.print(f"ok: {summary['tensors']} tensors and {summary['objects']} objects restore exactly"
                  + (f" (base {summary['base']})" if summary["base"] else ""), highlight=False)


@checkpoint_app.command("decompress")
def checkpoint_decompress(path: Path = typer.Argument(..., help="Checkpoint directory."),
                          out: Path = typer.Option(..., "--out", "-o", help="Write the state here with torch.save."),
                          allow_pickle: bool = typer.Option(
                              False, "--allow-pickle", help="Unpickle objects stored with allow_pickle=True: "
                                                            "this runs code from the checkpoint, so only for files "
                                                            "you trust.")):
    """Write the restored state as a plain torch.save file.

    Example: rayzip checkpoint decompress ~/ray_results/RUN/checkpoint_000001/trainer --out state.pt
    """
    import torch

    from .checkpoint import load

    state = _checkpoint_or_exit(lambda: load(path, allow_pickle=allow_pickle))
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    console.print(f"wrote {out}", highlight=False)


def main() -> None:  # pragma: no cover - console entry point
    app()
