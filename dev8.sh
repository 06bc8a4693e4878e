set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. EDGE_CACHE_DIR=/tmp/ec
t0=$SECONDS
if ls .whl/extra/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --target /tmp/extra .whl/extra/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/extra; fi
timeout 400 python3 -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors --tb=line tests > $OUT/suite.log 2>&1; grep -E "FAILED|ERROR|passed|failed" $OUT/suite.log | tail -n 15; echo "suite $((SECONDS-t0))s"
