"""The tokenizer and chat template of a GGUF file against the Hugging Face tokenizer it
was converted from (transformers' AutoTokenizer): the same ids for multilingual text,
special tokens and the rendered chat template; and against the expected ids llama.cpp
keeps for the published GPT-2, Llama 3 and Qwen2 vocabularies (its models/ folder:
ggml-vocab-*.gguf with inputs and the ids transformers gave for them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.model.gguf_file import open_gguf
from edge.model.gguf_tokenizer import LLAMA3_REGEX, QWEN2_REGEX, gguf_tokenizer
from edge.model.random_model import make_model

TEXTS = [
    "Hello world! How are you doing today?",
    "  leading spaces, trailing spaces   \n\n\ttabs\tand\r\nnewlines\n",
    "Ünïcödé façade naïve coöperate Äpfel Straße",
    "e\u0301 versus \u00e9, A\u030a versus \u00c5 (decomposed and composed)",
    "中文测试：我想在苹果公司工作一千三百一十四天。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다.",
    "Русский текст и болгарски: нещо на Български",
    "النص العربي من اليمين إلى اليسار",
    "हिन्दी पाठ और संख्याएँ १२३",
    "emoji 🚀🦙😶\u200d🌫️ ✅ and flags 🇩🇪🇯🇵",
    "numbers 3 33 333 3333 33333 3.14159 1,000,000 0x1F",
    "code: def f(x):\n    return x**2  # comment\n{\"json\": [1, 2, 3]}",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "text<|im_end|>glued<|im_start|>to special tokens",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Antworte auf Deutsch."},
    {"role": "user", "content": "Wie spät ist es in 東京? 🕐"},
    {"role": "assistant", "content": "Es ist 15 Uhr."},
    {"role": "user", "content": "Danke!"},
]


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
# How the published tokenizer.json of each family splits text (gpt-2: make_model's own).
PRE_VARIANTS = {
    "gpt-2": None,
    "qwen2": dict(normalizer={"type": "NFC"}, pre_tokenizer={"type": "Sequence", "pretokenizers": [
        _split(QWEN2_REGEX), _BYTE_LEVEL]}),
    "llama-bpe": dict(pre_tokenizer={"type": "Sequence", "pretokenizers": [_split(LLAMA3_REGEX), _BYTE_LEVEL]},
                      ignore_merges=True),
}


@pytest.fixture(scope="module", params=sorted(PRE_VARIANTS))
def converted(request: pytest.FixtureRequest, gguf_files, tmp_path_factory: pytest.TempPathFactory):
    """(pre name, HF directory, vocabulary-only GGUF converted from it by llama.cpp)."""
    pre = request.param
    hf = tmp_path_factory.mktemp(f"tok-{pre}")
    make_model(hf, arch="qwen3", preset="tiny", num_hidden_layers=1)
    edit = PRE_VARIANTS[pre]
    if edit is not None:
        data = json.loads((hf / "tokenizer.json").read_text(encoding="utf-8"))
        data["normalizer"] = edit.get("normalizer")
        data["pre_tokenizer"] = edit["pre_tokenizer"]
        if edit.get("ignore_merges"):
            data["model"]["ignore_merges"] = True
        (hf / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return pre, hf, gguf_files.vocab_only(hf, pre)


def test_text_encodes_to_the_hf_tokenizers_ids(converted) -> None:
    import transformers

    pre, hf_dir, path = converted
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = gguf_tokenizer(open_gguf(path))
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, f"{pre}: {text!r}"
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_chat_template_renders_and_encodes_as_transformers(converted) -> None:
    import transformers

    pre, hf_dir, path = converted
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = gguf_tokenizer(open_gguf(path))
    for prompt in (True, False):
        text = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == text
        assert ours.encode_chat(MESSAGES, add_generation_prompt=prompt) == ref.encode(text, add_special_tokens=False)
    assert ref.convert_tokens_to_ids("<|im_end|>") in ours.eos_token_ids


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2"])
def test_published_vocabularies_give_transformers_ids(gguf_files, name: str) -> None:
    models = gguf_files.source() / "models"
    f = open_gguf(models / f"ggml-vocab-{name}.gguf")
    assert f.get("tokenizer.ggml.pre") == name
    tok = gguf_tokenizer(f)
    inputs = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    outputs = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(inputs) == len(outputs) > 30
    for text, ids in zip(inputs, outputs):
        assert tok.encode(text) == [int(i) for i in ids.split()], repr(text)


def test_unsupported_tokenizers_are_named(gguf_files) -> None:
    from edge.model.gguf_file import GGUFError

    models = gguf_files.source() / "models"
    with pytest.raises(GGUFError, match="tokenizer model 'llama'"):
        gguf_tokenizer(open_gguf(models / "ggml-vocab-llama-spm.gguf"))
    with pytest.raises(GGUFError, match="pre-tokenizer 'deepseek-llm'"):
        gguf_tokenizer(open_gguf(models / "ggml-vocab-deepseek-llm.gguf"))


def test_vocab_only_file_is_not_a_model(gguf_files, converted) -> None:
    from edge.model.gguf_file import GGUFError
    from edge.runtime.engine import Engine

    _, _, path = converted
    with pytest.raises(GGUFError, match="token_embd.weight is missing"):
        Engine.from_pretrained(Path(path), device="cpu")
