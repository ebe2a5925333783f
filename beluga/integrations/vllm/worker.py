"""The connector's worker side (the model runner): moves blocks between KV cache and pool.

``register_kv_caches`` detects the layout (refused at start when it cannot be
moved); ``start_load_kv`` / ``wait_for_layer_load`` load the step's blocks
with ``KVStore.load`` (on the load thread when asynchronous);
``wait_for_save`` saves the blocks the step completed with one
``KVStore.save`` (on the save thread when asynchronous);
``get_block_ids_with_load_errors`` and ``get_finished`` report back to vLLM.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from beluga.errors import CapacityError, KVLayoutError
from beluga.integrations._link import UNAVAILABLE, StoreLink, log
from beluga.integrations.vllm.metrics import BelugaConnectorStats, Tally
from beluga.integrations.vllm.options import Options
from beluga.integrations.vllm.scheduler import BelugaMetadata, LoadSpec, SaveSpec
from beluga.integrations.vllm.shapes import EngineKV
from beluga.kv import BlockRef, KVStore
from beluga.transfer import EngineBlocks, KVLayout, KVSpec


class BelugaWorker:
    """The connector's worker side (the model runner): moves blocks between KV cache and pool.

    Not thread-safe: vLLM calls it from the model runner's thread; its step
    state is unguarded (its counts are thread-safe).  Asynchronous transfers
    run on two threads of its own, one for loads and one for saves, and hand
    results back through futures; a load thread writes only the engine blocks
    vLLM allocated to the requests waiting for it, and a save thread reads
    only blocks vLLM keeps until the save is reported (a finished request's,
    held by ``request_finished``; a preempted one's, flushed by
    :meth:`handle_preemptions`).
    """

    def __init__(self, kv: EngineKV, link: StoreLink, options: Options, rank: int) -> None:
        self.shard = kv.shard(rank)
        self.kv = kv
        self.link = link
        self.rank = rank
        self._transfer = options.transfer
        self._tally = Tally()
        self._layout: KVLayout | None = None
        self._layer_layouts: dict[str, tuple[int, KVLayout]] = {}
        self._load_errors: set[int] = set()
        self._layer_loads: tuple[np.ndarray, list[BlockRef], list[str]] | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        if options.loads and options.async_min_bytes is not None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="beluga-load")
        if options.saves and options.save_async:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="beluga-save")
        self._loading: dict[str, Future[set[int]]] = {}  # request -> its failed engine blocks
        self._saves: list[tuple[set[str], Future[None]]] = []  # requests, their save
        self._saved_for: set[str] = set()  # requests an asynchronous save was queued for
        self._finished: set[str] = set()  # of those, the ones vLLM finished

    def get_stats(self) -> BelugaConnectorStats | None:
        return self._tally.take()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self.kv.layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise KVLayoutError(
                f"vLLM registered no KV cache for layers {missing}; BelugaConnector needs every "
                "attention layer of the model's KV cache group"
            )
        tensors = [kv_caches[n] for n in names]
        self._layout = self._detect_layout(self.kv.spec, tensors)
        if self._transfer == "layerwise":
            layer_bytes = 2 * self.kv.spec.section_bytes
            if layer_bytes % 64:
                raise KVLayoutError(
                    f"one layer of a block is {layer_bytes} bytes, not a multiple of 64, so "
                    "layer-wise transfers cannot address it: use 'transfer': 'whole'"
                )
            one = dataclasses.replace(self.kv.spec, num_layers=1)
            self._layer_layouts = {
                n: (i * layer_bytes, self._detect_layout(one, [t]))
                for i, (n, t) in enumerate(zip(names, tensors, strict=True))
            }
        self.link.available()  # connect now, so a missing pool is reported at engine start

    @staticmethod
    def _detect_layout(spec: KVSpec, tensors: list[torch.Tensor]) -> KVLayout:
        """The engine's KV layout, refused with the reason when it cannot be moved."""
        device = tensors[0].device
        if device.type != "cpu":
            raise KVLayoutError(
                f"the KV cache is on {device}; BelugaConnector moves host-resident KV "
                "caches (vLLM's CPU backend) only, and has never run on a GPU: serve on "
                "the CPU backend or remove it from --kv-transfer-config"
            )
        return KVLayout.cpu_attention(spec, tensors)

    def start_load_kv(self, meta: BelugaMetadata | None) -> None:
        """Load the step's blocks: on the load thread when asynchronous, else now.

        ``"layerwise"`` (synchronous only): prepare, and load in the layer hooks.
        """
        if meta is None or not meta.loads or self._layout is None:
            return
        now = []
        for load in meta.loads:
            if load.asynchronous and self._loader is not None:
                self._loading[load.req_id] = self._loader.submit(self._load_one, load)
            else:
                now.append(load)
        if not now:
            return
        engine = np.array([b for load in now for b in load.engine_blocks], dtype=np.int64)
        refs = [r for load in now for r in load.refs[self.shard]]
        if self._transfer == "layerwise":
            self._layer_loads = (engine, refs, list(self._layer_layouts))
            return
        valid = self._read(engine, refs, self._layout, 0)
        self._load_errors.update(int(b) for b in engine[~valid])
        self._tally.add(loaded_blocks=int(valid.sum()))

    def _load_one(self, load: LoadSpec) -> set[int]:
        """One request's asynchronous load (on the load thread); the engine blocks that failed."""
        assert self._layout is not None
        engine = np.array(load.engine_blocks, dtype=np.int64)
        valid = self._read(engine, load.refs[self.shard], self._layout, 0)
        self._tally.add(loaded_blocks=int(valid.sum()))
        return {int(b) for b in engine[~valid]}

    def _read(
        self, engine: np.ndarray, refs: list[BlockRef], layout: KVLayout, at: int
    ) -> np.ndarray:
        """Read pool blocks (their bytes from ``at`` on) into engine blocks; which stayed valid.

        A block that the store does not validate (replaced, evicted, torn or
        corrupted) is not valid: the caller reports it as a load error, so
        vLLM recomputes it (or fails the request, as its
        ``kv_load_failure_policy`` says) instead of using what was copied.
        """
        valid = np.zeros(len(refs), dtype=bool)
        with self.link.connected() as store:
            if store is not None:
                try:
                    with self._tally.timed("load_seconds"):
                        valid = self._read_from(store, engine, refs, layout, at)
                except UNAVAILABLE as e:
                    self._tally.add(pool_errors=1)
                    self.link.lost(e, store)
                    valid[:] = False
        return valid

    def _read_from(
        self, store: KVStore, engine: np.ndarray, refs: list[BlockRef], layout: KVLayout, at: int
    ) -> np.ndarray:
        sink = EngineBlocks(layout, engine, at=at, value_bytes=self.kv.format.nbytes)
        # the store checks each block's header and the checksum of what was copied
        valid = np.array(store.load(refs, sink, drop_corrupt=True), dtype=bool)
        self._tally.add(load_bytes=int(valid.sum()) * layout.format.nbytes)
        return valid

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_loads is None or layer_name not in self._layer_layouts:
            return
        engine, refs, remaining = self._layer_loads
        at, layout = self._layer_layouts[layer_name]
        valid = self._read(engine, refs, layout, at)
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
        while vLLM keeps the block.
        """
        self._layer_loads = None
        if meta is None or not meta.saves.hashes:
            return
        if not self.kv.saves(self.rank):  # rank 0 saves the shard every rank holds
            if self._saver is not None:  # vLLM waits for every rank to report the request
                self._saved_for |= meta.saves.req_ids
            return
        if self._saver is not None:
            self._saved_for |= meta.saves.req_ids
            self._saves.append((meta.saves.req_ids, self._saver.submit(self._save_all, meta.saves)))
            return
        self._save_all(meta.saves)

    def _save_all(self, saves: SaveSpec) -> None:
        """Save blocks; an outage, a full pool or a lost lease is counted, not raised.

        A block committed already, or being saved by another engine, is
        skipped by the store (it costs no pool capacity); a write whose lease
        ran out is tried once more.
        """
        layout = self._layout
        if layout is None:
            return
        with self.link.connected() as store:
            if store is None:
                return
            keys = [self.kv.key(h, self.shard) for h in saves.hashes]
            try:
                with self._tally.timed("save_seconds"):
                    saved = store.save(keys, EngineBlocks(layout, saves.engine_blocks), attempts=2)
            except CapacityError as e:
                self._tally.add(save_full=len(saves.hashes))
                log.debug("BelugaConnector: no room for %d blocks: %s", len(saves.hashes), e)
            except UNAVAILABLE as e:
                self._tally.add(pool_errors=1)
                self.link.lost(e, store)
            else:
                n = len(saved.stored)
                self._tally.add(
                    saved_blocks=n,
                    save_bytes=n * layout.format.nbytes,
                    save_skipped=len(saved.present) + len(saved.in_flight),
                    lease_losses=len(saved.lost),
                )

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
        for req_ids, future in self._saves:
            if not future.done():
                running |= req_ids
            else:
                future.result()
        self._saves = [(r, f) for r, f in self._saves if not f.done()]
        self._finished |= finished_req_ids & self._saved_for
        sending = self._finished - running
        self._finished -= sending
        self._saved_for -= sending
        return sending or None, recving or None

    def handle_preemptions(self, meta: BelugaMetadata | None) -> None:
        """Wait for the saves in flight when vLLM preempted a request (its blocks are reused)."""
        if meta is not None and meta.flush_saves:
            wait([future for _, future in self._saves])

    def close(self) -> None:
        """Let the transfers in flight end (they hold engine blocks), then stop the threads."""
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
