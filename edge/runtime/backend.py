"""The backend: which implementation serves each op of one engine, chosen once.

:func:`select_backend` plans it in ``Engine.__init__`` from the device, the dtype, the
model's shapes and weight formats and the operator's choice (``kernels``): the layer
ops (embedding, norms, q/k norm + RoPE, SwiGLU), the paged attention, one linear per
weight format and the decode tuning. The result is a frozen :class:`Backend` that the
model receives at construction; nothing here is process-wide, so two engines in one
process with different backends do not affect each other.

On a CUDA device the kernels must load unless the operator chose the reference
(``kernels="reference"``): a failure raises :class:`BackendUnavailable` with one line
naming what is missing and the fix. A model shape a kernel cannot take is planned to
the torch reference for that op and listed in ``planned_reference`` (logged, and shown
by ``edge info`` and ``/health``); a call outside the plan is an error, never a silent
fallback.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from edge.model.config import ModelConfig
from edge.kernels import reference
from edge.quant.gguf import FORMAT as GGUF_FORMAT
from edge.quant.gguf import GGUFEmbedding, GGUFReferenceLinear, GGUFWeight
from edge.quant.int4 import Int4ReferenceLinear, Int4Weight
from edge.kernels.int4_cuda import Int4Tuning
from edge.kernels.int8_cuda import Int8Tuning
from edge.kernels.paged_cuda import DecodeTuning
from edge.quant.linear import FloatLinear, Int8ReferenceLinear, Linears, weight_format
from edge.quant.q8_0 import QUANT_METHOD, Int8Weight

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "cuda", "reference")
LAYER_OPS = ("embedding", "rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul")


class BackendUnavailable(RuntimeError):
    """The CUDA kernels the engine needs cannot be used; the message says what is
    missing and how to fix it (one line)."""


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """The fused decoder-layer ops, each the kernel or the torch reference."""

    embedding: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]
    qk_norm_rope: Callable[..., Any]
    silu_mul: Callable[..., torch.Tensor]
    # The graph step's last launch (token into the pinned ring, pos += 1); None without kernels.
    decode_step_end: Callable[..., None] | None
    names: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class AttentionOps:
    """Paged attention and the KV write."""

    name: str
    write_kv: Callable[..., None]
    decode_attention: Callable[..., torch.Tensor]
    decode_attention_rope: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    # Reads the position from device memory: what a captured decode step needs.
    device_position: bool
    # (dtype, head_dim, q_heads, kv_heads, page) -> decode kwargs that make eager launches
    # identical to the graph's; None for the reference.
    graph_decode_options: Callable[..., dict[str, int]] | None = None
    # The speculative verify step: T query tokens at a device-resident position (from q,
    # or from the qkv rows with the q/k norms, RoPE and the K/V store).
    verify_attention: Callable[..., torch.Tensor] = reference.verify_attention
    verify_attention_rope: Callable[..., torch.Tensor] = reference.verify_attention_rope


@dataclasses.dataclass(frozen=True)
class StepKernels:
    """Everything one forward launches: layer ops, attention, linears."""

    layer: LayerOps
    attention: AttentionOps
    linears: Linears


@dataclasses.dataclass(frozen=True)
class Backend:
    kind: str  # "cuda" or "reference"
    device: torch.device
    eager: StepKernels
    # The captured decode step's kernels (launches overlapped where the device can).
    graph: StepKernels | None
    decode_tuning: DecodeTuning | None = None
    int8_tuning: Int8Tuning | None = None
    int4_tuning: Int4Tuning | None = None
    overlap_launches: bool = False
    launcher: Any = None  # edge.kernels.launcher.Launcher on CUDA
    sms: int | None = None
    planned_reference: tuple[str, ...] = ()

    @property
    def cuda_graph_capable(self) -> bool:
        return self.graph is not None and self.graph.attention.device_position

    def describe(self) -> dict[str, Any]:
        """What ``engine.info()`` / ``/health`` report."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "attention": self.eager.attention.name,
            "layer_ops": dict(self.eager.layer.names),
            "linears": self.eager.linears.describe(),
            "overlapped_launches": self.overlap_launches,
            "planned_reference": list(self.planned_reference),
        }
        if self.sms is not None:
            out["sms"] = self.sms
        if self.decode_tuning is not None:
            out["decode_tuning"] = dataclasses.asdict(self.decode_tuning)
        if self.int8_tuning is not None:
            out["int8_tuning"] = dataclasses.asdict(self.int8_tuning)
        if self.int4_tuning is not None:
            out["int4_tuning"] = dataclasses.asdict(self.int4_tuning)
        return out

    def launch_counts(self) -> dict[str, int]:
        """Kernel launches by name so far (CUDA backends; captures count once)."""
        return dict(self.launcher.counts) if self.launcher is not None else {}


def _reference_layer(why: Mapping[str, str] | None = None) -> LayerOps:
    names = {op: "reference" + (f" ({why[op]})" if why and why.get(op) else "") for op in LAYER_OPS}
    return LayerOps(
        reference.embedding, reference.rms_norm, reference.add_rms_norm, reference.qk_norm_rope, reference.silu_mul,
        None, names,
    )


