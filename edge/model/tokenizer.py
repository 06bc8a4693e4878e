"""Tokenizer for a Hugging Face model directory: `tokenizer.json` through `tokenizers`,
the chat template through jinja2 rendered the way `transformers` renders it."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from edge.errors import ChatTemplateError, InvalidPrompt
from edge.model.files import MAX_TOKENIZER_BYTES, check_regular, read_json_object

Message = Mapping[str, Any]

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be parsed; the message names the file, on one line."""


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, TokenizerError) if path.exists() else {}


@contextlib.contextmanager
def _encoding() -> Iterator[None]:
    """A text the tokenizer cannot encode (a WordLevel vocabulary without an unknown
    token meeting a new word) is the request's fault: InvalidPrompt, one line."""
    try:
        yield
    except Exception as exc:  # tokenizers raises a bare Exception
        if isinstance(exc, InvalidPrompt):
            raise
        raise InvalidPrompt(f"the model's tokenizer cannot encode this text: {_one_line(exc)}") from None


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    # tokenizer_config.json stores special tokens either as plain strings or as
    # serialized AddedToken dicts.
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _as_id_list(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _select_chat_template(template: str | Sequence[Mapping[str, str]] | Mapping[str, str] | None) -> str | None:
    # Some models ship several named templates ("default", "tool_use", "rag"): a list of
    # {"name", "template"} in tokenizer_config.json, a {name: template} map in a processor.
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        by_name = {str(k): v for k, v in template.items() if isinstance(v, str)}
    else:
        if not isinstance(template, list) or not all(
                isinstance(e, Mapping) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str)
                for e in template):
            raise TokenizerError("chat_template must be a string, a {name: template} map or a list of "
                                 '{"name": ..., "template": ...} objects')
        by_name = {entry["name"]: entry["template"] for entry in template}
    if "default" in by_name:
        return by_name["default"]
    return next(iter(by_name.values()), None)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates must not do.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# The functions a chat template may call, as transformers gives them: no request's
# chat_template_kwargs may stand in for them.
TEMPLATE_FUNCTIONS = ("raise_exception", "strftime_now")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same environment `transformers` uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(zip(TEMPLATE_FUNCTIONS, (_raise_exception, _strftime_now)))
    return env.from_string(source)


# -- where a model directory keeps its chat template, read as transformers reads it --

# A vision-language model's processor (preprocessor_config.json beside the tokenizer)
# renders its chats from its own template.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _read_text(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {_one_line(exc)}") from None


def tokenizer_chat_template_file(root: Path) -> str | None:
    """The tokenizer's chat_template.jinja (recent transformers save the template there
    instead of inside tokenizer_config.json, and it wins over the config's)."""
    return _read_text(root / "chat_template.jinja")


def processor_chat_template(root: Path) -> str | None:
    """The processor's template, for a directory that holds a processor, in the order of
    transformers' ``ProcessorMixin.from_pretrained``: a ``chat_template`` key in
    processor_config.json, then the legacy chat_template.json (``{"chat_template": ...}``),
    then chat_template.jinja with any named templates of additional_chat_templates/. None where the
    directory has no processor or the processor no template (the tokenizer's applies)."""
    if not any((root / name).is_file() for name in PROCESSOR_FILES):
        return None
    in_config = _read_json(root / "processor_config.json").get("chat_template")
    if in_config:
        return _select_chat_template(in_config)
    legacy = root / "chat_template.json"
    if legacy.is_file():
        template = _read_json(legacy).get("chat_template")
        if not isinstance(template, (str, list, dict)) or not template:
            raise TokenizerError(f"cannot parse {legacy}: expected a 'chat_template' string")
        return _select_chat_template(template)
    named = {p.stem: _read_text(p) for p in sorted((root / "additional_chat_templates").glob("*.jinja"))}
    default = tokenizer_chat_template_file(root)
    if default is not None:
        named["default"] = default
    return _select_chat_template(named) if named else None


