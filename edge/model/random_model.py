"""Random-weight models in Hugging Face format, built offline and deterministically.

A model directory written here (config.json, safetensors weights, tokenizer.json,
tokenizer_config.json, generation_config.json) loads with `transformers` and with
`edge` alike, so tests and demos never need the network.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from edge.dirlock import locked_directory
from edge.model.writing import plain_dir_mode, progress_bar, save_safetensors

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Shapes and hyper-parameters of the published checkpoints (vocab_size None = the local
# tokenizer's size). `arch` is the architecture used when the caller does not choose one.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "arch": "qwen3",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": None,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "arch": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "arch": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        "arch": "qwen3",
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "arch": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        "arch": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500_000.0,
        "rope_scaling": LLAMA3_ROPE_SCALING,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
}

# "qwen3-peaked": the verification model for bfloat16 on a GPU. Random weights give nearly
# flat logits, so bf16 rounding flips the argmax within a few dozen tokens. Here the
# embeddings are larger and the layers' output projections smaller (the current token
# stays most of the final hidden state) and each lm_head row also holds PEAKED_GAIN x the unit embedding
# of one token (a random permutation), so the token after x is, by a wide margin, the
# one whose row holds x's embedding: greedy decoding walks a long permutation cycle,
# while every logit still carries the random layers' and the context's share.
PRESETS["qwen3-peaked"] = {**PRESETS["qwen3-0.6b"], "num_hidden_layers": 12, "tie_word_embeddings": False,
                           "init_profile": "peaked"}
PEAKED_GAIN = 2.0
PEAKED_EMBED_SCALE = 8.0
PEAKED_OUT_SCALE = 0.05  # o_proj and down_proj: the layers' share of the residual stream

DEFAULT_MODEL_NAME = "default-v1"
INIT_STD = 0.02
NORM_NOISE_STD = 0.05
_CHUNK_ELEMENTS = 1 << 24

# --------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_TARGET_VOCAB = 4096

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unsupported role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CORPUS = """\
The small computer sat on the workbench next to a cup of cold coffee. Its fan spun up
whenever the model started to think, and the little green light blinked in time with
the tokens that streamed out onto the screen. Nobody in the lab remembered who had
named it, but everyone called it the lighthouse, because it was always on and always
answering questions in the dark.

Memory is the scarce resource on an embedded board. The processor and the graphics
unit share the same chips, so every copy of a weight matrix costs twice. Engineers
learn to count bytes the way sailors count water: carefully, every morning, and again
before they go to sleep. A cache that grows without limit will sink the whole ship.

In the spring the river behind the old mill rises quickly. Children throw sticks from
the stone bridge and race to the other side to see whose stick arrives first. The
miller's daughter keeps a notebook of the winners, with the date, the weather, and the
height of the water written in neat columns. Some years the river freezes in March;
other years it floods the lower meadow and the cows have to be moved up the hill.

To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt,
seven grams of yeast and about three hundred and fifty millilitres of warm water. Knead
the dough for ten minutes, until it is smooth and elastic, then let it rise for an hour
in a warm place. Shape it, let it rise again, and bake it at two hundred and twenty
degrees for thirty-five minutes. Tap the bottom: a hollow sound means it is done.

Questions and answers:
What time is it? It is a quarter past seven in the evening.
How far is the station? About two kilometres, or a twenty-minute walk.
Can you repeat that, please? Of course. I said the train leaves at nine o'clock.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered more.
Which is larger, 42 or 17? Forty-two is larger than seventeen by twenty-five.

def greet(name: str) -> str:
    return f"Hello, {name}! Welcome back."

for i in range(10):
    print(i * i, end=", ")

Voice assistants must answer quickly. When a person starts speaking while the
assistant is still talking, the assistant should stop at once and listen. Latency is
measured from the end of the question to the first word of the answer, and every
millisecond counts: people notice a pause of half a second, and they find a pause of a
full second rude.

The history of the printing press is a history of small improvements. Movable type,
better inks, stronger presses and cheaper paper arrived one after another, and each
made books a little less expensive. Within a few generations, ordinary families owned
almanacs, prayer books, and collections of stories that their grandparents could never
have afforded.

The hikers left the village before sunrise. The path climbed through a forest of pine
and birch, crossed a wooden bridge over a narrow stream, and then turned steeply up the
side of the mountain. By noon they had reached the pass, where the wind was cold and the
view stretched across three valleys. They ate bread, cheese and apples, took a few
photographs, and started down the other side before the clouds could gather.

