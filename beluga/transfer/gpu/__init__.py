"""The KV data path on a GPU: one kernel per batch, straight between GPU memory and the pool.

:class:`GpuPool` registers a pool's mapping with CUDA (``cudaHostRegister``
with the mapped flag, in chunks: NVIDIA r580+ refuses one registration of
512 GiB or more), so the GPU reaches the pool with its own loads and stores
and no staging buffer.  It stands in for the pool's ``Memory`` in
:func:`~beluga.transfer.gather_write` and
:func:`~beluga.transfer.scatter_read` when the layout's tensors are on its
GPU: those functions check every block id, offset and size first and build
the same scatter-gather table as on the CPU; here each row becomes (source
address, destination address, length) and ONE kernel launch copies every
row: a thread block per row (grid-stride over rows), 16-byte accesses when
the row allows, bytes otherwise.  The kernel is compiled once per process
with NVRTC (torch's CUDA builds ship it; no nvcc or CUDA_HOME needed) and
launched through the driver API.

Coherence, for the single-writer / many-reader protocol of beluga.coherence:

write
    the kernel's stores cross the root complex to the pool; every thread
    block ends with ``__threadfence_system()`` and the stream is synchronised
    before the call returns, so the caller seals (publishes the header) only
    after the payload is in memory.
read
    a GPU read of host memory is snooped by this host's CPU caches, which may
    hold stale copies of lines another host has since written: the CPU
    invalidates the pool ranges first (one call per merged range, i.e. per
    pool block), fences, then the kernel reads.  So the pool must be attached
    in native coherence mode; the simulated non-coherent cache of the model
    mode cannot see GPU traffic.

Tests: tests/test_transfer_gpu.py (skips without CUDA; one command on a GPU
machine, in its docstring).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from beluga.errors import BackendUnavailableError
from beluga.pool import Pool

CHUNK_BYTES = 256 << 30  # below the 512 GiB a single registration may not reach
_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the flag that works for DAX, too
_THREADS = 256
_MAX_GRID = 4096

KERNEL = r"""
struct alignas(16) Chunk16 { unsigned long long lo, hi; };

extern "C" __global__ void beluga_copy_rows(const unsigned long long *rows, int nrows)
{
    for (int r = blockIdx.x; r < nrows; r += gridDim.x) {
        const unsigned long long src = rows[3 * r], dst = rows[3 * r + 1], n = rows[3 * r + 2];
        if (((src | dst | n) & 15) == 0) {
            const Chunk16 *s = (const Chunk16 *)src;
            Chunk16 *d = (Chunk16 *)dst;
            for (unsigned long long i = threadIdx.x; i < n / 16; i += blockDim.x)
                d[i] = s[i];
        } else {
            const unsigned char *s = (const unsigned char *)src;
            unsigned char *d = (unsigned char *)dst;
            for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)
                d[i] = s[i];
        }
    }
    __threadfence_system();
}
"""


def _address(buffer: Any) -> int:
    """Where a layout buffer starts: a uint8 CUDA tensor, or a numpy array (stand-in runtimes)."""
    if isinstance(buffer, np.ndarray):
        return int(buffer.ctypes.data)
    return int(buffer.data_ptr())


class CudaRuntime:
    """The few CUDA calls the GPU path makes, each checked (torch's cudart returns codes)."""

    _functions: dict[int, ctypes.c_void_p] = {}  # the loaded kernel, per device, per process

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
        if self.device.index not in self._functions:
            self._functions[self.device.index] = self._load_kernel()
        self._function = self._functions[self.device.index]

    def _driver(self, name: str, *args: Any) -> None:
        code = getattr(self.libcuda, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.libcuda.cuGetErrorString(code, ctypes.byref(text))
            raise BackendUnavailableError(
                f"CUDA {name} failed with code {code} ({(text.value or b'?').decode()})"
            )

    def _load_kernel(self) -> ctypes.c_void_p:
        """Compile the copy kernel with NVRTC for this GPU and load it."""
        major = int(str(self.torch.version.cuda).split(".")[0])
        try:
            nvrtc = ctypes.CDLL(f"libnvrtc.so.{major}")
        except OSError as e:
            raise BackendUnavailableError(
                f"NVRTC (libnvrtc.so.{major}) is not loadable; install torch's CUDA build "
                f"or nvidia-cuda-nvrtc-cu{major}: {e}"
            ) from e
        props = self.torch.cuda.get_device_properties(self.device)
        arch = f"--gpu-architecture=sm_{props.major}{props.minor}".encode()
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
                    f"NVRTC {what} failed with code {code}: {log.decode(errors='replace')}"
                )

        check(
            nvrtc.nvrtcCreateProgram(
                ctypes.byref(prog), KERNEL.encode(), b"beluga_copy_rows.cu", 0, None, None
            ),
            "create",
        )
        try:
            options = (ctypes.c_char_p * 2)(arch, b"--std=c++17")
            check(nvrtc.nvrtcCompileProgram(prog, 2, options), "compile")
            size = ctypes.c_size_t()
            check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
            cubin = ctypes.create_string_buffer(size.value)
            check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        finally:
            nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        module = ctypes.c_void_p()  # stays loaded for the life of the process
        self._driver("cuModuleLoadData", ctypes.byref(module), cubin)
        function = ctypes.c_void_p()
        self._driver("cuModuleGetFunction", ctypes.byref(function), module, b"beluga_copy_rows")
        return function

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
        pointer = ctypes.c_uint64()
        self._driver(
            "cuMemHostGetDevicePointer_v2", ctypes.byref(pointer), ctypes.c_void_p(address), 0
        )
        return pointer.value

    def copy_rows(self, rows: np.ndarray) -> None:
        """Run the kernel over ``rows`` ([n, 3] uint64: source, destination, bytes); wait for it."""
        torch = self.torch
        table = torch.from_numpy(rows.view(np.int64)).to(self.device)
        stream = torch.cuda.current_stream(self.device)
        table_ptr = ctypes.c_uint64(table.data_ptr())
        count = ctypes.c_int(len(rows))
        params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(table_ptr), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(count), ctypes.c_void_p),
        )
        grid = min(len(rows), _MAX_GRID)
        self._driver(
            "cuLaunchKernel",
            self._function,
            grid,
            1,
            1,
            _THREADS,
            1,
            1,
            0,
            ctypes.c_void_p(stream.cuda_stream),
            params,
            None,
        )
        stream.synchronize()


