"""The GPU path's device code (beluga/transfer/gpu/kernels.cu), checked without and with a GPU.

Without a GPU: every kernel compiles with NVRTC for sm_90 (the lent H200's),
which needs NVRTC only (the nvidia-cuda-nvrtc wheel of the test extra); the
test skips, saying so, only where NVRTC cannot be loaded at all, and fails on
any compile error.  The CRC arithmetic, built for the host from the same
file, must be the C core's CRC32C at every length 0..300 and alignment 0..15,
cut into any chunks and pieces, and at big random sizes.

On a GPU (``cuda``): the CRC kernel itself, launched through the runtime,
against the C core at every length and alignment, from GPU memory.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from beluga._native import _core
from beluga.errors import BackendUnavailableError
from beluga.transfer.gpu import kernels
from beluga.transfer.gpu.plan import Plan, crc_segments

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="no CUDA device (torch.cuda.is_available() is False): run on a GPU machine with: "
    "python -m pytest -v -rs tests/test_gpu_kernels.py",
)
RNG = np.random.default_rng(20261204)
DATA = RNG.integers(0, 256, 1 << 20, dtype=np.uint8)  # every case lies inside


def nvrtc_or_skip() -> None:
    try:
        kernels.load_nvrtc()
    except BackendUnavailableError as e:
        pytest.skip(f"NVRTC is not installed here ({e})")


def test_every_kernel_compiles_with_nvrtc_for_sm_90() -> None:
    nvrtc_or_skip()
    cubin = kernels.compile_cubin("sm_90")
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF image
    for name in kernels.KERNEL_NAMES:
        assert name in cubin, f"{name!r} is not in the cubin"


def test_the_device_code_takes_its_polynomial_from_the_c_core() -> None:
    assert "82f63b78" not in kernels.source().lower()  # defined once, in beluga_native.h
    assert f"{_core.CRC32C_POLY:#x}" in kernels.POLY_DEFINE
    assert kernels.pow8_table()[0] == _core.crc32c_x8n(1)


def test_the_device_crc_is_the_c_cores_at_every_length_and_alignment() -> None:
    host = kernels.host_library()
    base = DATA.ctypes.data
    for align in range(16):
        for n in range(301):
            raw = host.beluga_crc_raw_host(0xFFFFFFFF, base + align, n)
            want = _core.crc32c(DATA[align : align + n].tobytes())
            assert (~raw & 0xFFFFFFFF) == want, (align, n)


def crc_plan(starts: list[int], lengths: list[int], cuts: int, chunk: int, base: int) -> Plan:
    """A plan that checksums blocks [starts[i], +lengths[i]) of memory at ``base``, each cut
    into ``cuts`` pieces given in reverse order (the sum must not care)."""
    rows = []
    for s, n in zip(starts, lengths, strict=True):
        edges = sorted({0, n, *(n * k // cuts for k in range(1, cuts))})
        rows += [(0, s + a, s + a, b - a) for a, b in itertools.pairwise(edges)][::-1]
    table = np.array(rows, dtype=np.uint64).reshape(-1, 4)
    st, ln = np.array(starts, np.int64), np.array(lengths, np.int64)
    pieces = table
    block = np.searchsorted(st, table[:, 2].astype(np.int64), side="right") - 1
    segs, tiled, _ = crc_segments(
        pieces, block, np.array([base], np.uint64), base, st, ln, chunk=chunk
    )
    assert tiled.all()
    empty = np.zeros(0, np.uint64)
    plan = Plan(empty, empty, empty, np.zeros(0, kernels.ROW_DTYPE), segs, chunk=chunk)
    plan.blocks = np.zeros(len(starts), kernels.BLOCK_DTYPE)
    plan.blocks["init"] = kernels.init_terms(ln)
    plan.blocks["total"] = ln
    return plan


def host_crcs(plan: Plan) -> list[int]:
    state = np.zeros(len(plan.blocks), kernels.STATE_DTYPE)
    out = np.zeros(len(plan.blocks), np.uint32)
    blocks, pow8 = np.ascontiguousarray(plan.blocks), kernels.pow8_table()
    kernels.host_library().beluga_crc_blocks_host(
        plan.segs.ctypes.data,
        len(plan.segs),
        blocks.ctypes.data,
        state.ctypes.data,
        out.ctypes.data,
        pow8.ctypes.data,
        plan.chunk,
        1,
    )
    return [0 if n == 0 else int(c) for c, n in zip(out, plan.blocks["total"], strict=True)]


@pytest.mark.parametrize("chunk", [16, 64, 256])
@pytest.mark.parametrize("cuts", [1, 3])
def test_chunk_crcs_combined_are_the_c_cores_crc_at_every_length_and_alignment(
    chunk: int, cuts: int
) -> None:
    starts, lengths, at = [], [], 0
    for n in range(301):
        for align in range(16):
            at = (at + 15) // 16 * 16 + align
            starts.append(at)
            lengths.append(n)
            at += n + 1
    plan = crc_plan(starts, lengths, cuts, chunk, DATA.ctypes.data)
    want = [_core.crc32c(DATA[s : s + n].tobytes()) for s, n in zip(starts, lengths, strict=True)]
    assert host_crcs(plan) == want


def test_big_random_blocks_cut_anywhere_checksum_as_the_c_core_does() -> None:
    big = RNG.integers(0, 256, 6 << 20, dtype=np.uint8)
    lengths = [(4 << 20) + 13, 1 << 20, 65536 + 7]
    starts = [3, (4 << 20) + 64, (4 << 20) + 64 + (1 << 20) + 5]
    plan = crc_plan(starts, lengths, 7, 256, big.ctypes.data)
    want = [_core.crc32c(big[s : s + n].tobytes()) for s, n in zip(starts, lengths, strict=True)]
    assert host_crcs(plan) == want


@cuda
def test_the_crc_kernel_on_the_gpu_is_the_c_cores_at_every_length_and_alignment() -> None:
    from beluga.transfer.gpu.runtime import CudaRuntime

    runtime = CudaRuntime("cuda")
    data = torch.from_numpy(DATA).to("cuda")
    starts, lengths, at = [], [], 0
    for n in range(301):
        for align in range(16):
            at = (at + 15) // 16 * 16 + align
            starts.append(at)
            lengths.append(n)
            at += n + 1
    for chunk, cuts in ((16, 3), (256, 1)):
        plan = crc_plan(starts, lengths, cuts, chunk, data.data_ptr())
        got = runtime.execute(plan, save=True).tolist()
        got = [0 if n == 0 else c for c, n in zip(got, lengths, strict=True)]
        want = [
            _core.crc32c(DATA[s : s + n].tobytes()) for s, n in zip(starts, lengths, strict=True)
        ]
        assert got == want, chunk
    big = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device="cuda")
    plan = crc_plan([1, 4 << 20], [(4 << 20) - 9, 1 << 20], 5, 256, big.data_ptr())
    host = big.cpu().numpy()
    want = [
        _core.crc32c(host[1 : 1 + (4 << 20) - 9].tobytes()),
        _core.crc32c(host[4 << 20 :].tobytes()),
    ]
    assert runtime.execute(plan, save=True).tolist() == want
    runtime.close()
