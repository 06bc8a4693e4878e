"""Files the model writers make: the mode a plain file gets (the umask honoured, never
safetensors' forced 0600), and progress bars on stderr, redrawn at most once a second."""

from __future__ import annotations

import importlib.util
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from edge.model.random_model import cached_model, make_model
from edge.model.writing import tensor_data_bytes
from edge.quant.int4_quantize import quantize_checkpoint_int4
from edge.quant.q8_0 import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [directory, *directory.iterdir()]}


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                            (0o002, 0o664, 0o775)])
def test_writers_give_the_plain_file_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mask: int,
                                          file_mode: int, dir_mode: int) -> None:
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path / "cache"))
    with umask(mask):
        src = make_model(tmp_path / "float", preset="tiny", num_hidden_layers=1, max_shard_bytes=400_000)
        quantize_checkpoint(src, tmp_path / "int8")
        quantize_checkpoint_int4(src, tmp_path / "int4", group_size=32)
        cached = cached_model("mode-test", preset="tiny", num_hidden_layers=1)
    for directory in (src, tmp_path / "int8", tmp_path / "int4", cached):
        found = modes(directory)
        assert any(name.endswith(".safetensors") for name in found), found
        want = {name: dir_mode if (directory / name).is_dir() or name == directory.name else file_mode
                for name in found}
        assert found == want, f"{directory}: {({k: oct(v) for k, v in found.items()})}"


def redraws(text: str) -> int:
    return text.count("\r")


def test_model_writing_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    make_model(tmp_path / "m", preset="tiny", num_hidden_layers=4, max_shard_bytes=100_000, progress=True)
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert out == ""
    assert "writing m" in err and "100%" in err, err
    # One redraw a second at most (plus the first and the last), whatever the tensor count.
    assert redraws(err) <= elapsed + 3, (redraws(err), elapsed)
    make_model(tmp_path / "quiet", preset="tiny", num_hidden_layers=1)
    assert capsys.readouterr() == ("", "")


def test_quantize_progress_counts_the_tensor_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_model(tmp_path / "float", preset="tiny", num_hidden_layers=1)
    capsys.readouterr()
    total = tensor_data_bytes(src / "model.safetensors")
    summary = quantize_checkpoint(src, tmp_path / "int8", progress=True)
    assert summary["bytes_in"] == total  # the bar's total is the bytes it counts: it ends at 100 %
    err = capsys.readouterr().err
    assert "q8_0: quantizing float" in err and "100%" in err, err
    quantize_checkpoint_int4(src, tmp_path / "int4", group_size=32, progress=True)
    err = capsys.readouterr().err
    assert "int4 rtn: quantizing float" in err and "100%" in err, err


def test_make_model_tool_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("make_model_tool", ROOT / "tools" / "make_model.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(tmp_path / "a"), "--num-layers", "1"]) == 0
    assert "writing a" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "b"), "--num-layers", "1", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
