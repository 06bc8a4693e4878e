#!/usr/bin/env python3
"""edge benchmarks. Prints one JSON document on stdout.

Modes:

  decode     end-to-end decode benchmark (tools/bench_decode.py)

  scheduler  two-slot scheduler: background-prefill slowdown, switch gap, second-turn
             TTFT with and without prefix reuse (tools/bench_scheduler.py)

  vision     a random qwen3-vl-8b-shaped model (on the CPU: qwen3-vl-tiny): vision-tower time and TTFT for 448x448
             and 1280x720 images, decode tok/s after an image and after text of the
             same length (tools/bench_vision.py)

  speculative  speculative decoding: the verify step's cost for k = 1..8 proposals
             against one graph decode step, the speed-up with a perfect proposer (the
             model's own greedy continuation) and with prompt lookup, and tok/s projected
             for published acceptance figures (tools/bench_speculative.py)

  structured  time per output token with and without a JSON schema and with tools,
             grammar compile time cold and cached, host mask time per token
             (tools/bench_structured.py)
  board      the shapes TensorRT Edge-LLM publishes for Jetson Orin (prefill 2048, decode
             with 2048 in the cache, 3 warm-up + 10 runs) with energy, the power mode and
             the clocks, beside the published figures; writes a JSON to share
             (tools/bench_board.py)

  kernels   device copy bandwidth, then paged decode attention at each kv_len for a
            Qwen3-8B-like layer (32 q heads, 8 kv heads, head_dim 128, page 16):
            achieved bandwidth = (K + V bytes read + q/out bytes) / median kernel time,
            as a fraction of the copy bandwidth measured in the same run; --floor adds
            kernels that only read the same bytes (the attention's gather, and a
            contiguous read): the floor under the attention's time; --verify-tokens
            times the speculative verify step's attention as a model step serves it
            (from the qkv rows, RoPE and the K/V store in the launch, each of --layers
            layers' pools, one sequence) for T tokens, T = 1 being the decode step's
            launch, per call of a CUDA graph. --kv-dtype int8 times the same over int8
            pools (codes and a float32 scale a row: their bytes are what is read).

    python tools/bench.py kernels [--dtype bfloat16] [--kv-lens 512,2048,8192]
                                  [--sweep | --tunings JSON] [--prefill] [--floor]
                                  [--verify-tokens 1,5,8] [--sms N] [--kv-dtype int8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, ".."), _HERE]

READ_FLOOR = os.path.join(_HERE, "kernels", "read_floor.cu")
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# Decode-kernel tunings tried by `kernels --sweep` (knobs of paged_decode*.cu and the
# split policy; `--tunings JSON` replaces the list).
# Fields of edge.kernels.paged_cuda.DecodeTuning.
SWEEP = [
    {"impl": "simt"},
    {"impl": "tc"},  # defaults: 8 warps, 2 stages, a wave of splits
    {"impl": "tc", "tc_warps": 4},  # two CTAs an SM
    {"impl": "tc", "tc_warps": 4, "tc_max_stages": 3},
    {"impl": "tc", "tc_stages": 1},
    {"impl": "tc", "tc_max_stages": 3},  # as deep as the SM's shared memory allows
    {"impl": "tc", "mergers": 1},
    {"impl": "tc", "mergers": 4},
    {"impl": "tc", "max_splits": 16},
    {"impl": "tc", "tc_warps": 2, "tc_stages": 4},
]


def _median_ms(
    fn: Callable[[], None], reps: int, warmup: int = 3
) -> tuple[float, list[float]]:
    """Median wall time of fn on the GPU (CUDA events around each call), ms."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), times


def copy_bandwidth(nbytes: int, reps: int) -> dict[str, Any]:
    """Large device-to-device copy: (bytes read + bytes written) / median time."""
    import torch

    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    med, times = _median_ms(lambda: dst.copy_(src), reps)
    moved = 2 * src.numel() * src.element_size()
    return {
        "bytes_moved": moved,
        "median_ms": med,
        "min_ms": min(times),
        "GBps": moved / (med * 1e-3) / 1e9,
    }


