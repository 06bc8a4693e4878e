"""What a loadable model directory is, and one-line errors naming what is wrong.

* ``--model`` must be a directory (a file gets told so, with its directory as hint);
* config.json fields have JSON types the config names (``"hidden_size": "256"`` is an
  error, not a silent conversion);
* every checkpoint tensor has the shape the config implies and a float dtype;
* no weight holds NaN or infinity (on the device, after loading: one reduction per
  tensor, then a single synchronisation).

The loader, the config parser and the engine call these; ``ConfigError`` and
``CheckpointError`` are re-exported by edge/model/config.py and edge/model/loader.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where tensors are checked: the config checks (the fit check) need no torch
    import torch

MODEL_FILES = "config.json, *.safetensors, tokenizer.json"
FINITE_CHUNK = 1 << 24  # elements per reduction: bounds the temporary boolean mask


class ConfigError(ValueError):
    """A config.json this engine cannot run, with the offending field named."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


class NotAModelDirectory(ValueError):
    """``--model`` names a file, not a model directory."""


def model_directory(path: str | Path) -> Path:
    """``path`` as a model directory; FileNotFoundError when it is missing,
    NotAModelDirectory when it is a file (naming the directory that may have been meant)."""
    if isinstance(path, str) and not path.strip():  # Path("") is the current directory
        raise FileNotFoundError("the model directory given is an empty string (did the command meant to print it, "
                                "such as `edge pull`, fail?)")
    p = Path(path)
    if p.is_dir():
        return p
    if p.exists():
        hint = f"; did you mean its directory {p.parent}?" if (p.parent / "config.json").is_file() else ""
        raise NotAModelDirectory(f"--model expects a model directory ({MODEL_FILES}), but {p} is a file{hint}")
    raise FileNotFoundError(f"model directory {p} does not exist")


def check_device_and_dtype(device: str | None, dtype: str | None) -> None:
    """ValueError for a device torch cannot use here or an unknown dtype name."""
    import torch

    if device is not None:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {device!r}; use cpu, cuda or cuda:N")
        # Without a usable GPU the engine's kernel check names the fix (edge/runtime/backend.py).
        if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
            n = torch.cuda.device_count()
            if dev.index >= n:
                raise ValueError(f"device {device!r}: there are {n} CUDA GPU(s)")
    if dtype is not None:
        from edge.model.config import parse_dtype  # edge.model.config imports this module

        parse_dtype(dtype)


# -- config.json -----------------------------------------------------------------------

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
# Far beyond any model this server runs: a larger value is an edited or corrupt file,
# refused before anything is sized from it.
UPPER_BOUNDS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 19,
                "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
                "head_dim": 4096, "max_position_embeddings": 1 << 24}
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _kind(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_config_fields(d: Mapping[str, Any]) -> None:
    """ConfigError for a field of the wrong JSON type or out of range (absent or null
    fields are left to the parser's defaults and required-field checks)."""
    for key in POSITIVE_INTS:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"config.json field {key!r} must be a positive integer, got {_kind(v)}")
        if v is not None and v > UPPER_BOUNDS[key]:
            raise ConfigError(f"config.json field {key!r} is {v}, beyond any model this server runs "
                              f"(at most {UPPER_BOUNDS[key]})")
    for key in POSITIVE_FLOATS:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v <= 0):
            raise ConfigError(f"config.json field {key!r} must be a positive number, got {_kind(v)}")
    for key in BOOLS:
        v = d.get(key)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"config.json field {key!r} must be true or false, got {_kind(v)}")
    for key in TOKEN_IDS:
        v = d.get(key)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"config.json field {key!r} must be a token id or a list of them, got {_kind(v)}")
    for key, kind in (("architectures", list), ("rope_scaling", dict), ("rope_parameters", dict)):
        v = d.get(key)
        if v is not None and not isinstance(v, kind):
            raise ConfigError(f"config.json field {key!r} must be a JSON {'array' if kind is list else 'object'}, "
                              f"got {_kind(v)}")
    heads = d.get("num_attention_heads")
    if d.get("head_dim") is None and heads and d.get("hidden_size", 0) % heads:
        raise ConfigError(f"config.json: hidden_size {d.get('hidden_size')} is not a multiple of "
                          f"num_attention_heads {heads} and no head_dim is given")


# -- tensors ----------------------------------------------------------------------------


def check_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, want: tuple[int, ...]) -> None:
    """A float checkpoint's tensor: the shape the config implies and a float dtype."""
    if tuple(shape) != tuple(want):
        raise CheckpointError(f"tensor {name} has shape {tuple(shape)}, config.json implies {tuple(want)}")
    if not dtype.is_floating_point:
        raise CheckpointError(f"tensor {name} is {dtype}, expected a float dtype (a quantized checkpoint "
                              "needs its metadata and scales: tools/quantize.py)")


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    import torch

    flat = t.reshape(-1)
    return torch.stack([torch.isfinite(c).all() for c in flat.split(FINITE_CHUNK)]).all()


def check_finite_weights(tensors: Iterable[tuple[str, torch.Tensor]], layout: Mapping[str, tuple[str, int]]) -> None:
    """CheckpointError naming the checkpoint tensor that holds NaN or infinity.

    ``tensors``: (loaded weight name, tensor) pairs, a quantized weight's scales among
    them (integer tensors are skipped). ``layout`` maps each checkpoint tensor to
    (loaded weight name, first row), as edge/model/loader.py fuses q/k/v and gate/up; it
    turns a bad row back into a name."""
    import torch

    flags = [(name, t, _all_finite(t)) for name, t in tensors if t.is_floating_point()]
    if not flags or bool(torch.stack([ok for _, _, ok in flags]).all()):
        return
    name, t, _ = next(f for f in flags if not bool(f[2]))
    bad = ~torch.isfinite(t)
    first = [int(i) for i in bad.nonzero()[0]]
    sources = sorted((start, src) for src, (dest, start) in layout.items() if dest == name)
    start, source = next(((st, src) for st, src in reversed(sources) if t.dim() < 2 or st <= first[0]), (0, name))
    if t.dim() > 1:
        first[0] -= start
    raise CheckpointError(f"weight {source} holds {int(bad.sum())} NaN or infinite values (the first at {first}); "
                          "the checkpoint is corrupt (--skip-weight-check loads it anyway)")
