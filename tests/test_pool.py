"""Pool create / attach / destroy and the superblock that describes it."""

from __future__ import annotations

import itertools
import os
import pickle
import stat
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beluga.coherence import ModelConfig, crc32c, digest, write_line
from beluga.errors import (
    BackendUnavailableError,
    BelugaError,
    LayoutVersionError,
    PoolError,
    PoolNotNamedError,
)
from beluga.kv import protocol as p
from beluga.pool import Geometry, HostState, Pool, parse_spec, resolve_pool
from beluga.pool.host_records import HostEntry, Identity
from beluga.pool.layout import (
    LAYOUT_VERSION,
    MAGIC,
    SUPERBLOCK_BYTES,
    blocks_holding,
    plan,
    pool_size_for,
    unpack,
)
from beluga.rpc import Request
from beluga.server.service import MetadataService

from .conftest import SMALL

SIZE = 32 << 20


def test_create_attach_round_trip(shm_path: str) -> None:
    with Pool.create(shm_path, SIZE, geometry=SMALL, label="qwen2-tiny") as p:
        sb = p.superblock
        assert sb.pool_size == SIZE and sb.label == "qwen2-tiny" and sb.max_hosts == 4
        regions = [sb.hosts, sb.rpc, sb.index, sb.headers, sb.payloads]
        assert all(r.offset % (2 << 20) == 0 for r in regions)
        assert all(a.end <= b.offset for a, b in itertools.pairwise(regions))
        assert sb.payloads.end <= SIZE and sb.nblocks * SMALL.block_size == sb.payloads.length
    with Pool.attach(shm_path, coherence="model") as q:
        assert q.superblock == sb and q.memory.mode == "model"
    Pool.destroy(shm_path)
    assert not os.path.exists(shm_path)
    Pool.destroy(shm_path)  # twice is fine


def test_pool_file_is_not_world_writable(pool: Pool) -> None:
    mode = stat.S_IMODE(os.stat(pool.backend.path).st_mode)
    assert not mode & stat.S_IWOTH and mode & stat.S_IRUSR


def test_existing_pool_needs_force(pool: Pool, shm_path: str) -> None:
    with pytest.raises(PoolError, match="--force"):
        Pool.create(shm_path, SIZE, geometry=SMALL)
    old_uuid = pool.superblock.uuid
    with Pool.create(shm_path, SIZE, geometry=SMALL, force=True) as fresh:
        assert fresh.superblock.uuid != old_uuid


