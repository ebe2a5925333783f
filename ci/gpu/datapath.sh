#!/usr/bin/env bash
# gpu-check's datapath step: the GPU data path's tests, then `beluga bench gpu` beside its
# floors.  Writes $STEP_OUT/junit.xml, $STEP_OUT/bench-gpu.json and $STEP_OUT/bench-gpu.png.
# Bounded by ci/gpu-check.sh (150 s): the tests take ~30 s (NVRTC compiles the kernels once),
# the bench ~40 s at --repeat 30 (BELUGA_GPU_BENCH_REPEAT, BELUGA_GPU_BENCH_BATCHES to change).
set -uo pipefail
: "${STEP_OUT:?run through ci/gpu-check.sh, or set STEP_OUT}"
status=0
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))' || exit 1
timeout -k 5 80 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="-ra --strict-markers" \
  --junitxml="$STEP_OUT/junit.xml" tests/test_gpu_kernels.py tests/test_transfer_gpu.py || status=1
timeout -k 5 60 python3 -m beluga bench gpu \
  --repeat "${BELUGA_GPU_BENCH_REPEAT:-30}" --batches "${BELUGA_GPU_BENCH_BATCHES:-16,256}" \
  --json "$STEP_OUT/bench-gpu.json" --chart "$STEP_OUT/bench-gpu.png" \
  > "$STEP_OUT/bench-gpu.txt" 2>&1 || status=1
cat "$STEP_OUT/bench-gpu.txt"
exit $status
