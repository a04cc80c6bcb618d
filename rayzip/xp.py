"""The array-module seam: numpy on the CPU, cupy on CUDA, torch in and out by DLPack.

Every codec is written once against numpy-compatible calls on ``xp``, the module returned
by :func:`array_module`. Torch tensors cross the seam without copies where the dtype
allows it (CPU tensors share memory with numpy, CUDA tensors with cupy via DLPack).

Usage::

    arr, xp = as_array(torch_tensor)   # zero-copy view, plus numpy or cupy
    ...                                 # numpy-compatible work on arr with xp
    out = to_torch(arr)                 # zero-copy back to torch
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import numpy as np

try:  # cupy is the optional `rayzip[gpu]` extra; CPU-only installs never import it.
    import cupy as _cupy
except Exception:  # pragma: no cover - depends on the machine
    _cupy = None

__all__ = [
    "address",
    "array_module",
    "as_array",
    "asnumpy",
    "cupy_available",
    "is_dtensor",
    "is_torch",
    "keep_freed_memory",
    "local_part",
    "to_torch",
]


def cupy_available() -> bool:
    """True when cupy imported and sees at least one CUDA device."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # pragma: no cover - depends on the machine
        return False


def address(arr: Any) -> int:
    """Where ``arr``'s first element lives, in host or device memory (the CUDA array
    interface for device arrays, numpy's for host ones)."""
    interface = getattr(arr, "__cuda_array_interface__", None) or arr.__array_interface__
    return int(interface["data"][0])


def array_module(arr: Any):
    """numpy or cupy, whichever owns ``arr``."""
    if _cupy is not None and isinstance(arr, _cupy.ndarray):
        return _cupy
    return np


def is_torch(obj: Any) -> bool:
    # torch is only looked up, never imported here: numpy-only callers stay torch-free.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_dtensor(obj: Any) -> bool:
    # Looked up like torch itself: torch.distributed.tensor costs every process that imports
    # it most of a second (DTensor's op tables, sympy), and one that never did holds none.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def local_part(tensor: Any) -> Any:
    """This rank's part of ``tensor``: its local shard where it is a DTensor, else itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def as_array(x: Any) -> tuple[Any, Any]:
    """Return ``(array, xp)`` for a torch tensor, numpy array or cupy array.

    Torch CPU tensors become numpy views and CUDA tensors cupy views (no copy). bfloat16,
    which numpy lacks, is widened to float32 first: that one case copies.
    """
    if is_torch(x):
        import torch

        t = x.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.is_cuda:
            if _cupy is None:
                raise RuntimeError("a CUDA tensor needs cupy: pip install 'rayzip[gpu]'")
            if not t.is_contiguous():
                t = t.contiguous()
            from .cuda import share_torch_allocator

            share_torch_allocator()  # cupy's temporaries then come from torch's pool
            return _cupy.from_dlpack(t), _cupy
        return t.resolve_conj().resolve_neg().numpy(), np
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        return x, _cupy
    return np.asarray(x), np


def asnumpy(arr: Any) -> np.ndarray:
    """A host numpy array (copies device arrays to the host, leaves numpy alone)."""
    if _cupy is not None and isinstance(arr, _cupy.ndarray):
        return _cupy.asnumpy(arr)
    return np.asarray(arr)


def to_torch(arr: Any):
    """Zero-copy torch view of a numpy or cupy array."""
    import torch

    if _cupy is not None and isinstance(arr, _cupy.ndarray):
        return torch.from_dlpack(arr)
    return torch.from_numpy(np.ascontiguousarray(arr))


_KEPT = False


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep large freed blocks for reuse instead of unmapping them.

    By default glibc serves every allocation above 32 MiB (and, adaptively, smaller ones)
    with a fresh mmap and unmaps it on free, so the next step's gradient-sized array is
    page-faulted in again, one 4 KiB page at a time: on this project's 2-core machines
    that held a float16 cast to 4.7 GB/s where the same cast into reused memory ran at
    24 GB/s. A training step allocates such arrays every step (compensated gradients,
    payloads, residuals), as the codecs do; the process's resident memory then stays at
    its high-water mark, as torch's CUDA caching allocator does on GPUs. Set
    ``RAYZIP_KEEP_FREED_MEMORY=0`` to leave malloc alone. Returns whether it is in effect.
    """
    global _KEPT
    if _KEPT or os.environ.get("RAYZIP_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return _KEPT
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, say): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    _KEPT = bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    return _KEPT
