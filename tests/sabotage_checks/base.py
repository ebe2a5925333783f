"""What every check shares: the Violation it raises, the model, model hosts and pool files."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from beluga import litmus
from beluga.coherence import Memory, ModelConfig, attach, digest
from beluga.pool import Geometry, Pool


class Violation(AssertionError):
    """A check saw a promise of the protocol broken."""


#: the model a mutation run uses: no random eviction, so a stale line stays stale
MUTATION_MODEL = ModelConfig(evict_rate=0.0)
SEEDS = range(8)
KEY = digest(b"sabotage check")
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)


def _host(shared: object, model: ModelConfig, seed: int, **knobs: float) -> Memory:
    """One more model host over a shared buffer."""
    return attach(shared, "model", replace(model, seed=seed, **knobs))


def _still(model: ModelConfig) -> ModelConfig:
    """The model with nothing drained early: a store is in memory only once fenced."""
    return replace(model, drain_rate=0.0)


def _window_seen(r: litmus.LitmusResult) -> None:
    """A sweep must have seen states before and after the write: else it proved nothing."""
    if not r.confirmed or r.trials == r.confirmed:
        raise RuntimeError(f"the {r.pattern} sweep never crossed its write ({r})")


@contextmanager
def _pool_file(model: ModelConfig) -> Iterator[Callable[..., Pool]]:
    """A pool file and a way to attach more model hosts to it (each closed at the end)."""
    pools: list[Pool] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="beluga-check-") as d:
        path = os.path.join(d, "pool")

        def host(seed: int, **knobs: float) -> Pool:
            cfg = replace(model, seed=seed, **knobs)
            if not pools:
                pool = Pool.create(path, 12 << 20, geometry=GEOMETRY, coherence="model", model=cfg)
            else:
                pool = Pool.attach(path, coherence="model", model=cfg)
            pools.append(pool)
            return pool

        try:
            yield host
        finally:
            for pool in pools:
                pool.close()
