"""A GGUF model (llama.cpp / Ollama file) -> edge's config and weights.

Conventions of llama.cpp's converter (``convert_hf_to_gguf.py``) undone here:

* tensor names: ``token_embd``, ``blk.N.attn_q``, ... are mapped to edge's (Hugging Face)
  names by gguf-py's own table (``gguf.get_tensor_name_map``);
* shapes are stored as ggml ``ne`` (fastest axis first): reversed to ``[out, in]``;
* ``llama`` attention: the converter reorders the rows of q and k (and their biases)
  within each head from the rotate-half RoPE layout to llama.cpp's interleaved one
  (``LlamaModel.permute``); the rows are put back (a row permutation: quantized rows
  move whole, every value unchanged);
* no ``output.weight``: the lm_head is tied to the embedding;
* Llama 3 RoPE scaling is stored as the ``rope_freqs`` tensor (a divisor per
  frequency), other RoPE parameters as metadata.

Quantized tensors stay as stored (:class:`edge.quant.gguf.GGUFWeight`), except Q8_0:
its blocks (a float16 scale and 32 int8 codes) are repacked once into edge's q8_0 layout
(:class:`edge.quant.q8_0.Int8Weight`, int8 codes and a float32 scale per group of 32:
every value exact, 9 bits a weight instead of 8.5), which the int8 kernels run with all
their fusions. Float tensors (F32 / F16 / BF16) become plain tensors of the model's
dtype, as from safetensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from edge.model.config import ModelConfig
from edge.model.gguf_file import GGUFError, GGUFFile, TensorInfo, open_gguf, read_rows
from edge.model.loader import READ_CHUNK_BYTES, expected_shapes, fused_layout
from edge.quant.embedding import Int8Embedding
from edge.quant.gguf import BLOCK_TYPES, SUPPORTED_TYPE_NAMES, GGUFEmbedding, GGUFPart, GGUFWeight
from edge.quant.q8_0 import Int8Weight

if TYPE_CHECKING:
    from edge.model.decoder import Model

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_FREQS = "rope_freqs.weight"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
Q8_0, Q8_0_BLOCK, Q8_0_BYTES = 8, 32, 34


def check_architecture(f: GGUFFile) -> str:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path.name}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    return arch


def gguf_config(f: GGUFFile) -> ModelConfig:
    """The model configuration from the file's metadata (and the shapes of its tensors
    where the metadata leaves them implicit: vocabulary, tied lm_head, q/k/v biases)."""
    arch = check_architecture(f)

    def need(name: str) -> Any:
        return f.require(f"{arch}.{name}")

    def opt(name: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{name}", default)

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(opt("attention.head_count_kv", heads))
    head_dim = int(opt("attention.key_length", hidden // heads))
    value_dim = int(opt("attention.value_length", head_dim))
    rope_dim = int(opt("rope.dimension_count", head_dim))
    name = f.path.name
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise GGUFError(f"{name}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    if value_dim != head_dim:
        raise GGUFError(f"{name}: key length {head_dim} and value length {value_dim} differ (not supported)")
    if rope_dim != head_dim:
        raise GGUFError(f"{name}: RoPE on {rope_dim} of {head_dim} head dimensions (partial RoPE) is not supported")
    scaling = str(opt("rope.scaling.type", "none")).lower()
    if scaling not in ("none", ""):
        raise GGUFError(f"{name}: RoPE scaling {scaling!r} is not supported (none, or Llama 3's rope_freqs)")
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{name}: tensor token_embd.weight is missing")
    vocab = f.tensors["token_embd.weight"].shape[0]
    factors = None
    if ROPE_FREQS in f.tensors:
        info = f.tensors[ROPE_FREQS]
        if info.qtype != 0 or info.shape != (head_dim // 2,):
            raise GGUFError(f"{name}: {ROPE_FREQS} must be F32 [{head_dim // 2}], is {info.type_name} {list(info.shape)}")
        factors = tuple(float(v) for v in torch.frombuffer(read_rows(info, 0, 1), dtype=torch.float32).tolist())
    bos = f.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(opt("rope.freq_base", 10000.0)),
        max_position_embeddings=int(opt("context_length", 4096)),
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm=arch == "qwen3",
        rope_freq_factors=factors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_token_ids(f),
        torch_dtype=None,
        raw={"gguf": str(f.path), "general.file_type": f.get("general.file_type")},
    )


# Texts of tokens llama.cpp also treats as end of generation (llama-vocab.cpp), where
# the file names only one end token but the chat format ends turns with another.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>",
})


def eos_token_ids(f: GGUFFile) -> tuple[int, ...]:
    """The file's end-of-generation ids: ``eos``, ``eot``, ``eom`` and the control tokens
    llama.cpp recognises by text."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = f.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    tokens = f.get("tokenizer.ggml.tokens") or []
    types = f.get("tokenizer.ggml.token_type") or []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == 3 and text in _EOG_TEXTS and i not in ids:  # 3: CONTROL
            ids.append(i)
    return tuple(ids)


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """edge's (Hugging Face) tensor name -> the GGUF file's, for every tensor ``cfg`` needs."""
    import gguf

    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == cfg.architecture)
    table = gguf.get_tensor_name_map(arch, cfg.num_layers)
    out = {}
    for name in expected_shapes(cfg):
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:  # gguf-py knows every tensor of these architectures
            raise GGUFError(f"no GGUF name for {name} in gguf-py's table for {cfg.architecture}")
        out[name] = mapped
    return out


