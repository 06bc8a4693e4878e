"""Writing checkpoint files: the permissions a plain file gets, and progress on stderr.

safetensors' ``save_file`` creates its file with mode 0600 whatever the umask, so a
checkpoint written by root would be unreadable by the service's own user. Every model
writer saves through :func:`save_safetensors`, which gives the file the mode ``open()``
would (0644 under the usual umask 022; the umask is still honoured). Long writes report
through :func:`progress_bar` (tqdm on stderr, redrawn at most once a second).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
import torch
from tqdm import tqdm

# At most one redraw a second: a log file or a slow terminal is not flooded.
PROGRESS_INTERVAL_S = 1.0


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so no thread sees it changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_file_mode() -> int:
    return 0o666 & ~current_umask()


def plain_dir_mode() -> int:
    return 0o777 & ~current_umask()


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str],
                     metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the mode a file created by ``open()`` has."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata=dict(metadata) if metadata is not None else None)
    os.chmod(path, plain_file_mode())


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B") -> tqdm:
    """A progress bar on stderr for ``total`` units (bytes by default, scaled: MB, GB);
    ``enabled`` False: one that prints nothing."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, mininterval=PROGRESS_INTERVAL_S, disable=not enabled, leave=True,
                dynamic_ncols=True)



def tensor_data_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte header length
    and the JSON header (a progress bar's total for reading it)."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header
