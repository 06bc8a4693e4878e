#!/usr/bin/env python3
"""Write a random-weight model directory in Hugging Face format (see edge/model/random_model.py;
the vision-language presets qwen3-vl-tiny, qwen2.5-vl-tiny and qwen3-vl-8b: edge/model/vision/random_model.py).

python tools/make_model.py OUT_DIR [--arch qwen3] [--preset tiny] [--seed 0]
    [--dtype float32] [--max-shard-mb N] [--vocab-size N] [--num-layers N] [--quiet]

Files get the mode a plain file gets (0644 under umask 022); a progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("edge") is None:
    # Run from a checkout without installing the package.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge.model.random_model import ARCHITECTURES, PRESETS, make_model
from edge.model.vision.random_model import VL_PRESETS, make_vl_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default=None,
        help="architecture (default: the preset's own, qwen3 for tiny)",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS) + sorted(VL_PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--max-shard-mb", type=float, default=None, help="split the weights into shards of at most this many MiB"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="model vocabulary (>= the tokenizer's; larger pads the embedding)"
    )
    parser.add_argument("--num-layers", type=int, default=None, help="num_hidden_layers")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {}
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    if args.num_layers is not None:
        overrides["num_hidden_layers"] = args.num_layers
    max_shard_bytes = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
    if args.preset in VL_PRESETS:
        if args.arch is not None:
            raise SystemExit(f"--arch does not apply to the vision-language preset {args.preset}")
        out = make_vl_model(
            args.out_dir, args.preset, seed=args.seed, dtype=args.dtype, max_shard_bytes=max_shard_bytes,
            progress=not args.quiet, **overrides,
        )
        print(out)
        return 0
    out = make_model(
        args.out_dir,
        arch=args.arch,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        max_shard_bytes=max_shard_bytes,
        progress=not args.quiet,
        **overrides,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
