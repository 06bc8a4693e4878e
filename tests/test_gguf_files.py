"""GGUF files made by llama.cpp's converter and llama-quantize (tests/gguf_support.py),
loaded by edge: config, weights and greedy tokens against transformers reading the same
file; split files; broken files refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_support import ARCH_VARIANTS, FILE_TYPES, assert_same_greedy, greedy_reference, transformers_oracle

from edge.model.config import ModelConfig, rope_inv_freq
from edge.model.gguf_file import GGUFError, open_gguf
from edge.model.gguf_loader import gguf_config, load_gguf_weights, open_model_file
from edge.model.loader import expected_shapes, fused_layout, load_weights
from edge.quant.embedding import Int8Embedding
from edge.quant.gguf import GGUFEmbedding, GGUFWeight
from edge.quant.q8_0 import Int8Weight
from edge.runtime.engine import Engine
from edge.sampling import SamplingParams

VARIANTS = sorted(ARCH_VARIANTS)
# The ggml types each file type must contain (so each test run exercises them).
TYPES_IN_FILE = {
    "F32": {"F32"}, "F16": {"F16"}, "BF16": {"BF16"}, "Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0"},
    "Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"},
}
CPU = torch.device("cpu")


def prompt(n: int, seed: int, vocab: int = 800) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_from_metadata_matches_config_json(gguf_files, variant: str) -> None:
    cfg = gguf_config(open_model_file(gguf_files.file(variant, "F32")))
    ref = ModelConfig.from_pretrained(gguf_files.hf_dir(variant))
    for name in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                 "qkv_bias", "qk_norm", "bos_token_id"):
        assert getattr(cfg, name) == getattr(ref, name), name
    assert np.float32(cfg.rms_norm_eps) == np.float32(ref.rms_norm_eps)
    assert set(ref.eos_token_ids) <= set(cfg.eos_token_ids)
    # Llama 3 scaling arrives as rope_freqs: the same frequencies, up to its float32 rounding.
    assert (cfg.rope_freq_factors is not None) == (ref.rope_scaling is not None)
    torch.testing.assert_close(rope_inv_freq(cfg), rope_inv_freq(ref), rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_file_holds_the_checkpoints_weights(gguf_files, variant: str) -> None:
    """Names, the llama q/k row order and the tied lm_head undone exactly."""
    f = open_model_file(gguf_files.file(variant, "F32"))
    ours = load_gguf_weights(f, gguf_config(f), CPU, torch.float32)
    hf_dir = gguf_files.hf_dir(variant)
    ref = load_weights(hf_dir, ModelConfig.from_pretrained(hf_dir), CPU, torch.float32)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name


def _dense(w) -> torch.Tensor:  # noqa: ANN001
    if isinstance(w, (GGUFEmbedding, Int8Embedding)):
        return w.table.dequantize()
    return w if isinstance(w, torch.Tensor) else w.dequantize()


@pytest.mark.parametrize("qtype", FILE_TYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_transformers_on_the_same_file(gguf_files, variant: str, qtype: str) -> None:
    """Every tensor dequantized bit for bit as transformers (gguf-py) does, then greedy
    decoding (float32, CPU) gives transformers' tokens."""
    path = gguf_files.file(variant, qtype)
    f = open_model_file(path)
    assert TYPES_IN_FILE[qtype] <= {t.type_name for t in f.tensors.values()}
    hf = transformers_oracle(gguf_files.hf_dir(variant), path)
    cfg = gguf_config(f)
    weights = load_gguf_weights(f, cfg, CPU, torch.float32)
    state = hf.state_dict()
    for name, (dest, row) in fused_layout(expected_shapes(cfg)).items():
        want = state[name]
        got = _dense(weights[dest])[row : row + want.shape[0]]
        assert torch.equal(got, want), f"{name} ({dest})"

    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=128, page_size=8)
    assert engine.info()["weights"]["format"] == "gguf"
    ids = prompt(9, seed=len(variant) + len(qtype))
    ref, logits = greedy_reference(hf, ids, 12)
    ours = engine.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    assert_same_greedy(ours, ref, logits, f"{variant} {qtype}")


def test_quantized_weights_are_held_as_stored(gguf_files) -> None:
    f = open_model_file(gguf_files.file("qwen3", "Q4_K_M"))
    engine = Engine.from_pretrained(f.path, device="cpu", dtype="float32", max_seq_len=64)
    w = engine.model.w
    qkv = w["model.layers.0.self_attn.qkv_proj.weight"]
    assert isinstance(qkv, GGUFWeight)
    stored = sum(f.tensors[f"blk.0.attn_{p}.weight"].nbytes for p in "qkv")
    assert qkv.nbytes() == stored
    # The budget counts what is held: the file's tensors, norms widened to the model's dtype.
    assert engine.model.weight_bytes() == engine.budget.weights
    assert engine.model.weight_bytes() <= f.nbytes()