_REFERENCE_ATTENTION = AttentionOps(
    "reference (torch)",
    reference.write_kv,
    reference.decode_attention,
    reference.decode_attention_rope,
    reference.prefill_attention,
    device_position=False,
)


def reference_backend(device: torch.device | str = "cpu", why: str | None = None) -> Backend:
    """The torch reference for every op (the CPU path and the kernels' oracle)."""
    layer = _reference_layer()
    kernels = StepKernels(layer, _REFERENCE_ATTENTION, _reference_linears(layer))
    return Backend("reference", torch.device(device), kernels, None, planned_reference=(why,) if why else ())


def _reference_linears(layer: LayerOps) -> Linears:
    return Linears({
        "float": FloatLinear(layer), QUANT_METHOD: Int8ReferenceLinear(layer), Int4Weight.FORMAT: Int4ReferenceLinear(layer),
        GGUF_FORMAT: GGUFReferenceLinear(layer),
    })


def kernel_fix_hint(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"CUDA kernels cannot be used: {first}. Fix: install the CUDA Python stack matching the driver "
        "(JetPack 6 / CUDA 12: pip install -c constraints-jetpack6.txt -e '.[jetson]'; x86 CUDA 13: "
        "pip install -e '.[cuda]'), or choose the slow torch reference explicitly with --kernels reference "
        "(EDGE_KERNELS=reference)"
    )


