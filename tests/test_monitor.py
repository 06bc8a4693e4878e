"""edge.monitor: sources, sampler, thermal governor, energy meter, metrics (CPU only)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import types

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge.monitor import (
    DeviceTooHot,
    EnergyMeter,
    FakeSource,
    Monitor,
    MonitorConfig,
    MonitorMetrics,
    NoneSource,
    Sample,
    Sampler,
    SourceUnavailable,
    ThermalGovernor,
    ThermalState,
    open_source,
    run_monitor_cli,
    write_fake_sysfs,
)
from edge.monitor.jtop_source import JtopSource
from edge.monitor.log_once import reset_log_once
from edge.monitor.nvml_source import NvmlSource, decode_clock_event_reasons
from edge.monitor.sysfs_source import SysfsSource


class Clock:
    """A settable clock for exact tests."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(autouse=True)
def _fresh_log_once(monkeypatch):
    reset_log_once()
    monkeypatch.delenv("EDGE_SYSFS_ROOT", raising=False)
    yield
    reset_log_once()


@pytest.fixture
def no_jtop(monkeypatch):
    """Make `import jtop` fail even where jetson-stats is installed."""
    monkeypatch.setitem(sys.modules, "jtop", None)


class _NVMLError(Exception):
    pass


class _NVMLNotSupported(_NVMLError):
    pass


def fake_nvml(*, init_fails: bool = False, reasons: int = 0x60, power_supported: bool = True):
    """A stand-in for the pynvml module."""
    m = types.SimpleNamespace()
    m.NVMLError = _NVMLError
    m.NVMLError_NotSupported = _NVMLNotSupported
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_CLOCK_SM = 1
    m.calls = {"power": 0}
    m.shutdown = 0

    def init():
        if init_fails:
            raise _NVMLError("NVML Shared Library Not Found")

    def power(h):
        m.calls["power"] += 1
        if not power_supported:
            raise _NVMLNotSupported("Not Supported")
        return 61500  # mW

    def shutdown():
        m.shutdown += 1

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA Fake GPU"
    m.nvmlDeviceGetTemperature = lambda h, kind: 71
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1410  # MHz
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons
    return m


# --------------------------------------------------------------------------- sysfs


def test_sysfs_parses_orin_tree(tmp_path):
    root = write_fake_sysfs(tmp_path)
    src = SysfsSource(root)
    s = src.read(t=12.0, wall_time=1000.0)
    assert s.source == "sysfs" and s.time == 12.0 and s.wall_time == 1000.0
    assert s.temperatures_c == {"cpu-thermal": 45.5, "gpu-thermal": 44.0,
                                "soc0-thermal": 43.25, "tj-thermal": 46.0}
    assert set(s.rails_w) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}
    assert s.rails_w["VDD_IN"] == pytest.approx(5000 * 1500 / 1e6)
    assert s.rails_w["VDD_CPU_GPU_CV"] == pytest.approx(4992 * 400 / 1e6)
    assert s.rails_w["VDD_SOC"] == pytest.approx(4996 * 600 / 1e6)
    assert s.power_w == pytest.approx(7.5)  # VDD_IN, not the sum
    assert s.gpu_load == pytest.approx(0.35)
    assert s.gpu_freq_hz == 918e6
    assert s.power_mode is None and s.throttle_reasons is None
    d = src.describe()
    assert d["zones"] == ["cpu-thermal", "gpu-thermal", "soc0-thermal", "tj-thermal"]
    assert d["total_rail"] == "VDD_IN"
    json.dumps(s.to_dict(), allow_nan=False)


def test_sysfs_total_is_sum_without_vdd_in(tmp_path):
    # AGX Orin style: no input rail; an unconnected channel is skipped
    rails = {"VDD_GPU_SOC": (5000, 1000), "VDD_CPU_CV": (5000, 400),
             "VIN_SYS_5V0": (5000, 300), "NC": (0, 0)}
    src = SysfsSource(write_fake_sysfs(tmp_path, rails=rails))
    s = src.read()
    assert set(s.rails_w) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"}
    assert s.power_w == pytest.approx(5.0 + 2.0 + 1.5)


