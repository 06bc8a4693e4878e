"""The Jetson Orin modules a plan can be made for (``edge plan --board``, docs/orin.md).

Memory is MemTotal as L4T r36 reports it (the firmware carve-outs are not in it), less what
a headless L4T with jtop.service uses before the service starts: figures to plan with,
not measurements of a given board (``edge plan`` on the board itself probes instead).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Board:
    key: str  # the name ``--board`` takes
    name: str
    mem_total: int  # bytes, MemTotal (approximate)
    sms: int
    bandwidth: float  # bytes/s, NVIDIA's figure for the module
    os_used: int = GiB  # the OS (headless L4T, jtop.service) before the service starts

    @property
    def available(self) -> int:
        """What the service may use when it starts: MemTotal less the OS."""
        return self.mem_total - self.os_used


BOARDS: dict[str, Board] = {
    b.key: b
    for b in (
        Board("agx-orin-64", "AGX Orin 64 GB", int(61.4 * GiB), 16, 204.8e9),
        Board("orin-nx-16", "Orin NX 16 GB", int(15.3 * GiB), 8, 102.4e9),
        Board("orin-nano-8", "Orin Nano 8 GB", int(7.4 * GiB), 8, 68e9),
    )
}


def board(key: str) -> Board:
    try:
        return BOARDS[key]
    except KeyError:
        raise ValueError(f"unknown board {key!r}; choose from {', '.join(BOARDS)}") from None