def _kernel_us(fn: Callable[[], None], prefix: str) -> list[float]:
    """Durations (us) of the GPU kernels named prefix* that fn launches (CUPTI via the
    torch profiler): kernel time without launch gaps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.name.startswith(prefix):
            tr = getattr(e, "time_range", None)
            dur = (
                (tr.end - tr.start)
                if tr is not None
                else getattr(e, "device_time", 0.0)
            )
            if dur > 0:
                out.append(float(dur))
    return out


def _row_bytes(dtype, d: int, q8: bool) -> int:
    """Bytes of a stored K or V row: d values, or d int8 codes and a float32 scale."""
    import torch

    return d + 4 if q8 else d * torch.empty((), dtype=dtype).element_size()


def _random_pool(shape: tuple[int, ...], dtype, q8: bool, g: Any) -> Any:
    """A pool of random rows: ``dtype``, or those rows quantized into an Int8KV."""
    import torch

    from edge.kernels.kv_int8 import Int8KV, quantize_rows

    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    return Int8KV(*quantize_rows(x)) if q8 else x


def _kv_sequences(
    dtype, kv_len: int, kvh: int, d: int, page: int, l2_bytes: int, q8: bool = False
) -> tuple[Any, Any, Any, int]:
    """(k_pool, v_pool, block tables [n_seq, blocks], n_seq): enough distinct sequences
    (random block tables into one pool) that their K/V is ~6x the L2, so calls rotating
    through them read K/V from device memory. ``q8``: int8 pools (Int8KV)."""
    import torch

    kv_bytes = 2 * kv_len * kvh * _row_bytes(dtype, d, q8)
    n_seq = max(4, min(512, math.ceil(6 * l2_bytes / kv_bytes)))
    blocks_per_seq = -(-kv_len // page)
    num_blocks = n_seq * blocks_per_seq
    g = torch.Generator(device="cuda").manual_seed(kv_len)
    k_pool = _random_pool((num_blocks, page, kvh, d), dtype, q8, g)
    v_pool = _random_pool((num_blocks, page, kvh, d), dtype, q8, g)
    tables = (
        torch.randperm(num_blocks, device="cuda", generator=g)
        .to(torch.int32)
        .view(n_seq, blocks_per_seq)
    )
    return k_pool, v_pool, tables, n_seq


def _capture(fn: Callable[[], None]) -> Any:
    """fn captured in a CUDA graph after a warm-up run, on the current stream unless it
    is the default one (graphs are captured on a side stream). With --sms the current
    stream is the green context's: a stream of torch's own (as torch.cuda.graph takes
    when given none) would run the graph on every SM of the GPU."""
    import torch

    cur = torch.cuda.current_stream()
    s = cur if cur != torch.cuda.default_stream() else torch.cuda.Stream()
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        fn()
    cur.wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        fn()
    return graph


def _decode_case(
    pcs: dict[str, Any],
    dtype,
    kv_len: int,
    qh: int,
    kvh: int,
    d: int,
    page: int,
    l2_bytes: int,
    reps: int,
    q8: bool = False,
) -> dict[str, Any]:
    """Time decode attention over enough distinct sequences (block tables into one
    pool) that their K/V is several times the L2: kernel durations (profiler), per-call
    time of the calls captured in one CUDA graph (serialised launches, and overlapped
    launches as the decode graph makes them on sm_90+), and eager per-call time.
    ``pcs``: the serial and the overlapped-launch PagedAttentionCuda of one tuning;
    ``q8``: int8 pools."""
    import time

    import torch

    from edge.kernels import nvrtc, reference

    es = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * kv_len * kvh * _row_bytes(dtype, d, q8)
    qo_bytes = 2 * qh * d * es
    table_bytes = -(-kv_len // page) * 4
    k_pool, v_pool, tables, n_seq = _kv_sequences(dtype, kv_len, kvh, d, page, l2_bytes, q8)
    g = torch.Generator(device="cuda").manual_seed(kv_len + 1)
    qs = torch.randn(n_seq, qh, d, device="cuda", generator=g).to(dtype)
    outs = torch.empty_like(qs)
    scale = 1.0 / math.sqrt(d)
    pc = pcs["serial"]
    splits = pc.decode_splits(dtype, d, qh, kvh, kv_len, page, kv_int8=q8)

    def calls(att: Any) -> Callable[[], None]:
        def run() -> None:
            for i in range(n_seq):
                att.decode_attention(qs[i], k_pool, v_pool, tables[i], kv_len, scale, out=outs[i])

        return run

    run_all = calls(pc)

    run_all()  # compile / load / workspace
    torch.cuda.synchronize()
    eager_ms, _ = _median_ms(run_all, max(3, reps // 4))
    t0 = time.perf_counter()
    run_all()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    kern_us = []
    for _ in range(3):
        kern_us += _kernel_us(run_all, "paged_decode")

    moved = kv_bytes + qo_bytes + table_bytes
    graph_s = {}
    rel_err = {}
    for name, att in pcs.items():
        graph = _capture(calls(att))
        graph_ms, _ = _median_ms(graph.replay, reps)
        graph_s[name] = graph_ms * 1e-3 / n_seq
        outs.fill_(float("nan"))
        graph.replay()
        ref = reference.decode_attention(
            qs[-1].float(), k_pool, v_pool, tables[-1], kv_len, scale
        )
        rel_err[name] = (
            (outs[-1].double() - ref.double()).norm() / ref.double().norm()
        ).item()
        del graph
    per_call_s = graph_s["serial"]
    plan = pc._plan(dtype, d, qh, kvh, page, q8=q8)
    kern = plan.kernel
    kernel_us = statistics.median(kern_us) if kern_us else float("nan")
    return {
        "kv_len": kv_len,
        "splits": splits,
        "sequences_rotated": n_seq,
        "bytes_per_call": moved,
        "kernel_us": kernel_us,
        "kernel_samples": len(kern_us),
        "GBps": moved / (kernel_us * 1e-6) / 1e9,
        "graph_us_per_call": per_call_s * 1e6,
        "graph_GBps": moved / per_call_s / 1e9,
        "overlapped_launches": pcs["overlapped"].launcher.overlap,
        "graph_overlapped_us_per_call": graph_s["overlapped"] * 1e6,
        "graph_overlapped_GBps": moved / graph_s["overlapped"] / 1e9,
        "eager_us_per_call": eager_ms * 1e3 / n_seq,
        "host_us_per_call": host_s * 1e6 / n_seq,
        "rel_err_vs_reference": rel_err,
        "kernel": {
            **nvrtc.kernel_resources(kern),
            "ctas_per_sm": nvrtc.max_active_blocks(
                kern, plan.threads, torch.cuda.current_device(), dynamic_smem=plan.smem
            ),
            "dynamic_smem_bytes": plan.smem,
        },
        "tuning": dataclasses.asdict(pc.tuning),
    }


def _verify_case(
    pc: Any, dtype, kv_len: int, qh: int, kvh: int, d: int, page: int, layers: int, reps: int, tokens: int,
    q8: bool = False,
) -> dict[str, Any]:
    """The verify step's attention as a model step serves it: ``tokens`` tokens at
    positions [kv_len, kv_len + tokens) (one token: the decode step's launch) in each of
    ``layers`` layers' pools, one sequence's block table: per-call time of the calls
    captured in one CUDA graph (serialised launches), the kernel that ran, and the last
    layer's error against the float32 reference."""
    import torch

    from edge.model.config import rope_tables
    from edge.kernels import reference

    g = torch.Generator(device="cuda").manual_seed(kv_len + tokens)
    max_pos = kv_len + tokens
    blocks = -(-max_pos // page)
    pools = [(_random_pool((blocks, page, kvh, d), dtype, q8, g), _random_pool((blocks, page, kvh, d), dtype, q8, g))
             for _ in range(layers)]
    table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)
    cos, sin_signed = rope_tables(1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device="cuda") / d)), max_pos)
    norm = torch.rand(qh + kvh, d, device="cuda", generator=g) * 0.4 + 0.8
    rope = reference.Rope(norm.to(dtype), cos.to(dtype), sin_signed.to(dtype), qh, kvh, 1e-6)
    rope32 = reference.Rope(norm, cos.float(), sin_signed.float(), qh, kvh, 1e-6)
    qkv = torch.randn(layers, tokens, (qh + 2 * kvh) * d, device="cuda", generator=g).to(dtype)
    outs = torch.empty(layers, tokens, qh, d, device="cuda", dtype=dtype)
    pos = torch.tensor([kv_len], dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)

    def run() -> None:
        for i, (k_pool, v_pool) in enumerate(pools):
            if tokens == 1:
                pc.decode_attention_rope(qkv[i], rope, k_pool, v_pool, table, 0, scale, pos, outs[i, 0])
            else:
                pc.verify_attention_rope(qkv[i], rope, k_pool, v_pool, table, pos, scale, outs[i])

    before = dict(pc.launcher.counts)
    run()  # compile / load / workspace
    ran = sorted(k for k, n in pc.launcher.counts.items() if n != before.get(k, 0))
    graph = _capture(run)
    graph_ms, _ = _median_ms(graph.replay, reps)
    k32, v32 = pools[-1]  # the step's rows as the replays stored them
    if not q8:
        k32, v32 = k32.float(), v32.float()
    outs.fill_(float("nan"))
    graph.replay()
    want = reference.verify_attention_rope(qkv[-1].float(), rope32, k32, v32, table, pos, scale)
    err = ((outs[-1].double() - want.double()).norm() / want.double().norm()).item()
    del graph
    return {"kv_len": kv_len, "tokens": tokens, "kernels": ran, "layers": layers,
            "graph_us_per_call": graph_ms * 1e3 / layers, "rel_err_vs_reference": err}


