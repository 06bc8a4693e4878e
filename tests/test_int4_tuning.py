"""Int4Tuning (edge/kernels/int4_cuda.py): the knobs the int4 GEMV is compiled and launched
with, checked on the CPU (the kernels themselves: tests/test_int4_cuda.py on a GPU,
tests/test_kernels_compile.py for sm_87 / sm_90)."""

from __future__ import annotations

import pytest
import torch

from edge.kernels.int4_cuda import Int4Tuning


@pytest.mark.parametrize("bad", [dict(warps=3), dict(unroll=9), dict(direct_unroll=0), dict(tiles=3), dict(split=3), dict(prefetch=65), dict(carveout=101),
                                 dict(stage_bytes=1024), dict(prefill="cublas")])
def test_bad_knobs_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        Int4Tuning(**bad)


def test_default_tuning_follows_the_sm_count() -> None:
    """Few SMs (an Orin's 8 or 16): 4-warp CTAs of two row tiles, one column tile a stage
    in the direct kernels; many SMs: one row tile and one column tile a stage, one-token
    launches of at most the resident CTAs (the measured bests, docs/benchmarks.md)."""
    for sms in (8, 16):
        t = Int4Tuning.for_sms(sms)
        assert (t.warps, t.tiles, t.unroll) == (4, 2, 2)
        d = t.defines(torch.bfloat16)
        assert (d["CFG_INT4_WARPS"], d["CFG_INT4_UNROLL"], d["CFG_INT4_DIRECT_UNROLL"]) == (4, 2, 1)
    assert not Int4Tuning.for_sms(16).resident_grid
    t = Int4Tuning.for_sms(132)
    assert (t.warps, t.tiles, t.unroll, t.resident_grid) == (8, 1, 1, True)
    d = t.defines(torch.float16)
    assert (d["CFG_INT4_UNROLL"], d["CFG_INT4_DIRECT_UNROLL"]) == (1, 1)


def test_bench_int4_arguments() -> None:
    """tools/bench_int4.py takes one --tokens for every mode (a gemv step's tokens, a
    prefill prompt); unset, main gives each mode its default."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_int4

    p = bench_int4.build_parser()
    assert p.parse_args(["gemv", "--tokens", "5", "--sms", "16", "--sweep"]).tokens == 5
    assert p.parse_args(["gemv"]).tokens is None and p.parse_args(["prefill"]).tokens is None
