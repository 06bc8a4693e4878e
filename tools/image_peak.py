#!/usr/bin/env python3
"""Peak RSS growth of one chat request with images, on the CPU: through the prompt worker's
path (``encode_request``: headers, decoding, resizing, the context check), the vision tower,
and the engine's prefill of the prompt with one token generated.

    python tools/image_peak.py --case 40mp [--max-pixels 1048576] [--model DIR]
    python tools/image_peak.py --case 4x10mp

Without ``--model`` a random qwen3-vl-tiny is written to a temporary directory, its image
processor allowing ``--max-pixels`` per image. The photos (smooth colour and noise, JPEG
quality 85) are made here. Prints one JSON line; a request refused with 400 reports its
message and the peak up to the refusal.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {"40mp": [(7744, 5164)], "4x10mp": [(3872, 2582)] * 4}


def photo(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    img = np.empty((height, width, 3), np.uint8)
    for c in range(3):
        f = 127 + 100 * np.sin(6.28 * (x * (c + 1) + y * (3 - c)) + seed)
        img[..., c] = np.clip(f + rng.normal(0, 4, (height, width)).astype(np.float32), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _body(images: list[bytes], text: str) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(i).decode()}}
             for i in images]
    return json.dumps({"model": "m", "max_tokens": 1,
                       "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}).encode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=sorted(CASES), default="40mp")
    p.add_argument("--model", help="a vision-language model directory (default: a random qwen3-vl-tiny)")
    p.add_argument("--max-pixels", type=int, default=1 << 20, help="the random model's image processor max_pixels")
    p.add_argument("--max-seq-len", type=int, default=4096)
    args = p.parse_args(argv)

    import gc

    import torch

    from edge.model.vision.random_model import make_vl_model
    from edge.model.vision.request import ImageLimits, ImagePolicy
    from edge.runtime.engine import Engine
    from edge.sampling import SamplingParams
    from edge.serving import schema
    from edge.serving.prompts import encode_request

    torch.set_num_threads(1)
    model = args.model
    if model is None:
        model = make_vl_model(Path(tempfile.mkdtemp(prefix="edge-vl-")) / "m", "qwen3-vl-tiny")
        pre = json.loads((model / "preprocessor_config.json").read_text())
        pre["size"] = {"shortest_edge": 65536, "longest_edge": args.max_pixels}
        (model / "preprocessor_config.json").write_text(json.dumps(pre))
    engine = Engine.from_pretrained(model, device="cpu", dtype="float32", max_seq_len=args.max_seq_len,
                                    kv_memory="64MiB")
    policy = ImagePolicy(ImageLimits(max_bytes=10 << 20, max_pixels=40_000_000), max_images=4)
    warm = encode_request(engine, schema.parse_request(_body([photo(64, 64, 0)], "hi"), schema.ChatCompletionRequest),
                          "chat", policy, {})
    engine.generate(warm, SamplingParams(max_tokens=1))
    req = schema.parse_request(_body([photo(w, h, i + 1) for i, (w, h) in enumerate(CASES[args.case])], "What is it?"),
                               schema.ChatCompletionRequest)
    gc.collect()
    base = _kib("VmRSS:")
    _reset_peak()
    t0 = time.perf_counter()
    out: dict = {"case": args.case, "max_pixels": args.max_pixels}
    try:
        prompt = encode_request(engine, req, "chat", policy, {})
        out["prompt_worker_mib"] = round((_kib("VmHWM:") - base) / 1024, 1)
        for i in range(len(prompt.images)):
            engine.vision.features(prompt, i)
        out["with_tower_mib"] = round((_kib("VmHWM:") - base) / 1024, 1)
        engine.generate(prompt, SamplingParams(max_tokens=1))
        out["outcome"] = f"200: {len(prompt.ids)} prompt tokens"
    except Exception as exc:  # a 400 (BadRequest / ImageError): its message
        out["outcome"] = f"400: {str(exc)[:200]}"
    out["end_to_end_mib"] = round((_kib("VmHWM:") - base) / 1024, 1)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
