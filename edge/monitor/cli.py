"""``edge monitor``: print live samples, one line each."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO

from .governor import ThermalGovernor
from .sample import Sample
from .sampler import Sampler
from .sources import open_source


def format_sample(sample: Sample, governor: ThermalGovernor | None = None) -> str:
    """One human-readable line."""
    parts = [time.strftime("%H:%M:%S", time.localtime(sample.wall_time)), sample.source]
    if sample.temperatures_c:
        parts.append("temp " + " ".join(f"{z}={c:.1f}C"
                                        for z, c in sample.temperatures_c.items()))
    if sample.power_w is not None or sample.rails_w:
        total = "?" if sample.power_w is None else f"{sample.power_w:.2f}W"
        rails = " ".join(f"{r}={w:.2f}W" for r, w in sample.rails_w.items())
        parts.append(f"power {total}" + (f" ({rails})" if rails else ""))
    if sample.gpu_load is not None or sample.gpu_freq_hz is not None:
        load = "?" if sample.gpu_load is None else f"{sample.gpu_load * 100:.0f}%"
        freq = "" if sample.gpu_freq_hz is None else f" {sample.gpu_freq_hz / 1e6:.0f}MHz"
        parts.append(f"gpu {load}{freq}")
    if sample.power_mode:
        parts.append(f"mode {sample.power_mode}")
    if sample.throttle_reasons:
        parts.append("throttle " + ",".join(sample.throttle_reasons))
    if governor is not None:
        parts.append(f"thermal {governor.state.value}")
    if len(parts) == 2:
        parts.append("no readings")
    return " | ".join(parts)


def run_monitor_cli(period_s: float = 1.0, count: int | None = None, as_json: bool = False,
                    source: str | None = None, sysfs_root: str | None = None, *,
                    out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print ``count`` samples (forever when None), one line per sample.

    JSON lines (:meth:`Sample.to_dict` plus ``thermal_state``) when ``as_json``.
    Returns the exit code: 0, or 2 for bad arguments. Ctrl-C ends it with 0.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if not period_s > 0:
        print(f"edge monitor: period must be > 0 (got {period_s})", file=err)
        return 2
    if count is not None and count < 0:
        print(f"edge monitor: count must be >= 0 (got {count})", file=err)
        return 2
    try:
        src = open_source(source, sysfs_root, period_s=period_s)
    except ValueError as e:
        print(f"edge monitor: {e}", file=err)
        return 2
    governor = ThermalGovernor()
    sampler = Sampler(src, period_s)
    sampler.add_hook(governor)
    if not as_json:
        print(f"source: {src.name} {json.dumps(src.describe())}", file=err)
    wait = threading.Event()
    n = 0
    try:
        while count is None or n < count:
            if n:
                wait.wait(period_s)
            sample = sampler.sample_once()
            if as_json:
                d = sample.to_dict()
                d["thermal_state"] = governor.state.value
                line = json.dumps(d, sort_keys=False)
            else:
                line = format_sample(sample, governor)
            print(line, file=out, flush=True)
            n += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `edge monitor | head`
        pass
    finally:
        src.close()
    return 0
