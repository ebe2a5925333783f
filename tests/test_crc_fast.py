"""CRC32C by VPCLMULQDQ folding: the same answers as the definition and as the 3-stream path.

The folding path is what this process uses where the CPU has AVX-512 and
VPCLMULQDQ; elsewhere these tests still pass and check the 3-stream path.
The old path is forced in a subprocess with the chicken bit BELUGA_CRC=hw.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from beluga._native import _core

MAX_LEN = 70000
SEED = 20240611
BUFFER = random.Random(SEED).randbytes(MAX_LEN + 64)


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


TABLE = _table()


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC32C a byte at a time through a table built from the polynomial."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _crc_in_subprocess(
    env: dict[str, str], cases: list[tuple[int, int, int]]
) -> tuple[str, list[int]]:
    """The chosen CRC path and the CRC of every (length, offset, crc) case, in a fresh process."""
    code = (
        "import json, random, sys\n"
        "from beluga._native import _core\n"
        "n, seed, cases = json.load(sys.stdin)\n"
        "buf = memoryview(random.Random(seed).randbytes(n))\n"
        "out = [_core.crc32c(buf[o:o + k], c) for k, o, c in cases]\n"
        "print(json.dumps([_core.selected()['crc'], out]))\n"
    )
    size = max(k + o for k, o, _ in cases)
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([size, SEED, cases]),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    selected, crcs = json.loads(done.stdout)
    return selected, crcs


@settings(max_examples=200, deadline=None)
@given(st.integers(0, MAX_LEN), st.integers(0, 63), st.integers(0, 0xFFFFFFFF))
@example(255, 1, 0xFFFFFFFF)
@example(256, 63, 0x12345678)
@example(MAX_LEN, 63, 0xFFFFFFFF)
def test_any_length_offset_and_seed_matches_reference(n: int, offset: int, crc: int) -> None:
    data = BUFFER[offset : offset + n]
    assert _core.crc32c(memoryview(BUFFER)[offset : offset + n], crc) == crc32c_reference(data, crc)


@given(st.integers(0, MAX_LEN), st.integers(0, MAX_LEN), st.integers(0, 63))
def test_split_anywhere_chains(n: int, cut: int, offset: int) -> None:
    view = memoryview(BUFFER)[offset : offset + n]
    cut = min(cut, n)
    assert _core.crc32c(view[cut:], _core.crc32c(view[:cut])) == _core.crc32c(view)


def test_folding_path_equals_forced_three_stream_path() -> None:
    rng = random.Random(SEED)
    lengths = list(range(0, 1100))
    lengths += [m + d for m in range(256, 8192, 64) for d in (-1, 0, 1)]
    lengths += [rng.randrange(MAX_LEN) for _ in range(400)]
    lengths += [3 << 20, (5 << 20) + 13]
    cases = [(k, rng.randrange(64), rng.getrandbits(32)) for k in lengths]
    selected, mine = _crc_in_subprocess({}, cases)
    forced, old = _crc_in_subprocess({"BELUGA_CRC": "hw"}, cases)
    assert forced in ("hw", "sw")
    if selected == forced:
        pytest.skip(f"this CPU has no faster CRC path than {forced!r}; nothing to compare")
    wrong = [(case, hex(a), hex(b)) for case, a, b in zip(cases, mine, old, strict=True) if a != b]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[:3]}"


@pytest.mark.parametrize(
    ("value", "allowed"),
    [("vpclmulqdq", {"vpclmulqdq", "hw", "sw"}), ("hw", {"hw", "sw"}), ("sw", {"sw"})],
)
def test_chicken_bit_values(value: str, allowed: set[str]) -> None:
    selected, (check,) = _crc_in_subprocess({"BELUGA_CRC": value}, [(300, 0, 0)])
    assert selected in allowed
    assert check == crc32c_reference(random.Random(SEED).randbytes(300))


def test_folding_is_chosen_where_the_cpu_has_it() -> None:
    flags = _cpu_flags()
    if not {"avx512f", "vpclmulqdq", "sse4_2"} <= flags:
        pytest.skip("CPU lacks AVX-512 F or VPCLMULQDQ")
    assert _core.selected()["crc"] == "vpclmulqdq"
