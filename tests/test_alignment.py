"""Every copy between the pool and caller memory moves the right bytes at any alignment.

The native copy kernels (memops.c) align their stores to the destination and
cover the head and tail with overlapping unaligned vectors; the streaming
copies split a head and a tail off.  Each of those is an edge where a wrong
byte would hide, so every path is run from and into caller buffers at every
offset from a page that ``beluga bench store --full-sweep`` times, odd ones
too, at lengths around the kernels' cut-offs, in native and model mode, and
into buffers whose last byte is the last of a page followed by an
inaccessible page (an overrun is a crash, not a pass).  Nothing here is
timed: speed at those offsets is the benchmark's.
"""

from __future__ import annotations

import ctypes
import mmap
import random
from collections.abc import Iterator

import numpy as np
import pytest

from beluga.coherence import digest
from beluga.pool import Geometry, Pool

#: blocks are sealed through Memory with no metadata server (tests/test_blockio.py)
pytestmark = pytest.mark.leaves("writes")
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=32 << 10)
PAGE = mmap.PAGESIZE
#: the benchmark's offsets (0-256 by 16, 512, 1024, 2048, 4080, an odd one) and more odd ones
OFFSETS = (*range(0, 257, 16), 512, 1024, 2048, 4080, 7, 1, 63, 4095)
#: about the kernels' short cut-off (256), vector widths and a 4 KiB piece
LENGTHS = (1, 63, 255, 256, 257, 4096 + 33, 16384 + 77)
SPAN = max(LENGTHS) + 2 * PAGE


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 16 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


class Guarded:
    """Pages of caller memory followed by a PROT_NONE page: a copy past the end faults."""

    def __init__(self, size: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        self.map = mmap.mmap(-1, self.size + PAGE)
        self.buf = np.frombuffer(self.map, dtype=np.uint8)
        base = self.buf.ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(base + self.size, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")

    def ending_at_page(self, n: int) -> np.ndarray:
        """n bytes whose last is the last byte before the guard page."""
        return self.buf[self.size - n : self.size]

    def at(self, offset: int, n: int) -> np.ndarray:
        """n bytes starting `offset` bytes past a page boundary."""
        return self.buf[offset : offset + n]


def cases() -> Iterator[tuple[str, int, int]]:
    """(where, offset, length): every offset at every length, and buffers ending at a page."""
    for n in LENGTHS:
        for o in OFFSETS:
            yield "at", o, n
        yield "end", 0, n


def views(mem: Guarded, where: str, offset: int, n: int) -> np.ndarray:
    return mem.ending_at_page(n) if where == "end" else mem.at(offset, n)


def block(pool: Pool, i: int) -> tuple[int, int, bytes, int]:
    sb = pool.superblock
    return sb.block_header_offset(i), sb.block_payload_offset(i), digest(b"k%d" % i), 100 + i


def fresh(rng: random.Random, n: int) -> np.ndarray:
    return np.frombuffer(rng.randbytes(n), dtype=np.uint8)


@pytest.mark.parametrize("mode", ["native", "model"])
def test_every_read_and_write_path_at_every_alignment(pool: Pool, mode: str) -> None:
    rng = random.Random(22)
    src_mem, dst_mem = Guarded(SPAN), Guarded(SPAN)
    cap = GEOMETRY.block_size
    wrong: list[str] = []
    with (
        Pool.attach(pool.spec, coherence=mode) as writer,
        Pool.attach(pool.spec, coherence=mode) as reader,
    ):
        w, r = writer.memory, reader.memory
        for k, (where, offset, n) in enumerate(cases()):
            hdr, pay, dg, version = block(pool, k % 8)
            version += k
            label = f"{mode} {where} +{offset} {n} B"

            def check(path: str, got: object, want: np.ndarray, label: str = label) -> None:
                if bytes(got) != want.tobytes():  # type: ignore[call-overload]
                    wrong.append(f"{path} {label}")

            want = fresh(rng, n)
            src = views(src_mem, where, offset, n)
            src[:] = want
            dst = views(dst_mem, where, offset, n)
            table = np.array([[0, 0, pay, n]], dtype=np.uint64)

            w.publish(hdr, pay, dg, version, src)  # publish from an unaligned source
            dst[:] = 0
            assert r.read_validated(hdr, pay, cap, dg, version, dst) == n, label
            check("read_validated", dst, want)
            check("read_bytes", r.read_bytes(hdr, pay, cap, dg, version), want)
            dst[:] = 0
            assert list(r.read_blocks([dst], table, [(hdr, pay, cap, dg, version)])) == [n]
            check("read_blocks", dst, want)

            want = fresh(rng, n)
            src[:] = want
            w.begin_write(hdr, pay, dg, version + 1, n)
            w.write_blocks([src], table, [(hdr, pay, dg, version + 1, n, 0, 1, 0)])
            dst[:] = 0
            assert r.read_validated(hdr, pay, cap, dg, version + 1, dst) == n, label
            check("write_blocks", dst, want)

            want = fresh(rng, n)
            src[:] = want
            unaligned = np.array([[0, 0, pay + offset % 64, n]], dtype=np.uint64)
            w.gather_write([src], unaligned)
            dst[:] = 0
            r.scatter_read([dst], unaligned)
            check("gather_write/scatter_read", dst, want)

            want = fresh(rng, n)
            w.nt_store(pay + 3, want.tobytes())
            w.sfence()
            r.invalidate(pay + 3, n)
            r.mfence()
            dst[:] = 0
            r.load_into(pay + 3, dst)
            check("nt_store/load_into", dst, want)
            check("load", r.load(pay + 3, n), want)
        del src, dst
    src_mem.buf = dst_mem.buf = None  # type: ignore[assignment]
    src_mem.map.close()
    dst_mem.map.close()
    assert not wrong, f"{len(wrong)} copies moved other bytes, first: {wrong[:5]}"


def test_the_copy_kernels_check_themselves() -> None:
    """Every kernel this CPU runs, from and to every offset 0..63, guards around (memops.c)."""
    from beluga._native import _core

    assert _core.memops_selfcheck() == []
