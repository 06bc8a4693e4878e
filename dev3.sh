set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. EDGE_CACHE_DIR=/tmp/ec
t0=$SECONDS
EDGE_TEST_SMS=16 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_int8_cuda.py -k "pairs or prestaged or norm_mode or fused_modes_match or tensor_core" > $OUT/t16.log 2>&1; tail -n 2 $OUT/t16.log; echo "t16 $((SECONDS-t0))s"
timeout 200 python3 tools/bench.py speculative --preset qwen3-8b --quantize int8 --sms 16 --breakdown 4 > $OUT/spec16.json 2> $OUT/spec16.err
python3 abs_sum.py $OUT/spec16.json | cut -c1-300; echo "spec16 $((SECONDS-t0))s"
timeout 220 python3 tools/bench.py speculative --preset qwen3-8b --quantize int8 --sms 8 --breakdown 4 > $OUT/spec8.json 2> $OUT/spec8.err
python3 abs_sum.py $OUT/spec8.json | cut -c1-300; echo "spec8 $((SECONDS-t0))s"
EDGE_TEST_SMS=8 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_int8_cuda.py -k "pairs or prestaged" > $OUT/t8.log 2>&1; tail -n 2 $OUT/t8.log; echo "t8 $((SECONDS-t0))s"
