"""The RDMA-era engine: the same model engine, with Mooncake Store as its prefix cache.

This is the baseline side of ``beluga bench e2e --baseline mooncake``.  It
serves a request in the steps :class:`beluga.serving.engine.ServingEngine`
times, over Mooncake Store instead of the pool, the way an engine with a
Mooncake connector does:

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
    gather the new full blocks from the KV cache into the staging buffer, then
    one ``batch_put_from``.

A value is exactly a Beluga pool block's payload (:class:`BlockFormat`, HND
order): both systems move the same bytes per block.  The bytes cross Mooncake's
transfer engine over TCP on loopback (the wheel that installs here has no RDMA);
Mooncake checks no checksum on the way, so a block that is not there or
comes back short ends the usable prefix, like a miss.

:class:`MooncakeEngines` builds one engine per engine process of a
:class:`beluga.serving.cluster.Cluster`; each process connects its own
Mooncake client.  Engines are not thread-safe (one request at a time) and
not fork-safe (a Mooncake client is not).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from beluga.kv.identity import ModelIdentity
from beluga.kv.tier.mooncake import MooncakeClient, check_available, connect
from beluga.serving.cluster import EngineConfig
from beluga.serving.engine import Served, Timings, kv_block_keys, kv_format
from beluga.serving.model import KV, ModelEngine
from beluga.units import MiB


def _leading(flags: Sequence[object]) -> int:
    """Length of the leading run of truthy items."""
    return next((i for i, ok in enumerate(flags) if not ok), len(flags))


class MooncakeServingEngine:
    """A model engine whose prefix cache is Mooncake Store, moving blocks through staging.

    ``staging_blocks`` bounds the blocks one call moves; a request with more
    moves them in several batches.  Not thread-safe, not fork-safe.
    """

    def __init__(
        self,
        model: ModelEngine,
        client: MooncakeClient,
        *,
        staging_blocks: int,
        identity: ModelIdentity | None = None,
    ) -> None:
        if staging_blocks < 1:
            raise ValueError(f"staging_blocks must be >= 1, not {staging_blocks}")
        self.model = model
        self.client = client
        self.format = kv_format(model)
        self.identity = identity if identity is not None else model.identity
        spec = self.format.spec
        self.block_tokens = spec.block_tokens
        # one engine block's value per slot: [layers, K/V, kv heads, block tokens, head dim]
        self.staging = np.zeros((staging_blocks, self.format.nbytes), dtype=np.uint8)
        client.register_buffer(self.staging)
        self.slots = list(self.staging)
        self.staged = torch.from_numpy(self.staging).view(torch.float32)
        self.staged = self.staged.view(
            staging_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_tokens, spec.head_dim
        )

    def close(self) -> None:
        """Unregister the staging buffer (the client's close would too)."""
        self.client.unregister_buffer(self.staging)

    def keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[str]:
        """The prompt's block keys: Beluga's, as hex strings (Mooncake keys are text)."""
        return [k.hex() for k in kv_block_keys(self.format, self.identity, token_ids, salt=salt)]

    def serve(
        self, token_ids: Sequence[int], *, salt: str | None = None, want_logits: bool = False
    ) -> Served:
        """Prefill one prompt through Mooncake Store's prefix cache."""
        clock = time.perf_counter
        start = clock()
        keys = self.keys(token_ids, salt)
        found = _leading(self.client.batch_is_exist(keys)) if keys else 0
        looked_up = clock()
        loadable = min(found, (len(token_ids) - 1) // self.block_tokens)
        prefix, loaded_blocks = self._load(keys[:loadable])
        loaded = clock()
        out = self.model.prefill(token_ids, prefix)
        computed = clock()
        stored = found if loaded_blocks == loadable else loaded_blocks
        saved = self._save(out.kv, keys, stored, out.num_full_blocks)
        done = clock()
        timings = Timings(looked_up - start, loaded - looked_up, computed - loaded, done - computed)
        return Served(
            len(token_ids),
            out.num_cached,
            saved,
            timings,
            out.logits.cpu().numpy() if want_logits else None,
        )

    def _load(self, keys: list[str]) -> tuple[KV | None, int]:
        """Fetch the blocks into staging, batch by batch, and scatter the intact leading run."""
        if not keys:
            return None, 0
        prefix = self.model.empty_prefix(len(keys))
        nbytes, batch = self.format.nbytes, len(self.slots)
        intact = 0
        for first in range(0, len(keys), batch):
            chunk = keys[first : first + batch]
            lengths = self.client.batch_get_into(chunk, self.slots[: len(chunk)])
            good = _leading([n == nbytes for n in lengths])
            self._scatter(prefix, first, good)
            intact += good
            if good < len(chunk):
                break
        if intact == len(keys):
            return prefix, intact
        if intact == 0:
            return None, 0
        tokens = intact * self.block_tokens
        cut = [(k[:, :, :tokens].contiguous(), v[:, :, :tokens].contiguous()) for k, v in prefix]
        return cut, intact

    def _save(self, kv: KV, keys: list[str], first: int, end: int) -> int:
        """Gather blocks ``first .. end`` of a prefill's KV into staging and put them."""
        batch = len(self.slots)
        for start in range(first, end, batch):
            stop = min(end, start + batch)
            self._gather(kv, start, stop)
            self.client.batch_put_from(keys[start:stop], self.slots[: stop - start])
        return max(0, end - first)

    def _scatter(self, prefix: KV, first: int, count: int) -> None:
        """Staging slots ``0 .. count`` into blocks ``first ..`` of a prefix."""
        bs = self.block_tokens
        for layer, pair in enumerate(prefix):
            for kind, tensor in enumerate(pair):
                span = tensor[0, :, first * bs : (first + count) * bs, :]
                blocks = span.unflatten(1, (count, bs)).transpose(0, 1)
                blocks.copy_(self.staged[:count, layer, kind])

    def _gather(self, kv: KV, first: int, end: int) -> None:
        """Blocks ``first .. end`` of a prefill's KV into staging slots ``0 ..``."""
        bs, count = self.block_tokens, end - first
        for layer, pair in enumerate(kv):
            for kind, tensor in enumerate(pair):
                span = tensor[0, :, first * bs : end * bs, :]
                self.staged[:count, layer, kind].copy_(
                    span.unflatten(1, (count, bs)).transpose(0, 1)
                )


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
        torch.set_num_threads(config.threads)
        model = ModelEngine(config.shape, seed=config.seed, device=config.device)
        client = connect(
            check_available(), self.metadata_url, self.master_address, self.local_buffer_size
        )
        try:
            engine = MooncakeServingEngine(
                model, client, staging_blocks=self.staging_blocks, identity=config.identity
            )
        except BaseException:
            client.close()
            raise
        return client, engine
