"""Scheduler benchmark (the ``scheduler`` mode of tools/bench.py).

Measures, through the public Scheduler API with the consumer's own timestamps:
- decode tok/s and inter-token latency of the active slot alone, and while the other
  slot prefills a long prompt in the background (the ping-pong cost), and the process
  CPU time per decoded token alone (waiting for the GPU must not spin a core);
- the switch gap: from the active request's last event to the READY request's first
  token, against one decode step;
- TTFT of a second conversation turn with and without prefix reuse.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from edge.runtime.engine import Engine
from edge.model.random_model import default_model_path
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler

from bench_decode import build_engine, prompt_ids  # same presets and prompts as the decode mode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: a random preset on the GPU, the embedded model on the CPU)")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", help="default: bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--background-prompt", type=int, default=2048, help="tokens the background slot prefills")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--tokens-before", type=int, default=16, help="tokens the active request decodes before the background one arrives")
    p.add_argument("--prefill-chunk", type=int, default=256, help="largest background chunk, tokens")
    p.add_argument("--prefill-budget-ms", type=float, help="time per background chunk (default: the scheduler's)")
    p.add_argument("--itl-target", type=float, help="ITL during background prefill over ITL alone (default: the scheduler's)")
    p.add_argument("--turn-prompt", type=int, default=1024, help="first-turn prompt length for the prefix-reuse test")
    p.add_argument("--sms", type=int, default=None, help="restrict the process to N SMs (green context) before anything runs")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                   help="weights of the random preset (bench_decode's formats): a fixed expansion cost per prefill chunk")


def _timed(handle) -> list[tuple[float, int]]:  # noqa: ANN001 - RequestHandle
    """(consumer time, tokens in chunk) for every event of a request, final included."""
    out = []
    for chunk in handle:
        out.append((time.perf_counter(), len(chunk.token_ids)))
    return out


def _gaps(events: list[tuple[float, int]], t0: float = float("-inf"), t1: float = float("inf")) -> dict[int, float]:
    """Milliseconds from each token to the next, keyed by the next token's index, for
    the tokens inside [t0, t1]."""
    times = [t for t, n in events for _ in range(n)]
    return {i: (times[i] - times[i - 1]) * 1e3 for i in range(1, len(times)) if t0 <= times[i - 1] and times[i] <= t1}


def _summary(gaps: dict[int, float]) -> dict | None:
    if len(gaps) < 2:
        return None
    gaps = sorted(gaps.values())
    return {
        "mean": statistics.fmean(gaps),
        "p50": gaps[len(gaps) // 2],
        "p90": gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))],
        "max": gaps[-1],
        "gaps": len(gaps),
    }


def _scheduler(engine: Engine, args: argparse.Namespace, prefix_cache: bool) -> Scheduler:
    options = {}
    if args.prefill_budget_ms is not None:
        options["prefill_budget_ms"] = args.prefill_budget_ms
    if args.itl_target is not None:
        options["itl_target"] = args.itl_target
    return Scheduler(engine, queue_size=4, prefill_chunk=args.prefill_chunk, prefix_cache=prefix_cache, **options)


def _rate(events: list[tuple[float, int]], t0: float = float("-inf"), t1: float = float("inf")) -> float | None:
    times = [t for t, n in events if n and t0 <= t <= t1]
    if len(times) < 3:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def _watch_state(sched: Scheduler, request_id: str, until: threading.Event) -> dict[str, float]:
    """Poll slot states to learn when a background request went READY."""
    seen: dict[str, float] = {}
    while not until.is_set():
        for slot in sched.stats()["slots"]:
            if slot.get("request_id") == request_id and slot["state"] not in seen:
                seen[slot["state"]] = time.perf_counter()
        time.sleep(0.001)
    return seen


def run(args: argparse.Namespace, engine: Engine | None = None) -> dict:
    if engine is None:
        streams = None
        if getattr(args, "sms", None):
            from orin_shape import restrict_sms, stream_factory

            # First, before any stream exists; the scheduler's streams come from it too.
            args.green_context = restrict_sms(args.sms)  # kept alive for the run
            streams = stream_factory(args.green_context)
        if args.device == "cpu" and not args.model:
            args.model = str(default_model_path())
        args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
        engine, _ = build_engine(args, streams)
    greedy = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    result: dict = {"device": str(engine.device), "model": args.model or args.preset, "kernels": engine.info().get("kernels"),
                    "cuda_graph": engine.cuda_graph, "prefill_chunk": args.prefill_chunk,
                    "quantize": getattr(args, "quantize", "none")}
    if engine.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(engine.device)
        result["sms"] = torch.cuda.get_device_properties(engine.device).multi_processor_count

    sched = _scheduler(engine, args, prefix_cache=False)
    sched.start()
    try:
        _timed(sched.submit(prompt_ids(engine, 32, 0), SamplingParams(max_tokens=16, ignore_eos=True)))  # warm-up, graph capture
        cpu0, wall0 = time.process_time(), time.perf_counter()
        alone = _timed(sched.submit(prompt_ids(engine, 64, 1), greedy))
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        result["decode_tok_s_alone"] = _rate(alone)
        result["itl_alone_ms"] = _summary(_gaps(alone))
        result["cpu_ms_per_token_alone"] = cpu_s / args.decode_tokens * 1e3
        result["cpu_busy_fraction_alone"] = cpu_s / wall_s  # 1.0: a core busy all along (a spinning wait)

        a = sched.submit(prompt_ids(engine, 64, 2), greedy)
        a_events: list[tuple[float, int]] = []
        started = threading.Event()

        def consume_a() -> None:
            for chunk in a:
                a_events.append((time.perf_counter(), len(chunk.token_ids)))
                if len(a_events) == args.tokens_before:
                    started.set()

        ta = threading.Thread(target=consume_a)
        ta.start()
        started.wait(60)
        paced0 = sched.stats().get("background_prefill") or {}
        t_submit_b = time.perf_counter()
        b = sched.submit(prompt_ids(engine, args.background_prompt, 3), SamplingParams(max_tokens=8, ignore_eos=True))
        stop_watch = threading.Event()
        states: dict[str, float] = {}
        tw = threading.Thread(target=lambda: states.update(_watch_state(sched, b.id, stop_watch)))
        tw.start()
        b_events = _timed(b)
        ta.join()
        stop_watch.set()
        tw.join()
        t_ready = states.get("ready", states.get("decoding", t_submit_b))
        during = _rate(a_events, t_submit_b, t_ready)
        result["background_prefill_tokens"] = args.background_prompt
        result["active_decoded_until_ready"] = bool(a_events) and a_events[-1][0] > t_ready  # else raise --decode-tokens
        result["background_prefill_s"] = t_ready - t_submit_b
        result["decode_tok_s_during_background_prefill"] = during
        if during and result["decode_tok_s_alone"]:
            result["slowdown_during_background_prefill"] = 1 - during / result["decode_tok_s_alone"]
        during_gaps = _gaps(a_events, t_submit_b, t_ready)
        # The figure alone at the same token positions (a step's cost grows with the context).
        alone_gaps = _gaps(alone)
        same = {i: alone_gaps[i] for i in during_gaps if i in alone_gaps}
        itl, itl_alone = _summary(during_gaps), _summary(same)
        result["itl_during_background_prefill_ms"] = itl
        result["itl_alone_same_positions_ms"] = itl_alone
        if itl and itl_alone:
            result["itl_ratio_mean"] = itl["mean"] / itl_alone["mean"]
        paced = sched.stats().get("background_prefill")
        result["background_prefill_pacing"] = paced
        if paced and paced0:
            # Device time the chunks took over the window.
            result["background_busy_fraction"] = (paced["busy_s"] - paced0["busy_s"]) / (t_ready - t_submit_b)
        step = 1 / result["decode_tok_s_alone"]
        a_final = a_events[-1][0]
        b_first = next(t for t, n in b_events if n)
        result["switch_gap_ms"] = (b_first - a_final) * 1e3
        result["decode_step_ms"] = step * 1e3
        result["switch_gap_in_decode_steps"] = (b_first - a_final) / step
    finally:
        sched.stop()

    result["second_turn_ttft_ms"] = {}
    for reuse in (False, True):
        sched = _scheduler(engine, args, prefix_cache=reuse)
        sched.start()
        try:
            ttfts = []
            for rep in range(3):
                turn1 = prompt_ids(engine, args.turn_prompt, 10 + rep)
                r1 = sched.submit(turn1, SamplingParams(max_tokens=32, ignore_eos=True)).result(120)
                turn2 = turn1 + r1.token_ids + prompt_ids(engine, 64, 20 + rep)
                r2 = sched.submit(turn2, SamplingParams(max_tokens=4, ignore_eos=True)).result(120)
                ttfts.append((r2.usage.ttft_ms, r2.usage.cached_tokens))
            result["second_turn_ttft_ms"]["with_prefix_reuse" if reuse else "without_prefix_reuse"] = {
                "ttft_ms": statistics.median(t for t, _ in ttfts),
                "cached_tokens": ttfts[-1][1],
                "prompt_tokens": len(turn2),
            }
        finally:
            sched.stop()
    return result
