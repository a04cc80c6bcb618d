"""Two ranks on one GPU over gloo with CUDA tensors (issue 50): every line of the multi-rank
CUDA path but NCCL itself (NCCL refuses two ranks on one device) runs here: the kernels, the
hook's side stream and worker thread, CUDA futures, the sparse ring's sends staged through
the host, local steps' exchange thread on the caller's stream, a restart onto CUDA, and a
NaN on one rank.

Each scenario runs twice, on the CPU and on the GPU, from the same seeds, and the two must
agree bit for bit where the arithmetic is the same. It is made the same on purpose: the
models' weights and inputs are small multiples of powers of two, so every product and sum
in forward and backward is exact in float32 whatever the order (cuBLAS's and the CPU's
differ), and the codecs' GPU kernels round as the host's do. Where the arithmetic is not
the same (AdamW updates a model, whose next matrix products then round in each library's
own order), the test says so and compares each device with itself.

Skipped without a GPU. ``python tests/integration/test_gpu_ranks.py cpu`` runs the CPU side alone (the
harness's own check on a machine without one).
"""

from __future__ import annotations

import sys
import tempfile
import traceback

import numpy as np
import pytest
import torch

from gloo_world import run_world
from restarts import reload_from_checkpoint

HAVE_GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401
except Exception:  # pragma: no cover - depends on the machine
    HAVE_GPU = False

STEPS = 3
SEGMENT_MB = 0.1  # the exact model's 86,544 parameters in two segments


