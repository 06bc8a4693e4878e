"""jetson-stats (``jtop``) source.

Needs the ``jetson-stats`` package (optional extra ``edge-llm[jetson]``) and a
running ``jtop.service`` whose socket (``/run/jtop.sock``, group ``jtop``) the
process may connect to, with a client of the service's major.minor version.
``jtop`` is imported lazily; a missing package is logged once per process, and
an unreachable service makes the source unavailable as *broken*, so
:func:`open_source` falls back (to sysfs on a Jetson) with one warning line.

jtop units: temperatures in °C, power in mW, GPU load in percent, GPU
frequency in kHz.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .log_once import log_once
from .sample import Sample
from .sources import Source, SourceUnavailable

log = logging.getLogger(__name__)

MIN_VALID_C = -100.0  # jtop reports offline zones as -256


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


class JtopSource(Source):
    """Reads temperatures, rails, GPU and nvpmodel from a jtop client."""

    name = "jtop"

    def __init__(self, interval_s: float | None = None, *,
                 factory: Callable[..., Any] | None = None) -> None:
        if factory is None:
            try:
                from jtop import jtop as factory  # type: ignore[import-not-found]
            except ImportError as e:
                log_once(log, "jtop-import", logging.INFO,
                         "jtop source unavailable: jetson-stats not installed (%s)", e)
                raise SourceUnavailable(f"jetson-stats not installed: {e}") from e
            except Exception as e:  # a broken install
                log_once(log, "jtop-import-error", logging.WARNING,
                         "jtop source unavailable: importing jtop failed: %s", e)
                raise SourceUnavailable(f"importing jtop failed: {e}") from e
        try:
            self._jtop = factory(interval=interval_s) if interval_s else factory()
            self._jtop.start()
        except Exception as e:  # JtopException, PermissionError, ConnectionRefusedError
            reason = " ".join(str(e).split()) or type(e).__name__
            raise SourceUnavailable(
                f"jtop.service unreachable ({type(e).__name__}: {reason}); it must run and this user "
                "must be in group jtop (the unit's SupplementaryGroups=)", broken=True) from e
        self._open = True

    def _get(self, attr: str) -> Any:
        try:
            return getattr(self._jtop, attr)
        except Exception as e:
            log_once(log, ("jtop-attr", attr, type(e).__name__), logging.WARNING,
                     "jtop: reading %s failed: %s", attr, e)
            return None

    def read(self, t: float | None = None, wall_time: float | None = None) -> Sample:
        t, wall_time = self._stamps(t, wall_time)

        temps: dict[str, float] = {}
        for zone, v in (self._get("temperature") or {}).items():
            if isinstance(v, dict):
                if not v.get("online", True):
                    continue
                v = v.get("temp")
            c = _num(v)
            if c is not None and c > MIN_VALID_C:
                temps[str(zone)] = c

        rails: dict[str, float] = {}
        total = None
        power = self._get("power") or {}
        if isinstance(power, dict):
            for rail, r in (power.get("rail") or {}).items():
                if isinstance(r, dict) and r.get("online", True):
                    mw = _num(r.get("power"))
                    if mw is not None:
                        rails[str(rail)] = mw / 1000.0
            tot = power.get("tot")
            if isinstance(tot, dict):
                mw = _num(tot.get("power"))
                total = None if mw is None else mw / 1000.0

        gpu_load = gpu_freq = None
        gpu = self._get("gpu") or {}
        if isinstance(gpu, dict) and gpu:
            first = next(iter(gpu.values()))
            if isinstance(first, dict):
                load = _num((first.get("status") or {}).get("load"))
                gpu_load = None if load is None else min(max(load / 100.0, 0.0), 1.0)
                khz = _num((first.get("freq") or {}).get("cur"))
                gpu_freq = None if khz is None else khz * 1000.0

        mode = None
        nvp = self._get("nvpmodel")
        if nvp is not None:
            mode = str(getattr(nvp, "name", None) or nvp)

        return Sample(time=t, wall_time=wall_time, source=self.name, temperatures_c=temps,
                      power_w=total, rails_w=rails, gpu_load=gpu_load, gpu_freq_hz=gpu_freq,
                      power_mode=mode)

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            try:
                self._jtop.close()
            except Exception:  # pragma: no cover - best effort
                pass
