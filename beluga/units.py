"""Sizes in bytes: binary units, reading ``16K`` / ``2M`` and writing ``64KiB``.

Below every other layer (beside :mod:`beluga.errors`): the pool, the CLI, the
chaos harness and the benchmarks all take and print sizes the same way.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_SUFFIXES = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}


def parse_size(text: str) -> int:
    """'64', '16K', '2M', '1G', '1GiB' (binary units) → bytes.

    Raises:
        ValueError: not a size, or not positive (the message shows the form).
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _SUFFIXES.get(t[-1:], 1)
    try:
        value = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 64, 16K, 2M, 1G)") from None
    if value <= 0:
        raise ValueError(f"a size must be positive, not {text!r}")
    return value


def human_bytes(n: int) -> str:
    """A size as its largest exact binary unit: 2097152 → '2MiB', 1536 → '1536B'."""
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
