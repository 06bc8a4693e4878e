"""One reading of the board's thermal and power state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


def normalize_zone(name: str) -> str:
    """Zone name without case or a ``-thermal``/``_thermal`` suffix.

    jtop says ``gpu``, sysfs says ``gpu-thermal``; both normalize to ``gpu`` so a
    zone filter works whichever source is active.
    """
    n = name.strip().lower()
    for suffix in ("-thermal", "_thermal"):
        if n.endswith(suffix):
            n = n[: -len(suffix)]
    return n


@dataclass(frozen=True)
class Sample:
    """A snapshot from a :class:`~edge.monitor.sources.Source`.

    ``time`` is a monotonic clock in seconds (the clock of the sampler that took
    it); ``wall_time`` is Unix time. Everything else is ``None`` (or empty) when
    the source does not know it.
    """

    time: float
    wall_time: float
    source: str
    temperatures_c: Mapping[str, float] = field(default_factory=dict)
    power_w: float | None = None
    rails_w: Mapping[str, float] = field(default_factory=dict)
    gpu_load: float | None = None  # 0..1
    gpu_freq_hz: float | None = None
    power_mode: str | None = None
    throttle_reasons: tuple[str, ...] | None = None

    def max_temperature(self, zones: Iterable[str] | None = None,
                        exclude: Iterable[str] = ()) -> tuple[str, float] | None:
        """(zone, °C) of the hottest zone among ``zones`` (all when None), or None.

        Zone names match exactly or after :func:`normalize_zone`.
        """
        wanted = None if zones is None else {normalize_zone(z) for z in zones}
        skip = {normalize_zone(z) for z in exclude}
        best: tuple[str, float] | None = None
        for name, temp in self.temperatures_c.items():
            key = normalize_zone(name)
            if wanted is not None and key not in wanted:
                continue
            if key in skip or temp is None or not math.isfinite(temp):
                continue
            if best is None or temp > best[1]:
                best = (name, float(temp))
        return best

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (non-finite floats become None)."""

        def num(x: float | None) -> float | None:
            if x is None:
                return None
            x = float(x)
            return x if math.isfinite(x) else None

        return {
            "time": num(self.time),
            "wall_time": num(self.wall_time),
            "source": self.source,
            "temperatures_c": {k: num(v) for k, v in self.temperatures_c.items()},
            "power_w": num(self.power_w),
            "rails_w": {k: num(v) for k, v in self.rails_w.items()},
            "gpu_load": num(self.gpu_load),
            "gpu_freq_hz": num(self.gpu_freq_hz),
            "power_mode": self.power_mode,
            "throttle_reasons": (None if self.throttle_reasons is None
                                 else list(self.throttle_reasons)),
        }
