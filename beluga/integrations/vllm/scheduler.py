"""The connector's scheduler side (the engine core): lookups, and each step's metadata.

``get_num_new_matched_tokens`` looks the request's next blocks up in the pool
index (one prefix lookup per shard, no RPC); ``update_state_after_alloc``
pairs those pool blocks with the engine blocks vLLM allocated;
``build_connector_meta`` hands the worker each step's loads and the blocks
the step completes, to save; ``request_finished`` forgets the request, and a
``kv_producer`` tells the decode engine how many blocks to expect.  The role
(:mod:`beluga.integrations.vllm.options`) decides, here and only here, what a
scheduler loads and saves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from beluga.integrations._link import UNAVAILABLE, StoreLink, log
from beluga.integrations.vllm.metrics import BelugaConnectorStats, Tally
from beluga.integrations.vllm.options import Options
from beluga.integrations.vllm.shapes import EngineKV
from beluga.kv import BlockRef, KVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: the key of a producer's ``kv_transfer_params`` that says how many blocks it saved
EXPECTED_BLOCKS = "beluga_blocks"
#: pool blocks that failed to load, remembered so they are not offered again (the newest)
BAD_REFS = 4096


@dataclass
class LoadSpec:
    """Read these pool blocks into these engine blocks (one request).

    ``refs[shard]``: the pool blocks of that shard (see :meth:`EngineKV.shard`).
    """

    req_id: str
    engine_blocks: list[int]
    refs: list[list[BlockRef]]
    asynchronous: bool = False  # off the engine step (the request waits for get_finished)


@dataclass
class SaveSpec:
    """Save these engine blocks, whose vLLM block hashes these are (blocks the step completes).

    Each worker saves its own shard, under its shard's key of the hash (of MLA's
    one shard, rank 0 alone).
    ``req_ids``: the requests whose blocks these are, which an asynchronous
    save holds until it is done.
    """

    engine_blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    req_ids: set[str] = field(default_factory=set)


@dataclass
class BelugaMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: SaveSpec = field(default_factory=SaveSpec)
    flush_saves: bool = False  # vLLM preempted a request: its blocks may be reused this step


@dataclass
class _Tracked:
    """A scheduled request: its engine blocks and how many leading blocks the pool has."""

    request: Request
    block_ids: list[int]
    saved: int  # leading blocks that are in the pool (or were computed before it was asked)


@dataclass
class _Hit:
    """What a lookup found for a request, until vLLM allocates its blocks."""

    first: int  # the first block looked up (those before it vLLM had computed)
    refs: list[list[BlockRef]]  # by shard
    load_async: bool
    expected: int | None  # blocks its producer said it saved (kv_transfer_params), if told


class BelugaScheduler:
    """The connector's scheduler side (the engine core): lookups and each step's metadata.

    Not thread-safe: vLLM calls it from the engine core's thread; its
    request state is unguarded.
    """

    def __init__(
        self, vllm_config: VllmConfig, kv: EngineKV, link: StoreLink, options: Options
    ) -> None:
        self.kv = kv
        self.block_tokens = kv.spec.block_tokens
        self.link = link
        self.options = options
        self._saving: set[str] = set()  # requests with an asynchronous save queued
        self._tally = Tally()
        self._hits: dict[str, _Hit] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadSpec] = []
        self._loading: dict[str, dict[int, tuple[BlockRef, ...]]] = {}  # req: engine block: refs
        self._bad: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # (digest, version)
        if not vllm_config.cache_config.enable_prefix_caching:
            log.warning(
                "BelugaConnector keys blocks by vLLM's prefix-cache hashes, which vLLM "
                "computes only with enable_prefix_caching=True: the pool stays unused"
            )
        self.link.available()  # connect now, so a missing pool is reported at engine start

    def get_stats(self) -> BelugaConnectorStats | None:
        return self._tally.take()

    def _block_hashes(self, request: Request) -> list[bytes]:
        """vLLM's hashes of the request's full engine blocks."""
        hashes = request.block_hashes
        ratio = self.kv.hash_ratio
        return list(hashes[ratio - 1 :: ratio]) if ratio > 1 else list(hashes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the pool can supply beyond ``num_computed_tokens``, and whether they load
        asynchronously.  Every full block may load; at least the request's last token is
        left to compute (its logits pick the next token), so when every token is in full
        blocks the last block is loaded whole and its last token computed again."""
        self._hits.pop(request.request_id, None)
        if not self.options.loads:
            return 0, False
        first = num_computed_tokens // self.block_tokens
        hashes = self._block_hashes(request)[first : request.num_tokens // self.block_tokens]
        if not hashes or num_computed_tokens >= request.num_tokens - 1:
            return 0, False
        with self.link.connected() as store:
            if store is None:
                return 0, False
            try:
                refs = self._locate(store, hashes)
            except UNAVAILABLE as e:
                self._tally.add(pool_errors=1)
                self.link.lost(e, store)
                return 0, False
        hits = len(refs[0])
        self._tally.add(lookups=1, hit_blocks=hits, miss_blocks=len(hashes) - hits)
        load_async = (
            hits > 0
            and self.options.async_min_bytes is not None
            and hits * self.kv.format.nbytes >= self.options.async_min_bytes
        )
        params = request.kv_transfer_params or {}
        expected = params.get(EXPECTED_BLOCKS) if self.options.role == "kv_consumer" else None
        self._hits[request.request_id] = _Hit(first, refs, load_async, expected)
        tokens = min(hits * self.block_tokens, request.num_tokens - 1 - num_computed_tokens)
        return tokens, load_async and tokens > 0

    def _locate(self, store: KVStore, hashes: list[bytes]) -> list[list[BlockRef]]:
        """Each shard's pool blocks of the longest prefix of ``hashes`` that every shard has.

        One index lookup per shard; a block is a hit only when all its shards
        are in the pool, so every rank loads the same blocks.
        """
        per_shard: list[list[BlockRef]] = []
        for shard in range(len(self.kv.namespaces)):
            refs: list[BlockRef] = []
            for ref in store.locate([self.kv.key(h, shard) for h in hashes], prefix=True):
                bad = ref is not None and (ref.digest, ref.version) in self._bad
                if ref is None or bad or ref.length != self.kv.format.nbytes:
                    break
                refs.append(ref)
            per_shard.append(refs)
            hashes = hashes[: len(refs)]  # the next rank needs no more than this one has
        hits = min(len(refs) for refs in per_shard)
        return [refs[:hits] for refs in per_shard]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, None) or _Hit(0, [], False, None)
        (block_ids,) = blocks.get_block_ids()
        count = -(-num_external_tokens // self.block_tokens)  # a last block loads whole
        if count:
            engine = list(block_ids[hit.first : hit.first + count])
            shards = [rank_refs[:count] for rank_refs in hit.refs]
            self._pending_loads.append(LoadSpec(request.request_id, engine, shards, hit.load_async))
            by_block = dict(zip(engine, zip(*shards, strict=True), strict=True))
            self._loading[request.request_id] = by_block
        if isinstance(hit.expected, int) and not isinstance(hit.expected, bool):
            found = hit.first + count
            self._tally.add(
                expected_blocks=hit.expected, missing_blocks=max(0, hit.expected - found)
            )
        computed = request.num_computed_tokens // self.block_tokens
        self._tracked[request.request_id] = _Tracked(
            request, list(block_ids), max(hit.first + count, computed)
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which loaded blocks failed (``invalid_block_ids``, vLLM >= 0.33).

        vLLM recomputes a request from its first failed block on: those blocks
        are saved again once computed, and the pool blocks that failed are not
        offered again by this scheduler (the reader also dropped a corrupt one
        from the pool), so a request that meets only bad blocks finishes
        through recompute instead of loading them over and over.
        """
        invalid = output.invalid_block_ids
        if not invalid:
            return
        for by_block in self._loading.values():
            for block in invalid & by_block.keys():
                for ref in by_block[block]:
                    self._bad[ref.digest, ref.version] = None
        for tracked in self._tracked.values():
            failed = [i for i, b in enumerate(tracked.block_ids) if b in invalid]
            if failed:
                tracked.saved = min(tracked.saved, failed[0])
        while len(self._bad) > BAD_REFS:
            self._bad.popitem(last=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BelugaMetadata:
        meta = BelugaMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.flush_saves = self.options.save_async and bool(scheduler_output.preempted_req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._collect_saves(tracked, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids += new_ids[0]
            self._collect_saves(tracked, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _collect_saves(self, tracked: _Tracked, computed_after: int, meta: BelugaMetadata) -> None:
        """Queue the blocks whose KV is complete once this step's forward has run."""
        if not self.options.saves:
            return
        hashed = len(tracked.request.block_hashes) // self.kv.hash_ratio
        done = min(computed_after // self.block_tokens, hashed, len(tracked.block_ids))
        if done <= tracked.saved or not self.link.available():
            return  # the common decode step: no block completed
        hashes = self._block_hashes(tracked.request)
        seen = set(meta.saves.hashes)
        for i in range(tracked.saved, done):
            block_hash = bytes(hashes[i])
            if block_hash not in seen:  # two requests of one step can complete the same block
                seen.add(block_hash)
                meta.saves.hashes.append(block_hash)
                meta.saves.engine_blocks.append(tracked.block_ids[i])
                meta.saves.req_ids.add(tracked.request.request_id)
                if self.options.save_async:
                    self._saving.add(tracked.request.request_id)
        tracked.saved = done

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; hold its blocks while an asynchronous save of them runs.

        A ``kv_producer`` saved the request's blocks inside the steps that
        computed them, so they are committed now; its answer tells the
        decode engine how many to expect (``kv_transfer_params``).
        """
        self._hits.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
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
