"""Blocks (block.c, blockio.c): sweeps inside a write, caching readers, gather and scatter,
a device's read through its host."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from beluga import litmus
from beluga.coherence import Memory, ModelConfig
from tests.sabotage_checks.base import KEY, SEEDS, Violation, _host, _pool_file, _still

HDR, PAYLOAD, CAP = 0, 4096, 8192


def _sweep(name: str) -> Callable[[ModelConfig], None]:
    def check(model: ModelConfig) -> None:
        r = litmus.run_sweep(name, model, SEEDS)
        if r.caught:
            raise Violation(
                f"{name}: a reader took another version's bytes (equal CRC32C) in "
                f"{r.violations} of {r.trials} crash states"
            )
        if not (r.raced and r.confirmed):
            raise Violation(f"{name}: the sweep never met a write in progress")

    check.__name__ = f"sweep_{name}"
    check.__doc__ = f"Every state inside a {name} write reads as a miss or as a whole version."
    return check


def block_visible_at_return(model: ModelConfig) -> None:
    """A block published (whole, in place, or through write_blocks) is readable at return."""
    shared = bytearray(1 << 16)
    writer = _host(shared, _still(model), 1)
    for version, how in enumerate(("publish", "seal", "write_blocks"), start=1):
        data = random.Random(version).randbytes(3000)
        if how == "publish":
            writer.publish(HDR, PAYLOAD, KEY, version, data)
        else:
            writer.begin_write(HDR, PAYLOAD, KEY, version, len(data))
            if how == "seal":
                writer.nt_store(PAYLOAD, data)
                writer.seal(HDR, PAYLOAD, KEY, version, len(data))
            else:
                rows = np.array([(0, 0, PAYLOAD, len(data))], dtype=np.uint64)
                block = (HDR, PAYLOAD, KEY, version, len(data), 0, 0, 0)
                writer.write_blocks([data], rows, [block])
        out = bytearray(CAP)
        n = _host(shared, model, 10 + version).read_validated(HDR, PAYLOAD, CAP, KEY, version, out)
        if n != len(data) or bytes(out[:n]) != data:
            raise Violation(f"a block sealed by {how} was not readable when it returned ({n})")


def _republish(model: ModelConfig, read: Callable[[Memory, int, bytearray], int]) -> None:
    """A reader caches version 1, the writer publishes version 2, the reader reads it."""
    shared = bytearray(1 << 16)
    writer, reader = _host(shared, model, 1), _host(shared, model, 2)
    old, new = b"A" * 3000, b"B" * 2000
    writer.publish(HDR, PAYLOAD, KEY, 1, old)
    out = bytearray(CAP)
    if read(reader, 1, out) != len(old):
        raise Violation("the first version was not readable")
    writer.publish(HDR, PAYLOAD, KEY, 2, new)
    n = read(reader, 2, out)
    if n != len(new) or bytes(out[:n]) != new:
        raise Violation(f"a host that had read version 1 did not read version 2 ({n})")


def block_reread_on_a_caching_host(model: ModelConfig) -> None:
    """read_validated on a host holding the older version's lines returns the new one."""
    _republish(model, lambda m, v, out: m.read_validated(HDR, PAYLOAD, CAP, KEY, v, out))


def read_blocks_on_a_caching_host(model: ModelConfig) -> None:
    """read_blocks on a host holding the older version's lines returns the new one."""

    def read(m: Memory, version: int, out: bytearray) -> int:
        length = {1: 3000, 2: 2000}[version]
        rows = np.array([(0, 0, PAYLOAD, length)], dtype=np.uint64)
        (n,) = m.read_blocks([out], rows, [(HDR, PAYLOAD, CAP, KEY, version)])
        return n

    _republish(model, read)


def block_seal_of_a_foreign_payload(model: ModelConfig) -> None:
    """A payload another agent (the GPU's kernel) wrote is sealed right by a stale host."""
    shared = bytearray(1 << 16)
    host, gpu = _host(shared, model, 1), _host(shared, model, 2)
    old, new = b"O" * 3000, b"N" * 3000
    host.publish(HDR, PAYLOAD, KEY, 1, old)
    if host.read_validated(HDR, PAYLOAD, CAP, KEY, 1, bytearray(CAP)) != len(old):
        raise Violation("the first version was not readable")  # the host now caches it
    host.begin_write(HDR, PAYLOAD, KEY, 2, len(new))
    gpu.nt_store(PAYLOAD, new)
    gpu.sfence()
    host.seal(HDR, PAYLOAD, KEY, 2, len(new))
    out = bytearray(CAP)
    n = _host(shared, model, 3).read_validated(HDR, PAYLOAD, CAP, KEY, 2, out)
    if n != len(new) or bytes(out[:n]) != new:
        raise Violation(f"a payload written by another agent was sealed wrong ({n})")


def gather_and_scatter(model: ModelConfig) -> None:
    """gather_write's rows are in memory at return; scatter_read of a caching host sees them."""
    shared = bytearray(1 << 16)
    writer, reader = _host(shared, _still(model), 1), _host(shared, model, 2)
    rows = np.array([(0, 0, 4096, 900), (0, 900, 9000, 1100)], dtype=np.uint64)
    for n, fill in enumerate((b"x", b"y", b"z")):
        data = fill * 2000
        writer.gather_write([data], rows)
        out = bytearray(2000)
        reader.scatter_read([out], rows)
        if bytes(out) != data:
            raise Violation(f"round {n}: scatter_read did not see what gather_write returned from")


def device_read_on_a_caching_host(model: ModelConfig) -> None:
    """A GPU's load (the stand-in runtime: pool bytes as a device reads them through its host)
    of a block whose older version this host's CPU cached gets the newer version's bytes,
    which carry the same CRC32C, so only the invalidation can tell them apart (record.c)."""
    from beluga.transfer.gpu import GpuPool
    from tests.gpu_standin import StandInCuda

    old, new = litmus.TWINS
    with _pool_file(model) as host:
        writer, reader = host(1), host(2)
        with GpuPool(reader, runtime=StandInCuda()) as gpu:
            sb = reader.superblock
            hdr, pay, cap = sb.block_header_offset(0), sb.block_payload_offset(0), sb.block_size
            writer.memory.publish(hdr, pay, KEY, 1, old)
            if reader.memory.read_validated(hdr, pay, cap, KEY, 1, bytearray(cap)) != len(old):
                raise Violation("the first version was not readable")  # the CPU caches it now
            writer.memory.publish(hdr, pay, KEY, 2, new)
            out = np.zeros(len(new), np.uint8)
            rows = np.array([(0, 0, pay, len(new))], dtype=np.uint64)
            (n,) = gpu.read_blocks([out], rows, [(hdr, pay, cap, KEY, 2)])
            if n != len(new) or out.tobytes() != new:
                raise Violation(
                    f"a GPU load on a host that had cached version 1 did not get version 2 ({n}, "
                    f"{'the old bytes' if out.tobytes() == old else 'other bytes'})"
                )


sweep_publish, sweep_in_place, sweep_write_blocks = (_sweep(n) for n in litmus.SWEEPS)
