"""tools/orin_table.py (docs/orin.md): its weight and per-token byte counts are the engine's,
and its budgets follow the unified-memory policy on every board."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from edge.runtime.budget import DEFAULT_RESERVE
from edge.model.config import ModelConfig
from edge.runtime.engine import Engine
from edge.model.random_model import make_model

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():  # noqa: ANN201
    return load_tool("orin_table")


@pytest.mark.parametrize("tied", [True, False])
def test_byte_counts_are_the_engines(tool, tmp_path: Path, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # bench_decode imports its sibling tools
    bench = load_tool("bench_decode")
    path = make_model(tmp_path / "m", preset="tiny", num_hidden_layers=2, tie_word_embeddings=tied)
    cfg = ModelConfig.from_pretrained(path)
    for fmt, quantize in (("bf16", None), ("int8", "int8"), ("int4", "int4")):
        rows = "int8" if fmt == "int4" else "auto"  # the tables count int4 with int8 lm_head / embedding rows
        e = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=256, quantize=quantize,
                                   kv_blocks=16, quant_lm_head=rows, quant_embedding=rows)
        assert tool.weight_bytes(cfg, fmt) == e.model.weight_bytes(), fmt
        expect = bench.weight_bytes_per_token(e) + bench.kv_bytes(e, 200)
        assert tool.decode_bytes_per_token(cfg, fmt, 200) == expect, fmt


def test_board_budgets_follow_the_policy(tool) -> None:  # noqa: ANN001
    for board in tool.BOARDS:
        for preset in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"):
            cfg = tool.preset_config(preset)
            for fmt in tool.FORMATS:
                available, b = tool.board_budget(board, cfg, fmt, 4096)
                if isinstance(b, str):
                    assert board.name != "AGX Orin 64 GB", (preset, fmt, b)
                    continue
                assert available - b.kv_bytes - b.activations - b.graphs >= DEFAULT_RESERVE
                assert b.full_sequences <= 4
                if board.name == "AGX Orin 64 GB":
                    assert b.capped  # far from the whole board, as on the H200 before the cap
    nano = tool.BOARDS[2]
    assert tool.board_budget(nano, tool.preset_config("qwen3-8b"), "int8", 4096)[1] == "weights do not fit"


def test_tables_and_projection(tool, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    assert tool.main(["--fraction", "AGX Orin 64 GB=0.5"]) == 0
    out = capsys.readouterr().out
    assert "pending #24" not in out
    assert out.count("| qwen3-8b | int4 | 4.6 |") == 3  # every board: 4.92 GB of int4 weights
    agx = [line for line in out.splitlines() if line.startswith("| AGX Orin 64 GB | 16 | 204.8 | qwen3-8b | int8 |")]
    cells = [c.strip() for c in agx[0].strip("|").split("|")]
    assert float(cells[-1]) == pytest.approx(0.5 * float(cells[6]), abs=0.51)
    assert "pending (8 SMs)" in out
    # Per SM count and format: both 8-SM boards take the 8-SM int8 figure, nothing else.
    assert tool.main(["--fraction", "8:int8=0.25"]) == 0
    out = capsys.readouterr().out
    for board in ("Orin NX 16 GB", "Orin Nano 8 GB"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {board} | 8 |") and "| qwen3-1.7b | int8 |" in line)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-2] == "0.25" and float(cells[-1]) == pytest.approx(0.25 * float(cells[6]), abs=0.51)
    assert "| AGX Orin 64 GB | 16 | 204.8 | qwen3-1.7b | int8 | 2546 | 80.5 | pending (16 SMs) |" in out
    for bad in ("Xavier=0.5", "16:fp8=0.5"):
        with pytest.raises(SystemExit):
            tool.main(["--fraction", bad])


def test_int8_kv_holds_about_twice_the_contexts_where_memory_bounds_them(tool) -> None:  # noqa: ANN001
    nano = tool.BOARDS[2]
    cfg = tool.preset_config("qwen3-1.7b")
    _, bf16 = tool.board_budget(nano, cfg, "bf16", 4096)
    _, int8 = tool.board_budget(nano, cfg, "bf16", 4096, "int8")
    assert not bf16.capped and int8.kv_bytes <= bf16.kv_bytes
    assert int8.full_sequences == pytest.approx(bf16.full_sequences * 2 * 128 / 132, rel=0.02)
    assert tool.decode_bytes_per_token(cfg, "bf16", 4096) - tool.decode_bytes_per_token(cfg, "bf16", 4096, "int8") == (
        2 * cfg.num_layers * 4096 * cfg.num_kv_heads * (2 * 128 - 132))
