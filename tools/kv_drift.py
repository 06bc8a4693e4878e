#!/usr/bin/env python3
"""How far int8 K/V moves a model's outputs: drift against float K/V, reported.

    python tools/kv_drift.py [--device cpu|cuda] [--quantize none|int8|int4] [--tokens 200]
                             [--contexts 512,4096] [--skip-presets] [--skip-transformers] [--json]

Two parts, each a table:

- **presets**: the verification suite of tools/verify_paged.py (its prompts; on the CPU
  the embedded model in float32, on a GPU ``qwen3-peaked`` in bfloat16, weights as
  ``--quantize``) with K/V in the model's dtype (the baseline: greedy ``--tokens`` tokens
  a case) and in int8, on the device's own kernels. ``agree``: the share of the
  baseline's tokens that int8 K/V also ranks first when fed the same tokens (teacher
  forced); ``max|dlogit|``: over those positions; ``free run``: how many greedy tokens
  int8 K/V produces before its first different one (``-``: none differ).
- **transformers**: random-weight models (the embedded ``tiny`` shape, flat logits, and
  a peaked variant whose greedy path is decisive) against Hugging Face transformers in
  float32: a random prompt, transformers' greedy ``--tokens`` tokens after it, so that
  the last one sits at position ``context``; edge with float32 K/V (the control) and
  with int8 K/V is fed the same tokens; the same columns, against transformers.

Nothing here is a pass/fail gate: the numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:
    import edge  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge.model.random_model import cached_model  # noqa: E402
from edge.runtime.engine import Engine, default_device  # noqa: E402
from edge.runtime.verify import default_model, prompt_suite, run_case  # noqa: E402


@dataclass
class Drift:
    part: str
    model: str
    case: str
    kv: str
    tokens: int
    agree: float
    max_abs_dlogit: float
    free_run: int | None  # greedy tokens before the first different one (None: none differ)


def forced_logits(engine: Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(tokens), vocab]`` (CPU) of each position that predicts
    ``tokens[i]``, the engine fed the prompt and then ``tokens`` one decode step at a time."""
    seq = engine.new_sequence()
    try:
        out = [engine.prefill(seq, prompt).float().cpu()]
        for tok in tokens[:-1]:
            out.append(engine.forward(seq, [tok]).float().cpu())
    finally:
        engine.end_sequence(seq)
    return torch.stack(out)


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate(prompt, max_tokens=n, ignore_eos=True).token_ids


def compare(part: str, model: str, case: str, kv: str, want: list[int], ref: torch.Tensor, got: torch.Tensor,
            free: list[int]) -> Drift:
    ranked = got.argmax(dim=-1).tolist()
    agree = sum(a == b for a, b in zip(ranked, want)) / len(want)
    first = next((i for i, (a, b) in enumerate(zip(free, want)) if a != b), None)
    return Drift(part, model, case, kv, len(want), agree, (got - ref).abs().max().item(), first)


def preset_rows(device: torch.device, dtype: str | None, quantize: str | None, tokens: int) -> list[Drift]:
    """The verification suite with float K/V (baseline) and int8 K/V, each case's turns
    run as verify_paged runs them; teacher forcing along the baseline's last turn."""
    path = default_model(device, dtype)
    # A pool for two full sequences, not the budget's default share of the device.
    common = dict(device=device, dtype=dtype, max_seq_len=1024, cuda_graph=False, quantize=quantize, kv_blocks=128)
    base = Engine.from_pretrained(path, **common)
    q8 = Engine(base.model, base.tokenizer, base.model_dir, max_seq_len=1024, kv_dtype="int8",
                num_blocks=2 * -(-1024 // base.page_size), cuda_graph=False)
    label = base.model_dir.name + ("" if quantize is None else f" ({quantize} weights)")
    rows = []
    for case in prompt_suite(base, base.page_size, tokens):
        trace = run_case(base, case)
        # The last turn's prompt as run_case sends it: every turn's new tokens, each earlier
        # turn's answer after them.
        prompt: list[int] = []
        done = 0
        for new_ids, n in case.turns[:-1]:
            prompt += new_ids + trace.tokens[done : done + n]
            done += n
        prompt += case.turns[-1][0]
        want = trace.tokens[done:]
        ref = torch.stack(trace.logits[done:])
        got = forced_logits(q8, prompt, want)
        rows.append(compare("presets", label, case.name, "int8", want, ref, got, greedy(q8, prompt, len(want))))
    return rows


def transformers_rows(contexts: list[int], tokens: int) -> list[Drift]:
    """Random-weight models against transformers (float32, CPU)."""
    import transformers

    models = {
        "tiny": cached_model("default-v1", arch="qwen3", preset="tiny", seed=0, dtype="float32"),
        "tiny-peaked": cached_model("tiny-peaked-float32-v1", preset="tiny", seed=0, dtype="float32",
                                    tie_word_embeddings=False, init_profile="peaked", max_position_embeddings=8192),
    }
    rows = []
    for name, path in models.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        for context in contexts:
            seq_len = context + 8
            engines = {kv: Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=seq_len,
                                                  kv_dtype=kv, kv_blocks=-(-seq_len // 16) + 1)
                       for kv in ("auto", "int8")}
            g = torch.Generator().manual_seed(context)
            prompt = torch.randint(3, vocab - 3, (context - tokens + 1,), generator=g).tolist()
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, pad_token_id=0)
                want = out[0, len(prompt):].tolist()
                ref = hf(out[:, :-1]).logits[0, len(prompt) - 1:].float()
            for kv, engine in engines.items():
                got = forced_logits(engine, prompt, want)
                label = "float32" if kv == "auto" else "int8"
                rows.append(compare("transformers", name, f"context {context}", label, want, ref, got,
                                    greedy(engine, prompt, tokens)))
            del engines
    return rows


def print_table(rows: list[Drift]) -> None:
    head = f"{'part':<13} {'model':<28} {'case':<18} {'kv':<8} {'tokens':>6} {'agree':>7} {'max|dlogit|':>11} {'free run':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        free = "-" if r.free_run is None else str(r.free_run)
        print(f"{r.part:<13} {r.model:<28} {r.case:<18} {r.kv:<8} {r.tokens:>6} {r.agree:>7.1%} "
              f"{r.max_abs_dlogit:>11.3g} {free:>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kv_drift", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", help="the presets' dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none", help="the presets' weights")
    p.add_argument("--tokens", type=int, default=200, help="greedy tokens compared a case")
    p.add_argument("--contexts", default="512,4096", help="positions of the last token, against transformers")
    p.add_argument("--skip-presets", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device) if args.device else default_device()
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    if any(c <= args.tokens for c in contexts):
        p.error(f"every context must exceed --tokens ({args.tokens}): the prompt holds the rest")
    rows: list[Drift] = []
    if not args.skip_presets:
        rows += preset_rows(device, args.dtype, None if args.quantize == "none" else args.quantize, args.tokens)
    if not args.skip_transformers:
        rows += transformers_rows(contexts, args.tokens)
    if args.json:
        print(json.dumps({"device": str(device), "rows": [asdict(r) for r in rows]}))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
