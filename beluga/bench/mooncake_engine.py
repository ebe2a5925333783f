"""The RDMA-era engine: the same model engine, with Mooncake Store as its prefix cache.

This is the baseline side of ``beluga bench e2e --baseline mooncake``.  It
serves a request in the steps :class:`beluga.serving.engine.CachingEngine`
runs and times, in the same roles (a single engine, a prefill engine, a
decode engine), over Mooncake Store instead of the pool, the way an engine
with a Mooncake connector does:

lookup
    the same block keys (vLLM's chained hashes in the model's namespace, as
    hex strings), then one ``batch_is_exist``: the longest stored prefix;
load
    one ``batch_get_into`` of the prefix blocks into the engine's *staging
    buffer* (registered with Mooncake's transfer engine once, at start), then
    a scatter from the staging buffer into the model's KV cache;
compute
    prefill the tokens after the prefix (time to first token ends here);
save
    one ``batch_is_exist`` of the new full blocks, then, for those not stored
    yet (SGLang's Mooncake backend skips stored keys the same way; the skipped
    ones are counted as computed twice), a gather from the KV cache into the
    staging buffer and one ``batch_put_from``.  A batch Mooncake finds no
    room for is counted as refused (its blocks are not there to load).

A value is exactly a Beluga pool block's payload (:class:`BlockFormat`, HND
order): both systems move the same bytes per block.  The bytes cross Mooncake's
transfer engine over TCP on loopback (the wheel that installs here has no RDMA:
:data:`TRANSPORT`);
Mooncake checks no checksum on the way, so a block that is not there or
comes back short ends the usable prefix, like a miss.

The staging buffer is what Mooncake's own vLLM and SGLang integrations use
when the KV cache is on a GPU: host memory pinned and registered with CUDA
(``cudaHostAlloc``, through torch's ``pin_memory``), so the copies between it
and the GPU are DMA at the PCIe rate, issued per layer (K and V) and waited
for once per batch; it is registered with Mooncake's transfer engine too.
On the CPU it is plain host memory, as before.  Either way Mooncake moves
what Beluga moves, by the best path it has here.

:class:`MooncakeEngines` builds one engine per engine process of a
:class:`beluga.serving.cluster.Cluster`; each process connects its own
Mooncake client.  Engines are not thread-safe (one request at a time) and
not fork-safe (a Mooncake client is not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from beluga.errors import CapacityError
from beluga.kv.identity import ModelIdentity
from beluga.kv.store import Saved
from beluga.kv.tier.mooncake import MooncakeClient, check_available, connect
from beluga.serving.cluster import EngineConfig, build_model
from beluga.serving.engine import CachingEngine, kv_block_keys, leading_run
from beluga.serving.model import KV, ModelEngine
from beluga.units import MiB

#: how Mooncake moves bytes in this baseline: its transfer engine's TCP transport on loopback
TRANSPORT = "tcp-loopback"


class MooncakeServingEngine(CachingEngine):
    """A model engine whose prefix cache is Mooncake Store, moving blocks through staging.

    ``staging_blocks`` bounds the blocks one call moves; a request with more
    moves them in several batches.  ``role``: one of
    :data:`beluga.serving.engine.ROLES`.  Not thread-safe, not fork-safe.
    """

    def __init__(
        self,
        model: ModelEngine,
        client: MooncakeClient,
        *,
        staging_blocks: int,
        role: str = "kv_both",
        identity: ModelIdentity | None = None,
    ) -> None:
        if staging_blocks < 1:
            raise ValueError(f"staging_blocks must be >= 1, not {staging_blocks}")
        super().__init__(model, role=role, identity=identity)
        self.client = client
        spec = self.format.spec
        # one engine block's value per slot: [layers, K/V, kv heads, block tokens, head dim]
        self.pinned = model.device.type == "cuda"  # staging the GPU reaches by DMA
        self._host = torch.zeros(
            (staging_blocks, self.format.nbytes), dtype=torch.uint8, pin_memory=self.pinned
        )
        self.staging = self._host.numpy()
        client.register_buffer(self.staging)
        self.slots = list(self.staging)
        self.staged = self._host.view(model.dtype).view(
            staging_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_tokens, spec.head_dim
        )

    def close(self) -> None:
        """Unregister the staging buffer (the client's close would too)."""
        self.client.unregister_buffer(self.staging)

    def keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[str]:
        """The prompt's block keys: Beluga's, as hex strings (Mooncake keys are text)."""
        return [k.hex() for k in kv_block_keys(self.format, self.identity, token_ids, salt=salt)]

    def _locate(self, keys: list[str]) -> list[str]:
        return keys[: leading_run(self.client.batch_is_exist(keys))]

    def _fill(self, prefix: KV, keys: list[str]) -> int:
        """Fetch the blocks into staging, batch by batch, and scatter the intact leading run."""
        nbytes, batch = self.format.nbytes, len(self.slots)
        intact = 0
        for first in range(0, len(keys), batch):
            chunk = keys[first : first + batch]
            lengths = self.client.batch_get_into(chunk, self.slots[: len(chunk)])
            good = leading_run([n == nbytes for n in lengths])
            self._scatter(prefix, first, good)
            intact += good
            if good < len(chunk):
                break
        return intact

    def _save(self, kv: KV, keys: list[str], blocks: list[int]) -> Saved:
        """Put the blocks Mooncake does not hold yet, gathered into staging batch by batch."""
        there = self.client.batch_is_exist([keys[b] for b in blocks])
        todo = [i for i, ok in enumerate(there) if not ok]
        stored: list[int] = []
        refused: list[int] = []
        batch = len(self.slots)
        for start in range(0, len(todo), batch):
            chunk = todo[start : start + batch]
            self._gather(kv, [blocks[i] for i in chunk])
            try:
                self.client.batch_put_from(
                    [keys[blocks[i]] for i in chunk], self.slots[: len(chunk)]
                )
            except CapacityError:  # no room for some: those Mooncake does not hold are refused
                held = self.client.batch_is_exist([keys[blocks[i]] for i in chunk])
                stored += [i for i, ok in zip(chunk, held, strict=True) if ok]
                refused += [i for i, ok in zip(chunk, held, strict=True) if not ok]
            else:
                stored += chunk
        return Saved(stored, [i for i, ok in enumerate(there) if ok], refused)

    def _scatter(self, prefix: KV, first: int, count: int) -> None:
        """Staging slots ``0 .. count`` into blocks ``first ..`` of a prefix (from pinned
        staging: one DMA of the slots to the GPU, then the scatter there)."""
        bs = self.block_tokens
        staged = self.staged[:count]
        if self.pinned:
            staged = staged.to(self.model.device, non_blocking=True)
        for layer, pair in enumerate(prefix):
            for kind, tensor in enumerate(pair):
                span = tensor[0, :, first * bs : (first + count) * bs, :]
                blocks = span.unflatten(1, (count, bs)).transpose(0, 1)
                blocks.copy_(staged[:, layer, kind])
        self._synchronize()  # the next batch overwrites the slots the DMA reads

    def _gather(self, kv: KV, blocks: list[int]) -> None:
        """These blocks of a prefill's KV into staging slots ``0 ..`` (a run of blocks, the
        usual case, is one strided copy per layer, K and V; to pinned staging, gathered on
        the GPU first, then one DMA)."""
        bs, count, first = self.block_tokens, len(blocks), blocks[0]
        run = blocks == list(range(first, first + count))
        index = None if run else torch.as_tensor(blocks, device=self.model.device)
        slots = self.staged[:count]
        into = torch.empty_like(slots, device=self.model.device) if self.pinned else slots
        for layer, pair in enumerate(kv):
            for kind, tensor in enumerate(pair):
                if index is None:
                    span = tensor[0, :, first * bs : (first + count) * bs, :]
                    picked = span.unflatten(1, (count, bs))
                else:
                    span = tensor[0, :, : (max(blocks) + 1) * bs, :]
                    picked = span.unflatten(1, (-1, bs)).index_select(1, index)
                into[:, layer, kind].copy_(picked.transpose(0, 1))
        if self.pinned:
            slots.copy_(into, non_blocking=True)
            self._synchronize()  # Mooncake reads the slots next

    def _synchronize(self) -> None:
        """Wait for this device's copies (those to and from the pinned slots among them)."""
        if self.pinned:
            torch.cuda.current_stream(self.model.device).synchronize()


@dataclass(frozen=True)
class MooncakeEngines:
    """Builds an engine process's Mooncake client and engine (a :data:`EngineBuilder`).

    Pickles by value, so a spawned engine process connects to the same store.
    """

    metadata_url: str
    master_address: str
    staging_blocks: int
    local_buffer_size: int = 16 * MiB

    def __call__(
        self, pool: str, config: EngineConfig
    ) -> tuple[MooncakeClient, MooncakeServingEngine]:
        model = build_model(config)
        client = connect(
            check_available(), self.metadata_url, self.master_address, self.local_buffer_size
        )
        try:
            engine = MooncakeServingEngine(
                model,
                client,
                staging_blocks=self.staging_blocks,
                role=config.role,
                identity=config.identity,
            )
        except BaseException:
            client.close()
            raise
        return client, engine
