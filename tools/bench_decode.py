"""End-to-end decode benchmark (the ``decode`` mode of tools/bench.py).

One run measures everything it compares: device copy bandwidth, decode tok/s at
batch 1 eager and with CUDA graphs, the fraction of the memory roofline, TTFT at
several prompt lengths, host-to-device bytes per decode step, CPU seconds per token,
the kernels one captured step launches, peak memory, and with ``--compare-hf``
Hugging Face transformers on the same weights: ``generate()`` with a static cache
compiled by torch.compile (its documented fast path) and, beside it, eager.
``--sms N`` restricts the process to N SMs first (a CUDA green context: 16 is an AGX
Orin's SM count, 8 an Orin NX / Nano's). ``--kv-dtype int8`` holds K/V in int8 (codes
and a float32 scale a row). ``step_breakdown``: GPU time per kernel of one graph decode
step at the context (launches serialised, so the times add up), with attention's share
of the step's kernel time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from edge.model.config import ModelConfig, parse_dtype
from edge.runtime.engine import Engine
from edge.model.loader import fuse_weights
from edge.model.decoder import Model
from edge.quant.int4_checkpoints import quantize_fused_weights
from edge.quant.q8_0 import DEFAULT_GROUP_SIZE, LM_HEAD, Int8Weight, quantize_tensor, weight_tensors
from edge.model.random_model import default_model_path, iter_random_tensors, model_config
from edge.sampling import SamplerState, SamplingParams
from edge.model.tokenizer import Tokenizer
from edge.runtime.budget import kv_row_bytes
from orin_shape import restrict_sms, stream_factory


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory")
    src.add_argument("--preset", default="qwen3-0.6b", help="random preset built on the GPU (qwen3-0.6b|qwen3-1.7b|qwen3-8b|llama-3.2-1b)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=128, help="prompt length before the timed decode")
    p.add_argument("--ttft-lengths", default="128,512,2048")
    p.add_argument("--prefill-chunk", type=int, default=None, dest="engine_prefill_chunk", metavar="TOKENS",
                   help="tokens a prefill forward takes at most (default: the engine's, longer for quantized weights)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--compare-hf", action="store_true", help="also time transformers with a static cache")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--quantize", choices=("none", "int8", "int4"), default="none",
        help="int8: W8A16 projections (q8_0, group 128); int4: W4A16 (RTN, group 128; lm_head and embedding int8)",
    )
    p.add_argument("--sms", type=int, default=None, help="restrict the process to N SMs (green context) before anything runs")
    p.add_argument("--no-hf-compile", action="store_true", help="with --compare-hf: skip the compiled transformers run")
    p.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto",
                   help="K/V rows: the model dtype, or int8 codes with a float32 scale a row")


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def read_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device read bandwidth in bytes/s: a kernel that only reads ``nbytes`` contiguously
    (tools/kernels/read_floor.cu, 8 CTAs an SM of the current context). The ceiling of a
    weight-streaming decode where a copy's writes are not (few SMs: the copy is
    issue-bound before the memory is)."""
    import numpy as np

    from edge.kernels.launcher import Launcher

    launcher = Launcher(torch.cuda.current_device())
    kernel = launcher.kernel(str(Path(__file__).resolve().parent / "kernels" / "read_floor.cu"), "linear_read")
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    half = nbytes // 32  # 16-byte chunks in each half

    def read() -> None:
        launcher.launch(kernel, 8 * launcher.sm_count(), 256,
                        (buf.data_ptr(), buf.data_ptr() + 16 * half, np.int64(half), sink.data_ptr()))

    for _ in range(3):
        read()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        read()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del buf
    return 32 * half / statistics.median(times)


