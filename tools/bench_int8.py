#!/usr/bin/env python3
"""Int8 (W8A16) linear benchmark: the linears of a whole model step (GPU), against the
device's copy and read bandwidths measured in the same process.

    python tools/bench_int8.py [--sms N] [--tokens T] [--sweep | --only a,b]

Builds every layer's int8 projections of the preset (random codes, group 128, float32
scales), captures one CUDA graph of the step's linears (qkv with the input norm folded
in, o and down with the residual add, gate_up with norm + SwiGLU) for ``--tokens``
tokens (1: decode, the CUDA-core GEMV; 2..8: a speculative verify step, the tensor-core
kernel) and times its replays, then each projection kind alone. ``--sms N`` first makes
a CUDA green context of N SMs current (16: an AGX Orin's SM count). ``--sweep`` also
times other tensor-core tunings (:class:`edge.kernels.int8_cuda.Int8Tuning`). Prints
one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

if importlib.util.find_spec("edge") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _weight(out: int, inp: int, g: torch.Generator):
    from edge.quant.q8_0 import Int8Weight

    q = torch.randint(-127, 128, (out, inp), generator=g, device="cuda", dtype=torch.int8)
    scale = (torch.rand(out, inp // 128, generator=g, device="cuda") + 0.5) * 1e-3
    return Int8Weight(q, scale, 128)


def _nbytes(w) -> int:
    return w.weight.numel() + 4 * w.scale.numel()


def _tunings(sms: int) -> dict:
    from edge.kernels.int8_cuda import ARGMAX_MODES, MODES, Int8Tuning

    base = Int8Tuning.for_sms(sms)
    gemv_modes = tuple(infix for infix, _ in MODES.values())
    every_mode = gemv_modes + tuple(ARGMAX_MODES.values())  # every tensor-core mode
    return {
        "default": base,
        "stage160": dataclasses.replace(base, mma_stage_bytes=160 << 10),  # the down projection's 5 tokens staged
        "warps4": dataclasses.replace(base, mma_warps=4),
        "unroll1": dataclasses.replace(base, mma_unroll=1),
        "unroll2": dataclasses.replace(base, mma_unroll=2),
        "unroll4": dataclasses.replace(base, mma_unroll=4),
        "warps4_unroll1": dataclasses.replace(base, mma_warps=4, mma_unroll=1),
        "staged": dataclasses.replace(base, mma_direct=False),  # o staged where it fits
        "norm_unroll1": dataclasses.replace(base, mma_norm_unroll=1),
        "norm_unroll2": dataclasses.replace(base, mma_norm_unroll=2),
        "norm_unroll4": dataclasses.replace(base, mma_norm_unroll=4),
        "carveout_driver": dataclasses.replace(base, mma_carveout=None),  # the driver picks the carveout
        "carveout100": dataclasses.replace(base, mma_carveout=100),
        "carveout50": dataclasses.replace(base, mma_carveout=50),
        # --tokens 1: every mode on the GEMV, or every mode on the tensor-core kernel
        "one_token_gemv": dataclasses.replace(base, mma_one_token=()),
        "one_token_mma": dataclasses.replace(base, mma_one_token=gemv_modes),
        "one_token_qkv_gemv": dataclasses.replace(base, mma_one_token=tuple(m for m in base.mma_one_token if m != "norm_")),
        # tokens staged once a launch (int8_stage) instead of by every CTA: none, every mode,
        # the norm modes alone (qkv, gate_up), the few-SM default's modes
        "prestage_none": dataclasses.replace(base, mma_prestage=()),
        "norm_warps4": dataclasses.replace(base, mma_norm_warps=4),  # the one-tile norm mode (qkv) in 4-warp CTAs
        "norm_warps8": dataclasses.replace(base, mma_norm_warps=8),
        "prestage_all": dataclasses.replace(base, mma_prestage=every_mode),
        "prestage_norm": dataclasses.replace(base, mma_prestage=("norm_", "norm_swiglu_")),
        "prestage_norm_residual": dataclasses.replace(base, mma_prestage=("norm_", "residual_", "norm_swiglu_")),
        # prestaged one-tile modes in units of two row tiles: none, or these modes (prestaged too)
        "pair_none": dataclasses.replace(base, mma_pair_tiles=()),
        **{f"pair_{'_'.join(m.rstrip('_') for m in modes)}": _paired(base, modes)
           for modes in (("residual_",), ("norm_",), ("norm_", "residual_"))},
    }


def _paired(base: Any, modes: tuple[str, ...]) -> Any:
    """``base`` with ``modes`` prestaged in units of two row tiles."""
    prestage = base.mma_prestage + tuple(m for m in modes if m not in base.mma_prestage)
    return dataclasses.replace(base, mma_prestage=prestage, mma_pair_tiles=modes)


def gemv(args: argparse.Namespace) -> dict:
    from edge.kernels import reference
    from edge.kernels.int8_cuda import Int8CudaLinear

    from bench_linears import sweep

    return sweep(args, _weight, _nbytes, _tunings, lambda launcher, t: Int8CudaLinear(launcher, reference, t))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--sms", type=int, default=None, help="restrict to N SMs (green context) first")
    p.add_argument("--tokens", type=int, default=5, help="tokens a step (1: decode; 2..8: a verify step)")
    p.add_argument("--sweep", action="store_true", help="also time other tensor-core tunings")
    p.add_argument("--only", default="", help="time only these tunings (comma-separated labels) and the default")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(json.dumps(gemv(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
