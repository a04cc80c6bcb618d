"""The codecs' hot loops as torch ops, on numpy or cupy arrays, zero-copy both ways.

torch's CPU kernels are vectorized (half and bfloat16 conversion with F16C/AVX2, top-k,
reductions) and run on every core, where numpy converts to float16 one scalar at a time on
one core; on CUDA the same calls are CUDA kernels. A codec calls these and stays written
once, against ``xp``, for both devices. Where one pass beats a chain of torch ops (group
top-k, QSGD, DCT quantization), a fused C encoder (``_kernels.c``, built by setup.py) runs
on host arrays, and the torch/numpy path stays as the GPU path and the fallback.

Usage::

    half = to_fp16(flat)                 # numpy float16 (cupy on CUDA), rounded to nearest even
    bits = to_bf16_bits(flat)            # bfloat16 as its uint16 bit pattern
    back = from_bf16_bits(bits)          # float32
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .. import cuda
from ..cuda.group_topk import MAX_WIDTH
from ..xp import as_array
from ..xp import to_torch as _to_torch

try:  # the fused C encoders (setup.py); without them the torch/numpy path does the same work
    from . import _kernels as fused
except ImportError:  # pragma: no cover - depends on the build
    fused = None

__all__ = ["adam_update", "all_finite", "bf16_bits_finite", "rows_kernel_for", "from_bf16_bits", "fused", "fused_for",
           "momentum_update", "scale_checked", "to_bf16_bits", "to_fp16", "top_magnitude_rows", "widen"]


def fused_for(arr) -> bool:
    """True when the fused C encoders can take ``arr``: built, and a host (numpy) array."""
    return fused is not None and isinstance(arr, np.ndarray)


def rows_kernel_for(rows_width: int, arr) -> bool:
    """True when :func:`top_magnitude_rows` runs a kernel (host C or CUDA) on rows of
    ``arr`` that reports NaN/Inf as it reads them."""
    return fused_for(arr) or (cuda.enabled(arr) and rows_width <= MAX_WIDTH)


def _array(tensor: torch.Tensor):
    return as_array(tensor)[0]


def to_torch(arr) -> torch.Tensor:
    """A zero-copy tensor of ``arr``, also of a read-only one (a payload received as bytes):
    these kernels only read their inputs, so torch's warning about writes does not apply."""
    if isinstance(arr, torch.Tensor):
        return arr
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return _to_torch(arr)


def to_fp16(flat):
    """float32 ``flat`` as float16, round to nearest even; |x| > 65504 becomes Inf."""
    return _array(to_torch(flat).to(torch.float16))


def to_bf16_bits(flat):
    """float32 ``flat`` as bfloat16, round to nearest even, carried as uint16 bits."""
    return _array(to_torch(flat).to(torch.bfloat16).view(torch.int16)).view("<u2")


def from_bf16_bits(bits):
    """uint16 bfloat16 bit patterns as float32."""
    return _array(to_torch(bits.view("<i2")).view(torch.bfloat16).float())


def widen(values):
    """float16 (or any float) ``values`` as a new float32 array."""
    return _array(to_torch(values).float())


def all_finite(values) -> bool:
    """True when no entry is NaN or +-Inf. The common case costs one summing pass, no
    temporary: a NaN or an Inf anywhere makes the sum NaN or Inf, so a finite sum settles it
    (and a sum is cheaper than min and max). Only a sum that is not finite is checked again,
    exactly, by min and max, since finite entries can overflow a float sum."""
    tensor = to_torch(values)
    if tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return True
    low, high = torch.aminmax(tensor)  # NaN propagates through both; an Inf is one of them
    return bool(torch.isfinite(low) & torch.isfinite(high))


def scale_checked(tensor: torch.Tensor, factor: float) -> int | torch.Tensor:
    """``tensor *= factor`` in place, and the first index whose scaled value is NaN or +-Inf
    (-1: none): an int for a host tensor (found in the same pass where the fused C kernel
    takes it: float32, contiguous), and on a device a 0-d int64 tensor computed without
    waiting for the device: ``int()`` it when the answer is needed."""
    if fused is not None and tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous():
        return fused.scale_finite(tensor.detach().numpy(), factor)
    tensor.mul_(factor)
    if tensor.device.type == "cpu" and all_finite(tensor):  # nothing to wait for: the common case in one pass
        return -1
    bad = ~torch.isfinite(tensor.reshape(-1))
    first = torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1)  # argmax: the first maximal entry
    return int(first) if tensor.device.type == "cpu" else first