def test_q8_0_runs_as_edges_int8_groups(gguf_files) -> None:
    """Q8_0 blocks repacked into int8 codes + float32 scales per 32 values: every value
    exact (the greedy test compares them bit for bit), held at 9 bits a weight."""
    f = open_model_file(gguf_files.file("qwen2", "Q8_0"))
    w = load_gguf_weights(f, gguf_config(f), CPU, torch.float32)
    qkv = w["model.layers.0.self_attn.qkv_proj.weight"]
    assert isinstance(qkv, Int8Weight) and qkv.group_size == 32 and qkv.scale.dtype == torch.float32
    assert isinstance(w["model.embed_tokens.weight"], Int8Embedding)
    stored = sum(f.tensors[f"blk.0.attn_{p}.weight"].nbytes for p in "qkv")
    assert qkv.nbytes() == stored * 36 // 34


def test_split_files_load_as_one_model(gguf_files) -> None:
    parts = gguf_files.split("qwen3", max_tensors=8)
    assert len(parts) >= 3
    whole = open_model_file(gguf_files.file("qwen3", "F32"))
    for part in (parts[0], parts[-1]):
        f = open_model_file(part)
        assert f.paths == tuple(parts)
        assert f.tensors.keys() == whole.tensors.keys()
        a = load_gguf_weights(f, gguf_config(f), CPU, torch.float32)
        b = load_gguf_weights(whole, gguf_config(whole), CPU, torch.float32)
        assert all(torch.equal(a[k], b[k]) for k in b)
    missing = parts[1].with_suffix(".moved")
    parts[1].rename(missing)
    try:
        with pytest.raises(GGUFError, match="missing"):
            open_gguf(parts[0])
    finally:
        missing.rename(parts[1])


# -- broken files ----------------------------------------------------------------------


def _offset(reader, part: np.ndarray) -> int:  # noqa: ANN001
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


def _patched(src: Path, dst: Path, edits: list[tuple[int, bytes]]) -> Path:
    data = bytearray(src.read_bytes())
    for at, new in edits:
        data[at : at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def _tensor_field_offsets(path: Path, name: str) -> dict[str, int]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    _, _, _, dims, dtype, _ = t.field.parts
    return {"dims": _offset(reader, dims), "dtype": _offset(reader, dtype)}


def _key_offset(path: Path, key: str) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return _offset(reader, reader.fields[key].parts[1])


def _value_offset(path: Path, key: str) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return _offset(reader, reader.fields[key].parts[-1])


def _broken_files(src: Path, out: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what its error must say)."""
    size = src.stat().st_size
    data = src.read_bytes()
    down = _tensor_field_offsets(src, "blk.0.ffn_down.weight")
    embd = _tensor_field_offsets(src, "token_embd.weight")
    files = {
        "truncated data": (size // 2, "truncated"),
        "truncated header": (200, "truncated"),
    }
    cases: dict[str, tuple[Path, str]] = {}
    for name, (n, msg) in files.items():
        p = out / f"{name.replace(' ', '-')}.gguf"
        p.write_bytes(data[:n])
        cases[name] = (p, msg)
    cases["wrong magic"] = (_patched(src, out / "magic.gguf", [(0, b"GGML")]), "not a GGUF file")
    cases["unknown type"] = (_patched(src, out / "type.gguf", [(down["dtype"], (99).to_bytes(4, "little"))]),
                             "unknown ggml type")
    cases["unread type"] = (_patched(src, out / "q2k.gguf", [(down["dtype"], (10).to_bytes(4, "little"))]),
                            "Q2_K, which edge does not read")
    # token_embd declared with 4x the rows: more bytes than lie before the next tensor.
    rows = int.from_bytes(data[embd["dims"] + 8 : embd["dims"] + 16], "little")
    cases["size"] = (_patched(src, out / "size.gguf", [(embd["dims"] + 8, (4 * rows).to_bytes(8, "little"))]),
                     "token_embd.weight")
    key = _key_offset(src, "qwen3.embedding_length")
    cases["missing metadata"] = (_patched(src, out / "meta.gguf", [(key + len("qwen3.embedding_lengt"), b"X")]),
                                 "'qwen3.embedding_length' is missing")
    arch = _value_offset(src, "general.architecture")
    cases["architecture"] = (_patched(src, out / "arch.gguf", [(arch, b"gemma")]), "unsupported architecture 'gemma'")
    return cases


def test_broken_files_are_refused_in_one_line(gguf_files, tmp_path: Path) -> None:
    cases = _broken_files(gguf_files.file("qwen3", "F32"), tmp_path)
    for name, (path, msg) in cases.items():
        with pytest.raises((GGUFError, ValueError)) as exc:
            Engine.from_pretrained(path, device="cpu", max_seq_len=64)
        text = str(exc.value)
        assert msg in text and "\n" not in text and path.name in text, f"{name}: {text}"


def test_cli_names_a_broken_file_without_a_traceback(gguf_files, tmp_path: Path) -> None:
    path, msg = _broken_files(gguf_files.file("qwen3", "F32"), tmp_path)["truncated data"]
    proc = subprocess.run([sys.executable, "-m", "edge.cli", "generate", "--model", str(path), "--prompt", "hi",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("edge: error")]
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in proc.stderr


def test_missing_file_and_directory_hints(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "absent.gguf", device="cpu")
