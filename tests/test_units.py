"""Sizes read and written in binary units (beluga.units)."""

from __future__ import annotations

import pytest

from beluga.units import human_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64", 64),
        ("16K", 16 * 1024),
        ("16k", 16 * 1024),
        (" 2M ", 2 * 1024 * 1024),
        ("2MiB", 2 * 1024 * 1024),
        ("2MB", 2 * 1024 * 1024),
        ("1G", 1024**3),
        ("3T", 3 * 1024**4),
        ("512B", 512),
    ],
)
def test_sizes_parse_in_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "1.5M", "2X", "two"])
def test_what_is_not_a_size_is_refused_with_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a size: .* \(use e\.g\. 64, 16K, 2M, 1G\)"):
        parse_size(text)


@pytest.mark.parametrize("text", ["0", "0K", "-4K"])
def test_a_size_must_be_positive(text: str) -> None:
    with pytest.raises(ValueError, match="a size must be positive"):
        parse_size(text)


@pytest.mark.parametrize(
    ("size", "text"),
    [(2 * 1024 * 1024, "2MiB"), (64 * 1024, "64KiB"), (1536, "1536B"), (3 << 30, "3072MiB")],
)
def test_sizes_print_in_their_largest_exact_unit(size: int, text: str) -> None:
    assert human_bytes(size) == text
