"""Speculative decoding on the GPU (skipped without one): greedy output identical to the
captured plain decode step, and rollback across page crossings."""

from __future__ import annotations

import pytest
import torch

from edge.engine import Engine
from edge.sampling import SamplingParams
from edge.scheduler import Scheduler
from edge.speculative.params import SpeculativeParams

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_matches_the_captured_decode_step(dtype: str) -> None:
    engine = Engine.from_pretrained(device="cuda", dtype=dtype, page_size=16, kv_blocks=512)
    draft = Engine.from_pretrained(device="cuda", dtype=dtype, page_size=16, kv_blocks=128, cuda_graph=False)
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, 800, (p,), generator=g).tolist() * 4)[: 4 * p] for p in (3, 7, 20, 50)]
    wants = [engine.generate(ids, max_tokens=120, ignore_eos=True).token_ids for ids in prompts]
    for spec in (SpeculativeParams("ngram", 8), SpeculativeParams("draft", 4)):
        sched = Scheduler(engine, speculative=spec, draft=draft)
        sched.start()
        try:
            for ids, want in zip(prompts, wants):
                got = sched.submit(ids, SamplingParams(max_tokens=120, ignore_eos=True)).result(timeout=120)
                assert got.token_ids == want, (spec.method, len(ids))
        finally:
            sched.stop()
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
        assert draft.kv.pool.num_free == draft.kv.pool.num_blocks
