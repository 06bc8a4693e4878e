"""Linux sysfs source: thermal zones, INA3221 power rails, GPU devfreq.

Layout read (relative to the root, default ``/sys``, or ``$EDGE_SYSFS_ROOT``):

* ``class/thermal/thermal_zone*/type`` and ``temp`` (millidegree C);
* INA3221 hwmon devices, ``class/hwmon/hwmon*/`` with ``name`` == ``ina3221``
  and ``bus/i2c/drivers/ina3221/*/hwmon/hwmon*/`` (deduplicated by real path):
  channel N with ``inN_label``, ``inN_input`` (mV) and ``currN_input`` (mA)
  gives rail ``label`` = mV * mA / 1e6 W. Labels ``NC`` and "sum of ..." and
  channels with ``inN_enable`` == 0 are skipped;
* optionally the GPU's devfreq node ``class/devfreq/*`` (``cur_freq`` in Hz,
  ``device/load`` in 0..1000).

Total power is the ``VDD_IN`` rail when the board has one (Orin NX/Nano), else
the sum of the rails (AGX Orin has no input rail). Files that are missing or
hold garbage are skipped with a warning logged once per file.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import Any

from .log_once import log_once
from .sample import Sample
from .sources import Source, SourceUnavailable

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/sys"
ROOT_ENV = "EDGE_SYSFS_ROOT"
TOTAL_RAIL = "VDD_IN"
# Values a zone reports when it is offline (e.g. -256000 on absent CV zones).
MIN_VALID_C = -100.0
MAX_VALID_C = 250.0
GPU_DEVFREQ_NAMES = ("gpu", "ga10b", "gv11b", "gp10b", "gb10b")


def sysfs_root(root: str | os.PathLike | None = None) -> str:
    """The sysfs root: the argument, else ``$EDGE_SYSFS_ROOT``, else ``/sys``."""
    if root is not None:
        return os.fspath(root)
    return os.environ.get(ROOT_ENV) or DEFAULT_ROOT


@dataclass(frozen=True)
class ThermalZone:
    name: str
    temp_path: str


@dataclass(frozen=True)
class Rail:
    name: str
    volt_path: str  # mV
    curr_path: str  # mA


def _sort_key(path: str) -> tuple[str, int]:
    base = os.path.basename(path)
    digits = "".join(ch for ch in base if ch.isdigit())
    return (base.rstrip("0123456789"), int(digits) if digits else -1)


class SysfsSource(Source):
    """Reads thermal zones and INA3221 rails from a sysfs tree."""

    name = "sysfs"

    def __init__(self, root: str | os.PathLike | None = None, *,
                 total_rail: str = TOTAL_RAIL) -> None:
        self.root = sysfs_root(root)
        self.total_rail = total_rail
        self._warned: set[str] = set()
        self.zones = self._find_zones()
        self.rails = self._find_rails()
        self._gpu_freq_path, self._gpu_load_path = self._find_gpu()
        if not self.zones and not self.rails:
            log_once(log, ("sysfs-empty", self.root), logging.INFO,
                     "sysfs source unavailable: no thermal zones or INA3221 rails under %s",
                     self.root)
            raise SourceUnavailable(f"no thermal zones or INA3221 rails under {self.root}")

    # -- file helpers --------------------------------------------------------

    def _warn_once(self, path: str, msg: str, *args: object) -> None:
        if path in self._warned:
            return
        self._warned.add(path)
        log.warning(msg, *args)

    def _read_text(self, path: str) -> str | None:
        try:
            with open(path, encoding="ascii", errors="strict") as f:
                return f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            self._warn_once(path, "sysfs: cannot read %s: %s", path, e)
            return None

    def _read_number(self, path: str) -> float | None:
        text = self._read_text(path)
        if text is None:
            return None
        try:
            return float(int(text))
        except ValueError:
            try:
                return float(text)
            except ValueError:
                self._warn_once(path, "sysfs: garbage in %s: %r", path, text[:40])
                return None

    # -- discovery -----------------------------------------------------------

    def _find_zones(self) -> list[ThermalZone]:
        zones: list[ThermalZone] = []
        seen: dict[str, int] = {}
        pattern = os.path.join(self.root, "class", "thermal", "thermal_zone*")
        for zdir in sorted(glob.glob(pattern), key=_sort_key):
            temp_path = os.path.join(zdir, "temp")
            if not os.path.isfile(temp_path):
                self._warn_once(temp_path, "sysfs: thermal zone %s has no temp file; skipped", zdir)
                continue
            type_path = os.path.join(zdir, "type")
            name = self._read_text(type_path) if os.path.exists(type_path) else None
            if not name:
                if not os.path.exists(type_path):
                    self._warn_once(type_path, "sysfs: thermal zone %s has no type file", zdir)
                name = os.path.basename(zdir)
            if name in seen:  # two zones of the same type: keep both
                seen[name] += 1
                name = f"{name}#{seen[name]}"
            else:
                seen[name] = 0
            zones.append(ThermalZone(name, temp_path))
        return zones

    def _hwmon_dirs(self) -> list[str]:
        found: list[str] = []
        real: set[str] = set()
        candidates = sorted(glob.glob(os.path.join(self.root, "class", "hwmon", "hwmon*")),
                            key=_sort_key)
        candidates += sorted(glob.glob(os.path.join(
            self.root, "bus", "i2c", "drivers", "ina3221", "*", "hwmon", "hwmon*")))
        for d in candidates:
            name_path = os.path.join(d, "name")
            if not os.path.exists(name_path):
                continue
            if self._read_text(name_path) != "ina3221":
                continue
            rp = os.path.realpath(d)
            if rp in real:
                continue
            real.add(rp)
            found.append(d)
        return found

    def _find_rails(self) -> list[Rail]:
        rails: list[Rail] = []
        names: set[str] = set()
        for d in self._hwmon_dirs():
            labels = sorted(glob.glob(os.path.join(d, "in*_label")), key=lambda p: _sort_key(
                os.path.basename(p).split("_")[0]))
            for label_path in labels:
                chan = os.path.basename(label_path)[2:-len("_label")]
                if not chan.isdigit():
                    continue
                label = self._read_text(label_path)
                if not label or label.upper() == "NC" or label.lower().startswith("sum"):
                    continue
                enable_path = os.path.join(d, f"in{chan}_enable")
                if os.path.exists(enable_path) and self._read_text(enable_path) == "0":
                    continue
                volt_path = os.path.join(d, f"in{chan}_input")
                curr_path = os.path.join(d, f"curr{chan}_input")
                missing = [p for p in (volt_path, curr_path) if not os.path.exists(p)]
                if missing:
                    for p in missing:
                        self._warn_once(p, "sysfs: INA3221 rail %s: missing %s; skipped", label, p)
                    continue
                name = label
                n = 1
                while name in names:
                    n += 1
                    name = f"{label}#{n}"
                names.add(name)
                rails.append(Rail(name, volt_path, curr_path))
        return rails

    def _find_gpu(self) -> tuple[str | None, str | None]:
        for d in sorted(glob.glob(os.path.join(self.root, "class", "devfreq", "*"))):
            base = os.path.basename(d).lower()
            of_name_path = os.path.join(d, "device", "of_node", "name")
            of_name = ""
            if os.path.exists(of_name_path):
                of_name = (self._read_text(of_name_path) or "").rstrip("\x00").lower()
            tail = base.rsplit(".", 1)[-1]
            if of_name in GPU_DEVFREQ_NAMES or tail in GPU_DEVFREQ_NAMES:
                freq = os.path.join(d, "cur_freq")
                load = os.path.join(d, "device", "load")
                return (freq if os.path.exists(freq) else None,
                        load if os.path.exists(load) else None)
        return None, None

    # -- reading -------------------------------------------------------------

    def read(self, t: float | None = None, wall_time: float | None = None) -> Sample:
        t, wall_time = self._stamps(t, wall_time)
        temps: dict[str, float] = {}
        for z in self.zones:
            v = self._read_number(z.temp_path)
            if v is None:
                continue
            c = v / 1000.0
            if not (MIN_VALID_C <= c <= MAX_VALID_C):
                log_once(log, ("sysfs-offline-zone", z.temp_path), logging.INFO,
                         "sysfs: zone %s reads %.1f °C (offline?); ignored", z.name, c)
                continue
            temps[z.name] = c

        rails: dict[str, float] = {}
        complete = True
        for r in self.rails:
            mv = self._read_number(r.volt_path)
            ma = self._read_number(r.curr_path)
            if mv is None or ma is None:
                complete = False
                continue
            rails[r.name] = mv * ma / 1e6

        total: float | None
        if any(r.name == self.total_rail for r in self.rails):
            total = rails.get(self.total_rail)
        elif rails and complete:
            total = sum(rails.values())
        else:
            total = None  # a partial sum would under-report

        gpu_load = gpu_freq = None
        if self._gpu_load_path:
            v = self._read_number(self._gpu_load_path)
            if v is not None:
                gpu_load = min(max(v / 1000.0, 0.0), 1.0)
        if self._gpu_freq_path:
            gpu_freq = self._read_number(self._gpu_freq_path)

        return Sample(time=t, wall_time=wall_time, source=self.name, temperatures_c=temps,
                      power_w=total, rails_w=rails, gpu_load=gpu_load, gpu_freq_hz=gpu_freq)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "root": self.root,
                "zones": [z.name for z in self.zones],
                "rails": [r.name for r in self.rails],
                "total_rail": self.total_rail if any(
                    r.name == self.total_rail for r in self.rails) else None,
                "gpu_devfreq": self._gpu_freq_path is not None}
