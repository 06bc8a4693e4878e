"""Engine: the public Python API.

    engine = Engine.from_pretrained()            # the embedded default model, CPU
    result = engine.generate("Hello", SamplingParams(max_tokens=32))
    for chunk in engine.stream("Hello"): print(chunk.text, end="")

The engine owns the model, the tokenizer and the KV cache. ``prefill``/``decode_step``
are the primitives the scheduler drives; ``generate``/``stream``/``chat`` run one
request to completion on the calling thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge.runtime.backend import Backend, select_backend
from edge.runtime.memory_plan import Checkpoint, MemoryPlan, fit, runtime_to_come, tower_peak
from edge.runtime.threads import compile_threads
from edge.runtime.budget import (
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_UTILIZATION,
    BudgetError,
    MemoryBudget,
    MemoryInfo,
    default_prefill_chunk,
    parse_kv_dtype,
    fmt_bytes,
    parse_bytes,
    parse_reserve,
    plan_kv_budget,
    probe_memory,
)
from edge.model.config import ModelConfig, parse_dtype
from edge.errors import PromptTooLong
from edge.model.generation import Chunk, Generation, GenerationResult
from edge.runtime.graph import SlotDecoder
from edge.kernels.int4_cuda import Int4Tuning
from edge.kernels.int8_cuda import Int8Tuning
from edge.kernels.paged_cuda import DecodeTuning
from edge.model.kv import KVOutOfMemory, SequenceKV
from edge.runtime.kv_contiguous import ContiguousKV
from edge.runtime.kv_paged import BlockPool, PagedKVCache
from edge.model.loader import check_checkpoint_matches_config, expected_shapes, fused_layout
from edge.model.decoder import Model
from edge.quant.q8_0 import weight_tensors
from edge.sampling import SamplerState, SamplingParams, sample
from edge.runtime.verify_graph import DEFAULT_GRAPH_PROPOSALS, VerifyDecoder
from edge.model.tokenizer import Tokenizer
from edge.model.validate import check_finite_weights, model_directory

if TYPE_CHECKING:
    from edge.structured.matcher import GrammarMatcher
    from edge.model.vision.runtime import MultimodalPrompt, VisionLanguage

log = logging.getLogger(__name__)

KV_KINDS = ("paged", "contiguous")


def _loader_choice(held: str) -> str:
    """A plan's lm_head / embedding form as the loaders take it (a tied head has none)."""
    return "float" if held == "tied" else held


def _fit(
    path: Path, dev: torch.device, dtype: torch.dtype, seq_len: int, page_size: int, quantize: str | None,
    lm_head: str, embedding: str, cuda_graph: bool | None, options: dict,
) -> MemoryPlan:
    """The memory plan the model loads under (edge/runtime/memory_plan.py), checked against
    what this process may use unless the caller sized the pool itself for a test
    (``num_blocks`` / ``memory_info``)."""
    if dev.type == "cpu":
        kind = "cpu"
    elif torch.cuda.is_available():
        kind = "integrated" if getattr(torch.cuda.get_device_properties(dev), "is_integrated", False) else "discrete"
    else:  # no CUDA here: what runs next names that, the plan cannot probe anything
        kind = "discrete"
    faked = "num_blocks" in options or "memory_info" in options or (kind != "cpu" and not torch.cuda.is_available())
    memory = None
    if not faked:
        try:
            memory = probe_memory(dev)
        except (OSError, BudgetError) as exc:
            log.warning("cannot probe memory (%s): the model is loaded without a fit check", exc)
    reserve = options.get("memory_reserve")
    p = fit(
        Checkpoint.from_dir(path), quantize=quantize, lm_head=lm_head, embedding=embedding, kind=kind,
        memory=memory, dtype=dtype, max_seq_len=seq_len, page_size=page_size, kv_dtype=options.get("kv_dtype"),
        kv_blocks=options.get("kv_blocks"), kv_memory=None if options.get("kv_memory") is None else parse_bytes(
            options["kv_memory"]),
        reserve=None if reserve is None else parse_reserve(reserve),
        utilization=options.get("memory_utilization", DEFAULT_UTILIZATION), prefill_chunk=options.get("prefill_chunk"),
        cuda_graph=cuda_graph, runtime=0 if kind == "discrete" else runtime_to_come(kind),
    )
    for note in p.notes:
        log.warning("memory plan: %s", note)
    if memory is not None:
        log.info("memory plan: %s %s needs %s for a context of %d tokens; %s available (%s)", p.name, p.held.label(),
                 fmt_bytes(p.need), seq_len, fmt_bytes(memory.available), memory.source)
    return p


