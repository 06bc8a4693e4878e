"""Tokenizer for a Hugging Face model directory: `tokenizer.json` through `tokenizers`,
the chat template through jinja2 rendered the way `transformers` renders it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from edge.errors import ChatTemplateError

Message = Mapping[str, Any]

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be parsed; the message names the file, on one line."""


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot parse {path}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"cannot parse {path}: expected a JSON object, got {type(data).__name__}")
    return data


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


def _select_chat_template(template: str | Sequence[Mapping[str, str]] | None) -> str | None:
    # Some models ship several named templates ("default", "tool_use", "rag").
    if template is None or isinstance(template, str):
        return template
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


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same environment `transformers` uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {root} (looked for {tokenizer_file})")
        template_file = root / "chat_template.jinja"
        # Recent transformers versions save the template next to the config instead of inside it.
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        try:
            hf = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"cannot parse {tokenizer_file}: {_one_line(exc)}") from None
        return cls(
            hf,
            tokenizer_config=_read_json(root / "tokenizer_config.json"),
            generation_config=_read_json(root / "generation_config.json"),
            model_config=_read_json(root / "config.json"),
            chat_template=chat_template,
        )

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
        return self._with_bos(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, add_special_tokens)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``encode``, with the GIL released while the Rust tokenizer runs (its
        ``encode_batch`` releases it, ``encode`` does not): other Python threads, such
        as an event loop or an engine loop, keep running during a long text."""
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
                "this model has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); use a plain prompt instead"
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

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        # The rendered text already holds the template's special tokens; adding them again
        # would double the BOS, so transformers encodes it without them and so do we.
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


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
