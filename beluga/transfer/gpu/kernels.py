"""The GPU data path's device code (kernels.cu): NVRTC for the GPU, g++ for the host.

``kernels.cu`` holds a row-copy kernel and the CRC32C kernel; its arithmetic
is ``__host__ __device__`` so the same file also builds as host C++.  The CRC
polynomial and every shift constant come from the C core
(``_core.CRC32C_POLY``, ``_core.crc32c_x8n``): the CRC has one definition.

- :func:`compile_cubin` compiles the kernels with NVRTC for an architecture
  (``sm_90`` for the H200); it needs NVRTC, not a GPU, so CPU tests run it.
- :func:`host_library` builds the host form with g++ (cached per source and
  compiler) for the CPU tests and the stand-in runtime.
- :func:`pow8_table`: the 64 constants x^(8 * 2^j) mod P the kernels shift with.

Thread-safe (compilation results are cached under a lock); fork-safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from beluga._native import _core
from beluga.errors import BackendUnavailableError

SOURCE_PATH = Path(__file__).with_name("kernels.cu")
KERNEL_NAMES = (b"beluga_copy_rows", b"beluga_crc_blocks")
#: the C core's polynomial, handed to both compilers as a macro
POLY_DEFINE = f"-DBL_CRC32C_POLY={_core.CRC32C_POLY:#x}u"
ROW_DTYPE = np.dtype([("src", "<u8"), ("dst", "<u8"), ("len", "<u8")])
SEG_DTYPE = np.dtype([("addr", "<u8"), ("len", "<u8"), ("after", "<u8"), ("block", "<u8")])
BLOCK_DTYPE = np.dtype([("init", "<u8"), ("total", "<u8"), ("expect", "<u8")])
STATE_DTYPE = np.dtype([("acc", "<u4"), ("pad", "<u4"), ("done", "<u8")])
LANES = 32

_lock = threading.Lock()
_cubins: dict[str, bytes] = {}
_host: ctypes.CDLL | None = None


def source() -> str:
    return SOURCE_PATH.read_text()


def pow8_table() -> np.ndarray:
    """x^(8 * 2^j) mod P for j = 0..63, as uint32: the shifts the kernels multiply by."""
    return np.array([_core.crc32c_x8n(1 << j) for j in range(64)], dtype=np.uint32)


def init_terms(lengths: np.ndarray) -> np.ndarray:
    """~0 * x^(8 len) mod P per length: the part of each block's CRC that its bytes do not set."""
    values, where = np.unique(np.asarray(lengths, dtype=np.int64), return_inverse=True)
    terms = [_core.crc32c_mul(_core.crc32c_x8n(int(n)), 0xFFFFFFFF) for n in values.tolist()]
    return (
        np.array(terms, dtype=np.uint64)[where.reshape(-1)]
        if len(values)
        else values.astype(np.uint64)
    )


# -- NVRTC ----------------------------------------------------------------------------


def _nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be: the system's, then the nvidia-cuda-nvrtc wheel's (torch's too)."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    found = list(names)
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            for n in names:
                p = Path(root) / sub / n
                if p.exists():
                    found.insert(0, str(p))
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for n in names:
        for lib in ("lib64", "lib"):
            p = Path(cuda_home) / lib / n
            if p.exists():
                found.append(str(p))
    return found


def load_nvrtc() -> ctypes.CDLL:
    """NVRTC, from the system or the nvidia-cuda-nvrtc wheel; BackendUnavailableError if none."""
    for name in _nvrtc_candidates():
        try:
            if "/" in name:  # a wheel's: NVRTC opens its builtins by name, so load them first
                for builtins in sorted(Path(name).parent.glob("libnvrtc-builtins.so*")):
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise BackendUnavailableError(
        "NVRTC is not loadable (tried libnvrtc.so.13/.12 and the nvidia-cuda-nvrtc wheel); "
        "install it with: pip install 'nvidia-cuda-nvrtc==13.0.*'"
    )


def compile_cubin(arch: str = "sm_90") -> bytes:
    """The kernels compiled by NVRTC for ``arch`` (cached per process); raises with NVRTC's log."""
    with _lock:
        if arch in _cubins:
            return _cubins[arch]
        nvrtc = load_nvrtc()
        prog = ctypes.c_void_p()

        def check(code: int, what: str) -> None:
            if code != 0:
                log = b""
                size = ctypes.c_size_t()
                if nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) == 0 and size.value:
                    buf = ctypes.create_string_buffer(size.value)
                    nvrtc.nvrtcGetProgramLog(prog, buf)
                    log = buf.value
                raise BackendUnavailableError(
                    f"NVRTC {what} of kernels.cu for {arch} failed with code {code}: "
                    f"{log.decode(errors='replace')}"
                )

        check(
            nvrtc.nvrtcCreateProgram(
                ctypes.byref(prog), source().encode(), b"kernels.cu", 0, None, None
            ),
            "create",
        )
        try:
            opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", POLY_DEFINE.encode()]
            options = (ctypes.c_char_p * len(opts))(*opts)
            check(nvrtc.nvrtcCompileProgram(prog, len(opts), options), "compile")
            size = ctypes.c_size_t()
            check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
            cubin = ctypes.create_string_buffer(size.value)
            check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        finally:
            nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        _cubins[arch] = cubin.raw
        return cubin.raw


# -- the host form --------------------------------------------------------------------


def host_library() -> ctypes.CDLL:
    """kernels.cu built as host C++ by g++ (cached on disk per source): the kernels'
    arithmetic on the CPU.  BackendUnavailableError without a C++ compiler."""
    global _host
    with _lock:
        if _host is not None:
            return _host
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if not cxx:
            raise BackendUnavailableError("building kernels.cu for the host needs g++")
        text = source()
        tag = hashlib.sha256((text + POLY_DEFINE + cxx).encode()).hexdigest()[:16]
        cache = Path(tempfile.gettempdir()) / f"beluga-kernels-{os.getuid()}"
        cache.mkdir(mode=0o700, exist_ok=True)
        lib = cache / f"kernels-{tag}.so"
        if not lib.exists():
            fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
            os.close(fd)
            cmd = [cxx, "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-x", "c++"]
            cmd += [POLY_DEFINE, str(SOURCE_PATH), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                os.unlink(tmp)
                raise BackendUnavailableError(f"g++ could not build kernels.cu: {done.stderr}")
            os.replace(tmp, lib)
        host = ctypes.CDLL(str(lib))
        host.beluga_crc_blocks_host.restype = ctypes.c_uint32
        host.beluga_crc_blocks_host.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        host.beluga_crc_blocks_host.argtypes += [ctypes.c_void_p] * 4
        host.beluga_crc_blocks_host.argtypes += [ctypes.c_uint64, ctypes.c_int]
        host.beluga_crc_raw_host.restype = ctypes.c_uint32
        host.beluga_crc_raw_host.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
        _host = host
        return host