def _exact_model(device):
    """An MLP whose weights are -1/4, 0 or 1/4 (see the module docstring: exact arithmetic)."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=gen).float() / 4)
    return model.to(device)


def _batch(rank, step, device, nan=False):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(-2, 3, (32, 64), generator=gen).float()
    target = torch.randint(-1, 2, (32, 16), generator=gen).float()
    if nan:
        x[3, 7] = float("nan")
    return x.to(device), target.to(device)


def _ddp(device, spec, on_nonfinite="raise", momentum=None):
    from rayzip.torch import compress, ddp_kwargs

    model = _exact_model(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None,
                                                    **ddp_kwargs(spec))
    return ddp, compress(ddp, spec, momentum=momentum, on_nonfinite=on_nonfinite)


def _flat_grad(ddp):
    return torch.cat([p.grad.flatten() for p in ddp.parameters()]).cpu().numpy().copy()


def _hook(rank, device, nan_at=None, on_nonfinite="raise", momentum=None, **spec):
    """STEPS steps of the hook on fixed weights (the error feedback still moves): each step's
    averaged gradient, whether every rank skipped it, and the segments exchanged."""
    from rayzip.torch import CompressionConfig

    spec = CompressionConfig(segment_mb=SEGMENT_MB, **spec)
    ddp, state = _ddp(device, spec, on_nonfinite, momentum)
    out = []
    for step in range(STEPS):
        ddp.zero_grad()
        x, target = _batch(rank, step, device, nan=rank == 1 and step == nan_at)
        (ddp(x) * target).sum().backward()
        out.append({"grad": _flat_grad(ddp), "skipped": state.last_step.skipped,
                    "why": state.last_step.nonfinite, "bytes": state.last_step.bytes_sent})
    return {"steps": out, "segments": len(state.segments), "collective": state.communicator.name}


def _nan_raises(rank, device):
    """A NaN on rank 1 at step 1 under on_nonfinite="raise": what each rank raised."""
    try:
        _hook(rank, device, nan_at=1, codec="group_topk", density=0.05)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


class _Elementwise(torch.nn.Module):
    """y = x * w per entry: gradients are sums of integers, exact in any order."""

    def __init__(self, device):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.w = torch.nn.ParameterList([torch.nn.Parameter((torch.randint(-4, 5, (n,), generator=gen) / 4).to(device))
                                         for n in (3000, 700)])

    def forward(self, xs):
        return [x * w for x, w in zip(xs, self.w)]


def _local_steps(rank, device, overlap=True):
    """Local steps, H = 2, group top-k on the pseudo-gradients, an outer SGD of learning rate
    1 (exact): the synchronized parameters after each round."""
    from rayzip.torch import CompressionConfig
    from rayzip.torch.local_steps import LocalSteps

    model = _Elementwise(device)
    local = LocalSteps(model.named_parameters(), every=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                       compression=CompressionConfig(codec="group_topk", density=0.05), overlap=overlap)
    inner = torch.optim.SGD(model.parameters(), lr=2.0**-6)
    rounds = []
    for step in range(8):
        gen = torch.Generator().manual_seed(100 * rank + step)
        xs = [torch.randint(-2, 3, (8, w.numel()), generator=gen).float().to(device) for w in model.w]
        ts = [torch.randint(-1, 2, (8, w.numel()), generator=gen).float().to(device) for w in model.w]
        inner.zero_grad()
        sum((y * t).sum() for y, t in zip(model(xs), ts)).backward()
        assert local.gradient_ok(step)
        inner.step()
        if local.after_inner_step(force=step == 7):
            rounds.append(torch.cat([p.detach().flatten() for p in model.w]).cpu().numpy().copy())
    return {"rounds": rounds, "bytes": local.state.totals["bytes_sent"]}


def _restart(rank, device):
    """AdamW with group top-k: five steps straight, and two steps, a checkpoint of model,
    optimizer and hook (residuals on the device), a fresh model, optimizer and hook loaded
    from it, three more. Both final weights."""
    from rayzip.torch import CompressionConfig

    spec = CompressionConfig(codec="group_topk", density=0.05, segment_mb=SEGMENT_MB)

    def build():
        ddp, state = _ddp(device, spec)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), state

    def steps(ddp, opt, lo, hi):
        for step in range(lo, hi):
            x, target = _batch(rank, step, device)
            opt.zero_grad()
            (ddp(x) * target).sum().backward()
            opt.step()

    def weights(ddp):
        return torch.cat([p.detach().flatten() for p in ddp.parameters()]).cpu().numpy().copy()

    ddp, opt, state = build()
    steps(ddp, opt, 0, 5)
    straight = weights(ddp)
    with tempfile.TemporaryDirectory() as directory:
        ddp, opt, state = build()
        steps(ddp, opt, 0, 2)
        ddp, opt, state = reload_from_checkpoint(directory, ddp, opt, state, build)
        loaded = _devices(state.memory.residuals)
        steps(ddp, opt, 2, 5)
    return {"straight": straight, "restarted": weights(ddp), "loaded_on": loaded,
            "held_on": _devices(state.memory.residuals)}


def _devices(arrays: dict) -> list[str]:
    """Where the error-feedback residuals live: "cuda" or "cpu", whatever their kind."""
    from rayzip.xp import array_module, is_torch

    return sorted({("cuda" if a.is_cuda else "cpu") if is_torch(a) else
                   ("cuda" if array_module(a).__name__ == "cupy" else "cpu") for a in arrays.values()})


SCENARIOS = {
    "hook_overlap": lambda rank, device: _hook(rank, device, codec="group_topk", density=0.05, collective="allgather"),
    "hook_serial": lambda rank, device: _hook(rank, device, codec="group_topk", density=0.05, collective="allgather",
                                              overlap=False),
    "sparse_ring": lambda rank, device: _hook(rank, device, codec="group_topk", density=0.05, collective="ring"),
    "dct_4bit": lambda rank, device: _hook(rank, device, codec="dct_quant", bits=4),
    "momentum": lambda rank, device: _hook(rank, device, codec="group_topk", density=0.05, momentum_correction=True,
                                           momentum=0.9),
    "local_steps": _local_steps,
    "restart": _restart,
    "nan_skip": lambda rank, device: _hook(rank, device, nan_at=1, on_nonfinite="skip", codec="group_topk",
                                           density=0.05),
    "nan_raise": _nan_raises,
}


def _all(rank, world, device, names):
    """Every scenario on this rank; a failure is returned with its traceback, not raised, so
    that the others still run (a collective left waiting fails at run_world's timeout)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    out = {}
    for name in names:
        try:
            out[name] = ("ok", SCENARIOS[name](rank, device))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


def run(device: str, names=tuple(SCENARIOS)):
    """{scenario: [rank 0's result, rank 1's]} on ``device``."""
    ranks = run_world(_all, 2, device, list(names), timeout_s=120)
    return {name: [ranks[r][name] for r in range(2)] for name in names}


@pytest.fixture(scope="module")
def runs():
    return {device: run(device) for device in ("cpu", "cuda")}


def _ok(runs, name):
    """Both devices' results for both ranks, failing with the rank's traceback if it raised."""
    out = {}
    for device in ("cpu", "cuda"):
        for rank, (status, value) in enumerate(runs[device][name]):
            assert status == "ok", f"{name} on {device}, rank {rank}:\n{value}"
        out[device] = [value for _, value in runs[device][name]]
    return out["cpu"], out["cuda"]


def _same_steps(cpu, gpu):
    for rank in range(2):
        for step, (a, b) in enumerate(zip(cpu[rank]["steps"], gpu[rank]["steps"])):
            assert a["skipped"] == b["skipped"] and a["why"] == b["why"], (rank, step)
            assert a["bytes"] == b["bytes"], (rank, step)
            np.testing.assert_array_equal(b["grad"], a["grad"], err_msg=f"rank {rank}, step {step}")
        np.testing.assert_array_equal(gpu[0]["steps"][-1]["grad"], gpu[1]["steps"][-1]["grad"])  # replicas agree


pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and cupy (pip install 'rayzip[gpu]')")


@pytest.mark.parametrize("name", ["hook_overlap", "hook_serial", "sparse_ring", "dct_4bit"])
def test_two_cuda_ranks_over_gloo_average_bitwise_as_the_cpu_does(runs, name):
    cpu, gpu = _ok(runs, name)
    assert gpu[0]["segments"] >= 2 and gpu[0]["collective"] == cpu[0]["collective"]
    _same_steps(cpu, gpu)
    assert not np.array_equal(gpu[0]["steps"][0]["grad"], gpu[0]["steps"][1]["grad"])


def test_overlapped_and_serial_hooks_agree_on_cuda(runs):
    _, overlapped = _ok(runs, "hook_overlap")
    _, serial = _ok(runs, "hook_serial")
    for rank in range(2):
        for a, b in zip(overlapped[rank]["steps"], serial[rank]["steps"]):
            np.testing.assert_array_equal(a["grad"], b["grad"])


def test_momentum_correction_on_cuda_matches_the_cpu(runs):
    cpu, gpu = _ok(runs, "momentum")
    _same_steps(cpu, gpu)


def test_local_steps_on_two_cuda_ranks_synchronize_as_on_the_cpu(runs):
    cpu, gpu = _ok(runs, "local_steps")
    for rank in range(2):
        assert len(gpu[rank]["rounds"]) == len(cpu[rank]["rounds"]) == 4
        for a, b in zip(cpu[rank]["rounds"], gpu[rank]["rounds"]):
            np.testing.assert_array_equal(b, a)
        assert gpu[rank]["bytes"] == cpu[rank]["bytes"]
    np.testing.assert_array_equal(gpu[0]["rounds"][-1], gpu[1]["rounds"][-1])


def test_a_restart_onto_cuda_continues_exactly(runs):
    cpu, gpu = _ok(runs, "restart")
    for rank in range(2):
        assert gpu[rank]["loaded_on"] == gpu[rank]["held_on"] == ["cuda"]
        assert cpu[rank]["loaded_on"] == cpu[rank]["held_on"] == ["cpu"]
        np.testing.assert_array_equal(gpu[rank]["restarted"], gpu[rank]["straight"])
        np.testing.assert_array_equal(cpu[rank]["restarted"], cpu[rank]["straight"])
    np.testing.assert_array_equal(gpu[0]["restarted"], gpu[1]["restarted"])


def test_a_nan_on_one_cuda_rank_skips_the_step_on_both_as_on_the_cpu(runs):
    cpu, gpu = _ok(runs, "nan_skip")
    for rank in range(2):
        assert [s["skipped"] for s in gpu[rank]["steps"]] == [False, True, False]
        assert "rank 1's gradient is not finite" in gpu[rank]["steps"][1]["why"]
        assert np.isnan(gpu[rank]["steps"][1]["grad"]).all()
    _same_steps(cpu, gpu)


def test_a_nan_on_one_cuda_rank_raises_on_both_alike(runs):
    cpu, gpu = _ok(runs, "nan_raise")
    assert gpu[0].startswith("NonFiniteError") and "rank 1's gradient is not finite" in gpu[0]
    assert gpu == cpu


def _delayed_rank(rank, world, delay):
    """The overlapped hook's gradients, with ``delay``: the side stream sleeps before it
    writes the results, so that DDP would read them unwritten unless its stream waits."""
    torch.cuda.set_device(0)
    if delay:
        from rayzip.engine import GradientExchange

        exchange = GradientExchange.exchange_into

        def slow(self, flat, out, ready=None):
            exchange(self, flat, out, ready)
            torch.cuda._sleep(200_000_000)  # about 0.1 s of the side stream's time

        GradientExchange.exchange_into = slow
    result = _hook(rank, "cuda", codec="group_topk", density=0.05, collective="allgather")
    return [step["grad"] for step in result["steps"]]


def test_ddp_reads_the_overlapped_results_only_once_the_side_stream_wrote_them():
    plain = run_world(_delayed_rank, 2, False, timeout_s=120)
    delayed = run_world(_delayed_rank, 2, True, timeout_s=120)
    for rank in range(2):
        for a, b in zip(plain[rank], delayed[rank]):
            np.testing.assert_array_equal(b, a)


def _summary(results) -> None:
    for name, ranks in results.items():
        for rank, (status, value) in enumerate(ranks):
            print(f"{name} rank {rank}: {status}" + (f"\n{value}" if status != "ok" else ""))


if __name__ == "__main__":
    _summary(run(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
