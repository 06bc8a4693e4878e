"""Thermal and power monitoring: sources, a sampler, and hooks.

Quick use (the service)::

    from edge.monitor import Monitor, MonitorConfig, DeviceTooHot
    mon = Monitor(MonitorConfig.from_env(), registry=server_registry).start()
    mon.governor.check_admission()          # raises DeviceTooHot in HARD -> 503
    mon.governor.allow_background_prefill() # scheduler: False in SOFT/HARD
    mon.governor.decode_delay_s()           # scheduler: sleep between steps
    mon.energy.begin(req_id); ...; joules = mon.energy.end(req_id)
    mon.describe()                          # /health, `edge info`
    mon.stop()

See DESIGN.md, "Monitoring".
"""

from .cli import format_sample, run_monitor_cli
from .energy import EnergyMeter
from .fake import FakeSource, write_fake_jetson, write_fake_sysfs
from .governor import DeviceTooHot, GovernorSnapshot, ThermalGovernor, ThermalState
from .metrics import MonitorMetrics
from .monitor import Monitor, MonitorConfig
from .sample import Sample, normalize_zone
from .sampler import Sampler
from .sources import SOURCE_ORDER, NoneSource, Source, SourceUnavailable, open_source

__all__ = [
    "DeviceTooHot", "EnergyMeter", "FakeSource", "GovernorSnapshot", "Monitor",
    "MonitorConfig", "MonitorMetrics", "NoneSource", "SOURCE_ORDER", "Sample", "Sampler",
    "Source", "SourceUnavailable", "ThermalGovernor", "ThermalState", "format_sample",
    "normalize_zone", "open_source", "run_monitor_cli", "write_fake_jetson", "write_fake_sysfs",
]
