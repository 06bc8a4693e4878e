"""The one benchmark a board owner runs (the ``board`` mode of tools/bench.py): the shapes
TensorRT Edge-LLM publishes for Jetson Orin, batch 1, and everything that makes a figure
reproducible.

* prefill: a 2048-token prompt (time to its first token, and prefill tok/s);
* decode: ``--decode-tokens`` tokens after the same 2048-token prompt is in the cache
  (CUDA-graph decode, as the service runs it);
* each 3 warm-up runs, then 10 timed runs (median, mean, min, max);
* energy over the timed decode runs from the monitor (jtop, then the INA3221 rails in
  sysfs on a Jetson; NVML elsewhere, null when the process is confined to a share of the
  GPU's SMs, whose power it cannot tell apart);
* the board: module, L4T, nvpmodel mode, jetson_clocks, GPU / CPU clocks
  (edge/monitor/board.py), the GPU's name, SM count and clocks, the versions of the stack;
* a table beside the figures published for this board.

    python tools/bench.py board --model /opt/edge/models/Qwen3-8B-AWQ
    python tools/bench.py board --preset qwen3-8b --quantize int4 --sms 16     # random weights, 16 SMs

The JSON goes to stdout and to ``--out`` (default ``bench-board-<board>-<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench_decode import build_engine, prompt_ids
from edge.monitor.board import read_board
from orin_shape import restrict_sms, stream_factory

# TensorRT Edge-LLM's published batch-1 decode figures (tok/s), by board.
PUBLISHED = {
    "agx-orin-64": [("Qwen3-8B", "int4 (AWQ)", 32.2)],
    "orin-nx-16": [("Qwen3-8B", "int4 (AWQ)", 18.4)],
    "orin-nano-8": [("Qwen3-1.7B", "int4 (AWQ)", 36.5)],
}
PUBLISHED_SOURCE = "TensorRT Edge-LLM, published Jetson Orin figures (batch 1)"
BOARD_NAMES = {"agx-orin-64": "AGX Orin", "orin-nx-16": "Orin NX", "orin-nano-8": "Orin Nano"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory (a published checkpoint)")
    src.add_argument("--preset", default="qwen3-8b", help="random weights of a preset's shape (no files)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                   help="quantize while loading (a published int4 checkpoint needs none)")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens (and the cache the decode starts from)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens each decode run generates")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--sms", type=int, default=None, help="confine the process to N SMs (green context) first")
    p.add_argument("--monitor-period-s", type=float, default=0.05, help="power sampling period")
    p.add_argument("--out", help="where to write the JSON (default bench-board-<board>-<date>.json)")


def board_key(model: str | None, mem_total: int | None) -> str | None:
    """edge.runtime.boards' key for a device-tree model ("... AGX Orin ...", "... Orin NX ...",
    "... Orin Nano ...") and MemTotal (the NX and Nano come in two sizes)."""
    from edge.runtime.boards import BOARDS

    name = (model or "").lower()
    gib = (mem_total or 0) / 2**30
    for key in BOARDS:
        family = BOARD_NAMES[key].lower()
        if family in name:
            size = {"agx-orin-64": 48, "orin-nx-16": 12, "orin-nano-8": 6}[key]
            return key if gib >= size else None
    return None


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "min": min(values),
            "max": max(values), "runs": len(values)}


def prefill_seconds(engine: Any, prompt: list[int]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq = engine.new_sequence(slot=0)
    try:
        int(torch.argmax(engine.prefill(seq, prompt)))
        return time.perf_counter() - t0
    finally:
        engine.end_sequence(seq)


def decode_seconds(engine: Any, prompt: list[int], n: int) -> float:
    """Seconds for ``n`` graph decode steps with ``prompt`` in the cache, each token read as
    the service reads it (prefill not timed)."""
    from bench_decode import prefilled

    with prefilled(engine, prompt, graph=True) as (seq, decoder, token, sampler):
        t0 = time.perf_counter()
        for _ in range(n):
            decoder.next_token(seq, True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        engine.settle(seq)
    return seconds


def gpu_clocks() -> dict[str, Any]:
    """SM and memory clocks from NVML where it answers (discrete GPUs), else nothing."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return {
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
        }
    except Exception:  # no NVML (a Jetson): the board facts carry its clocks
        return {}


