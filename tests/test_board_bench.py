"""The board owner's benchmark records what makes a figure reproducible: the power mode,
jetson_clocks and the clocks, read from a Jetson's files (here a fake Orin tree), and the
energy of the timed runs from the same sources the service's monitor reads (the INA3221
rails in sysfs, jtop), integrated by the service's energy meter."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from edge.monitor import Monitor, MonitorConfig, write_fake_jetson
from edge.monitor.board import measure_energy, read_board
from edge.monitor.jtop_source import JtopSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from test_monitor import FakeJtop  # noqa: E402


def test_board_facts_from_a_fake_orin(tmp_path: Path) -> None:
    root = write_fake_jetson(tmp_path / "nx", power_mode=(2, "15W"), jetson_clocks=False)
    facts = read_board(root)
    assert facts.is_jetson and facts.model.startswith("NVIDIA Jetson Orin NX")
    assert (facts.l4t, facts.power_mode, facts.power_mode_id) == ("R36.4.3", "15W", 2)
    assert facts.jetson_clocks is False and facts.gpu_freq_hz == 918000000 and facts.gpu_max_freq_hz == 918000000
    pinned = read_board(write_fake_jetson(tmp_path / "agx", model="NVIDIA Jetson AGX Orin Developer Kit",
                                          jetson_clocks=True, gpu_freq_hz=1300500000))
    assert pinned.jetson_clocks is True and pinned.power_mode == "MAXN" and pinned.gpu_min_freq_hz == 1300500000


def test_not_a_jetson_is_all_null(tmp_path: Path) -> None:
    facts = read_board(tmp_path)
    assert not facts.is_jetson
    assert all(v is None for v in facts.as_dict().values())


def _monitor(source=None, root: Path | None = None) -> Monitor:  # noqa: ANN001
    config = MonitorConfig(period_s=0.01, source="sysfs", sysfs_root=str(root) if root else None, metrics=False)
    return Monitor(config, source=source).start()


def test_energy_from_the_input_rail_of_a_fake_orin(tmp_path: Path) -> None:
    # Orin NX / Nano: VDD_IN is the board's input power (5000 mV x 1500 mA = 7.5 W).
    root = write_fake_jetson(tmp_path)
    monitor = _monitor(root=Path(root) / "sys")
    try:
        assert monitor.source_name == "sysfs"
        _, energy = measure_energy(monitor, lambda: time.sleep(0.1))
    finally:
        monitor.stop()
    assert energy.source == "sysfs"
    assert energy.joules == pytest.approx(7.5 * energy.seconds, rel=1e-6)
    assert energy.watts == pytest.approx(7.5)


def test_energy_of_an_agx_orin_sums_its_rails(tmp_path: Path) -> None:
    # AGX Orin has no VDD_IN rail: the sum of its rails is the board's power.
    rails = {"VDD_GPU_SOC": (5000, 1000), "VDD_CPU_CV": (5000, 400), "VIN_SYS_5V0": (5000, 600)}
    root = write_fake_jetson(tmp_path, rails=rails)
    monitor = _monitor(root=Path(root) / "sys")
    try:
        _, energy = measure_energy(monitor, lambda: time.sleep(0.05))
    finally:
        monitor.stop()
    assert energy.watts == pytest.approx(10.0)


def test_energy_from_jtop() -> None:
    monitor = _monitor(source=JtopSource(interval_s=0.01, factory=FakeJtop))
    try:
        _, energy = measure_energy(monitor, lambda: time.sleep(0.05))
    finally:
        monitor.stop()
    assert energy.source == "jtop" and energy.watts == pytest.approx(9.25)


def test_board_key_and_table() -> None:
    from bench_board import board_key, table

    gib = 1 << 30
    assert board_key("NVIDIA Jetson AGX Orin Developer Kit", int(61.4 * gib)) == "agx-orin-64"
    assert board_key("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", int(15.3 * gib)) == "orin-nx-16"
    assert board_key("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", int(7.4 * gib)) is None  # NX 8 GB
    assert board_key("NVIDIA Jetson Orin Nano Developer Kit", int(7.4 * gib)) == "orin-nano-8"
    assert board_key(None, 80 * gib) is None
    result = {
        "board": None, "device": "NVIDIA H100 80GB HBM3", "sm_count": 16, "model": "qwen3-8b",
        "board_facts": read_board("/nonexistent").as_dict(), "format": {"projections": "rtn int4 g128"},
        "quantize": "int4", "prefill_tok_s": 9000.0, "ttft_ms": {"median": 227.0},
        "decode_tok_s": {"median": 100.8}, "energy": {"joules_per_token": None, "source": "nvml"}, "published": [],
    }
    text = table(result)
    assert "board not a Jetson" in text and "power mode n/a" in text and "| qwen3-8b | rtn int4 g128 |" in text
