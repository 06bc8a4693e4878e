#!/usr/bin/env python3
"""Quantize a float Hugging Face checkpoint: int8 groups (q8_0, W8A16) or int4 (W4A16).

python tools/quantize.py SRC_DIR DST_DIR [--group-size 128] [--keep-lm-head-float]
    [--scale-dtype float32|float16]
python tools/quantize.py SRC_DIR DST_DIR --bits 4 [--group-size 128] [--method rtn|awq]

int8 (the default): every linear projection X.weight becomes X.weight (int8 [out, in])
and X.weight_scale ([out, in / group_size]); embeddings and norms stay float; lm_head is
quantized unless tied to the embedding or --keep-lm-head-float. The safetensors
__metadata__ says {"quantization": "q8_0", "group_size": "128"}.

int4 (--bits 4): compressed-tensors pack-quantized, asymmetric groups (the format
llm-compressor writes; edge.quant.int4_quantize says how), round-to-nearest or AWQ scaling
calibrated on a text shipped in the repository (needs transformers and the
checkpoint's tokenizer.json). lm_head and embeddings stay float in the file.

Shards keep the source's layout, and config.json and the tokenizer files are copied.
`edge generate --model DST_DIR` loads either.
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
        "--scale-dtype", choices=("float32", "float16"), default="float32", help="int8: dtype of the stored scales"
    )
    parser.add_argument("--bits", type=int, choices=(8, 4), default=8, help="8: q8_0 (default); 4: int4")
    parser.add_argument("--method", choices=("rtn", "awq"), default="rtn", help="int4: round-to-nearest or AWQ scaling")
    parser.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from edge.quant.int4_quantize import quantize_checkpoint_int4
    from edge.quant.q8_0 import SCALE_DTYPES, quantize_checkpoint

    try:
        if args.bits == 4:
            if args.keep_lm_head_float:
                raise ValueError("--keep-lm-head-float is for --bits 8 (int4 files keep lm_head float)")
            summary = quantize_checkpoint_int4(
                args.src, args.dst, group_size=args.group_size, method=args.method, progress=not args.quiet
            )
            print(json.dumps(summary))
            return 0
        summary = quantize_checkpoint(
            args.src,
            args.dst,
            group_size=args.group_size,
            keep_lm_head_float=args.keep_lm_head_float,
            scale_dtype=SCALE_DTYPES[args.scale_dtype],
            progress=not args.quiet,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"quantize: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
