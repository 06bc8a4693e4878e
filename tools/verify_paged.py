#!/usr/bin/env python3
"""Diff the contiguous and paged KV paths token by token; exit 0 only if they agree.

Same as `edge verify`. Run `python tools/verify_paged.py --help` for options.
"""

import sys
from pathlib import Path

try:
    import edge  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge.runtime.verify import main

if __name__ == "__main__":
    sys.exit(main())
