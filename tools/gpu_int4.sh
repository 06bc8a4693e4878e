#!/usr/bin/env bash
# One GPU session for the int4 kernels: their tests, the GEMV step at full and 16 SMs,
# prefill against bf16, load memory, end-to-end decode / TTFT. Results under $OUT.
#   PYTHONPATH=. bash tools/gpu_int4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EDGE_CACHE_DIR=${EDGE_CACHE_DIR:-/tmp/edge-cache}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_int4_cuda.py >"$OUT/tests.log" 2>&1; tail -n 15 "$OUT/tests.log"
for a in "gemv --sms 16 --sweep" "gemv" "prefill" "ttft"; do
    timeout 120 python3 tools/bench_int4.py $a 2>"$OUT/err.log" | tee -a "$OUT/bench_int4.jsonl" || tail -n 5 "$OUT/err.log"
done
timeout 180 python3 tools/bench.py decode --preset qwen3-8b --quantize int4 --decode-tokens 128 --repeats 2 \
    --ttft-lengths 512,2048 >"$OUT/decode-8b-int4.json" 2>"$OUT/err-decode.log" || tail -n 8 "$OUT/err-decode.log"
python3 - "$OUT/decode-8b-int4.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    sys.exit(f"no decode result: {exc}")
keys = ("device", "copy_bandwidth_GBps", "weight_bytes", "roofline_tok_s", "decode_tok_s_graph", "roofline_fraction_graph", "decode_tok_s_eager", "ttft_ms", "peak_memory_GiB")
print(json.dumps({k: r.get(k) for k in keys}))
PY
timeout 90 python3 tools/bench_int4.py load --preset qwen3-1.7b 2>"$OUT/err.log" | tee -a "$OUT/bench_int4.jsonl" || tail -n 5 "$OUT/err.log"
