"""The interleave: backend over stand-in dax devices and plain files."""

from __future__ import annotations

import mmap
import os
import pickle
from pathlib import Path

import pytest

from beluga.coherence import Memory
from beluga.errors import BackendUnavailableError, PoolError
from beluga.pool import Backend, Geometry, Mapping, Pool, ShmBackend, parse_spec
from beluga.pool import interleave as interleave_module
from beluga.pool._libc import address_of
from beluga.pool.dax import DaxBackend
from beluga.pool.interleave import MAPS_KEPT_FREE, InterleaveBackend
from tests.conftest import serving

MiB = 1 << 20
STRIPE = 2 * MiB
SMALL = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def is_mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def devices(tmp_path: Path, sizes: list[int], offset: int = 0) -> list[str]:
    """Stand-in dax devices (regular files) of the given sizes, as child specs."""
    specs = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"dax{i}.0"
        path.write_bytes(bytes(size))
        specs.append(f"dax:{path}@{offset}" if offset else f"dax:{path}")
    return specs


def child_location(pool_offset: int, n: int, stripe: int) -> tuple[int, int]:
    """(child index, offset in that child) where a pool byte must land."""
    k, within = divmod(pool_offset, stripe)
    return k % n, (k // n) * stripe + within


@pytest.mark.parametrize(
    ("rest", "stripe", "children"),
    [
        ("shm:/dev/shm/a,shm:/dev/shm/b", STRIPE, ["shm:/dev/shm/a", "shm:/dev/shm/b"]),
        ("4194304:dax:/dev/dax0.0,dax:/dev/dax1.0@2097152", 4 * MiB,
         ["dax:/dev/dax0.0", "dax:/dev/dax1.0@2097152"]),
        ("/dev/shm/a,/dev/shm/b,/dev/shm/c", STRIPE,
         ["shm:/dev/shm/a", "shm:/dev/shm/b", "shm:/dev/shm/c"]),
    ],
)  # fmt: skip
def test_spec_parses_and_round_trips(rest: str, stripe: int, children: list[str]) -> None:
    b = parse_spec(f"interleave:{rest}")
    assert isinstance(b, InterleaveBackend) and b.stripe == stripe
    assert [c.spec for c in b.children] == children
    assert b.spec == f"interleave:{stripe}:{','.join(children)}"
    assert parse_spec(b.spec).spec == b.spec


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("interleave:3145728:shm:/x/a,shm:/x/b", "multiple of 2 MiB"),
        ("interleave:0:shm:/x/a,shm:/x/b", "multiple of 2 MiB"),
        ("interleave:2097152:shm:/x/a", "at least two children"),
        ("interleave:2097152:shm:/x/a,shm:/x/a", "appears twice"),
        ("interleave:2097152:shm:/x/a,,shm:/x/b", "no empty child"),
        ("interleave:2097152:shm:/x/a,dax:/dev/dax0.0@1", "multiple of 2 MiB"),
    ],
)
def test_bad_specs_are_refused(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_nested_interleave_is_refused() -> None:
    inner = InterleaveBackend([ShmBackend("/x/a"), ShmBackend("/x/b")])
    with pytest.raises(ValueError, match="cannot be an interleave child"):
        InterleaveBackend([inner, ShmBackend("/x/c")])


@pytest.mark.parametrize("n", [2, 3])
def test_bytes_land_in_the_right_child(tmp_path: Path, n: int) -> None:
    offset = 2 * MiB  # children use a data offset too
    specs = devices(tmp_path, [offset + 8 * MiB] * n, offset)
    b = InterleaveBackend([parse_spec(s) for s in specs])
    size = 7 * STRIPE  # not a multiple of n: the last round of stripes is partial
    probes = [k * STRIPE + k * 4097 % STRIPE for k in range(7)] + [size - 8]
    m = b.create(size)
    try:
        assert m.size == size
        for i, at in enumerate(probes):
            m.buffer[at : at + 8] = f"probe{i:03d}".encode()
    finally:
        m.close()
    files = [Path(s.split(":", 1)[1].rsplit("@", 1)[0]).read_bytes() for s in specs]
    for i, at in enumerate(probes):
        child, where = child_location(at, n, STRIPE)
        assert files[child][offset + where : offset + where + 8] == f"probe{i:03d}".encode()
    # and the other way: bytes written into a child show up at the right pool offset
    child, where = child_location(5 * STRIPE + 123, n, STRIPE)
    with open(specs[child].split(":", 1)[1].rsplit("@", 1)[0], "r+b") as f:
        f.seek(offset + where)
        f.write(b"from the child")
    m = b.open()
    try:
        assert bytes(m.buffer[5 * STRIPE + 123 : 5 * STRIPE + 137]) == b"from the child"
    finally:
        m.close()


@pytest.mark.parametrize("n", [2, 3])
def test_pool_create_and_attach(tmp_path: Path, n: int) -> None:
    spec = "interleave:" + ",".join(devices(tmp_path, [32 * MiB] * n))
    b = parse_spec(spec)
    assert not b.creates_storage
    with Pool.create(spec, 64 * MiB, geometry=SMALL, label="striped") as pool:
        assert pool.mapping.size == n * 32 * MiB  # open maps whole children
        with serving(pool):
            host = pool.claim_host()
        clone = pickle.loads(pickle.dumps(pool))
        try:
            assert clone.superblock == pool.superblock and clone.spec == parse_spec(spec).spec
            assert [e.host_id for e in clone.hosts.entries()] == [host.host_id]
        finally:
            clone.close()
        info = pool.info()
        assert info["stripe"] == STRIPE and len(info["children"]) == n
        assert info["children"][0]["backend"] == "dax"
    Pool.destroy(spec)
    with pytest.raises(PoolError, match="not a Beluga pool"):
        Pool.attach(spec)


def test_file_children_are_created_and_removed(tmp_path: Path) -> None:
    paths = [tmp_path / "a", tmp_path / "b"]
    b = InterleaveBackend([ShmBackend(str(p)) for p in paths], 4 * MiB)
    assert b.creates_storage and not b.exists()
    with Pool.create(b, 24 * MiB, geometry=SMALL) as pool:  # 6 stripes: 3 per child
        assert pool.superblock.pool_size == 24 * MiB
        assert [p.stat().st_size for p in paths] == [12 * MiB, 12 * MiB]
        fd = pool.mapping.exclusive_lock("the test's lock")  # the first child is lockable
        assert fd >= 0
        os.close(fd)
    assert b.exists()
    Pool.destroy(b)
    assert not any(p.exists() for p in paths)
    Pool.destroy(b)


def test_unequal_children_use_the_smallest(tmp_path: Path) -> None:
    b = parse_spec("interleave:" + ",".join(devices(tmp_path, [64 * MiB, 41 * MiB, 50 * MiB])))
    m = b.open()
    try:
        assert m.size == 3 * 40 * MiB
    finally:
        m.close()


def test_a_missing_child_is_named(tmp_path: Path) -> None:
    present = devices(tmp_path, [8 * MiB])[0]
    b = parse_spec(f"interleave:{present},dax:{tmp_path}/dax7.0")
    before = open_fds()
    with pytest.raises(BackendUnavailableError, match=f"no device at {tmp_path}/dax7.0"):
        b.open()
    with pytest.raises(BackendUnavailableError, match=f"no device at {tmp_path}/dax7.0"):
        b.create(8 * MiB)
    assert open_fds() == before


def test_a_too_small_child_rolls_everything_back(tmp_path: Path) -> None:
    small = devices(tmp_path, [4 * MiB])[0]
    file_child = tmp_path / "file"
    b = parse_spec(f"interleave:shm:{file_child},{small}")
    before = open_fds()
    with pytest.raises(BackendUnavailableError, match="device smaller than asked"):
        Pool.create(b, 32 * MiB, geometry=SMALL)
    assert open_fds() == before
    assert list(tmp_path.iterdir()) == [tmp_path / "dax0.0"], "the file child must be removed"
    with pytest.raises(ValueError, match="multiple of its stripe"):
        InterleaveBackend(b.children, 4 * MiB).create(6 * MiB)


def test_too_many_stripes_are_refused_with_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open("/proc/self/maps") as f:
        used = sum(1 for _ in f)
    limit = tmp_path / "max_map_count"
    limit.write_text(f"{used + MAPS_KEPT_FREE + 10}\n")  # room for about 10 more mappings
    monkeypatch.setattr(interleave_module, "MAX_MAP_COUNT", str(limit))
    b = parse_spec("interleave:" + ",".join(devices(tmp_path, [32 * MiB] * 2)))
    before = open_fds()
    with pytest.raises(
        BackendUnavailableError, match=r"needs 32 memory mappings.*interleave:8388608:"
    ):
        b.open()
    assert open_fds() == before
    m = InterleaveBackend(b.children, 8 * MiB).open()  # the advice works
    m.close()


def test_close_unmaps_once_and_closes_every_descriptor(tmp_path: Path) -> None:
    b = parse_spec("interleave:" + ",".join(devices(tmp_path, [8 * MiB] * 3)))
    before = open_fds()
    m = b.open()
    base = address_of(m.buffer)
    assert base % (2 * MiB) == 0 and is_mapped(base) and is_mapped(base + m.size - 1)
    assert open_fds() == before + 3
    memory = Memory(m.buffer, "native")
    with pytest.raises(BufferError):
        m.close()  # refused while a view is alive, instead of leaving it dangling
    memory.nt_store(0, b"still mapped")
    memory.release()
    m.close()
    assert not is_mapped(base) and not is_mapped(base + m.size - 1)
    assert open_fds() == before and m.buffer is None
    m.close()


class AnonymousBackend(Backend):
    """A backend whose memory has no descriptor, which cannot be stitched."""

    scheme = "test-anonymous"

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def spec(self) -> str:
        return f"{self.scheme}:{self.name}"

    def exists(self) -> bool:
        return True

    def create(self, size: int) -> Mapping:
        return self.open()

    def open(self) -> Mapping:
        mm = mmap.mmap(-1, 4 * MiB)
        return Mapping(buffer=mm, size=4 * MiB, _closers=[mm.close])

    def unlink(self) -> None:
        pass


def test_children_must_come_from_a_descriptor(tmp_path: Path) -> None:
    b = InterleaveBackend([DaxBackend(devices(tmp_path, [8 * MiB])[0][4:]), AnonymousBackend("x")])
    with pytest.raises(BackendUnavailableError, match="test-anonymous:x cannot be interleaved"):
        b.open()