def _unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row ``k`` of the Hugging Face weight is row ``index[k]`` of the converter's
    (``LlamaModel.permute``: rows ``[heads, 2, D/2]`` stored as ``[heads, D/2, 2]``)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _row_permutation(cfg: ModelConfig, name: str) -> torch.Tensor | None:
    if cfg.architecture != "llama":
        return None
    if ".self_attn.q_proj." in name:
        return _unpermute_index(cfg.q_size, cfg.num_heads)
    if ".self_attn.k_proj." in name:
        return _unpermute_index(cfg.kv_size, cfg.num_kv_heads)
    return None


def _checked_info(f: GGUFFile, gname: str, want: tuple[int, ...], float_only: bool) -> TensorInfo:
    info = f.tensors.get(gname)
    if info is None:
        raise GGUFError(f"{f.path.name}: tensor {gname} is missing")
    if info.qtype not in BLOCK_TYPES:
        raise GGUFError(f"{f.path.name}: tensor {gname} has type {info.type_name}, which edge does not read "
                        f"(supported: {', '.join(SUPPORTED_TYPE_NAMES)})")
    if info.shape != tuple(want):
        raise GGUFError(f"{f.path.name}: tensor {gname} has shape {list(info.shape)}, the metadata implies {list(want)}")
    if float_only and info.qtype not in _FLOAT_TYPES:
        raise GGUFError(f"{f.path.name}: tensor {gname} is {info.type_name}; edge reads it only as F32, F16 or BF16")
    return info


