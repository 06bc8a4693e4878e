"""JetPack 6.0 ships torch 2.3, which has no ``torch.nn.functional.rms_norm`` (added in 2.4):
the reference backend, ``edge verify`` and the Qwen2.5-VL tower must run without it, and
give what they give with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edge.kernels import reference
from edge.model.vision.random_model import make_vl_model
from edge.runtime.engine import Engine
from edge.sampling import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 256), (3, 5, 128), (1, 4096)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_without_torchs(monkeypatch, dtype, shape, weighted) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype) if weighted else None
    with_torchs = reference.rms_norm(x, w, 1e-6)
    monkeypatch.delattr(F, "rms_norm")
    assert torch.equal(reference.rms_norm(x, w, 1e-6), with_torchs)


def test_engine_and_vision_tower_without_torchs_rms_norm(monkeypatch, tmp_path) -> None:
    ids = [3, 14, 15, 92, 65]
    engine = Engine.from_pretrained(device="cpu", dtype="float32", kv_blocks=600)
    expected = engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    vl = Engine.from_pretrained(make_vl_model(tmp_path / "vl", "qwen2.5-vl-tiny", std=0.1), device="cpu",
                                dtype="float32", kv_blocks=600)
    pixels = torch.randn(16 * 4, vl.vision.cfg.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    features = vl.vision.tower(pixels, [(1, 8, 8)])[0].embeds
    monkeypatch.delattr(F, "rms_norm")
    assert engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids == expected
    assert torch.equal(vl.vision.tower(pixels, [(1, 8, 8)])[0].embeds, features)
