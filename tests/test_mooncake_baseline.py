"""The Mooncake Store baseline: availability messages, byte-exact round trips, clean stop.

The round-trip tests need Mooncake (``ci/install-mooncake.sh``) and skip with
the availability check's own reason where it is missing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from beluga.bench.mooncake import MooncakeBaseline
from beluga.errors import BackendUnavailableError
from beluga.kv.tier import mooncake
from beluga.kv.tier.mooncake import MooncakeClient

KiB = 1 << 10
MiB = 1 << 20
INSTALL_LINES = ("pip install mooncake-transfer-engine-non-cuda==0.3.13.post1", "libibverbs1")


def test_absent_module_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(BackendUnavailableError, match="not installed") as caught:
        mooncake.check_available()
    for line in INSTALL_LINES:
        assert line in str(caught.value)


def test_absent_module_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    before = psutil.Process().children(recursive=True)
    baseline = MooncakeBaseline()
    with pytest.raises(BackendUnavailableError), baseline:
        pytest.fail("the body must not run")
    assert baseline.pids == []
    assert psutil.Process().children(recursive=True) == before


class _FakeLoader:
    """Stands in for ctypes.CDLL: no system-wide libibverbs, files loadable only from ``libdir``."""

    def __init__(self, libdir: Path | None) -> None:
        self.libdir = libdir
        self.loaded: list[str] = []

    def __call__(self, name: str, mode: int = 0) -> object:
        assert mode == ctypes.RTLD_GLOBAL
        if self.libdir is None or Path(name).parent != self.libdir:
            raise OSError(f"{name}: cannot open shared object file")
        self.loaded.append(Path(name).name)
        return object()


def test_missing_verbs_names_the_folder_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BELUGA_MOONCAKE_LIBDIR", str(tmp_path))
    monkeypatch.setattr(mooncake.ctypes, "CDLL", _FakeLoader(None))
    with pytest.raises(BackendUnavailableError, match=r"libibverbs\.so\.1") as caught:
        mooncake._load_verbs()
    assert str(tmp_path) in str(caught.value)
    for line in INSTALL_LINES:
        assert line in str(caught.value)


def test_unpacked_verbs_are_preloaded_in_dependency_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loader = _FakeLoader(tmp_path)
    monkeypatch.setenv("BELUGA_MOONCAKE_LIBDIR", str(tmp_path))
    monkeypatch.setattr(mooncake.ctypes, "CDLL", loader)
    assert mooncake._load_verbs() == tmp_path
    assert loader.loaded == ["libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"]


def test_libdir_defaults_to_the_installer_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BELUGA_MOONCAKE_LIBDIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert mooncake.verbs_libdir() == Path("/cache/beluga/mooncake-libs")


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 MiB"):
        MooncakeBaseline(segment_size=1024)
    with pytest.raises(ValueError, match="positive"):
        MooncakeBaseline(start_timeout=0)


def _require_mooncake() -> None:
    try:
        mooncake.check_available()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def client() -> Iterator[MooncakeClient]:
    _require_mooncake()
    with MooncakeBaseline() as baseline:
        pids = baseline.pids
        yield baseline.client
    assert not any(psutil.pid_exists(pid) for pid in pids)


def _key() -> str:
    return f"test-{uuid.uuid4().hex}"


@pytest.mark.parametrize("size", [16 * KiB, 2 * MiB])
def test_put_get_round_trip(client: MooncakeClient, size: int) -> None:
    key, value = _key(), os.urandom(size)
    client.put(key, value)
    assert client.is_exist(key)
    assert client.get(key) == value
    assert client.remove(key)
    assert not client.is_exist(key)
    assert not client.remove(key)
    with pytest.raises(KeyError):
        client.get(key)


def test_batch_round_trip(client: MooncakeClient) -> None:
    keys = [_key() for _ in range(64)]
    values = [os.urandom(16 * KiB) for _ in keys]
    client.put_batch(keys, values)
    missing = _key()
    assert client.get_batch([*keys, missing]) == [*values, None]
    assert all(client.remove(key) for key in keys)


def test_a_key_is_written_once(client: MooncakeClient) -> None:
    key = _key()
    client.put(key, b"first")
    client.put(key, b"second")
    assert client.get(key) == b"first"
    assert client.remove(key)


def test_zero_copy_round_trip(client: MooncakeClient) -> None:
    region = np.zeros(8 * MiB, dtype=np.uint8)
    client.register_buffer(region)
    try:
        keys = [_key() for _ in range(64)]
        sources = [region[i * 16 * KiB : (i + 1) * 16 * KiB] for i in range(64)]
        targets = [region[MiB + i * 16 * KiB : MiB + (i + 1) * 16 * KiB] for i in range(65)]
        region[: 64 * 16 * KiB] = np.frombuffer(os.urandom(64 * 16 * KiB), dtype=np.uint8)
        client.batch_put_from(keys, sources)
        assert client.batch_get_into([*keys, _key()], targets) == [16 * KiB] * 64 + [None]
        assert np.array_equal(region[MiB : MiB + 64 * 16 * KiB], region[: 64 * 16 * KiB])

        big, source, target = _key(), region[2 * MiB : 4 * MiB], region[4 * MiB : 6 * MiB]
        source[:] = np.frombuffer(os.urandom(2 * MiB), dtype=np.uint8)
        client.put_from(big, source)
        assert client.get_into(big, target) == 2 * MiB
        assert np.array_equal(target, source)
        assert client.get(big) == source.tobytes()
        with pytest.raises(ValueError, match="smaller than the value"):
            client.get_into(big, region[6 * MiB : 6 * MiB + KiB])
        with pytest.raises(KeyError):
            client.get_into(_key(), target)
        for key in [*keys, big]:
            assert client.remove(key)
    finally:
        client.unregister_buffer(region)
    with pytest.raises(ValueError, match="register_buffer"):
        client.put_from(_key(), region[:KiB])


def test_bad_arguments_are_refused_before_mooncake(client: MooncakeClient) -> None:
    with pytest.raises(ValueError, match="empty"):
        client.put(_key(), b"")
    with pytest.raises(ValueError, match="non-empty str"):
        client.get(b"bytes-key")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 keys but 1"):
        client.put_batch([_key(), _key()], [b"x"])
    with pytest.raises(ValueError, match="writable"):
        client.register_buffer(b"read-only")


def test_stop_leaves_no_process_and_no_files_even_if_the_body_raised() -> None:
    _require_mooncake()
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    baseline = MooncakeBaseline()
    with pytest.raises(RuntimeError, match="body failed"), baseline:
        pids = baseline.pids
        logdir = baseline._logdir
        assert len(pids) == 2
        assert all(psutil.pid_exists(pid) for pid in pids)
        raise RuntimeError("body failed")
    assert not any(psutil.pid_exists(pid) for pid in pids)
    started = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert not [child for child in started if child.name().startswith("mooncake")]
    assert logdir is not None and not logdir.exists()
    with pytest.raises(RuntimeError, match="not running"):
        _ = baseline.client