A good teacher asks more questions than she answers. She listens to the students,
notices what they already understand, and builds the next lesson on top of it. When a
student makes a mistake, she does not simply give the correct answer; she asks what
the student was thinking, because the mistake often shows exactly which idea is
missing. Patience, she says, is the most important tool in the classroom.

The station master checked his watch, looked down the platform, and raised his flag.
The train pulled out slowly, then faster, past the warehouses and the allotments and
the last houses of the town, and out into the open fields. A woman in the second
carriage opened her newspaper, read the weather forecast, and smiled: tomorrow would be
warm and dry, perfect for the market.

Le café était fermé, alors nous avons marché jusqu'à la boulangerie près de l'église.
Élodie a acheté deux croissants et une baguette; François a préféré un éclair au
chocolat. « Où est la gare ? » a demandé un touriste. « Tout droit, puis à gauche. »
Der Bäcker öffnet früh am Morgen. Über die Brücke gehen täglich viele Menschen, und im
Frühling blühen die Bäume am Fluss. Größere Städte haben mehr Verkehr, aber auch mehr
Grünflächen, als man denkt.
El niño comió una manzana y después jugó en el jardín con su perro. ¿Dónde está la
biblioteca? Está al lado del ayuntamiento, señora. Mañana iremos a la montaña.
A criança está a ler um livro sobre a história de Portugal. São três horas da tarde e
o céu está azul. Não há nuvens.
Tiếng Việt có nhiều dấu thanh: mà, má, mả, mã, mạ. Hà Nội là thủ đô của Việt Nam.
Smørrebrød og kaffe på Østerbro; Åsa läser en bok i Göteborg.

今天天气很好，我们去公园散步吧。公园里有很多人，有的在跑步，有的在打太极拳。
小明喜欢读书，他每天晚上都会读一个小时的书。他最喜欢的书是《西游记》。
这台小电脑放在桌子上，风扇在转，绿色的灯一闪一闪的。它回答问题很快，大家都叫它灯塔。
春天来了，河水涨了，孩子们在桥上扔树枝，看谁的树枝先漂到对岸。
请问，火车站怎么走？一直往前走，然后在第二个路口左转。谢谢！不客气。
内存是嵌入式设备上最宝贵的资源。处理器和图形处理器共用同一块内存。
東京の桜はとても綺麗です。ありがとうございます。
서울의 가을 하늘은 높고 맑습니다.

Emoji appear in casual messages: 😀 😂 🙂 👍 🎉 🚀 ❤️ 🌍 🔥 ✅ 🐍 🤖 ☕ 🍞 🌸
Great job! 🎉 See you tomorrow 👋 The launch went well 🚀🚀 and the team is happy 😀.
The weather today: ☀️ then 🌧️, temperature 21°C, humidity 60 %, wind 15 km/h.
Prices: €12.50, £9.99, ¥1200, $7.25 — discounts up to 30 % off… “quoted” ‘text’.
Math: α + β = γ, ∑ x² ≤ ∞, √2 ≈ 1.414, π ≈ 3.14159, Δt → 0, ±5 °C.
"""


@functools.lru_cache(maxsize=4)
def tokenizer_json(extra_special: tuple[str, ...] = ()) -> str:
    """Serialized byte-level BPE tokenizer trained on `CORPUS` (cached per process), with
    `extra_special` tokens (a vision model's) after the usual special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # min_frequency=2 keeps characters seen only once split into several byte tokens,
    # so the split-UTF-8 paths of every decoder get exercised by ordinary text.
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_TARGET_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    # Added after training so the special tokens sit at the end of the vocabulary, as in Qwen.
    tok.add_special_tokens(list(SPECIAL_TOKENS + extra_special))
    return tok.to_str()


def covering_tokenizer_json(vocab_size: int, extra_special: tuple[str, ...] = ()) -> str:
    """The local tokenizer, grown to ``vocab_size`` ids when the model's vocabulary is
    larger than the trained one (the published presets): each extra id is a new entry
    spelling two trained tokens, so every id a random model samples decodes to text.
    No merge produces an extra entry, so encoding is unchanged."""
    trained = tokenizer_vocab_size(extra_special)
    if vocab_size <= trained:
        return tokenizer_json(extra_special)
    data = json.loads(tokenizer_json(extra_special))
    vocab: dict[str, int] = data["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.__getitem__)
    # The special tokens join the model's vocabulary at their ids: with a gap there,
    # tokenizers would renumber them after the extra entries.
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    taken = set(vocab)
    pairs = (a + b for a in pieces for b in pieces)
    next_id = trained
    while next_id < vocab_size:
        entry = next(pairs)
        if entry not in taken:
            vocab[entry] = next_id
            taken.add(entry)
            next_id += 1
    return json.dumps(data, ensure_ascii=False)


def special_token_ids(extra_special: tuple[str, ...] = ()) -> dict[str, int]:
    """Ids of the special tokens in the local tokenizer."""
    added = json.loads(tokenizer_json(extra_special))["added_tokens"]
    return {entry["content"]: entry["id"] for entry in added}


def tokenizer_vocab_size(extra_special: tuple[str, ...] = ()) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(extra_special)).get_vocab_size(with_added_tokens=True)


def tokenizer_config(
    max_length: int, chat_template: str = CHAT_TEMPLATE, extra_special: tuple[str, ...] = ()
) -> dict[str, Any]:
    ids = special_token_ids(extra_special)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for content in SPECIAL_TOKENS + extra_special
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_length,
        "split_special_tokens": False,
    }


