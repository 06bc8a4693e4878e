"""Int4Tuning (edge/kernels/int4_cuda.py): the knobs the int4 GEMV is compiled and launched
with, checked on the CPU (the kernels themselves: tests/test_int4_cuda.py on a GPU,
tests/test_kernels_compile.py for sm_87 / sm_90)."""

from __future__ import annotations

import pytest
import torch

from edge.kernels.int4_cuda import Int4Tuning


@pytest.mark.parametrize("bad", [dict(smem_stages=1), dict(smem_stages=17), dict(smem_stages=-2), dict(warps=3),
                                 dict(tiles=3), dict(split=3), dict(prefetch=65)])
def test_bad_knobs_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        Int4Tuning(**bad)


def test_the_ring_is_compiled_in_and_sized_per_cta() -> None:
    """int4_gemv.cu's Ring: a stage a warp holds, per (column tile, row tile) slot, 512 B of
    codes, 16 scales and 16 zero points; the register path takes no ring."""
    assert Int4Tuning().ring_bytes(2, torch.float16) == 0
    assert Int4Tuning().defines(torch.float16)["CFG_INT4_SMEM_STAGES"] == 0
    t = Int4Tuning(warps=4, unroll=2, smem_stages=4)
    assert t.defines(torch.bfloat16)["CFG_INT4_SMEM_STAGES"] == 4
    assert t.ring_bytes(2, torch.float16) == 4 * 4 * (2 * 2) * (512 + 32 + 16)
    assert t.ring_bytes(1, torch.float32) == 4 * 4 * (2 * 1) * (512 + 64 + 16)
    # An AGX Orin CTA (163 KB of shared memory at most): a 4-warp ring of 6 stages beside
    # one staged 12288-column bf16 row.
    assert Int4Tuning(warps=4, smem_stages=6).ring_bytes(2, torch.float16) + (12288 + 16) * 2 < 163 << 10
