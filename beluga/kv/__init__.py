"""The KVCache store: hashing, the client, the metadata service and server."""

from beluga.kv.hashing import block_keys, hash_block, hash_function, seed_hash, sha256
from beluga.kv.server import MetadataServer, serve
from beluga.kv.store import MAX_KEY_BYTES, BlockRef, KVStore

__all__ = [
    "MAX_KEY_BYTES",
    "BlockRef",
    "KVStore",
    "MetadataServer",
    "block_keys",
    "hash_block",
    "hash_function",
    "seed_hash",
    "serve",
    "sha256",
]
