"""Llama / Qwen2 / Qwen3 decoder in plain torch, run against a KV backend.

One sequence at a time (the scheduler decodes one conversation while the other
prefills), so activations are ``[T, hidden]`` with no batch dimension. Numerics follow
Hugging Face: RMSNorm in float32 then cast, RoPE tables in float32 cast to the model
dtype, attention softmax in float32.

Every op goes through the model's :class:`edge.runtime.backend.Backend`, given at construction
and never changed (:meth:`Model.with_backend` makes another model on the same weights):
the layer ops (norms, q/k norm + RoPE, SwiGLU), one linear per weight format, and, in
the KV cache, the attention. A forward takes the backend's eager kernels unless told
otherwise (the captured decode step passes the graph's). A decode token on a paged
cache hands its qkv row to the cache (``SequenceKV.attend_rope``), whose attention
kernel does the q/k norm, RoPE and K/V store itself. With int8 projections whose
kernel fuses, the decode GEMV also takes the norms, residual adds and SwiGLU into its
own launches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edge.runtime.backend import Backend, StepKernels, reference_backend
from edge.model.config import ModelConfig, rope_inv_freq, rope_tables
from edge.kernels.reference import Rope
from edge.model.kv import SequenceKV
from edge.quant.int4 import DEFAULT_GROUP_SIZE as DEFAULT_INT4_GROUP_SIZE
from edge.quant.gguf import GGUFWeight
from edge.quant.int4 import Int4Weight
from edge.model.loader import expected_shapes, load_weights
from edge.quant.q8_0 import (
    Int8Weight,
    QuantError,
    Norm,
    Weight,
    checkpoint_quantization,
    load_quantized_weights,
    parse_quantize,
    weight_tensors,
)

if TYPE_CHECKING:
    from edge.model.vision.runtime import Deepstack


class Model:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor | Int8Weight],
        max_seq_len: int,
        backend: Backend | None = None,
    ) -> None:
        self.cfg = cfg
        self.w = weights
        embed = weights["model.embed_tokens.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        self.backend = backend if backend is not None else reference_backend(self.device)
        # A quantized embedding (int4 models) ties the lm_head to its int8 table.
        tied = embed if isinstance(embed, torch.Tensor) else embed.table
        self.lm_head = tied if cfg.tie_word_embeddings else weights["lm_head.weight"]
        # How the weights are held (quantized models): engine.info() reports it.
        self.weight_formats: dict[str, str] | None = None
        self.layers = [self._layer_weights(i) for i in range(cfg.num_layers)]
        # The norm after each layer's residual add: the next layer's input norm, or the
        # final norm after the last layer.
        for lw, nxt in zip(self.layers, self.layers[1:]):
            lw["ln_out"] = nxt["ln1"]
        self.layers[-1]["ln_out"] = weights["model.norm.weight"]
        # Every projection quantized (int8, int4 or GGUF blocks): forward may fold norms
        # and residual adds into them where their kernel fuses.
        self.int8_projections = all(
            isinstance(lw[k], (Int8Weight, Int4Weight, GGUFWeight))
            for lw in self.layers for k in ("qkv", "o", "gate_up", "down")
        )
        cos, sin_signed = rope_tables(rope_inv_freq(cfg), max_seq_len)
        self.cos = cos.to(device=self.device, dtype=self.dtype)
        self.sin_signed = sin_signed.to(device=self.device, dtype=self.dtype)
        # Each layer's q/k norm + RoPE arguments for the decode attention that applies them.
        self.ropes = [
            Rope(lw["qk_norm"], self.cos, self.sin_signed, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps)
            for lw in self.layers
        ]

    def with_backend(self, backend: Backend) -> "Model":
        """A model on the same weights and tables (nothing copied) with ``backend``."""
        other = copy.copy(self)
        other.backend = backend
        return other

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_seq_len: int,
        quantize: str | None = None,
        quant_group_size: int | None = None,
        backend: Backend | None = None,
        lm_head: str = "int8",
        embedding: str = "int8",
        checkpoint_name: Callable[[str], str] | None = None,
    ) -> "Model":
        """Load a checkpoint; int8 projections when its metadata says q8_0 (route A) or
        ``quantize="int8"`` asks to quantize a float one while loading (route B); int4
        projections for an AWQ / GPTQ / compressed-tensors checkpoint or with
        ``quantize="int4"`` (edge.quant.int4_checkpoints; ``lm_head`` / ``embedding`` say how
        an int4 model holds those: int8 by default). ``checkpoint_name``: edge's tensor
        name -> the checkpoint's (a vision-language model's decoder, edge/vision)."""
        from edge.quant.int4_checkpoints import Int4Format, describe_weights, detect_format, load_int4_weights, parse_int4

        fmt = detect_format(model_dir)
        if parse_int4(quantize):
            if fmt is not None:
                raise QuantError(f"{model_dir} is already an int4 checkpoint ({fmt.describe()}); drop --quantize")
            if checkpoint_quantization(model_dir) is not None:
                raise QuantError(f"{model_dir} is already quantized (q8_0); int4 quantizes float checkpoints")
            fmt = Int4Format("rtn", quant_group_size or DEFAULT_INT4_GROUP_SIZE)
        elif fmt is not None and quantize is not None and parse_quantize(quantize) is not None:
            raise QuantError(f"{model_dir} is an int4 checkpoint ({fmt.describe()}); it cannot be quantized to {quantize}")
        if fmt is not None:
            weights = load_int4_weights(
                model_dir, cfg, device, dtype, fmt, lm_head=lm_head, embedding=embedding, checkpoint_name=checkpoint_name
            )
            model = cls(cfg, weights, max_seq_len, backend)
            model.weight_formats = describe_weights(weights, fmt)
            return model
        if parse_quantize(quantize) is not None or checkpoint_quantization(model_dir) is not None:
            names = None if checkpoint_name is None else {n: checkpoint_name(n) for n in expected_shapes(cfg)}
            weights = load_quantized_weights(
                model_dir, cfg, device, dtype, quantize, quant_group_size, tensor_names=names
            )
            return cls(cfg, weights, max_seq_len, backend)
        return cls(cfg, load_weights(model_dir, cfg, device, dtype, checkpoint_name=checkpoint_name), max_seq_len, backend)

    def _layer_weights(self, i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        w = self.w
        return {
            "ln1": w[p + "input_layernorm.weight"],
            "ln2": w[p + "post_attention_layernorm.weight"],
            "qkv": w[p + "self_attn.qkv_proj.weight"],
            "qkv_b": w.get(p + "self_attn.qkv_proj.bias"),
            "o": w[p + "self_attn.o_proj.weight"],
            "qk_norm": self._qk_norm(p),
            "gate_up": w[p + "mlp.gate_up_proj.weight"],
            "down": w[p + "mlp.down_proj.weight"],
        }

    def _qk_norm(self, prefix: str) -> torch.Tensor | None:
        """Qwen3's q_norm and k_norm weights stacked per head ``[heads + kv_heads, D]``."""
        if not self.cfg.qk_norm:
            return None
        q = self.w[prefix + "self_attn.q_norm.weight"]
        k = self.w[prefix + "self_attn.k_norm.weight"]
        return torch.cat((q.expand(self.cfg.num_heads, -1), k.expand(self.cfg.num_kv_heads, -1)))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: SequenceKV) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``, for tokens ``ids`` at
        ``positions`` (device tensors of length T; positions int64 or int32). Writes
        their K/V through ``kv``."""
        h, norm = self.hidden(ids, positions, kv)
        return h if norm is None else self.backend.eager.layer.rms_norm(h, *norm)

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: SequenceKV,
        kernels: StepKernels | None = None,
        embeds: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        deepstack: Deepstack | None = None,
    ) -> tuple[torch.Tensor, Norm | None]:
        """:meth:`forward` with the final RMSNorm still pending where the int8 decode
        GEMVs fold the norms in (an int8 lm_head's then takes it too): ``(h, norm)``,
        ``norm`` the ``(weight, eps)`` still to apply to ``h`` (None: ``h`` is
        normalised). :meth:`logits` and :meth:`greedy_token` take ``norm``. ``kernels``:
        the backend's eager kernels unless given (the captured step's).

        Vision-language prompts (edge/vision) pass ``embeds`` ``[T, hidden]``, the input
        embeddings with image features in (taken as the residual stream: modified in
        place), ``rope``, cos / signed-sin tables whose row p is the RoPE of sequence
        position p (multimodal positions, or a decode's position + delta), and
        ``deepstack``, features added at image rows after the first layers."""
        kern = kernels or self.backend.eager
        ops, linear = kern.layer, kern.linears
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        t = ids.shape[0]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # The residual stream.
        x = embeds if embeds is not None else ops.embedding(ids, self.w["model.embed_tokens.weight"])
        cos, sin = rope if rope is not None else (self.cos, self.sin_signed)
        ropes = self.ropes if rope is None else [r._replace(cos=cos, sin_signed=sin) for r in self.ropes]
        # Two plans. The int8 decode GEMV folds each RMSNorm into the projection that
        # reads it (scaling its dot product by 1/rms: the normalised row is never
        # rounded to bf16) and each residual add into the projection that produces it.
        # Otherwise (float weights, prefill chunks, CPU) one add_rms_norm kernel does
        # add + norm.
        fused = self.int8_projections and linear.fuses(x, self.layers[0]["qkv"])
        # What the next projection reads, and the norm it still applies to it.
        h, norm = (x, (self.layers[0]["ln1"], eps)) if fused else (ops.rms_norm(x, self.layers[0]["ln1"], eps), None)
        for i, lw in enumerate(self.layers):
            qkv = linear(h, lw["qkv"], lw["qkv_b"], norm=norm)
            # A decode token (or a verify step): the paged cache's attention takes the q/k
            # norms, RoPE and the K/V store into its own launch.
            attn = kv.attend_rope(i, qkv, ropes[i])
            if attn is None:
                # Qwen3's per-head q/k norms (when present) and RoPE in one op, which
                # also stores k and v in a paged cache (one launch fewer per layer); a
                # cache without pages gets k and v (a view) from attend.
                pages = kv.pages(i)
                q, k = ops.qk_norm_rope(qkv, lw["qk_norm"], cos, sin, positions, heads, kv_heads, d, eps, pages)
                v = None if pages is not None else qkv[:, cfg.q_size + cfg.kv_size :].view(t, kv_heads, d)
                attn = kv.attend(i, q, k, v)
            h, norm = self._add_projection(kern, x, attn.reshape(t, cfg.q_size), lw["o"], lw["ln2"], fused)
            act = linear(h, lw["gate_up"], norm=norm, swiglu=True)
            # The last layer's norm is the final one.
            if deepstack is not None and i < len(deepstack.features):
                h, norm = self._add_deepstack(kern, x, act, lw["down"], lw["ln_out"], fused, deepstack, i)
            else:
                h, norm = self._add_projection(kern, x, act, lw["down"], lw["ln_out"], fused)
        return h, norm

    def _add_deepstack(
        self,
        kern: StepKernels,
        x: torch.Tensor,
        a: torch.Tensor,
        w: Weight,
        ln: torch.Tensor,
        fused: bool,
        ds: Deepstack,
        i: int,
    ) -> tuple[torch.Tensor, Norm | None]:
        """:meth:`_add_projection` with layer ``i``'s DeepStack features added to the
        residual stream at the image rows before the next norm."""
        x.add_(kern.linears(a, w))
        x[ds.rows] += ds.features[i]
        eps = self.cfg.rms_norm_eps
        return (x, (ln, eps)) if fused else (kern.layer.rms_norm(x, ln, eps), None)

    def _add_projection(
        self, kern: StepKernels, x: torch.Tensor, a: torch.Tensor, w: Weight, ln: torch.Tensor, fused: bool
    ) -> tuple[torch.Tensor, Norm | None]:
        """``x += linear(a, w)`` in place; returns the next projection's input and the
        RMSNorm (weight ``ln``) it still has to apply."""
        eps = self.cfg.rms_norm_eps
        if fused:
            kern.linears(a, w, residual=x)
            return x, (ln, eps)
        return kern.layer.add_rms_norm(x, kern.linears(a, w), ln, eps), None

    def logits(self, hidden: torch.Tensor, norm: Norm | None = None, kernels: StepKernels | None = None) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` of ``hidden`` (``norm``: the final norm still to
        apply, from :meth:`hidden`)."""
        return (kernels or self.backend.eager).linears(hidden, self.lm_head, norm=norm).float()

    def greedy_token(
        self,
        hidden: torch.Tensor,
        out: torch.Tensor | None = None,
        norm: Norm | None = None,
        kernels: StepKernels | None = None,
    ) -> torch.Tensor:
        """Greedy token ids ``[T]`` (int64), the argmax of :meth:`logits`; an int8 lm_head's
        kernel finds it without writing the logits (``out`` receives the ids)."""
        return (kernels or self.backend.eager).linears.greedy_token(hidden, self.lm_head, out, norm=norm)

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for w in self.w.values():
            for t in weight_tensors(w):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total
