"""Peak memory while loading a checkpoint: host VmHWM above the baseline plus the device's
allocator peak, against the final weight bytes (issue #22: at most weights + 1.5 GiB).

    python tools/load_peak.py MODEL_DIR [--device cuda] [--dtype bfloat16] [--quantize int8|int4]

Prints one JSON object. The baseline is taken after torch (and on a GPU its CUDA context)
is up, and the kernel's high-water mark is reset there (``/proc/self/clear_refs``), so the
figure is what loading itself adds. Linux only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BOUND_EXTRA = 3 << 29  # 1.5 GiB above the final weights


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(model_dir: str, device: str, dtype: str, quantize: str | None) -> dict:
    import torch

    from edge.model.config import ModelConfig, parse_dtype
    from edge.model.decoder import Model

    dev = torch.device(device)
    cfg = ModelConfig.from_pretrained(model_dir)
    if dev.type == "cuda":
        torch.empty(1, device=dev)  # the CUDA context belongs to the baseline
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        device_base = torch.cuda.memory_allocated(dev)
    base = status_kib("VmRSS") << 10
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    model = Model.load(model_dir, cfg, dev, parse_dtype(dtype), 256, quantize=quantize)
    host_peak = (status_kib("VmHWM") << 10) - base
    device_peak = torch.cuda.max_memory_allocated(dev) - device_base if dev.type == "cuda" else 0
    weights = model.weight_bytes()
    peak = host_peak + device_peak
    return {
        "model": model_dir,
        "device": str(dev),
        "dtype": dtype,
        "quantize": quantize,
        "weights": weights,
        "host_peak": host_peak,
        "device_peak": device_peak,
        "peak": peak,
        "over_weights": peak - weights,
        "bound": weights + BOUND_EXTRA,
        "within_bound": peak <= weights + BOUND_EXTRA,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", choices=("int8", "int4"))
    args = p.parse_args(argv)
    out = measure(args.model_dir, args.device, args.dtype, args.quantize)
    print(json.dumps(out))
    return 0 if out["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
