"""Contiguous vs paged verification: same prompts, greedy, diffed token by token.

Every mode shares one set of weights and runs on its own engine with its own backend;
the baseline is the contiguous cache on the torch reference backend. On a GPU one mode
is the production decode step as it ships: paged KV, CUDA graphs, the fused layer
kernels and, with ``--quantize int8`` / ``int4``, the int8 / int4 GEMV plan. A divergence is accepted
only at a genuine near-tie: where the baseline's top-2 logit gap is below
``--tie-tolerance``. Exit code 0 only when every mode agrees. With ``--kv-dtype int8``
every engine, the baseline included, holds its K/V in int8 (edge/kernels/kv_int8.py):
the paths must agree with each other; the drift against float K/V is
tools/kv_drift.py's to report.

On a GPU the default model is the ``qwen3-peaked`` preset (built once into the cache):
its logits are peaked, so bfloat16 runs compare hundreds of tokens per case instead of
stopping at the first near-tie of flat random logits. Without ``--model`` a
vision-language model runs the suite too, with cases whose prompt holds an image: the
``qwen3-vl-peaked`` preset on a GPU (qwen3-peaked's decoder behind Qwen3-VL-8B's tower),
``qwen3-vl-tiny`` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edge.runtime.budget import KV_DTYPES
from edge.runtime.engine import Engine, default_device
from edge.quant.int4 import Int4Weight
from edge.runtime.kv_paged import PagedKVCache
from edge.runtime.verify_args import DESCRIPTION, add_verify_args
from edge.sampling import SamplerState, SamplingParams

if TYPE_CHECKING:
    from edge.model.vision.runtime import MultimodalPrompt

# The cases the vision-language model runs beside the text model (a text-only prompt included).
VISION_CASES = ("shorter-than-page", "image", "image-multi-turn")
DEFAULT_TIE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class Case:
    name: str
    turns: list[tuple[list[int], int]]  # (new prompt tokens, tokens to generate) per turn
    image: MultimodalPrompt | None = None  # a prompt with images, before the turns (VL models)


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 [vocab] per generated token


@dataclass
class Row:
    model: str
    mode: str
    backend: str
    case: str
    compared: int
    mismatch_at: int | None = None
    tokens: tuple[int, int] | None = None
    baseline_gap: float | None = None
    accepted_tie: bool = False
    max_abs_dlogit: float = 0.0
    table_bytes: int = 0
    blocks_allocated: int = 0
    blocks_freed: int = 0

    @property
    def ok(self) -> bool:
        return (self.mismatch_at is None or self.accepted_tie) and self.blocks_allocated == self.blocks_freed


def prompt_suite(engine: Engine, page: int, min_tokens: int = 24) -> list[Case]:
    """Prompts shorter than a page, exactly a page, several pages, long decodes, turns;
    each case generates at least ``min_tokens`` tokens."""
    text = (
        "Paged attention keeps the cache in fixed blocks. The robot answers questions at the kiosk, "
        "and every answer streams token by token to the speaker while the next question waits. "
    ) * 40
    ids = engine.encode(text) if engine.tokenizer is not None else list(range(3, 3 + 40 * 30))
    ids = [t % engine.cfg.vocab_size for t in ids]

    def take(n: int, offset: int = 0) -> list[int]:
        return ids[offset : offset + n]

    n = max(24, min_tokens)
    per_turn = max(20, -(-min_tokens // 3))
    cases = [
        Case("shorter-than-page", [(take(max(1, page // 2 - 1)), n)]),
        Case("exactly-one-page", [(take(page), n)]),
        Case("several-pages", [(take(3 * page + 5, 7), n)]),
        Case("long-decode", [(take(5, 11), max(n, 6 * page + 3))]),
        Case("multi-turn", [(take(page + 3, 13), per_turn), (take(7, 200), per_turn), (take(2 * page, 300), per_turn)]),
    ]
    if engine.vision is not None and engine.tokenizer is not None:
        # Multimodal RoPE in prefill, position + delta in decode, image tokens across pages.
        image = engine.chat_prompt([{"role": "user", "content": [
            {"type": "image", "image": test_image(320, 240)}, {"type": "text", "text": "What does the kiosk camera see?"}
        ]}])
        cases.append(Case("image", [([], max(n, 3 * page + 3))], image=image))
        cases.append(Case("image-multi-turn", [([], per_turn), (take(page + 1, 40), per_turn)], image=image))
    return cases


def test_image(width: int, height: int):  # noqa: ANN201 - PIL stays out of text-only imports
    """A deterministic picture: colour gradients with a bright square."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    rgb[height // 4 : height // 2, width // 4 : width // 2] = 255
    return Image.fromarray(rgb.astype(np.uint8))


