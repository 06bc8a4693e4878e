"""Structured output on the GPU (skipped without one): constrained greedy decoding beside
an unconstrained request in the other slot, and speculative + constrained (prompt lookup
and a draft model, through the verify graphs) giving plain constrained decoding's tokens.
float32 on the embedded model, so no near-tie decides a token differently between the
decode and verify kernels."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edge.runtime.engine import Engine
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler
from edge.speculative.params import SpeculativeParams
from edge.structured.compiler import GrammarCompiler
from edge.structured.request import parse_structured

pytestmark = pytest.mark.cuda

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "n": {"type": "integer", "minimum": 0, "maximum": 10**6},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    e = Engine.from_pretrained(device="cuda", dtype="float32", page_size=16, max_seq_len=1024)
    e.capture_graphs(speculative_tokens=4)
    return e


def test_constrained_graph_engine_speculative_equals_plain(engine: Engine) -> None:
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok.to_json(), engine.cfg.vocab_size, tok.eos_token_ids)
    twin = Engine.from_pretrained(device="cuda", dtype="float32", page_size=16, max_seq_len=1024, kv_blocks=160)
    twin.capture_graphs()
    sched = Scheduler(engine, draft=twin)
    sched.start()
    try:
        grammar = compiler.compile(parse_structured(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}))
        ids = tok.encode_chat([{"role": "user", "content": 'JSON {"name": "x", "n": 1, "tags": ["a"]} again'}])
        plain = sched.submit(ids, SamplingParams(max_tokens=160), grammar=grammar.matcher())
        other = sched.submit(ids, SamplingParams(max_tokens=64, ignore_eos=True))  # the other slot, free
        p = plain.result(300)
        assert p.finish_reason == "stop" and len(other.result(300).token_ids) == 64
        jsonschema.validate(json.loads(p.text), SCHEMA)
        for method in ("ngram", "draft"):
            r = sched.submit(ids, SamplingParams(max_tokens=160, speculative=SpeculativeParams(method, 4)),
                             grammar=grammar.matcher()).result(300)
            assert r.token_ids == p.token_ids, method
            assert r.usage.speculative["verify"] == "graph"
    finally:
        sched.stop()
        compiler.close()
