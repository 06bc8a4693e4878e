"""Timing of a model step's quantized linears (GPU), shared by tools/bench_int4.py and
tools/bench_int8.py: every layer's qkv (input norm folded in), o and down (residual add)
and gate_up (norm + SwiGLU) for ``tokens`` tokens, captured as one CUDA graph and
replayed; bytes read over time against the copy and read bandwidths measured in the
same process."""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

KINDS = ("qkv", "o", "gate_up", "down")


def time_graph(fn: Callable[[], None], reps: int = 20) -> float:
    """Median seconds of one ``fn()`` replayed from a CUDA graph (warmed up first)."""
    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():  # graphs are captured on a side stream
        stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    with torch.cuda.stream(stream):  # replays run on the current stream: time that one
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            graph.replay()
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times[2:])


def model_layers(preset: str, make: Callable[[int, int, torch.Generator], Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The preset's config and, per layer, its four projections made by ``make(out, in, g)``."""
    from edge.model.config import ModelConfig
    from edge.model.random_model import model_config

    cfg = ModelConfig.from_dict(model_config(preset=preset))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, h), "o": (h, cfg.q_size), "gate_up": (2 * inter, h),
              "down": (h, inter)}
    return cfg, [{k: make(*shapes[k], g) for k in KINDS} for _ in range(cfg.num_layers)]


def time_step(lin: Any, cfg: Any, layers: list[dict[str, Any]], tokens: int, nbytes: Callable[[Any], int],
              copy_bw: float, read_bw: float) -> dict[str, float]:
    """The whole step's time and bandwidth fractions through ``lin`` (a backend linear),
    then each projection kind alone (its fraction of the copy bandwidth and its time)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    x = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
    a = torch.randn(tokens, cfg.q_size, generator=g, device="cuda").to(torch.bfloat16)
    ln = (torch.rand(h, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    resid = torch.zeros(tokens, h, dtype=torch.bfloat16, device="cuda")
    down_in = torch.randn(tokens, inter, generator=g, device="cuda").to(torch.bfloat16)

    def run(kinds: tuple[str, ...] = KINDS) -> Callable[[], None]:
        def step() -> None:
            for lw in layers:
                if "qkv" in kinds:
                    lin.linear(x, lw["qkv"], norm=(ln, 1e-6))
                if "o" in kinds:
                    lin.linear(a, lw["o"], residual=resid)
                act = lin.linear(x, lw["gate_up"], norm=(ln, 1e-6), swiglu=True) if "gate_up" in kinds else down_in
                if "down" in kinds:
                    lin.linear(act, lw["down"], residual=resid)
        return step

    total = sum(nbytes(w) for lw in layers for w in lw.values())
    t = time_graph(run())
    row = {"step_us": t * 1e6, "bytes": total, "GBps": total / t / 1e9, "fraction_of_copy": total / t / copy_bw,
           "fraction_of_read": total / t / read_bw}
    for kind in KINDS:
        nb = sum(nbytes(lw[kind]) for lw in layers)
        tk = time_graph(run((kind,)))
        row[f"{kind}_fraction"] = nb / tk / copy_bw
        row[f"{kind}_us"] = tk * 1e6
    return row


def sweep(args: argparse.Namespace, make: Callable[[int, int, torch.Generator], Any], nbytes: Callable[[Any], int],
          tunings: Callable[[int], dict[str, Any]], linear: Callable[[Any, Any], Any]) -> dict:
    """The whole benchmark of a format: ``--sms`` confines the process first (a green
    context), the copy and read bandwidths, the preset's layers made by ``make``, then
    :func:`time_step` for the tuning "default" and, with ``--sweep`` or ``--only``, the
    others of ``tunings(sm_count)`` (``--only``: those named); ``linear(launcher, tuning)``
    builds the format's backend linear."""
    from edge.kernels.launcher import Launcher

    from orin_shape import restrict_sms
    from tools.bench_decode import copy_bandwidth, read_bandwidth

    green = restrict_sms(args.sms) if args.sms else None
    bw = copy_bandwidth()
    read_bw = read_bandwidth()
    cfg, layers = model_layers(args.preset, make)
    result: dict = {"mode": "gemv", "device": torch.cuda.get_device_name(), "preset": args.preset,
                    "sms": args.sms or torch.cuda.get_device_properties(0).multi_processor_count,
                    "green_context": green is not None, "tokens": args.tokens, "copy_GBps": bw / 1e9,
                    "read_GBps": read_bw / 1e9}
    every = tunings(Launcher(torch.cuda.current_device()).sm_count())
    for label in chosen(args, every):
        lin = linear(Launcher(torch.cuda.current_device()), every[label])
        result[label] = time_step(lin, cfg, layers, args.tokens, nbytes, bw, read_bw)
    return result


def chosen(args: argparse.Namespace, labels: Any) -> list[str]:
    """The tunings to time, in ``labels``' order: "default", then every other with
    ``--sweep``, or those ``--only`` names (with or without ``--sweep``). An unknown name
    is an error, not a silent skip."""
    labels = list(labels)
    only = [x for x in args.only.split(",") if x] if args.only else []
    unknown = sorted(set(only) - set(labels))
    if unknown:
        raise SystemExit(f"unknown tunings {unknown}; known: {labels}")
    keep = {"default"} | (set(only) if only else set(labels) if args.sweep else set())
    return [x for x in labels if x in keep]