def run_case(engine: Engine, case: Case) -> Trace:
    """Greedy generation of every turn; each turn resends the whole conversation on a
    fresh sequence, so blocks freed by one turn are reused (stale) by the next."""
    trace = Trace()
    mm = case.image
    history: list[int] = [] if mm is None else list(mm.ids)
    delta = 0 if mm is None else mm.rope_delta
    for new_ids, n in case.turns:
        history = history + new_ids
        seq = engine.new_sequence(slot=0)
        try:
            if mm is None:
                logits = engine.prefill(seq, history)
            else:
                logits = engine.prefill(seq, list(mm.ids), mm=mm)
                if len(history) > seq.length:  # text after the image prompt: positions + delta
                    logits = engine.forward(seq, history[seq.length :], rope_delta=delta)
            if engine.cuda_graph:
                history += _graph_tokens(engine, seq, logits, n, trace, delta)
                continue
            for _ in range(n):
                tok = int(torch.argmax(logits))
                trace.tokens.append(tok)
                trace.logits.append(logits.float().cpu())
                history.append(tok)
                logits = engine.forward(seq, [tok], rope_delta=delta)
        finally:
            engine.end_sequence(seq)
    return trace


def _graph_tokens(engine: Engine, seq, logits: torch.Tensor, n: int, trace: Trace, delta: int = 0) -> list[int]:  # noqa: ANN001
    """Greedy tokens from the captured decode graph (it yields tokens, not logits)."""
    sampler = SamplerState(engine.cfg.vocab_size, engine.device)
    sampler.load(SamplingParams(), [])
    first = torch.argmax(logits).view(1)
    out = [int(first)]
    decoder = engine.slot_decoder(seq)
    decoder.bind(seq, sampler, first, delta)
    while len(out) < n:
        out.append(decoder.read(decoder.launch(seq, True)))
    trace.tokens += out
    return out


def compare(model: str, mode: str, backend: str, case: Case, base: Trace, other: Trace, tie_tol: float) -> Row:
    row = Row(model, mode, backend, case.name, compared=0)
    for i, (a, b) in enumerate(zip(base.tokens, other.tokens)):
        row.compared += 1
        if other.logits:  # graph decode reports tokens only
            row.max_abs_dlogit = max(row.max_abs_dlogit, (base.logits[i] - other.logits[i]).abs().max().item())
        if a != b:
            top2 = torch.topk(base.logits[i], 2).values
            row.mismatch_at, row.tokens = i, (a, b)
            row.baseline_gap = (top2[0] - top2[1]).item()
            row.accepted_tie = row.baseline_gap < tie_tol
            break
    return row


