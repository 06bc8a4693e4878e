"""``--model ollama:NAME[:TAG]``: a model in the local Ollama store, read without Ollama.

The store (``$OLLAMA_MODELS``, else ``~/.ollama/models``: :func:`edge.settings.ollama_models_dir`)
holds one JSON manifest per model and tag, ``manifests/HOST/NAMESPACE/MODEL/TAG``, whose
layer of media type ``application/vnd.ollama.image.model`` names the GGUF file by digest:
``blobs/sha256-HEX``. Names are Ollama's: ``qwen3`` is
``registry.ollama.ai/library/qwen3:latest``, ``user/model:tag`` is in namespace ``user``,
``hf.co/org/repo:Q4_K_M`` on host ``hf.co``.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge.model.gguf_file import GGUFError

PREFIX = "ollama:"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"


def is_ollama_ref(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def manifest_path(name: str, store: Path) -> Path:
    """Where the manifest of ``NAME[:TAG]`` lies in ``store``."""
    ref = name.strip()
    if not ref or any(c.isspace() for c in ref) or ".." in ref.split("/"):
        raise GGUFError(f"bad Ollama model name {name!r}; expected NAME[:TAG], e.g. ollama:qwen3:8b")
    path_part, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", DEFAULT_TAG)
    parts = path_part.split("/")
    if len(parts) == 1:
        parts = [DEFAULT_HOST, DEFAULT_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [DEFAULT_HOST, *parts]
    if len(parts) != 3 or not all(parts) or not tag:
        raise GGUFError(f"bad Ollama model name {name!r}; expected [HOST/][NAMESPACE/]MODEL[:TAG]")
    return store.joinpath("manifests", *parts, tag)


def resolve_ollama(spec: str, store: Path | None = None) -> Path:
    """The GGUF blob of ``ollama:NAME[:TAG]`` in the local store."""
    if store is None:
        from edge.settings import ollama_models_dir

        store = ollama_models_dir()
    name = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    manifest = manifest_path(name, store)
    if not manifest.is_file():
        raise FileNotFoundError(
            f"Ollama model {name!r} is not in the local store {store} (no {manifest.relative_to(store)}); "
            f"pull it with `ollama pull {name}` or set OLLAMA_MODELS"
        )
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digests = [layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GGUFError(f"unreadable Ollama manifest {manifest}: {' '.join(str(exc).split())}") from None
    if len(digests) != 1:
        raise GGUFError(f"Ollama manifest {manifest} has {len(digests)} model layers, expected one")
    algo, _, hexdigest = digests[0].partition(":")
    if not hexdigest or "/" in hexdigest or "/" in algo:
        raise GGUFError(f"Ollama manifest {manifest}: bad digest {digests[0]!r}")
    blob = store / "blobs" / f"{algo}-{hexdigest}"
    if not blob.is_file():
        raise FileNotFoundError(f"Ollama model {name!r}: its weights {blob} are missing (pull it again)")
    return blob
