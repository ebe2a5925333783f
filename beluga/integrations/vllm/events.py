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
    a block it announced is gone: its own lookup missed it (the server
    evicted it, someone removed or replaced it), or its load of it failed
    (evicted or replaced meanwhile, or corrupt, which the reader drops).
``AllBlocksCleared``
    ``reset_cache``: this engine loads none of the blocks it announced any more.

Medium ``"CPU"``: host memory, which is what the pool is to every host that
maps it (the cache-hit source is ``HOST`` for the same reason).

Why from this engine's own saves and lookups, and not from the server's
counters or an event ring.  Eviction is the server's: its counters count
evictions but name no key, so nothing can be folded from them.  An event
ring in the pool (the server, the index's only writer, appending each commit
and each removal as a sealed record that any host folds with loads) would
be the exact source: every engine's blocks, every eviction as it happens.
It is a change to the server and the pool's format, which this package does
not own.  Looking for announced blocks in the pool index would find
evictions without the server, but every lookup records a hit in the
reader's hint lines, which is what the server's LRU evicts by: probing would
keep every announced block alive and count probes as hits.  So this engine
reports what it knows: what its saves left in the pool, and, at the lookups
and loads it makes anyway, what is no longer there.  What that misses: an
eviction is reported only when this engine next looks the block up (or
never), blocks beyond the newest :data:`TRACKED` announced are forgotten
without an event, and a queued save not reported within :data:`PENDING_S`
is never announced.  With the ring, ``BlockRemoved`` would come for every
eviction of an announced block, at the step after it.

Not thread-safe: the scheduler calls it from the engine core's thread.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
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
    rank 0 alone saves).
    """

    def __init__(
        self, kv_cache_config: KVCacheConfig, block_size: int, ranks: int, enabled: bool
    ) -> None:
        self.enabled = enabled
        self.block_size = block_size
        self.ranks = ranks
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self._kinds = [
            (get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs
        ]
        self._queued: dict[Block, _Queued] = {}
        self._reports: Counter[Block] = Counter()
        self._announced: OrderedDict[Block, None] = OrderedDict()
        self._events: list[KVCacheEvent] = []

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
                self._announced[name] = None
                if len(self._announced) > TRACKED:
                    self._announced.popitem(last=False)

    def missing(self, blocks: Iterable[Block]) -> None:
        """This engine found these blocks gone from the pool (a lookup or a load)."""
        for name in blocks:
            if name in self._announced:
                del self._announced[name]
                self._events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(name[0])],
                        medium=MEDIUM_CPU,
                        group_idx=name[1],
                    )
                )

    def reset(self) -> None:
        """The connector's cache was reset: nothing announced is loaded any more."""
        if self.enabled:
            self._queued.clear()
            self._reports.clear()
            self._announced.clear()
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call; queued saves never reported in time are dropped."""
        now = time.monotonic()
        for name in [n for n, q in self._queued.items() if now - q.since > PENDING_S]:
            del self._queued[name]
            self._reports.pop(name, None)
        events, self._events = self._events, []
        return events
