"""K/V held in int8 (edge/kernels/kv_int8.py) on the CPU: the format, the pools and the
contiguous cache, the budget, prefix reuse, settings and the commands.

The CUDA kernels' int8 paths are checked against the same reference in
tests/test_kv_int8_cuda.py (GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.kernels import reference
from edge.kernels.kv_int8 import Int8KV, dequantize, quantize_rows
from edge.model.config import ModelConfig
from edge.runtime.budget import compute_budget, kv_block_bytes, parse_kv_dtype
from edge.runtime.engine import Engine
from edge.runtime.kv_paged import BlockPool, PagedKVCache
from edge.settings import from_environment, resolve

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig.from_dict(
    {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
)


def test_codes_and_scales_are_the_rounded_row_over_its_largest_magnitude() -> None:
    """Against numpy in float32: scale = amax / 127, code = rint(x * (127 / amax)), half to
    even; every nonzero row reaches +-127; a zero row is all zeros with scale 0; each
    value comes back within half a step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 64, generator=g) * torch.logspace(-3, 3, 300).view(-1, 1, 1)
    x[5, 1] = 0
    x[7, 2, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0])  # halves: ties to even after scaling by 1
    x[7, 2, 4:] = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = x.to(dtype)
        codes, scales = quantize_rows(xs)
        xf = xs.float().numpy()
        amax = np.abs(xf).max(axis=-1)
        want_scale = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        want = np.clip(np.rint(xf * inv[..., None]), -127, 127).astype(np.int8)
        assert codes.dtype == torch.int8 and scales.dtype == torch.float32
        np.testing.assert_array_equal(codes.numpy(), want)
        np.testing.assert_array_equal(scales.numpy(), want_scale)
        nonzero = amax > 0
        assert (np.abs(want).max(axis=-1)[nonzero] == 127).all()
        assert not codes[5, 1].any() and scales[5, 1] == 0
        err = (dequantize(codes, scales) - xs.float()).abs()
        assert (err <= scales.unsqueeze(-1) * 0.5 * (1 + 1e-4)).all()  # x * (127 / amax) rounds in float32
    assert quantize_rows(x[7, 2])[0][:4].tolist() == [0, 2, -2, 127]  # 0.5 -> 0, 1.5 -> 2, -2.5 -> -2


def test_int8kv_holds_codes_and_scales_of_the_same_rows() -> None:
    pool = Int8KV.empty((2, 3, 4, 2, 8), "cpu")
    layer = pool[1]
    assert layer.shape == (3, 4, 2, 8) and layer.scales.shape == (3, 4, 2)
    assert layer.codes.data_ptr() == pool.codes[1].data_ptr()  # a view, not a copy
    assert layer.nbytes() == 3 * 4 * 2 * (8 + 4)
    with pytest.raises(ValueError, match="int8 codes and float32 scales"):
        Int8KV(torch.zeros(2, 8), torch.zeros(2))
    with pytest.raises(ValueError, match="same rows"):
        Int8KV(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(3))


def test_reference_attention_reads_the_rows_dequantized_in_float32() -> None:
    """An int8 pool is read as float32 rows code * scale: the reference over it equals the
    reference over a float32 pool holding those rows, bit for bit."""
    g = torch.Generator().manual_seed(1)
    nb, page, kvh, d, qh = 6, 4, 2, 8, 4
    table = torch.tensor([4, 1, 5, 0], dtype=torch.int32)
    k, v = torch.randn(13, kvh, d, generator=g), torch.randn(13, kvh, d, generator=g)
    kq, vq = Int8KV.empty((nb, page, kvh, d), "cpu"), Int8KV.empty((nb, page, kvh, d), "cpu")
    everything = torch.arange(nb)
    kq.poison(0, everything)
    vq.poison(0, everything)
    reference.write_kv(kq, vq, table, k, v, 0)
    kf = torch.full((nb, page, kvh, d), float("nan"))
    vf = torch.full_like(kf, float("nan"))
    reference.write_kv(kf, vf, table, dequantize(*quantize_rows(k)), dequantize(*quantize_rows(v)), 0)
    q = torch.randn(qh, d, generator=g)
    for n in (1, 4, 5, 13):
        a = reference.decode_attention(q, kq, vq, table, n, 0.3)
        assert torch.isfinite(a).all()  # no poisoned row read
        assert torch.equal(a, reference.decode_attention(q, kf, vf, table, n, 0.3))
    qs = torch.randn(5, qh, d, generator=g)
    assert torch.equal(reference.prefill_attention(qs, kq, vq, table, 8, 0.3),
                       reference.prefill_attention(qs, kf, vf, table, 8, 0.3))


def test_block_pool_counts_and_poisons_int8_rows() -> None:
    pool = BlockPool(CFG, 8, 4, torch.device("cpu"), torch.bfloat16, poison=True, kv_dtype="int8")
    assert isinstance(pool.k, Int8KV) and pool.kv_dtype == "int8"
    assert pool.block_bytes() == kv_block_bytes(CFG, 4, torch.bfloat16, "int8") == 2 * 2 * 4 * 2 * (8 + 4)
    blocks = pool.alloc_many(3)
    assert (pool.k.codes[:, blocks] == -128).all() and torch.isnan(pool.v.scales[:, blocks]).all()
    with pytest.raises(ValueError, match="kv dtype must be one of auto, int8"):
        BlockPool(CFG, 8, 4, torch.device("cpu"), torch.bfloat16, kv_dtype="fp8")


