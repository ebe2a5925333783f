"""The KVCache store: hashing, model identity, the client, the metadata service and server."""

from beluga.kv.hashing import (
    block_keys,
    hash_block,
    hash_function,
    prefix_hashes,
    seed_hash,
    sha256,
)
from beluga.kv.identity import KVNamespace, ModelIdentity, resolve_model
from beluga.kv.server import MetadataServer, serve
from beluga.kv.store import MAX_KEY_BYTES, BlockRef, KVStore, Retired, Saved

__all__ = [
    "MAX_KEY_BYTES",
    "BlockRef",
    "KVNamespace",
    "KVStore",
    "MetadataServer",
    "ModelIdentity",
    "Retired",
    "Saved",
    "block_keys",
    "hash_block",
    "hash_function",
    "prefix_hashes",
    "resolve_model",
    "seed_hash",
    "serve",
    "sha256",
]