def test_sysfs_zone_zero_padding_and_order(tmp_path):
    zones = {f"z{i}": 30000 + i * 1000 for i in range(12)}
    src = SysfsSource(write_fake_sysfs(tmp_path, zones_mc=zones, rails={}))
    assert [z.name for z in src.zones] == [f"z{i}" for i in range(12)]  # zone10 after zone9
    assert src.read().temperatures_c["z11"] == 41.0


def test_sysfs_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SYSFS_ROOT", str(write_fake_sysfs(tmp_path)))
    assert SysfsSource().root == str(tmp_path)
    assert open_source("sysfs").name == "sysfs"


def test_sysfs_i2c_driver_path_and_symlink_dedup(tmp_path):
    root = tmp_path
    write_fake_sysfs(root, rails={})  # zones only
    hw = root / "bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"
    hw.mkdir(parents=True)
    (hw / "name").write_text("ina3221\n")
    (hw / "in1_label").write_text("VDD_IN\n")
    (hw / "in1_input").write_text("5080\n")
    (hw / "curr1_input").write_text("1968\n")
    (hw / "in2_label").write_text("sum of shunt voltages\n")  # not a rail
    (hw / "in2_input").write_text("1\n")
    (hw / "curr2_input").write_text("1\n")
    (root / "class/hwmon").mkdir(parents=True, exist_ok=True)
    os.symlink(hw, root / "class/hwmon/hwmon3")  # same device seen twice
    src = SysfsSource(root)
    assert [r.name for r in src.rails] == ["VDD_IN"]
    assert src.read().power_w == pytest.approx(5080 * 1968 / 1e6)


def test_sysfs_tolerates_missing_and_garbage_files(tmp_path, caplog):
    root = write_fake_sysfs(tmp_path)
    zdir = tmp_path / "class/thermal"
    (zdir / "thermal_zone1/temp").write_text("garbage\n")  # gpu-thermal
    (zdir / "thermal_zone2/type").unlink()  # soc0-thermal loses its name
    (zdir / "thermal_zone9").mkdir()  # a zone without temp
    (zdir / "thermal_zone9/type").write_text("ghost-thermal\n")
    (zdir / "thermal_zone7").mkdir()  # offline zone (absent CV cluster)
    (zdir / "thermal_zone7/type").write_text("cv0-thermal\n")
    (zdir / "thermal_zone7/temp").write_text("-256000\n")
    hw = tmp_path / "class/hwmon/hwmon1"
    (hw / "curr3_input").write_text("\x00\x01bad")  # VDD_SOC current
    (hw / "in2_input").unlink()  # VDD_CPU_GPU_CV has no voltage file: rail skipped
    caplog.set_level(logging.INFO, logger="edge.monitor")
    src = SysfsSource(root)
    assert [r.name for r in src.rails] == ["VDD_IN", "VDD_SOC"]
    samples = [src.read() for _ in range(3)]
    for s in samples:
        assert s.temperatures_c == {"cpu-thermal": 45.5, "thermal_zone2": 43.25,
                                    "tj-thermal": 46.0}
        assert s.rails_w == {"VDD_IN": pytest.approx(7.5)}
        assert s.power_w == pytest.approx(7.5)  # VDD_IN still read
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    def count(fragment):
        return sum(fragment in w for w in warnings)

    assert count("thermal_zone1/temp") == 1  # once per file, not per sample
    assert count("curr3_input") == 1
    assert count("thermal_zone2 has no type") == 1
    assert count("thermal_zone9") == 1
    assert count("in2_input") == 1
    assert sum("offline" in r.getMessage() for r in caplog.records) == 1

    # the input rail itself goes bad: total unknown rather than a partial sum
    (hw / "in1_input").write_text("n/a\n")
    s = src.read()
    assert s.power_w is None and "VDD_IN" not in s.rails_w


def test_sysfs_partial_sum_is_not_a_total(tmp_path):
    rails = {"VDD_GPU_SOC": (5000, 1000), "VDD_CPU_CV": (5000, 400)}
    root = write_fake_sysfs(tmp_path, rails=rails)
    src = SysfsSource(root)
    (tmp_path / "class/hwmon/hwmon1/curr2_input").write_text("oops\n")
    s = src.read()
    assert s.rails_w == {"VDD_GPU_SOC": pytest.approx(5.0)} and s.power_w is None


def test_sysfs_empty_root_unavailable(tmp_path):
    with pytest.raises(SourceUnavailable):
        SysfsSource(tmp_path)


# --------------------------------------------------------------------------- source order


