"""The C core seen from Python: CRC32C, instruction choice, bounds checks."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from setuptools import Distribution, Extension

from beluga._native import _core
from beluga.coherence import Memory, crc32c, seal_record, unseal_record
from beluga.errors import CoherenceError


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bitwise CRC32C, the definition itself."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


@pytest.mark.parametrize("n", [1, 7, 8, 383, 384, 385, 3071, 3072, 3073, 9216, 16384, 20011])
def test_crc32c_every_path_matches_reference(n: int) -> None:
    data = os.urandom(n)
    assert crc32c(data) == crc32c_reference(data)


@given(st.binary(max_size=5000), st.integers(0, 5000))
def test_crc32c_chains_like_zlib(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


@given(st.binary(max_size=60), st.sampled_from([64, 4096]))
def test_a_sealed_record_is_its_body_padded_then_their_crc32c(body: bytes, size: int) -> None:
    """The one codec of host lines, ring control lines and the superblock."""
    padded = body.ljust(size - 4, b"\0")
    record = padded + struct.pack("<I", crc32c_reference(padded))
    assert seal_record(body, size) == record
    assert unseal_record(record) == padded
    torn = bytearray(record)
    torn[random.randrange(size)] ^= 1 << random.randrange(8)
    assert unseal_record(bytes(torn)) is None


def test_a_sealed_record_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="room for 60 bytes before its checksum, not 61"):
        seal_record(bytes(61))
    with pytest.raises(ValueError, match="at least 4 bytes"):
        seal_record(b"", 3)
    with pytest.raises(ValueError, match="at least 4 bytes"):
        unseal_record(b"abc")
    assert unseal_record(bytes(64)) is None  # an empty line is no record


@pytest.mark.parametrize(
    ("env", "key", "want"),
    [
        ({"BELUGA_CRC": "sw"}, "crc", "sw"),
        ({"BELUGA_FLUSH": "clflush"}, "flush", "clflush"),
        ({"BELUGA_NT": "store-flush"}, "nt", "store-flush"),
        ({"BELUGA_COPY": "sse2"}, "copy", "sse2"),
        ({"BELUGA_COPY": "libc"}, "copy", "libc"),
        ({"BELUGA_COPY_CRC": "copy+crc"}, "copy_crc", "copy+crc"),
    ],
)
def test_chicken_bits_force_a_choice(env: dict[str, str], key: str, want: str) -> None:
    code = (
        "from beluga._native import _core; from beluga.coherence import crc32c;"
        "import mmap; m = _core.Memory(bytearray(8192)); d = bytes(range(256)) * 20;"
        "m.nt_store(3, d); m.sfence(); assert m.load(3, len(d)) == d;"
        "assert crc32c(b'123456789') == 0xE3069283;"
        f"print(_core.selected()[{key!r}])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == want


def test_selected_names_real_features() -> None:
    sel, feats = _core.selected(), _core.cpu_features()
    if sel["flush"] == "clflushopt":
        assert feats["clflushopt"]
    if sel["nt"] == "avx512":
        assert feats["avx512f"]
    assert sel["copy"] == ("avx512" if feats["avx512f"] else "avx2" if feats["avx2"] else "sse2")
    assert sel["crc"] in ("vpclmulqdq", "hw", "sw")
    if sel["crc"] == "vpclmulqdq":
        assert feats["avx512f"]


@pytest.mark.parametrize("mode", ["native", "model"])
def test_out_of_range_access_raises_instead_of_crashing(mode: str) -> None:
    mem = Memory(bytearray(4096), mode)
    for call in (
        lambda: mem.load(4090, 7),
        lambda: mem.store(4095, b"xy"),
        lambda: mem.nt_store(2**63, b"x"),
        lambda: mem.flush(0, 4097),
        lambda: mem.invalidate(2**64 - 1, 2),
        lambda: mem.load_u64(4),
        lambda: mem.publish(64, 4096, bytes(16), 1, b"x"),
        lambda: mem.publish(0, 128, bytes(16), 0, b"x"),
        lambda: mem.publish(0, 32, bytes(16), 1, b"x"),
        lambda: mem.read_validated(3, 64, 100, bytes(16), 0, bytearray(8)),
        lambda: mem.publish(0, 64, bytes(15), 1, b"x"),
    ):
        with pytest.raises(CoherenceError):
            call()
    mem.release()
    with pytest.raises(CoherenceError, match="released"):
        mem.load(0, 1)
    mem.release()  # twice is fine


def test_bad_mode_and_readonly_buffer_are_refused() -> None:
    with pytest.raises(ValueError, match="native"):
        Memory(bytearray(64), "bogus")
    with pytest.raises(BufferError):
        Memory(b"read-only bytes")


def test_scatter_gather_table_is_checked_before_any_byte_moves() -> None:
    import numpy as np

    pool = bytearray(8192)
    mem = Memory(pool)
    local = bytearray(b"a" * 100)
    good = np.array([[0, 0, 0, 50]], dtype=np.uint64)
    bad = np.array([[0, 0, 100, 50], [0, 60, 200, 50]], dtype=np.uint64)  # row 1 overruns
    with pytest.raises(CoherenceError, match="row 1"):
        mem.gather_write([local], bad)
    assert pool[100:150] == bytes(50)  # row 0 was not executed either
    with pytest.raises(CoherenceError, match="names buffer 3"):
        mem.gather_write([local], np.array([[3, 0, 0, 1]], dtype=np.uint64))
    with pytest.raises(CoherenceError, match="outside the 8192-byte"):
        mem.scatter_read([local], np.array([[0, 0, 8190, 10]], dtype=np.uint64))
    with pytest.raises(CoherenceError, match="rows of 4"):
        mem.gather_write([local], np.zeros(3, dtype=np.uint64))
    assert mem.gather_write([local], good) == 50
    assert pool[:50] == b"a" * 50
    mem.release()


@pytest.mark.parametrize("flush", ["clflushopt", "clflush"])
def test_the_native_table_flushes_plain_stores_and_never_invalidates_with_clwb(flush: str) -> None:
    """memops_selfcheck watches every flush while it runs each non-temporal copy this CPU
    can do into unaligned destinations, and an invalidate: the model replaces this table,
    so only this check sees a copy whose unaligned head or tail stays in the cache, or an
    invalidate that keeps a stale line (CLWB)."""
    code = (
        "from beluga._native import _core;"
        "print(_core.selected()['invalidate']); print(_core.memops_selfcheck())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "BELUGA_FLUSH": flush},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    invalidate, problems = out.stdout.split("\n")[:2]
    assert invalidate in ("clflushopt", "clflush") and invalidate != "clwb"
    if _core.cpu_features()["clflushopt"]:
        assert invalidate == flush  # the chicken bit picks it, and invalidate follows the flush
    assert problems == "[]"
    assert _core.memops_selfcheck() == [] and _core.selected()["invalidate"] != "clwb"


# -- the shape of the C core: plain C below, bindings on top, calls one way --------

NATIVE = Path(__file__).resolve().parent.parent / "beluga" / "_native"
CORE = sorted(p for p in NATIVE.glob("*.c") if not p.name.endswith("_py.c"))
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (it builds the core)")


@needs_gcc
def test_the_core_compiles_without_python() -> None:
    """No core file reaches Python.h, not even through a header (only *_py.c files may)."""
    assert {p.stem for p in CORE} >= {
        "crc32c", "blake3", "sg", "block", "blockio", "index", "mirror", "rpc", "memops",
        "model", "sabotage",
    }  # fmt: skip
    for src in CORE:
        deps = subprocess.run(
            ["gcc", "-M", "-MG", str(src)], capture_output=True, text=True, check=True
        ).stdout
        assert "Python.h" not in deps and "beluga_py.h" not in deps, src.name
        subprocess.run(["gcc", "-fsyntax-only", "-std=gnu11", str(src)], check=True)


def _calls(tmp_path: Path) -> set[tuple[str, str]]:
    """(caller file, callee file) for every symbol one C file uses that another defines."""
    include = sysconfig.get_paths()["include"]
    defined: dict[str, str] = {}
    used: dict[str, set[str]] = {}
    for src in NATIVE.glob("*.c"):
        obj = tmp_path / f"{src.stem}.o"
        subprocess.run(
            ["gcc", "-c", "-O0", "-std=gnu11", "-fPIC", f"-I{include}", str(src), "-o", str(obj)],
            check=True,
        )
        symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True)
        used[src.stem] = set()
        for line in symbols.stdout.splitlines():
            parts = line.split()
            if parts[0] == "U":
                used[src.stem].add(parts[1])
            elif len(parts) == 3 and parts[1] in "TDRB":
                defined[parts[2]] = src.stem
    return {(f, defined[s]) for f, syms in used.items() for s in syms if defined.get(s, f) != f}


@needs_gcc
def test_no_two_c_files_call_each_other_and_the_core_never_calls_a_binding(tmp_path: Path) -> None:
    calls = _calls(tmp_path)
    assert ("index_py", "index") in calls and ("rpc", "crc32c") in calls  # the graph is seen
    assert sorted((a, b) for a, b in calls if (b, a) in calls and a < b) == []
    core = {p.stem for p in CORE}
    assert sorted((a, b) for a, b in calls if a in core and b not in core) == []


@needs_gcc
def test_a_build_without_native_instructions_refuses_native_mode(tmp_path: Path) -> None:
    """-DBL_PORTABLE builds the core as for an architecture without a native table (x86-64
    is the only one written): native mode must refuse with an error that names model mode,
    never run plain copies that look coherent; model mode works as everywhere."""
    ext = Extension(
        "beluga._native._core",
        sources=[str(p) for p in sorted(NATIVE.glob("*.c"))],
        define_macros=[("BL_PORTABLE", "1")],
        extra_compile_args=["-O0", "-std=gnu11"],
    )
    cmd = Distribution({"ext_modules": [ext]}).get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(tmp_path), str(tmp_path / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    path = cmd.get_ext_fullpath(ext.name)
    code = (
        "import importlib.machinery, importlib.util, sys\n"
        f"name, path = 'beluga._native._core', {path!r}\n"
        "loader = importlib.machinery.ExtensionFileLoader(name, path)\n"
        "core = importlib.util.module_from_spec(\n"
        "    importlib.util.spec_from_file_location(name, path, loader=loader))\n"
        "loader.exec_module(core)\n"
        "sys.modules[name] = core\n"
        "from beluga.coherence import Memory, crc32c, digest\n"
        "from beluga.errors import CoherenceError\n"
        "try:\n"
        "    Memory(bytearray(4096), 'native')\n"
        "    print('native ran')\n"
        "except CoherenceError as e:\n"
        "    print('refused:', e)\n"
        "mem = Memory(bytearray(8192), 'model')\n"
        "mem.publish(0, 64, digest(b'k'), 1, b'value')\n"
        "out = bytearray(5)\n"
        "print(mem.read_validated(0, 64, 4096, digest(b'k'), 1, out), bytes(out))\n"
        "print(sorted(core.selected().items()))\n"
        "print(crc32c(b'123456789') == 0xE3069283, core.memops_selfcheck())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0].startswith("refused: native mode needs") and "mode='model'" in out[0]
    assert out[1] == "5 b'value'"
    none = ("copy", "flush", "invalidate", "nt", "writeback")
    want = {"crc": "sw", "copy_crc": "copy+crc", **dict.fromkeys(none, "none")}
    assert out[2] == str(sorted(want.items()))
    assert out[3] == f"True [{out[0].removeprefix('refused: ')!r}]"  # the selfcheck says why
