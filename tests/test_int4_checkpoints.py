"""Int4 checkpoints as published (AWQ GEMM, GPTQ v1 / v2 with and without desc_act,
compressed-tensors pack-quantized with and without zero points) against transformers.

The oracle: a random Hugging Face model whose linears get known int4 codes, scales,
zero points (and act-order group indices) drawn here; the dequantized weights
``(q - z) * s`` go into the transformers model in float32, and the same codes are
written in each format's published layout by the packers below, written from the
formats' descriptions (numpy bit operations, no edge code). edge loads the packed
checkpoint; its logits must match transformers' within float32 tolerance and its
greedy tokens must be identical."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from edge.runtime.engine import Engine
from edge.quant.int4 import Int4Weight
from edge.quant.int4_checkpoints import detect_format
from edge.model.loader import CheckpointError
from edge.quant.q8_0 import Int8Weight
from edge.sampling import SamplingParams
from tests.conftest import build_hf_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Linears that read the same input share GPTQ's act order (it follows that input's statistics).
SHARED_INPUT = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
                "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class Codes:
    q: np.ndarray  # [out, in] 0..15
    scale: np.ndarray  # [out, groups] float16
    zero: np.ndarray  # [out, groups] 0..15 (8 when symmetric)
    g_idx: np.ndarray  # [in] group of each input column

    def dequantize(self) -> torch.Tensor:
        s = self.scale.astype(np.float32)[:, self.g_idx]
        z = self.zero.astype(np.float32)[:, self.g_idx]
        return torch.from_numpy((self.q.astype(np.float32) - z) * s)


def draw_codes(rng: np.random.Generator, out: int, inp: int, group: int, symmetric: bool,
               g_idx: np.ndarray | None) -> Codes:
    groups = inp // group
    q = rng.integers(0, 16, size=(out, inp))
    # Exact in float16 (AWQ, GPTQ) and bfloat16 (compressed-tensors writes the model dtype).
    scale = torch.from_numpy(rng.uniform(0.008, 0.03, size=(out, groups))).to(torch.bfloat16).half().numpy()
    # Zero points 1..15: GPTQ v1 stores z - 1, which has no nibble for z = 0.
    zero = np.full((out, groups), 8) if symmetric else rng.integers(1, 16, size=(out, groups))
    if g_idx is None:
        g_idx = np.arange(inp) // group
    return Codes(q, scale, zero, g_idx)


def act_order_g_idx(rng: np.random.Generator, inp: int, group: int) -> np.ndarray:
    perm = rng.permutation(inp)
    g_idx = np.empty(inp, dtype=np.int64)
    g_idx[perm] = np.arange(inp) // group  # GPTQ quantizes column perm[i] in group i // G
    return g_idx


def int32(words: np.ndarray) -> torch.Tensor:
    """Unsigned 32-bit words (as int64) as the int32 tensors the formats store."""
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def pack_rows_of_8(values: np.ndarray, order: list[int] | None = None) -> np.ndarray:
    """[n, 8 m] -> [n, m]: nibble i of word c holds column 8c + order[i]."""
    order = order or list(range(8))
    n, cols = values.shape
    v = values.astype(np.int64).reshape(n, cols // 8, 8)
    words = np.zeros((n, cols // 8), dtype=np.int64)
    for i in range(8):
        words |= v[:, :, order[i]] << (4 * i)
    return words


# -- the published layouts -------------------------------------------------------------


def write_awq(c: Codes, base: str) -> dict[str, torch.Tensor]:
    qt = c.q.T  # [in, out]
    return {
        base + ".qweight": int32(pack_rows_of_8(qt, AWQ_ORDER)),
        base + ".qzeros": int32(pack_rows_of_8(c.zero.T, AWQ_ORDER)),
        base + ".scales": torch.from_numpy(c.scale.T.copy()),
    }


def write_gptq(c: Codes, base: str, v2: bool) -> dict[str, torch.Tensor]:
    qt = c.q.T  # [in, out]: nibble k of qweight[r, o] is input row 8r + k
    inp, out = qt.shape
    qweight = np.zeros((inp // 8, out), dtype=np.int64)
    for k in range(8):
        qweight |= qt[k::8].astype(np.int64) << (4 * k)
    stored_zero = c.zero.T if v2 else c.zero.T - 1
    return {
        base + ".qweight": int32(qweight),
        base + ".qzeros": int32(pack_rows_of_8(stored_zero)),
        base + ".scales": torch.from_numpy(c.scale.T.copy()),
        base + ".g_idx": torch.from_numpy(c.g_idx.astype(np.int32)),
    }


def write_compressed(c: Codes, base: str, zero_point: str | None, g_idx: bool) -> dict[str, torch.Tensor]:
    out, inp = c.q.shape
    t = {
        base + ".weight_packed": int32(pack_rows_of_8(c.q)),  # q + 8 of the signed code is the unsigned one
        base + ".weight_scale": torch.from_numpy(c.scale.copy()).to(torch.bfloat16),
        base + ".weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }
    if zero_point == "packed":  # along the rows: nibble i of word [r, g] is row 8r + i, stored z + 8
        t[base + ".weight_zero_point"] = int32(pack_rows_of_8(c.zero.T).T.copy())
    elif zero_point == "int8":  # older writers: the signed zero point
        t[base + ".weight_zero_point"] = torch.from_numpy((c.zero - 8).astype(np.int8))
    if g_idx:
        t[base + ".weight_g_idx"] = torch.from_numpy(c.g_idx.astype(np.int32))
    return t


# name -> (quantization_config, writer options)
FORMATS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}, {}),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, {}),
    "gptq-desc-act": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}, {}),
    "gptq-v2-desc-act": (
        {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False,
         "checkpoint_format": "gptq_v2"}, {},
    ),
    "ct-symmetric": ("ct", {"symmetric": True, "zero_point": None}),
    "ct-zero-point": ("ct", {"symmetric": False, "zero_point": "packed"}),
    "ct-zero-point-int8-actorder": ("ct", {"symmetric": False, "zero_point": "int8", "actorder": True}),
}


def ct_config(group: int, symmetric: bool, actorder: bool) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "pack-quantized",
                "input_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                            "group_size": group, "actorder": "group" if actorder else None},
            }
        },
    }


def make_checkpoint(fmt: str, arch: str, out_dir: Path, seed: int = 0, legacy: bool = False, **overrides):
    """Write ``fmt``'s checkpoint of a random model into ``out_dir``; returns the
    transformers model holding the dequantized weights."""
    hf = build_hf_model(arch, out_dir, seed=seed, **overrides)
    config = json.loads((out_dir / "config.json").read_text())
    qc, opts = FORMATS[fmt]
    ct = qc == "ct"
    group = 32
    if ct:
        qc = ct_config(group, opts["symmetric"], opts.get("actorder", False))
    else:
        group = qc["group_size"]
    symmetric = opts["symmetric"] if ct else (qc.get("sym", False) if qc["quant_method"] == "gptq" else False)
    act = (qc.get("desc_act", False)) or opts.get("actorder", False)
    rng = np.random.default_rng(seed + 1)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(hf.config.num_hidden_layers):
        shared: dict[str, np.ndarray] = {}
        for lin in LINEARS:
            base = f"model.layers.{i}.{lin}"
            w = state.pop(base + ".weight")
            out, inp = w.shape
            g_idx = None
            if act:
                key = SHARED_INPUT.get(lin, lin)
                g_idx = shared.setdefault(key, act_order_g_idx(rng, inp, group))
            c = draw_codes(rng, out, inp, group, symmetric, g_idx)
            with torch.no_grad():
                hf.get_submodule(base).weight.copy_(c.dequantize())
            if ct:
                tensors |= write_compressed(c, base, opts["zero_point"], act)
            elif qc["quant_method"] == "awq":
                tensors |= write_awq(c, base)
            else:
                tensors |= write_gptq(c, base, qc.get("checkpoint_format") == "gptq_v2")
    tensors |= state
    save_file(tensors, str(out_dir / "model.safetensors"))
    if legacy and qc["quant_method"] == "awq":
        (out_dir / "quant_config.json").write_text(
            json.dumps({"zero_point": True, "q_group_size": group, "w_bit": 4, "version": "GEMM"})
        )
    else:
        config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config))
    return hf


def prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


CASES = [
    ("awq", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    ("gptq", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    ("gptq-desc-act", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    ("gptq-v2-desc-act", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    ("ct-symmetric", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    ("ct-zero-point", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    ("ct-zero-point-int8-actorder", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
]


@pytest.mark.parametrize("fmt,arch,overrides", CASES, ids=[c[0] for c in CASES])
def test_published_int4_matches_transformers(tmp_path: Path, fmt: str, arch: str, overrides: dict) -> None:
    hf = make_checkpoint(fmt, arch, tmp_path, seed=3, **overrides)
    engine = Engine.from_pretrained(
        tmp_path, device="cpu", dtype="float32", quant_lm_head="float", quant_embedding="float", page_size=8
    )
    layer = engine.model.layers[0]
    assert all(isinstance(layer[k], Int4Weight) for k in ("qkv", "o", "gate_up", "down"))
    assert (layer["qkv"].perm is not None) == ("desc-act" in fmt or "actorder" in fmt)
    for n in (1, 33):
        ids = prompt(n, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert rel_err(engine.score(ids), ref) < 1e-4, f"{fmt} len {n}"
    ids = prompt(12, seed=7)
    with torch.no_grad():
        ref_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48, do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()
    ours = engine.generate(ids, SamplingParams(max_tokens=48, ignore_eos=True)).token_ids
    assert ours == ref_tokens


def test_legacy_awq_config_and_faithful_defaults(tmp_path: Path) -> None:
    """AutoAWQ's quant_config.json is read when config.json has no quantization_config;
    by default the lm_head and the embedding stay as published (float), int8 rows only
    when chosen (or when only they fit, edge/runtime/memory_plan.py), and info says so."""
    hf = make_checkpoint("awq", "Qwen3ForCausalLM", tmp_path, legacy=True, tie_word_embeddings=False)
    fmt = detect_format(tmp_path)
    assert fmt is not None and fmt.method == "awq" and fmt.group_size == 32
    ids = prompt(20, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    info = engine.info()
    assert info["weights"] == {"projections": "awq int4 g32", "lm_head": "float32", "embedding": "float32"}
    assert info["memory_plan"]["notes"] == []
    assert rel_err(engine.score(ids), ref) < 1e-4
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32", quant_lm_head="int8", quant_embedding="int8")
    info = engine.info()["weights"]
    assert info == {"projections": "awq int4 g32", "lm_head": "int8 g128", "embedding": "int8 rows g128"}
    assert isinstance(engine.model.lm_head, Int8Weight)
    # int8 lm_head and embedding rows: close, not float32-exact.
    assert rel_err(engine.score(ids), ref) < 0.02


def test_format_comes_from_the_config_not_the_name(tmp_path: Path) -> None:
    d = tmp_path / "Qwen3-8B-AWQ"
    make_checkpoint("ct-symmetric", "Qwen3ForCausalLM", d)
    assert detect_format(d).method == "compressed-tensors"
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="bitsandbytes.*not supported"):
        detect_format(d)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GEMM only"):
        detect_format(d)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 32}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="8-bit"):
        detect_format(d)


def test_fused_parts_with_different_act_orders_are_refused(tmp_path: Path) -> None:
    make_checkpoint("gptq-desc-act", "Qwen3ForCausalLM", tmp_path)
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "model.safetensors"))
    g = t["model.layers.0.self_attn.k_proj.g_idx"]
    t["model.layers.0.self_attn.k_proj.g_idx"] = g.flip(0).contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="qkv_proj.*different act-order"):
        Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")


def test_bad_packed_shape_is_named(tmp_path: Path) -> None:
    make_checkpoint("awq", "Qwen3ForCausalLM", tmp_path)
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.qweight"
    t[name] = t[name][:, :-1].contiguous()
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj\.qweight is torch.int32"):
        Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
