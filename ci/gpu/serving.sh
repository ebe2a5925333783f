#!/usr/bin/env bash
# GPU serving, as the paper measures it: the GPU serving tests, then `beluga bench e2e --device
# cuda` with the 7B model (Qwen2-7B's shape, bfloat16, weights drawn on the GPU) over 15,000-token
# LV-Eval-like documents, beside Mooncake Store (pinned, CUDA-registered staging; TCP on loopback),
# for the prefix cache and for prefill/decode 1:1, each --repeat 3.  Called by ci/gpu-check.sh with
# a bound of 240 s; writes under $STEP_OUT:
#   junit.xml                       the tests (tests/test_serving_gpu.py, tests/test_vllm_moves.py)
#   e2e-prefix.{json,png,txt}       prefix cache: pass 1 fills, pass 2 hits, both systems
#   e2e-pd.{json,png,txt}           prefill/decode 1:1, both systems
# Mooncake comes from the carry (../shared/gpu/README.md); without it the benches fail and say so.
#
# The sizes fit the bound on one H200 by estimate, not yet by measurement: 4 engines of ~22 GiB
# (budgeted, refused before start if they do not fit), an automatic rate of half what the engines
# serve (so a pass of N requests lasts about N / rate), 3 runs each from scratch (spawned
# engines import torch and draw 15 GB of weights).  Smaller or larger, by environment:
#   SERVING_DOCS (2)  SERVING_QUESTIONS (2)  SERVING_PD_QUESTIONS (1)  SERVING_REPEAT (3)
#   SERVING_PREFIX_S (125)  SERVING_PD_S (70): each bench's own bound, inside the step's.
set -uo pipefail
out=${STEP_OUT:?STEP_OUT: the folder this step writes to}
docs=${SERVING_DOCS:-2}
questions=${SERVING_QUESTIONS:-2}
pd_questions=${SERVING_PD_QUESTIONS:-1}
repeat=${SERVING_REPEAT:-3}
status=0

python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name())'

python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
  --junitxml="$out/junit.xml" tests/test_serving_gpu.py tests/test_vllm_moves.py || status=1

bench() {  # NAME BOUND_S ARGS...: one bench, its JSON, chart and printed summary
  local name=$1 bound=$2
  shift 2
  echo "serving: beluga bench e2e $* (bound ${bound} s)"
  timeout -k 10 "$bound" python3 -m beluga bench e2e --device cuda --model 7b \
    --baseline mooncake --repeat "$repeat" --documents "$docs" \
    --json "$out/$name.json" --chart "$out/$name.png" "$@" > "$out/$name.txt"
  local rc=$?
  cat "$out/$name.txt"
  (( rc == 0 )) || { echo "serving: $name failed with rc $rc"; status=1; }
}

bench e2e-prefix "${SERVING_PREFIX_S:-125}" --questions "$questions" "$questions"
bench e2e-pd "${SERVING_PD_S:-70}" --pd 1:1 --questions "$pd_questions" "$pd_questions" \
  --max-tokens 8
exit $status
