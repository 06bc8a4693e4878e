"""Service settings: command line > environment > config file > defaults.

The config file is in systemd's ``EnvironmentFile=`` format (``KEY=VALUE`` lines,
``#``/``;`` comments, optional quotes), so one file, ``/etc/edge/edge.env``, serves
both the unit and ``edge serve --config``. Variables the service does not read
itself (the monitor's ``EDGE_THERMAL_*``, ``EDGE_CACHE_DIR``, ...) are exported from
the file into the process environment unless the environment already sets them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from edge.runtime.budget import parse_bytes, parse_kv_dtype, parse_reserve
from edge.speculative.params import SpeculativeParams

log = logging.getLogger(__name__)


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")


def parse_optional_bool(text: str) -> bool | None:
    return None if text.strip().lower() in ("", "auto") else parse_bool(text)


def kernel_choice(text: str) -> str:
    if text not in ("auto", "cuda", "reference"):
        raise ValueError(f"expected auto, cuda or reference, got {text!r}")
    return text


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise ValueError(f"must be a positive integer, got {v}")
    return v


def power_of_two(text: str) -> int:
    v = int(text)
    if v < 1 or v & (v - 1):
        raise ValueError(f"must be a power of two, got {v}")
    return v


def parse_speculative(text: str) -> SpeculativeParams | None:
    """``METHOD[:K]`` (``ngram:4``, ``draft``) or ``off``."""
    if text.strip().lower() in ("", "off", "none"):
        return None
    method, _, k = text.strip().partition(":")
    params = SpeculativeParams(method, int(k) if k else SpeculativeParams.num_tokens)
    params.validate()
    return params


def positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise ValueError(f"must be > 0, got {v}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise ValueError(f"port must be in 0..65535, got {v}")
    return v


def _file_mode(text: str) -> int:
    v = int(text, 8)
    if not 0 <= v <= 0o777:
        raise ValueError(f"must be an octal file mode such as 0660, got {text!r}")
    return v


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def quantize_choice(text: str) -> str | None:
    """``int8`` / ``int4`` (quantize a float checkpoint while loading), or ``none``."""
    t = text.strip().lower()
    if t in ("", "none", "off"):
        return None
    if t not in ("int8", "int4"):
        raise ValueError(f"expected int8, int4 or none, got {text!r}")
    return t


def lm_head_choice(text: str) -> str:
    """How an int4 model holds its lm_head: auto (as published; int8 where only that fits), float, int8, int4."""
    t = text.strip().lower()
    if t not in ("auto", "float", "int8", "int4"):
        raise ValueError(f"expected auto, float, int8 or int4, got {text!r}")
    return t


def embedding_choice(text: str) -> str:
    """How an int4 model holds its embedding: auto (as published; int8 where only that fits), float, int8."""
    t = text.strip().lower()
    if t not in ("auto", "float", "int8"):
        raise ValueError(f"expected auto, float or int8, got {text!r}")
    return t


def non_negative_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise ValueError(f"must be >= 0, got {v}")
    return v


@dataclass
class Settings:
    """Everything ``edge serve`` needs. Field -> environment variable in ``ENV``."""

    model: str | None = None  # None: the embedded random model
    model_name: str | None = None  # id in /v1/models and responses (default: directory name)
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None  # listen on this Unix socket instead of TCP
    uds_mode: int = 0o660  # permissions of the socket file
    uds_group: str | None = None  # group of the socket file (name or number; default: ours)
    api_key_file: str | None = None  # bearer key required on /v1/* when set
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback and the bind address ("*": any)
    cors_origins: tuple[str, ...] = ()  # origins sent CORS headers (none by default)
    queue_size: int = 8
    device: str | None = None
    dtype: str | None = None
    kernels: str = "auto"  # "reference": the torch path, chosen explicitly (no kernels, no graphs)
    page_size: int = 16
    max_seq_len: int | None = None
    kv_blocks: int | None = None  # KV block pool size (default: the memory budget)
    kv_memory: int | None = None  # KV pool size in bytes (default: the memory budget)
    kv_dtype: str = "auto"  # how K/V rows are held: "auto" (the model's dtype) or "int8"
    memory_reserve: int | None = None  # kept free on an integrated GPU (default: edge.runtime.budget.DEFAULT_RESERVE)
    prefill_chunk: int | None = None  # the largest background prefill chunk (default: the engine's, 512)
    prefill_budget_ms: float | None = None  # time per background chunk (default: 2x the ITL alone, measured)
    prefix_cache: bool = True
    grammar_time_limit_s: float = 10.0  # a response format / tool set must compile within this
    speculative: SpeculativeParams | None = None  # speculative decoding of requests that do not choose
    draft_model: str | None = None  # the draft model directory of speculative method "draft"
    cuda_graph: bool | None = None  # None: on a GPU
    skip_weight_check: bool = False  # True: load weights holding NaN/inf without refusing
    # -- memory and CPU: quantizing while loading, the int4 lm_head / embedding, torch's threads --
    quantize: str | None = None  # int8 | int4: quantize a float checkpoint while loading
    quant_lm_head: str = "auto"  # int4 models: auto (as published; int8 where only that fits), float, int8, int4
    quant_embedding: str = "auto"  # int4 models: auto, float, int8
    torch_threads: int | None = None  # torch's CPU threads (None: edge.runtime.threads' choice for the device)
    default_max_tokens: int | None = None  # None: the rest of the context, as OpenAI
    shutdown_grace_s: float = 5.0  # SIGTERM: streams get this long, then are cancelled
    max_body: int | None = None  # request body bytes before 413 (None: max(1 MiB, 64 B x context))
    # Images in chat requests (vision-language models): per image and per request.
    image_max_bytes: int = 10 << 20
    image_max_pixels: int = 40_000_000
    max_images: int = 4
    image_max_memory: int = 192 << 20  # decoded pixels and conversions of one image at a time
    allow_remote_images: bool = False  # fetch http(s) image URLs (off: data: URLs only)
    # Connections: a request head and body must arrive in time; past the cap, 503.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    max_connections: int = 256  # lowered to fit the file descriptor limit
    log_level: str = "info"
    config: str | None = None  # the file these settings were read from (informative)


# variable -> (field, parser)
ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "EDGE_MODEL": ("model", str),
    "EDGE_MODEL_NAME": ("model_name", str),
    "EDGE_HOST": ("host", str),
    "EDGE_PORT": ("port", _port),
    "EDGE_UDS": ("uds", str),
    "EDGE_UDS_MODE": ("uds_mode", _file_mode),
    "EDGE_UDS_GROUP": ("uds_group", str),
    "EDGE_API_KEY_FILE": ("api_key_file", str),
    "EDGE_ALLOWED_HOSTS": ("allowed_hosts", _comma_list),
    "EDGE_CORS_ORIGINS": ("cors_origins", _comma_list),
    "EDGE_QUEUE_SIZE": ("queue_size", positive_int),
    "EDGE_DEVICE": ("device", str),
    "EDGE_KERNELS": ("kernels", kernel_choice),
    "EDGE_DTYPE": ("dtype", str),
    "EDGE_PAGE_SIZE": ("page_size", power_of_two),
    "EDGE_MAX_SEQ_LEN": ("max_seq_len", positive_int),
    "EDGE_KV_BLOCKS": ("kv_blocks", positive_int),
    "EDGE_KV_MEMORY": ("kv_memory", parse_bytes),
    "EDGE_KV_DTYPE": ("kv_dtype", parse_kv_dtype),
    "EDGE_MEMORY_RESERVE": ("memory_reserve", parse_reserve),
    "EDGE_PREFILL_CHUNK": ("prefill_chunk", positive_int),
    "EDGE_PREFILL_BUDGET_MS": ("prefill_budget_ms", positive_float),
    "EDGE_GRAMMAR_TIME_LIMIT_S": ("grammar_time_limit_s", positive_float),
    "EDGE_PREFIX_CACHE": ("prefix_cache", parse_bool),
    "EDGE_SPECULATIVE": ("speculative", parse_speculative),
    "EDGE_DRAFT_MODEL": ("draft_model", str),
    "EDGE_CUDA_GRAPH": ("cuda_graph", parse_optional_bool),
    "EDGE_SKIP_WEIGHT_CHECK": ("skip_weight_check", parse_bool),
    "EDGE_QUANTIZE": ("quantize", quantize_choice),
    "EDGE_QUANT_LM_HEAD": ("quant_lm_head", lm_head_choice),
    "EDGE_QUANT_EMBEDDING": ("quant_embedding", embedding_choice),
    "EDGE_TORCH_THREADS": ("torch_threads", positive_int),
    "EDGE_DEFAULT_MAX_TOKENS": ("default_max_tokens", positive_int),
    "EDGE_SHUTDOWN_GRACE_S": ("shutdown_grace_s", non_negative_float),
    "EDGE_MAX_BODY": ("max_body", parse_bytes),
    "EDGE_IMAGE_MAX_BYTES": ("image_max_bytes", parse_bytes),
    "EDGE_IMAGE_MAX_PIXELS": ("image_max_pixels", positive_int),
    "EDGE_MAX_IMAGES": ("max_images", positive_int),
    "EDGE_IMAGE_MAX_MEMORY": ("image_max_memory", parse_bytes),
    "EDGE_ALLOW_REMOTE_IMAGES": ("allow_remote_images", parse_bool),
    "EDGE_HEADER_TIMEOUT_S": ("header_timeout_s", positive_float),
    "EDGE_BODY_TIMEOUT_S": ("body_timeout_s", positive_float),
    "EDGE_KEEP_ALIVE_S": ("keep_alive_s", positive_float),
    "EDGE_MAX_CONNECTIONS": ("max_connections", positive_int),
    "EDGE_LOG_LEVEL": ("log_level", str),
}
FIELD_PARSERS: dict[str, Callable[[str], Any]] = {name: parse for name, parse in ENV.values()}

# Read elsewhere in the process (not by Settings): not typos when found in the file.
OTHER_KNOWN_VARS = frozenset({"EDGE_CONFIG", "EDGE_CACHE_DIR", "EDGE_CUDA_INCLUDE", "OLLAMA_MODELS"})


def from_environment(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Field ``name`` as its variable in ``environ`` (default ``os.environ``) sets it,
    parsed, or None when unset (the commands other than ``serve`` take their defaults so)."""
    environ = os.environ if environ is None else environ
    for var, (field_name, parse) in ENV.items():
        if field_name == name:
            raw = environ.get(var)
            if raw is None or raw == "":
                return None
            try:
                return parse(raw)
            except ValueError as exc:
                raise ValueError(f"bad {var}={raw!r} (environment): {exc}") from None
    raise KeyError(f"no variable sets {name!r}")


