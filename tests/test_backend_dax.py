"""The dax: backend, exercised on stand-in files (as CI must) and a faked sysfs device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from beluga.errors import BackendUnavailableError, PoolError
from beluga.pool import Geometry, Pool, parse_spec
from beluga.pool import dax as dax_module
from beluga.pool.dax import DaxBackend
from tests.conftest import serving

MiB = 1 << 20
SMALL = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def stand_in(path: Path, size: int, fill: bytes = b"\0") -> str:
    """A regular file of ``size`` bytes standing in for /dev/daxX.Y."""
    path.write_bytes(fill * size)
    return str(path)


@pytest.mark.parametrize(
    ("spec", "path", "offset", "canonical"),
    [
        ("dax:/dev/dax0.0", "/dev/dax0.0", 0, "dax:/dev/dax0.0"),
        ("dax:/dev/dax0.0@4194304", "/dev/dax0.0", 4 * MiB, "dax:/dev/dax0.0@4194304"),
        ("dax:/dev/dax0.0@0", "/dev/dax0.0", 0, "dax:/dev/dax0.0"),
        ("dax:/tmp/with@sign@2097152", "/tmp/with@sign", 2 * MiB, "dax:/tmp/with@sign@2097152"),
    ],
)
def test_spec_parses_and_round_trips(spec: str, path: str, offset: int, canonical: str) -> None:
    b = parse_spec(spec)
    assert isinstance(b, DaxBackend) and (b.path, b.offset) == (path, offset)
    assert b.spec == canonical and parse_spec(b.spec).spec == b.spec
    assert not b.creates_storage


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("dax:/dev/dax0.0@4096", "multiple of 2 MiB"),
        ("dax:/dev/dax0.0@3145728", "multiple of 2 MiB"),
        ("dax:/dev/dax0.0@2M", "OFFSET in bytes"),
        ("dax:", "needs a device"),
    ],
)
def test_bad_specs_are_refused(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_stand_in_maps_from_the_offset(tmp_path: Path) -> None:
    path = stand_in(tmp_path / "dax", 41 * MiB)
    b = DaxBackend(path, 2 * MiB)
    m = b.create(32 * MiB)
    try:
        assert m.size == 32 * MiB and m.offset == 2 * MiB
        m.buffer[0:5] = b"first"
        m.buffer[32 * MiB - 4 : 32 * MiB] = b"last"
    finally:
        m.close()
    data = Path(path).read_bytes()
    assert data[2 * MiB : 2 * MiB + 5] == b"first" and data[:5] == bytes(5)
    assert data[34 * MiB - 4 : 34 * MiB] == b"last"
    whole = b.open()  # to the last whole 2 MiB after the offset: 39 MiB -> 38 MiB
    try:
        assert whole.size == 38 * MiB and bytes(whole.buffer[0:5]) == b"first"
    finally:
        whole.close()


def test_create_refuses_more_than_the_device_holds(tmp_path: Path) -> None:
    b = DaxBackend(stand_in(tmp_path / "dax", 16 * MiB), 4 * MiB)
    with pytest.raises(BackendUnavailableError, match=r"device smaller than asked: has 12582912"):
        b.create(16 * MiB)
    with pytest.raises(ValueError, match="multiple of 2 MiB"):
        b.create(3 * MiB)
    tiny = DaxBackend(stand_in(tmp_path / "tiny", MiB))
    with pytest.raises(BackendUnavailableError, match="less than the 2 MiB"):
        tiny.open()


def test_missing_device_says_how_to_make_one(tmp_path: Path) -> None:
    b = DaxBackend(str(tmp_path / "dax9.9"))
    assert not b.exists()
    for attempt in (b.open, lambda: b.create(2 * MiB), b.unlink):
        with pytest.raises(BackendUnavailableError, match=r"ndctl create-namespace.*emulation/"):
            attempt()


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_a_char_device_that_is_not_dax_is_refused(device: str) -> None:
    with pytest.raises(BackendUnavailableError, match=r"is not a device-DAX device.*mem subsystem"):
        DaxBackend(device).open()


def test_failed_opens_leak_no_descriptors(tmp_path: Path) -> None:
    stand_in(tmp_path / "tiny", MiB)
    attempts = [
        lambda: DaxBackend("/dev/null").open(),
        lambda: DaxBackend("/dev/zero").create(2 * MiB),
        lambda: DaxBackend(str(tmp_path / "absent")).open(),
        lambda: DaxBackend(str(tmp_path)).open(),
        lambda: DaxBackend(str(tmp_path / "tiny")).open(),
        lambda: DaxBackend(str(tmp_path / "tiny")).create(2 * MiB),
    ]
    before = open_fds()
    for attempt in attempts:
        with pytest.raises(BackendUnavailableError):
            attempt()
    assert open_fds() == before


def test_pool_lifecycle_on_a_dirty_stand_in(tmp_path: Path) -> None:
    """A device keeps old bytes: create clears what it uses, destroy wipes only the superblock."""
    path = stand_in(tmp_path / "dax", 66 * MiB, fill=b"\xa5")
    spec = f"dax:{path}@{2 * MiB}"
    with Pool.create(spec, 64 * MiB, geometry=SMALL) as pool:
        assert pool.superblock.pool_size == 64 * MiB
        assert pool.mapping.size == 64 * MiB  # open maps the whole device after the offset
        with serving(pool):
            entry = pool.claim_host()
        assert entry.host_id == 0
        assert pool.info()["device_size"] == 66 * MiB and pool.info()["stand_in_file"]
    with pytest.raises(PoolError, match="--force"):
        Pool.create(spec, 64 * MiB, geometry=SMALL)
    Pool.destroy(spec)
    data = Path(path).read_bytes()
    assert data[: 2 * MiB] == b"\xa5" * (2 * MiB), "bytes before the offset must not change"
    assert data[2 * MiB : 2 * MiB + 4096] == bytes(4096)
    with pytest.raises(PoolError, match="not a Beluga pool"):
        Pool.attach(spec)
    Pool.destroy(spec)  # repeating is harmless
    with Pool.create(spec, 32 * MiB, geometry=SMALL) as again:  # no --force needed now
        assert again.superblock.pool_size == 32 * MiB


def fake_sysfs(tmp_path: Path, device: str, subsystem: str, size: int) -> Path:
    """A /sys/dev/char tree in which ``device`` belongs to ``subsystem`` and holds ``size``."""
    rdev = os.stat(device).st_rdev
    bus = tmp_path / "bus" / subsystem
    bus.mkdir(parents=True)
    node = tmp_path / "char" / f"{os.major(rdev)}:{os.minor(rdev)}"
    node.mkdir(parents=True)
    (node / "subsystem").symlink_to(bus)
    (node / "size").write_text(f"{size}\n")
    return tmp_path / "char"


def test_device_size_comes_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/zero maps MAP_SHARED like a device, so a faked sysfs entry can pose it as DAX."""
    monkeypatch.setattr(
        dax_module, "SYS_CHAR_DEVICES", str(fake_sysfs(tmp_path, "/dev/zero", "dax", 12 * MiB))
    )
    b = DaxBackend("/dev/zero", 2 * MiB)
    assert b.info()["device_size"] == 12 * MiB and not b.info()["stand_in_file"]
    m = b.open()
    try:
        assert m.size == 10 * MiB
    finally:
        m.close()
    with pytest.raises(BackendUnavailableError, match="has 10485760, need 12582912"):
        b.create(12 * MiB)


def test_info_reports_device_facts(tmp_path: Path) -> None:
    path = stand_in(tmp_path / "dax", 8 * MiB)
    info = DaxBackend(path, 2 * MiB).info()
    assert info == {
        "backend": "dax",
        "spec": f"dax:{path}@{2 * MiB}",
        "path": path,
        "offset": 2 * MiB,
        "device_size": 8 * MiB,
        "stand_in_file": True,
    }
    assert DaxBackend(str(tmp_path / "absent")).info()["device_size"] is None