def _read_tensor(info: TensorInfo, perm: torch.Tensor | None, chunk_bytes: int) -> Iterable[tuple[int, torch.Tensor]]:
    """``(first row, uint8 rows [n, row_bytes])`` chunks of one tensor, rows in Hugging
    Face order (``perm`` applied: such a tensor is read whole)."""
    rows = info.shape[0] if len(info.shape) > 1 else 1
    rb = info.row_bytes
    if perm is not None:
        data = torch.frombuffer(read_rows(info, 0, rows), dtype=torch.uint8).view(rows, rb)
        yield 0, data.index_select(0, perm)
        return
    step = max(1, chunk_bytes // max(rb, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        yield r0, torch.frombuffer(read_rows(info, r0, r1), dtype=torch.uint8).view(r1 - r0, rb)


def _as_float(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    return raw.view(_FLOAT_TYPES[qtype])


def load_gguf_weights(
    f: GGUFFile, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, chunk_bytes: int = READ_CHUNK_BYTES
) -> dict[str, Any]:
    """edge's fused weights (edge/model/loader.py's layout) from the file: quantized
    projections as :class:`GGUFWeight` (fused parts stacked, consecutive parts of one
    type in one buffer), a quantized embedding as :class:`GGUFEmbedding`, everything
    float as tensors of ``dtype``."""
    shapes = expected_shapes(cfg)
    layout = fused_layout(shapes)
    names = gguf_names(cfg)
    infos = {n: _checked_info(f, names[n], shapes[n], float_only=len(shapes[n]) == 1) for n in shapes}
    groups: dict[str, list[str]] = {}
    for n in shapes:
        groups.setdefault(layout[n][0], []).append(n)
    out: dict[str, Any] = {}
    for dest, members in groups.items():
        members.sort(key=lambda n: layout[n][1])
        if all(infos[n].qtype in _FLOAT_TYPES for n in members):
            out[dest] = _load_float(members, infos, shapes, cfg, device, dtype, chunk_bytes)
        elif all(infos[n].qtype == Q8_0 for n in members):
            q8 = _load_q8_0(members, infos, shapes, cfg, device, chunk_bytes)
            out[dest] = Int8Embedding(q8, dtype) if dest == EMBED else q8
        else:
            weight = _load_blocks(members, infos, shapes, cfg, device, chunk_bytes)
            out[dest] = GGUFEmbedding(weight, dtype) if dest == EMBED else weight
    return out


def _load_float(
    members: list[str], infos: dict[str, TensorInfo], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig,
    device: torch.device, dtype: torch.dtype, chunk_bytes: int,
) -> torch.Tensor:
    rows = sum(shapes[n][0] for n in members)
    dest = torch.empty((rows, *shapes[members[0]][1:]), dtype=dtype, device=device)
    row = 0
    for n in members:
        info, perm = infos[n], _row_permutation(cfg, n)
        if len(shapes[n]) == 1:  # a norm or a bias: one row of values (permuted one by one)
            vals = _as_float(next(iter(_read_tensor(info, None, chunk_bytes)))[1], info.qtype).reshape(-1)
            dest[row : row + vals.shape[0]].copy_(vals if perm is None else vals[perm])
        else:
            for r0, raw in _read_tensor(info, perm, chunk_bytes):
                vals = _as_float(raw, info.qtype)
                dest[row + r0 : row + r0 + vals.shape[0]].copy_(vals)
        row += shapes[n][0]
    return dest


def _load_q8_0(
    members: list[str], infos: dict[str, TensorInfo], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig,
    device: torch.device, chunk_bytes: int,
) -> Int8Weight:
    """Q8_0 blocks -> int8 codes ``[rows, in]`` and float32 scales ``[rows, in / 32]``."""
    in_features = shapes[members[0]][1]
    nb = in_features // Q8_0_BLOCK
    rows = sum(shapes[n][0] for n in members)
    q = torch.empty(rows, in_features, dtype=torch.int8, device=device)
    scale = torch.empty(rows, nb, dtype=torch.float32, device=device)
    row = 0
    for n in members:
        for r0, raw in _read_tensor(infos[n], _row_permutation(cfg, n), chunk_bytes):
            blocks = raw.view(-1, nb, Q8_0_BYTES)
            at = slice(row + r0, row + r0 + blocks.shape[0])
            q[at].copy_(blocks[:, :, 2:].contiguous().view(torch.int8).reshape(-1, in_features))
            scale[at].copy_(blocks[:, :, :2].contiguous().view(torch.float16).reshape(-1, nb))
        row += shapes[n][0]
    return Int8Weight(q, scale, Q8_0_BLOCK)


def _load_blocks(
    members: list[str], infos: dict[str, TensorInfo], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig,
    device: torch.device, chunk_bytes: int,
) -> GGUFWeight:
    in_features = shapes[members[0]][1]
    runs: list[list[str]] = []  # consecutive members of one type share a buffer
    for n in members:
        if runs and infos[runs[-1][-1]].qtype == infos[n].qtype:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = []
    for run in runs:
        qtype = infos[run[0]].qtype
        rb = BLOCK_TYPES[qtype].row_bytes(in_features)
        buf = torch.empty(sum(shapes[n][0] for n in run), rb, dtype=torch.uint8, device=device)
        row = 0
        for n in run:
            for r0, raw in _read_tensor(infos[n], _row_permutation(cfg, n), chunk_bytes):
                buf[row + r0 : row + r0 + raw.shape[0]].copy_(raw)
            row += shapes[n][0]
        parts.append(GGUFPart(qtype, buf))
    return GGUFWeight(parts, in_features)


def describe_gguf_weights(weights: dict[str, Any], f: GGUFFile) -> dict[str, str]:
    """What ``engine.info()`` reports of a GGUF model's weights: the file and the ggml
    types of its projections, embedding and lm_head."""
    counts: dict[str, int] = {}
    for t in f.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    held: dict[str, int] = {}
    for w in weights.values():
        table = w.table if isinstance(w, (GGUFEmbedding, Int8Embedding)) else w
        kind = ("GGUF blocks as stored" if isinstance(table, GGUFWeight)
                else "Q8_0 as int8 groups of 32" if isinstance(table, Int8Weight) else f"{w.dtype}".removeprefix("torch."))
        held[kind] = held.get(kind, 0) + 1
    return {
        "format": "gguf",
        "file": str(f.path) + (f" (+{len(f.paths) - 1} split files)" if len(f.paths) > 1 else ""),
        "tensor_types": ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())),
        "held_as": ", ".join(f"{k} x{v}" for k, v in sorted(held.items())),
    }


def resolve_gguf(spec: str | Path) -> Path:
    """The GGUF file ``--model`` names: a path, or ``ollama:NAME[:TAG]`` in the local store."""
    from edge.model.gguf_ollama import is_ollama_ref, resolve_ollama

    if is_ollama_ref(spec):
        return resolve_ollama(str(spec))
    return Path(spec)


def is_gguf_spec(spec: str | Path | None) -> bool:
    """Whether ``--model`` names a GGUF model (a .gguf file or ``ollama:NAME``)."""
    from edge.model.gguf_file import is_gguf_path
    from edge.model.gguf_ollama import is_ollama_ref

    return spec is not None and (is_ollama_ref(spec) or is_gguf_path(spec))


def open_model_file(spec: str | Path) -> GGUFFile:
    """Resolve, parse and check ``spec``; its architecture must be one edge runs."""
    f = open_gguf(resolve_gguf(spec))
    check_architecture(f)
    return f


def load_gguf_model(
    f: GGUFFile, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_seq_len: int,
    quantize: str | None = None,
) -> "Model":
    """The decoder on the file's weights, as stored (``quantize`` must be None: a GGUF
    file is already in its format)."""
    from edge.model.decoder import Model
    from edge.quant.q8_0 import QuantError, parse_quantize

    if parse_quantize(quantize) is not None or str(quantize).lower() == "int4":
        raise QuantError(f"{f.path.name} is a GGUF file, loaded in its own types; drop --quantize")
    weights = load_gguf_weights(f, cfg, device, dtype)
    model = Model(cfg, weights, max_seq_len)
    model.weight_formats = describe_gguf_weights(weights, f)
    return model