def modes(base: Engine, device: torch.device) -> dict[str, Engine]:
    """The paged variants to check against the contiguous baseline, each on its own
    engine (and so its own backend)."""
    out: dict[str, Engine] = {}
    # Each mode gets a pool for two full sequences, not the memory budget's default
    # (90 % of what is free): several engines share one GPU here.
    blocks = 2 * -(-base.max_seq_len // base.page_size)

    def paged(name: str, **kw) -> None:
        out[name] = Engine(
            base.model, base.tokenizer, base.model_dir, kv_cache="paged", num_blocks=blocks,
            page_size=base.page_size, max_seq_len=base.max_seq_len, vision=base.vision, kv_dtype=base.kv_dtype, **kw,
        )

    paged("paged-reference", kernels="reference", cuda_graph=False)
    paged("paged-ref+nan-poison", kernels="reference", poison_kv=True, cuda_graph=False)
    if device.type == "cuda":
        paged("paged-cuda-eager", cuda_graph=False)
        paged("paged-cuda+nan-poison", poison_kv=True, cuda_graph=False)
        paged("production", cuda_graph=True)  # graph + fused kernels (+ int8 GEMV): as served
        paged("production+nan-poison", cuda_graph=True, poison_kv=True)
    return out


def backend_label(engine: Engine) -> str:
    """One line naming what a mode runs: kernels, graphs, the linears per format."""
    b = engine.backend
    parts = [b.kind, "graph" if engine.cuda_graph else "eager"]
    if engine.cuda_graph and b.overlap_launches:
        parts.append("overlapped")
    if engine.model.int8_projections:  # quantized projections: int8 or int4
        fmt = "int4" if isinstance(engine.model.layers[0]["qkv"], Int4Weight) else "int8"
        parts.append(f"{fmt} " + ("GEMV" if b.kind == "cuda" else "ref"))
    return " ".join(parts)


def print_table(rows: list[Row], tie_tol: float) -> None:
    head = (
        f"{'model':<24} {'mode':<22} {'backend':<28} {'case':<18} {'tokens':>6} {'first mismatch':<28} {'max|dlogit|':>11} "
        f"{'table B':>8} {'alloc/freed':>11}  ok"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.mismatch_at is None:
            mm = "-"
        else:
            tie = " (near-tie)" if r.accepted_tie else ""
            mm = f"@{r.mismatch_at} {r.tokens[0]}!={r.tokens[1]} gap {r.baseline_gap:.2g}{tie}"
        print(
            f"{r.model:<24} {r.mode:<22} {r.backend:<28} {r.case:<18} {r.compared:>6} {mm:<28} {r.max_abs_dlogit:>11.3g} "
            f"{r.table_bytes:>8} {r.blocks_allocated:>5}/{r.blocks_freed:<5}  {'yes' if r.ok else 'NO'}"
        )
    print(f"divergences accepted only where the baseline top-2 logit gap < {tie_tol:g}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verify_paged", description=DESCRIPTION)
    add_verify_args(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The suite for parsed :func:`add_verify_args` options; 0 when every mode agrees."""
    device = torch.device(args.device) if args.device else default_device()
    models = [args.model] if args.model is not None else [default_model(device, args.dtype)]
    if args.model is None and (args.vision_model or "").lower() != "none":
        models.append(vision_model(args.vision_model, device, args.dtype))
    min_tokens = args.min_tokens if args.min_tokens is not None else (200 if device.type == "cuda" else 24)
    rows: list[Row] = []
    backends: dict[str, dict] = {}
    headers: list[str] = []
    tie_tol, dtype = 0.0, ""
    for i, model in enumerate(models):
        base = Engine.from_pretrained(
            model,
            device=device,
            dtype=args.dtype,
            kv_cache="contiguous",
            page_size=args.page_size,
            max_seq_len=args.max_seq_len,
            cuda_graph=False,
            kernels="reference",
            quantize=None if args.quantize == "none" else args.quantize,
            kv_dtype=args.kv_dtype,
        )
        tie_tol = args.tie_tolerance if args.tie_tolerance is not None else DEFAULT_TIE_TOLERANCE[base.dtype]
        label, dtype = base.model_dir.name, str(base.dtype)
        headers.append(
            f"model {base.model_dir} ({base.cfg.architecture}{', images' if base.vision else ''}), {device}, "
            f"{str(base.dtype).removeprefix('torch.')}, page {args.page_size}, quantize {args.quantize}, "
            f"kv {args.kv_dtype}; "
            "baseline: contiguous KV, reference backend"
        )
        engines = modes(base, device)
        only = VISION_CASES if i > 0 else None  # the text model already ran the text cases
        rows += verify_engines(label, base, engines, args.page_size, min_tokens, tie_tol, only)
        backends[label] = {name: e.backend.describe() for name, e in engines.items()}
        del base, engines
    ok = all(r.ok for r in rows)
    if args.json:
        print(json.dumps({"ok": ok, "tie_tolerance": tie_tol, "dtype": dtype, "backends": backends,
                          "rows": [asdict(r) for r in rows]}))
    else:
        for header in headers:
            print(header)
        print_table(rows, tie_tol)
        print("ALL MODES AGREE" if ok else "MISMATCH")
    return 0 if ok else 1


def default_model(device: torch.device, dtype: str | None) -> str | Path | None:
    """The text model without ``--model``: the embedded one (None) on the CPU,
    qwen3-peaked on a GPU."""
    if device.type != "cuda":
        return None
    from edge.model.random_model import preset_model_path

    return preset_model_path("qwen3-peaked", dtype=dtype or "bfloat16")


def vision_model(choice: str | None, device: torch.device, dtype: str | None) -> str | Path:
    """``--vision-model``: a directory, a VL preset (built once into the cache), or the
    default preset for the device."""
    from edge.model.vision.random_model import VL_PRESETS, vl_preset_model_path

    if choice is not None and choice not in VL_PRESETS:
        return choice
    if device.type == "cuda":
        return vl_preset_model_path(choice or "qwen3-vl-peaked", dtype=dtype or "bfloat16")
    return vl_preset_model_path(choice or "qwen3-vl-tiny", dtype=dtype or "float32")


def verify_engines(
    model: str,
    base: Engine,
    engines: dict[str, Engine],
    page: int,
    min_tokens: int,
    tie_tol: float,
    only: tuple[str, ...] | None = None,
) -> list[Row]:
    """Every case (or those named in ``only``) on the baseline, then on each mode's
    engine, diffed."""
    cases = [c for c in prompt_suite(base, page, min_tokens) if only is None or c.name in only]
    baseline = {c.name: run_case(base, c) for c in cases}
    rows: list[Row] = []
    for name, engine in engines.items():
        kv: PagedKVCache = engine.kv
        label = backend_label(engine)
        for c in cases:
            before = (kv.pool.allocations, kv.pool.frees, _table_bytes(engine))
            trace = run_case(engine, c)
            row = compare(model, name, label, c, baseline[c.name], trace, tie_tol)
            row.blocks_allocated = kv.pool.allocations - before[0]
            row.blocks_freed = kv.pool.frees - before[1]
            row.table_bytes = _table_bytes(engine) - before[2]
            rows.append(row)
    return rows


def _table_bytes(engine: Engine) -> int:
    return engine.kv.bytes_synced if engine.kv is not None else 0


if __name__ == "__main__":
    sys.exit(main())
