#!/usr/bin/env bash
# One GPU call: the steps named on the command line, logs and JSON packed into
# $OUT/session.tgz (the device tool returns at most 8 files), a summary table last.  STACK=cu12 first installs the CUDA 12 Python stack carried in
# .whl/cu12 (cuda-bindings 12.x, cuda-core, NVRTC 12.6) over the machine's CUDA 13 one.
#   bash tools/gpu_session.sh tests verify verify-int8 bench-8b ...
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export EDGE_CACHE_DIR=${EDGE_CACHE_DIR:-/tmp/edge-cache}
RESULTS=${OUT:-gpu-out}
OUT=$(mktemp -d); trap 'tar czf "$RESULTS/session.tgz" -C "$OUT" .' EXIT
install_cu12() {  # the carried CUDA 12 stack into /tmp/cu12
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cu12 .whl/cu12/*.whl
}
# Its environment: NVRTC 12.6 loaded first, as cuda-pathfinder would take the machine's 13.x.
CU12_ENV="PYTHONPATH=/tmp/cu12:. LD_LIBRARY_PATH=/tmp/cu12/nvidia/cuda_nvrtc/lib:${LD_LIBRARY_PATH:-} LD_PRELOAD=/tmp/cu12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
if [ "${STACK:-cu13}" = cu12 ]; then
    install_cu12 || exit 1
    export $CU12_ENV
else
    export PYTHONPATH=.
fi
# Test-only packages the machine lacks (pexpect), carried in .whl/extra.
if ls .whl/extra/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/extra .whl/extra/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/extra
fi
python3 -c "import cuda.bindings, cuda.core, torch; from edge.kernels import nvrtc; print('cuda-bindings', cuda.bindings.__version__, 'cuda-core', cuda.core.__version__, 'nvrtc', nvrtc.nvrtc_version(), 'torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/stack-${STACK:-cu13}.txt"
status=()
step() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then r=ok; else r="FAIL($?)"; fi
    status+=("$(printf '%-26s %-8s %4ss  %s' "$name" "$r" $((SECONDS - t0)) "$(tail -n 1 "$OUT/$name.log" | cut -c1-150)")")
    echo "${status[-1]}"
    tar czf "$RESULTS/session.tgz" -C "$OUT" .  # after every step: a timeout loses nothing
}
B="python3 tools/bench.py"
for s in "$@"; do
    case $s in
        tests) step tests timeout "${SUITE_LIMIT:-900}" python3 -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors tests ;;
        tests16) step tests-16sms env EDGE_TEST_SMS=16 python3 -m pytest -m cuda -q -x -p no:cacheprovider tests ;;
        tests8) step tests-8sms env EDGE_TEST_SMS=8 python3 -m pytest -m cuda -q -x -p no:cacheprovider tests ;;
        orin-tests)  # correctness only, so the three suites share the GPU at once (a fifth of its memory each): 16 SMs, 8 SMs, the CUDA 12 stack at full SMs
            install_cu12 || exit 1
            T="python3 -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors tests"
            step tests-16sms+8sms+cu12 sh -c "
              export EDGE_TEST_GPU_FRACTION=0.2
              (EDGE_CACHE_DIR=/tmp/c16 EDGE_TEST_SMS=16 timeout ${SUITE_LIMIT:-480} $T > $OUT/tests-16sms.log 2>&1; echo rc=\$? >> $OUT/tests-16sms.log) &
              (EDGE_CACHE_DIR=/tmp/c8 EDGE_TEST_SMS=8 timeout ${SUITE_LIMIT:-480} $T > $OUT/tests-8sms.log 2>&1; echo rc=\$? >> $OUT/tests-8sms.log) &
              (export EDGE_CACHE_DIR=/tmp/c12 $CU12_ENV PYTHONPATH=/tmp/cu12:\$PYTHONPATH;
               python3 -c 'import cuda.bindings, cuda.core; from edge.kernels import nvrtc; print(\"cuda-bindings\", cuda.bindings.__version__, \"cuda-core\", cuda.core.__version__, \"nvrtc\", nvrtc.nvrtc_version())';
               python3 tools/verify_paged.py --device cuda --dtype bfloat16 | tail -n 3; timeout ${SUITE_LIMIT:-480} $T; echo rc=\$?) > $OUT/tests-cu12.log 2>&1 &
              wait; tail -n 2 $OUT/tests-16sms.log $OUT/tests-8sms.log $OUT/tests-cu12.log" ;;
        orin-recheck)  # the GPU test files that failed at 16 / 8 SMs, at both counts at once (a fifth of the memory each)
            step recheck-16sms+8sms sh -c "
              export EDGE_TEST_GPU_FRACTION=0.2 EDGE_CACHE_DIR=/tmp/kc
              F='tests/test_kernels_cuda.py tests/test_dequant_cuda.py tests/test_graph_cuda.py'
              (EDGE_TEST_SMS=16 timeout ${SUITE_LIMIT:-480} python3 -m pytest -m cuda -q -p no:cacheprovider \$F > $OUT/recheck-16sms.log 2>&1) &
              (EDGE_TEST_SMS=8 timeout ${SUITE_LIMIT:-480} python3 -m pytest -m cuda -q -p no:cacheprovider \$F > $OUT/recheck-8sms.log 2>&1) &
              wait; tail -n 1 $OUT/recheck-16sms.log $OUT/recheck-8sms.log" ;;
        load-peak-int4) step load-peak-int4 sh -c "python3 tools/make_model.py /tmp/q8b --preset qwen3-8b --dtype bfloat16 && python3 tools/load_peak.py /tmp/q8b --device cuda --quantize int4 && python3 tools/quantize.py /tmp/q8b /tmp/q8b-int4 --bits 4 && python3 tools/load_peak.py /tmp/q8b-int4 --device cuda" ;;
        quick) step quick python3 -m pytest -m cuda -q -x -p no:cacheprovider tests/test_int8_cuda.py tests/test_graph_cuda.py tests/test_overlap_cuda.py ;;
        verify) step verify python3 tools/verify_paged.py --device cuda --dtype bfloat16 ;;
        kvint8-tests) step kvint8-tests python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_kv_int8_cuda.py ;;
        kvint8-verify) for q in none int8 int4; do step kvint8-verify-$q python3 tools/verify_paged.py --device cuda --dtype bfloat16 --quantize $q --kv-dtype int8; done ;;
        kvint8-drift) for q in none int4; do step kvint8-drift-$q sh -c "python3 tools/kv_drift.py --device cuda --quantize $q --skip-transformers --json > $OUT/kv-drift-$q.json"; done ;;
        kvint8-bench)  # Qwen3-8B int4 at context 8192, 16 SMs: bf16 against int8 K/V (tok/s, attention's share, TTFT 2048)
            for kv in auto int8; do step kvint8-bench-$kv sh -c "$B decode --preset qwen3-8b --quantize int4 --sms 16 --context 8192 --max-seq-len 9216 --decode-tokens 64 --repeats 2 --ttft-lengths 2048 --kv-dtype $kv > $OUT/decode-8b-int4-8k-16sms-kv-$kv.json"; done ;;
        kvint8-kernels)  # decode attention alone, bf16 and int8 pools, 16 SMs
            for kv in auto int8; do step kvint8-kernels-$kv sh -c "$B kernels --sms 16 --kv-lens 2048,8192 --verify-tokens 1,5 --prefill --kv-dtype $kv > $OUT/kernels-16sms-kv-$kv.json"; done ;;
        vision16) step vision-16sms env EDGE_TEST_SMS=16 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_vision_cuda.py ;;
        vision8) step vision-8sms env EDGE_TEST_SMS=8 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_vision_cuda.py ;;
        vision) step vision python3 -m pytest -m cuda -q -x -p no:cacheprovider tests/test_vision_cuda.py ;;
        verify-int4) step verify-int4 python3 tools/verify_paged.py --device cuda --dtype bfloat16 --quantize int4 ;;
        bench-vision) step bench-vision sh -c "$B vision > $OUT/vision-8b.json" ;;
        verify-int8) step verify-int8 python3 tools/verify_paged.py --device cuda --dtype bfloat16 --quantize int8 ;;
        bench-8b) step bench-8b sh -c "$B decode --preset qwen3-8b --compare-hf --decode-tokens 128 --repeats 2 > $OUT/decode-8b.json" ;;
        bench-8b-int8-8k) step bench-8b-int8-8k sh -c "$B decode --preset qwen3-8b --quantize int8 --context 8192 --max-seq-len 9216 --decode-tokens 128 --repeats 2 --ttft-lengths 2048 > $OUT/decode-8b-int8-8k.json" ;;
        bench-16) for q in none int8; do step bench-8b-$q-16sms sh -c "$B decode --preset qwen3-8b --quantize $q --sms 16 --decode-tokens 64 --repeats 2 --ttft-lengths 512,2048 > $OUT/decode-8b-$q-16sms.json"; done ;;
        bench-8) for q in none int8; do step bench-8b-$q-8sms sh -c "$B decode --preset qwen3-8b --quantize $q --sms 8 --decode-tokens 64 --repeats 2 --ttft-lengths 512,2048 > $OUT/decode-8b-$q-8sms.json"; done ;;
        bench-16-8k) step bench-8b-int8-8k-16sms sh -c "$B decode --preset qwen3-8b --quantize int8 --sms 16 --context 8192 --max-seq-len 9216 --decode-tokens 64 --repeats 2 --ttft-lengths 2048 > $OUT/decode-8b-int8-8k-16sms.json" ;;
        sched16) step sched-16sms sh -c "$B scheduler --preset qwen3-8b --sms 16 --background-prompt 2048 --decode-tokens 128 > $OUT/scheduler-16sms.json" ;;
        floor16) step floor-16sms sh -c "$B kernels --floor --sms 16 --kv-lens 2048,8192 > $OUT/kernels-16sms.json" ;;
        floor8) step floor-8sms sh -c "$B kernels --floor --sms 8 --kv-lens 2048,8192 > $OUT/kernels-8sms.json" ;;
        int4-tests) step int4-tests python3 -m pytest -q -x -p no:cacheprovider tests/test_int4_cuda.py ;;
        fixes) step fixes python3 -m pytest -q -p no:cacheprovider tests/test_green_context_cuda.py tests/test_int8_cuda.py -k "green or fused_plan or fused_kernels" ;;
        quant-tests) step quant-tests python3 -m pytest -q -p no:cacheprovider tests/test_int4_cuda.py tests/test_int8_cuda.py tests/test_dequant_cuda.py ;;
        bench-8b-int8) step bench-8b-int8 sh -c "$B decode --preset qwen3-8b --quantize int8 --decode-tokens 128 --repeats 2 --ttft-lengths 512,2048 > $OUT/decode-8b-int8.json" ;;
        spec-tests)  # the quantized-linear and speculative GPU tests, the three files at once (a third of the memory each)
            step spec-tests sh -c "
              export EDGE_TEST_GPU_FRACTION=0.3 EDGE_CACHE_DIR=/tmp/st
              for f in int8 int4 speculative; do (timeout ${SUITE_LIMIT:-480} python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_\${f}_cuda.py > $OUT/tests-\$f.log 2>&1) & done
              wait; tail -n 1 $OUT/tests-int8.log $OUT/tests-int4.log $OUT/tests-speculative.log" ;;
        spec-tests-orin)  # the int8 / int4 GPU tests at 16 SMs and int8 at 8 (fewer resident CTAs: each takes more units)
            step spec-tests-orin sh -c "
              export EDGE_TEST_GPU_FRACTION=0.3 EDGE_CACHE_DIR=/tmp/so
              (EDGE_TEST_SMS=16 timeout ${SUITE_LIMIT:-480} python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_int8_cuda.py > $OUT/tests-int8-16.log 2>&1) &
              (EDGE_TEST_SMS=16 timeout ${SUITE_LIMIT:-480} python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_int4_cuda.py > $OUT/tests-int4-16.log 2>&1) &
              (EDGE_TEST_SMS=8 timeout ${SUITE_LIMIT:-480} python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_int8_cuda.py > $OUT/tests-int8-8.log 2>&1) &
              wait; tail -n 1 $OUT/tests-int8-16.log $OUT/tests-int4-16.log $OUT/tests-int8-8.log" ;;
        spec-*|sspec-*)  # [s]spec-<quantize>[-<sms>]: the speculative benchmark with a per-kernel breakdown at k = 4 (sspec: serial launches)
            q=${s#*spec-}; n=${q#*-}; q=${q%%-*}; [ "$n" = "$q" ] && n=""
            step "$s" sh -c "$B speculative --preset qwen3-8b --quantize $q ${n:+--sms $n} --breakdown 4 $([ "${s%%-*}" = sspec ] && echo --serial-launches) > $OUT/$s.json" ;;
        int4-gemv) for n in 16 132; do step int4-gemv-$n sh -c "python3 tools/bench_int4.py gemv --sweep $([ $n = 132 ] || echo --sms $n) > $OUT/int4-gemv-$n.json"; done ;;
        ncu-int4)  # Nsight Compute on one int4 decode GEMV (gate_up, down; default tuning and loads only) at 16 SMs and all
            for n in 16 0; do for k in gate_up down; do for t in default skip_math; do
                step ncu-int4-$k-$t-$n sh -c "ncu --clock-control none --kernel-name regex:int4_gemv --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables python3 tools/ncu_linear.py --format int4 --kind $k --tuning $t $([ $n = 0 ] || echo --sms $n) > $OUT/ncu-int4-$k-$t-$n.txt 2>&1; tail -n 3 $OUT/ncu-int4-$k-$t-$n.txt"
            done; done; done ;;
        int4-direct) for n in 16 132; do step int4-direct-$n sh -c "python3 tools/bench_int4.py gemv --tokens 5 --only default,direct $([ $n = 132 ] || echo --sms $n) > $OUT/int4-direct-$n.json"; done ;;
        int8-gemv) for n in 16 132; do step int8-gemv-$n sh -c "python3 tools/bench_int8.py --sweep --tokens ${TOKENS:-5} $([ $n = 132 ] || echo --sms $n) > $OUT/int8-gemv-$n.json"; done ;;
        bench-8b-int4) step bench-8b-int4 sh -c "$B decode --preset qwen3-8b --quantize int4 --decode-tokens 128 --repeats 2 --ttft-lengths 512,2048 > $OUT/decode-8b-int4.json" ;;
        bench-16-int4) step bench-8b-int4-16sms sh -c "$B decode --preset qwen3-8b --quantize int4 --sms 16 --decode-tokens 64 --repeats 2 --ttft-lengths 2048 > $OUT/decode-8b-int4-16sms.json" ;;
        load-peak-8b) step load-peak-8b sh -c "python3 tools/make_model.py /tmp/q8b --preset qwen3-8b --dtype bfloat16 && python3 tools/quantize.py /tmp/q8b /tmp/q8b-int8 && python3 tools/quantize.py /tmp/q8b /tmp/q8b-int4 --bits 4 && for a in '/tmp/q8b' '/tmp/q8b --quantize int8' '/tmp/q8b --quantize int4' '/tmp/q8b-int8' '/tmp/q8b-int4'; do python3 tools/load_peak.py \$a --device cuda; done > $OUT/load-peak-8b.jsonl" ;;
        bench-8-int4) step bench-8b-int4-8sms sh -c "$B decode --preset qwen3-8b --quantize int4 --sms 8 --decode-tokens 64 --repeats 2 --ttft-lengths 2048 > $OUT/decode-8b-int4-8sms.json" ;;
        sched8) step sched-8sms sh -c "$B scheduler --preset qwen3-8b --sms 8 --background-prompt 2048 --decode-tokens 128 > $OUT/scheduler-8sms.json" ;;
        spec) step spec python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_speculative_cuda.py ;;
        bench-spec) for q in none int8; do step bench-spec-$q sh -c "$B speculative --preset qwen3-8b --quantize $q > $OUT/speculative-8b-$q.json"; done ;;
        bench-spec16) step bench-spec-16sms sh -c "$B speculative --preset qwen3-8b --sms 16 > $OUT/speculative-8b-16sms.json" ;;
        new-tests)  # the GPU tests of int8 K/V, structured output and GGUF
            step new-tests python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_kv_int8_cuda.py tests/test_structured_cuda.py tests/test_gguf_cuda.py ;;
        verify-kv8) for q in none int4; do step verify-kv8-$q python3 tools/verify_paged.py --device cuda --dtype bfloat16 --quantize $q --kv-dtype int8; done ;;
        ba-*)  # ba-<quantize>: decode and TTFT of this tree, then of the previous release (.before), same card
            q=${s#ba-}
            step after-$q sh -c "timeout ${STEP_LIMIT:-240} $B decode --preset qwen3-8b --quantize $q --decode-tokens 128 --repeats 2 --ttft-lengths 512 > $OUT/after-$q.json"
            step before-$q sh -c "cd .before && PYTHONPATH=. timeout ${STEP_LIMIT:-240} $B decode --preset qwen3-8b --quantize $q --decode-tokens 128 --repeats 2 --ttft-lengths 512 > $OUT/before-$q.json" ;;
        kv8k) for kv in auto int8; do step kv8k-$kv sh -c "$B decode --preset qwen3-8b --quantize int4 --sms 16 --context 8192 --max-seq-len 9216 --decode-tokens 64 --repeats 2 --ttft-lengths 2048 --kv-dtype $kv > $OUT/kv8k-$kv.json"; done ;;
        structured) for n in 16 8; do step structured-$n sh -c "timeout ${STEP_LIMIT:-240} $B structured --preset qwen3-8b --quantize int4 --sms $n > $OUT/structured-$n.json"; done ;;
        board) for n in 16 8; do step board-$n sh -c "$B board --preset qwen3-8b --quantize int4 --sms $n > $OUT/board-$n.json"; done ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
echo
printf '%s\n' "${status[@]}" | tee "$OUT/status.txt"
python3 tools/gpu_summary.py "$OUT"