def generation_config() -> dict[str, Any]:
    ids = special_token_ids()
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }


# --------------------------------------------------------------------------- config


def model_config(arch: str | None = None, preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """A Hugging Face `config.json` dict for `arch` with the shapes of `preset`.

    `arch` None takes the preset's own architecture. `overrides` replace any field.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    shape = dict(PRESETS[preset])
    preset_arch = shape.pop("arch")
    arch = arch or preset_arch
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    ids = special_token_ids()
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        **shape,
        "vocab_size": shape["vocab_size"] or tokenizer_vocab_size(),
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = shape["num_hidden_layers"]
    config.update(overrides)
    if arch != "llama" and "num_hidden_layers" in overrides and "max_window_layers" not in overrides:
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


# --------------------------------------------------------------------------- weights


def state_dict_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes for `config`, in checkpoint order."""
    model_type = config["model_type"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    # Qwen2 hard-codes q/k/v bias; Llama and Qwen3 put `attention_bias` on all four projections.
    has_bias = model_type == "qwen2" or bool(config.get("attention_bias"))
    has_o_bias = model_type != "qwen2" and bool(config.get("attention_bias"))

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        for name, out_dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{p}.self_attn.{name}_proj.weight"] = (out_dim, hidden)
            if has_bias:
                shapes[f"{p}.self_attn.{name}_proj.bias"] = (out_dim,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, q_dim)
        if has_o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (hidden,)
        if model_type == "qwen3":
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _tensor_seed(seed: int, name: str) -> int:
    # Per-tensor seeds make every tensor independent of generation order and of the
    # other tensors, so e.g. changing num_hidden_layers leaves layer 0 unchanged.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _is_norm(name: str) -> bool:
    # Decoder norms, and the vision towers' (norm1 / norm2 / ln_q).
    return name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    std: float = INIT_STD,
) -> torch.Tensor:
    """One tensor, drawn on the CPU from a generator seeded by (seed, name), then moved:
    N(0, std), norm weights 1 + N(0, NORM_NOISE_STD).

    Values depend only on (seed, name, shape), never on `device` or `dtype` beyond rounding.
    """
    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    norm = _is_norm(name)
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    # Drawn in fixed-size chunks so that a 600M-element embedding never needs a full
    # float32 copy on the host next to its device copy (they share DRAM on Jetson).
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = torch.empty(min(_CHUNK_ELEMENTS, flat.numel() - start), dtype=torch.float32)
        chunk.normal_(0.0, NORM_NOISE_STD if norm else std, generator=gen)
        if norm:
            # Not exactly 1, so that a forgotten or misapplied norm weight changes the output.
            chunk += 1.0
        flat[start : start + chunk.numel()].copy_(chunk)
    return out


def iter_random_tensors(
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so a large model never sits on the CPU whole."""
    for name, shape in state_dict_shapes(config).items():
        yield name, config_tensor(config, name, shape, seed, dtype, device)


def config_tensor(
    config: dict[str, Any],
    name: str,
    shape: tuple[int, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """:func:`random_tensor`, shaped by the config's ``init_profile`` ("peaked": each
    lm_head row plus PEAKED_GAIN x the unit embedding of its predecessor token)."""
    peaked = config.get("init_profile") == "peaked"
    if peaked and name == "model.embed_tokens.weight":
        return random_tensor(name, shape, seed, torch.float32).mul_(PEAKED_EMBED_SCALE).to(device=device, dtype=dtype)
    if peaked and name.endswith(("o_proj.weight", "down_proj.weight")):
        return random_tensor(name, shape, seed, torch.float32).mul_(PEAKED_OUT_SCALE).to(device=device, dtype=dtype)
    if not peaked or name != "lm_head.weight":
        return random_tensor(name, shape, seed, dtype, device)
    t = random_tensor(name, shape, seed, torch.float32)
    embed = random_tensor("model.embed_tokens.weight", shape, seed, torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name + ":successor"))
    pred = torch.randperm(shape[0], generator=gen)
    t.add_(torch.nn.functional.normalize(embed[pred], dim=-1), alpha=PEAKED_GAIN)
    del embed
    return t.to(device=device, dtype=dtype)


def random_state_dict(
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Deterministic random weights with exact Hugging Face tensor names."""
    return dict(iter_random_tensors(config, seed, dtype, device))


# --------------------------------------------------------------------------- writing

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(_DTYPES)}") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value == dtype)


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int | None) -> list[list[str]]:
    """Group tensor names into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    if max_shard_bytes is None:
        return [list(shapes)]
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_weights(
    out_dir: Path,
    shapes: dict[str, tuple[int, ...]],
    make_tensor: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: torch.dtype,
    max_shard_bytes: int | None,
    progress: bool = False,
) -> None:
    """``make_tensor(name, shape)`` for each of ``shapes`` as model.safetensors (or
    shards and their index), one shard in memory at a time; ``progress``: a bar on
    stderr counting the bytes made."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(shapes, itemsize, max_shard_bytes)
    metadata = {"format": "pt"}
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    with progress_bar(total, f"writing {out_dir.name}", progress) as bar:

        def make(name: str) -> torch.Tensor:
            t = make_tensor(name, shapes[name])
            bar.update(t.numel() * t.element_size())
            return t

        if len(shards) == 1:
            save_safetensors({name: make(name) for name in shards[0]}, out_dir / "model.safetensors", metadata)
            return
        weight_map: dict[str, str] = {}
        total_size = 0
        for index, names in enumerate(shards, start=1):
            filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            # One shard in memory at a time keeps an 8B-shaped checkpoint writable on a small host.
            tensors = {name: make(name) for name in names}
            save_safetensors(tensors, out_dir / filename, metadata)
            total_size += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({name: filename for name in names})
            del tensors
    index_data = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / "model.safetensors.index.json", index_data)


