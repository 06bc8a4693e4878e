"""The Monitor facade: source + sampler + governor + energy meter + metrics."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from prometheus_client import CollectorRegistry

from .energy import EnergyMeter
from .governor import ThermalGovernor
from .metrics import MonitorMetrics
from .sampler import Sampler
from .sources import Source, open_source

log = logging.getLogger(__name__)


@dataclass
class MonitorConfig:
    period_s: float = 1.0
    source: str | None = None  # preferred source name; None/"auto": first that works
    sysfs_root: str | None = None  # None: $EDGE_SYSFS_ROOT or /sys
    soft_c: float = 85.0
    hard_c: float = 95.0
    hysteresis_c: float = 5.0
    max_decode_delay_s: float = 0.05
    zones: tuple[str, ...] | None = None  # None: all zones
    metrics: bool = True
    energy_history_s: float = 60.0

    # environment variable -> (field, parser), read by from_env()
    ENV: ClassVar[dict[str, tuple[str, Callable[[str], Any]]]] = {
        "EDGE_MONITOR_PERIOD_S": ("period_s", float),
        "EDGE_MONITOR_SOURCE": ("source", str),
        "EDGE_SYSFS_ROOT": ("sysfs_root", str),
        "EDGE_THERMAL_SOFT_C": ("soft_c", float),
        "EDGE_THERMAL_HARD_C": ("hard_c", float),
        "EDGE_THERMAL_HYSTERESIS_C": ("hysteresis_c", float),
        "EDGE_MAX_DECODE_DELAY_S": ("max_decode_delay_s", float),
        "EDGE_THERMAL_ZONES": ("zones", lambda s: tuple(
            z.strip() for z in s.split(",") if z.strip()) or None),
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "MonitorConfig":
        """Defaults, then the ``EDGE_*`` variables above, then ``overrides``."""
        env = os.environ if env is None else env
        cfg = cls()
        for var, (name, parse) in cfg.ENV.items():
            if env.get(var):
                try:
                    setattr(cfg, name, parse(env[var]))
                except ValueError as e:
                    raise ValueError(f"bad {var}={env[var]!r}: {e}") from e
        for name, value in overrides.items():
            if value is not None:
                setattr(cfg, name, value)
        return cfg


class Monitor:
    """Everything the service needs from :mod:`edge.monitor`, wired together.

    The source is opened at construction (``source`` overrides the config's
    choice, e.g. a FakeSource in tests); ``start()`` runs the sampler thread,
    ``stop()`` joins it and closes the source (so it is final: build a new
    Monitor to start again). Hooks run in this order:
    governor, energy meter, metrics, then any added later via
    ``monitor.sampler.add_hook``.
    """

    def __init__(self, config: MonitorConfig | None = None, *, source: Source | None = None,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = cfg = config or MonitorConfig()
        self.source = source if source is not None else open_source(
            cfg.source, cfg.sysfs_root, period_s=cfg.period_s)
        self.sampler = Sampler(self.source, cfg.period_s, clock=clock, wall_clock=wall_clock)
        self.governor = ThermalGovernor(cfg.soft_c, cfg.hard_c, cfg.hysteresis_c,
                                        cfg.max_decode_delay_s, cfg.zones)
        self.energy = EnergyMeter(clock, history_s=cfg.energy_history_s)
        self.sampler.add_hook(self.governor)
        self.sampler.add_hook(self.energy)
        self.metrics: MonitorMetrics | None = None
        if cfg.metrics:
            self.metrics = MonitorMetrics(registry, governor=self.governor, energy=self.energy,
                                          source_name=self.source.name)
            self.sampler.add_hook(self.metrics)

    @property
    def source_name(self) -> str:
        return self.source.name

    @property
    def latest(self):
        return self.sampler.latest

    def start(self) -> "Monitor":
        self.sampler.start()
        return self

    def stop(self) -> None:
        self.sampler.stop()
        self.source.close()

    close = stop

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        """JSON-able state for ``edge info`` and ``/health``."""
        latest = self.sampler.latest
        try:
            source = self.source.describe()
        except Exception as e:  # never let /health fail on this
            source = {"name": self.source.name, "error": str(e)}
        return {
            "source": self.source.name,
            "source_detail": source,
            "running": self.sampler.running,
            "period_s": self.sampler.period_s,
            "samples": self.sampler.count,
            "governor": self.governor.describe(),
            "energy": {"total_joules": self.energy.total_joules,
                       "active_requests": self.energy.active_requests},
            "latest": None if latest is None else latest.to_dict(),
        }
