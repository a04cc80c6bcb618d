"""CUDA kernels (cupy) for the hot loops that torch ops do in several passes, and the seam
that lets cupy and torch share one allocator and one stream.

Each kernel module holds one job and a function that runs it on cupy arrays; the codecs call
that function when the array is on a GPU and these kernels are on (:func:`enabled`), and keep
their torch/numpy path as the fallback and the reference the GPU tests compare against.

* :mod:`.group_topk`: the k largest magnitudes of every group, one block per group, selected
  by radix select in shared memory, emitted in ascending column order;
* :mod:`.dct_quant`: 8x8 DCT-II, scale, quantize (and the inverse), fused per block;
* :mod:`.qsgd`: bucket norm, stochastic rounding with the counter hash, codes (and decode);
* :mod:`.planes`: checkpoint XOR, rotation and byte-plane split (and join).

Usage::

    from rayzip import cuda
    cuda.share_torch_allocator()      # cupy allocates through torch's caching allocator
    if cuda.enabled(arr):             # a cupy array, kernels not turned off
        ...

``RAYZIP_CUDA_KERNELS=0`` turns the kernels off (the torch-op path then runs on the GPU).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from functools import lru_cache

__all__ = ["enabled", "kernels_on", "raw_kernel", "share_torch_allocator", "torch_stream"]

_FORCED: list[bool] = []  # a stack of overrides from kernels_on(); empty means the environment decides


def _cupy():
    try:
        import cupy
    except Exception:  # pragma: no cover - depends on the machine
        return None
    return cupy


def enabled(arr) -> bool:
    """True when ``arr`` is a cupy array and the kernels are on."""
    if _FORCED:
        on = _FORCED[-1]
    else:
        on = os.environ.get("RAYZIP_CUDA_KERNELS", "1") != "0"
    return on and type(arr).__module__.startswith("cupy")


@contextmanager
def kernels_on(on: bool):
    """Within the block, the kernels are on or off whatever the environment says (the
    benchmark times both paths in one run, the tests compare them)."""
    _FORCED.append(bool(on))
    try:
        yield
    finally:
        _FORCED.pop()


@lru_cache(maxsize=None)
def raw_kernel(source: str, name: str):
    """A compiled cupy RawKernel, built once per process (cupy caches the binary on disk)."""
    cupy = _cupy()
    return cupy.RawKernel(source, name, options=("-std=c++17",))


_SHARED = False


def share_torch_allocator() -> bool:
    """Have cupy allocate through torch's caching allocator, on torch's current stream, so
    that the two libraries do not hold two pools of the same GPU's memory (each would keep
    what the other needs). Idempotent; returns whether it is in effect."""
    global _SHARED
    if _SHARED:
        return True
    cupy = _cupy()
    if cupy is None:
        return False
    import torch

    if not torch.cuda.is_available():
        return False

    def malloc(size: int, device: int) -> int:
        return torch.cuda.caching_allocator_alloc(size, device, torch.cuda.current_stream(device))

    def free(ptr: int, device: int) -> None:
        try:
            torch.cuda.caching_allocator_delete(ptr)
        except Exception:  # at interpreter exit torch's module is torn down first; the process frees it all
            pass

    allocator = cupy.cuda.memory.PythonFunctionAllocator(malloc, free)
    cupy.cuda.set_allocator(allocator.malloc)
    _SHARED = True
    return True


@contextmanager
def torch_stream(device=None):
    """cupy work inside the block is queued on torch's current stream of ``device``, so that
    it reads what torch queued before it and torch reads its results in order. Nothing to do
    where cupy was never imported (no CUDA array has crossed the seam)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        yield
        return
    import torch

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index or 0):
        yield
