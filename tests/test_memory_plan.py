"""The memory plan (edge/runtime/memory_plan.py): its weight bytes are what the loaded
model holds, byte for byte, in every format; the fit check refuses, in one line and before
anything loads, what the plan says does not fit; "auto" keeps an int4 model's lm_head and
embedding as published unless only int8 rows fit."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from edge import cli
from edge.model.random_model import make_model, model_config
from edge.runtime import memory_plan as mp
from edge.runtime.boards import BOARDS
from edge.runtime.budget import MemoryInfo
from edge.runtime.engine import Engine
from edge.sampling import SamplingParams
from tests.test_int4_checkpoints import make_checkpoint

GiB = 1 << 30


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("untied") / "m", preset="tiny", dtype="bfloat16",
                      tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tied") / "m", preset="tiny", dtype="bfloat16")


def _engine(path: Path, **kw) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype="float32", kv_blocks=600, **kw)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(
    "quantize,head,emb",
    [(None, "auto", "auto"), ("int8", "auto", "auto"), ("int4", "auto", "auto"), ("int4", "int8", "int8"),
     ("int4", "int4", "float")],
)
def test_plan_weights_are_what_the_loaded_model_holds(tiny_tied, tiny_untied, tied, quantize, head, emb) -> None:
    path = tiny_tied if tied else tiny_untied
    engine = _engine(path, quantize=quantize, quant_lm_head=head, quant_embedding=emb)
    p = mp.plan(mp.Checkpoint.from_dir(path), kind="cpu", dtype="float32", quantize=quantize, lm_head=head,
                embedding=emb)
    assert p.weight_bytes == engine.model.weight_bytes()


@pytest.mark.parametrize("fmt", ["awq", "gptq-desc-act", "ct-symmetric"])
def test_plan_weights_of_published_int4_checkpoints(tmp_path: Path, fmt: str) -> None:
    make_checkpoint(fmt, "Qwen3ForCausalLM", tmp_path, seed=3, tie_word_embeddings=False)
    ckpt = mp.Checkpoint.from_dir(tmp_path)
    assert ckpt.stored == "int4"
    engine = _engine(tmp_path, page_size=8)
    p = mp.plan(ckpt, kind="cpu", dtype="float32")
    # Faithful by default: the published float lm_head and embedding.
    assert engine.info()["weights"]["lm_head"] == "float32" and p.held.lm_head == "float"
    assert p.weight_bytes == engine.model.weight_bytes()


def test_plan_weights_of_a_q8_0_checkpoint(tiny_untied, tmp_path: Path) -> None:
    from edge.quant.q8_0 import quantize_checkpoint

    quantize_checkpoint(tiny_untied, tmp_path / "q8")
    ckpt = mp.Checkpoint.from_dir(tmp_path / "q8")
    assert (ckpt.stored, ckpt.int8_lm_head) == ("q8_0", True)
    p = mp.plan(ckpt, kind="cpu", dtype="float32")
    assert p.weight_bytes == _engine(tmp_path / "q8").model.weight_bytes()


def test_plan_counts_the_vision_tower(tmp_path: Path) -> None:
    from edge.model.vision.random_model import make_vl_model

    path = make_vl_model(tmp_path / "vl", "qwen3-vl-tiny")
    engine = _engine(path)
    p = mp.plan(mp.Checkpoint.from_dir(path), kind="cpu", dtype="float32", max_seq_len=engine.max_seq_len)
    tower = sum(t.numel() * t.element_size() for t in engine.vision.tower.w.values())
    assert p.weights["vision tower"] == tower
    assert p.weight_bytes - tower == engine.model.weight_bytes()
    # The tower's peak on the largest image the context holds counts in the engine's budget too.
    assert p.tower > 0 and engine.budget.activations >= p.tower


def test_kv_bytes_per_token_per_dtype() -> None:
    cfg = mp.Checkpoint.from_config(model_config(preset="qwen3-8b"), "qwen3-8b").cfg
    p = mp.plan(mp.Checkpoint(cfg.architecture, cfg), kind="integrated", kv_dtypes=("bfloat16", "int8", "float32"))
    per_layer_head = 2 * cfg.num_layers * cfg.num_kv_heads
    assert p.kv_per_token == {"bfloat16": per_layer_head * 128 * 2, "int8": per_layer_head * (128 + 4),
                              "float32": per_layer_head * 128 * 4}


def _small(available: int) -> MemoryInfo:
    return MemoryInfo("cpu", available, available, "fake meminfo")


def _sparse_checkpoint(root: Path, preset: str, dtype: str = "BF16") -> Path:
    """A checkpoint of a preset's full shapes whose data is a hole: the header is real, the
    tensors read as zeros and take no disk (the fit check reads headers only)."""
    from edge.model.shapes import expected_shapes

    config = model_config(preset=preset)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in expected_shapes(mp.Checkpoint.from_config(config, preset).cfg).items():
        n = 2 * int(torch.tensor(shape).prod())
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path = root / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
    with open(path, "r+b") as f:
        f.truncate(8 + len(blob) + offset)
    return root


def test_serve_refuses_in_one_line_what_the_plan_says_does_not_fit(tmp_path, monkeypatch, capsys) -> None:
    model = _sparse_checkpoint(tmp_path / "qwen3-8b", "qwen3-8b")
    memory = _small(11 * GiB)
    p = mp.plan(mp.Checkpoint.from_dir(model), kind="cpu", memory=memory, dtype="bfloat16")
    assert p.fits is False  # 15.3 GiB of bf16 weights
    monkeypatch.setattr(mp, "probe", lambda kind: memory)

    def no_serving(settings):  # noqa: ANN001, ANN202
        raise AssertionError("the service started although the model cannot fit")

    monkeypatch.setattr("edge.serving.server.serve", no_serving)
    rc = cli.main(["serve", "--model", str(model), "--device", "cpu", "--dtype", "bfloat16"])
    err = capsys.readouterr().err.strip()
    assert rc == mp.EXIT_DOES_NOT_FIT == 78
    assert len(err.splitlines()) == 1, err
    assert "qwen3-8b bfloat16 needs" in err and "11.0 GiB available (fake meminfo)" in err
    assert "--quantize int8" in err  # names what would fit


def test_a_plan_that_fits_passes_and_the_engine_refuses_the_rest(tiny_untied, monkeypatch) -> None:
    ckpt = mp.Checkpoint.from_dir(tiny_untied)
    fits = mp.plan(ckpt, kind="cpu", memory=_small(8 * GiB), dtype="float32")
    assert fits.fits and fits.budget() is not None
    tight = mp.plan(ckpt, kind="cpu", memory=_small(fits.need - 1), dtype="float32")
    assert tight.fits is False and tight.budget() is None  # the same arithmetic as the engine's budget
    monkeypatch.setattr("edge.runtime.engine.probe_memory", lambda device: _small((fits.need - fits.runtime) // 2))
    with pytest.raises(mp.DoesNotFit, match="needs .* available"):
        Engine.from_pretrained(tiny_untied, device="cpu", dtype="float32")


def test_int8_rows_only_where_only_they_fit(tiny_untied, monkeypatch) -> None:
    ckpt = mp.Checkpoint.from_dir(tiny_untied)
    kw = dict(kind="cpu", dtype="float32", quantize="int4", runtime=0)
    published = mp.plan(ckpt, memory=_small(64 * GiB), **kw)
    rows = mp.plan(ckpt, memory=_small(64 * GiB), held=mp.held_form(ckpt, "float32", "int4", "int8", "int8"), **kw)
    assert rows.need < published.need
    between = (rows.need + published.need) // 2
    chosen = mp.fit(ckpt, memory=_small(between), **kw)
    assert (chosen.held.lm_head, chosen.held.embedding) == ("int8", "int8")
    assert "int8 rows" in chosen.notes[0]
    assert mp.fit(ckpt, memory=_small(64 * GiB), **kw).held.lm_head == "float"
    with pytest.raises(mp.DoesNotFit):
        mp.fit(ckpt, memory=_small(between), lm_head="float", embedding="float", **kw)
    # The engine takes the plan's choice and reports it.
    monkeypatch.setattr("edge.runtime.engine.probe_memory", lambda device: _small(between))
    monkeypatch.setattr("edge.runtime.engine.runtime_to_come", lambda kind: 0)
    engine = Engine.from_pretrained(tiny_untied, device="cpu", dtype="float32", quantize="int4")
    info = engine.info()
    assert info["weights"]["lm_head"].startswith("int8") and info["memory_plan"]["notes"]


def test_auto_is_the_published_head_bit_for_bit(tiny_untied) -> None:
    ids = [5, 17, 99, 3]
    auto = _engine(tiny_untied, quantize="int4").generate(ids, SamplingParams(max_tokens=6)).token_ids
    assert auto == _engine(tiny_untied, quantize="int4", quant_lm_head="float",
                           quant_embedding="float").generate(ids, SamplingParams(max_tokens=6)).token_ids


def test_alternatives_name_what_fits_on_a_board() -> None:
    ckpt = mp.Checkpoint.from_config(model_config(preset="qwen3-8b"), "qwen3-8b")
    nx = BOARDS["orin-nx-16"]
    with pytest.raises(mp.DoesNotFit) as exc:
        mp.fit(ckpt, kind="integrated", memory=mp.board_memory(nx), board=nx)
    msg = str(exc.value)
    assert "\n" not in msg and "--quantize int8" in msg and "int4 (AWQ / GPTQ) checkpoint" in msg
    assert mp.fit(ckpt, kind="integrated", memory=mp.board_memory(nx), board=nx, quantize="int4").fits


def test_board_table_rows() -> None:
    ckpts = [mp.Checkpoint.from_config(model_config(preset=p), p) for p in ("qwen3-1.7b", "qwen3-8b")]
    table = mp.board_table(ckpts, list(BOARDS.values()))
    rows = table.splitlines()[2:]
    assert len(rows) == 2 * 3 * len(BOARDS)
    nano_8b_bf16 = next(r for r in rows if "Orin Nano" in r and "qwen3-8b | bf16" in r)
    assert "**no**" in nano_8b_bf16


def test_memory_kind_without_torch(tmp_path: Path) -> None:
    compatible = tmp_path / "compatible"
    compatible.write_bytes(b"nvidia,p3768-0000+p3767-0000\0nvidia,tegra234\0")
    none = str(tmp_path / "absent")
    assert mp.memory_kind(None, tegra_release=none, compatible=str(compatible)) == "integrated"
    assert mp.memory_kind("cpu", tegra_release=none, compatible=str(compatible)) == "cpu"
    assert mp.memory_kind(None, tegra_release=none, compatible=none, nvidia_driver=none) == "cpu"
    assert mp.memory_kind("cuda", tegra_release=none, compatible=none, nvidia_driver=none) == "discrete"


def test_the_fit_check_imports_no_torch(tmp_path: Path) -> None:
    import subprocess

    model = _sparse_checkpoint(tmp_path / "m", "qwen3-1.7b")
    code = ("import sys; from edge.runtime import memory_plan as mp; "
            f"p = mp.plan(mp.Checkpoint.from_dir({str(model)!r}), kind='integrated'); "
            "assert p.weight_bytes > 3 << 30; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def test_the_service_exits_with_78_when_the_model_cannot_fit(tmp_path, monkeypatch) -> None:
    """The fit check inside the engine (the service's loader thread) ends the service with the
    exit code the unit's RestartPreventExitStatus= names, not 1 (which systemd retries)."""
    from edge.serving.service import Service
    from edge.settings import Settings

    model = _sparse_checkpoint(tmp_path / "m", "qwen3-8b")
    monkeypatch.setattr("edge.runtime.engine.probe_memory", lambda device: _small(11 * GiB))
    service = Service(Settings(model=str(model), device="cpu", dtype="bfloat16"), environ={})
    codes: list[int] = []
    service.request_exit = codes.append
    service._load()
    assert codes == [mp.EXIT_DOES_NOT_FIT] and service.exit_code == 78 and service.state == "failed"
    assert service.error.startswith("DoesNotFit: m bfloat16 needs")
    unit = (Path(__file__).resolve().parents[1] / "systemd" / "edge.service").read_text()
    assert "RestartPreventExitStatus=78" in unit


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_plans_kv_is_the_engines(tiny_untied, kv_dtype: str) -> None:
    engine = Engine.from_pretrained(tiny_untied, device="cpu", dtype="float32", kv_dtype=kv_dtype)
    plan = engine.memory_plan
    assert plan.kv_dtype == ("float32" if kv_dtype == "auto" else "int8")
    assert plan.block_bytes == engine.budget.block_bytes == engine.kv.pool.block_bytes()
