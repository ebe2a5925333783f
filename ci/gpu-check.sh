#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine (kind nvidia-h200; see
# ../shared/gpu/README.md for its facts and for carrying what it lacks).
#
#   bash ci/gpu-check.sh                  # figures and logs go to $OUT (default ./gpu-out)
#   BELUGA_GPU_STEPS="native datapath" bash ci/gpu-check.sh   # only some steps
#
# On the machine, with the carry made by ../shared/gpu/make-carry.sh:
#   . .gpu-carry/on-device.sh .gpu-carry && python3 setup.py build_ext --inplace -q -j 16 \
#     && PYTHONPATH=$PWD:$PYTHONPATH bash ci/gpu-check.sh
#
# The whole run is sized to finish in under 8 minutes on one H200 (each step has
# its own bound below), so a lent machine's 15 minutes leave room to run it twice.
# Steps (each a script in ci/gpu/, each writing under $OUT/<step>/):
#   native    the C core's own tests on this machine's CPU (it has AVX-512, which the
#             CPU machines lack: the AVX-512 copy and CRC paths run only here)
#   datapath  the GPU data path: its tests, then `beluga bench gpu --json` (floors beside)
#   serving   GPU serving: its tests, then `beluga bench e2e --device cuda` against Mooncake
# Exit status: 0 when every step passed, else 1 (a summary line per step at the end).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
steps=${BELUGA_GPU_STEPS:-native datapath serving}
declare -A BOUND_S=([native]=60 [datapath]=150 [serving]=240)

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current --format=csv 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1
  git -C "$ROOT" rev-parse HEAD 2>/dev/null || true
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

status=0
summary=()
for step in $steps; do
  script=$ROOT/ci/gpu/$step.sh
  [[ -f $script ]] || { echo "gpu-check: no step '$step' ($script)" >&2; exit 2; }
  mkdir -p "$OUT/$step"
  start=$SECONDS
  echo "gpu-check: $step (bound ${BOUND_S[$step]:-120} s)"
  STEP_OUT=$OUT/$step timeout -k 10 "${BOUND_S[$step]:-120}" bash "$script" 2>&1 | tee "$OUT/$step/log.txt"
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || status=1
  summary+=("$step: rc $rc in $((SECONDS - start)) s")
done
printf 'gpu-check: %s\n' "${summary[@]}" | tee "$OUT/summary.txt"
exit $status
