"""The int8 linears' tuning per GPU size and the int8 benchmark's arguments (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from edge.kernels.int8_cuda import MODES, Int8Tuning


def test_few_sms_take_one_column_tile_a_stage() -> None:
    """An Orin's 8 or 16 SMs get one column tile a tensor-core stage (four in the one-tile
    norm mode, whose CTAs have 4 warps), the decode token's qkv and gate_up on the
    tensor-core kernel, and the norm and residual modes prestaged (the one-tile ones in
    units of two row tiles); a full GPU two column tiles everywhere, the GEMV for every
    decode token and only the norm modes prestaged; the rest of the tuning is the default
    either way, and the kernels see it as defines."""
    for sms in (8, 16, 32):
        t = Int8Tuning.for_sms(sms)
        d = t.mma_defines()
        assert (d["CFG_INT8_MMA_UNROLL"], d["CFG_INT8_MMA_NORM_UNROLL"]) == (1, 4)
        assert t == Int8Tuning(mma_unroll=1, mma_norm_unroll=4, mma_norm_warps=4, mma_one_token=("norm_", "norm_swiglu_"),
                               mma_prestage=("norm_", "residual_", "norm_swiglu_"), mma_pair_tiles=("norm_", "residual_"))
        assert d["CFG_INT8_MMA_WARPS"] == 8 and t.mma_defines("norm_")["CFG_INT8_MMA_WARPS"] == 4
        assert t.warps_of("norm_") == 4 and t.warps_of("norm_swiglu_") == t.warps_of("residual_") == 8
    assert Int8Tuning.for_sms(132) == Int8Tuning(mma_prestage=("norm_", "norm_swiglu_"))
    assert Int8Tuning.for_sms(132).mma_defines("norm_")["CFG_INT8_MMA_WARPS"] == 8
    assert Int8Tuning().mma_one_token == ()
    d = Int8Tuning().mma_defines()
    assert (d["CFG_INT8_MMA_UNROLL"], d["CFG_INT8_MMA_NORM_UNROLL"]) == (2, 2)


def test_one_token_modes_are_gemv_modes() -> None:
    """mma_one_token names GEMV modes (infixes); anything else is refused at once."""
    import pytest

    assert Int8Tuning(mma_one_token=("norm_swiglu_", "norm_")).mma_one_token == ("norm_swiglu_", "norm_")
    with pytest.raises(ValueError, match="mma_one_token"):
        Int8Tuning(mma_one_token=("swiglu",))


def test_prestaged_modes_are_tensor_core_modes() -> None:
    """mma_prestage names tensor-core modes (GEMV infixes and the argmax ones); anything
    else is refused at once."""
    import pytest

    assert Int8Tuning(mma_prestage=("norm_", "norm_argmax_")).mma_prestage == ("norm_", "norm_argmax_")
    with pytest.raises(ValueError, match="mma_prestage"):
        Int8Tuning(mma_prestage=("direct_",))


def test_warps_are_powers_of_two() -> None:
    """Both warp counts (every mode's, the one-tile norm mode's) are checked at once."""
    import pytest

    for bad in ({"mma_warps": 3}, {"mma_norm_warps": 6}):
        with pytest.raises(ValueError, match="warps"):
            Int8Tuning(**bad)


def test_carveout_is_a_percentage() -> None:
    """The tensor-core kernels' preferred carveout: 72 % unless told, None (the driver's
    choice) or 0..100."""
    import pytest

    assert Int8Tuning().mma_carveout == 72 and Int8Tuning.for_sms(16).mma_carveout == 72
    assert Int8Tuning(mma_carveout=None).mma_carveout is None
    for bad in (-1, 101):
        with pytest.raises(ValueError):
            Int8Tuning(mma_carveout=bad)


def test_paired_modes_are_one_tile_modes() -> None:
    """mma_pair_tiles names one-tile modes (plain, norm, residual); a two-tile mode or
    anything else is refused at once."""
    import pytest

    assert Int8Tuning(mma_pair_tiles=("", "norm_")).mma_pair_tiles == ("", "norm_")
    assert Int8Tuning().mma_pair_tiles == ()
    for bad in (("norm_swiglu_",), ("argmax_",), ("residual",)):
        with pytest.raises(ValueError, match="mma_pair_tiles"):
            Int8Tuning(mma_pair_tiles=bad)


def test_bench_int8_arguments() -> None:
    """tools/bench_int8.py: a verify step's 5 tokens unless told, the SM count, the sweep."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_int8

    p = bench_int8.build_parser()
    a = p.parse_args(["--sms", "16", "--sweep"])
    assert (a.tokens, a.sms, a.sweep) == (5, 16, True)
    assert p.parse_args(["--tokens", "1", "--only", "unroll2"]).only == "unroll2"
    # The one-token comparison: every GEMV mode on either kernel, whatever the SM count.
    for sms in (16, 132):
        t = bench_int8._tunings(sms)
        assert t["one_token_gemv"].mma_one_token == ()
        assert set(t["one_token_mma"].mma_one_token) == {infix for infix, _ in MODES.values()}
        # Paired row tiles: the modes named are prestaged too, whatever the SM count's default.
        assert t["pair_none"].mma_pair_tiles == ()
        for label, modes in (("pair_residual", {"residual_"}), ("pair_norm", {"norm_"}),
                             ("pair_norm_residual", {"norm_", "residual_"})):
            assert set(t[label].mma_pair_tiles) == modes and modes <= set(t[label].mma_prestage), label


def test_bench_tunings_chosen() -> None:
    """tools/bench_linears.py: the default alone, every tuning with --sweep, the named ones
    with --only (--sweep or not); a misspelt name stops the run instead of timing nothing."""
    import argparse

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from bench_linears import chosen

    labels = ["default", "a", "b", "c"]

    def args(sweep: bool = False, only: str = "") -> argparse.Namespace:
        return argparse.Namespace(sweep=sweep, only=only)

    assert chosen(args(), labels) == ["default"]
    assert chosen(args(sweep=True), labels) == labels
    assert chosen(args(only="c,a"), labels) == ["default", "a", "c"]
    assert chosen(args(sweep=True, only="b"), labels) == ["default", "b"]
    with pytest.raises(SystemExit, match="unknown tunings"):
        chosen(args(only="d"), labels)
