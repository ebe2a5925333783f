#!/usr/bin/env bash
# Install Beluga on a fresh Debian 12 / Ubuntu machine into the project's own
# virtualenv (.venv in the checkout; BELUGA_VENV moves it).  Debian's python3
# refuses `pip install` outside a virtualenv (PEP 668), so nothing here touches
# the system interpreter's packages.
#
#   ci/install.sh                  everything: system packages, .venv, the CPU build
#                                  of PyTorch, Beluga with its extras, the Mooncake
#                                  baseline, the QEMU sandbox
#   ci/install.sh --no-sandbox     skip the QEMU sandbox (no root needed when the
#                                  system packages are already there)
#
# Every step says what it does; a step that fails says which one and what to do,
# and the script exits non-zero.  Re-running it is quick: each step is skipped
# when what it makes is already there.  Enter the venv with `. .venv/bin/activate`
# (or run .venv/bin/beluga, .venv/bin/python directly).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${BELUGA_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0

sandbox=1
for arg in "$@"; do
  case $arg in
    --no-sandbox) sandbox=0 ;;
    *) echo "usage: $0 [--no-sandbox]" >&2; exit 2 ;;
  esac
done

say() { echo "install: $*"; }
step=""
fail() {
  echo "install: FAILED while ${step:-starting}" >&2
  [[ -n "${hint:-}" ]] && echo "install: $hint" >&2
  exit 1
}
trap fail ERR
run_step() {  # DESCRIPTION HINT: announce a step and what to do if it fails
  step=$1 hint=$2
  say "$step"
}

# -- system packages ----------------------------------------------------------
command -v "$PYTHON" >/dev/null || {
  echo "install: no '$PYTHON' on PATH; install Python 3.10+ (apt-get install python3) or set PYTHON" >&2
  exit 1
}
need_apt=()
for pkg in gcc libnuma1 numactl; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# a distribution Python needs its venv module and headers as separate packages
if ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
  need_apt+=("python3-venv")
fi
if ! "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  need_apt+=("python3-dev")
fi
if (( ${#need_apt[@]} )); then
  run_step "apt-get install ${need_apt[*]}" \
    "run this script as root (or: sudo apt-get install ${need_apt[*]}), then run it again"
  [[ $(id -u) -eq 0 ]] || false
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# -- the virtualenv -----------------------------------------------------------
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  run_step "creating the virtualenv $VENV" \
    "'$PYTHON -m venv $VENV' failed: remove $VENV and check that $PYTHON is 3.10 or newer"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
PIP=("$PY" -m pip --disable-pip-version-check -q)

# -- PyTorch first: a bare torch requirement would pull a multi-GB CUDA build ----
if ! "$PY" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  run_step "pip install $TORCH (the CPU build)" \
    "pip could not install $TORCH; check the network or pip's index settings and run again"
  "${PIP[@]}" install "$TORCH"
fi

# -- Beluga (editable, with the C core) and its extras ----------------------------
run_step "pip install -e .[model,report,test,lint] (builds the C core)" \
  "the project did not build: read pip's error above (a C compiler error means gcc or the Python headers are missing)"
"${PIP[@]}" install "setuptools>=65" wheel
"${PIP[@]}" install --no-build-isolation -e ".[model,report,test,lint]"
"$PY" -c 'import beluga._native._core' || {
  hint="the C core does not import; run '$PY setup.py build_ext --inplace' to see why"
  false
}

# -- the Mooncake Store baseline (beluga bench store --baseline mooncake) -------
run_step "the Mooncake Store baseline (ci/install-mooncake.sh)" \
  "ci/install-mooncake.sh failed; its own message above says why"
PYTHON=$PY bash ci/install-mooncake.sh

# -- the QEMU CXL sandbox: packages, guest kernel, initramfs (cached) -----------
if (( sandbox )); then
  run_step "the QEMU sandbox (python -m emulation build; cached after the first run)" \
    "the sandbox build failed (it needs root for apt-get); fix what it printed, or pass --no-sandbox"
  "$PY" -m emulation build
fi

step="" hint=""
say "done: enter the venv with '. $VENV/bin/activate', then run 'beluga demo' or 'python -m pytest'"
