"""The options of ``edge verify`` / ``tools/verify_paged.py`` (argparse only: ``edge --help``
must not import torch)."""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "Run a prompt suite through the contiguous KV path on the torch reference (the baseline) and through "
    "the paged modes (on a GPU: the CUDA kernels and the production decode step), diff the greedy outputs "
    "token by token, and exit 0 only when every mode agrees."
)


def add_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the embedded model, and the vision-language one)")
    p.add_argument(
        "--vision-model",
        help="vision-language model directory or preset for the image cases when --model is not given "
        "(default: qwen3-vl-peaked on a GPU, qwen3-vl-tiny on the CPU; none: skip them)",
    )
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--dtype", help="float32, bfloat16, float16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--tie-tolerance", type=float, help="top-2 gap under which a divergence is a tie")
    p.add_argument(
        "--quantize", choices=("none", "int8", "int4"), default="none",
        help="int8: q8_0 projections; int4: W4A16 (RTN) projections; quantized while loading",
    )
    p.add_argument(
        "--kv-dtype", choices=("auto", "int8"), default="auto",
        help="how every engine (the baseline too) holds K/V: auto (the model's dtype) or int8",
    )
    p.add_argument("--min-tokens", type=int, help="tokens each case generates (default: 200 on a GPU, 24 on the CPU)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
