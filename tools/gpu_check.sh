#!/usr/bin/env bash
# One GPU session: every CUDA test, the verification script on a Qwen3-shaped bf16
# model, and the benchmarks, with JSON under $OUT (or ./gpu-out) and a table last.
#   PYTHONPATH=. bash tools/gpu_check.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
FINAL=${OUT:-gpu-out}
mkdir -p "$FINAL"
OUT=$(mktemp -d)  # everything lands here, then travels as one archive (file-count limits)
export EDGE_CACHE_DIR=${EDGE_CACHE_DIR:-/tmp/edge-cache}
status=()

step() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then r=ok; else r="FAIL($?)"; fi
    status+=("$(printf '%-22s %-8s %4ss' "$name" "$r" $((SECONDS - t0)))")
    tail -n 3 "$OUT/$name.log"
    printf '%s\n' "${status[@]}" >"$OUT/status.txt"
    tar -czf "$FINAL/results.tgz" -C "$OUT" .  # after every step: a timeout loses nothing
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
step cuda-tests python -m pytest -m cuda -q -p no:cacheprovider tests
python tools/make_model.py /tmp/qwen3-0.6b --preset qwen3-0.6b --dtype bfloat16 >/dev/null 2>&1
step verify-paged python tools/verify_paged.py --model /tmp/qwen3-0.6b --device cuda --dtype bfloat16
step bench-0.6b sh -c "python tools/bench.py decode --preset qwen3-0.6b --compare-hf > $OUT/decode-0.6b.json"
step bench-scheduler sh -c "python tools/bench.py scheduler --preset qwen3-0.6b > $OUT/scheduler.json"
if [ "${1:-}" != quick ]; then
    step bench-8b sh -c "python tools/bench.py decode --preset qwen3-8b --compare-hf --decode-tokens 128 --repeats 2 > $OUT/decode-8b.json"
    step bench-8b-int8 sh -c "python tools/bench.py decode --preset qwen3-8b --quantize int8 --decode-tokens 128 --repeats 2 > $OUT/decode-8b-int8.json"
    step bench-kernels sh -c "python tools/bench.py kernels --floor > $OUT/kernels.json"
fi
echo
printf '%s\n' "${status[@]}"
