"""edge against Hugging Face transformers on the same random weights (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from edge.runtime.engine import Engine
from edge.sampling import SamplingParams

PROMPT_LENGTHS = [1, 7, 33, 100]


def prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_score_matches_transformers(hf_checkpoint, kv: str) -> None:
    name, hf, path = hf_checkpoint
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", kv_cache=kv, prefill_chunk=24)
    for n in PROMPT_LENGTHS:
        ids = prompt(n, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        ours = engine.score(ids)
        assert ours.shape == ref.shape
        assert rel_err(ours, ref) < 1e-4, f"{name} {kv} len {n}"


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_greedy_tokens_match_transformers(hf_checkpoint, kv: str) -> None:
    name, hf, path = hf_checkpoint
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", kv_cache=kv, page_size=8)
    for seed in (1, 2):
        ids = prompt(12, seed=100 + seed)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=48,
                min_new_tokens=48,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        ours = engine.generate(ids, SamplingParams(max_tokens=48, ignore_eos=True)).token_ids
        assert ours == ref, f"{name} {kv}: first mismatch at {next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}"


@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
def test_paged_matches_contiguous(hf_checkpoint, page_size: int) -> None:
    name, _, path = hf_checkpoint
    contiguous = Engine.from_pretrained(path, device="cpu", dtype="float32", kv_cache="contiguous")
    paged = Engine(contiguous.model, None, path, kv_cache="paged", page_size=page_size, prefill_chunk=24)
    ids = prompt(70, seed=page_size)
    base = contiguous.score(ids)
    assert rel_err(paged.score(ids), base) < 1e-5, f"{name} page {page_size}"
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert paged.generate(ids[:9], params).token_ids == contiguous.generate(ids[:9], params).token_ids
