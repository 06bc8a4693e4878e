#!/usr/bin/env python3
"""Compare grammar engines for structured output (docs/structured.md): llguidance (the
one edge uses) and xgrammar (``pip install --no-deps xgrammar apache-tvm-ffi``, only
for this comparison). For the embedded tokenizer and one grown to Qwen3's 151936 ids:
the token-trie build, one JSON schema's compile, the mask time per token along a valid
answer (first mask apart), and which JSON Schema keywords each accepts; for the keywords
it accepts but does not enforce, whether an invalid instance still passes.

    PYTHONPATH=. python tools/grammar_engines.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from edge.model.random_model import covering_tokenizer_json, special_token_ids, tokenizer_json  # noqa: E402

SCHEMA = {
    "$defs": {"addr": {"type": "object", "properties": {"street": {"type": "string"},
                                                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                       "required": ["street", "zip"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["robot", "human", "cat"]},
        "home": {"$ref": "#/$defs/addr"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "kind", "home", "tags", "score"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Lighthouse unit 7", "age": 3, "kind": "robot",
                     "home": {"street": "Mill road 12", "zip": "01234"},
                     "tags": ["green light", "fan", "coffee"], "score": 0.75}, separators=(",", ":"))
# keyword -> (schema, an instance that violates it, or None)
KEYWORDS: dict[str, tuple[dict, str | None]] = {
    "$ref / $defs": (SCHEMA, None),
    "recursive $ref": ({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items":
                       {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}, None),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}, "{}"),
    "enum / const": ({"enum": ["a", 1, None]}, '"b"'),
    "pattern": ({"type": "string", "pattern": "^[a-z]+[0-9]{2}$"}, '"a1"'),
    "format: date-time": ({"type": "string", "format": "date-time"}, '"noon"'),
    "minLength / maxLength": ({"type": "string", "minLength": 2, "maxLength": 5}, '"abcdefg"'),
    "minItems / maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1]"),
    "additionalProperties: false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, '{"b":1}'),
    "minimum / maximum": ({"type": "integer", "minimum": 3, "maximum": 9}, "12"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    '["a"]'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    "not": ({"not": {"type": "string"}}, '"a"'),
}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def walk(fill: Callable[[], Any], allowed: Callable[[Any, int], bool], accept: Callable[[int], Any],
         ids: list[int]) -> list[float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        mask = fill()
        times.append(time.perf_counter() - t0)
        assert allowed(mask, t), f"token {t} not allowed"
        accept(t)
    return times


def run_llguidance(tok_json: str, n_vocab: int, eos: int, ids: list[int]) -> dict:
    import llguidance as llg
    import llguidance.numpy as lnp

    tok, t_tok = timed(lambda: llg.LLTokenizer(tok_json, n_vocab=n_vocab, eos_token=eos))

    def compile_(schema: dict) -> Any:
        return llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}), log_level=0)

    m, t_comp = timed(lambda: compile_(SCHEMA))
    mask = lnp.allocate_token_bitmask(1, n_vocab)

    def fill() -> Any:
        lnp.fill_next_token_bitmask(m, mask, 0)
        return mask

    times = walk(fill, lambda mk, t: bool((int(mk[0, t // 32]) >> (t % 32)) & 1), m.consume_token, ids)
    coverage = {}
    for name, (schema, bad) in KEYWORDS.items():
        mm = compile_(schema)
        if mm.is_error():
            coverage[name] = "refused: " + mm.get_error().splitlines()[0][:60]
        elif bad is not None:
            coverage[name] = "enforced" if mm.try_consume_tokens(tok.tokenize_str(bad)) < len(
                tok.tokenize_str(bad)) or not mm.is_accepting() else "ACCEPTS INVALID"
        else:
            coverage[name] = "enforced"
    return {"trie_ms": t_tok * 1e3, "compile_ms": t_comp * 1e3, "times": times, "coverage": coverage}


def run_xgrammar(tok_path: str, n_vocab: int, eos: int, ids: list[int]) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=tok_path)
    info, t_tok = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab, stop_token_ids=[eos]))
    comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    cg, t_comp = timed(lambda: comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                        separators=(",", ":"), strict_mode=True))
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, n_vocab)

    def fill() -> Any:
        m.fill_next_token_bitmask(mask, 0)
        return mask

    times = walk(fill, lambda mk, t: bool((int(mk[0, t // 32]) >> (t % 32)) & 1), m.accept_token, ids)
    coverage = {}
    for name, (schema, bad) in KEYWORDS.items():
        try:
            g = comp.compile_json_schema(json.dumps(schema), strict_mode=True)
        except Exception as exc:  # noqa: BLE001 - each engine's own error type
            coverage[name] = "refused: " + str(exc).splitlines()[0][:60]
            continue
        if bad is not None and xgr.GrammarMatcher(g).accept_string(bad):
            coverage[name] = "ACCEPTS INVALID"
        else:
            coverage[name] = "enforced"
    return {"trie_ms": t_tok * 1e3, "compile_ms": t_comp * 1e3, "times": times, "coverage": coverage}


def main() -> int:
    from tokenizers import Tokenizer

    eos = special_token_ids()["<|im_end|>"]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, text in (("embedded", tokenizer_json()), ("qwen3-sized", covering_tokenizer_json(151936))):
            path = os.path.join(tmp, f"{label}.json")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            hf = Tokenizer.from_str(text)
            n_vocab = hf.get_vocab_size(with_added_tokens=True)
            ids = hf.encode(ANSWER).ids + [eos]
            for engine, fn in (("llguidance", lambda: run_llguidance(text, n_vocab, eos, ids)),
                               ("xgrammar", lambda: run_xgrammar(path, n_vocab, eos, ids))):
                try:
                    r = fn()
                except ImportError:
                    continue
                t = sorted(r["times"][1:])
                row = {"vocab": n_vocab, "trie_ms": r["trie_ms"], "compile_ms": r["compile_ms"],
                       "first_mask_us": r["times"][0] * 1e6, "mean_us": statistics.mean(t) * 1e6,
                       "p50_us": t[len(t) // 2] * 1e6, "p90_us": t[int(len(t) * 0.9)] * 1e6, "tokens": len(ids)}
                if label == "embedded":
                    row["keywords"] = r["coverage"]
                out[f"{engine} / {label}"] = row
                print(f"{engine:10s} {label:12s} trie {row['trie_ms']:7.1f} ms  compile {row['compile_ms']:7.1f} ms  "
                      f"mask mean {row['mean_us']:6.1f} us  p50 {row['p50_us']:5.1f}  p90 {row['p90_us']:6.1f}",
                      file=sys.stderr)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
