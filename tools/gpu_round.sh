#!/usr/bin/env bash
# One round on a GPU machine: install the lab, run the GPU tests, then the named benchmarks, with
# the rows written under $RESULTS (default data/results, or $OUT/results when $OUT is set).
#   bash tools/gpu_round.sh "tests/test_a.py tests/test_b.py" [bench ...]
# TEST_K: a pytest -k expression; TEST_WORKERS: xdist workers (default 1); DSV4LAB_COMMIT labels
# the rows where the checkout has no .git (else .dsv4lab_commit, written beside it).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export DSV4LAB_RESULTS_DIR="${RESULTS:-${OUT:+$OUT/results}}"
[ -n "$DSV4LAB_RESULTS_DIR" ] || unset DSV4LAB_RESULTS_DIR
export DSV4LAB_COMMIT="${DSV4LAB_COMMIT:-$(cat .dsv4lab_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
mkdir -p "${DSV4LAB_RESULTS_DIR:-data/results}"
if ls .whl/*.whl >/dev/null 2>&1; then      # Python packages the machine lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || python3 -m pip install --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -5
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m dsv4lab.cli env
tests="${1:-}"; shift || true
if [ -n "$tests" ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -n "${TEST_WORKERS:-1}" ${TEST_K:+-k "$TEST_K"} $tests 2>&1 \
    | tee "${OUT:-/tmp}/gpu_tests.log" | tail -40
fi
for b in "$@"; do
  echo "=== bench $b"
  python3 -m dsv4lab.cli bench "$b" 2>&1 | tee -a "${OUT:-/tmp}/bench.log" | tail -40
done
