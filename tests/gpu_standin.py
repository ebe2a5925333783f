"""A CUDA runtime that runs the GPU path's plans on the CPU, for tests without a GPU.

:class:`StandInCuda` "registers" by bookkeeping and executes a
:class:`~beluga.transfer.gpu.plan.Plan` as the real runtime would: every
copy-engine run and kernel row, and the CRC step through kernels.cu built for
the host (the same arithmetic the GPU runs), with the status the GPU would
write.  Pool bytes move through ``Memory.dma_read`` / ``dma_write``, which in
model mode see what a device sees through its host (a read is served by the
host's cached line, however stale), so a GpuPool over a model-mode pool shows
whether the invalidate rule leaves stale lines.  GPU buffers are CPU arrays
or tensors (``device`` is the CPU).  Not thread-safe; tests only.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from beluga.errors import BackendUnavailableError
from beluga.transfer.gpu import kernels
from beluga.transfer.gpu.plan import Plan


class StandInCuda:
    """A runtime that keeps books instead of calling CUDA, and runs plans on the CPU."""

    device = torch.device("cpu")
    sees_model = True  # its device accesses go through Memory.dma_read / dma_write

    def __init__(self, fail_at: int | None = None, gap: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.fail_at = fail_at
        self.gap = gap  # > 0: each chunk's device address is this far past the last one's
        self.launches = 0  # plans run
        self.batches = 0  # copy-engine batches (one per plan with copy-engine runs)
        self.batched_runs = 0
        self.kernel_rows = 0
        self.crc_segments = 0
        self.plans: list[Plan] = []
        self.keep_plans = False
        self.memory: Any = None
        self._pool = (0, 0, 0)  # host address, device address, size

    def register(self, address: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise BackendUnavailableError("cudaHostRegister failed with CUDA error 1")
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        del self.registered[address]

    def device_pointer(self, address: int) -> int:
        assert address in self.registered, "asked for the device address of unregistered memory"
        return address + self.gap * sorted(self.registered).index(address)

    def attach_pool(self, memory: Any, host: int, device: int, size: int) -> None:
        self.memory = memory
        self._pool = (host, device, size)

    # -- running a plan ---------------------------------------------------------------

    def _pool_offset(self, address: int, n: int) -> int | None:
        _, device, size = self._pool
        if device <= address < device + size:
            assert address + n <= device + size, "a copy runs past the end of the pool"
            return address - device
        return None

    def _copy(self, src: int, dst: int, n: int) -> None:
        if not n:
            return
        s, d = self._pool_offset(src, n), self._pool_offset(dst, n)
        if s is not None and d is None:
            out = (ctypes.c_uint8 * n).from_address(dst)
            self.memory.dma_read(s, memoryview(out).cast("B"))
        elif d is not None and s is None:
            self.memory.dma_write(d, ctypes.string_at(src, n))
        else:
            raise AssertionError("the GPU path copies between the pool and GPU memory only")

    def _crc(self, plan: Plan, *, save: bool) -> np.ndarray:
        segs = plan.segs.copy()
        scratch = []
        for i in range(len(segs)):  # bytes a segment takes from the pool: as a device reads
            off = self._pool_offset(int(segs["addr"][i]), int(segs["len"][i]))
            if off is not None:
                buf = np.empty(int(segs["len"][i]), np.uint8)
                self.memory.dma_read(off, buf)
                scratch.append(buf)
                segs["addr"][i] = buf.ctypes.data
        state = np.zeros(len(plan.blocks), kernels.STATE_DTYPE)
        status = np.zeros(len(plan.blocks), np.uint32)
        blocks = np.ascontiguousarray(plan.blocks)
        pow8 = kernels.pow8_table()
        kernels.host_library().beluga_crc_blocks_host(
            segs.ctypes.data,
            len(segs),
            blocks.ctypes.data,
            state.ctypes.data,
            status.ctypes.data,
            pow8.ctypes.data,
            plan.chunk,
            1 if save else 0,
        )
        done = state["done"] == plan.blocks["total"]
        assert done.all(), "the CRC segments do not cover every block exactly"
        self.crc_segments += len(segs)
        return status

    def execute(self, plan: Plan, *, save: bool) -> np.ndarray:
        self.launches += 1
        if self.keep_plans:
            self.plans.append(plan)
        status = np.zeros(len(plan.blocks), np.uint32)
        if save and len(plan.segs):
            status = self._crc(plan, save=True)
        if len(plan.ce_len):
            self.batches += 1
            self.batched_runs += len(plan.ce_len)
        for s, d, n in zip(
            plan.ce_src.tolist(), plan.ce_dst.tolist(), plan.ce_len.tolist(), strict=True
        ):
            self._copy(s, d, n)
        self.kernel_rows += len(plan.rows)
        for s, d, n in plan.rows.tolist():
            self._copy(s, d, n)
        if not save and len(plan.segs):
            status = self._crc(plan, save=False)
        return status