def _floor_case(
    dtype, kv_len: int, kvh: int, d: int, page: int, l2_bytes: int, reps: int, splits: int, q8: bool = False
) -> dict[str, Any]:
    """Per-call time of kernels that only read the K/V bytes of one decode attention call
    (tools/kernels/read_floor.cu), captured in graphs like the attention calls: the
    attention's gather with its own grid and with 4x the splits, and a contiguous read
    of as many bytes with 8 CTAs an SM. The attention kernel cannot beat these. ``q8``:
    the codes of int8 pools (their scales, 4 bytes a row, not read)."""
    import numpy as np
    import torch

    from edge.kernels.launcher import Launcher

    k_pool, v_pool, tables, n_seq = _kv_sequences(dtype, kv_len, kvh, d, page, l2_bytes, q8)
    if q8:
        k_pool, v_pool = k_pool.codes, v_pool.codes
    es = k_pool.element_size()
    chunks = d * es // 16
    seq_chunks = kv_len * kvh * chunks  # of K (and of V), contiguous in linear_read
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    launchers = {"serial": Launcher(torch.cuda.current_device())}
    launchers["overlapped"] = launchers["serial"].overlapped()
    sms = launchers["serial"].sm_count()
    gather = launchers["serial"].kernel(READ_FLOOR, "gather_read")
    linear = launchers["serial"].kernel(READ_FLOOR, "linear_read")
    log2_page = page.bit_length() - 1

    def gathers(n_splits: int) -> Callable[[Launcher], Callable[[], None]]:
        def bind(lau: Launcher) -> Callable[[], None]:
            def run() -> None:
                for i in range(n_seq):
                    args = (k_pool.data_ptr(), v_pool.data_ptr(), tables[i].data_ptr(), np.int32(kv_len),
                            np.int32(kvh), np.int32(chunks), np.int32(log2_page), np.int32(64), sink.data_ptr())
                    lau.launch(gather, (kvh, n_splits), 128, args)
            return run
        return bind

    def linears(lau: Launcher) -> Callable[[], None]:
        def run() -> None:
            for i in range(n_seq):
                off = i * seq_chunks * 16
                args = (k_pool.data_ptr() + off, v_pool.data_ptr() + off, np.int64(seq_chunks), sink.data_ptr())
                lau.launch(linear, 8 * sms, 256, args)
        return run

    moved = 2 * seq_chunks * 16
    out: dict[str, Any] = {"kv_len": kv_len, "bytes_per_call": moved}
    for name, fn in (
        (f"gather_{splits}_splits", gathers(splits)),
        (f"gather_{4 * splits}_splits", gathers(4 * splits)),
        (f"linear_{8 * sms}_ctas", linears),
    ):
        for mode, lau in launchers.items():
            graph = _capture(fn(lau))
            ms, _ = _median_ms(graph.replay, reps)
            out[f"{name}_{mode}_us"] = ms * 1e3 / n_seq
            del graph
    return out


