#!/usr/bin/env python3
"""The figures of a GPU session's JSON results, one compact line per result file:
every scalar whose key names a rate, a fraction, a time or a bandwidth.

    python tools/gpu_summary.py DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

KEYS = re.compile(r"(tok_s|fraction|GBps|_ms|_us|ratio|itl|speedup|sms$|passed|agree|bytes|GiB|peak|weights|bound|quantize)", re.I)


def scalars(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every scalar under ``value``."""
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in scalars(v, f"{prefix}{k}.")]
    if isinstance(value, list):
        return [kv for i, v in enumerate(value) for kv in scalars(v, f"{prefix}{i}.")]
    return [(prefix[:-1], value)]


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".")
    for path in sorted([*root.glob("*.json"), *root.glob("*.jsonl")]):
        text = path.read_text().strip()
        try:
            if path.suffix == ".jsonl":
                records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            else:
                try:
                    records = [json.loads(text)]
                except ValueError:  # a JSON line after other output
                    records = [json.loads(text.splitlines()[-1])]
        except (ValueError, IndexError) as exc:
            print(f"{path.name}: unreadable ({exc})")
            continue
        for data in records:
            cells = [f"{k}={fmt(v)}" for k, v in scalars(data) if KEYS.search(k) and isinstance(v, (int, float, str))]
            print(f"{path.name}: " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
