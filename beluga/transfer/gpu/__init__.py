"""The KV data path on a GPU: straight between GPU memory and the pool, checked on the GPU.

:class:`GpuPool` registers a pool's mapping with CUDA (``cudaHostRegister``
with the mapped flag, in chunks: NVIDIA r580+ refuses one registration of
512 GiB or more), so the GPU reaches the pool with its own DMA and loads and
no staging buffer.  It stands where the data path takes the pool's
``Memory``: ``KVStore.save`` / ``load`` with an ``EngineBlocks`` whose mover
is a GpuPool call its :meth:`GpuPool.write_blocks` / :meth:`GpuPool.read_blocks`
(the same arguments and answers as ``Memory.write_blocks`` / ``read_blocks``),
and the raw :func:`~beluga.transfer.gather_write`,
:func:`~beluga.transfer.scatter_read` and :func:`~beluga.transfer.sparse_fetch`
take it too.

WHY THE PATH IS SHAPED SO (figures from one H200, PCIe Gen5, 2026-12-04, p50
per operation, each beside its floor from the same run; the issue "KV at PCIe
speed between the pool and the GPU" has the table):

- The first GPU path ran every move as ONE kernel, a 256-thread block per
  row.  It was correct and 5-7x under the floor: a 64 KiB pool->GPU copy took
  61.8 us against 11.4 us for cudaMemcpy from pinned memory (11.5 us from the
  registered pool); a 7B-class block (2 MiB as 64 x 32 KiB) 296 us (7 GB/s)
  against 58 us (36 GB/s) for one contiguous cudaMemcpy; 16 such blocks
  2,562 us (13 GB/s).  Reads of host memory over PCIe are latency-bound, so
  speed is bytes in flight, and one block per row kept few.  Each launch also
  uploaded its row table through pageable memory with an allocation.
- So pieces go to the COPY ENGINES, which reach the floor without SMs: all
  runs of one call in ONE ``cuMemcpyBatchAsync`` (vLLM's OffloadingConnector
  moves 2 MB blocks at ~50 GB/s that way and chose copy engines over a kernel
  because kernels take SMs from the model: +5-32% end-to-end throughput),
  runs of adjacent pool blocks merged (FlexKV), one ``cuMemcpyAsync`` per
  run where the batch call is missing or refused.  Only pieces below a
  crossover go to an SM kernel, sized by bytes in flight (a warp per row, four
  16-byte loads in flight per lane; SGLang sizes its transfer kernel so):
  vLLM's kernel won below ~28 KiB pieces.  The crossover (``crossover``,
  default :data:`~beluga.transfer.gpu.plan.CROSSOVER`) must be MEASURED on
  the machine: ``beluga bench gpu`` sweeps it.
- Nothing is uploaded per call through pageable memory: the kernels' tables
  go through a pinned arena with one async copy (LMCache passes pointers as
  kernel parameters for the same reason); status comes back in mapped pinned
  memory.
- The CRC32C is computed ON THE GPU (kernels.cu), where a load's bytes land
  or from a save's source bytes: the old path re-read every payload on one
  CPU core after the copy (a second full read) and took a save's CRC by
  reading the pool back.  A load compares each block's CRC with its header's
  there and one status array comes back; the CPU reads headers before and
  after (the same three-step check as ``Memory.read_blocks``), never payloads.
  A save seals each header with the CRC of what the GPU wrote, so bytes this
  writer did not put in an extent can never be sealed in (RTP-LLM checks KV
  CRCs on its GPUs too).
- The CPU invalidated every pool range before every read: 32,768 CLFLUSHOPTs
  for a 2 MiB block, more than the copy.  Now it invalidates only what this
  host may hold stale (the read record, beluga/_native/record.c, argued
  there); a block whose CRC still fails on the GPU is read once more with
  every range invalidated, so a stale line the record could not see (another
  process of the same machine, a prefetch) costs a second read, never bytes.

COHERENCE, for the single-writer / many-reader protocol of beluga.coherence:
a save's DMA writes snoop and drop this host's cached copies and are complete
when the stream is synchronised, before any header is sealed; a load's DMA
reads are snooped by this host's caches, hence the read record.  A real
runtime needs the pool in native coherence mode (the simulated cache of the
model cannot see a GPU); a stand-in runtime that moves bytes through
``Memory.dma_read`` / ``dma_write`` (tests) runs under the model too, which is
how the invalidate rule is proven.

Modules: :mod:`.plan` (table -> copy-engine runs, kernel rows, CRC segments),
:mod:`.kernels` (kernels.cu, NVRTC and the host build), :mod:`.runtime`
(the CUDA driver calls).  Tests: tests/test_transfer_gpu.py and
tests/test_gpu_kernels.py (CPU, stand-in runtime; CUDA ones skip without a
GPU); ci/gpu/datapath.sh runs them and the bench on a lent GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from beluga.coherence import Miss
from beluga.errors import BackendUnavailableError
from beluga.pool import Pool
from beluga.transfer.gpu.plan import CRC_CHUNK, CROSSOVER, Plan, plan_moves

CHUNK_BYTES = 256 << 30  # below the 512 GiB a single registration may not reach


def _address(buffer: Any) -> int:
    """Where a layout buffer starts: a uint8 CUDA tensor, or a numpy array (stand-in runtimes)."""
    if isinstance(buffer, np.ndarray):
        return int(buffer.ctypes.data)
    return int(buffer.data_ptr())


def CudaRuntime(device: Any = None) -> Any:
    """The real runtime (imported on first use: it loads the CUDA driver)."""
    from beluga.transfer.gpu.runtime import CudaRuntime as Runtime

    return Runtime(device)


class GpuPool:
    """A pool's mapping registered with CUDA; pass it where the data path takes a ``Memory``.

    ``crossover``: rows of at least this many bytes go to the copy engines,
    shorter ones to the SM kernel (measure it: ``beluga bench gpu``).
    Close it (or use it as a context manager) before closing the pool: it
    holds a view of the mapping while registered.  Thread-safe (the runtime
    serialises its calls; the counters are updated under a lock); not
    fork-safe (CUDA is not).
    """

    def __init__(
        self,
        pool: Pool,
        device: Any = None,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        runtime: Any = None,
        crossover: int = CROSSOVER,
        crc_chunk: int = CRC_CHUNK,
    ) -> None:
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, not {chunk_bytes}")
        if crossover < 0:
            raise ValueError(f"crossover is a byte count, not {crossover}")
        if crc_chunk < 16 or crc_chunk & (crc_chunk - 1):
            raise ValueError(f"crc_chunk must be a power of two of at least 16, not {crc_chunk}")
        sees_model = bool(getattr(runtime, "sees_model", False))
        if pool.memory.mode != "native" and not sees_model:
            raise ValueError(
                f"the GPU path needs a pool attached in native coherence mode, not "
                f"{pool.memory.mode!r}: the simulated cache cannot see the GPU's accesses"
            )
        self.runtime = runtime or CudaRuntime(device)
        self.device = self.runtime.device
        self.memory = pool.memory
        self.size = pool.memory.size
        self.crossover = crossover
        self.crc_chunk = crc_chunk
        self._lock = threading.Lock()
        #: bytes invalidated before device reads, blocks read twice, plans run
        self.stats = {"invalidated": 0, "retried": 0, "executed": 0}
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
            attach = getattr(self.runtime, "attach_pool", None)
            if attach is not None:
                attach(self.memory, self.host_address, self.device_address, self.size)
        except BaseException:
            self.close()
            raise

    # -- the raw moves (unchecked, as Memory.gather_write / scatter_read) --------------

    def gather_write(self, buffers: Any, table: np.ndarray) -> int:
        """Copy table rows GPU -> pool (the data path checked them); bytes moved.  Unsealed."""
        plan = plan_moves(
            table, self._bases(buffers), self.device_address, to_pool=True, crossover=self.crossover
        )
        self._execute(plan, save=True)
        return plan.copy_bytes

    def scatter_read(self, buffers: Any, table: np.ndarray) -> int:
        """Copy table rows pool -> GPU, invalidating first what this host may hold stale."""
        plan = plan_moves(
            table,
            self._bases(buffers),
            self.device_address,
            to_pool=False,
            crossover=self.crossover,
        )
        rows = np.asarray(table, dtype=np.uint64).reshape(-1, 4)
        ranges = np.zeros((len(rows), 3), np.uint64)
        ranges[:, 0], ranges[:, 1] = rows[:, 2], rows[:, 3]
        self._invalidate(ranges)
        self._execute(plan, save=False)
        return plan.copy_bytes

    # -- whole blocks, validated (as Memory.read_blocks / write_blocks) ----------------

    def read_blocks(
        self, buffers: Sequence[Any], table: np.ndarray, blocks: Sequence[tuple]
    ) -> list[int]:
        """Copy whole blocks out of the pool into GPU memory, each validated; per block its
        length or a negative ``Miss`` code (the arguments of ``Memory.read_blocks``).

        Headers are checked on the CPU (this key, this version, published), the
        CRC32C of the bytes as they landed on the GPU must be the header's, and
        the headers must be unchanged afterwards.  A block whose CRC differs is
        read again once with all its ranges invalidated first.
        """
        mem = self.memory
        results, crcs, lines = mem.check_headers(blocks)
        n = len(blocks)
        got = np.array(results, dtype=np.int64)
        if not n:
            return []
        offs = np.array([b[1] for b in blocks], dtype=np.int64)
        caps = np.array([b[2] for b in blocks], dtype=np.int64)
        versions = np.array([b[4] for b in blocks], dtype=np.uint64)
        expect = np.array(crcs, dtype=np.int64)
        ok = got >= 0
        lengths = np.where(ok, got, 0)
        table = np.asarray(table, dtype=np.uint64).reshape(-1, 4)
        bases = self._bases(buffers)
        plan = self._block_plan(table, bases, offs, lengths, caps, expect, ok)
        got[ok & plan.too_long] = int(Miss.LENGTH)
        ok &= ~plan.too_long
        ranges = np.stack([offs[ok], lengths[ok], versions[ok]], axis=1).astype(np.uint64)
        self._invalidate(ranges)
        bad = ok & (self._execute(plan, save=False) != 0)
        if bad.any():  # a stale line the record did not know of, or a corrupt block
            for o, n_ in zip(offs[bad].tolist(), lengths[bad].tolist(), strict=True):
                if n_:
                    mem.invalidate(o, n_)
            mem.mfence()
            with self._lock:
                self.stats["retried"] += int(bad.sum())
            again = self._block_plan(
                table, bases, offs, np.where(bad, lengths, 0), caps, expect, bad
            )
            bad &= self._execute(again, save=False) != 0
        got[bad] = int(Miss.CHECKSUM)
        _, _, lines2 = mem.check_headers(blocks)
        same = (
            np.frombuffer(lines, np.uint8).reshape(n, -1)
            == np.frombuffer(lines2, np.uint8).reshape(n, -1)
        ).all(axis=1)
        changed = (got >= 0) & ~same
        got[changed] = int(Miss.CHANGED)
        return got.tolist()

    def write_blocks(
        self, buffers: Sequence[Any], table: np.ndarray, blocks: Sequence[tuple]
    ) -> int:
        """Copy whole blocks from GPU memory into the pool and seal each; bytes moved (the
        arguments of ``Memory.write_blocks``: every header must say WRITING already).

        Each block's CRC32C is computed on the GPU from the source bytes the
        rows name; a block they do not tile exactly once is sealed with the CRC
        of what the pool holds instead (read back by the CPU), as the CPU path does.
        """
        n = len(blocks)
        offs = np.array([b[1] for b in blocks], dtype=np.int64)
        lengths = np.array([b[4] for b in blocks], dtype=np.int64)
        table = np.asarray(table, dtype=np.uint64).reshape(-1, 4)
        plan = plan_moves(
            table,
            self._bases(buffers),
            self.device_address,
            to_pool=True,
            crossover=self.crossover,
            blocks=(offs, lengths, lengths, np.zeros(n, np.int64)),
            chunk=self.crc_chunk,
        )
        if plan.too_long.any():
            raise ValueError("a row writes pool bytes outside every block's payload")
        crcs = self._execute(plan, save=True)
        for i, (hdr, payload, dig, version, length, key_len, writer, gen) in enumerate(blocks):
            given = None
            if plan.tiled[i]:
                given = int(crcs[i]) if length else 0
            self.memory.seal(
                hdr,
                payload,
                dig,
                version,
                length,
                key_len=key_len,
                writer=writer,
                writer_gen=gen,
                crc=given,
            )
        return plan.copy_bytes

    # -- plumbing -------------------------------------------------------------------

    def _bases(self, buffers: Any) -> np.ndarray:
        if self._view is None:
            raise ValueError("this GpuPool is closed; make a new one")
        return np.array([_address(b) for b in buffers], dtype=np.uint64)

    def _block_plan(
        self,
        table: np.ndarray,
        bases: np.ndarray,
        offs: np.ndarray,
        lengths: np.ndarray,
        caps: np.ndarray,
        expect: np.ndarray,
        keep: np.ndarray,
    ) -> Plan:
        """The plan that loads (and checksums) the blocks ``keep`` picks; others move nothing."""
        order = np.argsort(offs, kind="stable")
        starts = offs[order]
        p = table[:, 2].astype(np.int64)
        k = np.searchsorted(starts, p, side="right") - 1
        inside = k >= 0
        wanted = np.zeros(len(table), bool)
        wanted[inside] = keep[order[k[inside]]]
        wanted |= ~inside  # let the planner refuse a row outside every block
        return plan_moves(
            table[wanted],
            bases,
            self.device_address,
            to_pool=False,
            crossover=self.crossover,
            blocks=(offs, np.where(keep, lengths, 0), caps, expect),
            chunk=self.crc_chunk,
        )

    def _invalidate(self, ranges: np.ndarray) -> None:
        if len(ranges):
            done = self.memory.invalidate_stale(np.ascontiguousarray(ranges, dtype=np.uint64))
            with self._lock:
                self.stats["invalidated"] += done

    def _execute(self, plan: Plan, *, save: bool) -> np.ndarray:
        """Run a plan; per block its status (load: nonzero where the CRC differs; save: CRC)."""
        with self._lock:
            self.stats["executed"] += 1
        status = np.asarray(self.runtime.execute(plan, save=save), dtype=np.int64)
        empty = plan.blocks["total"] == 0  # no segment finishes them: the CRC of nothing is 0
        if empty.any():
            status[empty] = 0 if save else (plan.blocks["expect"][empty] != 0)
        return status

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
