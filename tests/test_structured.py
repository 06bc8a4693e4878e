"""Structured output on the CPU with the random-weight embedded model: only the grammar
mask makes its output valid, so every finished output must parse and validate
(``jsonschema``, an oracle we did not write) against hypothesis-generated schemas and tool
sets; speculative + constrained greedy output equals plain constrained decoding; bad
schemas are refused naming the field; the output parser streams what it parses whole."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.runtime.engine import Engine
from edge.model.random_model import make_model
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler
from edge.speculative.params import SpeculativeParams
from edge.structured.compiler import GrammarCompiler
from edge.structured.errors import GrammarError
from edge.structured.formats import HERMES
from edge.structured.output import OutputParser, parse_output
from edge.structured.request import parse_structured

MAX_TOKENS = 160  # room for every generated schema's longest compact answer


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(kv_cache="paged", page_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    tok = engine.tokenizer
    c = GrammarCompiler(tok.to_json(), engine.cfg.vocab_size, tok.eos_token_ids)
    yield c
    c.close()


# -- generated schemas: bounded, so a finished answer exists within MAX_TOKENS ---------------

NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.one_of(NAMES, st.integers(0, 9)), min_size=1, max_size=4,
                                                    unique=True)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}-[0-9]{2}$"])),
)


def _object(props: dict, required_all: bool) -> dict:
    return {"type": "object", "properties": props, "required": sorted(props) if required_all else [],
            "additionalProperties": False}


def _array(items: dict, n: int) -> dict:
    return {"type": "array", "items": items, "minItems": min(1, n), "maxItems": n}


inner = st.one_of(
    leaf,
    st.builds(_array, leaf, st.integers(0, 3)),
    st.builds(lambda a, b: {"anyOf": [a, b]}, leaf, leaf),
)
schemas = st.one_of(
    st.builds(_object, st.dictionaries(NAMES, inner, min_size=1, max_size=4), st.booleans()),
    st.builds(lambda props: {"$defs": {"item": _object(props, True)}, "type": "object",
                             "properties": {"items": _array({"$ref": "#/$defs/item"}, 2)},
                             "required": ["items"], "additionalProperties": False},
              st.dictionaries(NAMES, leaf, min_size=1, max_size=2)),
)


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**31))
def test_generated_schema_outputs_validate(engine: Engine, compiler: GrammarCompiler, schema: dict,
                                           temperature: float, seed: int) -> None:
    req = parse_structured(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    grammar = compiler.compile(req)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)
    r = engine.generate(_chat(engine, "Answer in JSON."), params, grammar.matcher())
    assert r.finish_reason == "stop", (r.text, schema)
    jsonschema.validate(json.loads(r.text), schema)


TOOL_SETS = st.lists(
    st.builds(lambda name, props: {"type": "function", "function": {"name": name, "description": "a tool",
                                                                    "parameters": _object(props, True)}},
              NAMES, st.dictionaries(NAMES, leaf, max_size=3)),
    min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"],
)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tools=TOOL_SETS, choice=st.sampled_from(["required", "named"]), seed=st.integers(0, 2**31))
def test_generated_tool_calls_validate(engine: Engine, compiler: GrammarCompiler, tools: list, choice: str,
                                       seed: int) -> None:
    named = tools[seed % len(tools)]["function"]["name"]
    tool_choice = {"type": "function", "function": {"name": named}} if choice == "named" else "required"
    req = parse_structured(tools=tools, tool_choice=tool_choice, parallel_tool_calls=False)
    r = engine.generate(_chat(engine, "Call a tool."), SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0,
                                                                      seed=seed), compiler.compile(req).matcher())
    assert r.finish_reason == "stop", r.text
    parsed = parse_output(r.text, HERMES, tools=True)
    assert len(parsed.tool_calls) == 1 and parsed.content is None, r.text
    call = parsed.tool_calls[0]
    if choice == "named":
        assert call.name == named
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.arguments), params[call.name])
    assert call.id.startswith("call_")


def test_tool_choice_and_thinking_shapes(engine: Engine, compiler: GrammarCompiler) -> None:
    """What each tool_choice and thinking mode lets through, token by token: auto takes
    text or text then calls, required only calls, a think block (free text) comes first."""
    tools = [{"type": "function", "function": {"name": "light", "parameters": _object({"on": {"type": "boolean"}},
                                                                                       True)}}]
    call = '<tool_call>\n{"name": "light", "arguments": {"on": true}}\n</tool_call>'
    bad_call = '<tool_call>\n{"name": "light", "arguments": {"on": 1}}\n</tool_call>'
    eos = min(engine.tokenizer.eos_token_ids)

    def passes(text: str, **kw) -> bool:
        matcher = compiler.compile(parse_structured(tools=tools, **kw)).matcher()
        ids = engine.tokenizer.encode(text) + [eos]
        return matcher.valid_prefix(ids) == len(ids)

    assert passes("Just text, no call.") and passes("Sure. " + call) and passes(call + "\n" + call)
    assert not passes("Sure. " + bad_call) and not passes(call + " and text after")
    assert passes(call, tool_choice="required") and not passes("Just text.", tool_choice="required")
    assert not passes(call + "\n" + call, tool_choice="required", parallel_tool_calls=False)
    assert passes("<think>\nA lamp. <tool_call> is fine in here.\n</think>\n\n" + call, tool_choice="required",
                  thinking="on")
    assert passes(call, tool_choice="required", thinking="on")
    assert passes("hmm </think>\n\n" + call, tool_choice="required", thinking="open")
    assert not passes(call, tool_choice="required", thinking="open")  # the open block must close first
    assert compiler.compile(parse_structured(tools=tools, tool_choice="none")) is None  # nothing to constrain


def test_speculative_constrained_greedy_equals_plain_constrained(engine: Engine, compiler: GrammarCompiler,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Proposals (an unconstrained draft with other weights, and prompt lookup) are cut at
    the first token the grammar rejects and every verified position is masked: greedy
    output is the plain constrained run's, token for token."""
    schema = _object({"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 10**6},
                      "tags": _array({"enum": ["a", "bb", "ccc"]}, 3)}, True)
    req = parse_structured(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    grammar = compiler.compile(req)
    draft = Engine.from_pretrained(make_model(tmp_path_factory.mktemp("d") / "seed1", seed=1), kv_cache="paged",
                                   page_size=4, num_blocks=128)
    sched = Scheduler(engine, draft=draft)
    sched.start()
    try:
        ids = _chat(engine, 'JSON {"name": "x", "n": 1, "tags": ["a"]} again {"name": "x", "n": 1')
        plain = sched.submit(ids, SamplingParams(max_tokens=MAX_TOKENS), grammar=grammar.matcher()).result(120)
        assert plain.finish_reason == "stop"
        jsonschema.validate(json.loads(plain.text), schema)
        for method in ("draft", "ngram"):
            spec = SamplingParams(max_tokens=MAX_TOKENS, speculative=SpeculativeParams(method, 4))
            r = sched.submit(ids, spec, grammar=grammar.matcher()).result(120)
            assert r.token_ids == plain.token_ids, method
            assert r.usage.speculative["steps"] < len(r.token_ids) or method == "ngram"
        # Both slots at once: one constrained, one not.
        a = sched.submit(ids, SamplingParams(max_tokens=MAX_TOKENS), grammar=grammar.matcher())
        b = sched.submit(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        assert a.result(120).token_ids == plain.token_ids
        assert len(b.result(120).token_ids) == 24
    finally:
        sched.stop()


# -- bad input ---------------------------------------------------------------------------------

BAD = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format.json_schema.schema", "foo"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
     "response_format.json_schema.schema", "not"),
    (dict(tools=[{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "(unclosed"}}}}}]),
     "tools[0].function.parameters", "unclosed"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name", "name"),
    (dict(tools=[{"type": "function", "function": {"name": "a"}}], tool_choice={"type": "function",
                                                                               "function": {"name": "b"}}),
     "tool_choice", "'b'"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(response_format={"type": "xml"}), "response_format.type", "xml"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format.json_schema.name", "name"),
]


