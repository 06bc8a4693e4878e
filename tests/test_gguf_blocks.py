"""GGUF block formats: edge's torch dequantization against gguf-py's own (gguf.quants),
bit for bit, on random blocks of every type edge reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf_support import random_rows

from edge.quant.gguf import (
    BLOCK_TYPES,
    GGUFEmbedding,
    GGUFPart,
    GGUFWeight,
    dequantize_rows,
    gguf_linear_reference,
)
from edge.quant.q8_0 import QuantError


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_block_sizes_match_gguf_py(qtype: int) -> None:
    t = BLOCK_TYPES[qtype]
    assert GGMLQuantizationType(qtype).name == t.name
    assert GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] == (t.block_size, t.type_size)


@pytest.mark.parametrize("name", [t.name for t in BLOCK_TYPES.values()])
def test_dequantize_bit_exact_with_gguf_py(name: str) -> None:
    rows, cols = 7, 512
    raw = random_rows(name, rows, cols, seed=hash(name) % 1000)
    qtype = GGMLQuantizationType[name]
    ours = dequantize_rows(torch.from_numpy(raw.copy()), int(qtype))
    theirs = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32))
    assert ours.shape == theirs.shape == (rows, cols)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_reference_linear_is_dequantize_then_linear(name: str) -> None:
    cols = 512
    parts = [GGUFPart(int(GGMLQuantizationType[n]), torch.from_numpy(random_rows(n, r, cols, seed=r)))
             for n, r in ((name, 5), ("Q6_K", 3))]
    w = GGUFWeight(parts, cols)
    x = torch.randn(4, cols)
    bias = torch.randn(8)
    dense = w.dequantize()
    assert dense.shape == (8, cols)
    assert torch.equal(dense[5:], dequantize_rows(parts[1].data, parts[1].qtype))
    torch.testing.assert_close(gguf_linear_reference(x, w, bias), x @ dense.T + bias, rtol=1e-5, atol=1e-5)


def test_embedding_rows_are_dequantized_rows() -> None:
    raw = torch.from_numpy(random_rows("Q4_K", 10, 256))
    table = GGUFWeight([GGUFPart(int(GGMLQuantizationType.Q4_K), raw)], 256)
    emb = GGUFEmbedding(table, torch.bfloat16)
    ids = torch.tensor([3, 0, 3, 9])
    assert torch.equal(emb.rows(ids), table.dequantize(torch.bfloat16)[ids])


def test_rows_that_do_not_hold_whole_blocks_are_refused() -> None:
    with pytest.raises(QuantError, match="Q4_K"):
        GGUFWeight([GGUFPart(int(GGMLQuantizationType.Q4_K), torch.zeros(2, 100, dtype=torch.uint8))], 256)
    with pytest.raises(QuantError, match="not supported"):
        GGUFWeight([GGUFPart(int(GGMLQuantizationType.Q2_K), torch.zeros(2, 84, dtype=torch.uint8))], 256)
