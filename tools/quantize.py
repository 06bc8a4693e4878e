#!/usr/bin/env python3
"""Quantize a float Hugging Face checkpoint to int8 weight-only groups (q8_0, W8A16).

python tools/quantize.py SRC_DIR DST_DIR [--group-size 128] [--keep-lm-head-float]
    [--scale-dtype float32|float16]

Every linear projection X.weight becomes X.weight (int8 [out, in]) and X.weight_scale
([out, in / group_size]); embeddings and norms stay float; lm_head is quantized unless
tied to the embedding or --keep-lm-head-float. The safetensors __metadata__ says
{"quantization": "q8_0", "group_size": "128"}, shards keep the source's layout, and
config.json and the tokenizer files are copied. `edge generate --model DST_DIR` loads it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

if importlib.util.find_spec("edge") is None:
    # Run from a checkout without installing the package.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="float checkpoint directory")
    parser.add_argument("dst", type=Path, help="output directory (created if missing)")
    parser.add_argument("--group-size", type=int, default=128, help="input columns per scale (default 128)")
    parser.add_argument("--keep-lm-head-float", action="store_true", help="leave lm_head.weight in float")
    parser.add_argument(
        "--scale-dtype", choices=("float32", "float16"), default="float32", help="dtype of the stored scales"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from edge.quant import SCALE_DTYPES, quantize_checkpoint

    try:
        summary = quantize_checkpoint(
            args.src,
            args.dst,
            group_size=args.group_size,
            keep_lm_head_float=args.keep_lm_head_float,
            scale_dtype=SCALE_DTYPES[args.scale_dtype],
        )
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"quantize: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
