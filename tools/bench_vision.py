"""Vision-language benchmark (the ``vision`` mode of tools/bench.py).

A random model of a VL preset's shapes (default qwen3-vl-8b), built on the GPU: for each
image size, the preprocessing time (CPU), the vision tower's time, TTFT of a one-image
chat prompt (preprocessing, tower, prefill, first token) and decode tok/s after it (CUDA
graph, RoPE at position + delta); and decode tok/s after a text-only prompt of the same
length, which it should equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from edge.model.config import parse_dtype
from edge.runtime.engine import Engine
from edge.model.loader import fuse_weights
from edge.model.decoder import Model
from edge.model.random_model import random_tensor, tokenizer_config, tokenizer_json
from edge.sampling import SamplingParams
from edge.model.tokenizer import Tokenizer
from edge.model.vision.config import VLConfig
from edge.model.vision.preprocess import ProcessorConfig, preprocess
from edge.model.vision.random_model import (
    VL_PRESETS,
    VL_SPECIAL_TOKENS,
    preprocessor_config,
    vl_model_config,
    vl_state_dict_shapes,
)
from edge.model.vision.runtime import VisionLanguage
from edge.model.vision.tower import VisionTower


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, choices=sorted(VL_PRESETS),
                   help="default: qwen3-vl-8b on a GPU, qwen3-vl-tiny on the CPU")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of the tiny presets)")
    p.add_argument("--sizes", default="448x448,1280x720", help="image sizes WxH")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)


def build_engine(args: argparse.Namespace) -> Engine:
    """The preset's random weights straight on the GPU (nothing written to disk)."""
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    raw = vl_model_config(args.preset)
    cfg = VLConfig.from_dict(raw)
    shapes = vl_state_dict_shapes(raw)
    text = (
        (n.replace("model.language_model.", "model.", 1), random_tensor(n, s, 0, dtype, device))
        for n, s in shapes.items()
        if not n.startswith("model.visual.")
    )
    model = Model(cfg.text, fuse_weights(text, cfg.text, device, dtype), args.max_seq_len)
    tower_weights = {
        n.removeprefix("model.visual."): random_tensor(n, s, 0, dtype, device)
        for n, s in shapes.items()
        if n.startswith("model.visual.")
    }
    processor = ProcessorConfig.from_dict(preprocessor_config(args.preset))
    vision = VisionLanguage(
        cfg, VisionTower(cfg.vision, tower_weights), processor, model.w["model.embed_tokens.weight"], args.max_seq_len
    )
    from tokenizers import Tokenizer as HFTokenizer

    template = VL_PRESETS[args.preset]["template"]
    tokenizer = Tokenizer(
        HFTokenizer.from_str(tokenizer_json(VL_SPECIAL_TOKENS)),
        tokenizer_config(args.max_seq_len, template, VL_SPECIAL_TOKENS),
    )
    blocks = 2 * (-(-args.max_seq_len // args.page_size)) + 8
    return Engine(
        model, tokenizer, Path(f"preset:{args.preset}"), page_size=args.page_size, max_seq_len=args.max_seq_len,
        num_blocks=blocks, vision=vision,
    )


def picture(width: int, height: int) -> Image.Image:

    rng = np.random.default_rng(width * height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t) * 1e3


def run(args: argparse.Namespace) -> dict:
    if args.preset is None:  # an 8B-shaped model in float32 fills most of a small machine's memory
        args.preset = "qwen3-vl-tiny" if torch.device(args.device).type == "cpu" else "qwen3-vl-8b"
    engine = build_engine(args)
    vision = engine.vision
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    rows = []
    for size in args.sizes.split(","):
        w, h = (int(x) for x in size.lower().split("x"))
        image = picture(w, h)
        pre, tower, ttft, decode = [], [], [], []
        for _ in range(args.repeats + 1):  # the first round warms up
            t = time.perf_counter()
            prepared = preprocess(image, vision.processor)
            pre.append((time.perf_counter() - t) * 1e3)
            tower.append(_ms(lambda p=prepared: vision.tower(p.pixels, [p.grid])))
            messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}]
            _sync()
            t = time.perf_counter()
            prompt = engine.chat_prompt(messages)  # decoding, preprocessing and the template count towards TTFT
            build_ms = (time.perf_counter() - t) * 1e3
            result = engine.generate(prompt, params)
            ttft.append(build_ms + (result.usage.ttft_ms or 0.0))
            decode.append(result.usage.decode_tok_s or 0.0)
        n_text = len(prompt.ids)
        text_ids = [t % 800 + 3 for t in range(n_text)]  # a text prompt of the same length
        text_decode = [engine.generate(text_ids, params).usage.decode_tok_s or 0.0 for _ in range(args.repeats)]
        rows.append({
            "image": f"{w}x{h}",
            "grid_thw": list(prepared.grid),
            "image_tokens": prepared.num_tokens,
            "prompt_tokens": n_text,
            "preprocess_ms": statistics.median(pre[1:]),
            "tower_ms": statistics.median(tower[1:]),
            "ttft_ms": statistics.median(ttft[1:]),
            "decode_tok_s": statistics.median(decode[1:]),
            "text_only_decode_tok_s": statistics.median(text_decode),
        })
    return {
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "preset": args.preset,
        "dtype": args.dtype,
        "cuda_graph": engine.cuda_graph,
        "decode_tokens": args.decode_tokens,
        "rows": rows,
    }
