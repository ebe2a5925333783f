"""KV events: the blocks this engine saved into the pool, and those it found gone.

vLLM publishes what each engine caches (``--kv-events-config``) so that a
router can send a request where its prefix is; a connector adds its tier's
events through ``take_events``.  BelugaConnector's, folded by
:class:`PoolEvents` on the scheduler side:

``BlockStored``
    this engine's save of a block ended with every shard of it in the pool
    (committed by the save, or found committed by another engine that saved
    it first): each worker reports the blocks its saves left in the pool
    (:class:`SavedBlocks`, through vLLM's ``KVConnectorOutput``), and the
    scheduler announces a block once every saving rank has, with the
    payload it took when it queued the save (token ids, parent hash, group).
``BlockRemoved``
    a block it announced is gone: the server took one of its shards out of
    the index (evicted it, or someone removed it, or a reader dropped it as
    corrupt), or this engine's own lookup or load found it gone.
``AllBlocksCleared``
    ``reset_cache``: this engine loads none of the blocks it announced any more.

Medium ``"CPU"``: host memory, which is what the pool is to every host that
maps it (the cache-hit source is ``HOST`` for the same reason).

Where removals come from.  Eviction is the server's, and its counters name
no key, so the server keeps the digests of the last keys that left its
index, numbered (``KVStore.retired``, the RETIRED op: a ring in the
server's memory, 16 bytes a key).  The scheduler asks for those since its
cursor at each ``take_events`` (one RPC, answered from memory) and maps
them to the blocks it announced by the digests of their shards' keys.
Why the server's memory and not a ring in the pool: the server is the one
writer of the index and the only one who knows what it evicts, engines
already talk to it each step, and a ring in the pool would change the
pool's format for a hint that routers use only to route better.  Why not
probing the index: every lookup records a hit in the reader's hint lines,
which is what the server's LRU evicts by, so probing would keep every
announced block alive.  What that misses: removals while this engine's
cursor is stale (the server restarted, or more than ``RETIRED_KEEP`` keys
left between two steps) are not reported, except those its own lookups and
loads find; blocks beyond the newest :data:`TRACKED` announced are
forgotten without an event; a queued save not reported within
:data:`PENDING_S` is never announced.

Not thread-safe: the scheduler calls it from the engine core's thread.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: announced blocks whose removal is watched for (the newest; older ones are forgotten)
TRACKED = 65536
#: seconds a block queued for saving waits for its ranks' reports before it is given up
PENDING_S = 30.0

Block = tuple[bytes, int]  # (vLLM block hash, KV cache group)


class SavedBlocks(KVConnectorKVEvents):
    """The blocks a worker's saves left in the pool, on their way to the scheduler.

    One ``BlockStored`` per block and group that names only its hash and
    group (the scheduler has the rest); vLLM adds the workers' up (one list,
    ``increment_workers``) before the scheduler's ``update_connector_output``
    reads them.  Not thread-safe (built once, read once).
    """

    def __init__(self, blocks: Iterable[Block] = (), block_size: int = 0) -> None:
        self._events: list[KVCacheEvent] = [
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=None,
                token_ids=[],
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
                group_idx=group,
            )
            for block_hash, group in blocks
        ]
        self._workers = 1

    @staticmethod
    def blocks(events: KVConnectorKVEvents) -> list[Block]:
        """The (hash, group) of each report in ``events`` (every worker's)."""
        return [
            (bytes(e.block_hashes[0]), e.group_idx or 0)
            for e in events.get_all_events()
            if isinstance(e, BlockStored)
        ]

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events += events

    def aggregate(self) -> SavedBlocks:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


@dataclass
class _Queued:
    """A block queued for saving: its stored event, and since when."""

    event: BlockStored
    since: float


class PoolEvents:
    """The scheduler's KV events (module doc); inert unless ``enabled``.  Not thread-safe.

    ``ranks``: how many workers save each block (the TP size; 1 for MLA, whose
    rank 0 alone saves); ``digests``: the digests of a block's pool keys, one
    per shard, by which the server's retirements are matched.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        block_size: int,
        ranks: int,
        enabled: bool,
        digests: Callable[[Block], list[bytes]] | None = None,
    ) -> None:
        self.enabled = enabled
        self._digests_of = digests
        self.block_size = block_size
        self.ranks = ranks
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self._kinds = [
            (get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs
        ]
        self._queued: dict[Block, _Queued] = {}
        self._reports: Counter[Block] = Counter()
        self._announced: OrderedDict[Block, list[bytes]] = OrderedDict()
        self._watched: dict[bytes, Block] = {}  # a shard's key digest: its announced block
        self._events: list[KVCacheEvent] = []

    @property
    def watching(self) -> bool:
        """Whether any announced block may yet be removed."""
        return bool(self._announced)

    def queued(self, request: Request, group: int, block: int, hashes: list[bytes]) -> None:
        """Engine block ``block`` of ``request`` in group ``group`` was queued for saving
        (``hashes``: the request's block hashes, one per engine block)."""
        name = (bytes(hashes[block]), group)
        if not self.enabled or name in self._announced or name in self._queued:
            return
        size, lora = self.block_size, request.lora_request
        kind, window = self._kinds[group]
        parent = maybe_convert_block_hash(bytes(hashes[block - 1])) if block else None
        event = BlockStored(
            block_hashes=[maybe_convert_block_hash(name[0])],
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[block * size : (block + 1) * size]),
            block_size=size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            session_id=getattr(request, "session_id", None),
        )
        self._queued[name] = _Queued(event, time.monotonic())

    def saved(self, blocks: Iterable[Block]) -> None:
        """Workers report blocks their saves left in the pool: a block every rank reported
        is announced."""
        for name in blocks:
            if name not in self._queued:
                continue
            self._reports[name] += 1
            if self._reports[name] >= self.ranks:
                del self._reports[name]
                self._events.append(self._queued.pop(name).event)
                digests = self._digests_of(name) if self._digests_of else []
                self._announced[name] = digests
                self._watched.update(dict.fromkeys(digests, name))
                if len(self._announced) > TRACKED:
                    self._forget(self._announced.popitem(last=False)[1])

    def _forget(self, digests: list[bytes]) -> None:
        for d in digests:
            self._watched.pop(d, None)

    def missing(self, blocks: Iterable[Block]) -> None:
        """This engine found these blocks gone from the pool (a lookup or a load)."""
        for name in blocks:
            if name in self._announced:
                self._forget(self._announced.pop(name))
                self._events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(name[0])],
                        medium=MEDIUM_CPU,
                        group_idx=name[1],
                    )
                )

    def retired(self, digests: Iterable[bytes]) -> None:
        """The server took these keys out of the pool: their announced blocks are gone."""
        self.missing([self._watched[d] for d in digests if d in self._watched])

    def reset(self) -> None:
        """The connector's cache was reset: nothing announced is loaded any more."""
        if self.enabled:
            self._queued.clear()
            self._reports.clear()
            self._announced.clear()
            self._watched.clear()
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call; queued saves never reported in time are dropped."""
        now = time.monotonic()
        for name in [n for n, q in self._queued.items() if now - q.since > PENDING_S]:
            del self._queued[name]
            self._reports.pop(name, None)
        events, self._events = self._events, []
        return events
