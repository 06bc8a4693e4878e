"""Structured output benchmark (the ``structured`` mode of tools/bench.py).

On one engine (a random preset, or ``--model``), through the scheduler as served:

- ``decode``: time per output token of a plain request, of one constrained by a JSON
  schema (long enough to time: eight strings of 32-48 characters) and of one that must
  call a tool (docs/examples/tools.json), each the median of ``--repeats`` runs of at most
  ``--tokens`` tokens; ``overhead`` is each constrained time over the plain one;
- ``compile``: the grammar engine's token trie for the model's vocabulary (once per
  model), then the schema's and the tools' grammar cold and from the cache;
- ``mask``: the host's time per token to compute the allowed-token bitmask, walking a
  valid answer of the schema token by token (mean, p50, p90), and as the constrained
  runs measured it (``usage.grammar``).

A random preset's vocabulary gets a tokenizer of its size (the embedded tokenizer grown
to it, edge.model.random_model.covering_tokenizer_json), so the mask walks a Qwen3-sized
vocabulary. ``--sms N`` first confines the process to N SMs (tools/orin_shape.py);
``--device cpu --preset tiny`` runs on the CPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench_decode import build_engine
from edge.model.random_model import covering_tokenizer_json
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler
from edge.structured.compiler import GrammarCompiler
from edge.structured.request import parse_structured
from orin_shape import restrict_sms, stream_factory

TOOLS_FILE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "tools.json"
NOTES_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "notes": {"type": "array", "items": {"type": "string", "minLength": 32, "maxLength": 48},
                  "minItems": 8, "maxItems": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["title", "notes", "count"],
    "additionalProperties": False,
}
VALID_ANSWER = {"title": "Mill road report",  # in the schema's property order, as the grammar writes it
                "notes": [f"note {i}: the river rose {i} cm overnight" for i in range(8)], "count": 42}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory")
    src.add_argument("--preset", default="qwen3-8b", help="random preset built on the device (qwen3-8b|qwen3-0.6b|tiny|...)")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none")
    p.add_argument("--init-profile", choices=("peaked", "random"), default="random")
    p.add_argument("--sms", type=int, default=None, help="restrict the process to N SMs (green context) first")
    p.add_argument("--tokens", type=int, default=192, help="most tokens of each timed request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=1024)


def run(args: argparse.Namespace) -> dict:
    if args.sms is not None and args.device != "cuda":
        raise SystemExit("--sms needs --device cuda")
    ctx = restrict_sms(args.sms) if args.sms is not None else None
    result = _measure(args, ctx)
    gc.collect()  # the engine's graphs go while the green context still exists
    if ctx is not None:
        torch.cuda.synchronize()
    return result


def _compiler(engine: Any, args: argparse.Namespace) -> tuple[GrammarCompiler, float]:
    tok = engine.tokenizer
    vocab = engine.cfg.vocab_size
    text = tok.to_json() if args.model else covering_tokenizer_json(vocab)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(text, vocab, tok.eos_token_ids)
    compiler.tokenizer  # the trie, built once per model
    return compiler, time.perf_counter() - t0


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _mask_walk(compiler: GrammarCompiler, grammar: Any) -> dict[str, float]:
    """Host time of each mask along a valid answer's tokens."""
    ids = compiler.tokenizer.tokenize_str(json.dumps(VALID_ANSWER, separators=(",", ":")))
    matcher = grammar.matcher()
    times = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.mask()
        times.append(time.perf_counter() - t0)
        matcher.accept(t)
    times.sort()
    return {"tokens": len(ids), "mean_us": statistics.mean(times) * 1e6, "p50_us": times[len(times) // 2] * 1e6,
            "p90_us": times[int(len(times) * 0.9)] * 1e6, "max_us": times[-1] * 1e6}


def _decode(sched: Scheduler, prompt: list[int], args: argparse.Namespace, grammar: Any, repeats: int) -> dict:
    runs = []
    for i in range(repeats):
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=grammar is None)
        r = sched.submit(prompt, params, grammar=None if grammar is None else grammar.matcher()).result(timeout=600)
        if len(r.token_ids) > 1 and r.usage.decode_tok_s:
            runs.append({"tokens": len(r.token_ids), "ms_per_token": 1e3 / r.usage.decode_tok_s,
                         "finish_reason": r.finish_reason, "grammar": r.usage.grammar})
    ms = statistics.median(x["ms_per_token"] for x in runs)
    out: dict[str, Any] = {"ms_per_token": ms, "tokens": [x["tokens"] for x in runs],
                           "finish_reasons": [x["finish_reason"] for x in runs]}
    masks = [x["grammar"]["mask_ms_per_token"] for x in runs if x["grammar"]]
    if masks:
        out["host_mask_ms_per_token"] = statistics.median(masks)
    return out


def _measure(args: argparse.Namespace, ctx: Any) -> dict:
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    engine, _ = build_engine(args, stream_factory(ctx) if ctx is not None else None)
    engine.capture_graphs()
    result: dict[str, Any] = {
        "mode": "structured",
        "date": _dt.date.today().isoformat(),
        "device": str(engine.device),
        "model": args.model or args.preset,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "vocab_size": engine.cfg.vocab_size,
    }
    if engine.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(engine.device)
        result["sms"] = engine.backend.sms
    compiler, trie_s = _compiler(engine, args)
    schema_req = parse_structured(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "notes", "schema": NOTES_SCHEMA}})
    tools_req = parse_structured(tools=json.loads(TOOLS_FILE.read_text()), tool_choice="required")
    schema_g, schema_cold = _timed(lambda: compiler.compile(schema_req))
    _, schema_hot = _timed(lambda: compiler.compile(schema_req))
    tools_g, tools_cold = _timed(lambda: compiler.compile(tools_req))
    _, tools_hot = _timed(lambda: compiler.compile(tools_req))
    result["compile"] = {"tokenizer_trie_ms": trie_s * 1e3, "schema_cold_ms": schema_cold * 1e3,
                         "schema_cached_ms": schema_hot * 1e3, "tools_cold_ms": tools_cold * 1e3,
                         "tools_cached_ms": tools_hot * 1e3}
    result["mask"] = _mask_walk(compiler, schema_g)
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Write the mill road report as JSON."}])
    sched = Scheduler(engine, queue_size=2)
    sched.start()
    try:
        _decode(sched, prompt, args, None, 1)  # warm-up
        plain = _decode(sched, prompt, args, None, args.repeats)
        schema = _decode(sched, prompt, args, schema_g, args.repeats)
        tools = _decode(sched, prompt, args, tools_g, args.repeats)
    finally:
        sched.stop()
        compiler.close()
    for row in (schema, tools):
        row["overhead"] = row["ms_per_token"] / plain["ms_per_token"] - 1.0
    result["decode"] = {"plain": plain, "schema": schema, "tools": tools}
    return result
