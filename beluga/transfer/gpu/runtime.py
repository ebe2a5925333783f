"""The CUDA calls of the GPU path, through the driver API with ctypes: one Plan, one sync.

:class:`CudaRuntime` runs a :class:`~beluga.transfer.gpu.plan.Plan` on one
stream: its copy-engine runs as ONE ``cuMemcpyBatchAsync`` (resolved at run
time with ``cuGetProcAddress``: CUDA 13 has ``_v2``, without the failure
index of 12.8's; a driver without it, or a batch it refuses, gets one
``cuMemcpyAsync`` per run instead), its small rows as one launch of the copy
kernel, and its CRC segments as one launch of the CRC kernel, then one
stream synchronisation.  The kernels' tables go up through a pinned host
arena with one asynchronous copy into a device arena, both kept and grown,
never allocated per call; the status comes back in mapped pinned memory the
CRC kernel writes (one small array and one word: no copy back).

The stream is the caller's current torch stream, so a save follows the
kernels that computed its KV; the legacy default stream (0, which the batch
call refuses) is replaced by a stream of our own that synchronises with it.

Thread-safe: one lock per runtime serialises its calls (they share the
arenas and the stream).  Not fork-safe: CUDA is not; a child makes its own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np

from beluga.errors import BackendUnavailableError
from beluga.transfer.gpu import kernels
from beluga.transfer.gpu.kernels import ROW_DTYPE, SEG_DTYPE, STATE_DTYPE
from beluga.transfer.gpu.plan import Plan

log = logging.getLogger("beluga.gpu")

_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the flag that works for DAX, too
_HOSTALLOC_PORTABLE_DEVICEMAP = 0x01 | 0x02
_THREADS = 256
_WARPS_PER_SM = 32
_ACCESS_ORDER_STREAM = 1
_PROC_LEGACY_STREAM = 1 << 0

c_u64 = ctypes.c_uint64


class _Attrs(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h, 12.8 and 13): access order, two location hints, flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocType", ctypes.c_int),
        ("srcLocId", ctypes.c_int),
        ("dstLocType", ctypes.c_int),
        ("dstLocId", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


class CudaRuntime:
    """The CUDA calls the GPU path makes, each checked.  See the module docstring."""

    _modules: dict[int, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}  # per device, per process

    def __init__(self, device: Any = None) -> None:
        try:
            import torch
        except ImportError as e:
            raise BackendUnavailableError("the GPU path needs torch with CUDA") from e
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "no CUDA device (torch.cuda.is_available() is False); move KV through the "
                "pool's Memory on the CPU instead"
            )
        self.torch = torch
        wanted = torch.device("cuda") if device is None else torch.device(device)
        if wanted.type != "cuda":
            raise ValueError(f"the GPU path runs on a CUDA device, not {wanted}")
        index = torch.cuda.current_device() if wanted.index is None else wanted.index
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)  # makes the primary context current on this thread
        self.cudart = torch.cuda.cudart()
        try:
            self.libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise BackendUnavailableError(f"the CUDA driver library cannot be loaded: {e}") from e
        self._declare()
        self._lock = threading.Lock()
        self.context = ctypes.c_void_p()
        self._driver("cuCtxGetCurrent", ctypes.byref(self.context))
        props = torch.cuda.get_device_properties(self.device)
        self.sms = int(props.multi_processor_count)
        self.arch = f"sm_{props.major}{props.minor}"
        if index not in self._modules:
            self._modules[index] = self._load_module()
        self._copy_fn, self._crc_fn = self._modules[index]
        self._batch, self._batch_v2 = self._resolve_batch()
        self._own_stream: ctypes.c_void_p | None = None
        self._host = (ctypes.c_void_p(), 0)  # pinned arena (host pointer, bytes)
        self._dev = (c_u64(), 0)  # device arena
        status = ctypes.c_void_p()
        self._status_bytes = 4 << 20
        self._driver(
            "cuMemHostAlloc",
            ctypes.byref(status),
            self._status_bytes,
            _HOSTALLOC_PORTABLE_DEVICEMAP,
        )
        self._status_host = status
        self._status_dev = self._host_device_pointer(status.value or 0)
        self._pow8 = kernels.pow8_table()
        self.batched = self._batch is not None  # whether copy-engine runs go as one batch

    # -- driver plumbing ----------------------------------------------------------

    def _declare(self) -> None:
        lib = self.libcuda
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        sigs: dict[str, list[Any]] = {
            "cuMemcpyAsync": [c_u64, c_u64, sz, vp],
            "cuMemcpyHtoDAsync_v2": [c_u64, vp, sz, vp],
            "cuStreamSynchronize": [vp],
            "cuStreamCreate": [vp, u],
            "cuCtxSetCurrent": [vp],
            "cuCtxGetCurrent": [vp],
            "cuMemHostAlloc": [vp, sz, u],
            "cuMemFreeHost": [vp],
            "cuMemAlloc_v2": [vp, sz],
            "cuMemFree_v2": [c_u64],
            "cuMemHostGetDevicePointer_v2": [vp, vp, u],
            "cuModuleLoadData": [vp, vp],
            "cuModuleGetFunction": [vp, vp, ctypes.c_char_p],
            "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, vp, vp],
            "cuDriverGetVersion": [vp],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def _driver(self, name: str, *args: Any) -> None:
        code = getattr(self.libcuda, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.libcuda.cuGetErrorString(code, ctypes.byref(text))
            raise BackendUnavailableError(
                f"CUDA {name} failed with code {code} ({(text.value or b'?').decode()})"
            )

    def _load_module(self) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """Compile kernels.cu with NVRTC for this GPU and load both kernels."""
        cubin = kernels.compile_cubin(self.arch)
        module = ctypes.c_void_p()  # stays loaded for the life of the process
        self._driver("cuModuleLoadData", ctypes.byref(module), cubin)
        copy, crc = ctypes.c_void_p(), ctypes.c_void_p()
        self._driver("cuModuleGetFunction", ctypes.byref(copy), module, b"beluga_copy_rows")
        self._driver("cuModuleGetFunction", ctypes.byref(crc), module, b"beluga_crc_blocks")
        return copy, crc

    def _resolve_batch(self) -> tuple[Any, bool]:
        """cuMemcpyBatchAsync as this driver has it: (function, takes no failIdx), or None.

        cuda.h (13.0) maps cuMemcpyBatchAsync to cuMemcpyBatchAsync_v2 (no failIdx);
        12.8 and 12.9 have the first form, with a failIdx before the stream.  We ask
        cuGetProcAddress for the form of the version the driver reports, so the ctypes
        signature matches what we get.  BELUGA_GPU_BATCH=0 turns it off (per-run copies).
        """
        if os.environ.get("BELUGA_GPU_BATCH", "1") == "0":
            return None, False
        version = ctypes.c_int()
        if self.libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
            return None, False
        want = 13000 if version.value >= 13000 else 12080
        pfn = ctypes.c_void_p()
        status = ctypes.c_int()
        try:
            get = self.libcuda.cuGetProcAddress_v2
            get.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, c_u64, ctypes.c_void_p]
            code = get(
                b"cuMemcpyBatchAsync",
                ctypes.byref(pfn),
                want,
                _PROC_LEGACY_STREAM,
                ctypes.byref(status),
            )
        except AttributeError:
            return None, False
        if code != 0 or not pfn.value:
            return None, False
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        if want >= 13000:  # (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
            proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp)
        else:  # 12.8: (..., numAttrs, failIdx, stream)
            proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp, vp)
        return proto(pfn.value), want >= 13000

    def _host_device_pointer(self, address: int) -> int:
        pointer = c_u64()
        self._driver(
            "cuMemHostGetDevicePointer_v2", ctypes.byref(pointer), ctypes.c_void_p(address), 0
        )
        return pointer.value

    def _stream(self) -> ctypes.c_void_p:
        """The caller's current torch stream, or ours when that is the legacy default one."""
        handle = int(self.torch.cuda.current_stream(self.device).cuda_stream)
        if handle:
            return ctypes.c_void_p(handle)
        if self._own_stream is None:
            stream = ctypes.c_void_p()
            self._driver("cuStreamCreate", ctypes.byref(stream), 0)  # blocking: orders with 0
            self._own_stream = stream
        return self._own_stream

    def _arena(self, nbytes: int) -> tuple[np.ndarray, int]:
        """A pinned host view of at least nbytes and the device arena's address (both kept)."""
        host, have = self._host
        if have < nbytes:
            size = max(nbytes, 2 * have, 1 << 20)
            if host.value:
                self._driver("cuMemFreeHost", host)
            host = ctypes.c_void_p()
            self._driver("cuMemHostAlloc", ctypes.byref(host), size, _HOSTALLOC_PORTABLE_DEVICEMAP)
            self._host = (host, size)
            dev, _ = self._dev
            if dev.value:
                self._driver("cuMemFree_v2", dev)
            dev = c_u64()
            self._driver("cuMemAlloc_v2", ctypes.byref(dev), size)
            self._dev = (dev, size)
        view = np.ctypeslib.as_array(
            ctypes.cast(self._host[0], ctypes.POINTER(ctypes.c_uint8)), shape=(self._host[1],)
        )
        return view, self._dev[0].value

    # -- what the GPU path asks for -------------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        code = int(self.cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_MAPPED))
        if code != 0:
            raise BackendUnavailableError(
                f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with CUDA error "
                f"{code}; the pool cannot be mapped for the GPU (is it locked memory the "
                "driver refuses, or over the registration limit?)"
            )

    def unregister(self, address: int) -> None:
        code = int(self.cudart.cudaHostUnregister(address))
        if code != 0:
            raise BackendUnavailableError(
                f"cudaHostUnregister at {address:#x} failed with CUDA error {code}"
            )

    def device_pointer(self, address: int) -> int:
        """The GPU's address of registered host memory."""
        return self._host_device_pointer(address)

    def execute(self, plan: Plan, *, save: bool) -> np.ndarray:
        """Run a plan (copies, then the CRC for a load; the CRC first for a save) and wait.

        Returns the per-block status (a load: 1 where the CRC differs; a save: the CRC).
        """
        with self._lock:
            self._driver("cuCtxSetCurrent", self.context)
            stream = self._stream()
            nblocks = len(plan.blocks)
            if nblocks * 4 + 64 > self._status_bytes:
                raise ValueError(
                    f"{nblocks} blocks in one call: at most {self._status_bytes // 4 - 16}"
                )
            status = np.ctypeslib.as_array(
                ctypes.cast(self._status_host, ctypes.POINTER(ctypes.c_uint32)),
                shape=(self._status_bytes // 4,),
            )
            bad_at = self._status_bytes // 4 - 16
            status[:nblocks] = 0
            status[bad_at] = 0
            crc = self._upload(plan, stream) if len(plan.segs) or len(plan.rows) else None
            if save and crc is not None and len(plan.segs):
                self._launch_crc(plan, crc, stream, save=True, bad_at=bad_at)
            self._copies(plan, crc, stream)
            if not save and crc is not None and len(plan.segs):
                self._launch_crc(plan, crc, stream, save=False, bad_at=bad_at)
            self._driver("cuStreamSynchronize", stream)
            return status[:nblocks].copy()

    def _upload(self, plan: Plan, stream: ctypes.c_void_p) -> dict[str, int]:
        """Pack the kernels' tables into the pinned arena and copy it up once; device addresses."""
        parts = {
            "rows": plan.rows.view(np.uint8).reshape(-1),
            "segs": plan.segs.view(np.uint8).reshape(-1),
            "blocks": plan.blocks.view(np.uint8).reshape(-1),
            "state": np.zeros(len(plan.blocks) * STATE_DTYPE.itemsize, np.uint8),
            "pow8": self._pow8.view(np.uint8),
        }
        at, where = 0, {}
        for name, data in parts.items():
            where[name] = at
            at = _align(at + len(data))
        view, dev = self._arena(at)
        for name, data in parts.items():
            view[where[name] : where[name] + len(data)] = data
        self._driver("cuMemcpyHtoDAsync_v2", dev, self._host[0], at, stream)
        return {name: dev + off for name, off in where.items()}

    def _copies(self, plan: Plan, addr: dict[str, int] | None, stream: ctypes.c_void_p) -> None:
        """Copy-engine runs (one batch, or one call per run) and the kernel's rows."""
        batched = self._batch is not None and len(plan.ce_len) and self._submit_batch(plan, stream)
        if len(plan.ce_len) and not batched:
            runs = zip(
                plan.ce_src.tolist(), plan.ce_dst.tolist(), plan.ce_len.tolist(), strict=True
            )
            for s, d, n in runs:
                self._driver("cuMemcpyAsync", d, s, n, stream)
        if len(plan.rows) and addr is not None:
            rows = c_u64(addr["rows"])
            count = c_u64(len(plan.rows))
            warps = min(len(plan.rows), self.sms * _WARPS_PER_SM)
            self._launch(self._copy_fn, -(-warps * 32 // _THREADS), stream, [rows, count])

    def _submit_batch(self, plan: Plan, stream: ctypes.c_void_p) -> bool:
        """One cuMemcpyBatchAsync for every copy-engine run; False (and off for good) if refused."""
        attrs = _Attrs(_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        idx = np.zeros(1, np.uint64)
        n = len(plan.ce_len)
        args = [
            _ptr(plan.ce_dst),
            _ptr(plan.ce_src),
            _ptr(plan.ce_len),
            n,
            ctypes.byref(attrs),
            _ptr(idx),
            1,
        ]
        if not self._batch_v2:
            fail = ctypes.c_size_t()
            args.append(ctypes.byref(fail))
        code = self._batch(*args, stream)
        if code != 0:
            log.warning("cuMemcpyBatchAsync refused a batch (code %d): one copy per run now", code)
            self._batch, self.batched = None, False
            return False
        return True

    def _launch_crc(
        self, plan: Plan, addr: dict[str, int], stream: ctypes.c_void_p, *, save: bool, bad_at: int
    ) -> None:
        args = [
            c_u64(addr["segs"]),
            c_u64(len(plan.segs)),
            c_u64(addr["blocks"]),
            c_u64(addr["state"]),
            c_u64(self._status_dev),
            c_u64(self._status_dev + 4 * bad_at),
            c_u64(addr["pow8"]),
            c_u64(plan.chunk),
            ctypes.c_int(1 if save else 0),
        ]
        warps = min(len(plan.segs), self.sms * _WARPS_PER_SM)
        self._launch(self._crc_fn, -(-warps * 32 // _THREADS), stream, args)

    def _launch(self, fn: ctypes.c_void_p, grid: int, stream: ctypes.c_void_p, args: list) -> None:
        params = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
        )
        self._driver(
            "cuLaunchKernel", fn, max(1, grid), 1, 1, _THREADS, 1, 1, 0, stream, params, None
        )

    def close(self) -> None:
        """Free the arenas (the kernels stay loaded for the process)."""
        with self._lock:
            if self._host[0].value:
                self._driver("cuMemFreeHost", self._host[0])
            if self._dev[0].value:
                self._driver("cuMemFree_v2", self._dev[0])
            self._host, self._dev = (ctypes.c_void_p(), 0), (c_u64(), 0)


__all__ = ["ROW_DTYPE", "SEG_DTYPE", "CudaRuntime"]