@pytest.mark.parametrize("head_dim,ratio", [(128, 2 * 128 / 132), (64, 2 * 64 / 68)])
def test_the_same_memory_holds_about_twice_the_tokens(head_dim: int, ratio: float) -> None:
    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": head_dim})
    kv_memory = 2 << 30
    blocks = {
        kv: compute_budget(block_bytes=kv_block_bytes(cfg, 16, torch.bfloat16, kv), page_size=16, max_seq_len=4096,
                           kv_memory=kv_memory).num_blocks
        for kv in ("auto", "int8")
    }
    assert blocks["int8"] / blocks["auto"] == pytest.approx(ratio, rel=1e-3)


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    """The embedded model with float32 K/V and with int8 K/V, paged and contiguous."""
    base = Engine.from_pretrained(kv_cache="contiguous", kv_dtype="int8", max_seq_len=256)
    out = {"contiguous-int8": base}
    for name, kw in (("paged-int8", {"kv_dtype": "int8", "poison_kv": True}), ("paged-float", {})):
        out[name] = Engine(base.model, base.tokenizer, base.model_dir, kv_cache="paged", num_blocks=40, page_size=8,
                           max_seq_len=256, **kw)
    return out


def test_paged_int8_cache_equals_the_contiguous_int8_cache(engines: dict[str, Engine]) -> None:
    """Prefill in chunks and decode over poisoned int8 pools give the contiguous int8
    cache's logits bit for bit; float K/V differs, but little (the drift tools/kv_drift.py
    reports)."""
    ids = list(range(5, 45))
    logits = {}
    for name, engine in engines.items():
        engine.prefill_chunk = 16
        seq = engine.new_sequence()
        out = [engine.prefill(seq, ids, all_logits=True)]
        for tok in (7, 9, 11, 13, 15, 17, 19, 21, 23):
            out.append(engine.forward(seq, [tok]).unsqueeze(0))
        engine.end_sequence(seq)
        logits[name] = torch.cat(out)
    assert torch.equal(logits["paged-int8"], logits["contiguous-int8"])
    drift = (logits["paged-int8"] - logits["paged-float"]).abs().max().item()
    assert 0 < drift < 0.05


def test_prefix_reuse_reads_the_cached_int8_blocks(engines: dict[str, Engine]) -> None:
    """A sequence started on another's full int8 blocks (reference-counted, not copied)
    continues exactly as the one that wrote them."""
    engine = engines["paged-int8"]
    ids = list(range(3, 40))  # 4 full pages of 8 and 5 tokens
    first = engine.new_sequence()
    engine.prefill(first, ids[:32])
    want = engine.forward(first, ids[32:])
    second = engine.new_sequence()
    second.share_prefix(first.blocks[:4])
    got = engine.forward(second, ids[32:])
    assert torch.equal(got, want)
    engine.end_sequence(second)
    engine.end_sequence(first)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_kv_dtype_setting_from_environment_and_flags() -> None:
    settings, _ = resolve({}, {"EDGE_KV_DTYPE": "INT8"})
    assert settings.kv_dtype == "int8"
    assert resolve({"kv_dtype": "auto"}, {"EDGE_KV_DTYPE": "int8"})[0].kv_dtype == "auto"
    assert from_environment("kv_dtype", {"EDGE_KV_DTYPE": "int8"}) == "int8"
    assert from_environment("kv_dtype", {}) is None
    with pytest.raises(ValueError, match=r"bad EDGE_KV_DTYPE='fp8' \(environment\): kv dtype must be one of auto, int8"):
        resolve({}, {"EDGE_KV_DTYPE": "fp8"})
    assert parse_kv_dtype(None) == parse_kv_dtype("") == "auto"


def _edge(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "edge.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, **(env or {})})


def test_generate_and_info_with_int8_kv() -> None:
    r = _edge("generate", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "12", "--kv-dtype", "int8", "--ignore-eos",
              "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 12
    r = _edge("info", "--max-seq-len", "256", env={"EDGE_KV_DTYPE": "int8"})
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["model"]
    assert model["kv_dtype"] == "int8"
    assert model["kv_budget"]["block_bytes"] == kv_block_bytes(
        ModelConfig.from_pretrained(model["model_dir"]), 16, torch.float32, "int8")
    r = _edge("generate", "--kv-dtype", "fp8", "--max-tokens", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "kv dtype must be one of" in r.stderr


def test_verify_paged_with_int8_kv_exits_zero() -> None:
    r = subprocess.run([sys.executable, "tools/verify_paged.py", "--kv-dtype", "int8", "--vision-model", "none",
                        "--min-tokens", "16", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and {row["mode"] for row in report["rows"]} >= {"paged-reference", "paged-ref+nan-poison"}
    assert all(row["compared"] >= 16 and row["mismatch_at"] is None for row in report["rows"])


def test_kv_drift_reports_a_float_control_at_transformers_and_int8_near_it() -> None:
    """tools/kv_drift.py against transformers on random weights: float32 K/V is the
    control (transformers' logits to float32 rounding), int8 K/V drifts but keeps the
    greedy tokens of the decisive (peaked) model."""
    r = subprocess.run([sys.executable, "tools/kv_drift.py", "--skip-presets", "--tokens", "12", "--contexts", "48",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr
    rows = {(row["model"], row["kv"]): row for row in json.loads(r.stdout)["rows"]}
    for model in ("tiny", "tiny-peaked"):
        assert rows[(model, "float32")]["max_abs_dlogit"] < 1e-4
        assert 1e-4 < rows[(model, "int8")]["max_abs_dlogit"] < 0.1
    assert rows[("tiny-peaked", "int8")]["agree"] == 1.0
