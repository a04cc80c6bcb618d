"""The parts of rayzip.cuda that need no GPU: when the kernels run, the DCT slot table, and
that every kernel source the codecs can ask for is well formed (the GPU tests compile and
run them: tests/integration/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzip import cuda
from rayzip.codecs.dct_quant import wire_order
from rayzip.cuda import dct_quant, group_topk, qsgd


def test_kernels_never_run_on_host_arrays_and_can_be_turned_off(monkeypatch):
    host = np.zeros(4, dtype=np.float32)
    assert not cuda.enabled(host) and not cuda.enabled(torch.zeros(4))
    with cuda.kernels_on(True):
        assert not cuda.enabled(host)

    class FakeCupyArray:  # only the module name is looked at
        __module__ = "cupy._core.core"

    device_array = FakeCupyArray()
    monkeypatch.delenv("RAYZIP_CUDA_KERNELS", raising=False)
    assert cuda.enabled(device_array)
    with cuda.kernels_on(False):
        assert not cuda.enabled(device_array)
        with cuda.kernels_on(True):
            assert cuda.enabled(device_array)
        assert not cuda.enabled(device_array)
    monkeypatch.setenv("RAYZIP_CUDA_KERNELS", "0")
    assert not cuda.enabled(device_array)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_the_allocator_is_left_alone_without_a_gpu():
    assert cuda.share_torch_allocator() is False


@pytest.mark.parametrize("kept", [1, 16, 20, 64])
def test_dct_slots_place_each_sent_coefficient_at_its_wire_position(kept):
    order = wire_order(8, kept)
    slot = dct_quant.slots(order)
    assert (slot >= 0).sum() == kept
    np.testing.assert_array_equal(np.argsort(np.where(slot >= 0, slot, 99))[:kept], order)


def test_every_kernel_source_formats():
    from rayzip.cuda import cast

    for bits in (1, 3, 4, 8, 12, 16):
        for kept in (16, 64):
            for vec in (0, 1):
                source = dct_quant._common() + dct_quant._ENCODE % {"bits": bits, "kept": kept, "vec": vec}
                assert f"#define BITS {bits}" in source and "%%" not in source and "%(" not in source
                for aligned in (0, 1):
                    source = dct_quant._common() + dct_quant._DECODE % {"bits": bits, "kept": kept, "aligned": aligned,
                                                                        "vec": vec}
                    assert f"#define KEPT {kept}" in source and "%%" not in source and "%(" not in source
    for vec in (0, 1):
        source = cast._SOURCE % {"vec": vec}
        assert "%1" in source and "%%" not in source and f"#define VEC {vec}" in source
    for per in (1, 32, 64):
        source = group_topk._SOURCE % {"per": per, "column_t": "long long", "value_t": "float"}
        assert "%1" in source and "%%" not in source  # the asm operands survive the formatting
    assert "#define PAIRS 8" in qsgd._ENCODE % {"pairs": 8}