def build_engine(args: argparse.Namespace, streams: Any = None) -> tuple[Engine, dict]:
    dtype = parse_dtype(args.dtype)
    device = torch.device(getattr(args, "device", None) or "cuda")
    if args.model:
        engine = Engine.from_pretrained(
            args.model, device=device, dtype=dtype, page_size=args.page_size, max_seq_len=args.max_seq_len, quantize=_quantize(args),
            stream_factory=streams, prefill_chunk=getattr(args, "engine_prefill_chunk", None), kv_dtype=_kv_dtype(args),
        )
        return engine, engine.cfg.raw
    raw = model_config(preset=args.preset)
    if device.type == "cpu":
        check_host_memory(raw, dtype, args.preset)
    if getattr(args, "init_profile", None):
        raw["init_profile"] = args.init_profile
        if args.init_profile == "peaked":
            raw["tie_word_embeddings"] = False  # the successor rows live in an own lm_head
    cfg = ModelConfig.from_dict(raw)
    weights = fuse_weights(iter_random_tensors(raw, 0, dtype, device), cfg, device, dtype)
    if _quantize(args) == "int4":
        quantize_fused_weights(weights, cfg, dtype)
    elif _quantize(args):
        quantize_projections(weights, cfg)
    model = Model(cfg, weights, args.max_seq_len)
    tokenizer = Tokenizer.from_pretrained(default_model_path())
    # Size the pool for the benchmark's longest sequence twice over, not the whole GPU.
    blocks = 2 * (-(-args.max_seq_len // args.page_size)) + 8
    engine = Engine(model, tokenizer, Path(f"preset:{args.preset}"), page_size=args.page_size, max_seq_len=args.max_seq_len,
                    num_blocks=blocks, stream_factory=streams, prefill_chunk=getattr(args, "engine_prefill_chunk", None),
                    kv_dtype=_kv_dtype(args))
    return engine, raw


def _kv_dtype(args: argparse.Namespace) -> str:
    return getattr(args, "kv_dtype", None) or "auto"
def check_host_memory(raw: dict, dtype: torch.dtype, preset: str) -> None:
    """A random preset built in host RAM: refused in one line when its weights cannot fit
    in the memory available, with a warning on stderr when they take over half of it."""
    import math
    import sys

    from edge.runtime.budget import fmt_bytes, host_memory
    from edge.model.random_model import state_dict_shapes

    need = sum(math.prod(s) for s in state_dict_shapes(raw).values()) * torch.empty((), dtype=dtype).element_size()
    _, available, _ = host_memory()
    what = f"the {preset} preset's weights take {fmt_bytes(need)} in {str(dtype).removeprefix('torch.')}"
    if need > available:
        raise SystemExit(f"bench: {what}, more than the {fmt_bytes(available)} of memory available; "
                         "choose a smaller --preset (tiny, qwen3-0.6b)")
    if 2 * need > available:
        print(f"bench: warning: {what} of the {fmt_bytes(available)} available", file=sys.stderr)


def serial_engine(engine: Engine, args: argparse.Namespace, streams: Any = None) -> Engine:
    """An engine over ``engine``'s weights and pool size whose launches do not overlap."""
    return Engine(
        engine.model, engine.tokenizer, engine.model_dir, page_size=args.page_size, max_seq_len=args.max_seq_len,
        num_blocks=engine.kv.pool.num_blocks, overlap_launches=False, stream_factory=streams, kv_dtype=engine.kv_dtype,
    )


def _quantize(args: argparse.Namespace) -> str | None:
    q = getattr(args, "quantize", "none")
    return None if q in (None, "none") else q


def quantize_projections(weights: dict, cfg: ModelConfig, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """Replace the fused float projections (and an untied lm_head) by int8 ones in
    place, one tensor at a time: the bits route B (quantize while loading) gives, as
    quantization works row by row and fusion only stacks rows."""
    for name in list(weights):
        if name.endswith("_proj.weight") or (name == LM_HEAD and not cfg.tie_word_embeddings):
            q, s = quantize_tensor(weights[name], group_size, name=name)
            weights[name] = Int8Weight(q, s, group_size)


def prompt_ids(engine: Engine, n: int, seed: int) -> list[int]:
    """``n`` seeded token ids the tokenizer can decode (random presets pad the vocab)."""
    vocab = min(engine.cfg.vocab_size, 800)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def weight_bytes_per_token(engine: Engine) -> int:
    """Bytes of weights one decode step reads: all of them but the embedding table,
    of which it reads one row (with tied embeddings the table is read as lm_head).
    Quantized weights count their codes, scales and zero points (Model.weight_bytes)."""
    cfg = engine.cfg
    total = engine.model.weight_bytes()
    if not cfg.tie_word_embeddings:
        table = sum(t.numel() * t.element_size() for t in weight_tensors(engine.model.w["model.embed_tokens.weight"]))
        total -= table - table // cfg.vocab_size
    return total


def kv_bytes(engine: Engine, kv_len: int) -> int:
    """K/V bytes a decode step at ``kv_len`` reads (int8: codes and scales)."""
    cfg = engine.cfg
    return 2 * cfg.num_layers * kv_len * cfg.num_kv_heads * kv_row_bytes(cfg.head_dim, engine.dtype, engine.kv_dtype)


@contextmanager
def prefilled(engine: Engine, prompt: list[int], graph: bool) -> Iterator[tuple]:
    """(seq, decoder or None, first token, sampler) after prefilling ``prompt``; with a
    graph the decoder is bound and has captured and replayed once, so no timed region
    includes capture."""
    engine.cuda_graph = graph
    seq = engine.new_sequence(slot=0)
    sampler = SamplerState(engine.cfg.vocab_size, engine.device)
    sampler.load(SamplingParams(), prompt)
    try:
        token = torch.argmax(engine.prefill(seq, prompt)).view(1)
        decoder = engine.slot_decoder(seq)
        if decoder is not None:
            decoder.bind(seq, sampler, token)
            decoder.read(decoder.launch(seq, True))
        torch.cuda.synchronize()
        yield seq, decoder, token, sampler
    finally:
        engine.end_sequence(seq)


def time_decode(engine: Engine, prompt: list[int], n: int, graph: bool) -> float:
    """Seconds for n decode steps after a prefill of ``prompt`` (prefill not timed).
    Graph steps are all enqueued before the last token is read: GPU-bound throughput."""
    with prefilled(engine, prompt, graph) as (seq, decoder, token, sampler):
        t0 = time.perf_counter()
        if decoder is not None:
            for _ in range(n):
                slot = decoder.launch(seq, True)
            decoder.read(slot)
        else:
            for _ in range(n):
                token = engine.decode(seq, token, sampler, True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def cpu_per_token(engine: Engine, prompt: list[int], n: int) -> dict:
    """CPU seconds this process spends per token while graph decode streams tokens as
    a server does (each read waits for its step): what a slow CPU pays for waiting."""
    with prefilled(engine, prompt, graph=True) as (seq, decoder, _, _):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            decoder.next_token(seq, True)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        engine.settle(seq)
    return {"tokens": n, "cpu_s_per_token": cpu / n, "wall_s_per_token": wall / n, "cpu_share": cpu / wall}


def step_kernels(engine: Engine, prompt: list[int]) -> dict[str, int]:
    """Kernel launches of one captured greedy decode step, by name."""
    with prefilled(engine, prompt, graph=True) as (_, decoder, _, _):
        return decoder.captured_kernels[(True, False)]


# The decode step's attention kernels (tensor-core or CUDA-core, RoPE fused or not, int8 KV).
ATTENTION_KERNELS = ("paged_decode",)


def step_breakdown(engine: Engine, prompt: list[int], reps: int = 10) -> dict:
    """GPU time per kernel name of one graph decode step after ``prompt`` (the torch
    profiler over ``reps`` steps), and attention's share of the step's kernel time."""
    from bench_speculative import _kernel_table

    with prefilled(engine, prompt, graph=True) as (seq, decoder, _, _):
        table = _kernel_table(lambda: decoder.read(decoder.launch(seq, True)), reps)
    attention = sum(k["us"] for k in table["kernels"] if k["name"].startswith(ATTENTION_KERNELS))
    return table | {"attention_us": attention, "attention_share": attention / table["kernel_us"]}


def h2d_bytes_per_step(engine: Engine, prompt: list[int], n: int) -> dict:
    """Host-to-device copies per graph decode step, from the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    with prefilled(engine, prompt, graph=True) as (seq, decoder, _, _):
        crossings = sum(1 for i in range(n) if (seq.length + i) % engine.page_size == 0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                decoder.launch(seq, True)
            torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "HtoD" in e.name]
    return {
        "steps": n,
        "page_crossings": crossings,
        "h2d_copies": len(h2d),
        "table_bytes_synced_per_crossing": 4,
        "h2d_copies_per_step_inside_page": (len(h2d) - crossings) / max(n - crossings, 1),
    }


def energy_per_token(engine: Engine, prompt: list[int], n: int) -> dict:
    """Joules per decoded token from the monitor's NVML source (power integrated by
    the same EnergyMeter the service uses), during graph decode."""
    from edge.monitor import Monitor, MonitorConfig

    monitor = Monitor(MonitorConfig(period_s=0.02, source="nvml", metrics=False))
    if monitor.source.name != "nvml":
        return {"source": monitor.source.name, "joules_per_token": None}
    monitor.start()
    try:
        time.sleep(0.1)
        monitor.energy.begin("bench")
        seconds = time_decode(engine, prompt, n, graph=True)
        time.sleep(0.05)  # one more sample past the end of the window
        joules = monitor.energy.end("bench")
        latest = monitor.sampler.latest
    finally:
        monitor.stop()
    return {
        "source": "nvml",
        "tokens": n,
        "seconds": seconds,
        "joules": joules,
        "joules_per_token": joules / n if joules is not None else None,
        "temperature_c": latest.temperatures_c if latest else None,
        "power_w": latest.power_w if latest else None,
    }


def time_ttft(engine: Engine, length: int, repeats: int) -> float:
    """Milliseconds from submitting a prompt of ``length`` tokens to the first token on the host."""
    prompt = prompt_ids(engine, length, seed=1)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        seq = engine.new_sequence()
        int(torch.argmax(engine.prefill(seq, prompt)))
        times.append(time.perf_counter() - t0)
        seq.release()
    return statistics.median(times[1:]) * 1e3


def hf_decode(engine: Engine, raw: dict, prompt: list[int], n: int, compile: bool = True) -> dict:
    """transformers on the same weights, same GPU, same run: ``generate()`` with
    ``cache_implementation="static"`` (compiled by torch.compile, as its documentation
    recommends for speed) and an eager greedy loop on a static cache."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    cls = getattr(transformers, raw["architectures"][0])
    default = torch.get_default_dtype()
    torch.set_default_dtype(engine.dtype)
    try:
        with torch.device("cuda"):
            hf = cls(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    state = dict(iter_random_tensors(raw, 0, engine.dtype, torch.device("cuda")))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    del state
    # Greedy decode by hand on a StaticCache: eager transformers with its static cache,
    # no torch.compile (generate() would compile, and recompile per cache length).
    import transformers.cache_utils as cu

    cache = cu.StaticCache(config=cfg, max_cache_len=len(prompt) + n + 8)
    ids = torch.tensor([prompt], device="cuda")

    def decode_seconds() -> float:
        cache.reset()
        with torch.no_grad():
            out = hf(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(len(prompt), device="cuda"))
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(n):
                pos = torch.tensor([len(prompt) + i], device="cuda")
                out = hf(tok, past_key_values=cache, use_cache=True, cache_position=pos)
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    decode_seconds()  # warm-up
    out = {"eager_static_decode_tok_s": n / decode_seconds(), "missing_keys": len(missing), "unexpected_keys": len(unexpected)}
    if compile:
        out["compiled_static_decode_tok_s"] = _hf_generate_compiled(hf, ids, n)
    return out


def _hf_generate_compiled(hf, ids: torch.Tensor, n: int) -> float:  # noqa: ANN001
    """Decode tok/s of ``generate(cache_implementation="static")``, which transformers
    compiles by itself (its documented fast path): the time of n + 1 new tokens minus
    that of 1 (the prefill), after warm-up runs that trigger the compilation."""
    hf.generation_config.cache_implementation = "static"
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}

    def seconds(new: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        seconds(n + 1)
        seconds(1)
    long = statistics.median(seconds(n + 1) for _ in range(3))
    short = statistics.median(seconds(1) for _ in range(3))
    return n / (long - short)


def run(args: argparse.Namespace) -> dict:
    green = restrict_sms(args.sms) if args.sms else None  # first: before any stream exists
    torch.cuda.reset_peak_memory_stats()
    bw = copy_bandwidth()
    read_bw = read_bandwidth()
    streams = stream_factory(green) if green is not None else None
    engine, raw = build_engine(args, streams)
    serial = serial_engine(engine, args, streams)
    prompt = prompt_ids(engine, args.context, seed=0)
    n = args.decode_tokens
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "model": args.model or args.preset,
        "dtype": args.dtype,
        "quantize": _quantize(args) or "none",
        "kv_dtype": engine.kv_dtype,
        "backend": engine.backend.describe(),
        "sms": engine.backend.sms,
        "green_context": green is not None,
        "copy_bandwidth_GBps": bw / 1e9,
        "read_bandwidth_GBps": read_bw / 1e9,
        "weight_bytes": engine.model.weight_bytes(),
    }
    per_token = weight_bytes_per_token(engine) + kv_bytes(engine, args.context + n // 2)
    roofline = bw / per_token
    result["roofline_tok_s"] = roofline
    # graph: as the engine runs (launches overlapped on sm_90+); graph_serial: the same
    # graph with plainly serialised launches.
    for mode, graph, eng in (("eager", False, engine), ("graph_serial", True, serial), ("graph", True, engine)):
        times = [time_decode(eng, prompt, n, graph) for _ in range(args.repeats)]
        tok_s = n / statistics.median(times)
        result[f"decode_tok_s_{mode}"] = tok_s
        result[f"roofline_fraction_{mode}"] = tok_s / roofline
        result[f"read_roofline_fraction_{mode}"] = tok_s / (read_bw / per_token)
    result["graph_speedup_over_eager"] = result["decode_tok_s_graph"] / result["decode_tok_s_eager"]
    result["overlapped_launches"] = engine.backend.overlap_launches
    serial.cuda_graph = True
    result["step_breakdown"] = step_breakdown(serial, prompt) | {"launches": "serial (no overlap)"}
    del serial
    engine.cuda_graph = True
    result["step_kernels"] = step_kernels(engine, prompt)
    result["cpu_per_token"] = cpu_per_token(engine, prompt, n)
    spinning = Engine(
        engine.model, engine.tokenizer, engine.model_dir, page_size=args.page_size, max_seq_len=args.max_seq_len,
        num_blocks=engine.kv.pool.num_blocks, blocking_waits=False, stream_factory=streams, kv_dtype=engine.kv_dtype,
    )
    result["cpu_per_token_spinning_waits"] = cpu_per_token(spinning, prompt, n)
    del spinning
    result["h2d_per_step"] = h2d_bytes_per_step(engine, prompt, 64)
    result["prefill_chunk"] = engine.prefill_chunk
    result["ttft_ms"] = {
        str(length): time_ttft(engine, length, args.repeats)
        for length in (int(x) for x in args.ttft_lengths.split(","))
        if length < engine.max_seq_len
    }
    result["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    result["energy"] = energy_per_token(engine, prompt, 4 * n)
    if args.compare_hf:
        hf = hf_decode(engine, raw, prompt, n, compile=not args.no_hf_compile)
        result["hf"] = hf
        result["speedup_over_hf_eager_static"] = result["decode_tok_s_graph"] / hf["eager_static_decode_tok_s"]
        if "compiled_static_decode_tok_s" in hf:
            result["speedup_over_hf_compiled"] = result["decode_tok_s_graph"] / hf["compiled_static_decode_tok_s"]
    return result