def test_open_source_jtop_missing_falls_back_to_sysfs(tmp_path, no_jtop, caplog):
    caplog.set_level(logging.INFO, logger="edge.monitor")
    root = write_fake_sysfs(tmp_path)
    assert open_source(sysfs_root=str(root)).name == "sysfs"
    assert open_source(sysfs_root=str(root)).name == "sysfs"
    msgs = [r.getMessage() for r in caplog.records if "jetson-stats not installed" in r.getMessage()]
    assert len(msgs) == 1  # logged once


def test_open_source_empty_root_nvml_fails_gives_none(tmp_path, no_jtop, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_fails=True))
    src = open_source(sysfs_root=str(tmp_path))
    assert isinstance(src, NoneSource) and src.name == "none"
    s = src.read(t=1.0, wall_time=2.0)
    assert s.temperatures_c == {} and s.power_w is None and s.rails_w == {}


def test_real_pynvml_fails_without_driver():
    try:
        src = NvmlSource()
    except SourceUnavailable:
        return  # the expected path on a CPU box
    src.close()
    pytest.skip("NVML works on this machine")


def test_open_source_nvml_when_available(tmp_path, no_jtop, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    assert open_source(sysfs_root=str(tmp_path)).name == "nvml"


def test_open_source_preferred(tmp_path, no_jtop, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    root = str(write_fake_sysfs(tmp_path))
    assert open_source("nvml", root).name == "nvml"  # preferred over sysfs
    assert open_source("none", root).name == "none"
    assert open_source("auto", root).name == "sysfs"
    assert open_source("jtop", root).name == "sysfs"  # preferred unavailable: fall back
    with pytest.raises(ValueError):
        open_source("tegrastats", root)


# --------------------------------------------------------------------------- jtop / nvml


class FakeJtop:
    def __init__(self, interval=None, fail=None):
        self.interval = interval
        self.fail = fail
        self.closed = False
        self.temperature = {"cpu": {"online": True, "temp": 51.25},
                            "cv0": {"online": False, "temp": -256.0},
                            "tj": {"online": True, "temp": 53.5}}
        self.power = {"rail": {"VDD_GPU_SOC": {"online": True, "volt": 5000, "curr": 800,
                                               "power": 4000, "avg": 3900},
                               "VDD_CPU_CV": {"online": True, "power": 1500}},
                      "tot": {"power": 9250, "avg": 9000, "name": "VDD_IN"}}
        self.gpu = {"gpu": {"type": "integrated", "status": {"load": 42.0},
                            "freq": {"cur": 612000, "max": 1300500}}}
        self.nvpmodel = "MAXN"

    def start(self):
        if self.fail:
            raise self.fail

    def close(self):
        self.closed = True


def test_jtop_source_reads_stats():
    src = JtopSource(interval_s=0.5, factory=FakeJtop)
    s = src.read(t=3.0, wall_time=4.0)
    assert src._jtop.interval == 0.5
    assert s.temperatures_c == {"cpu": 51.25, "tj": 53.5}
    assert s.rails_w == {"VDD_GPU_SOC": 4.0, "VDD_CPU_CV": 1.5}
    assert s.power_w == 9.25
    assert s.gpu_load == pytest.approx(0.42) and s.gpu_freq_hz == 612e6
    assert s.power_mode == "MAXN"
    src.close()
    assert src._jtop.closed


class JtopException(Exception):
    """Stands for jtop.core.exceptions.JtopException."""


@pytest.mark.parametrize("preferred", [None, "jtop"])
def test_unreachable_jtop_falls_back_to_sysfs_in_one_line(tmp_path, monkeypatch, caplog, preferred):
    # jetson-stats installed, but the socket refuses this user (not in group jtop).
    fail = JtopException("I can't access jtop.service.\nPlease logout or reboot this board.")
    monkeypatch.setitem(sys.modules, "jtop", types.SimpleNamespace(jtop=lambda **kw: FakeJtop(fail=fail)))
    root = str(write_fake_sysfs(tmp_path))
    caplog.set_level(logging.DEBUG, logger="edge.monitor")
    for _ in range(3):
        assert open_source(preferred, root).name == "sysfs"
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "\n" not in msg and msg.endswith("using sysfs")
    for piece in ("jtop.service unreachable", "JtopException: I can't access jtop.service. Please logout",
                  "group jtop"):
        assert piece in msg, piece
    with pytest.raises(SourceUnavailable) as exc:
        JtopSource(factory=lambda: FakeJtop(fail=PermissionError("jtop.sock: denied")))
    assert exc.value.broken and "PermissionError: jtop.sock: denied" in str(exc.value)


def test_nvml_source_with_fake_module():
    nv = fake_nvml(reasons=0x60 | 0x4)
    src = NvmlSource(nvml=nv)
    s = src.read(t=1.0, wall_time=1.0)
    assert s.source == "nvml"
    assert s.temperatures_c == {"gpu": 71.0}
    assert s.power_w == pytest.approx(61.5) and s.rails_w == {"gpu": pytest.approx(61.5)}
    assert s.gpu_load == pytest.approx(0.87) and s.gpu_freq_hz == 1410e6
    assert s.throttle_reasons == ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown")
    src.close()
    src.close()
    assert nv.shutdown == 1


def test_nvml_unsupported_power_is_none_and_not_retried():
    nv = fake_nvml(power_supported=False)
    src = NvmlSource(nvml=nv)
    assert src.read().power_w is None
    assert src.read().power_w is None
    assert nv.calls["power"] == 1


def test_decode_clock_event_reasons():
    assert decode_clock_event_reasons(0) == ()
    assert decode_clock_event_reasons(0x1) == ("gpu_idle",)
    assert decode_clock_event_reasons(0x40 | 0x8) == ("hw_slowdown", "hw_thermal_slowdown")
    assert decode_clock_event_reasons(0x1000) == ("unknown_0x1000",)


# --------------------------------------------------------------------------- fake source


def test_fake_source_scripts():
    src = FakeSource(temperatures=[80.0, {"gpu": 90.0, "cpu": 70.0}], power_w=lambda i: 10.0 + i,
                     throttle_reasons=[None, ["thermal"]])
    a, b, c = (src.read(t=float(i), wall_time=0.0) for i in range(3))
    assert a.temperatures_c == {"tj": 80.0} and a.power_w == 10.0 and a.throttle_reasons is None
    assert b.temperatures_c == {"gpu": 90.0, "cpu": 70.0} and b.power_w == 11.0
    assert c.temperatures_c == b.temperatures_c and c.throttle_reasons == ("thermal",)
    by_time = FakeSource(power_w=lambda t: 2.0 * t, index_by="time")
    assert by_time.read(t=3.5).power_w == 7.0


# --------------------------------------------------------------------------- sampler


def test_raising_hook_is_disabled_and_sampler_keeps_sampling(caplog):
    clock = Clock()
    sampler = Sampler(FakeSource(temperatures=[40.0, 41.0, 42.0]), period_s=1.0,
                      clock=clock, wall_clock=clock)
    seen: list[Sample] = []

    def bad_hook(sample):
        raise RuntimeError("boom")

    sampler.add_hook(bad_hook)
    sampler.add_hook(seen.append)
    with caplog.at_level(logging.ERROR, logger="edge.monitor"):
        for i in range(3):
            clock.t = float(i)
            sampler.sample_once()
    assert [s.temperatures_c["tj"] for s in seen] == [40.0, 41.0, 42.0]
    assert sampler.disabled_hooks == [bad_hook] and sampler.hooks == [seen.append]
    errors = [r for r in caplog.records if "bad_hook" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None  # with traceback
    assert sampler.latest is seen[-1] and sampler.latest.time == 2.0
    assert sampler.count == 3


def test_failing_source_read_gives_empty_sample(caplog):
    class Broken(NoneSource):
        name = "broken"

        def read(self, t=None, wall_time=None):
            raise OSError("i2c timeout")

    sampler = Sampler(Broken(), clock=Clock(5.0), wall_clock=Clock(6.0))
    with caplog.at_level(logging.ERROR, logger="edge.monitor"):
        s1, s2 = sampler.sample_once(), sampler.sample_once()
    assert s1.source == "broken" and s1.time == 5.0 and s1.temperatures_c == {}
    assert s2.source == "broken", "the sampler keeps sampling after a failed read"
    assert sum("read failed" in r.getMessage() for r in caplog.records) == 1


def test_sampler_thread_survives_raising_hook_and_stops_promptly():
    sampler = Sampler(FakeSource(temperatures=50.0), period_s=0.01)
    got = threading.Event()
    n = [0]

    def counter(sample):
        n[0] += 1
        if n[0] >= 5:
            got.set()

    sampler.add_hook(lambda s: 1 / 0)
    sampler.add_hook(counter)
    sampler.start()
    try:
        assert got.wait(5.0), "sampler stopped sampling"
    finally:
        sampler.stop()
    assert not sampler.running and len(sampler.disabled_hooks) == 1

    slow = Sampler(NoneSource(), period_s=60.0)
    first = threading.Event()
    slow.add_hook(lambda s: first.set())
    slow.start()
    assert first.wait(5.0)  # first sample right away
    t0 = time.monotonic()
    slow.stop()
    # Far below the 60 s period: stop() cut the wait short (a load-proof bound, not a speed check).
    assert time.monotonic() - t0 < 30.0 and not slow.running


def test_sampler_rejects_bad_period():
    with pytest.raises(ValueError):
        Sampler(NoneSource(), period_s=0)


# --------------------------------------------------------------------------- governor


def test_governor_ramp_with_hysteresis():
    ramp = [80.0, 84.9, 85.0, 90.0, 94.9, 95.0, 97.0, 92.0, 90.0, 89.9, 94.0, 85.0, 80.0,
            79.9, 84.0, 85.0]
    expected = ["normal", "normal", "soft", "soft", "soft", "hard", "hard", "hard", "hard",
                "soft", "soft", "soft", "soft", "normal", "normal", "soft"]
    gov = ThermalGovernor(soft_c=85.0, hard_c=95.0, hysteresis_c=5.0, max_decode_delay_s=0.05)
    changes = []
    gov.on_change.append(lambda old, new, snap: changes.append((old.value, new.value,
                                                                snap.temperature_c)))
    clock = Clock()
    sampler = Sampler(FakeSource(temperatures=ramp), clock=clock, wall_clock=clock)
    sampler.add_hook(gov)
    states = []
    for i in range(len(ramp)):
        clock.t = float(i)
        sampler.sample_once()
        states.append(gov.state.value)
        assert gov.temperature_c == ramp[i]
        assert gov.allow_background_prefill() == (gov.state is ThermalState.NORMAL)
        if gov.state is ThermalState.HARD:
            with pytest.raises(DeviceTooHot):
                gov.check_admission()
        else:
            assert gov.check_admission() is None
    assert states == expected
    assert changes == [("normal", "soft", 85.0), ("soft", "hard", 95.0),
                       ("hard", "soft", 89.9), ("soft", "normal", 79.9),
                       ("normal", "soft", 85.0)]
    assert sampler.disabled_hooks == []


def test_governor_decode_delay_bounds():
    gov = ThermalGovernor(soft_c=85.0, hard_c=95.0, hysteresis_c=5.0, max_decode_delay_s=0.05)
    assert gov.state is ThermalState.NORMAL and gov.decode_delay_s() == 0.0
    gov.update(84.0)
    assert gov.decode_delay_s() == 0.0
    gov.update(85.0)
    assert gov.state is ThermalState.SOFT and gov.decode_delay_s() == 0.0
    gov.update(90.0)
    assert gov.decode_delay_s() == pytest.approx(0.025, abs=1e-12)
    gov.update(82.0)  # SOFT inside the hysteresis band, below soft: no delay
    assert gov.state is ThermalState.SOFT and gov.decode_delay_s() == 0.0
    gov.update(95.0)
    assert gov.state is ThermalState.HARD and gov.decode_delay_s() == pytest.approx(0.05)
    gov.update(120.0)
    assert gov.decode_delay_s() == pytest.approx(0.05)  # bounded
    gov.update(92.5)
    assert gov.state is ThermalState.HARD
    assert gov.decode_delay_s() == pytest.approx(0.0375, abs=1e-12)
    gov.update(50.0)  # a big drop goes straight to normal
    assert gov.state is ThermalState.NORMAL and gov.decode_delay_s() == 0.0
    for temp in [20.0, 85.0, 86.0, 99.0, 94.0, 91.0, 89.0, 81.0, 60.0]:
        gov.update(temp)
        assert 0.0 <= gov.decode_delay_s() <= 0.05


def test_check_admission_message_and_503_fields():
    gov = ThermalGovernor(soft_c=80.0, hard_c=90.0, hysteresis_c=3.0)
    gov(Sample(0.0, 0.0, "fake", {"cpu-thermal": 70.0, "tj-thermal": 91.5}))
    assert gov.state == "hard" and str(gov.state) == "hard"
    with pytest.raises(DeviceTooHot) as ei:
        gov.check_admission()
    e = ei.value
    assert "91.5" in str(e) and "90.0" in str(e) and "tj-thermal" in str(e)
    assert e.temperature_c == 91.5 and e.limit_c == 90.0 and e.zone == "tj-thermal"
    assert e.retry_after_s > 0


def test_governor_zones_and_missing_readings():
    gov = ThermalGovernor(zones=["gpu"])  # matches "gpu-thermal" and jtop's "gpu"
    gov(Sample(0.0, 0.0, "fake", {"cpu-thermal": 99.0, "gpu-thermal": 60.0}))
    assert gov.state is ThermalState.NORMAL and gov.temperature_c == 60.0
    gov(Sample(1.0, 1.0, "fake", {"gpu": 96.0}))
    assert gov.state is ThermalState.HARD
    gov(Sample(2.0, 2.0, "none", {}))  # no reading: state kept
    assert gov.state is ThermalState.HARD and gov.temperature_c == 96.0
    # all zones by default, except Xavier's fixed-100 °C PMIC-Die
    gov_all = ThermalGovernor()
    gov_all(Sample(0.0, 0.0, "sysfs", {"PMIC-Die": 100.0, "CPU-therm": 50.0}))
    assert gov_all.state is ThermalState.NORMAL and gov_all.temperature_c == 50.0
    with pytest.raises(ValueError):
        ThermalGovernor(soft_c=95.0, hard_c=85.0)


# --------------------------------------------------------------------------- energy


def _pw(t: float) -> float:
    """Scripted piecewise-linear power (W); breakpoints at 0, 2, 3, 5."""
    if t <= 2.0:
        return 10.0 + 2.0 * t  # 10 -> 14
    if t <= 3.0:
        return 14.0 - 6.0 * (t - 2.0)  # 14 -> 8
    return 8.0 + 0.5 * (t - 3.0)  # 8 -> 9 at t=5


def _pw_integral(a: float, b: float) -> float:
    """Analytic integral of _pw over [a, b] (antiderivative per piece)."""
    pieces = [(float("-inf"), 2.0, lambda t: 10.0 * t + t * t),
              (2.0, 3.0, lambda t: 14.0 * t - 3.0 * (t - 2.0) ** 2),
              (3.0, float("inf"), lambda t: 8.0 * t + 0.25 * (t - 3.0) ** 2)]
    total = 0.0
    for lo, hi, F in pieces:
        x0, x1 = max(a, lo), min(b, hi)
        if x1 > x0:
            total += F(x1) - F(x0)
    return total


def _energy_rig():
    clock = Clock()
    meter = EnergyMeter(clock)
    sampler = Sampler(FakeSource(power_w=_pw, index_by="time"), clock=clock, wall_clock=clock)
    sampler.add_hook(meter)

    def sample_at(t):
        clock.t = t
        sampler.sample_once()

    return clock, meter, sample_at


def test_energy_per_request_matches_analytic_integral():
    # samples at irregular times 0, 0.5, 2, 2.25, 3, 4, 5 (all breakpoints included)
    clock, meter, sample_at = _energy_rig()
    assert meter.total_joules is None
    sample_at(0.0)
    sample_at(0.5)
    clock.t = 1.25  # request A begins mid-interval
    meter.begin("A")
    for t in (2.0, 2.25, 3.0, 4.0):
        sample_at(t)
    # ended before the next sample: the last power (at t=4) is held over [4, 4.4]
    clock.t = 4.4
    ja = meter.end("A")
    assert ja == pytest.approx(_pw_integral(1.25, 4.0) + _pw(4.0) * 0.4, abs=1e-9)
    sample_at(5.0)
    # once the samples are in, any window is the exact integral of the script
    for a, b in [(1.25, 4.4), (0.1, 0.3), (2.1, 2.2), (0.0, 5.0), (0.7, 3.6)]:
        assert meter.energy_between(a, b) == pytest.approx(_pw_integral(a, b), abs=1e-9)
    assert meter.total_joules == pytest.approx(_pw_integral(0.0, 5.0), abs=1e-9)
    # a request inside one interval
    meter.begin("B", t=4.2)
    assert meter.end("B", t=4.7) == pytest.approx(_pw_integral(4.2, 4.7), abs=1e-9)
    assert meter.active_requests == 0
    with pytest.raises(KeyError):
        meter.end("B")


def test_energy_concurrent_requests_and_gaps():
    clock, meter, sample_at = _energy_rig()
    meter.begin("early", t=-1.0)  # before any sample: first power held
    sample_at(0.0)
    meter.begin("x")
    sample_at(1.0)
    meter.begin("y")
    meter(Sample(1.5, 1.5, "fake", power_w=None))  # a missing reading is bridged
    sample_at(2.0)
    sample_at(3.0)
    clock.t = 3.0
    assert meter.end("y") == pytest.approx(_pw_integral(1.0, 3.0), abs=1e-9)
    assert meter.end("x") == pytest.approx(_pw_integral(0.0, 3.0), abs=1e-9)
    assert meter.end("early") == pytest.approx(_pw(0.0) * 1.0 + _pw_integral(0.0, 3.0),
                                               abs=1e-9)
    meter.begin("zero")
    assert meter.end("zero") == 0.0


def test_energy_history_pruned_but_active_requests_kept():
    clock = Clock()
    meter = EnergyMeter(clock, history_s=1.0)
    meter.begin("long", t=0.25)
    for i in range(100):
        meter.add_point(i * 0.1, _pw(i * 0.1))
    meter.begin("late", t=9.0)
    for i in range(100, 120):
        meter.add_point(i * 0.1, _pw(i * 0.1))
    assert meter.end("long", t=11.0) == pytest.approx(_pw_integral(0.25, 11.0), abs=1e-9)
    assert meter.end("late", t=11.5) == pytest.approx(_pw_integral(9.0, 11.5), abs=1e-9)
    meter.add_point(12.0, _pw(12.0))
    assert len(meter._t) <= 12  # only ~history_s of points once nothing needs more


def test_energy_without_power_is_none():
    clock = Clock()
    meter = EnergyMeter(clock)
    sampler = Sampler(NoneSource(), clock=clock, wall_clock=clock)
    sampler.add_hook(meter)
    meter.begin(1)
    for t in (0.0, 1.0, 2.0):
        clock.t = t
        sampler.sample_once()
    assert meter.end(1) is None
    assert meter.total_joules is None
    assert meter.energy_between(0.0, 2.0) is None


# --------------------------------------------------------------------------- metrics


def _families(registry):
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name, **labels):
    for fam in families.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def test_metrics_registry_exposes_gauges(tmp_path):
    registry = CollectorRegistry()
    clock = Clock()
    gov = ThermalGovernor()
    meter = EnergyMeter(clock)
    metrics = MonitorMetrics(registry, governor=gov, energy=meter, source_name="sysfs")
    sampler = Sampler(SysfsSource(write_fake_sysfs(tmp_path)), clock=clock, wall_clock=clock)
    for hook in (gov, meter, metrics):
        sampler.add_hook(hook)
    for t in (0.0, 2.0):
        clock.t = t
        sampler.sample_once()
    fam = _families(registry)
    assert _value(fam, "edge_temperature_celsius", zone="cpu-thermal") == 45.5
    assert _value(fam, "edge_temperature_celsius", zone="tj-thermal") == 46.0
    assert _value(fam, "edge_power_watts", rail="VDD_IN") == pytest.approx(7.5)
    assert _value(fam, "edge_power_watts", rail="VDD_SOC") == pytest.approx(2.9976)
    assert _value(fam, "edge_power_total_watts") == pytest.approx(7.5)
    assert _value(fam, "edge_gpu_load_ratio") == pytest.approx(0.35)
    assert _value(fam, "edge_gpu_frequency_hertz") == 918e6
    assert _value(fam, "edge_thermal_state", state="normal") == 1
    assert _value(fam, "edge_thermal_state", state="hard") == 0
    assert _value(fam, "edge_thermal_limit_celsius", limit="hard") == 95.0
    assert _value(fam, "edge_monitor_source_info", source="sysfs") == 1
    assert _value(fam, "edge_monitor_samples_total") == 2
    assert _value(fam, "edge_energy_joules") == pytest.approx(15.0)

    # it gets hot, a zone disappears
    (tmp_path / "class/thermal/thermal_zone3/temp").write_text("96000\n")
    (tmp_path / "class/thermal/thermal_zone0/temp").unlink()
    sampler.sample_once()
    fam = _families(registry)
    assert _value(fam, "edge_thermal_state", state="hard") == 1
    assert _value(fam, "edge_thermal_state", state="normal") == 0
    assert _value(fam, "edge_thermal_decode_delay_seconds") == pytest.approx(0.05)
    with pytest.raises(KeyError):
        _value(fam, "edge_temperature_celsius", zone="cpu-thermal")


def test_metrics_unknown_values_are_nan_not_zero():
    registry = CollectorRegistry()
    metrics = MonitorMetrics(registry)
    metrics(NoneSource().read(t=0.0, wall_time=0.0))
    fam = _families(registry)
    assert math.isnan(_value(fam, "edge_power_total_watts"))
    assert _value(fam, "edge_monitor_source_info", source="none") == 1
    assert "edge_temperature_celsius" not in [s.name for f in fam.values() for s in f.samples]
    assert isinstance(MonitorMetrics().registry, CollectorRegistry)  # own registry by default


# --------------------------------------------------------------------------- facade + CLI


def test_monitor_facade_describe_and_run(tmp_path, no_jtop):
    registry = CollectorRegistry()
    cfg = MonitorConfig(period_s=0.01, sysfs_root=str(write_fake_sysfs(tmp_path)),
                        soft_c=40.0, hard_c=60.0)
    mon = Monitor(cfg, registry=registry)
    assert mon.source_name == "sysfs"
    d = mon.describe()
    assert d["source"] == "sysfs" and d["latest"] is None and d["running"] is False
    json.dumps(d, allow_nan=False)
    mon.sampler.sample_once()
    assert mon.governor.state is ThermalState.SOFT  # 46 °C >= 40
    d = mon.describe()
    assert d["latest"]["temperatures_c"]["tj-thermal"] == 46.0
    assert d["governor"]["state"] == "soft"
    json.dumps(d, allow_nan=False)
    with mon:
        got = threading.Event()
        mon.sampler.add_hook(lambda s: got.set())
        assert got.wait(5.0) and mon.describe()["running"]
    assert not mon.sampler.running
    assert _value(_families(registry), "edge_thermal_state", state="soft") == 1


def test_monitor_with_fake_source_and_energy():
    clock = Clock()
    mon = Monitor(MonitorConfig(metrics=False),
                  source=FakeSource(power_w=_pw, index_by="time"), clock=clock,
                  wall_clock=clock)
    assert mon.metrics is None
    mon.sampler.sample_once()
    mon.energy.begin("r")
    for t in (1.0, 2.0):
        clock.t = t
        mon.sampler.sample_once()
    assert mon.energy.end("r") == pytest.approx(_pw_integral(0.0, 2.0), abs=1e-9)
    assert mon.describe()["energy"]["total_joules"] == pytest.approx(_pw_integral(0.0, 2.0))
    mon.stop()
    assert mon.source.closed


def test_monitor_config_from_env():
    cfg = MonitorConfig.from_env({"EDGE_MONITOR_PERIOD_S": "0.5", "EDGE_THERMAL_SOFT_C": "80",
                                  "EDGE_THERMAL_ZONES": "tj, gpu", "EDGE_MONITOR_SOURCE": "sysfs"},
                                 hard_c=90.0)
    assert (cfg.period_s, cfg.soft_c, cfg.hard_c, cfg.zones, cfg.source) == (
        0.5, 80.0, 90.0, ("tj", "gpu"), "sysfs")
    with pytest.raises(ValueError):
        MonitorConfig.from_env({"EDGE_THERMAL_HARD_C": "hot"})


def test_run_monitor_cli(tmp_path, capsys, no_jtop):
    root = str(write_fake_sysfs(tmp_path))
    assert run_monitor_cli(0.01, 2, True, None, root) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        d = json.loads(line)
        assert d["source"] == "sysfs" and d["temperatures_c"]["cpu-thermal"] == 45.5
        assert d["power_w"] == pytest.approx(7.5) and d["thermal_state"] == "normal"
    assert run_monitor_cli(0.01, 1, False, "sysfs", root) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "tj-thermal=46.0C" in out[0] and "7.50W" in out[0]
    assert run_monitor_cli(0.0, 1, False, None, root) == 2
    assert run_monitor_cli(0.01, 1, False, "bogus", root) == 2
