"""The tokenizer and chat template of a GGUF file, from its metadata, as a ``tokenizers``
tokenizer behind edge's :class:`edge.model.tokenizer.Tokenizer`.

A GGUF file keeps what llama.cpp's tokenizer needs (``tokenizer.ggml.*``): the model
kind (``gpt2``: byte-level BPE), every token's text and type, the BPE merges, the
pre-tokenizer's *name* (``tokenizer.ggml.pre``: the regex itself is in llama.cpp's
code), the special token ids and ``add_bos_token``; and the Jinja chat template
(``tokenizer.chat_template``). Rebuilt here as the published Hugging Face tokenizers
of those pre-tokenizers are built (their ``tokenizer.json``: a ``Split`` on the regex
then byte-level mapping, Qwen2's NFC normalizer, Llama 3's ``ignore_merges``), so text
encodes to the ids the original model's tokenizer gives. Control tokens are special
added tokens (matched whole, skipped when decoding with ``skip_special_tokens``),
user-defined ones plain added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from edge.model.gguf_file import GGUFError, GGUFFile
from edge.model.tokenizer import Tokenizer

# tokenizer.ggml.token_type values (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How the Hugging Face tokenizers of one ``tokenizer.ggml.pre`` family split text."""

    regex: str
    nfc: bool = False  # Qwen2's tokenizer.json normalizes to NFC first
    ignore_merges: bool = False  # Llama 3: a word already in the vocabulary is one token

    def build(self) -> tuple[Any, Any]:
        normalizer = normalizers.NFC() if self.nfc else None
        if self.regex == GPT2_REGEX:  # GPT-2's own ByteLevel pre-tokenizer carries this regex
            return normalizer, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        return normalizer, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(self.regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])


# The pre-tokenizer names llama.cpp's converter writes for these families (llama-vocab.cpp
# maps the same names to the same regexes).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer(GPT2_REGEX),
    "llama-bpe": PreTokenizer(LLAMA3_REGEX, ignore_merges=True),
    "llama3": PreTokenizer(LLAMA3_REGEX, ignore_merges=True),
    "llama-v3": PreTokenizer(LLAMA3_REGEX, ignore_merges=True),
    "qwen2": PreTokenizer(QWEN2_REGEX, nfc=True),
    "deepseek-r1-qwen": PreTokenizer(QWEN2_REGEX, nfc=True),
}


def _merge_pair(merge: str) -> tuple[str, str]:
    a, sep, b = merge.partition(" ")
    if not sep:
        raise ValueError(f"merge {merge!r} is not two tokens")
    return a, b


def build_hf_tokenizer(f: GGUFFile) -> HFTokenizer:
    """The ``tokenizers`` tokenizer of the file's metadata (module docstring)."""
    name = f.path.name
    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFError(f"{name} has no tokenizer (metadata tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise GGUFError(f"{name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
    pre_name = f.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise GGUFError(f"{name}: pre-tokenizer {pre_name!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = list(f.require("tokenizer.ggml.tokens"))
    types = list(f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{name}: {len(tokens)} tokens but {len(types)} token types")
    try:
        merges = [_merge_pair(m) for m in f.require("tokenizer.ggml.merges")]
    except ValueError as exc:
        raise GGUFError(f"{name}: bad tokenizer.ggml.merges ({exc})") from None
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate text keeps its first id, as llama.cpp's lookup does
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    tok = HFTokenizer(bpe)
    normalizer, pre_tokenizer = pre.build()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    # Their ids are the vocabulary's: tokenizers gives an added token already in the
    # model's vocabulary that id.
    control = [AddedToken(t, special=True, normalized=False) for i, (t, k) in enumerate(zip(tokens, types))
               if k == CONTROL and vocab[t] == i]
    user = [AddedToken(t, special=False, normalized=True) for i, (t, k) in enumerate(zip(tokens, types))
            if k == USER_DEFINED and vocab[t] == i]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok


def gguf_tokenizer(f: GGUFFile, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """edge's tokenizer for the file: the ``tokenizers`` tokenizer, its special tokens and
    the chat template from the metadata."""
    hf = build_hf_tokenizer(f)
    tokens = f.require("tokenizer.ggml.tokens")

    def text(key: str) -> str | None:
        i = f.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "pad_token": text("padding_token_id"),
        "unk_token": text("unknown_token_id"),
        "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": f.get("tokenizer.chat_template"),
    }
    return Tokenizer(hf, tokenizer_config=config, model_config={"eos_token_id": list(eos_token_ids)})
