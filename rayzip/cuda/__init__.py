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
import threading
from contextlib import contextmanager
from functools import lru_cache

__all__ = ["enabled", "kernels_on", "nonfinite_flag", "raw_kernel", "share_torch_allocator", "torch_stream"]

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


class _Flag:
    """One int32 in pinned host memory that kernels write (``*flag = 1``) when they meet a
    non-finite value. Under unified addressing a kernel reaches pinned host memory by its
    host address, so a call needs neither a device allocation and a memset to clear the flag
    nor a device-to-host copy to read it: the host clears it before the launch and reads it
    once the stream is done."""

    def __init__(self):
        import cupy
        import numpy as np

        self._stream = cupy.cuda.get_current_stream
        self._memory = cupy.cuda.alloc_pinned_memory(4)
        self._host = np.frombuffer(self._memory, dtype=np.int32, count=1)
        self.pointer = np.uint64(self._memory.ptr)

    def finite(self) -> bool:
        """Wait for the current stream; whether no kernel launched since the flag was handed
        out set it."""
        self._stream().synchronize()
        return not self._host[0]


_FLAGS = threading.local()  # one flag per thread: the hook's exchange thread encodes beside the caller


def nonfinite_flag() -> _Flag:
    """This thread's :class:`_Flag`, cleared, for the kernels about to be launched.

    Usage::

        flag = nonfinite_flag()
        kernel(grid, block, (..., flag.pointer))
        ...                                  # host work while the kernel runs
        finite = flag.finite()
    """
    flag = getattr(_FLAGS, "flag", None)
    if flag is None:
        flag = _FLAGS.flag = _Flag()
    flag._host[0] = 0
    return flag


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

    # Each block cupy asks for is a torch uint8 tensor that the cupy memory owns: when cupy
    # drops the memory, the tensor goes and torch's cache takes the block back. (A pair of
    # Python malloc/free callbacks instead had cupy call the free function from its
    # finalizer, which the garbage collector could run after clearing that function, leaking
    # the block with an "Exception ignored in ... __dealloc__" warning.)
    memory = cupy.cuda.memory

    def malloc(size: int):
        device = cupy.cuda.runtime.getDevice()
        owner = torch.empty(max(size, 1), dtype=torch.uint8, device=torch.device("cuda", device))
        return memory.MemoryPointer(memory.UnownedMemory(owner.data_ptr(), size, owner, device), 0)

    cupy.cuda.set_allocator(malloc)
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
    with _cupy_stream(stream.cuda_stream, stream.device.index or 0):
        yield


class _StreamHandle:
    """A raw stream handle under the CUDA stream protocol, which cupy 14 reads."""

    def __init__(self, pointer: int):
        self.pointer = pointer

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.pointer


@lru_cache(maxsize=64)  # torch hands out streams from a fixed pool: few distinct handles
def _cupy_stream(pointer: int, device: int):
    """cupy's view of the stream ``pointer`` on ``device``, which it does not own. cupy 14
    deprecates ExternalStream (a warning on every call) for Stream.from_external; cupy 13,
    which the CUDA 12 extra still allows, has only the former."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(pointer))
    return cupy.cuda.ExternalStream(pointer, device)
