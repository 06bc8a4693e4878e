"""tools/bench.py on a machine without a GPU: GPU modes stop in one line naming the CPU
run, and a random preset too large for the host's memory is refused (or warned about)
before anything is built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
@pytest.mark.parametrize("mode", ["decode", "kernels", "scheduler", "speculative", "vision"])
def test_gpu_modes_without_a_gpu_are_one_line(tools: None, mode: str) -> None:
    import bench

    with pytest.raises(SystemExit) as info:
        bench.main([mode])
    message = str(info.value.code)
    assert message.startswith(f"bench.py {mode}: torch sees no CUDA GPU") and "\n" not in message
    assert "--device cpu" in message


def test_gpu_mode_exits_nonzero_without_traceback() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the message a machine without a GPU gets")
    r = subprocess.run([sys.executable, "tools/bench.py", "decode"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr


def test_preset_larger_than_host_memory_is_refused(tools: None, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import bench_decode

    from edge.model.random_model import model_config

    gib = 2**30
    monkeypatch.setattr("edge.runtime.budget.host_memory", lambda: (24 * gib, 20 * gib, "test"))
    with pytest.raises(SystemExit) as info:  # ~8.2 G parameters in float32
        bench_decode.check_host_memory(model_config(preset="qwen3-8b"), torch.float32, "qwen3-8b")
    message = str(info.value.code)
    assert "qwen3-8b preset's weights take" in message and "--preset" in message and "\n" not in message
    # bf16 halves it: over half the memory available, a warning only.
    bench_decode.check_host_memory(model_config(preset="qwen3-8b"), torch.bfloat16, "qwen3-8b")
    assert "warning: the qwen3-8b preset's weights take" in capsys.readouterr().err
    bench_decode.check_host_memory(model_config(preset="tiny"), torch.float32, "tiny")
    assert capsys.readouterr().err == ""
