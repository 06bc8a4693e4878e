"""The verify step: score the last token and k proposals in one forward of the target
over the paged KV, decide which proposals stand, roll the rest back by length.

Acceptance is the standard speculative-sampling rule: proposal ``d`` at a
position where the target's sampling distribution is ``p`` and the proposer's is ``q``
stands with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn from
``normalize(max(0, p - q))``; when every proposal stands, one more token is drawn from
the target after the last. A deterministic proposer has ``q`` = a point mass. The
output then follows the target's distribution exactly; greedy decoding reduces to
"keep the proposals equal to the target's argmax", which is identical to plain decoding.

Randomness is the sampler's counter-based noise at the step of each emitted token, so a
seed reproduces a speculative run (not the plain run's tokens: another draw of the same
distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from edge.model.kv import SequenceKV
from edge.runtime.kv_paged import PagedSequence
from edge.sampling import SamplerState, apply_token_bitmask, sample, target_probs, uniform_noise

if TYPE_CHECKING:
    from edge.runtime.engine import Engine
    from edge.runtime.verify_graph import VerifyDecoder


@dataclass
class Verdict:
    """``tokens``: the accepted proposals, then one token the target drew itself (the
    correction of a rejected proposal, or the one after the last accepted)."""

    tokens: list[int]
    accepted: int


def accept(
    logits: torch.Tensor,
    proposed: list[int],
    state: SamplerState,
    greedy: bool,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """Decide on ``proposed`` (k tokens) from the target's float32 ``logits [k + 1,
    vocab]`` (row i scores the position after proposal i - 1); ``draft_probs [k, vocab]``
    is the proposer's distribution (None: a point mass on each proposal). Advances
    ``state`` by one step per emitted token, marking each as seen, as ``sample`` does."""
    k = len(proposed)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} rows of logits, got {logits.shape[0]}")
    if greedy and not state.use_penalty:
        # One argmax for all rows: a single device-to-host copy per verify step.
        return accept_greedy(logits.argmax(dim=-1).tolist(), proposed, state)
    tokens: list[int] = []
    for i, d in enumerate(proposed):
        if greedy:
            t = int(sample(logits[i], state, True))
        else:
            t = _accept_or_resample(logits[i], d, state, None if draft_probs is None else draft_probs[i])
        tokens.append(t)
        if t != d:
            return Verdict(tokens, i)
    tokens.append(int(sample(logits[k], state, greedy)))
    return Verdict(tokens, k)


def accept_greedy(best: list[int], proposed: list[int], state: SamplerState) -> Verdict:
    """Greedy decision from the target's argmax of each row (``best``, k + 1 ids): keep
    the proposals up to the first that differs, then the target's own token there."""
    k = len(proposed)
    if len(best) != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} argmax ids, got {len(best)}")
    n = next((i for i, (b, d) in enumerate(zip(best, proposed)) if b != d), k)
    state.step.add_(n + 1)
    return Verdict(proposed[:n] + [best[n]], n)


def _accept_or_resample(logits: torch.Tensor, proposal: int, state: SamplerState, q: torch.Tensor | None) -> int:
    p = target_probs(logits, state)
    vocab = p.shape[0]
    # The acceptance draw uses the id just past the vocabulary: independent of the
    # Gumbel noise the same step gives each token id.
    u = float(uniform_noise(state.seed, state.step, torch.full((1,), vocab, device=p.device)))
    q_d = 1.0 if q is None else float(q[proposal])
    if u * q_d < float(p[proposal]):
        token = proposal
    else:
        if q is None:
            residual = p.clone()
            residual[proposal] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:
            residual = p  # only reachable by rounding when p equals q
        ids = torch.arange(vocab, device=p.device)
        gumbel = -torch.log(-torch.log(uniform_noise(state.seed, state.step, ids)))
        token = int(torch.argmax(torch.log(residual) + gumbel))
    state.step.add_(1)
    if state.use_penalty:
        state.seen[token] = True
    return token


def verify(
    engine: Engine,
    seq: SequenceKV,
    last: int,
    proposed: list[int],
    state: SamplerState,
    greedy: bool,
    draft_probs: torch.Tensor | None = None,
    bitmasks: torch.Tensor | None = None,
) -> Verdict:
    """Feed ``last`` (the newest token, not yet in ``seq``) and ``proposed`` in one
    forward; keep ``last`` and the accepted proposals in the KV, roll the rejected ones
    back (length and block table only). Raises KVOutOfMemory with ``seq`` unchanged.
    ``bitmasks [k + 1, words]``: a grammar's allowed tokens at each position."""
    logits = engine.forward(seq, [last, *proposed], all_logits=True)
    if bitmasks is not None:
        logits = apply_token_bitmask(logits, bitmasks)
    verdict = accept(logits, proposed, state, greedy, draft_probs)
    seq.rollback(len(proposed) - verdict.accepted)
    return verdict


def verify_step(
    decoder: VerifyDecoder,
    seq: PagedSequence,
    last: int,
    proposed: list[int],
    state: SamplerState,
    greedy: bool,
    draft_probs: torch.Tensor | None = None,
    bitmasks: torch.Tensor | None = None,
) -> Verdict:
    """:func:`verify` through the slot's verify decoder (edge/runtime/verify_graph.py: a
    CUDA graph per token count with the position on the device, or the same step run
    eagerly on the reference backend). Greedy requests without penalties or a grammar
    get the argmax ids from the step itself; the others its logits, decided here
    (masked by ``bitmasks``, as in :func:`verify`)."""
    argmax = greedy and not state.use_penalty and bitmasks is None
    out = decoder.run(seq, [last, *proposed], argmax)
    if bitmasks is not None:
        out = apply_token_bitmask(out, bitmasks)
    verdict = accept_greedy(out, proposed, state) if argmax else accept(out, proposed, state, greedy, draft_probs)
    seq.rollback(len(proposed) - verdict.accepted)
    if not argmax:
        decoder.settle(seq)  # the argmax graph moved the device position itself
    return verdict
