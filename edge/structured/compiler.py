"""Compiling structured requests into grammars: off the caller's thread, with a time
limit, cached by the request's canonical form.

The llguidance tokenizer (the model's vocabulary as a token trie; a second or two for a
150k vocabulary) is built once, in the compiler's own threads, as soon as the compiler
exists. llguidance releases the GIL while it builds a grammar, so a slow compile stalls
neither the event loop nor the engine loop; its parser limits bound the work, and a
request whose compile takes longer than ``time_limit_s`` is refused (the compile
finishes in the background). Requests of the same canonical form share one compile, and
the outcome is cached either way: a repeated schema costs nothing, and a repeated
pathological one is refused at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from edge.structured.errors import GrammarError
from edge.structured.formats import HERMES, ToolFormat
from edge.structured.grammar import build_grammar, call_schema, json_rule
from edge.structured.matcher import GrammarMatcher, first_line
from edge.structured.request import StructuredRequest

DEFAULT_TIME_LIMIT_S = 10.0
DEFAULT_CACHE_SIZE = 64
COMPILE_NICE = 10  # added to the compile threads' nice value: background work


class CompiledGrammar:
    """A compiled grammar: each request gets a copy of its pristine matcher."""

    def __init__(self, ll: LLMatcher, text: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._ll = ll
        self.text = text
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._ll.deep_copy(), self._vocab_size, self._eos)


class GrammarCompiler:
    """Compiles :class:`StructuredRequest` s for one model: ``tokenizer_json`` (the
    tokenizer.json text), ``vocab_size`` (the model's, which may exceed the tokenizer's),
    ``eos_token_ids`` (what ends a request)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        fmt: ToolFormat = HERMES,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        workers: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.format = fmt
        self.time_limit_s = time_limit_s
        # Outcomes by canonical request: grammars, and the errors refusing the others.
        self._cache: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edge-grammar",
                                                           initializer=_background_priority)
        self._tokenizer = self._pool.submit(
            LLTokenizer, tokenizer_json, n_vocab=vocab_size, eos_token=list(self.eos_token_ids)
        )
        self.compiles = 0  # grammars built (cache misses)
        self.hits = 0

    @property
    def tokenizer(self) -> LLTokenizer:
        return self._tokenizer.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- compiling -------------------------------------------------------------------------

    def compile(self, req: StructuredRequest) -> CompiledGrammar | None:
        """The request's grammar (None: it constrains nothing), waiting on this thread;
        GrammarError for what cannot be enforced or compiles too slowly."""
        if not req.constrained:
            return None
        self._tokenizer.result()  # built once; not part of a request's time limit
        future = self._future(req)
        try:
            return future.result(timeout=self.time_limit_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow() from None

    async def compile_async(self, req: StructuredRequest) -> CompiledGrammar | None:
        """:meth:`compile` for an event loop, which keeps running meanwhile."""
        if not req.constrained:
            return None
        await asyncio.wrap_future(self._tokenizer)
        future = self._future(req)
        try:
            # shield: a timed-out wait must not cancel the compile other requests share
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.time_limit_s)
        except asyncio.TimeoutError:
            raise self._too_slow() from None

    def _future(self, req: StructuredRequest) -> concurrent.futures.Future:
        """The compile of ``req``: done already (cached grammar or refusal), running for
        another request with the same key, or started now."""
        key = req.key
        with self._lock:
            done = self._cache.get(key)
            if done is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                future: concurrent.futures.Future = concurrent.futures.Future()
                if isinstance(done, GrammarError):
                    future.set_exception(done)
                else:
                    future.set_result(done)
                return future
            running = self._running.get(key)
            if running is not None:
                return running
            future = self._pool.submit(self._build, req, time.monotonic())
            self._running[key] = future
            return future

    def _too_slow(self) -> GrammarError:
        return GrammarError(
            f"the response format / tools did not compile into a grammar within {self.time_limit_s:g} s: "
            "simplify the schema", code="grammar_too_complex",
        )

    def _remember(self, key: str, outcome: CompiledGrammar | GrammarError) -> None:
        with self._lock:
            self._running.pop(key, None)
            self._cache[key] = outcome
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _build(self, req: StructuredRequest, t_start: float) -> CompiledGrammar:
        """Compile ``req`` (in a pool thread). The outcome is cached either way: a grammar,
        or the error that refuses it; one that took longer than the time limit is refused
        as too slow from then on, so repeating a pathological schema costs nothing."""
        key = req.key
        try:
            text = build_grammar(req, self.format)
            assert text is not None
            tok = self._tokenizer.result()
            ll = LLMatcher(tok, LLMatcher.grammar_from_lark(text), log_level=0, limits=_limits())
            if not ll.is_error():
                # The first mask here, not on the engine loop: a grammar too large to step
                # through (llguidance's per-token limits) is refused with the others.
                ll.compute_bitmask()
            if ll.is_error():
                raise self._locate(req, first_line(ll.get_error()))
            if time.monotonic() - t_start > self.time_limit_s:
                raise self._too_slow()
        except GrammarError as exc:
            self._remember(key, exc)
            raise
        except BaseException:
            with self._lock:
                self._running.pop(key, None)
            raise
        grammar = CompiledGrammar(ll, text, self.vocab_size, self.eos_token_ids)
        with self._lock:
            self.compiles += 1
        self._remember(key, grammar)
        return grammar

    def _locate(self, req: StructuredRequest, message: str) -> GrammarError:
        """Name the schema that fails: each one compiled alone (error path only)."""
        tok = self._tokenizer.result()
        parts: list[tuple[str, dict]] = []
        if req.schema is not None:
            parts.append(("response_format.json_schema.schema", req.schema))
        for i, tool in enumerate(req.tools):
            if tool in req.callable_tools:
                parts.append((f"tools[{i}].function.parameters", call_schema(tool)))
        for param, schema in parts:
            ll = LLMatcher(tok, LLMatcher.grammar_from_lark("start: " + json_rule(schema)), log_level=0,
                           limits=_limits())
            if not ll.is_error():
                ll.compute_bitmask()
            if ll.is_error():
                why = first_line(ll.get_error()).removeprefix("at 1(8): ").removeprefix("failed to compile JSON schema: ")
                return GrammarError(f"{param} cannot be enforced: {why}", param)
        return GrammarError(f"the structured output request cannot be enforced: {message}")


def _background_priority() -> None:
    """Compiles yield the CPU to the engine and the event loop: on a board's few cores a
    busy compile thread would otherwise slow every stream (Linux nice values are per
    thread; threads a compile starts inherit it)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)


def _limits() -> LLParserLimits:
    # Bounded work per grammar and per token (llguidance's fuel units), below its own
    # defaults' worst case so a pathological schema fails fast instead of stalling masks.
    return LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=500_000,
                          verbose_errors=False)