class Tokenizer:
    """Encode/decode text and render chat prompts for one model directory."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._tok_config = dict(tokenizer_config or {})
        self._gen_config = dict(generation_config or {})
        self._model_config = dict(model_config or {})
        self.chat_template = chat_template or _select_chat_template(self._tok_config.get("chat_template"))
        self.bos_token = _token_content(self._tok_config.get("bos_token"))
        self.eos_token = _token_content(self._tok_config.get("eos_token"))
        self.pad_token = _token_content(self._tok_config.get("pad_token"))
        self.add_bos_token = bool(self._tok_config.get("add_bos_token", False))
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"no tokenizer.json in model directory {root} (looked for {tokenizer_file})")
        chat_template = processor_chat_template(root) or tokenizer_chat_template_file(root)
        check_regular(tokenizer_file, TokenizerError, MAX_TOKENIZER_BYTES)
        try:
            hf = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"cannot parse {tokenizer_file}: {_one_line(exc)}") from None
        tok = cls(
            hf,
            tokenizer_config=_read_json(root / "tokenizer_config.json"),
            generation_config=_read_json(root / "generation_config.json"),
            model_config=_read_json(root / "config.json"),
            chat_template=chat_template,
        )
        if tok.chat_template:  # a template that does not compile fails here, not at the first chat request
            where = root if chat_template is not None else root / "tokenizer_config.json"
            try:
                tok._compiled_template
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"the chat template in {where} does not compile: {_one_line(exc)}") from None
        return tok

    # ------------------------------------------------------------------ ids

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if 0 <= token_id < self._vocab_size else None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (grammar engines build their token tries from it)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (may be < the model's vocab)."""
        return self._vocab_size

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(_as_id_list(self._model_config.get("eos_token_id")))
        ids.update(_as_id_list(self._gen_config.get("eos_token_id")))
        eos = self.token_to_id(self.eos_token)
        if eos is not None:
            ids.add(eos)
        return frozenset(ids)

    @cached_property
    def bos_token_id(self) -> int | None:
        # An explicit `"bos_token": null` (Qwen) means the tokenizer uses no BOS, even
        # though config.json still names one.
        if "bos_token" in self._tok_config:
            return self.token_to_id(self.bos_token)
        for config in (self._gen_config, self._model_config):
            if config.get("bos_token_id") is not None:
                return int(config["bos_token_id"])
        return None

    @cached_property
    def pad_token_id(self) -> int | None:
        pad = self.token_to_id(self.pad_token)
        if pad is not None:
            return pad
        for config in (self._gen_config, self._model_config):
            if config.get("pad_token_id") is not None:
                return int(config["pad_token_id"])
        return None

    # ------------------------------------------------------------------ text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        with _encoding():
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_bos(ids, add_special_tokens)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``encode``, with the GIL released while the Rust tokenizer runs (its
        ``encode_batch`` releases it, ``encode`` does not): other Python threads, such
        as an event loop or an engine loop, keep running during a long text."""
        with _encoding():
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._with_bos(ids, add_special_tokens)

    @cached_property
    def chars_per_token(self) -> int:
        """The most characters of input one token can stand for: the longest vocabulary
        entry (byte-level entries spell one byte per character, so this bounds UTF-8
        bytes too), times 4 when a normalizer may compose up to 4 code points into one
        (the longest canonical decomposition in Unicode)."""
        longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if self._tok.normalizer is not None else 1)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        # tokenizer.json post-processors usually add BOS themselves (Llama 3); this covers
        # the ones whose config asks for it without a post-processor that does it.
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # Models pad their embedding past the tokenizer (Qwen: 151936 > 151669); a sampled
        # padding id is not text.
        known = [i for i in ids if 0 <= i < self._vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json, "
                "no chat_template.jinja and, for a vision-language model, no chat_template.json); "
                "use a plain prompt instead"
            )
        return compile_chat_template(self.chat_template)

    def _special_tokens_map(self) -> dict[str, str]:
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        tokens = {name: _token_content(self._tok_config.get(name)) for name in names}
        return {name: value for name, value in tokens.items() if value is not None}

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` to the prompt text, exactly as `transformers` would."""
        # transformers drops None-valued keys (OpenAI clients send content=None).
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables: dict[str, Any] = {
            **self._special_tokens_map(),
            **kwargs,
            "messages": cleaned,
            "add_generation_prompt": add_generation_prompt,
        }
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._compiled_template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except Exception as exc:  # the template's own code meeting this input ({{ content + 1 }}): one line
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """The prompt ids of ``messages``: the template's special tokens as tokens, the
        messages' own text as text (see :meth:`render_chat`)."""
        return self.encode_rendered(self.render_chat(messages, add_generation_prompt, **kwargs))

    # ------------------------------------------------------------------ special tokens as text

    @cached_property
    def _specials(self) -> dict[str, tuple[int, bool, bool]]:
        """Special added tokens: content -> (id, lstrip, rstrip)."""
        return {t.content: (i, t.lstrip, t.rstrip) for i, t in self._tok.get_added_tokens_decoder().items()
                if t.special and t.content}

    @cached_property
    def _special_re(self) -> re.Pattern[str] | None:
        names = sorted(self._specials, key=len, reverse=True)  # the longest match first, as tokenizers does
        return re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @cached_property
    def _special_starts(self) -> frozenset[str]:
        return frozenset(name[:2] for name in self._specials)

    @cached_property
    def _text_tokenizer(self) -> _HFTokenizer:
        """The same tokenizer, reading special-token strings as ordinary text."""
        tok = _HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    **kwargs: Any) -> RenderedChat:
        """The chat template applied to ``messages`` whose special-token strings (a user
        typing ``<|im_end|>``) stand as markers: the template's own special tokens become
        tokens, the messages' become text. This is how the major servers keep a user
        from forging a turn; for text without such strings the ids equal transformers'."""
        pattern = self._special_re
        if pattern is None:
            return RenderedChat(self.apply_chat_template(messages, add_generation_prompt, **kwargs), {})
        strings: list[str] = []
        _collect_strings([messages, kwargs], strings)
        # A substring search per distinct two-character start first (C speed); the regex
        # only over the strings that may hold a special token.
        maybe = [s for s in strings if any(start in s for start in self._special_starts)]
        found = sorted({m for s in maybe for m in pattern.findall(s)})
        if not found:
            return RenderedChat(self.apply_chat_template(messages, add_generation_prompt, **kwargs), {})
        free = (c for c in map(chr, range(0xE000, 0xF900)) if not any(c in s for s in strings))  # private use
        left, right = next(free), next(free)
        hide = {name: f"{left}{k}{right}" for k, name in enumerate(found)}
        masked = _replace_strings([list(messages), kwargs], lambda s: pattern.sub(lambda m: hide[m.group(0)], s))
        text = self.apply_chat_template(masked[0], add_generation_prompt, **masked[1])
        return RenderedChat(text, {marker: name for name, marker in hide.items()})

    def encode_rendered(self, rendered: RenderedChat) -> list[int]:
        """Ids of a rendered chat: its special tokens (from the template) as their ids,
        the text between them (markers restored) encoded as text in one batch, with the
        interpreter released."""
        pattern = self._special_re
        if pattern is None:
            return self.encode_releasing_gil(rendered.text)
        pieces = pattern.split(rendered.text)  # text, special, text, ..., text
        texts = pieces[0::2]
        for k, name in enumerate(pieces[1::2]):  # AddedToken lstrip/rstrip eat the whitespace beside it
            _, lstrip, rstrip = self._specials[name]
            if lstrip:
                texts[k] = texts[k].rstrip()
            if rstrip:
                texts[k + 1] = texts[k + 1].lstrip()
        texts = [rendered.restore(t) for t in texts]
        with _encoding():
            encoded = self._text_tokenizer.encode_batch(texts, add_special_tokens=False)
        ids: list[int] = list(encoded[0].ids)
        for name, enc in zip(pieces[1::2], encoded[1:]):
            ids.append(self._specials[name][0])
            ids += enc.ids
        return ids