class GpuPool:
    """A pool's mapping registered with CUDA; pass it where the data path takes a ``Memory``.

    Close it (or use it as a context manager) before closing the pool: it
    holds a view of the mapping while registered.
    """

    def __init__(
        self,
        pool: Pool,
        device: Any = None,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        runtime: Any = None,
    ) -> None:
        if pool.memory.mode != "native":
            raise ValueError(
                f"the GPU path needs a pool attached in native coherence mode, not "
                f"{pool.memory.mode!r}: the simulated cache cannot see the GPU's accesses"
            )
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, not {chunk_bytes}")
        self.runtime = runtime or CudaRuntime(device)
        self.device = self.runtime.device
        self.memory = pool.memory
        self.size = pool.memory.size
        self._view: np.ndarray | None = np.frombuffer(pool.mapping.buffer, np.uint8)
        self.host_address = int(self._view.ctypes.data)
        self.device_address = 0
        self._chunks: list[int] = []
        try:
            for start in range(0, self.size, chunk_bytes):
                address = self.host_address + start
                self.runtime.register(address, min(chunk_bytes, self.size - start))
                self._chunks.append(address)
                pointer = self.runtime.device_pointer(address)
                if start == 0:
                    self.device_address = pointer
                elif pointer != self.device_address + start:
                    raise BackendUnavailableError(
                        "the GPU maps the pool's registered chunks at addresses that are not "
                        "contiguous; the GPU path needs one linear device view of the pool"
                    )
        except BaseException:
            self.close()
            raise

    def gather_write(self, buffers: Any, table: np.ndarray) -> int:
        """Copy table rows GPU -> pool in one kernel (the data path checked them); bytes moved."""
        return self._copy(self._rows(buffers, table, to_pool=True))

    def scatter_read(self, buffers: Any, table: np.ndarray) -> int:
        """Copy table rows pool -> GPU in one kernel, after invalidating the CPU's stale lines."""
        rows = self._rows(buffers, table, to_pool=False)
        for start, length in _merged_ranges(table[:, 2], table[:, 3]):
            self.memory.invalidate(start, length)
        self.memory.mfence()
        return self._copy(rows)

    def _rows(self, buffers: Any, table: np.ndarray, *, to_pool: bool) -> np.ndarray:
        """[n, 3] uint64 rows (source address, destination address, length) of a table."""
        if self._view is None:
            raise ValueError("this GpuPool is closed; make a new one")
        bases = np.array([_address(b) for b in buffers], dtype=np.uint64)
        pool = np.uint64(self.device_address) + table[:, 2]
        engine = bases[table[:, 0].astype(np.int64)] + table[:, 1]
        rows = np.empty((len(table), 3), dtype=np.uint64)
        rows[:, 0], rows[:, 1] = (engine, pool) if to_pool else (pool, engine)
        rows[:, 2] = table[:, 3]
        return rows

    def _copy(self, rows: np.ndarray) -> int:
        if len(rows):
            self.runtime.copy_rows(rows)
        return int(rows[:, 2].sum())

    def close(self) -> None:
        """Unregister every chunk and let go of the mapping; safe to call twice."""
        while self._chunks:
            self.runtime.unregister(self._chunks[-1])
            self._chunks.pop()
        self._view = None

    def __enter__(self) -> GpuPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merged_ranges(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Pool ranges covering every row, touching or overlapping ones merged (sorted)."""
    if not len(offsets):
        return []
    order = np.argsort(offsets, kind="stable")
    starts, ends = offsets[order].astype(np.int64), (offsets + lengths)[order].astype(np.int64)
    reach = np.maximum.accumulate(ends)
    breaks = np.flatnonzero(starts[1:] > reach[:-1]) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [len(starts) - 1]))
    return [(int(starts[a]), int(reach[b] - starts[a])) for a, b in zip(first, last, strict=True)]