@pytest.mark.parametrize("kwargs,param,needle", BAD)
def test_bad_requests_name_the_field(compiler: GrammarCompiler, kwargs: dict, param: str, needle: str) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(parse_structured(**kwargs))
    assert info.value.param == param and needle in info.value.message
    assert "\n" not in info.value.message


def test_compile_cache_and_time_limit(engine: Engine) -> None:
    tok = engine.tokenizer
    c = GrammarCompiler(tok.to_json(), engine.cfg.vocab_size, tok.eos_token_ids, time_limit_s=1e-4)
    try:
        # Hundreds of patterned properties: far more than a tenth of a millisecond to build.
        big = _object({f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7}}}[0-9]+x{i}$"} for i in range(300)},
                      True)
        req = parse_structured(response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": big}})
        for _ in range(2):  # again: the running compile is shared, then its refusal cached
            with pytest.raises(GrammarError) as info:
                c.compile(req)
            assert info.value.code == "grammar_too_complex"
        c.time_limit_s = 60.0
        small = parse_structured(response_format={"type": "json_object"})
        first = c.compile(small)
        assert c.compile(small) is first and c.hits == 1
    finally:
        c.close()


# -- the output parser ---------------------------------------------------------------------------

TEXTS = [
    ("off", True, 'Sure, one moment.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'),
    ("on", True, '<think>\nThe user wants a light.\n</think>\n\n<tool_call>\n{"name": "light", "arguments": '
                 '{"on": true}}\n</tool_call>'),
    ("open", False, "hmm, 2 < 3 </think>\n\nThe answer is <tool_call> literally."),
    ("on", True, "No thinking here; a <tool_ mention and <think> later."),
    ("off", True, '<tool_call>\n{"name": "a", "argu'),  # cut by max_tokens: stays text
]


@pytest.mark.parametrize("thinking,tools,text", TEXTS)
def test_stream_parser_agrees_with_whole_parse(thinking: str, tools: bool, text: str) -> None:
    whole = parse_output(text, HERMES, thinking, tools)
    for step in (1, 3, 7):
        p = OutputParser(HERMES, thinking, tools)
        deltas = [d for i in range(0, len(text), step) for d in p.feed(text[i:i + step])] + p.finish()
        content = "".join(d.get("content", "") for d in deltas) or None
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert (content, reasoning) == (whole.content, whole.reasoning)
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(i, c.name, json.loads(c.arguments)) for i, c in enumerate(whole.tool_calls)]
    if "</tool_call>" in text:
        assert whole.tool_calls and all(c.id.startswith("call_") for c in whole.tool_calls)
        assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)
    if text.endswith('"argu'):
        assert whole.content == text and not whole.tool_calls


