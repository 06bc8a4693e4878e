#!/usr/bin/env python3
"""First-start kernel compile: the variants an engine's backend loads, compiled into an empty
cache with N threads, as a first start does (edge/kernels/prebuild.py). No GPU needed.

    python tools/first_start.py [--preset qwen3-8b] [--dtype bfloat16] [--int4] [--arch sm_87]
                                [--sms 16] [--workers 1,2]

Prints one JSON line per worker count: variants, wall seconds, CPU seconds of the process
(all threads), and the per-variant wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--int4", action="store_true", help="int4 weights (float16 scales): their kernels too")
    p.add_argument("--arch", default="sm_87")
    p.add_argument("--sms", type=int, default=16)
    p.add_argument("--workers", default="1,2", help="comma-separated thread counts, each on an empty cache")
    args = p.parse_args(argv)

    import torch

    from edge.kernels import nvrtc, prebuild
    from edge.model.config import ModelConfig
    from edge.model.random_model import model_config

    cfg = ModelConfig.from_dict(model_config(preset=args.preset))
    dtype = getattr(torch, args.dtype)
    variants = prebuild.backend_variants(cfg, dtype, arch=args.arch, sms=args.sms,
                                         int4_scale_dtypes=(torch.float16,) if args.int4 else ())
    nvrtc.nvrtc_version()
    nvrtc.cuda_include_dirs()
    for workers in (int(w) for w in args.workers.split(",")):
        with tempfile.TemporaryDirectory(prefix="edge-first-start-") as cache:
            os.environ["EDGE_CACHE_DIR"] = cache  # the tool's own process: an empty kernel cache
            lines: list[str] = []
            t0 = os.times()
            wall = prebuild.compile_variants(variants, args.arch, workers, lines.append)
            t1 = os.times()
            assert not prebuild.missing(variants, args.arch)
        print(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "arch": args.arch, "sms": args.sms, "preset": args.preset,
            "dtype": args.dtype, "int4": args.int4, "variants": len(variants), "workers": workers,
            "wall_s": round(wall, 1), "cpu_s": round(t1.user + t1.system - t0.user - t0.system, 1),
            "cores": os.cpu_count(), "load_avg": round(os.getloadavg()[0], 1), "progress": lines,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
