"""The tensors a checkpoint of a config holds and how the loader fuses them, without torch
(the fit check, edge/runtime/memory_plan.py, sizes a model from them before loading it)."""

from __future__ import annotations

from edge.model.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a float checkpoint of this config must hold, with its shape."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (cfg.q_size,),
                p + "self_attn.k_proj.bias": (cfg.kv_size,),
                p + "self_attn.v_proj.bias": (cfg.kv_size,),
            }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
    return shapes


FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def fused_layout(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
    """Where each checkpoint tensor goes: (destination name, first row in it).

    q/k/v and gate/up are stacked along the output dimension so decode runs one
    matmul where the checkpoint has three (or two): fewer, larger kernels.
    """
    layout: dict[str, tuple[str, int]] = {}
    for name in shapes:
        layout[name] = (name, 0)
    for name in shapes:
        prefix, _, tail = name.partition("layers.")
        if not tail:
            continue
        idx, _, local = tail.partition(".")
        for fused, parts in FUSED.items():
            if local in parts:
                row = sum(shapes[f"{prefix}layers.{idx}.{p}"][0] for p in parts[: parts.index(local)])
                layout[name] = (f"{prefix}layers.{idx}.{fused}", row)
    return layout
