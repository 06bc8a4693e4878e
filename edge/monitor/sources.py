"""The Source interface, the ``none`` source, and :func:`open_source`.

Sources, in the order :func:`open_source` tries them:

1. ``jtop``  -- jetson-stats (:mod:`edge.monitor.jtop_source`), needs jtop.service;
2. ``sysfs`` -- thermal zones and INA3221 rails (:mod:`edge.monitor.sysfs_source`);
3. ``nvml``  -- discrete NVIDIA GPUs via pynvml (:mod:`edge.monitor.nvml_source`);
4. ``none``  -- no readings, so the sampler and its hooks still run.

:class:`~edge.monitor.fake.FakeSource` (scripted values) is for tests.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from .log_once import log_once
from .sample import Sample

log = logging.getLogger(__name__)

SOURCE_ORDER: tuple[str, ...] = ("jtop", "sysfs", "nvml", "none")


class SourceUnavailable(RuntimeError):
    """Raised by a source's constructor when it cannot work on this machine.

    ``broken``: the source is installed but cannot be reached (e.g. jtop.service refuses
    the connection), which :func:`open_source` reports as a warning when it falls back,
    rather than an absent package or device, which is normal on other machines.
    """

    def __init__(self, message: str, *, broken: bool = False) -> None:
        super().__init__(message)
        self.broken = broken


class Source(ABC):
    """Something that can be read for a :class:`Sample`.

    Constructors raise :class:`SourceUnavailable` when the source cannot work.
    ``read`` must be cheap (it runs on the sampler thread every period) and may
    raise; the sampler logs the error and carries on.
    """

    name: str = "source"

    @abstractmethod
    def read(self, t: float | None = None, wall_time: float | None = None) -> Sample:
        """Take one reading stamped with ``t`` (monotonic s) and ``wall_time``.

        Missing stamps default to ``time.monotonic()`` / ``time.time()``.
        """

    def close(self) -> None:
        """Release whatever the source holds (idempotent)."""

    def describe(self) -> dict[str, Any]:
        """JSON-able description (name plus source-specific details)."""
        return {"name": self.name}

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _stamps(t: float | None, wall_time: float | None) -> tuple[float, float]:
        return (time.monotonic() if t is None else float(t),
                time.time() if wall_time is None else float(wall_time))


class NoneSource(Source):
    """A source with no readings: samples carry only their time stamps."""

    name = "none"

    def read(self, t: float | None = None, wall_time: float | None = None) -> Sample:
        t, wall_time = self._stamps(t, wall_time)
        return Sample(time=t, wall_time=wall_time, source=self.name)


def _open_jtop(sysfs_root: str | None, period_s: float | None) -> Source:
    from .jtop_source import JtopSource
    return JtopSource(interval_s=period_s)


def _open_sysfs(sysfs_root: str | None, period_s: float | None) -> Source:
    from .sysfs_source import SysfsSource
    return SysfsSource(root=sysfs_root)


def _open_nvml(sysfs_root: str | None, period_s: float | None) -> Source:
    from .nvml_source import NvmlSource
    return NvmlSource()


def _open_none(sysfs_root: str | None, period_s: float | None) -> Source:
    return NoneSource()


OPENERS: dict[str, Callable[[str | None, float | None], Source]] = {
    "jtop": _open_jtop,
    "sysfs": _open_sysfs,
    "nvml": _open_nvml,
    "none": _open_none,
}


def open_source(preferred: str | None = None, sysfs_root: str | None = None, *,
                period_s: float | None = None) -> Source:
    """Open the first source that works.

    ``preferred`` (one of :data:`SOURCE_ORDER`, or ``"auto"``/None) is tried
    first, then the rest in the default order; ``none`` always works, so this
    never fails. ``sysfs_root`` overrides ``$EDGE_SYSFS_ROOT`` (default
    ``/sys``). Falling back past a broken source (installed but unreachable, such as
    jtop without access to its socket) is one warning line per process and reason,
    naming the source used instead.
    """
    if preferred is not None:
        preferred = preferred.strip().lower()
        if preferred in ("", "auto"):
            preferred = None
        elif preferred not in OPENERS:
            raise ValueError(f"unknown monitor source {preferred!r}; "
                             f"expected one of {', '.join(SOURCE_ORDER)} or auto")
    order = list(SOURCE_ORDER)
    if preferred is not None:
        order.remove(preferred)
        order.insert(0, preferred)
    broken: list[tuple[str, SourceUnavailable]] = []
    for name in order:
        try:
            src = OPENERS[name](sysfs_root, period_s)
        except SourceUnavailable as e:
            log.debug("monitor source %s unavailable: %s", name, e)
            if e.broken:
                broken.append((name, e))
            continue
        if broken:
            what = "; ".join(f"{n}: {e}" for n, e in broken)
            log_once(log, ("fallback", name, what), logging.WARNING,
                     "monitor source %s unavailable (%s); using %s", broken[0][0], what, name)
        elif preferred is not None and name != preferred:
            log.warning("monitor source %r unavailable; using %r", preferred, name)
        elif name == "none":
            log.warning("no thermal/power source found; monitoring without readings "
                        "(thermal governor stays normal)")
        else:
            log.info("monitor source: %s", name)
        return src
    return NoneSource()  # unreachable: "none" always opens