def select_backend(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    weights: Iterable[Any] = (),
    *,
    kernels: str = "auto",
    overlap_launches: bool | None = None,
    decode_tuning: DecodeTuning | None = None,
    int8_tuning: Int8Tuning | None = None,
    int4_tuning: Int4Tuning | None = None,
    sms: int | None = None,
    kv_int8: bool = False,
) -> Backend:
    """Plan the backend of one engine (see the module docstring). ``weights`` are the
    model's weights, checked once against what the linear kernels take; ``sms`` is the
    SM count the plans fill (default: what the current CUDA context has); ``kv_int8``:
    the KV cache holds int8 rows (the attention loads those kernels too)."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    device = torch.device(device)
    if device.type != "cuda":
        if kernels == "cuda":
            raise BackendUnavailable(f"kernels='cuda' needs a CUDA device, got {device}")
        return reference_backend(device)
    if kernels == "reference":
        log.warning("torch reference kernels on %s, as chosen: no CUDA graphs, slow decode", device)
        return reference_backend(device, "chosen by the operator (kernels='reference')")
    weights = list(weights)
    _check_verified_on_gpu(weights, kv_int8)
    try:
        return _cuda_backend(
            cfg, device, dtype, weights, overlap_launches, decode_tuning, int8_tuning, int4_tuning, sms, kv_int8
        )
    except BackendUnavailable:
        raise
    except Exception as exc:  # the kernels' import, compile or load failed
        from edge.kernels.nvrtc import KernelCompileError, KernelsUnavailable

        if isinstance(exc, (KernelsUnavailable, KernelCompileError, ImportError, OSError)):
            raise BackendUnavailable(kernel_fix_hint(exc)) from exc
        raise


def _check_verified_on_gpu(weights: list[Any], kv_int8: bool) -> None:
    """Refuse, in one line, the CUDA kernels that have not yet matched the torch reference
    on a GPU (int8 K/V, GGUF blocks): their CPU reference path is exact, the GPU one is not
    yet proven, and a wrong answer must never be served silently."""
    what = []
    if kv_int8:
        what.append("int8 K/V (--kv-dtype int8)")
    if any(isinstance(w, (GGUFWeight, GGUFEmbedding)) for w in weights):
        what.append("GGUF weights")
    if what:
        raise BackendUnavailable(
            f"the CUDA kernels for {' and '.join(what)} have not passed their GPU checks against the torch "
            "reference in this release: use --kernels reference on this GPU (slow, exact), or the CPU"
        )


def _cuda_backend(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    weights: list[Any],
    overlap_launches: bool | None,
    decode_tuning: DecodeTuning | None,
    int8_tuning: Int8Tuning | None,
    int4_tuning: Int4Tuning | None,
    sms: int | None,
    kv_int8: bool = False,
) -> Backend:
    from edge.kernels import fused_cuda, gguf_cuda, int4_cuda, int8_cuda, nvrtc, paged_cuda
    from edge.kernels.launcher import Launcher

    dev = nvrtc.device_index(device, "the CUDA kernels")
    nvrtc.check_available(dev)
    decode_tuning = decode_tuning or DecodeTuning()
    launcher = Launcher(dev, sms=sms)
    int8_tuning = int8_tuning or Int8Tuning.for_sms(launcher.sm_count())
    int4_tuning = int4_tuning or Int4Tuning.for_sms(launcher.sm_count())
    notes: list[str] = []
    fused = fused_cuda.FusedCuda(launcher)
    why = fused_cuda.shape_support(dtype, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim)
    notes += [f"{op}: {w}" for op, w in why.items() if w]

    attention_why = None
    if dtype not in paged_cuda.DTYPES:
        attention_why = f"no paged attention kernels for {dtype}"
    elif cfg.head_dim not in paged_cuda.HEAD_DIMS:
        attention_why = f"no paged attention kernels for head_dim {cfg.head_dim} (have {paged_cuda.HEAD_DIMS})"
    if attention_why:
        notes.append(f"attention: {attention_why}; no CUDA graphs")

    int8 = [w for w in weights if isinstance(w, Int8Weight)]
    int8_why = next((r for r in (int8_cuda.weight_support(w, dtype) for w in int8) if r), None)
    if int8 and int8_why:
        notes.append(f"int8 linear: {int8_why}")
    int4 = [w for w in weights if isinstance(w, Int4Weight)]
    int4_why = next((r for r in (int4_cuda.weight_support(w, dtype, int4_tuning) for w in int4) if r), None)
    if int4 and int4_why:
        notes.append(f"int4 linear: {int4_why}")

    # GGUF blocks (the tied lm_head multiplies by the embedding's table).
    gguf = [w.table if isinstance(w, GGUFEmbedding) else w for w in weights if isinstance(w, (GGUFWeight, GGUFEmbedding))]
    gguf_why = next((r for r in (gguf_cuda.weight_support(w, dtype) for w in gguf) if r), None)
    if gguf and gguf_why:
        notes.append(f"gguf linear: {gguf_why}")
    gg = None
    if gguf and not gguf_why:
        gg = gguf_cuda.GGUFCudaLinear(launcher, None, qtypes=tuple(sorted({p.qtype for w in gguf for p in w.parts})))

    def step(l: Launcher, fz: fused_cuda.FusedCuda, att: paged_cuda.PagedAttentionCuda | None,
             i8: int8_cuda.Int8CudaLinear | None, i4: int4_cuda.Int4CudaLinear | None) -> StepKernels:
        pick = {op: (reference if why[op] else fz) for op in LAYER_OPS}
        names = {op: ("cuda" if pick[op] is fz else f"reference ({why[op]})") for op in LAYER_OPS}
        layer = LayerOps(
            pick["embedding"].embedding, pick["rms_norm"].rms_norm, pick["add_rms_norm"].add_rms_norm,
            pick["qk_norm_rope"].qk_norm_rope, pick["silu_mul"].silu_mul, fz.decode_step_end, names,
        )
        if att is None:
            attention = _REFERENCE_ATTENTION
        else:
            att = att.with_launcher(l, layer)
            attention = AttentionOps(
                att.name, att.write_kv, att.decode_attention, att.decode_attention_rope, att.prefill_attention,
                device_position=True, graph_decode_options=att.graph_decode_options,
                verify_attention=att.verify_attention, verify_attention_rope=att.verify_attention_rope,
            )
        impls: dict[str, Any] = {"float": FloatLinear(layer)}
        if i8 is not None:
            impls[QUANT_METHOD] = i8.with_launcher(l, layer)
        else:
            impls[QUANT_METHOD] = Int8ReferenceLinear(layer)
        impls[Int4Weight.FORMAT] = i4.with_launcher(l, layer) if i4 is not None else Int4ReferenceLinear(layer)
        impls[GGUF_FORMAT] = gg.with_launcher(l, layer) if gg is not None else GGUFReferenceLinear(layer)
        return StepKernels(layer, attention, Linears(impls))

    att = None
    if attention_why is None:
        att = paged_cuda.PagedAttentionCuda(
            launcher, None, decode_tuning, dtypes=(dtype,), head_dims=(cfg.head_dim,), sms=sms, kv_int8=kv_int8
        )
    i8 = None
    if dtype in int8_cuda.DTYPES and not (int8 and int8_why):
        i8 = int8_cuda.Int8CudaLinear(launcher, None, int8_tuning)
    elif int8 and not int8_why:
        notes.append(f"int8 linear: no GEMV for {dtype} activations")
    # int4 kernels only for a model that has int4 weights (a module per scale dtype).
    i4 = None
    if int4 and not int4_why:
        scale_dtypes = tuple(sorted({w.scale.dtype for w in int4}, key=str))
        i4 = int4_cuda.Int4CudaLinear(launcher, None, int4_tuning, scale_dtypes)
    eager = step(launcher, fused, att, i8, i4)
    graph = None
    if overlap_launches is None:  # int4 decode measured slower overlapped on sm_90 (docs/benchmarks.md)
        overlap_launches = not int4
    if att is not None:
        glauncher = launcher.overlapped() if overlap_launches else launcher
        graph = eager if glauncher is launcher else step(glauncher, fused.with_launcher(glauncher), att, i8, i4)
    backend = Backend(
        "cuda",
        device,
        eager,
        graph,
        decode_tuning,
        int8_tuning,
        int4_tuning if int4 else None,
        overlap_launches=graph is not None and graph is not eager and glauncher.overlap,
        launcher=launcher,
        sms=launcher.sm_count(),
        planned_reference=tuple(notes),
    )
    for note in notes:
        log.warning("planned to the torch reference: %s", note)
    return backend


def weight_formats(weights: Iterable[Any]) -> list[str]:
    return sorted({weight_format(w) for w in weights})
