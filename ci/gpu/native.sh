#!/usr/bin/env bash
# The C core's own tests on the GPU machine's CPU, whose AVX-512 copy and CRC paths
# never run on the CPU machines (Zen 3, AVX2 only).  Writes $STEP_OUT/junit.xml.
set -euo pipefail
python3 -c 'from beluga._native import _core; print("cpu features:", _core.cpu_features())'
python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
  --junitxml="$STEP_OUT/junit.xml" tests/test_native.py tests/test_alignment.py tests/test_crc_fast.py
