#!/usr/bin/env python3
"""Int4 (W4A16) kernel benchmark: the decode GEMVs of a whole model step and the prefill
path, against the device's copy bandwidth measured in the same process (GPU).

    python tools/bench_int4.py gemv [--sms N] [--preset qwen3-8b]
    python tools/bench_int4.py prefill [--tokens 2048]
    python tools/bench_int4.py load [--preset qwen3-1.7b]
    python tools/bench_int4.py ttft [--preset qwen3-8b] [--prefill-chunk 512]

``gemv`` builds every layer's int4 projections of the preset (random codes, group 128,
float16 scales and zero points), captures one CUDA graph of the decode step's linears
(qkv with the input norm folded in, o and down with the residual add, gate_up with
norm + SwiGLU) and times its replays: bytes read over time, as a fraction of the copy
bandwidth. ``--sms N`` first makes a CUDA green context of N SMs current (16: an AGX
Orin's SM count), so copy and GEMVs run on those SMs. ``prefill`` times dequantize +
cuBLAS and the int4 GEMM against bfloat16 cuBLAS at the preset's shapes, and the
expansion kernel's bandwidth (bytes read + written) against the copy bandwidth. ``ttft``
times bf16, int8 and int4 prompts at the engine's prefill chunk (longer for quantized
weights) and int4 at ``--prefill-chunk`` tokens (the float default, 512) for comparison. ``load`` writes a random float
checkpoint of the preset, quantizes it offline (RTN, compressed-tensors) and loads it
on the GPU: peak device memory while loading against the final weight bytes. Prints
one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

if importlib.util.find_spec("edge") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _weight(out: int, inp: int, g: torch.Generator):
    from edge.quant.int4 import Int4Codes, pack_weight

    q = torch.randint(0, 16, (out, inp), generator=g, device="cuda", dtype=torch.uint8)
    scale = ((torch.rand(out, inp // 128, generator=g, device="cuda") + 0.5) * 1e-2).half()
    zero = torch.randint(0, 16, (out, inp // 128), generator=g, device="cuda", dtype=torch.uint8)
    return pack_weight([Int4Codes(q, scale, zero, 128)], "cuda")


def _tunings(sms: int) -> dict:
    from edge.kernels.int4_cuda import Int4Tuning

    default = Int4Tuning.for_sms(sms)
    return {
        "default": default,
        "base": Int4Tuning(),
        "split8": Int4Tuning(split=8),
        "unroll1": Int4Tuning(unroll=1),
        "warps4": Int4Tuning(warps=4),
        "tiles1": Int4Tuning(tiles=1),
        "prefetch4": Int4Tuning(prefetch=4),
        "tiles1_unroll1": Int4Tuning(tiles=1, unroll=1),
        "tiles1_unroll4": Int4Tuning(tiles=1, unroll=4),
        "skip_math": Int4Tuning(skip_math=True),
        "warps4_tiles1": Int4Tuning(warps=4, tiles=1),  # the 16-SM default with one row tile a unit
        "warps4_unroll1": Int4Tuning(warps=4, unroll=1),
        "direct": dataclasses.replace(default, direct=True),  # o (and down) never staged
        "resident": dataclasses.replace(default, resident_grid=True),  # one-token launches of resident CTAs only
        "spread": dataclasses.replace(default, resident_grid=False),  # one-token launches of a CTA per units group
        "carveout100": dataclasses.replace(default, carveout=100),  # the largest shared-memory carveout
        "carveout72": dataclasses.replace(default, carveout=72),
    }


def gemv(args: argparse.Namespace) -> dict:
    from edge.kernels import reference
    from edge.kernels.int4_cuda import Int4CudaLinear

    from bench_linears import sweep

    return sweep(args, _weight, lambda w: w.nbytes(), _tunings,
                 lambda launcher, t: Int4CudaLinear(launcher, reference, t))


def prefill(args: argparse.Namespace) -> dict:
    import torch.nn.functional as F

    from edge.model.config import ModelConfig
    from edge.kernels import reference
    from edge.kernels.int4_cuda import Int4CudaLinear
    from edge.kernels.launcher import Launcher
    from edge.model.random_model import model_config

    cfg = ModelConfig.from_dict(model_config(preset=args.preset))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    from edge.kernels.int4_cuda import Int4Tuning

    g = torch.Generator(device="cuda").manual_seed(1)
    launcher = Launcher(torch.cuda.current_device())
    lin = Int4CudaLinear(launcher, reference, Int4Tuning(prefill="dequant"))
    gemm = Int4CudaLinear(launcher, reference, Int4Tuning(prefill="gemm"))
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, h), "o": (h, cfg.q_size), "gate_up": (2 * inter, h),
              "down": (h, inter)}
    from bench_linears import time_graph
    from tools.bench_decode import copy_bandwidth

    result: dict = {"mode": "prefill", "device": torch.cuda.get_device_name(), "tokens": args.tokens,
                    "copy_bandwidth_GBps": copy_bandwidth() / 1e9}
    t4 = tb = tdq = tg = 0.0
    for name, (out, inp) in shapes.items():
        w4 = _weight(out, inp, g)
        wb = torch.randn(out, inp, generator=g, device="cuda").to(torch.bfloat16)
        x = torch.randn(args.tokens, inp, generator=g, device="cuda").to(torch.bfloat16)
        buf = torch.empty(out, inp, dtype=torch.bfloat16, device="cuda")
        a = time_graph(lambda: lin.linear(x, w4))
        b = time_graph(lambda: F.linear(x, wb))
        d = time_graph(lambda: lin.dequantize_blocks(w4, 0, w4.packed.shape[0], buf))
        m = time_graph(lambda: gemm.linear(x, w4))
        moved = w4.nbytes() + buf.numel() * buf.element_size()
        result[name] = {"dequant_cublas_us": a * 1e6, "int4_gemm_us": m * 1e6, "bf16_us": b * 1e6,
                        "dequant_us": d * 1e6, "dequant_GBps": moved / d / 1e9}
        t4, tb, tdq, tg = t4 + a, tb + b, tdq + d, tg + m
    result["layer_dequant_cublas_over_bf16"] = t4 / tb
    result["layer_int4_gemm_over_bf16"] = tg / tb
    result["layer_dequant_share"] = tdq / t4
    result["layer_dequant_GBps"] = sum(r["dequant_GBps"] * r["dequant_us"] for r in
                                       (result[n] for n in shapes)) / (tdq * 1e6)
    return result


def load(args: argparse.Namespace) -> dict:
    import tempfile

    from edge.runtime.engine import Engine
    from edge.quant.int4_quantize import quantize_checkpoint_int4
    from edge.model.random_model import make_model

    root = Path(tempfile.mkdtemp())
    src = make_model(root / "float", preset=args.preset, dtype="bfloat16")
    quantize_checkpoint_int4(src, root / "int4")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = Engine.from_pretrained(root / "int4", device="cuda", dtype="bfloat16", max_seq_len=1024, kv_blocks=80)
    peak = torch.cuda.max_memory_allocated() - base
    weights = engine.model.weight_bytes()
    return {"mode": "load", "device": torch.cuda.get_device_name(), "preset": args.preset,
            "weight_bytes": weights, "peak_while_loading_bytes": peak, "peak_over_weights_GiB": (peak - weights) / 2**30,
            "weights": engine.info()["weights"]}


def ttft(args: argparse.Namespace) -> dict:
    """TTFT of the preset in bf16, int8 and int4 (RTN while building) at the engine's
    prefill chunk, int4 also at ``--prefill-chunk`` tokens and with the int4 GEMM."""
    import gc

    from edge.model.config import ModelConfig, parse_dtype
    from edge.runtime.engine import Engine
    from edge.quant.int4_checkpoints import quantize_fused_weights
    from edge.kernels.int4_cuda import Int4Tuning
    from edge.model.loader import fuse_weights
    from edge.model.decoder import Model
    from edge.model.random_model import iter_random_tensors, model_config
    from tools.bench_decode import quantize_projections, time_ttft

    dtype = parse_dtype("bfloat16")
    raw = model_config(preset=args.preset)
    cfg = ModelConfig.from_dict(raw)
    weights = fuse_weights(iter_random_tensors(raw, 0, dtype, "cuda"), cfg, "cuda", dtype)
    lengths = (512, 2048)
    blocks = 2 * (4096 // 16) + 8
    result: dict = {"mode": "ttft", "device": torch.cuda.get_device_name(), "preset": args.preset}

    def run(label: str, w: dict, tuning: Int4Tuning | None = None, chunk: int | None = None) -> None:
        e = Engine(Model(cfg, w, 4096), None, Path(f"preset:{args.preset}"), max_seq_len=4096,
                   num_blocks=blocks, int4_tuning=tuning, prefill_chunk=chunk)
        result[f"{label}_ms"] = {n: time_ttft(e, n, 3) for n in lengths}
        result[f"{label}_prefill_chunk"] = e.prefill_chunk
        if "bf16_ms" in result:
            result[f"{label}_over_bf16_2048"] = result[f"{label}_ms"][2048] / result["bf16_ms"][2048]
        del e
        gc.collect()
        torch.cuda.empty_cache()

    run("bf16", weights)
    w8 = dict(weights)
    quantize_projections(w8, cfg)
    run("int8", w8)
    del w8
    quantize_fused_weights(weights, cfg, dtype)
    run("int4_dequant", weights, Int4Tuning(prefill="dequant"))
    run(f"int4_dequant_chunk{args.prefill_chunk}", weights, Int4Tuning(prefill="dequant"), args.prefill_chunk)
    run("int4_gemm", weights, Int4Tuning(prefill="gemm"))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("gemv", "prefill", "load", "ttft"))
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--sms", type=int, default=None, help="restrict to N SMs (green context) first")
    p.add_argument("--sweep", action="store_true", help="also time other warps / unroll tunings")
    p.add_argument("--only", default="", help="gemv: time only these tunings (comma-separated labels) and the default")
    p.add_argument("--tokens", type=int, default=None,
                   help="gemv: tokens a step (default 1; 2..8: a speculative verify step's linears); prefill: "
                   "prompt tokens (default 2048)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="ttft: the int4 comparison run's prefill chunk")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens is None:
        args.tokens = 1 if args.mode == "gemv" else 2048
    out = {"gemv": gemv, "prefill": prefill, "load": load, "ttft": ttft}[args.mode](args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
