"""The tables of docs/orin.md: which presets fit each Orin board in which format, with the
engine's default KV budget (edge/runtime/budget.py), and the decode roofline at the board's bandwidth.

    python tools/orin_table.py [--max-seq-len 4096] [--fraction 16:int4=0.23 ...] [--fraction 'AGX Orin 64 GB=0.8']
                               [--kv-dtype int8]

The budget table gives the contexts the default pool holds with K/V in bf16 and in int8
(codes and a float32 scale a row: the same memory, about twice the tokens); the
projection reads K/V of ``--kv-dtype``.

Nothing is measured here: a board's memory after loading is MemTotal less what the OS and
the engine's CUDA context take (the assumptions below); the activations are the engine's
shape estimate for one prefill chunk attending to itself (the CUDA attention kernels
stream the context's K/V instead of materializing scores over it; on a GPU the engine
measures them); a projected tok/s needs the fraction of the roofline measured at the
board's SM count (``--fraction``), else the column says so.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge.runtime.budget import (  # noqa: E402
    GRAPH_OVERHEAD,
    GRAPH_SLOTS,
    BudgetError,
    MemoryBudget,
    MemoryInfo,
    default_budget,
    estimate_activation_bytes,
    kv_block_bytes,
    kv_row_bytes,
)
from edge.model.config import ModelConfig  # noqa: E402
from edge.runtime.memory_plan import Checkpoint, held_form, weight_parts  # noqa: E402
from edge.quant.q8_0 import DEFAULT_GROUP_SIZE  # noqa: E402
from edge.model.random_model import model_config  # noqa: E402

GiB = 1 << 30
EMBED = "model.embed_tokens.weight"
PAGE_SIZE = 16
PREFILL_CHUNK = 512
FORMATS = ("bf16", "int8", "int4")
# The presets with the shapes of published checkpoints (edge/model/random_model.py).
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "llama-3.2-1b")


@dataclass(frozen=True)
class Board:
    name: str
    mem_total: int  # MemTotal as L4T r36 reports it (the carve-outs are not in it), approximate
    sms: int
    bandwidth: float  # bytes/s, NVIDIA's figure for the module


# OS (headless L4T, jtop.service) and the engine process's torch + CUDA context before the
# weights: assumptions until measured on a board.
OS_USED = GiB
CUDA_CONTEXT = int(0.8 * GiB)

BOARDS = (
    Board("AGX Orin 64 GB", int(61.4 * GiB), 16, 204.8e9),
    Board("Orin NX 16 GB", int(15.3 * GiB), 8, 102.4e9),
    Board("Orin Nano 8 GB", int(7.4 * GiB), 8, 68e9),
)


def preset_config(preset: str) -> ModelConfig:
    return ModelConfig.from_dict(model_config(preset=preset))


def weight_bytes(cfg: ModelConfig, fmt: str, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """What the loaded model holds (``Model.weight_bytes``, from edge/runtime/memory_plan.py):
    bf16 tensors; for int8 the projections (and an untied lm_head) as int8 with one float32
    scale per group; for int4 the projections as 4-bit codes with a float16 scale and a
    uint8 zero point per group, and the lm_head and the embedding as int8 rows (as these
    tables have always counted int4; `edge plan` gives the as-published default)."""
    ckpt = Checkpoint("preset", cfg)
    quantize = {"bf16": None, "int8": "int8", "int4": "int4"}[fmt]
    rows = "int8" if fmt == "int4" else "auto"
    return sum(weight_parts(ckpt, held_form(ckpt, "bfloat16", quantize, rows, rows, group_size)).values())


def embedding_row_bytes(cfg: ModelConfig, fmt: str, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes of one embedding row as loaded (int4 models hold int8 rows)."""
    h = cfg.hidden_size
    return h + 4 * (h // group_size) if fmt == "int4" else 2 * h


def decode_bytes_per_token(cfg: ModelConfig, fmt: str, context: int, kv_dtype: str = "auto") -> int:
    """Bytes one decode step reads (as tools/bench_decode.py counts them): every weight but
    the embedding table, of which one row (a tied table is read whole as lm_head), and the
    K/V of ``context`` tokens (bf16, or int8 rows with ``kv_dtype="int8"``)."""
    total = weight_bytes(cfg, fmt)
    if not cfg.tie_word_embeddings:
        total -= (cfg.vocab_size - 1) * embedding_row_bytes(cfg, fmt)
    return total + 2 * cfg.num_layers * context * cfg.num_kv_heads * kv_row_bytes(cfg.head_dim, torch.bfloat16, kv_dtype)


def activations_and_graphs(cfg: ModelConfig) -> tuple[int, int]:
    """Estimated (activations, graph buffers) on the GPU: one chunk, one decode step."""
    activations = estimate_activation_bytes(cfg, PREFILL_CHUNK, PREFILL_CHUNK, torch.bfloat16)
    return activations, GRAPH_SLOTS * estimate_activation_bytes(cfg, 1, 1, torch.bfloat16) + GRAPH_OVERHEAD


def board_budget(
    board: Board, cfg: ModelConfig, fmt: str, max_seq_len: int, kv_dtype: str = "auto"
) -> tuple[int, MemoryBudget | str]:
    """(available after loading, the default budget of a ``kv_dtype`` pool or why none fits)."""
    weights = weight_bytes(cfg, fmt)
    available = board.mem_total - OS_USED - CUDA_CONTEXT - weights
    if available <= 0:
        return available, "weights do not fit"
    activations, graphs = activations_and_graphs(cfg)
    memory = MemoryInfo("integrated", board.mem_total, available, "projected")
    try:
        return available, default_budget(
            memory, block_bytes=kv_block_bytes(cfg, PAGE_SIZE, torch.bfloat16, kv_dtype), page_size=PAGE_SIZE,
            max_seq_len=max_seq_len, weights=weights, activations=activations, graphs=graphs)
    except BudgetError:
        return available, "no room for one context"


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def budget_table(max_seq_len: int) -> str:
    rows = [
        f"| board | preset | format | weights GiB | available after loading GiB | activations + graphs GiB "
        f"| default KV GiB | contexts of {max_seq_len} | bound by | contexts with int8 KV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for board in BOARDS:
        for preset in MODELS:
            cfg = preset_config(preset)
            for fmt in FORMATS:
                available, b = board_budget(board, cfg, fmt, max_seq_len)
                head = f"| {board.name} | {preset} | {fmt} | {gib(weight_bytes(cfg, fmt))} | "
                b8 = board_budget(board, cfg, fmt, max_seq_len, "int8")[1]
                int8_contexts = "0" if isinstance(b8, str) else f"{b8.full_sequences:.1f}"
                if isinstance(b, str):
                    rows.append(head + f"{gib(max(available, 0))} | — | — | 0 | {b} | {int8_contexts} |")
                    continue
                # Which limit sized the pool: the cap, the reserve, or the utilization.
                by = ("cap (4 contexts)" if b.capped else
                      "reserve" if b.available - b.reserve < b.available * b.utilization else "utilization")
                rows.append(head + f"{gib(b.available)} | {gib(b.activations + b.graphs)} | {gib(b.kv_bytes)} "
                            f"| {b.full_sequences:.1f} | {by} | {int8_contexts} |")
    return "\n".join(rows)


def projection_table(context: int, fractions: dict[tuple[str | int, str | None], float], kv_dtype: str = "auto") -> str:
    """``fractions``: keyed by (SM count, format) as measured, or (board name, None) for
    every format of one board; K/V read as ``kv_dtype``."""
    rows = [
        f"| board | SMs | GB/s | preset | format | MB read per token at context {context} | roofline tok/s "
        "| roofline fraction at the board's SMs | projected tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for board in BOARDS:
        for preset in MODELS:
            cfg = preset_config(preset)
            for fmt in FORMATS:
                if isinstance(board_budget(board, cfg, fmt, context, kv_dtype)[1], str):
                    continue
                per_token = decode_bytes_per_token(cfg, fmt, context, kv_dtype)
                roof = board.bandwidth / per_token
                f = fractions.get((board.sms, fmt), fractions.get((board.name, None)))
                proj = f"{f * roof:.0f}" if f is not None else "pending GPU run"
                frac = f"{f:.2f}" if f is not None else f"pending ({board.sms} SMs)"
                rows.append(f"| {board.name} | {board.sms} | {board.bandwidth / 1e9:g} | {preset} | {fmt} | "
                            f"{per_token / 1e6:.0f} | {roof:.1f} | {frac} | {proj} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--fraction", action="append", default=[], metavar="SMS:FORMAT=F | BOARD=F",
                   help="measured roofline fraction at an SM count for one format (e.g. 16:int4=0.23), or "
                   "for every format of one board (e.g. 'AGX Orin 64 GB=0.8')")
    p.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto",
                   help="K/V the projection reads: bf16 (auto) or int8 rows")
    args = p.parse_args(argv)
    fractions: dict[tuple[str | int, str | None], float] = {}
    for item in args.fraction:
        name, _, value = item.rpartition("=")
        sms, colon, fmt = name.partition(":")
        if colon and sms.isdigit() and fmt in FORMATS:
            fractions[(int(sms), fmt)] = float(value)
        elif name in {b.name for b in BOARDS}:
            fractions[(name, None)] = float(value)
        else:
            p.error(f"--fraction: {name!r} is neither SMS:FORMAT (formats {', '.join(FORMATS)}) nor a board "
                    f"({', '.join(b.name for b in BOARDS)})")
    print(budget_table(args.max_seq_len))
    print()
    print(projection_table(args.max_seq_len, fractions, args.kv_dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