@dataclass(frozen=True)
class RenderedChat:
    """A rendered chat prompt in which the special-token strings that came from the
    messages stand as ``markers`` (marker -> the string it hides)."""

    text: str
    markers: Mapping[str, str]

    def restore(self, text: str) -> str:
        for marker, name in self.markers.items():
            if marker in text:
                text = text.replace(marker, name)
        return text

    @property
    def plain(self) -> str:
        """The text the template rendered, as transformers renders it."""
        return self.restore(self.text)


def _collect_strings(node: Any, out: list[str]) -> None:
    """Every string in ``node`` (JSON-like), keys too: ``tojson`` prints a tool's keys."""
    if isinstance(node, str):
        out.append(node)
    elif isinstance(node, Mapping):
        for k, v in node.items():
            _collect_strings(k, out)
            _collect_strings(v, out)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _collect_strings(v, out)


def _replace_strings(node: Any, fn: Any) -> Any:
    """``node`` (JSON-like) with ``fn`` applied to every string, keys too (``fn`` is
    one-to-one, so keys stay distinct)."""
    if isinstance(node, str):
        return fn(node)
    if isinstance(node, Mapping):
        return {_replace_strings(k, fn): _replace_strings(v, fn) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_replace_strings(v, fn) for v in node]
    return node


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each push decodes only a small window (prefix-offset / read-offset technique): the
    tokens since the last emission plus the tokens before them that were already emitted,
    so that decoders that depend on their left context (leading-space stripping) decode
    the new tokens as the full sequence would. Text ending in U+FFFD is held back, since a
    multi-byte character is still split across byte-level tokens. The concatenated deltas
    equal `tokenizer.decode(all_ids)`; a U+FFFD is only ever emitted where the full decode
    has one too (invalid bytes from a random model).
    """

    # A genuine UTF-8 character spans at most 4 byte tokens; a longer pending run means
    # garbage bytes (random models do this), which must not grow the window forever.
    MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: tokens before it are done with
        self._read_offset = 0  # tokens before it have been emitted
        self._emitted_chars = 0  # len(decode(ids[prefix_offset:read_offset]))

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        text = self._decode(self._prefix_offset)
        if not text.endswith(REPLACEMENT_CHAR):
            delta = text[self._emitted_chars :]
            self._advance(len(self._ids))
            return delta
        if len(self._ids) - self._read_offset > self.MAX_PENDING:
            return self._emit_garbage(text)
        return ""

    def _advance(self, new_read_offset: int) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = new_read_offset
        self._emitted_chars = len(self._decode(self._prefix_offset, self._read_offset))

    def _emit_garbage(self, text: str) -> str:
        # Emit everything before the last few tokens, but only at a split point where
        # decoding the two halves separately gives the same text as decoding them
        # together: then no byte sequence straddles the split and the output stays
        # identical to a full decode.
        start = self._prefix_offset
        last = len(self._ids) - 4
        for split in range(last, max(self._read_offset, last - 4), -1):
            head = self._decode(start, split)
            tail = self._decode(split)
            if tail and head + tail == text:
                delta = head[self._emitted_chars :]
                self._prefix_offset = self._read_offset = split
                self._emitted_chars = 0
                return delta
        return ""

    def flush(self) -> str:
        """Return whatever text is still held back and reset the window."""
        delta = self._decode(self._prefix_offset)[self._emitted_chars :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted_chars = 0
        return delta

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)
