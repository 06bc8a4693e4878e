"""`tools/bench.py vision` on the CPU (the tiny preset, its default there): the JSON report holds every
field the GPU run records, and the image token counts are the HF image processor's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image

from edge.model.vision.random_model import preprocessor_config

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(64, 48), (96, 64)]


def test_bench_vision_smoke() -> None:
    sizes = ",".join(f"{w}x{h}" for w, h in SIZES)
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench.py"), "vision", "--device", "cpu",  # the tiny preset by default
         "--dtype", "float32", "--sizes", sizes, "--decode-tokens", "8", "--repeats", "1", "--max-seq-len", "512"],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["preset"] == "qwen3-vl-tiny" and report["device"] == "cpu"
    processor = transformers.Qwen2VLImageProcessor(**preprocessor_config("qwen3-vl-tiny"))
    for (w, h), row in zip(SIZES, report["rows"], strict=True):
        assert row["image"] == f"{w}x{h}"
        image = Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert row["grid_thw"] == grid
        assert row["image_tokens"] == grid[0] * grid[1] * grid[2] // 4
        assert row["prompt_tokens"] > row["image_tokens"]
        for key in ("preprocess_ms", "tower_ms", "ttft_ms", "decode_tok_s", "text_only_decode_tok_s"):
            assert row[key] > 0, key
