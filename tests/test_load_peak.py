"""Peak memory while loading (issue #22): reading tensors in row chunks through short-lived
mappings keeps the resident high-water mark near the final weight bytes, for a bf16
checkpoint, the same quantized while loading, and a pre-quantized checkpoint.

The kernel's VmHWM of a fresh process is the oracle (tools/load_peak.py). The issue's bound
on a board is weights + 1.5 GiB; here the model is ~0.5 GB, so the bound is scaled to the
loader's own transients, which do not grow with the model: the read window (a chunk mapped
and its copy, 2 x READ_CHUNK_BYTES), for quantizing while loading the float32 temporaries of
one quantize chunk (the chunk, |w| and w / scale: 3 x 4 bytes x QUANTIZE_CHUNK_ELEMENTS),
plus 64 MiB of allocator slack. The checkpoint is one shard larger than every such bound, so
a loader that keeps a shard mapped (or reads whole files) fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge.model.loader import READ_CHUNK_BYTES
from edge.quant.q8_0 import QUANTIZE_CHUNK_ELEMENTS, quantize_checkpoint
from edge.model.random_model import make_model

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SLACK = 64 * MiB
READ_WINDOW = 2 * READ_CHUNK_BYTES
QUANTIZE_TEMPS = 3 * 4 * QUANTIZE_CHUNK_ELEMENTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("load-peak")
    # qwen3-0.6b layers, 8 of them, untied 64k-token embedding and lm_head: ~500 MB of bf16.
    bf16 = make_model(base / "bf16", preset="qwen3-0.6b", dtype="bfloat16", num_hidden_layers=8,
                      vocab_size=65536, tie_word_embeddings=False)
    q8 = Path(quantize_checkpoint(bf16, base / "q8")["dst"])
    return {"bf16": bf16, "q8": q8}


def load_peak(model_dir: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "load_peak.py"), str(model_dir), *args],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("case, extra", [
    ("bf16", READ_WINDOW + SLACK),
    ("bf16 quantized while loading", READ_WINDOW + QUANTIZE_TEMPS + SLACK),
    ("pre-quantized", READ_WINDOW + SLACK),
])
def test_load_peak_is_weights_plus_a_constant(checkpoints: dict[str, Path], case: str, extra: int) -> None:
    model_dir = checkpoints["q8" if case == "pre-quantized" else "bf16"]
    shard = (model_dir / "model.safetensors").stat().st_size
    r = load_peak(model_dir, *(["--quantize", "int8"] if "while" in case else []))
    assert shard > extra, "the checkpoint must be larger than the bound's slack to catch a mapped shard"
    assert r["within_bound"]  # weights + 1.5 GiB, the figure on a board
    assert r["peak"] <= r["weights"] + extra, (
        f"{case}: peak {r['peak'] / MiB:.0f} MiB = weights {r['weights'] / MiB:.0f} MiB "
        f"+ {r['over_weights'] / MiB:.0f} MiB, allowed + {extra / MiB:.0f} MiB"
    )
