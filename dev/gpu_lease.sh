#!/usr/bin/env bash
# One lease on a GPU machine, run from the repository root: the environment, bench.gpu's checks and
# timings, the tests written for CUDA, and the whole suite with CUDA as torch's default device.
# Each step has its own time limit (seconds, from the environment) so the run ends inside the lease;
# logs go to $OUT. The table of bench.gpu is printed again at the end. CPU_SUITE_S (default 0: skipped)
# also runs the whole suite with the CPU as default device, as CI does, on the machine's own torch.
set -u
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/env.txt"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"
$PY -m pip list 2>/dev/null | grep -i -E "^(torch|numpy|hypothesis|pytest|pytest-xdist|psutil|tqdm) " | tee -a "$OUT/env.txt"

timeout -s INT "${BENCH_S:-210}" $PY -m bench.gpu --json "$OUT/gpu.json" --sections "${SECTIONS:-check,sync,targets,asv}" \
    > "$OUT/gpu.log" 2> "$OUT/gpu.err"
echo "bench.gpu exit $?"

[ "${CUDA_TESTS_S:-60}" = 0 ] || timeout -s INT "${CUDA_TESTS_S:-60}" $PY -m pytest -q -p no:cacheprovider -p no:warnings -rfE --tb=short \
    tests/test_dtypes.py tests/test_derivatives.py tests/test_products.py tests/test_memory.py tests/test_data.py \
    -k "cuda or CUDA" > "$OUT/cuda_tests.log" 2>&1
echo "tests written for CUDA: exit $?"; tail -5 "$OUT/cuda_tests.log"

if [ -n "${DIAG_FILE:-}" ]; then  # chosen tests, one node id per line, with whole tracebacks
    mapfile -t ids < "$DIAG_FILE"
    JACMODE_TEST_DEVICE=cuda timeout -s INT "${DIAG_S:-90}" $PY -m pytest -q -p no:cacheprovider -p no:warnings \
        --tb=long -o addopts="" "${ids[@]}" > "$OUT/diag.log" 2>&1
    echo "chosen tests: exit $?"; tail -3 "$OUT/diag.log"
fi

if [ "${CPU_SUITE_S:-0}" != 0 ]; then  # the whole suite as CI runs it (CPU default device), on this machine's torch
    timeout -s INT "$CPU_SUITE_S" $PY -m pytest tests -q -p no:cacheprovider -p no:warnings -n "${WORKERS:-12}" -rfE \
        --tb=line -o addopts="" > "$OUT/cpu_suite.log" 2>&1
    echo "suite on the CPU, this torch: exit $?"
    grep -E "^(FAILED|ERROR)" "$OUT/cpu_suite.log" | sed -E 's/ - (.{0,160}).*/ - \1/' | head -40
    tail -3 "$OUT/cpu_suite.log"
fi

[ "${SUITE_S:-150}" = 0 ] || JACMODE_TEST_DEVICE=cuda timeout -s INT "${SUITE_S:-150}" $PY -m pytest tests -q -p no:cacheprovider -p no:warnings \
    -n "${WORKERS:-12}" -rfE --tb=line -o addopts="" > "$OUT/suite.log" 2>&1
echo "suite with CUDA as default device: exit $?"
grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | sed -E 's/ - (.{0,160}).*/ - \1/' | head -60
tail -3 "$OUT/suite.log"

echo; sed -n '/^| section/,$p' "$OUT/gpu.log"
