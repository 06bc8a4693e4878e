"""Structured output and tool calls through the official ``openai`` SDK against a live
``edge serve`` on loopback (random-weight embedded model with a Qwen3-style tool and
thinking template): ``chat.completions.parse`` with a Pydantic model, tools streamed and
whole, tool results in the history, reasoning split off, bad schemas refused with 400
naming the field while another stream runs on."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_server_support import ServerProc, ensure_default_model

# The shape of Qwen3's template where tools and thinking are concerned: tools listed in
# the system turn, earlier calls as <tool_call> blocks, results as <tool_response> in a
# user turn, and an empty think block when thinking is switched off.
TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'You can call these tools:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

LIGHT = {"type": "function", "function": {
    "name": "set_light", "description": "Switch a lamp",
    "parameters": {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"},
                                                    "level": {"type": "integer", "minimum": 0, "maximum": 100}},
                   "required": ["room", "on", "level"], "additionalProperties": False}}}
CHARGER = {"type": "function", "function": {
    "name": "next_charger", "description": "Distance to the next charger",
    "parameters": {"type": "object", "properties": {"max_km": {"type": "integer", "minimum": 1, "maximum": 500}},
                   "required": ["max_km"], "additionalProperties": False}}}
TOOLS = [LIGHT, CHARGER]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Reading(BaseModel):
    model_config = {"extra": "forbid"}  # additionalProperties: false, as the SDK's strict schemas

    sensor: Literal["temp", "humidity"]
    value: int = Field(ge=-40, le=120)
    note: str = Field(max_length=6)
    ok: bool


def slow_schema() -> dict:
    """An enum of 20 000 long strings: a second or so to compile, within the request
    body's value and container limits (edge/serving/json_body.py)."""
    return {"enum": [f"{i:06d}" + "-x" * 12 for i in range(20_000)]}


def tools_model(tmp: Path) -> Path:
    """The embedded model with the tools template (weights linked, not copied)."""
    src = ensure_default_model()
    out = tmp / "tools-model"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("structured")
    srv = ServerProc(tmp, "--model", str(tools_model(tmp)))
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory):
    """Grammars must compile within 5 ms: far less than slow_schema() takes, whatever the
    machine (its 20 000 alternatives alone are written into the grammar text in Python)."""
    srv = ServerProc(tmp_path_factory.mktemp("strict"), "--grammar-time-limit-s", "0.005")
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# The template thinks unless told not to; random weights would think on and on.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        done = client.chat.completions.parse(model="m", messages=ask("Read the sensor."), response_format=Reading,
                                             max_tokens=120, temperature=1.0, seed=seed, extra_body=NO_THINK)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Reading)
    beta = getattr(getattr(client, "beta", None), "chat", None)
    if beta is not None and hasattr(beta.completions, "parse"):  # the older SDKs' spelling
        done = beta.completions.parse(model="m", messages=ask("Again."), response_format=Reading, max_tokens=120,
                                      extra_body=NO_THINK)
        assert isinstance(done.choices[0].message.parsed, Reading)


