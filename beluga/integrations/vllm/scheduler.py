"""The connector's scheduler side (the engine core): lookups, and each step's metadata.

``get_num_new_matched_tokens`` looks the request's next blocks up in the pool
index (per group and shard, no RPC); ``update_state_after_alloc`` pairs those
pool blocks with the engine blocks vLLM allocated; ``build_connector_meta``
hands the worker each step's loads and the blocks the step completes, to
save; ``request_finished`` forgets the request, and a ``kv_producer`` tells
the decode engine how many blocks to expect.  The role
(:mod:`beluga.integrations.vllm.options`) decides, here and only here, what a
scheduler loads and saves.

Hits, per KV cache group (:class:`~beluga.integrations.vllm.shapes.KVGroup`):
a full-attention (or MLA) group needs every block of the prefix, so its hit is
the longest run of leading blocks the pool has; a sliding-window group needs
only the blocks the next token attends to, which are the engine blocks vLLM
does not make its null block (:meth:`KVGroup.first_kept`).  The request's hit
is the longest prefix that every group can serve, and a group loads only the
blocks it keeps.

Two requests that hit blocks still being loaded asynchronously for a third
do not load them again: their lookup answers "not yet" (``None``, which vLLM
asks again at the next step) until that request runs, when vLLM's own prefix
cache holds the blocks and serves them.

``reset_cache`` (``reset_prefix_cache(reset_connector=True)``) moves this
engine to a new epoch, which the key namespaces name (see
:meth:`EngineKV.at_epoch`), so no block saved before is found again.  Why an
epoch and not removals: the blocks are other engines' too (an engine that did
not reset may still use them), the pool has no removal by namespace (one
RPC per key, racing every engine that saves them), and what the reset is for
(new weights, after an RLHF weight sync, say) makes the old blocks wrong for
this engine only.  Why a count and not a nonce: engines that reset together
(every engine of a job, after each weight sync) meet in the same epoch and
share their new blocks again; engines that reset a different number of
times never share, so reset every engine that loads new weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from beluga.coherence import digest
from beluga.integrations._link import StoreLink, log
from beluga.integrations.vllm.events import Block, PoolEvents, SavedBlocks
from beluga.integrations.vllm.metrics import BelugaConnectorStats, Tally
from beluga.integrations.vllm.options import Options
from beluga.integrations.vllm.shapes import EngineKV, KVGroup
from beluga.kv import BlockRef, KVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: the key of a producer's ``kv_transfer_params`` that says how many blocks it saved
EXPECTED_BLOCKS = "beluga_blocks"
#: pool blocks that failed to load, remembered so they are not offered again (the newest)
BAD_REFS = 4096


@dataclass
class LoadSpec:
    """Read these pool blocks into these engine blocks (one request, one KV cache group).

    ``refs[shard]``: the pool blocks of that shard (see :meth:`EngineKV.shard`);
    None: not found, a load error.
    """

    req_id: str
    engine_blocks: list[int]
    refs: list[list[BlockRef | None]]
    asynchronous: bool = False  # off the engine step (the request waits for get_finished)
    group: int = 0


@dataclass
class SaveSpec:
    """Save these engine blocks of one KV cache group, whose vLLM block hashes these are
    (blocks the step completes).

    Each worker saves its own shard, under its shard's key of the hash (of MLA's
    one shard, rank 0 alone).
    ``req_ids``: the requests whose blocks these are, which an asynchronous
    save holds until it is done.
    """

    engine_blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    req_ids: set[str] = field(default_factory=set)
    group: int = 0


@dataclass
class BelugaMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one step.

    ``reused``: engine blocks this step hands to requests (new blocks of running
    requests, a new or resumed request's blocks past its local hit): before the
    step writes them the worker ends the saves in flight that read any of them
    (a preempted request's blocks, a sliding-window block vLLM freed as the
    window moved).  ``epoch``: the connector's, which the keys name.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)  # one per group with blocks to save
    reused: set[int] = field(default_factory=set)
    epoch: int = 0


@dataclass
class _Tracked:
    """A scheduled request: its engine blocks (by group) and how many leading blocks the
    pool has."""

    request: Request
    block_ids: list[list[int]]
    saved: int  # leading blocks that are in the pool (or were computed before it was asked)
    local: int  # leading blocks vLLM's own prefix cache gave it


@dataclass
class _Hit:
    """What a lookup found for a request, until vLLM allocates its blocks."""

    first: int  # the first block looked up (those before it vLLM had computed)
    refs: list[list[list[BlockRef | None]]]  # by group, by shard, by block from ``first``
    load_async: bool
    expected: int | None  # blocks its producer said it saved (kv_transfer_params), if told


class BelugaScheduler:
    """The connector's scheduler side (the engine core): lookups and each step's metadata.

    Not thread-safe: vLLM calls it from the engine core's thread; its
    request state is unguarded.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        kv: EngineKV,
        link: StoreLink,
        options: Options,
    ) -> None:
        self.kv = kv
        self.block_tokens = kv.block_tokens
        self.link = link
        self.options = options
        self.null_block: int | None = None  # vLLM's null block id, once its block pool is bound
        self._saving: set[str] = set()  # requests with an asynchronous save queued
        self._tally = Tally()
        self._hits: dict[str, _Hit] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadSpec] = []
        # req: engine block: (its (hash, group), its refs by shard)
        self._loading: dict[str, dict[int, tuple[Block, tuple[BlockRef | None, ...]]]] = {}
        self._async_loading: dict[str, set[bytes]] = {}  # req: hashes its load thread reads
        self._bad: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # (digest, version)
        events = vllm_config.kv_events_config
        self.events = PoolEvents(
            kv_cache_config,
            kv.block_tokens,
            ranks=sum(kv.saves(rank) for rank in range(kv.tp_size)),
            enabled=events is not None and bool(events.enable_kv_cache_events),
            digests=lambda name: [
                digest(self.kv.key(name[0], shard, name[1])) for shard in range(self.kv.shards)
            ],
        )
        #: where this engine's reading of the server's retirements stands (KV events)
        self._retired: tuple[int, int] | None = None
        if not vllm_config.cache_config.enable_prefix_caching:
            log.warning(
                "BelugaConnector keys blocks by vLLM's prefix-cache hashes, which vLLM "
                "computes only with enable_prefix_caching=True: the pool stays unused"
            )
        self.link.available()  # connect now, so a missing pool is reported at engine start
        if self.events.enabled:
            self._follow_retirements()  # from now: what leaves after a save is seen

    def get_stats(self) -> BelugaConnectorStats | None:
        return self._tally.take()

    def _block_hashes(self, request: Request) -> list[bytes]:
        """vLLM's hashes of the request's full engine blocks."""
        hashes = request.block_hashes
        ratio = self.kv.hash_ratio
        return list(hashes[ratio - 1 :: ratio]) if ratio > 1 else list(hashes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the pool can supply beyond ``num_computed_tokens``, and whether they load
        asynchronously; None while another request loads some of them asynchronously.

        Every full block may load; at least the request's last token is left to
        compute (its logits pick the next token), so when every token is in full
        blocks the last block is loaded whole and its last token computed again.
        """
        self._hits.pop(request.request_id, None)
        if not self.options.loads:
            return 0, False
        first = num_computed_tokens // self.block_tokens
        hashes = self._block_hashes(request)[first : request.num_tokens // self.block_tokens]
        if not hashes or num_computed_tokens >= request.num_tokens - 1:
            return 0, False
        found = self.link.call(
            lambda s: self._locate(s, hashes),
            None,
            on_outage=lambda _: self._tally.add(pool_errors=1),
        )
        if found is None:
            return 0, False
        hits = self._hit(found, num_computed_tokens, request.num_tokens)
        others = (h for r, h in self._async_loading.items() if r != request.request_id)
        loading = set().union(*others)
        if loading and not loading.isdisjoint(hashes[:hits]):
            self._tally.add(deferred_lookups=1)
            return None, False  # ask again once that load is done and vLLM caches the blocks
        self._tally.add(lookups=1, hit_blocks=hits, miss_blocks=len(hashes) - hits)
        tokens = min(hits * self.block_tokens, request.num_tokens - 1 - num_computed_tokens)
        kept = [g.first_kept(num_computed_tokens + tokens) - first for g in self.kv.groups]
        nbytes = sum(
            max(0, hits - max(0, k)) * g.format.nbytes
            for g, k in zip(self.kv.groups, kept, strict=True)
        )
        load_async = (
            hits > 0
            and self.options.async_min_bytes is not None
            and nbytes >= self.options.async_min_bytes
        )
        params = request.kv_transfer_params or {}
        expected = params.get(EXPECTED_BLOCKS) if self.options.role == "kv_consumer" else None
        self._hits[request.request_id] = _Hit(first, found, load_async, expected)
        return tokens, load_async and tokens > 0

    def _usable(self, ref: BlockRef | None, group: KVGroup) -> BlockRef | None:
        """``ref``, unless it failed a load before or is not a value of this group's size."""
        if ref is None or (ref.digest, ref.version) in self._bad:
            return None
        return ref if ref.length == group.format.nbytes else None

    def _locate(self, store: KVStore, hashes: list[bytes]) -> list[list[list[BlockRef | None]]]:
        """Each group's and shard's pool blocks of ``hashes`` (None where missing): of a
        full-attention group the leading run (one prefix lookup), of a sliding-window
        group every block (one lookup: it may need any window of them)."""
        found = []
        for group in self.kv.groups:
            by_shard = []
            for shard in range(self.kv.shards):
                keys = [self.kv.key(h, shard, group.index) for h in hashes]
                refs = store.locate(keys, prefix=group.window is None)
                refs = [self._usable(r, group) for r in refs]
                by_shard.append(refs + [None] * (len(hashes) - len(refs)))
            found.append(by_shard)
            missed = [i for i in range(len(hashes)) if any(s[i] is None for s in by_shard)]
            if group.window is None:
                missed = missed[:1]  # a prefix lookup looked no further
            self.events.missing((bytes(hashes[i]), group.index) for i in missed)
        return found

    def _hit(self, found: list[list[list[BlockRef | None]]], computed: int, total: int) -> int:
        """How many blocks from the first one looked up every group can serve."""
        there = [[all(s[i] is not None for s in by_shard) for i in range(len(by_shard[0]))]
                 for by_shard in found]  # fmt: skip
        first = computed // self.block_tokens
        hits = len(there[0])
        for group, present in zip(self.kv.groups, there, strict=True):
            if group.window is None:
                hits = min(hits, next((i for i, p in enumerate(present) if not p), hits))
        while hits > 0:
            tokens = min(hits * self.block_tokens, total - 1 - computed)
            if all(
                all(present[max(0, group.first_kept(computed + tokens) - first) : hits])
                for group, present in zip(self.kv.groups, there, strict=True)
            ):
                break
            hits -= 1
        return hits

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, None) or _Hit(0, [], False, None)
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        count = -(-num_external_tokens // self.block_tokens)  # a last block loads whole
        if count:
            hashes = self._block_hashes(request)
            by_block: dict[int, tuple[Block, tuple[BlockRef | None, ...]]] = {}
            for group in self.kv.groups:
                engine: list[int] = []
                shards: list[list[BlockRef | None]] = [[] for _ in range(self.kv.shards)]
                for i, block in enumerate(block_ids[group.index][hit.first : hit.first + count]):
                    if block == self.null_block:  # outside the window: vLLM keeps nothing
                        continue
                    refs = tuple(by_shard[i] for by_shard in hit.refs[group.index])
                    engine.append(block)
                    for shard, ref in enumerate(refs):
                        shards[shard].append(ref)
                    by_block[block] = ((bytes(hashes[hit.first + i]), group.index), refs)
                if engine:
                    self._pending_loads.append(
                        LoadSpec(request.request_id, engine, shards, hit.load_async, group.index)
                    )
            self._loading[request.request_id] = by_block
            if hit.load_async:
                self._async_loading[request.request_id] = {
                    bytes(h) for h in hashes[hit.first : hit.first + count]
                }
        if isinstance(hit.expected, int) and not isinstance(hit.expected, bool):
            found = hit.first + count
            self._tally.add(
                expected_blocks=hit.expected, missing_blocks=max(0, hit.expected - found)
            )
        computed = request.num_computed_tokens // self.block_tokens
        self._tracked[request.request_id] = _Tracked(
            request, block_ids, max(hit.first + count, computed), hit.first
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which loaded blocks failed (``invalid_block_ids``, vLLM >= 0.33), and which
        blocks the workers' saves left in the pool (``kv_cache_events``, for KV events).

        vLLM recomputes a request from its first failed block on: those blocks
        are saved again once computed, and the pool blocks that failed are not
        offered again by this scheduler (the reader also dropped a corrupt one
        from the pool), so a request that meets only bad blocks finishes
        through recompute instead of loading them over and over.
        """
        if isinstance(output.kv_cache_events, SavedBlocks):
            self.events.saved(SavedBlocks.blocks(output.kv_cache_events))
        invalid = output.invalid_block_ids
        if not invalid:
            return
        for by_block in self._loading.values():
            for block in invalid & by_block.keys():
                name, refs = by_block[block]
                self.events.missing([name])
                for ref in refs:
                    if ref is not None:
                        self._bad[ref.digest, ref.version] = None
        for tracked in self._tracked.values():
            failed = [i for ids in tracked.block_ids for i, b in enumerate(ids) if b in invalid]
            if failed:
                tracked.saved = min(tracked.saved, min(failed))
        while len(self._bad) > BAD_REFS:
            self._bad.popitem(last=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BelugaMetadata:
        meta = BelugaMetadata(loads=self._pending_loads, epoch=self.kv.epoch)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._async_loading.pop(new.req_id, None)  # its blocks are in vLLM's cache now
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
                self._reuse(meta, [ids[tracked.local :] for ids in tracked.block_ids])
                self._collect_saves(tracked, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = [list(ids) for ids in new_ids]
                    self._reuse(meta, [ids[tracked.local :] for ids in tracked.block_ids])
                else:
                    for ids, more in zip(tracked.block_ids, new_ids, strict=True):
                        ids += more
                    self._reuse(meta, new_ids)
            self._collect_saves(tracked, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _reuse(self, meta: BelugaMetadata, block_ids: Any) -> None:
        """Note engine blocks the step hands out (only asynchronous saves can be reading them)."""
        if self.options.save_async:
            meta.reused.update(b for ids in block_ids for b in ids if b != self.null_block)

    def _collect_saves(self, tracked: _Tracked, computed_after: int, meta: BelugaMetadata) -> None:
        """Queue the blocks whose KV is complete once this step's forward has run."""
        if not self.options.saves:
            return
        hashed = len(tracked.request.block_hashes) // self.kv.hash_ratio
        done = min(computed_after // self.block_tokens, hashed, *map(len, tracked.block_ids))
        if done <= tracked.saved or not self.link.available():
            return  # the common decode step: no block completed
        hashes = self._block_hashes(tracked.request)
        by_group = {s.group: s for s in meta.saves}
        for group in self.kv.groups:
            save = by_group.get(group.index) or SaveSpec(group=group.index)
            seen = set(save.hashes)
            for i in range(tracked.saved, done):
                block, block_hash = tracked.block_ids[group.index][i], bytes(hashes[i])
                # two requests of one step can complete the same block; a null one is not kept
                if block_hash in seen or block == self.null_block:
                    continue
                seen.add(block_hash)
                save.hashes.append(block_hash)
                save.engine_blocks.append(block)
                save.req_ids.add(tracked.request.request_id)
                self.events.queued(tracked.request, group.index, i, hashes)
            if save.hashes and group.index not in by_group:
                by_group[group.index] = save
                meta.saves.append(save)
        req_id = tracked.request.request_id
        if self.options.save_async and any(req_id in s.req_ids for s in meta.saves):
            self._saving.add(req_id)
        tracked.saved = done

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; hold its blocks while an asynchronous save of them runs.

        ``block_ids``: vLLM's (of one group, or of every group with the hybrid
        manager); unused, as the request's blocks are known since their allocation.
        A ``kv_producer`` saved the request's blocks inside the steps that
        computed them, so they are committed now; its answer tells the
        decode engine how many to expect (``kv_transfer_params``).
        """
        self._hits.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._async_loading.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        params = None
        if self.options.role == "kv_producer":
            prompt_blocks = request.num_prompt_tokens // self.block_tokens
            saved = 0 if tracked is None else min(tracked.saved, prompt_blocks)
            params = {EXPECTED_BLOCKS: saved}
        # the worker reports every request it saved for once it is finished and saved
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, params
        return False, params

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (see :mod:`beluga.integrations.vllm.events`)."""
        if self.events.enabled and (self.events.watching or self._retired is None):
            self._follow_retirements()
        return self.events.take()

    def _follow_retirements(self) -> None:
        """Read the keys the server took out since the last call (one RPC; none while the
        server is away, whose retirements are then read at the next call, or lost to a
        restart: a gap, logged)."""
        got = self.link.call(lambda s: s.retired(self._retired), None)
        if got is None:
            return
        if got.gap:
            log.info(
                "BelugaConnector: the pool server restarted or evicted faster than it "
                "remembers; KV events miss removals between two steps"
            )
        self._retired = got.cursor
        self.events.retired(got.digests)

    def reset_cache(self) -> bool:
        """Move to the next epoch: no block saved before it is offered again (module doc)."""
        self.kv = self.kv.at_epoch(self.kv.epoch + 1)
        self._hits.clear()
        self._bad.clear()  # blocks of the old epoch are never looked up again
        self.events.reset()
        log.info("BelugaConnector: cache reset, now at epoch %d", self.kv.epoch)
        return True
