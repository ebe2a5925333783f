"""Benchmarks share the tests' fixtures (pools under unique /dev/shm names)."""

from tests.conftest import no_leaks, pool, shm_path  # noqa: F401