def run(args: argparse.Namespace) -> dict:
    from edge.monitor import Monitor, MonitorConfig
    from edge.monitor.board import measure_energy
    from edge.runtime.budget import read_meminfo
    from edge.runtime.platform_info import probe_platform

    green = restrict_sms(args.sms) if args.sms else None
    facts = read_board()
    key = board_key(facts.model, read_meminfo().get("MemTotal"))
    engine, _ = build_engine(argparse.Namespace(**{**vars(args), "context": args.prefill}),
                             stream_factory(green) if green is not None else None)
    engine.cuda_graph = True
    prompt = prompt_ids(engine, args.prefill, seed=0)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())

    for _ in range(args.warmup):
        prefill_seconds(engine, prompt)
    prefill = [prefill_seconds(engine, prompt) for _ in range(args.runs)]
    for _ in range(args.warmup):
        decode_seconds(engine, prompt, args.decode_tokens)
    # A Jetson: jtop, else its INA3221 rails; elsewhere NVML (a host's thermal zones carry no power).
    source = None if facts.is_jetson else "nvml"
    monitor = Monitor(MonitorConfig(period_s=args.monitor_period_s, source=source, metrics=False)).start()
    try:
        time.sleep(2 * args.monitor_period_s)
        decode, energy = measure_energy(
            monitor, lambda: [decode_seconds(engine, prompt, args.decode_tokens) for _ in range(args.runs)])
    finally:
        monitor.stop()
    tokens = args.decode_tokens * args.runs
    whole_gpu_only = green is not None and energy.source == "nvml"
    joules = None if whole_gpu_only else energy.joules
    tok_s = [args.decode_tokens / s for s in decode]
    result = {
        "date": dt.date.today().isoformat(),
        "board": key,
        "board_facts": facts.as_dict(),
        "device": props.name,
        "sm_count": engine.backend.sms or props.multi_processor_count,
        "green_context_sms": args.sms,
        "gpu_clocks": gpu_clocks(),
        "platform": probe_platform().as_dict(),
        "model": args.model or args.preset,
        "format": engine.info().get("weights") or {"projections": args.quantize if args.quantize != "none" else args.dtype},
        "dtype": args.dtype,
        "quantize": args.quantize,
        "weight_bytes": engine.model.weight_bytes(),
        "prefill_tokens": args.prefill,
        "decode_tokens": args.decode_tokens,
        "warmup_runs": args.warmup,
        "ttft_ms": {k: v * 1e3 for k, v in stats(prefill).items() if k != "runs"},
        "prefill_tok_s": args.prefill / statistics.median(prefill),
        "decode_tok_s": stats(tok_s),
        "energy": {
            "source": energy.source,
            "joules": joules,
            "joules_per_token": None if joules is None else joules / tokens,
            "average_power_w": None if joules is None else joules / energy.seconds,
            "note": "NVML measures the whole GPU, not the confined SMs" if whole_gpu_only else None,
        },
        "published": [{"model": m, "format": f, "decode_tok_s": v, "source": PUBLISHED_SOURCE}
                      for m, f, v in PUBLISHED.get(key or "", [])],
        "command": " ".join(["python", "tools/bench.py", *sys.argv[1:]]),
    }
    out = Path(args.out or f"bench-board-{key or props.name.replace(' ', '-')}-{result['date']}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result), file=sys.stderr)
    print(f"written to {out}: attach it when you share the figures", file=sys.stderr)
    return result


def table(r: dict) -> str:
    """The result beside the published figures for the board (markdown)."""
    f = r["board_facts"]
    mode = f"{f['power_mode']} (nvpmodel {f['power_mode_id']})" if f["power_mode"] else "n/a"
    clocks = {True: "on", False: "off", None: "n/a"}[f["jetson_clocks"]]
    e = r["energy"]
    jpt = f"{e['joules_per_token']:.3f} J/token ({e['source']})" if e["joules_per_token"] is not None else "n/a"
    rows = [
        f"board {r['board'] or 'not a Jetson'} | {r['device']} | {r['sm_count']} SMs | power mode {mode} | "
        f"jetson_clocks {clocks}",
        "",
        "| model | format | prefill tok/s (2048) | TTFT ms | decode tok/s (median of runs) | energy | source |",
        "|---|---|---|---|---|---|---|",
        f"| {r['model']} | {r['format'].get('projections', r['quantize'])} | {r['prefill_tok_s']:.0f} | "
        f"{r['ttft_ms']['median']:.0f} | {r['decode_tok_s']['median']:.1f} | {jpt} | this run |",
    ]
    for p in r["published"]:
        rows.append(f"| {p['model']} | {p['format']} | | | {p['decode_tok_s']} | | {p['source']} |")
    return "\n".join(rows)
