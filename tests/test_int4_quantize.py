"""tools/quantize.py --bits 4: the written compressed-tensors checkpoint, read back by an
independent dequantizing reader (written here from the format's description) into
transformers in float32, against edge loading the same files; AWQ's scaling leaves the
float model's function unchanged (transformers before / after) and helps where
activations have outlier channels; --quantize int4 while loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from edge.model.config import ModelConfig
from edge.runtime.engine import Engine
from edge.quant.int4_quantize import _layer_groups, awq_plan, calibration_inputs
from edge.model.random_model import make_model
from edge.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def read_compressed(dst: Path) -> dict[str, torch.Tensor]:
    """Float32 state dict of a pack-quantized checkpoint: W = (q - z) * s per group,
    q the unsigned nibble (bits 4i of word i // 8), z from the row-packed zero points."""
    t = load_file(str(dst / "model.safetensors"))
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]["weights"]["group_size"]
    out = {}
    for name, v in t.items():
        if name.endswith(".weight_packed"):
            base = name.removesuffix(".weight_packed")
            rows, cols = t[base + ".weight_shape"].tolist()
            words = v.to(torch.int64) & 0xFFFFFFFF
            q = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(rows, cols)
            zw = t[base + ".weight_zero_point"].to(torch.int64) & 0xFFFFFFFF  # [rows/8, groups]
            z = torch.stack([(zw >> (4 * i)) & 15 for i in range(8)], dim=1).reshape(-1, zw.shape[1])[:rows]
            s = t[base + ".weight_scale"].float()
            g = torch.arange(cols) // group
            out[base + ".weight"] = (q.float() - z.float()[:, g]) * s[:, g]
        elif not name.endswith((".weight_scale", ".weight_zero_point", ".weight_shape")):
            out[name] = v.float()
    return out


def hf_from(src: Path, state: dict[str, torch.Tensor]):
    import transformers

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if missing:
        model.tie_weights()
    return model


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("float"), arch="qwen3", preset="tiny", seed=5)


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_written_checkpoint_reads_back_as_edge_loads_it(
    float_model: Path, tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.quantize import main

    dst = tmp_path / "int4"
    assert main([str(float_model), str(dst), "--bits", "4", "--group-size", "32", "--method", method]) == 0
    err = capsys.readouterr().err  # each long stage reports on stderr
    stages = [f"int4 {method}: quantizing"] + (["AWQ: calibration inputs", "AWQ: scale search"] if method == "awq" else [])
    assert all(stage in err for stage in stages), err
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert (dst / "tokenizer.json").is_file()
    hf = hf_from(dst, read_compressed(dst))
    engine = Engine.from_pretrained(dst, device="cpu", dtype="float32", quant_lm_head="float", quant_embedding="float")
    vocab = engine.cfg.vocab_size
    ids = prompt(40, seed=1, vocab=vocab)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(engine.score(ids), ref) < 1e-4
    ids = ids[:10]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert engine.generate(ids, SamplingParams(max_tokens=48, ignore_eos=True)).token_ids == want


def test_awq_scaling_keeps_the_float_function(float_model: Path) -> None:
    """Folding the scales into the producers (norm weights, up / v rows) and the
    consumers' columns changes no float output: transformers before and after."""
    import transformers

    cfg = ModelConfig.from_pretrained(float_model)
    state = load_file(str(float_model / "model.safetensors"))
    inputs = calibration_inputs(float_model, cfg, tokens=64)
    assert set(inputs) == {key for i in range(cfg.num_layers) for _, _, key in _layer_groups(cfg, i)}
    cols, rows = awq_plan(lambda n: state[n], cfg, inputs, 32, torch.float16)
    assert any(not torch.allclose(s, torch.ones_like(s)) for s in cols.values()), "no group was scaled"
    scaled = {}
    for n, t in state.items():
        t = t.float()
        if n in cols:
            t = t * cols[n]
        if n in rows:
            t = t / rows[n] if t.dim() == 1 else t / rows[n].unsqueeze(1)
        scaled[n] = t
    before = transformers.AutoModelForCausalLM.from_pretrained(float_model, dtype=torch.float32).eval()
    after = hf_from(float_model, scaled)
    ids = torch.tensor([prompt(30, seed=2, vocab=cfg.vocab_size)])
    with torch.no_grad():
        assert rel_err(after(ids).logits, before(ids).logits) < 1e-5


def test_awq_beats_rtn_with_outlier_channels(tmp_path: Path) -> None:
    """Activation outliers (a few hidden channels 30x larger, as in trained LLMs) are what
    AWQ protects: its logits on the calibration text are closer to the float model's."""
    from safetensors.torch import save_file

    from tools.quantize import main

    src = make_model(tmp_path / "float", arch="qwen3", preset="tiny", seed=6)
    state = load_file(str(src / "model.safetensors"))
    hot = torch.arange(0, state["model.norm.weight"].numel(), 29)
    for n in list(state):
        if n.endswith("layernorm.weight"):
            state[n][hot] *= 30.0
    save_file(state, str(src / "model.safetensors"))
    errs = {}
    ids = prompt(64, seed=3, vocab=ModelConfig.from_pretrained(src).vocab_size)
    base = Engine.from_pretrained(src, device="cpu", dtype="float32").score(ids)
    for method in ("rtn", "awq"):
        dst = tmp_path / method
        assert main([str(src), str(dst), "--bits", "4", "--group-size", "32", "--method", method]) == 0
        e = Engine.from_pretrained(dst, device="cpu", dtype="float32", quant_lm_head="float", quant_embedding="float")
        errs[method] = rel_err(e.score(ids), base)
    assert errs["awq"] < errs["rtn"], errs


def test_quantize_while_loading_is_rtn_of_the_float_checkpoint(float_model: Path, tmp_path: Path) -> None:
    """--quantize int4 gives the codes the offline RTN writes (same group, same scale dtype)."""
    from tools.quantize import main

    dst = tmp_path / "rtn"
    assert main([str(float_model), str(dst), "--bits", "4", "--group-size", "32"]) == 0
    kw = dict(device="cpu", dtype="float32", quant_lm_head="float", quant_embedding="float")
    offline = Engine.from_pretrained(dst, **kw)
    online = Engine.from_pretrained(float_model, quantize="int4", quant_group_size=32, **kw)
    for k in ("qkv", "o", "gate_up", "down"):
        a, b = offline.model.layers[1][k], online.model.layers[1][k]
        assert torch.equal(a.packed, b.packed) and torch.equal(a.zero, b.zero)
        assert torch.equal(a.scale.float(), b.scale.float())
    assert online.info()["weights"]["projections"] == "rtn int4 g32"


def test_bad_options_are_one_line_errors(float_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tools.quantize import main

    assert main([str(float_model), str(tmp_path / "x"), "--bits", "4", "--group-size", "48"]) == 2
    assert "multiple of 48" in capsys.readouterr().err
    dst = tmp_path / "q"
    assert main([str(float_model), str(dst), "--bits", "4", "--group-size", "32"]) == 0
    assert main([str(dst), str(tmp_path / "again"), "--bits", "4"]) == 2
    assert "already quantized" in capsys.readouterr().err
