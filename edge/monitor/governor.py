"""Thermal governor: a sampler hook that the scheduler and server consult.

States, with temperature T = max over the watched zones:

* NORMAL -> SOFT when T >= soft_c; NORMAL/SOFT -> HARD when T >= hard_c;
* HARD -> SOFT when T < hard_c - hysteresis_c (straight to NORMAL if also
  T < soft_c - hysteresis_c);
* SOFT -> NORMAL when T < soft_c - hysteresis_c.

In SOFT and HARD background prefill is paused and decode is slowed by a delay
growing linearly from 0 at soft_c to max_decode_delay_s at hard_c (clamped);
in HARD new requests are refused with :class:`DeviceTooHot` (HTTP 503).

The query methods only read one immutable snapshot attribute: thread-safe,
lock-free and cheap enough for the scheduler's loop.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable

from .sample import Sample

log = logging.getLogger(__name__)

# Zones ignored when watching "all zones": Xavier's PMIC-Die reports a fixed
# 100 °C that is not a temperature of anything the governor can cool.
IGNORED_ZONES: tuple[str, ...] = ("PMIC-Die",)


class ThermalState(str, enum.Enum):
    NORMAL = "normal"
    SOFT = "soft"
    HARD = "hard"

    def __str__(self) -> str:
        return self.value


class DeviceTooHot(RuntimeError):
    """New work refused because the device is above its hard thermal limit."""

    def __init__(self, message: str, *, temperature_c: float | None = None,
                 limit_c: float | None = None, zone: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.temperature_c = temperature_c
        self.limit_c = limit_c
        self.zone = zone
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GovernorSnapshot:
    state: ThermalState
    temperature_c: float | None
    zone: str | None
    decode_delay_s: float
    time: float | None  # sample time of the last update


ChangeCallback = Callable[[ThermalState, ThermalState, GovernorSnapshot], object]


class ThermalGovernor:
    """Hook: ``sampler.add_hook(governor)``; query from any thread."""

    def __init__(self, soft_c: float = 85.0, hard_c: float = 95.0,
                 hysteresis_c: float = 5.0, max_decode_delay_s: float = 0.05,
                 zones: Iterable[str] | None = None, *,
                 retry_after_s: float = 5.0) -> None:
        if not (math.isfinite(soft_c) and math.isfinite(hard_c) and soft_c < hard_c):
            raise ValueError(f"need soft_c < hard_c (got {soft_c}, {hard_c})")
        if not hysteresis_c >= 0:
            raise ValueError("hysteresis_c must be >= 0")
        if not max_decode_delay_s >= 0:
            raise ValueError("max_decode_delay_s must be >= 0")
        self.soft_c = float(soft_c)
        self.hard_c = float(hard_c)
        self.hysteresis_c = float(hysteresis_c)
        self.max_decode_delay_s = float(max_decode_delay_s)
        self.zones: tuple[str, ...] | None = None if zones is None else tuple(zones)
        self.retry_after_s = retry_after_s
        self.on_change: list[ChangeCallback] = []
        self._snap = GovernorSnapshot(ThermalState.NORMAL, None, None, 0.0, None)

    # -- hook ----------------------------------------------------------------

    def __call__(self, sample: Sample) -> None:
        hottest = sample.max_temperature(
            self.zones, exclude=IGNORED_ZONES if self.zones is None else ())
        if hottest is None:
            return  # no reading: keep the state we had
        zone, temp = hottest
        self.update(temp, zone=zone, t=sample.time)

    def update(self, temperature_c: float, *, zone: str | None = None,
               t: float | None = None) -> ThermalState:
        """Feed one temperature (what the hook does); returns the new state."""
        old = self._snap.state
        new = self._next_state(old, temperature_c)
        delay = 0.0 if new is ThermalState.NORMAL else self._delay_for(temperature_c)
        snap = GovernorSnapshot(new, float(temperature_c), zone, delay, t)
        self._snap = snap
        if new is not old:
            level = logging.WARNING if new is not ThermalState.NORMAL else logging.INFO
            log.log(level, "thermal state %s -> %s at %.1f °C (%s; soft %.1f, hard %.1f)",
                    old.value, new.value, temperature_c, zone or "?", self.soft_c, self.hard_c)
            for cb in list(self.on_change):
                try:
                    cb(old, new, snap)
                except Exception:
                    log.exception("thermal governor on_change callback raised")
        return new

    def _next_state(self, state: ThermalState, temp: float) -> ThermalState:
        soft_exit = self.soft_c - self.hysteresis_c
        hard_exit = self.hard_c - self.hysteresis_c
        if temp >= self.hard_c:
            return ThermalState.HARD
        if state is ThermalState.HARD:
            if temp >= hard_exit:
                return ThermalState.HARD
            return ThermalState.SOFT if temp >= soft_exit else ThermalState.NORMAL
        if state is ThermalState.SOFT:
            return ThermalState.SOFT if temp >= soft_exit else ThermalState.NORMAL
        return ThermalState.SOFT if temp >= self.soft_c else ThermalState.NORMAL

    def _delay_for(self, temp: float) -> float:
        frac = (temp - self.soft_c) / (self.hard_c - self.soft_c)
        return self.max_decode_delay_s * min(max(frac, 0.0), 1.0)

    # -- queries (scheduler / server) ----------------------------------------

    @property
    def state(self) -> ThermalState:
        return self._snap.state

    @property
    def temperature_c(self) -> float | None:
        """The watched temperature at the last update (None before any)."""
        return self._snap.temperature_c

    def snapshot(self) -> GovernorSnapshot:
        return self._snap

    def allow_background_prefill(self) -> bool:
        """False in SOFT and HARD."""
        return self._snap.state is ThermalState.NORMAL

    def decode_delay_s(self) -> float:
        """Seconds to sleep between decode steps: 0 in NORMAL, else in [0, max]."""
        return self._snap.decode_delay_s

    def check_admission(self) -> None:
        """Raise :class:`DeviceTooHot` in HARD; return None otherwise."""
        snap = self._snap
        if snap.state is ThermalState.HARD:
            temp = "?" if snap.temperature_c is None else f"{snap.temperature_c:.1f}"
            zone = f" ({snap.zone})" if snap.zone else ""
            raise DeviceTooHot(
                f"device too hot: {temp} °C{zone} reached the hard limit "
                f"{self.hard_c:.1f} °C; new requests refused until below "
                f"{self.hard_c - self.hysteresis_c:.1f} °C",
                temperature_c=snap.temperature_c, limit_c=self.hard_c, zone=snap.zone,
                retry_after_s=self.retry_after_s)

    def describe(self) -> dict:
        snap = self._snap
        return {"state": snap.state.value, "temperature_c": snap.temperature_c,
                "zone": snap.zone, "decode_delay_s": snap.decode_delay_s,
                "soft_c": self.soft_c, "hard_c": self.hard_c,
                "hysteresis_c": self.hysteresis_c,
                "max_decode_delay_s": self.max_decode_delay_s,
                "zones": None if self.zones is None else list(self.zones)}
