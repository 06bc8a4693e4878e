"""OpenAI wire format: request models, validation into engine inputs, response bodies.

Requests are parsed strictly (a string where a number belongs is a 400, not a silent
conversion) and unknown fields are ignored, as OpenAI does. Parameter mapping:

* ``temperature`` defaults to 1.0 (OpenAI's default), range [0, 2]; 0 is greedy.
* ``top_p`` in [0, 1] (0 keeps only the most likely token); ``seed`` any integer.
* ``max_completion_tokens`` (or the older ``max_tokens``): 0 .. context length. 0 is a
  prefill-only request that warms the prefix cache. When prompt + max_tokens exceeds
  the context the request is not refused: generation stops at the context's end with
  ``finish_reason: "length"``. Unset: the rest of the context (or the server's
  ``EDGE_DEFAULT_MAX_TOKENS``).
* ``stop``: a string or a list of up to 16 non-empty strings.
* ``frequency_penalty`` / ``presence_penalty``: only 0 is accepted (400 otherwise);
  use the ``repetition_penalty`` extension instead.
* Extensions: ``top_k``, ``repetition_penalty``, ``ignore_eos``, ``speculative``
  (``{"method": "ngram" | "draft" | "off", "num_tokens": 1..16}``; unset: the server's default;
  "off": plain decoding whatever the default).
  A speculative response's ``usage`` carries ``speculative``: steps, proposed and
  accepted tokens, tokens per step, acceptance rate.
* Structured output and tools (edge/structured, docs/structured.md): ``response_format``
  (``json_object``, ``json_schema``), ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
  ``tool`` messages and assistant messages with ``tool_calls``, ``chat_template_kwargs``
  (e.g. ``{"enable_thinking": false}``). Responses carry ``tool_calls`` (finish_reason
  ``tool_calls``) and a thinking model's ``reasoning_content``; ``usage.grammar`` (extension)
  the host's mask time.
* Refused with 400: ``n`` > 1, ``logprobs``/``top_logprobs``, the legacy ``functions`` /
  ``function_call`` (use ``tools``), ``logit_bias``, ``echo``, ``suffix``, ``best_of`` > 1,
  content parts other than text and ``image_url`` (the latter only for vision-language
  models: edge/model/vision/request.py), batched prompts.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edge.serving.errors import BadRequest

if TYPE_CHECKING:  # torch stays out of the import path until the model loads
    from edge.structured.output import ParsedOutput
    from edge.structured.request import StructuredRequest
    from edge.sampling import SamplingParams

MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

_T = TypeVar("_T")
# A list validated up to its first bad item: a million bad items make one error, not a
# million (building them held the interpreter for seconds).
Items = Annotated[list[_T], Field(fail_fast=True)]


def bad_request(message: str, param: str | None = None, code: str | None = None) -> BadRequest:
    return BadRequest(message, param=param, code=code)


# -- request models ----------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageUrl(_Strict):
    url: str | None = None
    detail: str | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(_Strict):
    role: str
    content: str | Items[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


class SpeculativeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a misspelt key is a 400, not plain decoding

    method: str
    num_tokens: int = 4


class _Common(_Strict):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | Items[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM spells them the same way)
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    speculative: SpeculativeRequest | None = None


class ChatCompletionRequest(_Common):
    messages: Items[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | Items[int] | Items[str] | Items[Items[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


def parse_request(body: bytes, model: type[BaseModel]) -> Any:
    """Validate a JSON body; BadRequest naming the offending parameter."""
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> BadRequest:
    errors = exc.errors(include_url=False)
    err = errors[0]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return bad_request(
            f"could not parse the JSON body of the request: {err.get('ctx', {}).get('error', err.get('msg'))}",
            code="invalid_json",
        )
    if kind in ("model_type", "model_attributes_type") and not err.get("loc"):
        return bad_request("the request body must be a JSON object", code="invalid_json")
    # Unions report one error per member; name the field, not the member.
    loc = [p for p in err.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    param = _param_name(loc)
    if kind == "missing":
        return bad_request(f"missing required parameter '{param}'", param=param, code="missing_required_parameter")
    got = err.get("input")
    got_s = _short(got)
    return bad_request(f"invalid type or value for '{param}': {err.get('msg')} (got {got_s})", param=param,
                       code="invalid_type" if "type" in kind else "invalid_value")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _param_name(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _brief_repr() -> reprlib.Repr:
    r = reprlib.Repr()  # keyword arguments only from Python 3.12
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 2, 4, 4, 40, 40
    return r


_REPR = _brief_repr()


def _short(value: Any) -> str:
    # reprlib: a few items of a million-item list, not a repr of all of them
    s = _REPR.repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


# -- validation into engine inputs -------------------------------------------------------


# Fields whose mere presence (truthy) asks for something this server does not do.
_REJECT_WHEN_SET: dict[type, tuple[str, ...]] = {
    ChatCompletionRequest: ("logit_bias", "logprobs", "top_logprobs", "functions", "function_call"),
    CompletionRequest: ("logit_bias", "logprobs", "echo", "suffix"),
}


def check_unsupported(req: _Common) -> None:
    """400 for OpenAI features this server does not implement (never silently ignored)."""
    if req.n not in (None, 1):
        raise bad_request("only n=1 is supported", param="n", code="unsupported_parameter")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(req, name)
        if v is not None and v != 0:
            raise bad_request(
                f"{name} is not supported; use repetition_penalty (e.g. 1.1) instead",
                param=name,
                code="unsupported_parameter",
            )
    for name in _REJECT_WHEN_SET[type(req)]:
        if getattr(req, name) not in (None, False, "none", "auto", [], {}):
            hint = "; use tools / tool_choice" if name in ("functions", "function_call") else ""
            raise bad_request(f"{name} is not supported{hint}", param=name, code="unsupported_parameter")
    if isinstance(req, CompletionRequest) and req.best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", param="best_of", code="unsupported_parameter")


def image_urls(req: ChatCompletionRequest) -> list[str]:
    """The URLs of the ``image_url`` parts of the user messages, in order."""
    return [
        part.image_url.url
        for m in req.messages
        if m.role == "user" and isinstance(m.content, list)
        for part in m.content
        if part.type == "image_url" and part.image_url is not None and part.image_url.url
    ]


def chat_messages(req: ChatCompletionRequest, images: bool = False) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: {role, content} with text content, or,
    where a user message holds images (``images``: the model takes them), a list of text
    and ``image_url`` parts in order."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages", code="empty_array")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        param = f"messages[{i}]"
        role = m.role
        if role not in CHAT_ROLES:
            if role == "function":
                raise bad_request(f"{param}: function messages are not supported; use tool messages",
                                  param=f"{param}.role", code="unsupported_parameter")
            raise bad_request(
                f"{param}: invalid role {role!r}; expected one of {', '.join(CHAT_ROLES)}",
                param=f"{param}.role",
                code="invalid_value",
            )
        if m.function_call:
            raise bad_request(f"{param}: function_call is not supported; use tool_calls",
                              param=f"{param}.function_call", code="unsupported_parameter")
        if m.tool_calls and role != "assistant":
            raise bad_request(f"{param}: only assistant messages carry tool_calls", param=f"{param}.tool_calls",
                              code="invalid_value")
        extra: dict[str, Any] = {}
        if m.tool_calls:
            extra["tool_calls"] = [_history_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(m.tool_calls)]
        if role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"{param}: a tool message needs tool_call_id", param=f"{param}.tool_call_id",
                                  code="missing_required_parameter")
            extra["tool_call_id"] = m.tool_call_id
            if m.name:
                extra["name"] = m.name
        content = m.content
        if content is None:
            if role != "assistant":
                raise bad_request(f"{param}: content is required for role {role!r}", param=f"{param}.content",
                                  code="missing_required_parameter")
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                if part.type == "image_url" and images and role == "user":
                    if part.image_url is None or not part.image_url.url:
                        raise bad_request(f"{param}.content[{j}]: an image_url part needs image_url.url",
                                          param=f"{param}.content[{j}].image_url.url",
                                          code="missing_required_parameter")
                    parts.append({"type": "image_url", "image_url": {"url": part.image_url.url}})
                elif part.type == "text" and part.text is not None:
                    parts.append({"type": "text", "text": part.text})
                else:
                    kinds = "text and, in user messages, image_url" if images else "text"
                    raise bad_request(
                        f"{param}.content[{j}]: this model takes {kinds} content parts only (got {part.type!r})",
                        param=f"{param}.content[{j}].type",
                        code="unsupported_parameter",
                    )
            if any(p["type"] == "image_url" for p in parts):
                out.append({"role": role, "content": parts})
                continue
            text = "".join(p["text"] for p in parts)
        out.append({"role": "system" if role == "developer" else role, "content": text, **extra})
    return out


def _history_call(call: Any, param: str) -> dict[str, Any]:
    """An assistant message's earlier tool call as chat templates take it (transformers'
    shape: ``arguments`` as an object where the client sent its JSON text)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{param} needs function.name", param=f"{param}.function.name",
                          code="missing_required_parameter")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{param}.function.arguments is not JSON", param=f"{param}.function.arguments",
                              code="invalid_value") from None
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def structured_request(req: ChatCompletionRequest) -> StructuredRequest:
    """The request's response format and tools, validated (GrammarError names the field);
    the thinking mode is set once the prompt is rendered."""
    from edge.structured.request import parse_structured

    return parse_structured(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """What the chat template gets beside the messages: ``chat_template_kwargs`` and the
    tools (as transformers' ``apply_chat_template(messages, tools=...)``)."""
    from edge.model.tokenizer import TEMPLATE_FUNCTIONS
    from edge.structured.request import parse_tools

    given = req.chat_template_kwargs or {}
    for name in TEMPLATE_FUNCTIONS:
        if name in given:
            raise bad_request(f"chat_template_kwargs may not set {name!r}: it is a function the chat template calls",
                              param="chat_template_kwargs")
    kwargs = {k: v for k, v in given.items() if k not in ("messages", "add_generation_prompt", "tools")}
    tools = parse_tools(req.tools)
    if tools:
        kwargs["tools"] = [t.as_template_dict() for t in tools]
    return kwargs


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    p = req.prompt
    if isinstance(p, str):
        return p
    if not p:
        raise bad_request("'prompt' must not be empty", param="prompt", code="empty_array")
    if isinstance(p[0], int):  # the model validated p as one of list[int], list[str], list[list[int]]
        return p  # type: ignore[return-value]
    if len(p) != 1:
        raise bad_request("batched prompts are not supported: send one prompt per request", param="prompt",
                          code="unsupported_parameter")
    return p[0]  # type: ignore[return-value]


def requested_max_tokens(req: _Common) -> tuple[int | None, str]:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def sampling_params(
    req: _Common,
    prompt_len: int,
    max_seq_len: int,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """SamplingParams for a validated request whose prompt has ``prompt_len`` tokens."""
    from edge.sampling import SamplingParams

    room = max(max_seq_len - prompt_len, 0)
    max_tokens, mt_param = requested_max_tokens(req)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens < 0:
        raise bad_request(f"{mt_param} must be >= 0, got {max_tokens}", param=mt_param, code="invalid_value")
    elif max_tokens > max_seq_len:
        raise bad_request(
            f"{mt_param} {max_tokens} exceeds the model's context length of {max_seq_len} tokens",
            param=mt_param,
            code="invalid_value",
        )
    else:
        max_tokens = min(max_tokens, room)

    temperature = 1.0 if req.temperature is None else req.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise bad_request(f"temperature must be in [0, 2], got {temperature}", param="temperature",
                          code="invalid_value")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not (math.isfinite(top_p) and 0.0 <= top_p <= 1.0):
        raise bad_request(f"top_p must be in [0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_p = max(top_p, 1e-6)  # the most likely token always survives: 0 keeps just it
    top_k = 0 if req.top_k is None else req.top_k
    if not 0 <= top_k < 1 << 63:  # (an int64 on the device; any k beyond the vocabulary keeps every token)
        raise bad_request(f"top_k must be in [0, 2^63), got {top_k}", param="top_k", code="invalid_value")
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not (math.isfinite(rep) and 0.0 < rep <= 10.0):
        raise bad_request(f"repetition_penalty must be in (0, 10], got {rep}", param="repetition_penalty",
                          code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop",
                          code="invalid_value")
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", param="stop", code="invalid_value")
    seed = None if req.seed is None else req.seed % (1 << 63)
    speculative = None
    if req.speculative is not None:
        from edge.errors import SamplingError
        from edge.speculative.params import SpeculativeParams

        speculative = SpeculativeParams(req.speculative.method, req.speculative.num_tokens)
        try:
            speculative.validate()
        except SamplingError as exc:
            raise bad_request(str(exc), param="speculative", code="invalid_value") from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=rep,
        seed=seed,
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        speculative=speculative,
    )


def include_usage(req: _Common) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# -- responses ----------------------------------------------------------------------------


FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]


def usage_body(usage: Any) -> dict:
    """OpenAI ``usage`` from an :class:`edge.model.generation.Usage` (or None)."""
    prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
    completion = int(getattr(usage, "completion_tokens", 0) or 0)
    cached = int(getattr(usage, "cached_tokens", 0) or 0)
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    speculative = getattr(usage, "speculative", None)
    if speculative is not None:
        body["speculative"] = jsonable(speculative)  # extension
    grammar = getattr(usage, "grammar", None)
    if grammar is not None:
        body["grammar"] = jsonable(grammar)  # extension
    return body


def timings_body(usage: Any) -> dict:
    """Extension (as llama.cpp's server): latency and energy of the request."""
    keys = ("ttft_ms", "decode_tok_s", "prefill_ms", "total_ms", "energy_j", "energy_j_per_token", "seed")
    return {k: finite(getattr(usage, k, None)) for k in keys}


def finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def jsonable(obj: Any) -> Any:
    """Replace NaN/inf (invalid JSON) by None, recursively."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return finite(obj)
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def _envelope(rid: str, created: int, model: str, obj: str, choices: list[dict], usage: Any = None) -> dict:
    """The fields every OpenAI response and stream chunk shares; usage (and our
    llama.cpp-style ``timings``) only where the request is complete."""
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
        body["timings"] = timings_body(usage)
    return body


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(rid, created, model, "chat.completion.chunk", [choice])


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(rid, created, model, "text_completion", [choice])


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: Any) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return _envelope(rid, created, model, obj, [], usage)


def chat_completion(
    rid: str, created: int, model: str, text: str, finish_reason: str, usage: Any, parsed: ParsedOutput | None = None
) -> dict:
    """``parsed``: the text split into reasoning, content and tool calls (edge/structured)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if parsed is not None:
        message["content"] = parsed.content
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in parsed.tool_calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(rid, created, model, "chat.completion", [choice], usage)


def completion(rid: str, created: int, model: str, text: str, finish_reason: str, usage: Any) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(rid, created, model, "text_completion", [choice], usage)