def test_json_object_and_streamed_schema(client: openai.OpenAI) -> None:
    schema = Reading.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": schema, "strict": True}}
    stream = client.chat.completions.create(model="m", messages=ask("Stream it."), response_format=fmt,
                                            max_tokens=120, stream=True, stream_options={"include_usage": True},
                                            extra_body=NO_THINK)
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    assert reasons[-1] == "stop", text
    jsonschema.validate(json.loads(text), schema)
    assert usage is not None and usage.model_extra["grammar"]["masks"] >= usage.completion_tokens
    r = client.chat.completions.create(model="m", messages=ask("Any object."), response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0.0, extra_body=NO_THINK)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _check_calls(calls, parallel: bool) -> None:
    assert calls and (parallel or len(calls) == 1)
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def test_tool_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    kw = dict(model="m", tools=TOOLS, max_tokens=200, temperature=1.0, seed=5, extra_body=NO_THINK)
    r = client.chat.completions.create(messages=ask("Kitchen light on."), tool_choice="required",
                                       parallel_tool_calls=False, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    _check_calls(choice.message.tool_calls, parallel=False)
    named = {"type": "function", "function": {"name": "next_charger"}}
    with client.chat.completions.stream(messages=ask("Charger?"), tool_choice=named, **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, parallel=False)
    assert choice.message.tool_calls[0].function.name == "next_charger"
    # The call and its result go back into the history, rendered by the template.
    history = ask("Charger?") + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in choice.message.tool_calls]},
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": '{"km": 12}'},
    ]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_thinking_goes_to_reasoning_content(server: ServerProc) -> None:
    """Thinking on (the template's default): the answer may open with a think block, free
    text before the constrained JSON. Random weights rarely close it, so a short run
    shows either a valid answer or reasoning, streamed as delta.reasoning_content."""
    schema = Reading.model_json_schema()
    body = {"messages": ask("Think, then answer in JSON."), "max_tokens": 24, "temperature": 1.0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    thought = 0
    with server.client() as c:
        for seed in range(8):
            events = [json.loads(line[6:]) for line in c.post("/v1/chat/completions", json=body | {"seed": seed})
                      .text.splitlines() if line.startswith("data: {")]
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            assert "<think>" not in reasoning + content
            if events[-1]["choices"][0]["finish_reason"] == "stop":
                jsonschema.validate(json.loads(content), schema)
            thought += bool(reasoning)
    assert thought, "no seed opened a think block"


def test_bad_schemas_400_while_a_stream_runs(server: ServerProc, client: openai.OpenAI) -> None:
    n = 300
    result: dict = {}

    def stream() -> None:
        with server.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": ask("long"), "max_tokens": n, "ignore_eos": True,
                                                     "stream": True, "stream_options": {"include_usage": True}})
            result["text"] = r.text

    t = threading.Thread(target=stream)
    t.start()
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "q", "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
         "tools[0].function.parameters"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=ask("x"), max_tokens=8, **extra)
        err = info.value.body
        assert info.value.status_code == 400 and err["message"] and "\n" not in err["message"]
        assert err["param"] == param, err
    t.join(300)
    events = [json.loads(line[6:]) for line in result["text"].splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == n


def test_pathological_schemas_do_not_stall_a_stream(strict_server: ServerProc) -> None:
    """A schema that takes seconds to compile, posted again and again while a stream
    runs: each is refused (400 grammar_too_complex, the compile shared, then its refusal
    cached) and the stream's largest gap and /health's latency stay within 100 ms, or
    three times a quiet second's (the hostile tests' rule, tests/test_hostile.py).
    (Parsing a large JSON body holds the interpreter in any request, this one's too.)"""
    from hostile_support import large_prompt_attack

    body = json.dumps({"messages": ask("x"), "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "huge", "schema": slow_schema()}}}).encode()
    with strict_server.client() as c:
        err = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}).json()
    assert err["error"]["code"] == "grammar_too_complex", err
    for _ in range(2):  # a stall must show twice in a row to count (once can be the machine)
        fig = large_prompt_attack(strict_server, senders=1, rounds=3, body=body)
        assert fig["attack_statuses"] == [400] * 3 and fig["count_503"] == 0, fig
        limit = 100.0
        if (fig["stream_max_gap_ms"] <= max(limit, 3 * fig["quiet_stream_max_gap_ms"])
                and fig["health_max_ms"] <= max(limit, 3 * fig["quiet_health_max_ms"])):
            return
    raise AssertionError(f"stalled twice: {json.dumps(fig)}")


def test_voice_runs_the_calls_and_speaks_the_answer(server: ServerProc, tmp_path: Path) -> None:
    """``edge voice --tools --tool-handler``: a spoken request, a call (required on the
    turn's first answer), the handler's result back to the model, its answer spoken."""
    pytest.importorskip("pocketsphinx")
    import importlib.util
    import os

    from test_server_support import ROOT, server_env

    spec = importlib.util.spec_from_file_location("voice_bench", ROOT / "tools" / "voice_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    log = tmp_path / "calls.jsonl"
    (tmp_path / "recorder.py").write_text(
        "import json, os\n"
        "def handle(name, arguments):\n"
        "    with open(os.environ['CALL_LOG'], 'a') as f:\n"
        "        f.write(json.dumps({'name': name, 'arguments': arguments}) + '\\n')\n"
        "    return {'ok': True}\n")
    wav, out = tmp_path / "ask.wav", tmp_path / "answer.wav"
    bench.make_conversation_wav(wav, parts=((0.5, "Turn the kitchen light on please."),))
    env = server_env(CALL_LOG=str(log), PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    turns, stderr = bench.run_voice(
        ["--url", server.base_url], wav, out,
        ["--tools", str(tmp_path / "tools.json"), "--tool-handler", "recorder:handle", "--tool-choice", "required",
         "--max-tokens", "160", "--temperature", "1", "--seed", "3", "--system", ""], env=env)
    assert len(turns) == 1, stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls, stderr
    for c in calls:
        jsonschema.validate(c["arguments"], PARAMS[c["name"]])
    assert "[tool call]" in stderr