def _prefill_case(
    pc, dtype, start: int, t: int, qh: int, kvh: int, d: int, page: int, reps: int, q8: bool = False
) -> dict[str, Any]:
    import torch

    total = start + t
    nb = -(-total // page)
    g = torch.Generator(device="cuda").manual_seed(total)
    k_pool = _random_pool((nb, page, kvh, d), dtype, q8, g)
    v_pool = _random_pool((nb, page, kvh, d), dtype, q8, g)
    table = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    q = torch.randn(t, qh, d, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    out = torch.empty_like(q)
    fn = lambda: pc.prefill_attention(
        q, k_pool, v_pool, table, start, 1 / math.sqrt(d), out=out
    )
    med, _ = _median_ms(fn, reps)
    keys = sum(start + i + 1 for i in range(t))
    flops = 4 * keys * d * qh
    return {
        "start": start,
        "T": t,
        "median_us": med * 1e3,
        "TFLOPs": flops / (med * 1e-3) / 1e12,
    }


def mode_kernels(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from edge.kernels import nvrtc, paged_cuda
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.launcher import Launcher

    if not torch.cuda.is_available():
        raise SystemExit("bench kernels: no CUDA GPU visible to torch")
    if args.sms:
        from orin_shape import restrict_sms

        args.green_context = restrict_sms(args.sms)  # first, before any stream; kept alive
    dtype = getattr(torch, _DTYPES[args.dtype])
    q8 = args.kv_dtype == "int8"
    kv_lens = [int(x) for x in args.kv_lens.split(",") if x]
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    launcher = Launcher(0)
    fused = FusedCuda(launcher)

    def attention(tuning: paged_cuda.DecodeTuning) -> dict[str, Any]:
        serial = paged_cuda.PagedAttentionCuda(launcher, fused, tuning, dtypes=(dtype,), head_dims=(args.head_dim,),
                                               kv_int8=q8)
        overlapped = launcher.overlapped()
        return {"serial": serial, "overlapped": serial.with_launcher(overlapped, fused.with_launcher(overlapped))}
    result: dict[str, Any] = {
        "mode": "kernels",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "sm": nvrtc.device_arch(0),
        "sms": launcher.sm_count(),
        "l2_bytes": l2,
        "torch": torch.__version__,
        "nvrtc": nvrtc.nvrtc_version(),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "shape": {
            "q_heads": args.q_heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page": args.page,
            "dtype": str(dtype),
            "kv_dtype": args.kv_dtype,
        },
    }
    copy = copy_bandwidth(args.copy_mib * 2**20, args.reps)
    result["copy"] = copy
    bw = copy["GBps"]

    def decode_all(tuning: paged_cuda.DecodeTuning) -> list[dict[str, Any]]:
        pcs = attention(tuning)
        rows = []
        for kv_len in kv_lens:
            r = _decode_case(
                pcs,
                dtype,
                kv_len,
                args.q_heads,
                args.kv_heads,
                args.head_dim,
                args.page,
                l2,
                args.reps,
                q8,
            )
            r["fraction_of_copy"] = r["GBps"] / bw
            r["graph_fraction_of_copy"] = r["graph_GBps"] / bw
            r["graph_overlapped_fraction_of_copy"] = r["graph_overlapped_GBps"] / bw
            rows.append(r)
            torch.cuda.empty_cache()
        return rows

    verify_tokens = [int(x) for x in args.verify_tokens.split(",") if x]

    def verify_all(tuning: paged_cuda.DecodeTuning) -> list[dict[str, Any]]:
        pc = attention(tuning)["serial"]
        return [_verify_case(pc, dtype, kv_len, args.q_heads, args.kv_heads, args.head_dim, args.page, args.layers,
                             args.reps, t, q8) for kv_len in kv_lens for t in verify_tokens]

    if args.sweep or args.tunings:
        sweep = []
        for tuning in json.loads(args.tunings) if args.tunings else SWEEP:
            try:
                t = paged_cuda.DecodeTuning(**tuning)
                sweep.append({"tuning": tuning, "decode": decode_all(t), "verify": verify_all(t)})
            except Exception as exc:  # report, keep going
                sweep.append(
                    {"tuning": tuning, "error": f"{type(exc).__name__}: {exc}"}
                )
        result["sweep"] = sweep
    result["decode"] = decode_all(paged_cuda.DecodeTuning())
    result["verify"] = verify_all(paged_cuda.DecodeTuning())
    if args.floor:
        result["floor"] = [
            _floor_case(dtype, x["kv_len"], args.kv_heads, args.head_dim, args.page, l2, args.reps, x["splits"], q8)
            for x in result["decode"]
        ]
        for f in result["floor"]:
            for key in [k for k in f if k.endswith("_us")]:
                f[key.removesuffix("_us") + "_fraction_of_copy"] = f["bytes_per_call"] / (f[key] * 1e-6) / 1e9 / bw
    if args.prefill:
        result["prefill"] = [
            _prefill_case(
                attention(paged_cuda.DecodeTuning())["serial"],
                dtype,
                s,
                t,
                args.q_heads,
                args.kv_heads,
                args.head_dim,
                args.page,
                args.reps,
                q8,
            )
            for s, t in ((0, 512), (0, 2048), (4096, 512))
        ]
    _print_kernels_table(result)
    torch.cuda.empty_cache()
    return result


def _print_kernels_table(r: dict[str, Any]) -> None:
    out = sys.stderr
    print(
        f"# {r['device']} ({r['sm']}, {r['sms']} SMs), torch {r['torch']}, NVRTC {r['nvrtc']}, {r['date']}",
        file=out,
    )
    print(
        f"# copy bandwidth: {r['copy']['GBps']:.0f} GB/s (read+write, median)", file=out
    )
    for sw in r.get("sweep", []):
        tag = " ".join(
            f"{k}={v}"
            for k, v in sw["tuning"].items()
        )
        if "error" in sw:
            print(f"# sweep {tag}: {sw['error'][:300]}", file=out)
            continue
        cells = " ".join(
            f"{x['kv_len']}:{x['splits']}:{x['kernel_us']:.2f}us:{x['fraction_of_copy']:.3f}/{x['graph_fraction_of_copy']:.3f}"
            f"/{x['graph_overlapped_fraction_of_copy']:.3f}"
            for x in sw["decode"]
        )
        k = sw["decode"][-1]["kernel"]
        print(
            f"# sweep {tag} regs={k.get('num_regs')} ctas/sm={k.get('ctas_per_sm')} -> {cells}",
            file=out,
        )
        for v in sw["verify"]:
            print(f"# sweep {tag} verify kv_len={v['kv_len']} T={v['tokens']}: {v['graph_us_per_call']:.2f} us "
                  f"({', '.join(v['kernels'])})", file=out)
    print(
        f"{'kv_len':>7} {'splits':>6} {'kern us':>8} {'GB/s':>6} {'of copy':>8} {'graph us':>9} {'of copy':>8}"
        f" {'overl us':>9} {'of copy':>8} {'eager us':>9} {'host us':>8} {'rel err':>8}",
        file=out,
    )
    for x in r["decode"]:
        print(
            f"{x['kv_len']:>7} {x['splits']:>6} {x['kernel_us']:>8.2f} {x['GBps']:>6.0f} {x['fraction_of_copy']:>8.1%}"
            f" {x['graph_us_per_call']:>9.2f} {x['graph_fraction_of_copy']:>8.1%}"
            f" {x['graph_overlapped_us_per_call']:>9.2f} {x['graph_overlapped_fraction_of_copy']:>8.1%}"
            f" {x['eager_us_per_call']:>9.2f} {x['host_us_per_call']:>8.2f}"
            f" {max(x['rel_err_vs_reference'].values()):>8.1e}",
            file=out,
        )
    for v in r.get("verify", []):
        print(f"# verify kv_len={v['kv_len']} T={v['tokens']}: {v['graph_us_per_call']:.2f} us a call, "
              f"rel err {v['rel_err_vs_reference']:.1e} ({', '.join(v['kernels'])})", file=out)
    for f in r.get("floor", []):
        cells = "  ".join(
            f"{k.removesuffix('_us')} {v:.2f} us ({f[k.removesuffix('_us') + '_fraction_of_copy']:.1%})"
            for k, v in f.items()
            if k.endswith("_us")
        )
        print(f"# read floor kv_len={f['kv_len']}: {cells}", file=out)
    for p in r.get("prefill", []):
        print(
            f"# prefill start={p['start']} T={p['T']}: {p['median_us']:.1f} us, {p['TFLOPs']:.1f} TFLOP/s",
            file=out,
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="mode", required=True)

    k = sub.add_parser(
        "kernels", help="copy bandwidth and paged decode attention bandwidth"
    )
    k.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    k.add_argument("--kv-dtype", default="auto", choices=("auto", "int8"),
                   help="the pools: the model dtype, or int8 codes with a float32 scale a row")
    k.add_argument("--kv-lens", default="512,2048,8192")
    k.add_argument("--q-heads", type=int, default=32)
    k.add_argument("--kv-heads", type=int, default=8)
    k.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    k.add_argument("--page", type=int, default=16)
    k.add_argument("--reps", type=int, default=50, help="timed repetitions (median)")
    k.add_argument(
        "--copy-mib",
        type=int,
        default=2048,
        help="size of the copy for the bandwidth ceiling",
    )
    k.add_argument(
        "--sweep", action="store_true", help="also time the decode tunings in SWEEP"
    )
    k.add_argument(
        "--tunings",
        default="",
        help='JSON list of tunings to sweep instead of SWEEP, e.g. \'[{"impl": "tc", "max_splits": 32}]\'',
    )
    k.add_argument("--prefill", action="store_true", help="also time prefill attention")
    k.add_argument("--verify-tokens", default="",
                   help="also time the verify step's attention (RoPE fused) for these token counts, e.g. 1,5,8 "
                   "(1: the decode step's launch)")
    k.add_argument("--layers", type=int, default=36, help="layers' pools the verify calls cycle through, as a step does")
    k.add_argument("--sms", type=int, default=None,
                   help="restrict the process to N SMs (green context): the read floors are then the "
                   "bandwidth ceiling an Orin-shaped projection needs")
    k.add_argument(
        "--floor",
        action="store_true",
        help="also time kernels that only read the same K/V bytes (tools/kernels/read_floor.cu)",
    )
    k.set_defaults(func=mode_kernels)

    # End-to-end modes live in their own modules beside this file.
    import bench_board
    import bench_decode
    import bench_scheduler
    import bench_speculative
    import bench_structured
    import bench_vision

    d = sub.add_parser("decode", help="end-to-end decode benchmark (tools/bench_decode.py)")
    bench_decode.add_arguments(d)
    d.set_defaults(func=bench_decode.run)
    sch = sub.add_parser("scheduler", help="ping-pong scheduler benchmark (tools/bench_scheduler.py)")
    bench_scheduler.add_arguments(sch)
    sch.set_defaults(func=bench_scheduler.run)
    v = sub.add_parser("vision", help="vision-language: tower time, TTFT with an image, decode (tools/bench_vision.py)")
    bench_vision.add_arguments(v)
    v.set_defaults(func=bench_vision.run)
    sp = sub.add_parser("speculative", help="speculative decoding: verify cost per k, speed-ups (tools/bench_speculative.py)")
    bench_speculative.add_arguments(sp)
    sp.set_defaults(func=bench_speculative.run)
    st = sub.add_parser("structured", help="structured output: time per token with a schema / tools, compile and "
                        "mask times (tools/bench_structured.py)")
    bench_structured.add_arguments(st)
    st.set_defaults(func=bench_structured.run)
    b = sub.add_parser("board", help="the board owner's benchmark: TensorRT Edge-LLM's shapes, energy, power mode "
                       "(tools/bench_board.py)")
    bench_board.add_arguments(b)
    b.set_defaults(func=bench_board.run)
    return ap


def check_device(args: argparse.Namespace) -> None:
    """A mode bound for a GPU on a machine where torch sees none stops in one line
    naming the CPU run, where the mode has one."""
    import torch

    device = getattr(args, "device", None)
    if (device or "cuda").startswith("cuda") and not torch.cuda.is_available():
        cpu = " (on the CPU: --device cpu)" if device is not None else (
            " (on the CPU: tools/bench.py scheduler, speculative or vision with --device cpu)")
        raise SystemExit(f"bench.py {args.mode}: torch sees no CUDA GPU{cpu}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_device(args)
    result = args.func(args)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
