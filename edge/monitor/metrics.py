"""Prometheus gauges fed by the sampler (a hook).

Metrics (``namespace`` defaults to ``edge``):

* ``edge_temperature_celsius{zone}``
* ``edge_power_watts{rail}`` and ``edge_power_total_watts``
* ``edge_gpu_load_ratio``, ``edge_gpu_frequency_hertz``
* ``edge_thermal_state{state}`` (1 for the current state, 0 for the others),
  ``edge_thermal_decode_delay_seconds``, ``edge_thermal_limit_celsius{limit}``
* ``edge_energy_joules`` (total metered by the energy meter)
* ``edge_monitor_source_info{source}`` (1), ``edge_monitor_samples_total``,
  ``edge_monitor_last_sample_timestamp_seconds``

Zones and rails that disappear from the samples are removed from the gauges;
unknown values are NaN (unlabelled gauges) or left out (labelled ones), never
a made-up 0.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from .governor import ThermalState
from .sample import Sample

if TYPE_CHECKING:
    from .energy import EnergyMeter
    from .governor import ThermalGovernor


class MonitorMetrics:
    """Hook: ``sampler.add_hook(metrics)`` after the governor and energy meter."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 governor: "ThermalGovernor | None" = None,
                 energy: "EnergyMeter | None" = None,
                 source_name: str | None = None, namespace: str = "edge") -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.governor = governor
        self.energy = energy
        self._lock = threading.Lock()
        r, ns = self.registry, namespace
        self.temperature = Gauge("temperature_celsius", "Temperature by thermal zone",
                                 ["zone"], namespace=ns, registry=r)
        self.rail_power = Gauge("power_watts", "Power by rail", ["rail"],
                                namespace=ns, registry=r)
        self.total_power = Gauge("power_total_watts", "Total board power",
                                 namespace=ns, registry=r)
        self.gpu_load = Gauge("gpu_load_ratio", "GPU load, 0..1", namespace=ns, registry=r)
        self.gpu_freq = Gauge("gpu_frequency_hertz", "GPU clock", namespace=ns, registry=r)
        self.thermal_state = Gauge("thermal_state", "Thermal governor state (1 = current)",
                                   ["state"], namespace=ns, registry=r)
        self.decode_delay = Gauge("thermal_decode_delay_seconds",
                                  "Delay the governor adds per decode step",
                                  namespace=ns, registry=r)
        self.thermal_limit = Gauge("thermal_limit_celsius", "Thermal governor limits",
                                   ["limit"], namespace=ns, registry=r)
        self.energy_joules = Gauge("energy_joules", "Energy metered since start",
                                   namespace=ns, registry=r)
        self.source_info = Gauge("monitor_source_info", "Active monitor source",
                                 ["source"], namespace=ns, registry=r)
        self.samples = Counter("monitor_samples", "Monitor samples taken",
                               namespace=ns, registry=r)
        self.last_sample = Gauge("monitor_last_sample_timestamp_seconds",
                                 "Wall time of the last monitor sample",
                                 namespace=ns, registry=r)
        for g in (self.total_power, self.gpu_load, self.gpu_freq, self.energy_joules,
                  self.last_sample):
            g.set(math.nan)  # unknown until a sample says otherwise
        self._zones: set[str] = set()
        self._rails: set[str] = set()
        self._source: str | None = None
        if source_name is not None:
            self._set_source(source_name)
        if governor is not None:
            self.thermal_limit.labels("soft").set(governor.soft_c)
            self.thermal_limit.labels("hard").set(governor.hard_c)
            self._set_state(governor.state)

    def _set_source(self, name: str) -> None:
        if name == self._source:
            return
        if self._source is not None:
            self.source_info.remove(self._source)
        self._source = name
        self.source_info.labels(name).set(1)

    def _set_state(self, state: ThermalState) -> None:
        for s in ThermalState:
            self.thermal_state.labels(s.value).set(1 if s is state else 0)

    @staticmethod
    def _sync(gauge: Gauge, seen: set[str], values: dict) -> None:
        for gone in seen - values.keys():
            gauge.remove(gone)
        seen.clear()
        for key, v in values.items():
            gauge.labels(key).set(v)
            seen.add(key)

    def __call__(self, sample: Sample) -> None:
        with self._lock:
            self._set_source(sample.source)
            self._sync(self.temperature, self._zones, dict(sample.temperatures_c))
            self._sync(self.rail_power, self._rails, dict(sample.rails_w))
            for gauge, v in ((self.total_power, sample.power_w),
                             (self.gpu_load, sample.gpu_load),
                             (self.gpu_freq, sample.gpu_freq_hz)):
                gauge.set(math.nan if v is None else v)
            if self.governor is not None:
                self._set_state(self.governor.state)
                self.decode_delay.set(self.governor.decode_delay_s())
            if self.energy is not None:
                j = self.energy.total_joules
                if j is not None:
                    self.energy_joules.set(j)
            self.samples.inc()
            self.last_sample.set(sample.wall_time)
