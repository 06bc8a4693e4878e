"""torch's CPU threads, set on purpose by the process that owns the engine.

torch starts as many intra-op threads as there are cores and spins them between ops:
beside another busy process (the voice front-end's ASR, a second request's tokenizer) a
CPU decode then loses most of its speed to threads waiting for a core. So:

* on a GPU the host only launches kernels and samples: ``GPU_THREADS`` threads;
* on the CPU the backend computes everything, but leaves ``CPU_CORES_LEFT`` of the cores
  this process may run on (its affinity, which ``CPUAffinity=`` / cpusets restrict) to the
  processes beside it;

``EDGE_TORCH_THREADS`` / ``--torch-threads`` (Settings.torch_threads) overrides both. A
first start compiles its kernel variants in up to ``MAX_COMPILE_THREADS`` threads.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

GPU_THREADS = 2
CPU_CORES_LEFT = 2
# NVRTC compiles at once at a first start: each holds its working memory beside the weights being loaded.
MAX_COMPILE_THREADS = 4


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(device_type: str, requested: int | None = None, cores: int | None = None) -> int:
    """The intra-op thread count for an engine on ``device_type`` ("cpu" or "cuda")."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"torch threads must be at least 1, got {requested}")
        return requested
    cores = available_cores() if cores is None else cores
    if device_type == "cpu":
        return max(1, cores - CPU_CORES_LEFT)
    return max(1, min(GPU_THREADS, cores))


def apply_threads(device_type: str, requested: int | None = None) -> int:
    """Set torch's intra-op threads (and one inter-op thread where torch still allows it)."""
    import torch

    n = choose_threads(device_type, requested)
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # the engine runs no parallel torch graphs
    except RuntimeError:  # torch allows it once, before any inter-op work
        pass
    log.debug("torch CPU threads: %d of %d cores%s", n, available_cores(), "" if requested is None else " (as set)")
    return n


def compile_threads() -> int:
    """Threads compiling kernel variants at a first start (edge/kernels/prebuild.py)."""
    return max(1, min(MAX_COMPILE_THREADS, available_cores()))
