"""First start (edge/kernels/prebuild.py): the variants a backend loads, recorded from the
wrappers' own constructors, compiled in parallel threads into the disk cache; a variant
asked for twice at once is compiled once. The GPU test checks the recorded list against
what a real backend loads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from edge.kernels import nvrtc, prebuild
from edge.model.config import ModelConfig
from edge.model.random_model import model_config


def _nvrtc_or_skip() -> None:
    try:
        nvrtc.check_available()
    except nvrtc.KernelsUnavailable as exc:
        pytest.skip(f"NVRTC toolchain not installed: {exc}")


def test_the_plan_follows_the_backend_shape() -> None:
    cfg = ModelConfig.from_dict(model_config(preset="qwen3-8b"))
    bf16 = prebuild.backend_variants(cfg, torch.bfloat16, arch="sm_87", sms=16)
    sources = [v.source for v in bf16]
    decode = [dict(v.defines) for v in bf16 if v.source == "paged_decode.cu"]
    assert decode == [{"CFG_DTYPE": "2", "CFG_HEAD_DIM": "128"}]  # this model's dtype and head dim only
    assert "int4_gemv.cu" not in sources  # int4 kernels only with int4 weights
    int4 = prebuild.backend_variants(cfg, torch.bfloat16, arch="sm_87", sms=16,
                                     int4_scale_dtypes=(torch.float16, torch.bfloat16))
    assert [v.source for v in int4].count("int4_gemv.cu") == 2  # one per scale dtype
    # Few SMs run 4-warp tensor-core CTAs in the norm modes: a second int8_mma variant.
    assert sources.count("int8_mma.cu") == 2
    assert [v.source for v in prebuild.backend_variants(cfg, torch.bfloat16, arch="sm_90", sms=132)].count(
        "int8_mma.cu") == 1


def test_variants_compile_in_threads_into_the_cache_once(tmp_path: Path, monkeypatch) -> None:
    _nvrtc_or_skip()
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path))
    compiles: list[str] = []
    real = nvrtc._compile
    threads: set[str] = set()

    def counting(cc, source, arch, defines, includes):  # noqa: ANN001, ANN202
        compiles.append(source)
        threads.add(threading.current_thread().name)
        return real(cc, source, arch, defines, includes)

    monkeypatch.setattr(nvrtc, "_compile", counting)
    variants = [prebuild.Variant("kv_write.cu", ()), prebuild.Variant("dequant.cu", ()),
                prebuild.Variant("kv_write.cu", ())]  # the same variant twice at once
    lines: list[str] = []
    prebuild.compile_variants(variants, "sm_87", workers=3, progress=lines.append)
    assert sorted(compiles) == ["dequant.cu", "kv_write.cu"]
    assert len(threads) == 2 and all(t.startswith("edge-nvrtc") for t in threads)
    assert not prebuild.missing(variants, "sm_87")
    assert lines[-1].startswith("kernels 3/3: ")
    prebuild.compile_variants(variants, "sm_87", workers=2)
    assert len(compiles) == 2  # served from the cache


@pytest.mark.cuda
@pytest.mark.parametrize("int4", [False, True])
def test_the_plan_is_what_the_backend_loads(monkeypatch, int4: bool) -> None:
    from edge.kernels.launcher import context_sm_count
    from edge.quant.int4 import Int4Weight, pack_weight, quantize_rtn
    from edge.runtime.backend import select_backend

    cfg = ModelConfig.from_dict(model_config(preset="qwen3-0.6b"))
    dev = torch.device("cuda")
    weights = []
    if int4:
        w = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
        weights.append(pack_weight([quantize_rtn(w, 128, torch.float16, "w")], dev, "w"))
        assert isinstance(weights[0], Int4Weight)
    loaded: set[prebuild.Variant] = set()
    real = nvrtc.compile_cubin

    def recording(source, arch, defines=None, **kw):  # noqa: ANN001, ANN202
        loaded.add(prebuild.Variant(source, nvrtc._normalize_defines(defines)))
        return real(source, arch, defines, **kw)

    monkeypatch.setattr(nvrtc, "compile_cubin", recording)
    select_backend(cfg, dev, torch.bfloat16, weights)
    idx = torch.cuda.current_device()
    planned = prebuild.backend_variants(
        cfg, torch.bfloat16, arch=nvrtc.device_arch(idx), sms=context_sm_count(idx),
        shared_memory=nvrtc.shared_memory(idx), int4_scale_dtypes=(torch.float16,) if int4 else (),
    )
    assert loaded == set(planned)


@pytest.mark.cuda
def test_a_first_start_compiles_ahead_and_reports_progress(tmp_path: Path, monkeypatch) -> None:
    from edge.runtime.engine import Engine

    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path))
    lines: list[str] = []
    engine = Engine.from_pretrained(device="cuda", on_status=lines.append)
    assert lines[0].startswith("compiling ") and "kernel variants" in lines[0]
    assert any(line.startswith("kernels ") for line in lines) and lines[-1].startswith("kernels compiled in")
    assert engine.backend.kind == "cuda"
    again: list[str] = []
    Engine.from_pretrained(device="cuda", on_status=again.append)
    assert again == []  # every variant cached: nothing compiled ahead
