#!/usr/bin/env bash
# One call on the lent GPU machine: install the lab, run the GPU tests, then the named
# benchmarks; rows go to $OUT/results (fetched and appended to data/results/ afterwards).
#   usage (on the device): bash scripts/gpu_round.sh "tests/test_a.py tests/test_b.py" bench1 bench2 ...
#   a pytest -k expression goes in TEST_K (the test list is split on spaces: "-k a or b" there
#   would be split too, and pytest then runs nothing: it happened once, f46a2bd)
# Wheels for papermill/jupyter (absent on the device image) travel in .whl/ when present.
# The rows' commit label: $DSV4LAB_COMMIT, else .dsv4lab_commit (write it before the call,
#   git rev-parse --short HEAD > .dsv4lab_commit, and carry it: device copies have no .git).
set -u
export PYTHONUNBUFFERED=1 DSV4LAB_RESULTS_DIR="$OUT/results" NCCL_NVLS_ENABLE=0
export DSV4LAB_COMMIT="${DSV4LAB_COMMIT:-$(cat .dsv4lab_commit 2>/dev/null || echo unknown)}"
echo "rows labelled commit $DSV4LAB_COMMIT"
mkdir -p "$OUT/results"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || { echo "editable install failed"; python3 -m pip install --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -5; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m dsv4lab.cli env
tests="$1"; shift
if [ -n "$tests" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n "${TEST_WORKERS:-1}" ${TEST_K:+-k "$TEST_K"} $tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
for b in "$@"; do
  echo "=== bench $b"
  timeout "${BENCH_TIMEOUT:-150}" python3 -m dsv4lab.cli bench "$b" 2>&1 | tee -a "$OUT/bench.log" | tail -60
done
