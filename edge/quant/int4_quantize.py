"""Offline int4 quantization: a float checkpoint -> compressed-tensors ``pack-quantized``.

``tools/quantize.py SRC DST --bits 4 [--group-size 128] [--method rtn|awq]`` writes the
format llm-compressor writes (and vLLM, transformers with ``compressed-tensors`` and
edge load): per linear ``weight_packed`` int32 ``[out, in/8]`` (code i at bits 4i,
stored as q + 8 of the signed code, i.e. the unsigned code), ``weight_scale``
``[out, in/G]`` in the model's dtype, ``weight_zero_point`` int32 ``[out/8, in/G]``
packed along the rows (asymmetric groups) and ``weight_shape``; config.json gains the
``quantization_config``. The lm_head and the embedding stay float in the file, as in
published checkpoints (edge holds them as int8 at load).

Methods:

* ``rtn``: round to nearest, per group over [min(w, 0), max(w, 0)]
  (:func:`edge.quant.int4.quantize_rtn`).
* ``awq``: activation-aware scaling before RTN. A calibration text shipped with the
  repository (:data:`edge.model.random_model.CORPUS`, tokenized by the checkpoint's own
  tokenizer) runs through the float model (transformers, on the CPU or a GPU); for each
  group of linears that read one input (q/k/v after the input norm, gate/up after the
  post-attention norm, down after up, o after v when no heads are shared), the input
  channels are scaled by ``s = mean|x|^a`` (normalised), the weights multiplied by
  ``s`` and the producer (the norm weight, up's or v's rows) divided by it, with
  ``a`` in 0, 0.05, ..., 0.95 chosen per group to minimise the error of the quantized
  group's outputs on the calibration activations. The float model's function is
  unchanged by the scaling; only which weights round well is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge.model.config import ModelConfig
from edge.quant.int4 import DEFAULT_GROUP_SIZE, Int4Codes, codes_dequantize, quantize_rtn
from edge.model.loader import INDEX_FILE, checkpoint_files
from edge.model.writing import progress_bar, save_safetensors, tensor_data_bytes
from edge.quant.q8_0 import LINEAR_SUFFIXES, QuantError, copy_checkpoint_extras

log = logging.getLogger(__name__)

METHODS = ("rtn", "awq")
AWQ_GRID = 20
CALIBRATION_TOKENS = 512


def _pack_int32(values: torch.Tensor) -> torch.Tensor:
    """``[n, 8 m]`` codes 0..15 -> int32 ``[n, m]``, code i of a word at bits 4i."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(8):
        words |= v[..., i] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def compressed_tensors(base: str, c: Int4Codes, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one linear (asymmetric groups)."""
    out, _ = shape
    rows8 = -(-out // 8) * 8
    zero = torch.zeros(rows8, c.zero.shape[1], dtype=torch.uint8)
    zero[:out] = c.zero.cpu()
    return {
        base + ".weight_packed": _pack_int32(c.q.cpu()),
        base + ".weight_scale": c.scale.cpu().contiguous(),
        base + ".weight_zero_point": _pack_int32(zero.t().contiguous()).t().contiguous(),
        base + ".weight_shape": torch.tensor(list(shape), dtype=torch.int64),
    }


def quantization_config(group_size: int) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": False,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
            }
        },
    }


# -- AWQ scaling ---------------------------------------------------------------------


def _layer_groups(cfg: ModelConfig, i: int) -> list[tuple[str, list[str], str]]:
    """(producer tensor, scaled linears, input key) of layer i."""
    p = f"model.layers.{i}."
    groups = [
        (p + "input_layernorm.weight", [p + f"self_attn.{n}_proj.weight" for n in "qkv"], p + "self_attn.q_proj"),
        (p + "post_attention_layernorm.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
         p + "mlp.gate_proj"),
        (p + "mlp.up_proj.weight", [p + "mlp.down_proj.weight"], p + "mlp.down_proj"),
    ]
    if cfg.num_kv_heads == cfg.num_heads:  # v's rows map one to one onto o's input channels
        groups.append((p + "self_attn.v_proj.weight", [p + "self_attn.o_proj.weight"], p + "self_attn.o_proj"))
    return groups


def calibration_inputs(
    src: Path, cfg: ModelConfig, tokens: int = CALIBRATION_TOKENS, progress: bool = False
) -> dict[str, torch.Tensor]:
    """Inputs ``[tokens, in]`` (float32, CPU) of every layer's q, gate, down and o
    projections on the calibration text, from the float model run by transformers;
    ``progress``: a bar on stderr counting the inputs captured."""
    try:
        import transformers
    except ImportError as exc:
        raise QuantError("--method awq runs the float model through transformers: pip install transformers") from exc
    ids = _calibration_ids(src, cfg, tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    keys = [key for i in range(cfg.num_layers) for _, _, key in _layer_groups(cfg, i)]
    with progress_bar(len(keys), "AWQ: calibration inputs", progress, unit="input") as bar:
        for key in keys:
            module = model.get_submodule(key)

            def hook(_m: Any, args: tuple, _out: Any, key: str = key) -> None:
                captured[key] = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()
                bar.update(1)

            hooks.append(module.register_forward_hook(hook))
        with torch.no_grad():
            model(torch.tensor([ids], device=device))
    for h in hooks:
        h.remove()
    del model
    return captured


def _calibration_ids(src: Path, cfg: ModelConfig, tokens: int) -> list[int]:
    from edge.model.random_model import CORPUS

    tok_file = src / "tokenizer.json"
    if not tok_file.is_file():
        raise QuantError(f"{src} has no tokenizer.json: --method awq needs it to tokenize the calibration text")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tok_file)).encode(CORPUS).ids
    ids = [i for i in ids if i < cfg.vocab_size]
    while len(ids) < tokens:  # a short corpus for a large vocab repeats
        ids = ids + ids
    return ids[:tokens]


def awq_scales(x: torch.Tensor, weights: list[torch.Tensor], group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """The per-input-channel scale ``s`` of one group: ``mean|x|^a`` normalised, ``a``
    on a grid, minimising ``|x W^T - x (Q(W s) / s)^T|^2`` summed over the group."""
    xf = x.float()
    w = torch.cat([t.float() for t in weights])
    ref = xf @ w.T
    x_mean = xf.abs().mean(0).clamp(min=1e-8)
    best, best_err = torch.ones_like(x_mean), float("inf")
    for k in range(AWQ_GRID):
        a = k / AWQ_GRID
        s = x_mean.pow(a)
        s = s / (s.max() * s.min()).sqrt()
        deq = codes_dequantize(quantize_rtn(w * s, group_size, scale_dtype)) / s
        err = float(((xf @ deq.T) - ref).pow(2).mean())
        if err < best_err:
            best, best_err = s, err
    return best


def awq_plan(
    tensors: Callable[[str], torch.Tensor],
    cfg: ModelConfig,
    inputs: dict[str, torch.Tensor],
    group_size: int,
    scale_dtype: torch.dtype,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every layer group's scale: (tensor -> scale of its input columns, producer ->
    scale its rows (or vector) are divided by). A tensor can be both (up, v); the two
    commute. ``progress``: a bar on stderr counting the groups searched."""
    cols: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    groups = [g for i in range(cfg.num_layers) for g in _layer_groups(cfg, i)]
    with progress_bar(len(groups), "AWQ: scale search", progress, unit="group") as bar:
        for producer, linears, key in groups:
            s = awq_scales(inputs[key], [tensors(n) for n in linears], group_size, scale_dtype)
            for n in linears:
                cols[n] = s
            rows[producer] = s
            bar.update(1)
    return cols, rows


# -- the checkpoint ------------------------------------------------------------------


def quantize_checkpoint_int4(
    src: str | Path, dst: str | Path, group_size: int = DEFAULT_GROUP_SIZE, method: str = "rtn",
    progress: bool = False,
) -> dict[str, Any]:
    """Write the int4 compressed-tensors copy of the float checkpoint ``src`` into
    ``dst`` (module docstring). Returns a summary. ``progress``: bars on stderr for the
    calibration, the scale search and the bytes quantized."""
    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    if method not in METHODS:
        raise QuantError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if not src.is_dir():
        raise FileNotFoundError(f"model directory {src} does not exist")
    if dst.resolve() == src.resolve():
        raise QuantError("the destination must differ from the source directory")
    cfg = ModelConfig.from_pretrained(src)
    if cfg.raw.get("quantization_config"):
        raise QuantError(f"{src} is already quantized ({cfg.raw['quantization_config'].get('quant_method')})")
    files = checkpoint_files(src)
    linears = sorted(n for n in files if n.startswith("model.layers.") and n.endswith(LINEAR_SUFFIXES))
    if not linears:
        raise QuantError(f"{src} holds no linear projection weights to quantize")
    with safe_open(str(files[linears[0]]), framework="pt", device="cpu") as f:
        wdtype = f.get_slice(linears[0]).get_dtype()
    scale_dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(wdtype, torch.float16)
    for n in linears:
        with safe_open(str(files[n]), framework="pt", device="cpu") as f:
            shape = tuple(f.get_slice(n).get_shape())
        if len(shape) != 2 or shape[1] % group_size:
            raise QuantError(f"{n}: shape {shape} is not 2-D with in_features a multiple of {group_size}")

    # AWQ: the scales of every group first (one pass over the float model), applied as
    # each tensor is written.
    cols: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    if method == "awq":
        inputs = calibration_inputs(src, cfg, progress=progress)

        def read(name: str) -> torch.Tensor:
            with safe_open(str(files[name]), framework="pt", device="cpu") as f:
                return f.get_tensor(name)

        cols, rows = awq_plan(read, cfg, inputs, group_size, scale_dtype, progress)
        del inputs

    dst.mkdir(parents=True, exist_ok=True)
    shard_names: dict[Path, list[str]] = {}
    for name, path in files.items():
        shard_names.setdefault(path, []).append(name)
    weight_map: dict[str, str] = {}
    bytes_in = bytes_out = 0
    qset = set(linears)
    total = sum(tensor_data_bytes(path) for path in shard_names)
    with progress_bar(total, f"int4 {method}: quantizing {src.name}", progress) as bar:
        for path, names in sorted(shard_names.items()):
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in sorted(names):
                    t = f.get_tensor(name)
                    bytes_in += t.numel() * t.element_size()
                    bar.update(t.numel() * t.element_size())
                    if name in cols or name in rows:
                        dtype = t.dtype
                        t = t.float()
                        if name in cols:
                            t = t * cols[name]
                        if name in rows:
                            t = t / rows[name] if t.dim() == 1 else t / rows[name].unsqueeze(1)
                        if name not in qset:
                            t = t.to(dtype)
                    if name in qset:
                        c = quantize_rtn(t, group_size, scale_dtype, name)
                        out |= compressed_tensors(name.removesuffix(".weight"), c, tuple(t.shape))
                    else:
                        out[name] = t.contiguous()
                    del t
            for name, t in out.items():
                bytes_out += t.numel() * t.element_size()
                weight_map[name] = path.name
            save_safetensors(out, dst / path.name, {"format": "pt"})
            del out
    if (src / INDEX_FILE).is_file():
        index = {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(group_size)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_checkpoint_extras(src, dst)
    summary = {
        "src": str(src), "dst": str(dst), "bits": 4, "method": method, "group_size": group_size,
        "format": "compressed-tensors pack-quantized", "quantized_tensors": len(qset),
        "bytes_in": bytes_in, "bytes_out": bytes_out,
    }
    log.info("int4 %s: %d tensors of %s: %d -> %d bytes", method, len(qset), src, bytes_in, bytes_out)
    return summary
