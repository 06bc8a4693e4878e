"""``edge pull``: real checkpoints from the Hugging Face Hub, with the one recommended for each board.

The download is huggingface_hub's ``snapshot_download`` into a plain directory (progress
bars, parallel files, and a resumed download where an interrupted one left off: running
the same command again fetches only what is missing). Only the files the engine reads
are fetched (config, tokenizer, chat template, processor, safetensors weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# What the engine reads from a checkpoint; *.bin / *.pth / *.gguf copies and ONNX exports are skipped.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "additional_chat_templates/*"]


class PullError(RuntimeError):
    """A download that cannot be made; the message is one line naming the fix."""


@dataclass(frozen=True)
class Checkpoint:
    name: str  # what `edge pull NAME` takes
    repo: str  # the Hugging Face repository id
    format: str
    boards: str  # where it fits, with room for the KV cache and the OS


# Qwen's own checkpoints, in the formats the engine loads as published.
CATALOGUE = (
    Checkpoint("qwen3-8b-awq", "Qwen/Qwen3-8B-AWQ", "int4 AWQ", "AGX Orin 64 GB / 32 GB"),
    Checkpoint("qwen3-4b-awq", "Qwen/Qwen3-4B-AWQ", "int4 AWQ", "Orin NX 16 GB (also AGX Orin, Orin Nano 8 GB)"),
    Checkpoint("qwen3-1.7b", "Qwen/Qwen3-1.7B", "bf16 (add --quantize int8 to halve it)", "Orin Nano 8 GB"),
    Checkpoint("qwen3-8b", "Qwen/Qwen3-8B", "bf16", "AGX Orin 64 GB, a discrete GPU"),
    Checkpoint("qwen3-vl-2b", "Qwen/Qwen3-VL-2B-Instruct", "bf16, images", "any Orin (images: edge generate --image)"),
    Checkpoint("qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", "bf16, images", "AGX Orin 64 GB, a discrete GPU"),
)

GIB = 2**30


def recommended(total_memory: int) -> Checkpoint:
    """The catalogue's text model for a board with ``total_memory`` bytes of (unified) memory."""
    name = "qwen3-8b-awq" if total_memory >= 30 * GIB else "qwen3-4b-awq" if total_memory >= 12 * GIB else "qwen3-1.7b"
    return lookup(name)


def lookup(name: str) -> Checkpoint:
    for c in CATALOGUE:
        if c.name == name.lower():
            return c
    raise PullError(f"unknown checkpoint {name!r}: give one of {', '.join(c.name for c in CATALOGUE)} "
                    "or a Hugging Face repository id (owner/name)")


def resolve(model: str) -> str:
    """A repository id from a catalogue name or an ``owner/name`` id."""
    if "/" in model:
        owner, _, name = model.partition("/")
        if not owner or not name or "/" in name:
            raise PullError(f"{model!r} is not a Hugging Face repository id (owner/name)")
        return model
    return lookup(model).repo


def default_directory(repo: str, models_dir: Path) -> Path:
    return models_dir / repo.split("/")[-1]


def pull(repo: str, directory: Path, revision: str | None = None, token: str | None = None) -> Path:
    """Download ``repo`` (at ``revision``) into ``directory``; PullError in one line when
    the repository, the revision or the network is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (  # where every release since 0.23 exports them
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(repo, revision=revision, local_dir=directory, allow_patterns=ALLOW_PATTERNS,
                                 token=token)
    except GatedRepoError:
        raise PullError(f"{repo} is gated: accept its licence on its Hugging Face page, then log in "
                        "(hf auth login) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise PullError(f"no repository {repo} on the Hugging Face Hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise PullError(f"{repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise PullError(f"cannot reach the Hugging Face Hub to download {repo} (offline, or a proxy is needed: "
                        "HTTPS_PROXY); what was downloaded is kept, and the same command resumes") from None
    except HfHubHTTPError as exc:
        raise PullError(f"downloading {repo}: {' '.join(str(exc).split())}") from None
    except OSError as exc:  # a full disk, a directory that cannot be written
        raise PullError(f"downloading {repo} into {directory}: {exc.strerror or exc}") from None
    path = Path(path)
    if not (path / "config.json").is_file():
        raise PullError(f"{repo} has no config.json: not a model checkpoint the engine can load")
    return path