def _write_tokenizer(out_dir: Path, max_length: int, vocab_size: int) -> None:
    (out_dir / "tokenizer.json").write_text(covering_tokenizer_json(vocab_size), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(max_length))
    _write_json(out_dir / "generation_config.json", generation_config())


def make_model(
    out_dir: str | os.PathLike[str],
    arch: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int | None = None,
    progress: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random-weight model directory in Hugging Face format and return its path.

    `arch` None takes the preset's architecture (qwen3 for the qwen3 presets and tiny);
    `progress`: a bar on stderr while the weights are written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = parse_dtype(dtype)
    config = model_config(arch, preset, torch_dtype=_dtype_name(torch_dtype), **overrides)
    _write_json(out / "config.json", config)
    _write_tokenizer(out, config["max_position_embeddings"], config["vocab_size"])
    shapes = state_dict_shapes(config)
    write_weights(
        out, shapes, lambda n, s: config_tensor(config, n, s, seed, torch_dtype), torch_dtype, max_shard_bytes, progress
    )
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("EDGE_CACHE_DIR") or Path.home() / ".cache" / "edge")


def default_model_path() -> Path:
    """The embedded default model (qwen3 tiny, float32, seed 0), created once and reused."""
    return cached_model(DEFAULT_MODEL_NAME, arch="qwen3", preset="tiny", seed=0, dtype="float32")


def preset_model_path(preset: str, dtype: str = "bfloat16") -> Path:
    """A random-weight ``preset`` model in the cache (seed 0), created once and reused."""
    return cached_model(f"{preset}-{dtype}-v1", preset=preset, seed=0, dtype=dtype)


def cached_model(name: str, build: Callable[..., Path] = make_model, **make: Any) -> Path:
    """``build(directory, **make)`` (default :func:`make_model`) once, into the cache.
    Built in a temporary directory and renamed into place (atomic: readers see no
    directory or a complete one), under a lock on the models directory, so that
    concurrent first uses build it once and a build killed half-way leaves a temporary
    directory that the next build removes."""
    models = cache_dir() / "models"
    final = models / name
    if final.is_dir():
        return final
    models.mkdir(parents=True, exist_ok=True)
    with locked_directory(models):
        if final.is_dir():  # built by another process while we waited
            return final
        for stale in models.glob(f".{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models))
        try:
            build(tmp, **make)
            tmp.chmod(plain_dir_mode())  # mkdtemp's 0700 would hide the model from other users
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
