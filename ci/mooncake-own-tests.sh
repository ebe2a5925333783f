#!/usr/bin/env bash
# Run Mooncake's own store tests, unchanged, against Mooncake and against the Beluga
# drop-in, and compare every test's outcome (tests/compat_mooncake/mooncake_own_tests.py).
#
#   ci/mooncake-own-tests.sh MOONCAKE_GIT [REVISION] [-- MORE ARGUMENTS]
#
# MOONCAKE_GIT: a clone of github.com/kvcache-ai/Mooncake (a bare one will do);
# REVISION: what to take mooncake-wheel/tests from (default v0.3.13, the release
# ci/install-mooncake.sh installs; a clone without that tag needs another).  The tests
# are extracted into a scratch folder, never into this project.  Needs the Mooncake
# wheel (ci/install-mooncake.sh) and ports 50051, 8080 and 50052 free.  Exit status:
# 0 when every test that passes on Mooncake passes on Beluga or is a documented
# difference (beluga.compat.mooncake.DIFFERENCES) and no documented difference is
# stale; 1 otherwise; 2 for bad arguments.
set -euo pipefail

usage() { echo "usage: $0 MOONCAKE_GIT [REVISION] [-- ARGS for python -m tests.compat_mooncake.mooncake_own_tests]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
repo=$1; shift
revision=v0.3.13
if [[ $# -ge 1 && $1 != -- ]]; then revision=$1; shift; fi
[[ $# -eq 0 || $1 == -- ]] || usage
[[ $# -eq 0 ]] || shift

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
git -C "$repo" rev-parse --verify --quiet "$revision^{commit}" >/dev/null || {
    echo "mooncake-own-tests: $repo has no revision $revision: name one it has (git -C $repo tag)" >&2
    exit 2
}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git -C "$repo" archive "$revision" mooncake-wheel/tests | tar -x -C "$scratch"
echo "mooncake-own-tests: Mooncake's tests at $revision ($(git -C "$repo" rev-parse --short "$revision^{commit}"))"
cd "$root"
"$python" -m tests.compat_mooncake.mooncake_own_tests "$scratch/mooncake-wheel/tests" "$@"