def test_chat_front_end_shows_tool_calls_and_keeps_them() -> None:
    """``edge chat``: the calls of an answer are printed and go into the history."""
    import io

    from edge.serving.chat_client import run_chat

    call = {"id": "call_1", "type": "function", "function": {"name": "set_light", "arguments": '{"on": true}'}}
    sent: list[list[dict]] = []

    class Client:
        last_finish, last_usage, last_tool_calls = None, None, []

        def stream_chat(self, messages, params, request_id):
            sent.append([dict(m) for m in messages])
            self.last_tool_calls = [call]
            yield "Sure."

        def cancel(self, request_id):
            return True

    lines = iter(["light on", "again"])

    def read_line(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    assert run_chat(Client(), {}, out=out, read_line=read_line) == 0
    assert '[tool call] set_light({"on": true})' in out.getvalue()
    assert sent[1][1] == {"role": "assistant", "content": "Sure.", "tool_calls": [call]}


def test_images_and_prefix_reuse_with_a_grammar(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A vision-language model's answer about an image follows the schema (the decode
    steps after the image run at RoPE positions shifted by the image); the same request
    again reuses the cached prefix, image included, and gives the same tokens."""
    import numpy as np
    from PIL import Image

    from edge.model.vision.random_model import make_vl_model

    path = make_vl_model(tmp_path_factory.mktemp("vl"), "qwen3-vl-tiny", std=0.1)
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", page_size=8)
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok.to_json(), engine.cfg.vocab_size, tok.eos_token_ids)
    schema = _object({"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}}, True)
    grammar = compiler.compile(parse_structured(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    prompt = engine.chat_prompt([{"role": "user", "content": [{"type": "image", "image": image},
                                                              {"type": "text", "text": "What colour?"}]}])
    sched = Scheduler(engine)
    sched.start()
    try:
        first = sched.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS), grammar=grammar.matcher()).result(120)
        again = sched.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS), grammar=grammar.matcher()).result(120)
    finally:
        sched.stop()
        compiler.close()
    assert first.finish_reason == "stop", first.text
    jsonschema.validate(json.loads(first.text), schema)
    assert again.usage.cached_tokens > 0 and again.token_ids == first.token_ids
