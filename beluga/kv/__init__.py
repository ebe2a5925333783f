"""The KVCache store's client: hashing, model identity, the store and its tier.

The metadata server it talks to is :mod:`beluga.server`.
"""

from beluga.kv.hashing import (
    block_keys,
    hash_block,
    hash_function,
    prefix_hashes,
    seed_hash,
    sha256,
)
from beluga.kv.identity import KVNamespace, ModelIdentity, resolve_model
from beluga.kv.store import MAX_KEY_BYTES, BlockRef, KVStore, Retired, Saved

__all__ = [
    "MAX_KEY_BYTES",
    "BlockRef",
    "KVNamespace",
    "KVStore",
    "ModelIdentity",
    "Retired",
    "Saved",
    "block_keys",
    "hash_block",
    "hash_function",
    "prefix_hashes",
    "resolve_model",
    "seed_hash",
    "sha256",
]
