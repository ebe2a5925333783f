#!/usr/bin/env bash
# Install everything Beluga needs on a fresh Debian 12 machine, idempotently:
# system packages, the CPU build of PyTorch (first, so nothing pulls a CUDA
# build), then Beluga itself with its test and lint extras.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pkg in gcc libnuma1 numactl; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PIP="python3 -m pip --disable-pip-version-check -q"
python3 -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || $PIP install "torch==2.13.0"
$PIP install --no-build-isolation -e ".[model,report,test,lint]"

# the Mooncake Store baseline (beluga bench store --baseline mooncake)
bash ci/install-mooncake.sh
# the QEMU CXL sandbox: packages, guest kernel, initramfs (cached after the first run)
python3 -m emulation build
