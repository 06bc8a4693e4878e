"""Token sampling: greedy, temperature, top-k, top-p, repetition penalty, seeds; stops.

The sampler is written in tensor operations with no host synchronisation and no
shape that depends on the data, so the same function runs eagerly and inside a
captured CUDA graph. Randomness is counter-based (a hash of seed, step and token id
turned into Gumbel noise) rather than a stateful generator: the same seed gives the
same tokens on the CPU, eagerly on the GPU, and in graph replay.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from edge.errors import SamplingError
from edge.speculative.params import SpeculativeParams

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so products of 32-bit values fit in int64 without overflow


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: SpeculativeParams | None = None  # None: plain decoding (or the service default)

    def validate(self, max_allowed_tokens: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise SamplingError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if max_allowed_tokens is not None and self.max_tokens > max_allowed_tokens:
            raise SamplingError(f"max_tokens {self.max_tokens} exceeds the limit {max_allowed_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 <= self.top_k < 1 << 63:  # the sampler holds it in an int64
            raise SamplingError(f"top_k must be in [0, 2^63), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty strings")
        if self.speculative is not None:
            self.speculative.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved_seed(self) -> int:
        """The seed to use: the given one, else a fresh random one (logged in usage)."""
        if self.seed is None:
            self.seed = secrets.randbits(63)
        return self.seed


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise for token ``ids`` at decode ``step`` of a request."""
    h = _mix32((step & _MASK32) ^ (seed >> 32))
    h = _mix32(h ^ (seed & _MASK32))
    h = _mix32(h ^ ids)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


class SamplerState:
    """Per-request sampling tensors, on the model's device. In a CUDA graph these are
    the static buffers; eagerly they are just the request's state."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.temperature = torch.zeros(1, device=device)
        self.top_k = torch.zeros(1, dtype=torch.long, device=device)
        self.top_p = torch.ones(1, device=device)
        self.penalty = torch.ones(1, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.use_penalty = False

    def load(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        """Set up for a new request (host-to-device copies: once per request)."""
        self.temperature.fill_(params.temperature)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)
        self.penalty.fill_(params.repetition_penalty)
        self.seed.fill_(params.resolved_seed() if not params.greedy else 0)
        self.step.zero_()
        self.use_penalty = params.repetition_penalty != 1.0
        self.seen.zero_()
        if self.use_penalty and prompt_ids:
            ids = torch.tensor(prompt_ids, dtype=torch.long).clamp_(0, self.seen.shape[0] - 1)
            self.seen[ids.to(self.seen.device)] = True


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [..., vocab]`` with -inf at the tokens a grammar forbids. ``bitmask [...,
    ceil(vocab / 32)]`` int32 words: bit ``i % 32`` of word ``i // 32`` set = token ``i``
    allowed (the llguidance / xgrammar layout). Shape-static: runs inside graph capture."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit reads as bit 31
    allowed = bits.flatten(-2)[..., :vocab].to(torch.bool)
    return logits.masked_fill(~allowed, float("-inf"))


def sample(
    logits: torch.Tensor, state: SamplerState, greedy: bool, bitmask: torch.Tensor | None = None
) -> torch.Tensor:
    """Next token ``[1]`` (long) from float32 ``logits [vocab]``; advances ``state.step``
    and marks the token as seen, all on the device. ``bitmask``: the tokens a grammar
    allows (:func:`apply_token_bitmask`), applied before the penalty and the choice."""
    if bitmask is not None:
        logits = apply_token_bitmask(logits, bitmask)
    logits = penalized(logits, state)
    if greedy:
        token = torch.argmax(logits).view(1)
    else:
        token = _sample_stochastic(logits, state)
    state.step.add_(1)
    if state.use_penalty:
        state.seen.index_fill_(0, token, True)
    return token


def _filtered(logits: torch.Tensor, state: SamplerState) -> tuple[torch.Tensor, torch.Tensor]:
    """Tempered logits sorted in descending order, -inf outside top-k and top-p; their ids."""
    vocab = logits.shape[0]
    scaled = logits / state.temperature.clamp(min=1e-5)
    vals, ids = torch.sort(scaled, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(state.top_k > 0, state.top_k, torch.full_like(state.top_k, vocab))
    vals = vals.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    # The most likely token always survives top-p, whatever p is.
    vals = vals.masked_fill((before > state.top_p) & (rank > 0), float("-inf"))
    return vals, ids


def _sample_stochastic(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    vals, ids = _filtered(logits, state)
    gumbel = -torch.log(-torch.log(uniform_noise(state.seed, state.step, ids)))
    choice = torch.argmax(vals + gumbel).view(1)
    # gather, not ids[choice]: indexing with a tensor scalar syncs with the host,
    # which is illegal inside graph capture.
    return ids.gather(0, choice)


def penalized(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """``logits`` with the repetition penalty applied to the tokens seen so far."""
    if not state.use_penalty:
        return logits
    pen = torch.where(logits > 0, logits / state.penalty, logits * state.penalty)
    return torch.where(state.seen, pen, logits)


def target_probs(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """The distribution ``sample`` draws from (stochastic params) as float32 probabilities
    ``[vocab]``: penalty, temperature, top-k, top-p. Speculative acceptance needs it."""
    vals, ids = _filtered(penalized(logits, state), state)
    return torch.zeros_like(vals).scatter_(0, ids, torch.softmax(vals, dim=-1))


class StopChecker:
    """Host-side end conditions: stop token ids, stop strings, max_tokens.

    Text that might be the start of a stop string is held back, so a stop string is
    never streamed and then retracted.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int] | set[int]) -> None:
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stops = list(params.stop)
        self.max_tokens = params.max_tokens
        self.count = 0
        self._pending = ""
        self.finish_reason: str | None = None

    def on_token(self, token: int) -> bool:
        """Account one generated token; True if it ends generation (the token itself is
        not to be shown when it is a stop id)."""
        self.count += 1
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return True
        if self.count >= self.max_tokens:
            self.finish_reason = "length"
        return False

    def on_text(self, text: str) -> str:
        """Feed newly decoded text; returns what may be shown now."""
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out
        for s in self.stops:
            at = self._pending.find(s)
            if at >= 0:
                out = self._pending[:at]
                self._pending = ""
                self.finish_reason = "stop"
                return out
        hold = max((self._partial_suffix(s) for s in self.stops), default=0)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, stop: str) -> int:
        for n in range(min(len(stop) - 1, len(self._pending)), 0, -1):
            if self._pending.endswith(stop[:n]):
                return n
        return 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
