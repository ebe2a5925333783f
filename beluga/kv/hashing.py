"""Block keys compatible with vLLM's prefix caching.

A request's tokens are cut into engine blocks of ``block_tokens`` tokens (16
by default, vLLM's block size); block i's hash hashes (hash of block i-1, the
block's token ids, extra keys), the first block chaining from a seed hash
(:func:`prefix_hashes`).  So a request's cached prefix is the longest run of
leading keys that the store holds: one batched lookup.  Only full blocks get
keys.

The hashes name tokens, not the model that computed their KV, so a store key
is a hash inside a :class:`~beluga.kv.identity.KVNamespace` (the model's
identity and the block layout): :func:`block_keys`.  Two models never share a
block, even when their KV caches have the same shape.

The hash functions follow vLLM's: ``sha256`` hashes the pickle of the tuple,
``sha256_cbor`` its canonical CBOR (needs ``cbor2``).  vLLM picks a random
seed unless PYTHONHASHSEED is set; engines that share a pool must share the
seed, so Beluga derives it from PYTHONHASHSEED or, failing that, from a fixed
string, and lets callers pass their own.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from beluga.kv.identity import KVNamespace

HashFn = Callable[[Any], bytes]
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_SEED = "beluga"


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickle of ``obj`` (vLLM's ``sha256``)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR of ``obj`` (vLLM's ``sha256_cbor``); needs cbor2."""
    try:
        import cbor2
    except ImportError as e:
        raise ValueError(
            "hash function sha256_cbor needs the cbor2 package: pip install cbor2"
        ) from e
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor}


def hash_function(name: str) -> HashFn:
    """The hash function called ``name`` (sha256 or sha256_cbor)."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown block hash {name!r}; choose from {sorted(HASH_FUNCTIONS)}"
        ) from None


def seed_hash(hash_fn: HashFn = sha256, seed: str | None = None) -> bytes:
    """The parent hash of a request's first block (vLLM's NONE_HASH with a set seed)."""
    return hash_fn(seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))


def hash_block(
    hash_fn: HashFn,
    parent: bytes,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """The key of one block given its parent's key."""
    return hash_fn((parent, tuple(token_ids), extra_keys))


def prefix_hashes(
    token_ids: Sequence[int],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    hash_fn: HashFn | str = sha256,
    extra_keys: tuple[Any, ...] | None = None,
    seed: str | None = None,
) -> list[bytes]:
    """The chained hashes of every full block of a token sequence (vLLM's block hashes).

    They say nothing about the model: store KV under :func:`block_keys`.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, not {block_tokens}")
    fn = hash_function(hash_fn) if isinstance(hash_fn, str) else hash_fn
    hashes: list[bytes] = []
    parent = seed_hash(fn, seed)
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash_block(fn, parent, token_ids[start : start + block_tokens], extra_keys)
        hashes.append(parent)
    return hashes


def block_keys(
    token_ids: Sequence[int],
    namespace: KVNamespace,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    hash_fn: HashFn | str = sha256,
    extra_keys: tuple[Any, ...] | None = None,
    seed: str | None = None,
) -> list[bytes]:
    """The store keys of every full block of a token sequence, for one model's KV.

    ``namespace`` names the model and the block layout (see
    :mod:`beluga.kv.identity`); the rest is as for :func:`prefix_hashes`.
    """
    if not isinstance(namespace, KVNamespace):
        raise TypeError(
            "block_keys needs the KVNamespace of the model whose KV the blocks hold, e.g. "
            "KVNamespace(ModelIdentity.explicit(name, revision), layout), not "
            f"{type(namespace).__name__}"
        )
    return [
        namespace.key(h) for h in prefix_hashes(token_ids, block_tokens, hash_fn, extra_keys, seed)
    ]
