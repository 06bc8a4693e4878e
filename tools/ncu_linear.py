#!/usr/bin/env python3
"""A profiler's target (GPU): one quantized decode projection of a preset's shape,
launched ``--repeats`` times eagerly, so Nsight Compute can read one kernel's counters.

    ncu --clock-control none --kernel-name regex:int4_gemv --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SchedulerStats \\
        python tools/ncu_linear.py --format int4 --kind gate_up [--sms 16] [--tuning skip_math]

``--kind`` qkv (norm folded in), o / down (residual add), gate_up (norm + SwiGLU), for
``--tokens`` tokens; ``--tuning`` names an entry of ``tools/bench_int4.py``'s (or
``bench_int8.py``'s) tunings. Prints the kernel's name and the weight's bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("edge") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=("int4", "int8"), default="int4")
    p.add_argument("--kind", choices=("qkv", "o", "gate_up", "down"), default="gate_up")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--sms", type=int, default=None, help="restrict the process to N SMs (green context) first")
    p.add_argument("--tuning", default="default")
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()

    from orin_shape import restrict_sms

    green = restrict_sms(args.sms) if args.sms else None  # kept alive: the context is gone with it
    from edge.model.config import ModelConfig
    from edge.kernels import reference
    from edge.kernels.launcher import Launcher
    from edge.model.random_model import model_config

    launcher = Launcher(torch.cuda.current_device())
    if args.format == "int4":
        import bench_int4 as bench
        from edge.kernels.int4_cuda import Int4CudaLinear as Linear
    else:
        import bench_int8 as bench
        from edge.kernels.int8_cuda import Int8CudaLinear as Linear
    tuning = bench._tunings(launcher.sm_count())[args.tuning]
    lin = Linear(launcher, reference, tuning)
    cfg = ModelConfig.from_dict(model_config(preset=args.preset))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shape = {"qkv": (cfg.q_size + 2 * cfg.kv_size, h), "o": (h, cfg.q_size), "gate_up": (2 * inter, h),
             "down": (h, inter)}[args.kind]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = bench._weight(*shape, g)
    x = torch.randn(args.tokens, shape[1], generator=g, device="cuda").to(torch.bfloat16)
    ln = (torch.rand(shape[1], generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    resid = torch.zeros(args.tokens, shape[0], dtype=torch.bfloat16, device="cuda")
    for _ in range(args.repeats):
        if args.kind == "qkv":
            lin.linear(x, w, norm=(ln, 1e-6))
        elif args.kind == "gate_up":
            lin.linear(x, w, norm=(ln, 1e-6), swiglu=True)
        else:
            lin.linear(x, w, residual=resid)
    torch.cuda.synchronize()
    del green
    nbytes = getattr(bench, "_nbytes", lambda w: w.nbytes())
    print(f"{args.format} {args.kind} {tuple(shape)} tokens {args.tokens} tuning {args.tuning}: {nbytes(w)} bytes")


if __name__ == "__main__":
    main()
