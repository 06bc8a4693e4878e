"""Fakes for tests: a scripted source and a sysfs tree laid out like an Orin's."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping, Sequence, Union

from .sample import Sample
from .sources import Source

# A field script: a constant, a sequence (indexed by call count, the last value
# repeats), or a callable of the call index (index_by="call") or of the sample
# time (index_by="time").
Script = Union[Any, Sequence[Any], Callable[[float], Any]]

DEFAULT_ZONE = "tj"


class FakeSource(Source):
    """A source whose readings are scripted.

    ``temperatures`` values may be a float (one zone, ``zone``) or a mapping
    zone -> °C; ``rails_w`` a mapping rail -> W; the others plain values. Each
    argument is a :data:`Script`. ``None`` means "unknown".

    >>> src = FakeSource(temperatures=[80, 90, 96], power_w=lambda t: 10 + t,
    ...                  index_by="call")
    """

    def __init__(self, *, temperatures: Script = None, power_w: Script = None,
                 rails_w: Script = None, gpu_load: Script = None,
                 gpu_freq_hz: Script = None, power_mode: Script = None,
                 throttle_reasons: Script = None, index_by: str = "call",
                 zone: str = DEFAULT_ZONE, name: str = "fake") -> None:
        if index_by not in ("call", "time"):
            raise ValueError("index_by must be 'call' or 'time'")
        self.name = name
        self.index_by = index_by
        self.zone = zone
        self.scripts = dict(temperatures=temperatures, power_w=power_w, rails_w=rails_w,
                            gpu_load=gpu_load, gpu_freq_hz=gpu_freq_hz,
                            power_mode=power_mode, throttle_reasons=throttle_reasons)
        self.calls = 0
        self.closed = False
        self._lock = threading.Lock()

    def _value(self, script: Script, i: int, t: float) -> Any:
        if callable(script):
            return script(i if self.index_by == "call" else t)
        if isinstance(script, (list, tuple)) and not isinstance(script, str):
            if not script:
                return None
            return script[min(i, len(script) - 1)]
        return script

    def read(self, t: float | None = None, wall_time: float | None = None) -> Sample:
        t, wall_time = self._stamps(t, wall_time)
        with self._lock:
            i = self.calls
            self.calls += 1
        v = {k: self._value(s, i, t) for k, s in self.scripts.items()}
        temps = v["temperatures"]
        if temps is None:
            temps = {}
        elif not isinstance(temps, Mapping):
            temps = {self.zone: float(temps)}
        else:
            temps = {str(k): float(x) for k, x in temps.items() if x is not None}
        rails = dict(v["rails_w"] or {})
        reasons = v["throttle_reasons"]
        return Sample(time=t, wall_time=wall_time, source=self.name, temperatures_c=temps,
                      power_w=None if v["power_w"] is None else float(v["power_w"]),
                      rails_w=rails,
                      gpu_load=v["gpu_load"], gpu_freq_hz=v["gpu_freq_hz"],
                      power_mode=v["power_mode"],
                      throttle_reasons=None if reasons is None else tuple(reasons))

    def close(self) -> None:
        self.closed = True


# Thermal zones and INA3221 rails of an Orin, in sysfs units.
ORIN_ZONES_MC: dict[str, int] = {
    "cpu-thermal": 45500,
    "gpu-thermal": 44000,
    "soc0-thermal": 43250,
    "tj-thermal": 46000,
}
# rail -> (mV, mA)
ORIN_RAILS: dict[str, tuple[int, int]] = {
    "VDD_IN": (5000, 1500),
    "VDD_CPU_GPU_CV": (4992, 400),
    "VDD_SOC": (4996, 600),
}


def write_fake_sysfs(root: str | os.PathLike, *,
                     zones_mc: Mapping[str, int | str] | None = None,
                     rails: Mapping[str, tuple[int | str, int | str]] | None = None,
                     gpu_freq_hz: int | None = 918000000,
                     gpu_load_permille: int | None = 350,
                     hwmon_index: int = 1) -> str:
    """Write a sysfs tree like a Jetson Orin's under ``root``; returns ``root``.

    ``zones_mc`` maps zone type -> millidegrees (written as text, so a string
    plants garbage); ``rails`` maps label -> (mV, mA). Defaults:
    :data:`ORIN_ZONES_MC` and :data:`ORIN_RAILS`. The hwmon directory holds
    ``name`` == ``ina3221``; ``hwmon0`` is another (non-INA) sensor.
    """
    root = os.fspath(root)
    zones_mc = ORIN_ZONES_MC if zones_mc is None else zones_mc
    rails = ORIN_RAILS if rails is None else rails

    def write(rel: str, text: object) -> None:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{text}\n")

    for i, (zone, mc) in enumerate(zones_mc.items()):
        write(f"class/thermal/thermal_zone{i}/type", zone)
        write(f"class/thermal/thermal_zone{i}/temp", mc)
    if rails:
        write("class/hwmon/hwmon0/name", "nvme")
        write("class/hwmon/hwmon0/temp1_input", 38850)
        h = f"class/hwmon/hwmon{hwmon_index}"
        write(f"{h}/name", "ina3221")
        for ch, (label, (mv, ma)) in enumerate(rails.items(), start=1):
            write(f"{h}/in{ch}_label", label)
            write(f"{h}/in{ch}_input", mv)
            write(f"{h}/curr{ch}_input", ma)
            write(f"{h}/in{ch}_enable", 1)
    if gpu_freq_hz is not None:
        write("class/devfreq/17000000.gpu/cur_freq", gpu_freq_hz)
        write("class/devfreq/17000000.gpu/device/of_node/name", "gpu")
        if gpu_load_permille is not None:
            write("class/devfreq/17000000.gpu/device/load", gpu_load_permille)
    return root


def write_fake_jetson(root: str | os.PathLike, *, model: str = "NVIDIA Jetson Orin NX Engineering Reference "
                      "Developer Kit", l4t: str = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic",
                      power_mode: tuple[int, str] = (0, "MAXN"), jetson_clocks: bool = False,
                      gpu_freq_hz: int = 918000000, **sysfs: Any) -> str:
    """A filesystem root like a Jetson Orin's: ``sys`` from :func:`write_fake_sysfs` (extra
    keyword arguments go there), the device-tree model, the L4T release, nvpmodel's status
    and configuration, the GPU's devfreq and cpu0's cpufreq limits (pinned at their maximum
    when ``jetson_clocks``)."""
    root = os.fspath(root)
    write_fake_sysfs(os.path.join(root, "sys"), gpu_freq_hz=gpu_freq_hz, **sysfs)

    def write(rel: str, text: object) -> None:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{text}\n")

    write("proc/device-tree/model", model + "\0")
    write("etc/nv_tegra_release", l4t)
    mode_id, name = power_mode
    write("var/lib/nvpmodel/status", f"pmode:{mode_id:04d} fmode:quiet")
    write("etc/nvpmodel.conf", "\n".join(f"< POWER_MODEL ID={i} NAME={n} >" for i, n in
                                          sorted({mode_id: name, 0: "MAXN", 1: "10W", 2: "15W"}.items())))
    gpu = "sys/class/devfreq/17000000.gpu"
    write(f"{gpu}/max_freq", gpu_freq_hz)
    write(f"{gpu}/min_freq", gpu_freq_hz if jetson_clocks else 306000000)
    cpu = "sys/devices/system/cpu/cpu0/cpufreq"
    write(f"{cpu}/scaling_max_freq", 1984000)
    write(f"{cpu}/scaling_min_freq", 1984000 if jetson_clocks else 729600)
    write(f"{cpu}/scaling_cur_freq", 1984000 if jetson_clocks else 1190400)
    return root