def test_a_failed_create_leaves_nothing_behind(
    shm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beluga.pool import layout

    def broken_pack(self: layout.Superblock) -> bytes:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(layout.Superblock, "pack", broken_pack)
    with pytest.raises(RuntimeError):
        Pool.create(shm_path, SIZE, geometry=SMALL)
    assert not os.path.exists(shm_path) and not os.path.exists(shm_path + ".creating")


@pytest.mark.parametrize("size", [0, 3 << 20, (2 << 20) * 3 + 1])
def test_bad_sizes_are_refused(shm_path: str, size: int) -> None:
    with pytest.raises(ValueError):
        Pool.create(shm_path, size, geometry=SMALL)
    assert not os.path.exists(shm_path)


def test_too_small_for_one_block_says_how_big(shm_path: str) -> None:
    with pytest.raises(ValueError, match="use at least"):
        Pool.create(shm_path, 8 << 20, geometry=Geometry(max_hosts=4, block_size=8 << 20))


def test_missing_pool_and_missing_permission(shm_path: str) -> None:
    with pytest.raises(PoolError, match="beluga pool create"):
        Pool.attach(shm_path)
    with pytest.raises(BackendUnavailableError, match="choose a path you can write"):
        Pool.create("/proc/beluga-cannot-be-here", SIZE, geometry=SMALL)


def test_no_permission_to_open(pool: Pool, shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args: object, **kw: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", denied)  # root bypasses file modes, so simulate a user
    with pytest.raises(BackendUnavailableError, match="owner or a member of its group"):
        Pool.attach(shm_path)


def corrupt(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_foreign_file_is_refused(shm_path: str) -> None:
    with open(shm_path, "wb") as f:
        f.write(os.urandom(4 << 20))
    with pytest.raises(PoolError, match="not a Beluga pool"):
        Pool.attach(shm_path)
    with pytest.raises(PoolError, match="--force"):
        Pool.create(shm_path, SIZE, geometry=SMALL)


def test_corrupted_superblock_is_refused(pool: Pool, shm_path: str) -> None:
    corrupt(shm_path, 40, b"\xff")
    with pytest.raises(PoolError, match="corrupted superblock"):
        Pool.attach(shm_path)


def reseal(raw: bytearray) -> None:
    """Recompute a superblock's checksum in place."""
    struct.pack_into("<I", raw, SUPERBLOCK_BYTES - 4, crc32c(bytes(raw[: SUPERBLOCK_BYTES - 4])))


def reseal_file(path: str, mutate_offset: int, fmt: str, value: int) -> None:
    """Change one field and fix the checksum, as a newer or broken writer would."""
    with open(path, "r+b") as f:
        raw = bytearray(f.read(SUPERBLOCK_BYTES))
        struct.pack_into(fmt, raw, mutate_offset, value)
        reseal(raw)
        f.seek(0)
        f.write(raw)


def test_newer_layout_version_is_refused(pool: Pool, shm_path: str) -> None:
    reseal_file(shm_path, 8, "<I", LAYOUT_VERSION + 1)
    with pytest.raises(LayoutVersionError, match="upgrade Beluga"):
        Pool.attach(shm_path)


def test_truncated_pool_is_refused(pool: Pool, shm_path: str) -> None:
    os.truncate(shm_path, 16 << 20)
    with pytest.raises(PoolError, match="truncated"):
        Pool.attach(shm_path)


def test_failed_attach_leaks_no_descriptors(shm_path: str) -> None:
    with open(shm_path, "wb") as f:
        f.write(bytes(4 << 20))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(PoolError):
            Pool.attach(shm_path)
    assert len(os.listdir("/proc/self/fd")) == before


def test_handle_pickles_by_name(pool: Pool) -> None:
    clone = pickle.loads(pickle.dumps(pool))
    try:
        assert clone.superblock == pool.superblock and clone.spec == pool.spec
    finally:
        clone.close()


def test_spec_parsing() -> None:
    assert parse_spec("/dev/shm/x").spec == "shm:/dev/shm/x"
    assert parse_spec("shm:/dev/shm/x").spec == "shm:/dev/shm/x"
    with pytest.raises(ValueError, match="unknown pool backend"):
        parse_spec("rdma:host:1234")
    with pytest.raises(ValueError):
        parse_spec("")


def test_the_pool_is_the_argument_else_the_environment_else_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BELUGA_POOL", "shm:/dev/shm/from-env")
    assert resolve_pool("shm:/dev/shm/given", setting="--pool") == "shm:/dev/shm/given"
    for unset in (None, ""):
        assert resolve_pool(unset, setting="--pool", default="shm:/d") == "shm:/dev/shm/from-env"
    monkeypatch.setenv("BELUGA_POOL", "")
    assert resolve_pool(None, setting="--pool", default="shm:/d") == "shm:/d"


def test_a_pool_named_nowhere_is_an_error_that_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    with pytest.raises(PoolNotNamedError) as caught:
        resolve_pool(None, setting="'pool' in extra_config")
    message = str(caught.value)
    assert "set 'pool' in extra_config to a pool spec" in message and "BELUGA_POOL" in message
    assert isinstance(caught.value, BelugaError) and isinstance(caught.value, ValueError)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(min_size=360, max_size=360),
        st.binary(min_size=352, max_size=352).map(lambda b: MAGIC + b),
    )
)
def test_superblock_parser_rejects_random_bytes(raw: bytes) -> None:
    with pytest.raises(PoolError):
        unpack(raw.ljust(SUPERBLOCK_BYTES, b"\0"), 1 << 30)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, SUPERBLOCK_BYTES - 1), st.integers(1, 255))
def test_superblock_parser_rejects_any_flipped_byte(pos: int, flip: int) -> None:
    raw = bytearray(plan(64 << 20, SMALL).pack())
    raw[pos] ^= flip
    with pytest.raises(PoolError):
        unpack(bytes(raw), 64 << 20)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(range(24, 200, 8))), st.integers(0, 2**40))
def test_resealed_nonsense_regions_are_refused(field_offset: int, value: int) -> None:
    """Even with a valid checksum, an impossible region table is refused."""
    raw = bytearray(plan(64 << 20, SMALL).pack())
    struct.pack_into("<Q", raw, field_offset, value)
    reseal(raw)
    try:
        parsed = unpack(bytes(raw), 64 << 20)
    except PoolError:
        return
    for r in (parsed.hosts, parsed.rpc, parsed.headers, parsed.payloads):
        assert r.end <= parsed.pool_size <= 64 << 20


