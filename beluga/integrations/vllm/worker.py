"""The connector's worker side (the model runner): moves blocks between KV cache and pool.

``register_kv_caches`` detects the layout (refused at start when it cannot be
moved: host caches of vLLM's CPU backend, and CUDA caches of FlashAttention in
the NHD or HND order their strides have, are moved); ``start_load_kv`` /
``wait_for_layer_load`` load the step's blocks with ``KVStore.load`` (on the
load thread when asynchronous); ``wait_for_save`` saves the blocks the step
completed with one ``KVStore.save`` per KV cache group (on the save thread
when asynchronous);
``handle_preemptions`` ends the saves that read blocks the step hands out
again; ``get_block_ids_with_load_errors``, ``get_finished`` and
``get_kv_cache_events`` report back to vLLM.

The moves themselves are :class:`beluga.integrations.moves.BlockMoves`,
which imports no vLLM (tests/test_vllm_moves.py drives them with vLLM-shaped
caches): a CUDA cache moves through the pool's mapping registered with CUDA
(:class:`~beluga.transfer.gpu.GpuPool`), as the serving engine's does, and
the registration is let go before the store it was made for.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from beluga.errors import CapacityError, KVLayoutError
from beluga.integrations._link import StoreLink, log
from beluga.integrations.moves import BlockMoves, engine_layout
from beluga.integrations.vllm.events import Block, SavedBlocks
from beluga.integrations.vllm.metrics import BelugaConnectorStats, Tally
from beluga.integrations.vllm.options import Options
from beluga.integrations.vllm.scheduler import BelugaMetadata, LoadSpec, SaveSpec
from beluga.integrations.vllm.shapes import EngineKV
from beluga.kv import BlockRef, KVStore
from beluga.transfer import KVLayout

#: seconds the worker waits for a save that reads engine blocks vLLM hands out again
SAVE_END_S = 60.0


class BelugaWorker:
    """The connector's worker side (the model runner): moves blocks between KV cache and pool.

    Not thread-safe: vLLM calls it from the model runner's thread; its step
    state is unguarded (its counts and its reports of saved blocks are
    thread-safe).  Asynchronous transfers run on two threads of its own, one
    for loads and one for saves, and hand results back through futures; a
    load thread writes only the engine blocks vLLM allocated to the requests
    waiting for it, and a save thread reads only blocks vLLM keeps until the
    save is reported (a finished request's, held by ``request_finished``) or
    that no step writes before the save ends (:meth:`handle_preemptions`).
    """

    def __init__(
        self, kv: EngineKV, link: StoreLink, options: Options, rank: int, events: bool = False
    ) -> None:
        self.shard = kv.shard(rank)
        self.kv = kv
        self.link = link
        self.rank = rank
        self._transfer = options.transfer
        if self._transfer == "layerwise" and len(kv.groups) > 1:
            raise KVLayoutError(
                f"layer-wise loads move one KV cache group, and this engine has {len(kv.groups)} "
                "(vLLM's hybrid KV cache manager): use kv_connector_extra_config 'transfer': "
                "'whole', or set disable_hybrid_kv_cache_manager=True"
            )
        self._tally = Tally()
        self._moves = BlockMoves([])  # the registered caches' moves (register_kv_caches)
        self._layouts: list[KVLayout] = []  # by group
        self._layer_layouts: dict[str, tuple[int, KVLayout]] = {}
        self._load_errors: set[int] = set()
        self._layer_loads: tuple[np.ndarray, list[BlockRef | None], list[str]] | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        if options.loads and options.async_min_bytes is not None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="beluga-load")
        if options.saves and options.save_async:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="beluga-save")
        self._loading: dict[str, Future[set[int]]] = {}  # request -> its failed engine blocks
        # the requests of a save, the engine blocks it reads, the save
        self._saves: list[tuple[set[str], set[int], Future[None]]] = []
        self._saved_for: set[str] = set()  # requests an asynchronous save was queued for
        self._finished: set[str] = set()  # of those, the ones vLLM finished
        self._events = events  # report the blocks saves leave in the pool (KV events)
        self._in_pool: list[Block] = []
        self._in_pool_lock = threading.Lock()

    def get_stats(self) -> BelugaConnectorStats | None:
        return self._tally.take()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for g in self.kv.groups for n in g.layer_names]
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise KVLayoutError(
                f"vLLM registered no KV cache for layers {missing}; BelugaConnector needs every "
                "attention layer of the model's KV cache groups"
            )
        self._layouts = [
            engine_layout(g.spec, [kv_caches[n] for n in g.layer_names]) for g in self.kv.groups
        ]
        if self._transfer == "layerwise":
            (group,) = self.kv.groups
            layer_bytes = 2 * group.spec.section_bytes
            if layer_bytes % 64:
                raise KVLayoutError(
                    f"one layer of a block is {layer_bytes} bytes, not a multiple of 64, so "
                    "layer-wise transfers cannot address it: use 'transfer': 'whole'"
                )
            one = dataclasses.replace(group.spec, num_layers=1)
            whole = self._layouts[0]  # each layer in its order
            order = whole.format.order if whole.device.type == "cuda" else None
            self._layer_layouts = {
                n: (i * layer_bytes, engine_layout(one, [kv_caches[n]], order))
                for i, n in enumerate(group.layer_names)
            }
        layer_layouts = [layout for _, layout in self._layer_layouts.values()]
        self._moves = BlockMoves([*self._layouts, *layer_layouts])
        # connect now, so a missing pool (or one the GPU cannot map) is reported at engine start
        self.link.call(self._moves.prepare, None, on_outage=self._moves.forget)

    def start_load_kv(self, meta: BelugaMetadata | None) -> None:
        """Load the step's blocks: on the load thread when asynchronous (one job per
        request, every group of it), else now.

        ``"layerwise"`` (synchronous only): prepare, and load in the layer hooks.
        """
        if meta is None or not meta.loads or not self._layouts:
            return
        now: list[LoadSpec] = []
        later: dict[str, list[LoadSpec]] = {}
        for load in meta.loads:
            if load.asynchronous and self._loader is not None:
                later.setdefault(load.req_id, []).append(load)
            else:
                now.append(load)
        for req_id, loads in later.items():
            self._loading[req_id] = self._loader.submit(self._load_all, loads)  # type: ignore[union-attr]
        if not now:
            return
        if self._transfer == "layerwise":
            engine = np.array([b for load in now for b in load.engine_blocks], dtype=np.int64)
            refs = [r for load in now for r in load.refs[self.shard]]
            self._layer_loads = (engine, refs, list(self._layer_layouts))
            return
        self._load_errors |= self._load_all(now)

    def _load_all(self, loads: list[LoadSpec]) -> set[int]:
        """Load requests' blocks (one read per group); the engine blocks that failed."""
        failed: set[int] = set()
        for group in self.kv.groups:
            mine = [load for load in loads if load.group == group.index]
            if not mine:
                continue
            engine = np.array([b for load in mine for b in load.engine_blocks], dtype=np.int64)
            refs = [r for load in mine for r in load.refs[self.shard]]
            valid = self._read(engine, refs, self._layouts[group.index], 0, group.format.nbytes)
            self._tally.add(loaded_blocks=int(valid.sum()))
            failed.update(int(b) for b in engine[~valid])
        return failed

    def _read(
        self,
        engine: np.ndarray,
        refs: list[BlockRef | None],
        layout: KVLayout,
        at: int,
        value_bytes: int,
    ) -> np.ndarray:
        """Read pool blocks (their bytes from ``at`` on, of values of ``value_bytes``) into
        engine blocks; which stayed valid.

        A block that the store does not validate (missing, replaced, evicted,
        torn or corrupted) is not valid: the caller reports it as a load
        error, so vLLM recomputes it (or fails the request, as its
        ``kv_load_failure_policy`` says) instead of using what was copied.
        """

        def load(store: KVStore) -> np.ndarray:
            with self._tally.timed("load_seconds"):
                # the store checks each block's header and the checksum of what was copied
                got = self._moves.load(store, layout, engine, refs, at=at, value_bytes=value_bytes)
                valid = np.array(got, dtype=bool)
            self._tally.add(load_bytes=int(valid.sum()) * layout.format.nbytes)
            return valid

        return self.link.call(load, np.zeros(len(refs), dtype=bool), on_outage=self._pool_error)

    def _pool_error(self, store: KVStore) -> None:
        """Count an outage, and let go of the store's GPU registration before the link drops
        the store."""
        self._tally.add(pool_errors=1)
        self._moves.forget(store)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_loads is None or layer_name not in self._layer_layouts:
            return
        engine, refs, remaining = self._layer_loads
        at, layout = self._layer_layouts[layer_name]
        valid = self._read(engine, refs, layout, at, self.kv.groups[0].format.nbytes)
        self._load_errors.update(int(b) for b in engine[~valid])
        # a block that failed one layer is reported already: later layers skip it
        engine, refs = engine[valid], [r for r, ok in zip(refs, valid, strict=True) if ok]
        remaining = [n for n in remaining if n != layer_name]
        if not remaining:
            self._tally.add(loaded_blocks=len(refs))
        self._layer_loads = (engine, refs, remaining) if remaining else None

    def wait_for_save(self, meta: BelugaMetadata | None) -> None:
        """Save the blocks the step completed, whole: on the save thread when asynchronous.

        A pool block is sealed with the checksum of the bytes its writer
        stored, taken as they are stored, so every layer of it moves in one
        write (nothing is saved per layer); a full block's KV does not change
        while vLLM keeps the block.  Keys are taken now, in the step's epoch.
        """
        self._layer_loads = None
        saves = [] if meta is None else [s for s in meta.saves if s.hashes]
        if meta is None or not saves:
            return
        req_ids = set().union(*(s.req_ids for s in saves))
        if not self.kv.saves(self.rank):  # rank 0 saves the shard every rank holds
            if self._saver is not None:  # vLLM waits for every rank to report the request
                self._saved_for |= req_ids
            return
        self.kv = self.kv.at_epoch(meta.epoch)
        jobs = [(s, [self.kv.key(h, self.shard, s.group) for h in s.hashes]) for s in saves]
        if self._saver is not None:
            self._saved_for |= req_ids
            blocks = {b for s in saves for b in s.engine_blocks}
            self._saves.append((req_ids, blocks, self._saver.submit(self._save_all, jobs)))
            return
        self._save_all(jobs)

    def _save_all(self, jobs: list[tuple[SaveSpec, list[bytes]]]) -> None:
        """Save blocks (one write per group, under these keys); an outage, a full pool or a
        lost lease is counted, not raised.

        A block committed already, or being saved by another engine, is
        skipped by the store (it costs no pool capacity); a write whose lease
        ran out is tried once more.
        """
        if self._layouts:
            self.link.call(lambda s: self._save_jobs(s, jobs), None, on_outage=self._pool_error)

    def _save_jobs(self, store: KVStore, jobs: list[tuple[SaveSpec, list[bytes]]]) -> None:
        """Save each job's blocks in turn; a job the pool has no room for is counted, skipped."""
        for save, keys in jobs:
            layout = self._layouts[save.group]
            try:
                with self._tally.timed("save_seconds"):
                    saved = self._moves.save(store, layout, keys, save.engine_blocks)
            except CapacityError as e:
                self._tally.add(save_full=len(keys))
                log.debug("BelugaConnector: no room for %d blocks: %s", len(keys), e)
                continue
            n = len(saved.stored)
            self._tally.add(
                saved_blocks=n,
                save_bytes=n * layout.format.nbytes,
                save_skipped=len(saved.present) + len(saved.in_flight),
                lease_losses=len(saved.lost),
            )
            if self._events:
                with self._in_pool_lock:
                    self._in_pool += [
                        (save.hashes[i], save.group) for i in saved.stored + saved.present
                    ]

    def get_kv_cache_events(self) -> SavedBlocks | None:
        """The blocks this worker's saves left in the pool since the last call (KV events)."""
        with self._in_pool_lock:
            blocks, self._in_pool = self._in_pool, []
        return SavedBlocks(blocks, self.kv.block_tokens) if blocks else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failed blocks of this step's loads and of the loads ``get_finished`` reported."""
        errors, self._load_errors = self._load_errors, set()
        self._tally.add(load_errors=len(errors))
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves are done (among those vLLM finished), and loads that are done.

        A done load's failed blocks go to :meth:`get_block_ids_with_load_errors`,
        which vLLM calls next in the same step, as its contract asks.  An error
        that is a bug (not an outage) raises here, in the model runner's thread.
        """
        recving = {req for req, future in self._loading.items() if future.done()}
        for req in recving:
            self._load_errors |= self._loading.pop(req).result()
        running: set[str] = set()
        for req_ids, _, future in self._saves:
            if not future.done():
                running |= req_ids
            else:
                future.result()
        self._saves = [save for save in self._saves if not save[2].done()]
        self._finished |= finished_req_ids & self._saved_for
        sending = self._finished - running
        self._finished -= sending
        self._saved_for -= sending
        return sending or None, recving or None

    def handle_preemptions(self, meta: BelugaMetadata | None) -> None:
        """End the saves in flight that read engine blocks this step hands out again (a
        preempted request's, a sliding-window block freed as its window moved), before
        the step writes them: else a save could seal another request's KV under this
        one's keys, with a valid checksum."""
        if meta is None or not meta.reused:
            return
        reading = [f for _, blocks, f in self._saves if not blocks.isdisjoint(meta.reused)]
        if reading and wait(reading, timeout=SAVE_END_S).not_done:
            raise TimeoutError(
                f"a save still reads engine blocks that vLLM hands out again after {SAVE_END_S} "
                "s; stopping rather than let it store another request's KV"
            )

    def close(self) -> None:
        """Let the transfers in flight end (they hold engine blocks), stop the threads, and let
        go of the GPU registration (before the connector closes the store)."""
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
        self._moves.close()