def _start_first_compile(
    cfg: ModelConfig, dtype: torch.dtype, dev: torch.device, plan: MemoryPlan, options: dict,
    on_status: Callable[[str], None] | None,
) -> Future[float] | None:
    """Start compiling the kernel variants the backend will load and the cache lacks
    (edge/kernels/prebuild.py), in threads beside the weights' loading; None when cached."""
    from edge.kernels import nvrtc, prebuild

    def progress(line: str) -> None:
        log.info("%s", line)
        if on_status is not None:
            on_status(line)

    try:
        return prebuild.start(
            cfg, dtype, nvrtc.device_index(dev), workers=compile_threads(), sms=options.get("sms"),
            int4_scale_dtypes=[getattr(torch, d) for d in plan.held.int4_scale_dtypes()],
            decode_tuning=options.get("decode_tuning"), int8_tuning=options.get("int8_tuning"),
            int4_tuning=options.get("int4_tuning"), progress=progress,
        )
    except Exception as exc:  # the backend compiles (and reports) whatever is missing itself
        log.warning("kernel variants not compiled ahead: %s", exc)
        return None


def _finish_first_compile(future: Future[float], on_status: Callable[[str], None] | None) -> None:
    try:
        seconds = future.result()
    except Exception as exc:  # the backend meets the same failure and names the fix
        log.warning("compiling the kernel variants ahead failed: %s", str(exc).splitlines()[0])
        return
    log.info("kernel variants compiled in %.0f s", seconds)
    if on_status is not None:
        on_status(f"kernels compiled in {seconds:.0f} s")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer | None,
        model_dir: Path,
        kv_cache: str = "paged",
        page_size: int = 16,
        max_seq_len: int | None = None,
        num_blocks: int | None = None,
        prefill_chunk: int | None = None,
        poison_kv: bool = False,
        kernels: str = "auto",
        cuda_graph: bool | None = None,
        overlap_launches: bool | None = None,
        kv_blocks: int | None = None,
        kv_memory: int | str | None = None,
        memory_utilization: float = DEFAULT_UTILIZATION,
        memory_info: MemoryInfo | None = None,
        decode_tuning: DecodeTuning | None = None,
        int8_tuning: Int8Tuning | None = None,
        int4_tuning: Int4Tuning | None = None,
        sms: int | None = None,
        backend: Backend | None = None,
        blocking_waits: bool = True,
        stream_factory: Callable[[int], torch.cuda.Stream] | None = None,
        memory_reserve: int | str | None = None,
        vision: VisionLanguage | None = None,
        kv_dtype: str = "auto",
        memory_plan: MemoryPlan | None = None,
    ) -> None:
        """``num_blocks`` sizes the pool exactly, with no budget checks (tests of logical
        OOM). Otherwise the pool comes from the memory budget (edge/runtime/budget.py):
        ``kv_blocks``/``kv_memory`` explicitly, or what is available x
        ``memory_utilization`` after weights and activations, keeping ``memory_reserve``
        free on an integrated GPU (default ``edge.runtime.budget.DEFAULT_RESERVE``); ``memory_info``
        fakes the probe.

        The engine plans its own backend (edge/runtime/backend.py) from ``kernels`` ("auto":
        the CUDA kernels on a GPU, which must then load; "reference": the torch
        reference), ``overlap_launches`` (captured decode steps start each kernel while
        the previous one finishes, sm_90+; None: on, except for int4 weights), the
        tunings and ``sms`` (the SM count plans fill; default: the current context's).
        ``model`` itself is not changed: the engine runs ``model.with_backend(...)``.
        ``backend`` gives a planned backend instead (tests). ``blocking_waits``: reading a
        decoded token sleeps until the GPU is done (False: spins a CPU core, which Orin's
        few cores cannot spare).
        ``prefill_chunk``: the most tokens one prefill forward takes (default:
        :func:`edge.runtime.budget.default_prefill_chunk`, longer where quantized linears expand
        their weights once per forward).
        ``stream_factory(priority)`` makes the CUDA streams the engine's users create
        (default ``torch.cuda.Stream``; an SM-restricted green context passes its own).
        ``vision``: the tower and multimodal RoPE of a vision-language model (edge/vision).
        ``kv_dtype``: how K/V rows are held, "auto" (the model's dtype) or "int8" (codes
        and a scale a row, edge/kernels/kv_int8.py), in the paged pool and the contiguous
        cache alike."""
        kv_dtype = parse_kv_dtype(kv_dtype)
        if kv_cache not in KV_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_KINDS}, got {kv_cache!r}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.backend: Backend = backend or select_backend(
            model.cfg,
            model.device,
            model.dtype,
            model.w.values(),
            kernels=kernels,
            overlap_launches=overlap_launches,
            decode_tuning=decode_tuning,
            int8_tuning=int8_tuning,
            int4_tuning=int4_tuning,
            sms=sms,
            kv_int8=kv_dtype == "int8",
        )
        log.info("backend: %s", self.backend.describe())
        model = model.with_backend(self.backend)
        self.model = model
        self.vision = vision
        self.memory_plan = memory_plan
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.device = model.device
        self.dtype = model.dtype
        self.kv_kind = kv_cache
        self.kv_dtype = kv_dtype
        self.max_seq_len = max_seq_len or min(self.cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if prefill_chunk is None:
            prefill_chunk = self._default_prefill_chunk(memory_info)
        self.prefill_chunk = prefill_chunk
        self.page_size = page_size
        self.kv: PagedKVCache | None = None
        self.budget: MemoryBudget | None = None
        attention = self.backend.eager.attention
        graph_ok = self.device.type == "cuda" and kv_cache == "paged" and self.backend.cuda_graph_capable
        if kv_cache == "paged":
            if num_blocks is None:
                self.budget = plan_kv_budget(
                    model,
                    attention,
                    page_size=page_size,
                    max_seq_len=self.max_seq_len,
                    prefill_chunk=prefill_chunk,
                    kv_blocks=kv_blocks,
                    kv_memory=kv_memory,
                    utilization=memory_utilization,
                    memory=memory_info,
                    reserve=memory_reserve,
                    cuda_graph=cuda_graph is not False and graph_ok,
                    kv_dtype=kv_dtype,
                    vision_activations=self._vision_activations(),
                )
                log.info("%s", self.budget.describe())
                num_blocks = self.budget.num_blocks
            elif kv_blocks is not None or kv_memory is not None:
                raise ValueError("give num_blocks or kv_blocks/kv_memory, not both")
            pool = BlockPool(
                self.cfg,
                num_blocks,
                page_size,
                self.device,
                self.dtype,
                poison=poison_kv,
                kv_dtype=kv_dtype,
            )
            self.kv = PagedKVCache(pool, self.max_seq_len, self.cfg.head_dim**-0.5, attention)
            if attention.graph_decode_options is not None:
                self.kv.decode_options = attention.graph_decode_options(
                    self.dtype, self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads, page_size,
                    kv_int8=kv_dtype == "int8",
                )
        # The captured step reads its position on the device: CUDA attention kernels only.
        self.cuda_graph = bool(cuda_graph) if cuda_graph is not None else graph_ok
        if self.cuda_graph and not graph_ok:
            raise ValueError("cuda_graph needs device='cuda', kv_cache='paged' and the CUDA attention kernels")
        self._sampler = SamplerState(self.cfg.vocab_size, self.device)
        self._contiguous: ContiguousKV | None = None
        self._decoders: dict[int, SlotDecoder] = {}
        self._verifiers: dict[int | None, VerifyDecoder] = {}
        # Widest verify step (proposals) of the verify decoders made from now on.
        self.verify_proposals = DEFAULT_GRAPH_PROPOSALS
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self.blocking_waits = blocking_waits
        self._stream_factory = stream_factory

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        kv_cache: str = "paged",
        page_size: int = 16,
        cuda_graph: bool | None = None,
        max_seq_len: int | None = None,
        quantize: str | None = None,
        quant_group_size: int | None = None,
        check_weights: bool = True,
        quant_lm_head: str = "auto",
        quant_embedding: str = "auto",
        **options,
    ) -> "Engine":
        """Load a Hugging Face model directory (default: the embedded random model).

        dtype defaults to float32 on the CPU and bfloat16 on a GPU. A q8_0 checkpoint
        (tools/quantize.py) loads with int8 projections; ``quantize="int8"`` quantizes a
        float one while loading (group size ``quant_group_size``, default 128). An AWQ /
        GPTQ / compressed-tensors checkpoint loads with int4 projections, and
        ``quantize="int4"`` quantizes a float one to int4 while loading (RTN); such a
        model keeps its lm_head and embedding as ``quant_lm_head`` (int8, int4 or float)
        and ``quant_embedding`` (int8 or float); ``"auto"`` keeps them as published, as int8
        rows only where only that fits.
        ``check_weights`` refuses weights holding NaN or infinity (edge/model/validate.py).

        Before anything loads, the memory plan (edge/runtime/memory_plan.py) checks that the
        weights, one full context of KV, the activations and the reserve fit what this
        process may use, and raises :class:`~edge.runtime.memory_plan.DoesNotFit` (one line
        naming what would fit) when they do not; explicit ``num_blocks`` / ``memory_info``
        (tests that fake the budget) skip it.
        """
        if path is None:
            from edge.model.random_model import default_model_path

            path = default_model_path()
        path = model_directory(path)
        dev = torch.device(device) if device is not None else default_device()
        if dev.type == "cuda" and not torch.cuda.is_available():
            from edge.runtime.backend import BackendUnavailable

            raise BackendUnavailable(
                f"device {dev}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu "
                "(or, on a GPU machine, a CUDA build of torch: docs/install.md)"
            )
        dt = parse_dtype(dtype) if dtype is not None else (torch.float32 if dev.type == "cpu" else torch.bfloat16)
        from edge.model.vision.config import VLConfig, is_vision_language

        vl = is_vision_language(path)
        cfg = VLConfig.from_pretrained(path).text if vl else ModelConfig.from_pretrained(path)
        check_checkpoint_matches_config(path, cfg)
        seq_len = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        cuda_kernels = dev.type == "cuda" and options.get("kernels", "auto") != "reference"
        if cuda_kernels:
            # Fail before planning or loading gigabytes of weights when the kernels cannot load.
            from edge.kernels import nvrtc

            try:
                nvrtc.check_available(nvrtc.device_index(dev))
            except nvrtc.KernelsUnavailable as exc:
                from edge.runtime.backend import BackendUnavailable, kernel_fix_hint

                raise BackendUnavailable(kernel_fix_hint(exc)) from exc
        plan = _fit(path, dev, dt, seq_len, page_size, quantize, quant_lm_head, quant_embedding, cuda_graph, options)
        quant_lm_head, quant_embedding = (_loader_choice(plan.held.lm_head), _loader_choice(plan.held.embedding))
        on_status = options.pop("on_status", None)
        first_compile = _start_first_compile(cfg, dt, dev, plan, options, on_status) if cuda_kernels else None
        # The tokenizer first: a broken tokenizer.json fails in a second, not after the weights.
        tokenizer = Tokenizer.from_pretrained(path) if (path / "tokenizer.json").exists() else None
        vision = None
        if vl:
            from edge.model.vision.loader import checked_tensors, load_vision_language

            model, vision = load_vision_language(
                path, dev, dt, seq_len, quantize, quant_group_size, lm_head=quant_lm_head, embedding=quant_embedding
            )
            if check_weights:
                check_finite_weights(*checked_tensors(path, model, vision))
        else:
            model = Model.load(
                path, cfg, dev, dt, seq_len, quantize=quantize, quant_group_size=quant_group_size,
                lm_head=quant_lm_head, embedding=quant_embedding,
            )
            if check_weights:
                tensors = ((name, t) for name, w in model.w.items() for t in weight_tensors(w))
                check_finite_weights(tensors, fused_layout(expected_shapes(cfg)))
        if tokenizer is None:
            log.warning("%s has no tokenizer.json: token ids in and out only", path)
        if first_compile is not None:
            _finish_first_compile(first_compile, on_status)
        return cls(
            model,
            tokenizer,
            path,
            kv_cache=kv_cache,
            page_size=page_size,
            max_seq_len=seq_len,
            cuda_graph=cuda_graph,
            vision=vision,
            memory_plan=plan,
            **options,
        )

    def _vision_activations(self) -> int:
        """The vision tower's peak on the largest image a context holds (0: a text model)."""
        if self.vision is None:
            return 0
        return tower_peak(self.vision.cfg.vision, self.vision.processor.max_pixels, self.max_seq_len, self.dtype)

    def _default_prefill_chunk(self, memory: MemoryInfo | None) -> int:
        """:func:`edge.runtime.budget.default_prefill_chunk` for this model and backend; the
        memory is probed only where the chunk may grow."""
        layers = [w for name, w in self.model.w.items() if name.startswith("model.layers.")
                  and not isinstance(w, torch.Tensor)]
        expands = self.backend.eager.linears.expands(layers)
        if expands and memory is None:
            try:
                memory = probe_memory(self.device)
            except (OSError, BudgetError) as exc:
                log.warning("cannot probe memory (%s): the prefill chunk is not capped by it", exc)
        chunk = default_prefill_chunk(self.cfg, self.dtype, self.max_seq_len, expands, memory)
        log.info("prefill chunk: %d tokens%s", chunk, " (the linears expand their weights once a chunk)" if expands else "")
        return chunk

    # -- primitives -------------------------------------------------------------------

    def new_sequence(self, slot: int | None = None) -> SequenceKV:
        """A fresh sequence. ``slot`` names the scheduler slot it decodes in, which
        selects that slot's captured CUDA graphs."""
        if self.kv is not None:
            seq = self.kv.new_sequence()
            seq.slot = slot
            return seq
        if self._contiguous is None:
            self._contiguous = ContiguousKV(self.cfg, self.max_seq_len, self.device, self.dtype, self.kv_dtype)
        self._contiguous.release()
        return self._contiguous

    def forward(
        self,
        seq: SequenceKV,
        ids: list[int] | torch.Tensor,
        all_logits: bool = False,
        mm: MultimodalPrompt | None = None,
        rope_delta: int = 0,
        progress: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Run ``ids`` through the model after the tokens ``seq`` holds; float32 logits
        of the last token ``[vocab]`` (or of every token ``[T, vocab]``). ``ids`` are
        tokens of the multimodal prompt ``mm`` (from position ``seq.length``), or
        tokens after one whose RoPE positions trail by ``-rope_delta`` (edge/vision).
        ``progress`` is called after each vision-tower block the chunk's images run."""
        ids_t = torch.as_tensor(ids, dtype=torch.long).to(self.device, non_blocking=True).view(-1)
        t = ids_t.shape[0]
        seq.reserve(t)
        positions = torch.arange(seq.length, seq.length + t, device=self.device)
        inputs = {}
        if mm is not None:
            inputs = self._vision().chunk_inputs(mm, seq.length, seq.length + t, progress)
        elif rope_delta:
            inputs = {"rope": self._vision().decode_rope(rope_delta)}
        hidden, norm = self.model.hidden(ids_t, positions, seq, **inputs)
        seq.advance(t)
        return self.model.logits(hidden if all_logits else hidden[-1:], norm)[slice(None) if all_logits else 0]

    def prefill(
        self, seq: SequenceKV, ids: list[int], all_logits: bool = False, mm: MultimodalPrompt | None = None
    ) -> torch.Tensor:
        """Prefill in chunks of ``prefill_chunk`` tokens; logits as ``forward`` (with
        ``mm``, ``ids`` are its tokens from ``seq.length`` on)."""
        if not ids:
            raise ValueError("cannot prefill an empty prompt")
        outs = []
        for i in range(0, len(ids), self.prefill_chunk):
            outs.append(self.forward(seq, ids[i : i + self.prefill_chunk], all_logits, mm=mm))
        return torch.cat(outs) if all_logits else outs[-1]

    def decode(
        self,
        seq: SequenceKV,
        token: torch.Tensor,
        sampler: SamplerState,
        greedy: bool,
        rope_delta: int = 0,
        bitmask: np.ndarray | None = None,
    ) -> torch.Tensor:
        """One decode step: feed ``token`` ([1] long, on the device), return the next
        one, still on the device (reading it is the caller's synchronisation point).
        Raises KVOutOfMemory, leaving ``seq`` unchanged, when no block is free.
        ``rope_delta``: the RoPE offset after a prompt with images (edge/vision).
        ``bitmask``: the tokens a grammar allows (int32 words, edge/structured); such a
        step runs eagerly, masking the logits before sampling."""
        if bitmask is not None:
            logits = self.forward(seq, token, rope_delta=rope_delta)
            return sample(logits, sampler, greedy, self.bitmask_tensor(bitmask))
        decoder = self.slot_decoder(seq)
        if decoder is None:
            return sample(self.forward(seq, token, rope_delta=rope_delta), sampler, greedy)
        if decoder.bound is not seq:
            decoder.bind(seq, sampler, token, rope_delta)
        return torch.tensor([decoder.next_token(seq, greedy)])

    def bitmask_tensor(self, bitmask: np.ndarray) -> torch.Tensor:
        """A host grammar bitmask (int32 words, ``[words]`` or ``[positions, words]``) on
        the device."""
        return torch.from_numpy(bitmask).to(self.device, non_blocking=True)

    def settle(self, seq: SequenceKV) -> None:
        """Detach ``seq`` from its slot's graph decoder, rolling back any step launched
        ahead but never read, so ``seq.length`` counts only tokens the caller saw."""
        decoder = self._decoders.get(getattr(seq, "slot", None))
        if decoder is not None and decoder.bound is seq:
            decoder.unbind(seq)

    def end_sequence(self, seq: SequenceKV) -> None:
        """Settle and release a sequence."""
        self.settle(seq)
        seq.release()

    def slot_decoder(self, seq: SequenceKV) -> SlotDecoder | None:
        """The CUDA-graph decoder of the sequence's slot, or None for eager decode."""
        slot = getattr(seq, "slot", None)
        if not self.cuda_graph or slot is None:
            return None
        if slot not in self._decoders:
            self._decoders[slot] = SlotDecoder(self, self._graph_pool)
        return self._decoders[slot]

    def verify_decoder(self, seq: SequenceKV) -> VerifyDecoder | None:
        """The speculative verify decoder of the sequence's slot (edge/runtime/verify_graph.py),
        or None on a contiguous cache (verify steps then run through :meth:`forward`)."""
        if self.kv is None:
            return None
        slot = getattr(seq, "slot", None)
        decoder = self._verifiers.get(slot)
        if decoder is None:
            decoder = self._verifiers[slot] = VerifyDecoder(self, self.verify_proposals, self._graph_pool)
        return decoder

    def new_stream(self, priority: int = 0) -> torch.cuda.Stream:
        """A CUDA stream for this engine's work (graph capture, scheduler slots)."""
        if self._stream_factory is not None:
            return self._stream_factory(priority)
        return torch.cuda.Stream(self.device, priority=priority)

    def capture_graphs(self, slots: tuple[int, ...] = (0, 1), speculative_tokens: int | None = None) -> int:
        """Capture every decode graph of ``slots`` now (serving start-up), so that no
        request pauses the engine for a capture; with ``speculative_tokens`` (speculation
        is configured) also the verify graphs of 1 .. max(that, DEFAULT_GRAPH_PROPOSALS)
        proposals (edge/runtime/verify_graph.py). Returns how many were captured."""
        if not self.cuda_graph:
            return 0
        made = 0
        for slot in slots:
            if slot not in self._decoders:
                self._decoders[slot] = SlotDecoder(self, self._graph_pool)
            made += self._decoders[slot].capture_all()
        if speculative_tokens is not None and self.kv is not None:
            width = max(speculative_tokens, DEFAULT_GRAPH_PROPOSALS)
            for slot in slots:
                decoder = self._verifiers.get(slot)
                if decoder is None or decoder.max_proposals < width:
                    decoder = self._verifiers[slot] = VerifyDecoder(self, width, self._graph_pool)
                made += decoder.capture_all()
            self.verify_proposals = width
        return made

    def check_prompt(self, prompt_ids: list[int], max_tokens: int = 1) -> None:
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty")
        if len(prompt_ids) + min(max_tokens, 1) > self.max_seq_len:
            raise PromptTooLong(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_seq_len} tokens"
            )

    def completion_room(self, prompt_len: int) -> int:
        """Tokens a completion of a ``prompt_len``-token prompt may have: prompt and
        completion together fill the context at most (as the API and transformers'
        ``max_length`` count; the last token is never written to the cache)."""
        return max(self.max_seq_len - prompt_len, 0)

    # -- one request on the calling thread ----------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: pass token ids, not text")
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams | None = None,
        grammar: GrammarMatcher | None = None,
        **overrides,
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are produced; the last one carries finish_reason and usage.
        A :class:`~edge.model.vision.runtime.MultimodalPrompt` holds images (edge/vision);
        ``grammar`` constrains the output (edge/structured)."""
        params = replace(params or SamplingParams(), **overrides)
        params.validate()
        mm = None if isinstance(prompt, (str, list)) else prompt
        prompt_ids = self.encode(prompt) if mm is None else mm.ids
        self.check_prompt(prompt_ids, params.max_tokens)
        params.max_tokens = min(params.max_tokens, self.completion_room(len(prompt_ids)))
        gen = self.new_generation(prompt_ids, params, self._sampler, grammar)
        seq = self.new_sequence(slot=0)
        try:
            yield from self._run(seq, gen, mm)
        finally:
            self.end_sequence(seq)

    def new_generation(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sampler: SamplerState,
        grammar: GrammarMatcher | None = None,
    ) -> Generation:
        return Generation(self.tokenizer, prompt_ids, params, sampler, frozenset(self.cfg.eos_token_ids), grammar)

    def _run(self, seq: SequenceKV, gen: Generation, mm: MultimodalPrompt | None = None) -> Iterator[Chunk]:
        logits = self.prefill(seq, gen.prompt_ids, mm=mm)
        delta = mm.rope_delta if mm is not None else 0
        gen.mark_prefilled()
        if gen.params.max_tokens == 0:
            yield gen.finish("length")
            return
        greedy = gen.params.greedy
        mask = gen.next_mask()
        token = sample(logits, gen.sampler, greedy, None if mask is None else self.bitmask_tensor(mask))
        while True:
            chunk = gen.feed(int(token))
            if chunk.token_ids or chunk.text:
                yield chunk
            if gen.done:
                break
            try:
                token = self.decode(seq, token, gen.sampler, greedy, rope_delta=delta, bitmask=gen.next_mask())
            except KVOutOfMemory as exc:
                yield gen.finish("length", message=str(exc))
                return
        yield gen.finish()

    def generate(
        self,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams | None = None,
        grammar: GrammarMatcher | None = None,
        **overrides,
    ) -> GenerationResult:
        params = replace(params or SamplingParams(), **overrides)
        return GenerationResult.from_chunks(list(self.stream(prompt, params, grammar)))

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **overrides) -> GenerationResult:
        """Messages through the chat template; a vision-language model also takes
        ``{"type": "image", "image": bytes | path | PIL image}`` content parts."""
        return self.generate(self.chat_prompt(messages), params, **overrides)

    def chat_prompt(self, messages: list[dict]) -> list[int] | MultimodalPrompt:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: chat needs one")
        if self.vision is not None:
            return self.vision.prompt_from_messages(self.tokenizer, messages)
        if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
                                                          for p in m["content"]) for m in messages):
            self._vision()  # a text model's template cannot place an image: say so, in one line
        return self.tokenizer.encode_chat(messages)

    def run_towers(self, mm: MultimodalPrompt, start: int, end: int, budget_s: float | None,
                   progress: Callable[[], None] | None = None) -> None:
        """A slice of the vision tower's work for prompt tokens [start, end) of ``mm``
        (:meth:`VisionLanguage.run_towers`)."""
        self._vision().run_towers(mm, start, end, budget_s, progress)

    def _vision(self) -> VisionLanguage:
        if self.vision is None:
            raise ValueError(f"{self.model_dir} is not a vision-language model: it takes no images "
                             "(images need a Qwen3-VL or Qwen2.5-VL checkpoint)")
        return self.vision

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits of every position ``[T, vocab]`` on the CPU (for verification)."""
        ids = [int(t) for t in token_ids]
        self.check_prompt(ids, 0)
        seq = self.new_sequence()
        try:
            return self.prefill(seq, ids, all_logits=True).cpu()
        finally:
            seq.release()

    def info(self) -> dict:
        cfg = self.cfg
        out = {
            "model_dir": str(self.model_dir),
            "architecture": cfg.architecture,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "weight_bytes": self.model.weight_bytes(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache": self.kv_kind,
            "kv_dtype": self.kv_dtype if self.kv_dtype != "auto" else str(self.dtype).removeprefix("torch."),
            "max_seq_len": self.max_seq_len,
            "prefill_chunk": self.prefill_chunk,
            "cuda_graph": self.cuda_graph,
            "overlapped_launches": self.cuda_graph and self.backend.overlap_launches,
            "backend": self.backend.describe(),
        }
        if self.model.weight_formats is not None:
            out["weights"] = dict(self.model.weight_formats)
        if self.kv is not None:
            pool = self.kv.pool
            out |= {
                "page_size": pool.page_size,
                "kv_blocks": pool.num_blocks,
                "kv_blocks_free": pool.num_free,
                "kernels": self.backend.kind,
            }
        if self.budget is not None:
            out["kv_budget"] = self.budget.as_dict()
        if self.memory_plan is not None:
            out["memory_plan"] = self.memory_plan.as_dict()
        if self.vision is not None:
            v, proc = self.vision.cfg.vision, self.vision.processor
            out["vision"] = {
                "architecture": v.kind,
                "layers": v.depth,
                "hidden_size": v.hidden_size,
                "patch_size": v.patch_size,
                "min_pixels": proc.min_pixels,
                "max_pixels": proc.max_pixels,
            }
        return out