def parse_env_file(text: str, source: str = "<config>") -> dict[str, str]:
    """Parse systemd ``EnvironmentFile=`` syntax: ``KEY=VALUE`` per line; blank lines
    and lines starting with ``#`` or ``;`` are skipped; a value may be wrapped in
    single or double quotes (backslash escapes inside double quotes); a trailing
    backslash continues the line. A leading ``export`` is tolerated (shell files)."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        lineno = i + 1
        line = lines[i]
        i += 1
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + lines[i]
            i += 1
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export ") :].lstrip()
        key, sep, value = stripped.partition("=")
        key = key.strip()
        if not sep or not key or not (key[0].isalpha() or key[0] == "_") or not all(
            c.isalnum() or c == "_" for c in key
        ):
            raise ValueError(f"{source}:{lineno}: expected KEY=VALUE, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            quote, value = value[0], value[1:-1]
            if quote == '"':
                value = _unescape(value)
        out[key] = value
    return out


def _unescape(value: str) -> str:
    out, it = [], iter(value)
    for c in it:
        if c == "\\":
            nxt = next(it, "")
            out.append({"n": "\n", "t": "\t"}.get(nxt, nxt))
        else:
            out.append(c)
    return "".join(out)


def load_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {p} does not exist") from None
    values = parse_env_file(text, str(p))
    known = set(ENV) | OTHER_KNOWN_VARS | _monitor_vars()
    for key in values:
        if key.startswith("EDGE_") and key not in known:
            log.warning("%s: unknown variable %s (typo?)", p, key)
    return values


def _monitor_vars() -> set[str]:
    try:
        from edge.monitor import MonitorConfig

        return set(MonitorConfig.ENV)
    except Exception:  # pragma: no cover - the monitor is part of the package
        return set()


def resolve(
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """Settings from ``cli`` (field -> value; None means "not given") over
    ``environ`` (default ``os.environ``) over the file (``config_file``, else
    ``cli["config"]``, else ``$EDGE_CONFIG``) over the defaults.

    Returns the settings and the file's variables (for :func:`export_file_vars`).
    Raises ValueError naming the variable or flag for a bad value.
    """
    cli = dict(cli or {})
    environ = os.environ if environ is None else environ
    path = config_file or cli.get("config") or environ.get("EDGE_CONFIG") or None
    file_vars = load_env_file(path) if path else {}
    s = Settings()
    names = {f.name for f in fields(Settings)}
    for layer_name, layer in (("config file", file_vars), ("environment", environ)):
        for var, (name, parse) in ENV.items():
            raw = layer.get(var)
            if raw is None or raw == "":
                continue
            try:
                setattr(s, name, parse(raw))
            except ValueError as exc:
                where = f"{path}" if layer_name == "config file" else "environment"
                raise ValueError(f"bad {var}={raw!r} ({where}): {exc}") from None
    for name, value in cli.items():
        if value is None or name not in names:
            continue
        parse = FIELD_PARSERS.get(name, str)
        if parse is not str:  # the same rules as the variable, so --port 99999 fails here, not in uvicorn
            try:
                value = parse(str(value))
            except ValueError as exc:
                raise ValueError(f"bad --{name.replace('_', '-')} {value}: {exc}") from None
        setattr(s, name, value)
    s.config = str(path) if path else None
    s.log_level = s.log_level.lower()
    return s, file_vars


def export_file_vars(file_vars: Mapping[str, str], environ: Any = None) -> None:
    """Make the file's variables visible to the rest of the process (the monitor's
    ``MonitorConfig.from_env``, ``EDGE_CACHE_DIR``) without overriding the environment."""
    environ = os.environ if environ is None else environ
    for key, value in file_vars.items():
        environ.setdefault(key, value)


def read_api_key(path: str | os.PathLike[str]) -> str:
    """The bearer key: the file's first non-empty line, stripped. A key file others may
    read is used, with a warning."""
    from edge.model.files import check_regular, read_text

    p = Path(path)
    try:
        check_regular(p, ValueError, 1 << 16)
    except FileNotFoundError:
        raise FileNotFoundError(f"API key file {p} does not exist") from None
    except ValueError as exc:
        raise ValueError(f"API key file: {exc}") from None
    mode = p.stat().st_mode
    if mode & 0o004:
        log.warning("API key file %s is readable by every user (mode %03o); make it private: chmod 600 %s",
                    p, mode & 0o777, p)
    text = read_text(p, ValueError, 1 << 16)
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    raise ValueError(f"API key file {p} is empty")


def ollama_models_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The local Ollama store that ``--model ollama:NAME[:TAG]`` reads: ``$OLLAMA_MODELS``
    (Ollama's own variable), else ``~/.ollama/models``."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()
