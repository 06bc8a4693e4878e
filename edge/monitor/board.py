"""What a benchmark must record about the board it ran on, and the energy it used.

Numbers nobody can reproduce are numbers whose power mode was never stated, so a result
carries: the module (device-tree model), the L4T release, the ``nvpmodel`` power mode,
whether ``jetson_clocks`` pinned the clocks, and the GPU and CPU clocks, read from files
(``/`` by default; a fake tree in tests, :func:`edge.monitor.fake.write_fake_jetson`).
Anything absent (any machine that is not a Jetson) is None.

Files read (relative to ``root``):

* ``proc/device-tree/model``; ``etc/nv_tegra_release`` (``# R36 (release), REVISION: 4.3``);
* ``var/lib/nvpmodel/status`` (``pmode:0000``) and the mode's name in ``etc/nvpmodel.conf``
  (``< POWER_MODEL ID=0 NAME=MAXN >``);
* the GPU's devfreq node (``sys/class/devfreq/*``, as edge/monitor/sysfs_source.py finds
  it): ``cur_freq``, ``min_freq``, ``max_freq``; ``jetson_clocks`` pins ``min_freq`` to
  ``max_freq``, which is how it is recognised, with ``cpu0``'s ``scaling_min_freq`` /
  ``scaling_max_freq`` (also pinned by it).

Energy (:func:`measure_energy`) integrates the monitor's total power over a run with the
service's own :class:`~edge.monitor.energy.EnergyMeter`: on a Jetson jtop's total or the
INA3221 input rail (sysfs), elsewhere NVML's board power.
"""

from __future__ import annotations

import glob
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from .sysfs_source import GPU_DEVFREQ_NAMES

T = TypeVar("T")


@dataclass(frozen=True)
class BoardFacts:
    model: str | None = None  # "NVIDIA Jetson AGX Orin Developer Kit"
    l4t: str | None = None  # "R36.4.3"
    power_mode: str | None = None  # nvpmodel's name of the mode, "MAXN"
    power_mode_id: int | None = None
    jetson_clocks: bool | None = None  # clocks pinned at their maximum
    gpu_freq_hz: int | None = None
    gpu_min_freq_hz: int | None = None
    gpu_max_freq_hz: int | None = None
    cpu_freq_khz: int | None = None
    cpu_max_freq_khz: int | None = None

    @property
    def is_jetson(self) -> bool:
        return self.l4t is not None or (self.model or "").startswith("NVIDIA Jetson")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip().strip("\x00")
    except OSError:
        return None


def _int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def read_board(root: str | os.PathLike[str] = "/") -> BoardFacts:
    """The facts of the board under ``root`` (see the module docstring)."""
    r = os.fspath(root)
    model = _read(os.path.join(r, "proc/device-tree/model"))
    l4t = None
    release = _read(os.path.join(r, "etc/nv_tegra_release"))
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release or "")
    if m:
        l4t = f"R{m.group(1)}.{m.group(2)}"
    mode_id, mode = _nvpmodel(r)
    gpu = _gpu_devfreq(r)
    cur = lo = hi = None
    if gpu is not None:
        cur, lo, hi = (_int(os.path.join(gpu, f)) for f in ("cur_freq", "min_freq", "max_freq"))
    cpu = os.path.join(r, "sys/devices/system/cpu/cpu0/cpufreq")
    cpu_cur, cpu_min, cpu_max = (_int(os.path.join(cpu, f)) for f in
                                 ("scaling_cur_freq", "scaling_min_freq", "scaling_max_freq"))
    pinned = None
    if lo is not None and hi is not None:
        pinned = lo == hi and (cpu_min is None or cpu_min == cpu_max)
    return BoardFacts(model, l4t, mode, mode_id, pinned, cur, lo, hi, cpu_cur, cpu_max)


def _nvpmodel(root: str) -> tuple[int | None, str | None]:
    status = _read(os.path.join(root, "var/lib/nvpmodel/status")) or ""
    m = re.search(r"pmode:\s*(\d+)", status)
    if m is None:
        return None, None
    mode_id = int(m.group(1))
    conf = _read(os.path.join(root, "etc/nvpmodel.conf")) or ""
    for cid, name in re.findall(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)\s*>", conf):
        if int(cid) == mode_id:
            return mode_id, name
    return mode_id, None


def _gpu_devfreq(root: str) -> str | None:
    for d in sorted(glob.glob(os.path.join(root, "sys/class/devfreq/*"))):
        name = (_read(os.path.join(d, "device/of_node/name")) or "").lower()
        if name in GPU_DEVFREQ_NAMES or os.path.basename(d).rsplit(".", 1)[-1].lower() in GPU_DEVFREQ_NAMES:
            return d
    return None


@dataclass(frozen=True)
class Energy:
    seconds: float
    joules: float | None  # None: no power reading
    source: str

    @property
    def watts(self) -> float | None:
        return None if self.joules is None or self.seconds <= 0 else self.joules / self.seconds


def measure_energy(monitor: Any, run: Callable[[], T], settle_s: float | None = None) -> tuple[T, Energy]:
    """``run()`` between the energy meter's begin and end (``monitor``: a started
    :class:`~edge.monitor.Monitor`); one more sample period is waited for after it, so the
    last interval is measured rather than extrapolated."""
    meter, key = monitor.energy, object()
    t0 = meter.clock()
    meter.begin(key, t0)  # an active request keeps its samples from being pruned
    result = run()
    t1 = meter.clock()
    time.sleep(monitor.sampler.period_s if settle_s is None else settle_s)
    return result, Energy(t1 - t0, meter.end(key, t1), monitor.source_name)
