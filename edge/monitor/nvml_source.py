"""NVML source (``nvidia-ml-py``/``pynvml``) for discrete NVIDIA GPUs.

Reads one GPU: temperature (zone ``gpu``), board power (mW -> W), utilization,
SM clock, and clock-event ("throttle") reasons decoded to names. Where NVML
cannot init (no driver, e.g. a CPU box or a Jetson without NVML) the source is
unavailable.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from .log_once import log_once
from .sample import Sample
from .sources import Source, SourceUnavailable

log = logging.getLogger(__name__)

# Bit -> name, as in nvml.h (nvmlClocksEventReason*, formerly *ThrottleReason*).
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)

THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"})


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Names of the bits set in an NVML clock-event reason mask."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _ in CLOCK_EVENT_REASONS:
        known |= bit
    if mask & ~known:
        names.append(f"unknown_0x{mask & ~known:x}")
    return tuple(names)


class NvmlSource(Source):
    """Reads GPU ``index`` through NVML."""

    name = "nvml"

    def __init__(self, index: int = 0, *, nvml: ModuleType | None = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError as e:
                log_once(log, "nvml-import", logging.INFO,
                         "NVML source unavailable: pynvml not installed (%s)", e)
                raise SourceUnavailable(f"pynvml not installed: {e}") from e
        self._nvml = nvml
        self.index = index
        self._unsupported: set[str] = set()
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            log_once(log, ("nvml-init", type(e).__name__), logging.INFO,
                     "NVML source unavailable: nvmlInit failed: %s", e)
            raise SourceUnavailable(f"nvmlInit failed: {e}") from e
        self._open = True
        try:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(self._handle)
            self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as e:
            self.close()
            log_once(log, ("nvml-device", index), logging.INFO,
                     "NVML source unavailable: GPU %d: %s", index, e)
            raise SourceUnavailable(f"NVML GPU {index}: {e}") from e

    def _call(self, what: str, fn_names: tuple[str, ...], *args: Any) -> Any:
        """Call the first NVML function that exists; None if unsupported/failing."""
        if what in self._unsupported:
            return None
        for fn_name in fn_names:
            fn = getattr(self._nvml, fn_name, None)
            if fn is None:
                continue
            try:
                return fn(self._handle, *args)
            except Exception as e:
                not_supported = getattr(self._nvml, "NVMLError_NotSupported", None)
                if not_supported is not None and isinstance(e, not_supported):
                    self._unsupported.add(what)
                    log.info("NVML: %s not supported on GPU %d", what, self.index)
                else:
                    log_once(log, ("nvml-read", what, type(e).__name__), logging.WARNING,
                             "NVML: reading %s failed: %s", what, e)
                return None
        self._unsupported.add(what)
        return None

    def read(self, t: float | None = None, wall_time: float | None = None) -> Sample:
        t, wall_time = self._stamps(t, wall_time)
        nv = self._nvml
        temps: dict[str, float] = {}
        temp = self._call("temperature", ("nvmlDeviceGetTemperature",),
                          getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        if temp is not None:
            temps["gpu"] = float(temp)
        power = self._call("power", ("nvmlDeviceGetPowerUsage",))
        power_w = None if power is None else float(power) / 1000.0
        util = self._call("utilization", ("nvmlDeviceGetUtilizationRates",))
        gpu_load = None if util is None else float(util.gpu) / 100.0
        clock = self._call("sm_clock", ("nvmlDeviceGetClockInfo",),
                           getattr(nv, "NVML_CLOCK_SM", 1))
        freq = None if clock is None else float(clock) * 1e6
        mask = self._call("clock_event_reasons", ("nvmlDeviceGetCurrentClocksEventReasons",
                                                  "nvmlDeviceGetCurrentClocksThrottleReasons"))
        reasons = None if mask is None else decode_clock_event_reasons(int(mask))
        return Sample(time=t, wall_time=wall_time, source=self.name, temperatures_c=temps,
                      power_w=power_w, rails_w={} if power_w is None else {"gpu": power_w},
                      gpu_load=gpu_load, gpu_freq_hz=freq,
                      throttle_reasons=reasons)

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # pragma: no cover - best effort
                pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "index": self.index,
                "device": getattr(self, "device_name", None)}