def _host_f32(*tensors: torch.Tensor | None) -> bool:
    """True when the fused C kernels can take every tensor given (None passes)."""
    return fused is not None and all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and
                                                   t.is_contiguous()) for t in tensors)


def _host(tensor: torch.Tensor | None):
    return None if tensor is None else tensor.detach().numpy()


def momentum_update(grad: torch.Tensor, held: torch.Tensor | None, out: torch.Tensor, momentum: float) -> None:
    """SGD's momentum buffer on an averaged gradient: ``out = momentum * held + grad`` (``held``
    None: ``grad``), and ``grad`` becomes it too. One pass on the host where torch ops take
    three; each product and sum rounded as SGD's ``buf.mul_(m).add_(g)`` rounds them."""
    if _host_f32(grad, held, out):
        fused.momentum_dense(_host(grad), _host(held), _host(out), momentum)
        return
    if held is None:
        out.copy_(grad)
        return
    torch.mul(held, momentum, out=out)
    out.add_(grad)
    grad.copy_(out)


def adam_update(grad: torch.Tensor, m_held: torch.Tensor | None, v_held: torch.Tensor | None, m_out: torch.Tensor,
                v_out: torch.Tensor, betas: tuple[float, float], corrections: tuple[float, float], eps: float) -> None:
    """Adam's moments of an averaged gradient into ``m_out`` and ``v_out`` (``m = (1 - b1) g +
    b1 m_held``, ``v = (1 - b2) g^2 + b2 v_held``; a held None counts as zero), and ``grad``
    becomes Adam's direction ``m / (sqrt(v c2) + eps) * c1``, ``corrections`` (c1, c2) being
    the bias corrections. One pass on the host where torch ops take nine."""
    (b1, b2), (c1, c2) = betas, corrections
    if _host_f32(grad, m_held, v_held, m_out, v_out):
        fused.adam_dense(_host(grad), _host(m_held), _host(v_held), _host(m_out), _host(v_out),
                         1 - b1, b1, 1 - b2, b2, c1, c2, eps)
        return
    torch.mul(grad, 1 - b1, out=m_out)
    if m_held is not None:
        m_out.add_(m_held, alpha=b1)
    torch.mul(grad, grad, out=v_out)
    v_out.mul_(1 - b2)
    if v_held is not None:
        v_out.add_(v_held, alpha=b2)
    torch.mul(v_out, c2, out=grad).sqrt_().add_(eps)
    torch.div(m_out, grad, out=grad).mul_(c1)


def bf16_bits_finite(bits) -> bool:
    """True when no uint16 bfloat16 bit pattern is NaN or +-Inf."""
    return all_finite(to_torch(bits.view("<i2")).view(torch.bfloat16))


def top_magnitude_rows(rows, k: int):
    """``(columns, values, finite)``: the column indices (int64, ascending in each row) of the
    k largest |values| in each row of the 2-D ``rows``, those values, and whether every entry
    was finite: False or True where the fused kernel checked as it read, None where not
    checked (the torch path; columns and values are then meaningless when it is False)."""
    if fused_for(rows):  # one pass with a k-entry heap per row; ties keep the lowest index
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        columns = np.empty((rows.shape[0], k), dtype=np.int64)
        values = np.empty((rows.shape[0], k), dtype=np.float32)
        finite = fused.group_topk(rows, rows.shape[1], k, columns, values)
        return columns, values, finite
    if rows_kernel_for(rows.shape[1], rows):  # CUDA: a warp per row, the threshold by a binary search
        from ..cuda.group_topk import top_magnitude_rows as on_gpu

        return on_gpu(rows, k)
    tensor = to_torch(rows)
    picked = torch.topk(tensor.abs(), k, dim=-1, sorted=False).indices
    columns = torch.sort(picked, dim=-1).values
    return _array(columns), _array(torch.gather(tensor, -1, columns)), None
