"""Orin-shaped runs on a larger GPU: in a process restricted to 16 SMs by a CUDA green
context, the launcher plans for 16 SMs also after kernels were loaded (which makes the
primary context current on the thread). A subprocess, since the context is per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import json, sys
sys.path.insert(0, "tools")
import torch
from orin_shape import restrict_sms
from edge.kernels.launcher import Launcher
ctx = restrict_sms(16)
first = Launcher(0).sm_count()
lau = Launcher(0)
lau.kernel("fused.cu", "embedding")
after = Launcher(0).sm_count()
print(json.dumps({"first": first, "after_load": after, "device": torch.cuda.get_device_properties(0).multi_processor_count}))
"""


def test_launcher_plans_for_the_green_context_after_kernels_load() -> None:
    if torch.cuda.get_device_properties(0).multi_processor_count <= 16:
        pytest.skip("the GPU has no more than 16 SMs: nothing to restrict")
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["first"] == 16 and seen["after_load"] == 16, seen