def test_a_geometry_whose_rpc_area_does_not_divide_evenly_still_attaches(shm_path: str) -> None:
    """24 hosts of 128 KiB rings round the RPC area up to 4 MiB, which 24 does not divide."""
    geometry = Geometry(max_hosts=24, rpc_bytes_per_host=128 << 10, block_size=16 << 10)
    with Pool.create(shm_path, 24 << 20, geometry=geometry) as pool:
        sb = pool.superblock
        assert sb.rpc_bytes_per_host >= 128 << 10 and sb.rpc_bytes_per_host % 4096 == 0
        assert sb.rpc.offset + sb.max_hosts * sb.rpc_bytes_per_host <= sb.rpc.end
    with Pool.attach(shm_path) as again:
        assert again.superblock == sb
    Pool.destroy(shm_path)


def test_a_device_formatted_under_the_model_keeps_no_ghosts_for_a_host_with_stale_lines(
    tmp_path: Path,
) -> None:
    """Format a device (a stand-in file) that holds a pool in use, through a model host.

    A host that had the old pool attached still caches its host table, block
    headers and commit table; after the format its own reads (invalidate,
    MFENCE, load) must find the new, empty pool: no host, and a metadata server
    restarted on it recovers no key.
    """
    model = ModelConfig(evict_rate=0.0)
    (tmp_path / "dax0.0").write_bytes(bytes(SIZE))
    spec = f"dax:{tmp_path / 'dax0.0'}"
    old = Pool.create(spec, SIZE, geometry=SMALL, coherence="model", model=replace(model, seed=1))
    stale = Pool.attach(spec, coherence="model", model=replace(model, seed=2))
    try:
        me = Identity.mine()
        holder = HostEntry(0, HostState.ALIVE, me.pid, me.start_ms, me.boot_id, 1, 1, 1)
        write_line(old.memory, old.superblock.hosts.offset, holder.pack())
        svc = MetadataService(old)
        for key in (b"a", b"b"):
            raw = p.encode_alloc([(digest(key), 100, 1)])
            (g,) = p.decode_grants(svc.op_alloc(Request(1, int(p.StoreOp.ALLOC), raw, 1)))
            sb = old.superblock
            old.memory.publish(
                sb.block_header_offset(g.block),
                sb.block_payload_offset(g.block),
                digest(key),
                g.version,
                key * 100,
            )
            raw = p.encode_commit([(digest(key), g.block, g.version)])
            assert p.decode_flags(svc.op_commit(Request(1, int(p.StoreOp.COMMIT), raw, 1)))[0]
        assert len(MetadataService(stale).index) == 2  # the stale host now caches the tables
        assert stale.hosts.entries() == [holder]
        old.close()
        with Pool.create(
            spec, SIZE, geometry=SMALL, force=True, coherence="model", model=replace(model, seed=3)
        ) as new:
            assert new.superblock.uuid != stale.superblock.uuid
            assert new.superblock.hosts == stale.superblock.hosts  # one geometry: same lines
            assert not MetadataService(stale).index  # recovered on the stale host: no ghost
            assert stale.hosts.entries() == [] and stale.hosts.seat() is None
    finally:
        old.close()
        stale.close()


def _nblocks(size: int, geometry: Geometry) -> int:
    try:
        return plan(size, geometry).nblocks
    except ValueError:
        return 0


@pytest.mark.parametrize(
    ("geometry", "align"),
    [
        (SMALL, 2 << 20),
        (Geometry(max_hosts=4, block_size=2 << 20), 2 << 20),
        (Geometry(max_hosts=4, block_size=2 << 20), 8 << 20),  # an interleaved pool's stripe
    ],
)
def test_pool_size_for_is_the_smallest_aligned_size_with_the_blocks(
    geometry: Geometry, align: int
) -> None:
    for blocks in (1, 7, 300):
        size = pool_size_for(blocks, geometry, align)
        assert size % align == 0 and plan(size, geometry).nblocks >= blocks
        assert _nblocks(size - align, geometry) < blocks


def test_blocks_holding_rounds_up_to_whole_blocks() -> None:
    g = Geometry(block_size=64 << 10)
    assert [blocks_holding(n, g) for n in (0, 1, 64 << 10, (64 << 10) + 1)] == [1, 1, 1, 2]
    with pytest.raises(ValueError, match="at least one block"):
        pool_size_for(0, g)
    with pytest.raises(ValueError, match="multiple of 2 MiB"):
        pool_size_for(1, g, 4096)
    with pytest.raises(ValueError, match="not negative"):
        blocks_holding(-1, g)
