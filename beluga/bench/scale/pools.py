"""The scale benchmark's pools: their geometry, scratch pools, and values stored through the
metadata service driven directly (no RPC), as tests/test_service.py drives it."""

from __future__ import annotations

import time
import uuid

from beluga.coherence import digest
from beluga.kv import protocol as p
from beluga.pool import Geometry, Pool
from beluga.rpc import Request
from beluga.server.service import MetadataService

GEOMETRY = Geometry(max_hosts=16)
RPC_GEOMETRY = Geometry(max_hosts=17)  # 16 writing hosts and the server
BATCH = 256
WRITER = (1, 1)


def request(op: p.StoreOp, payload: bytes) -> Request:
    return Request(WRITER[0], int(op), payload, WRITER[1])


def scratch_pool(size: int) -> tuple[str, Pool]:
    path = f"/dev/shm/beluga-scale-{uuid.uuid4().hex[:8]}"
    return path, Pool.create(path, size, geometry=GEOMETRY, coherence="native")


def fill(pool: Pool, svc: MetadataService, keys: int, prefix: str) -> dict[str, float]:
    """Store ``keys`` one-block values through the service in batches; server-side seconds."""
    sb, mem = pool.superblock, pool.memory
    alloc_s = commit_s = 0.0
    for start in range(0, keys, BATCH):
        names = [f"{prefix}-{i}".encode() for i in range(start, min(keys, start + BATCH))]
        digests = [digest(k) for k in names]
        t = time.perf_counter()
        grants = p.decode_grants(
            svc.op_alloc(request(p.StoreOp.ALLOC, p.encode_alloc([(d, 64, 1) for d in digests])))
        )
        alloc_s += time.perf_counter() - t
        for d, g in zip(digests, grants, strict=True):
            mem.publish(
                sb.block_header_offset(g.block),
                sb.block_payload_offset(g.block),
                d,
                g.version,
                d * 4,
                writer=WRITER[0],
                writer_gen=WRITER[1],
            )
        t = time.perf_counter()
        payload = p.encode_commit(
            [(d, g.block, g.version) for d, g in zip(digests, grants, strict=True)]
        )
        svc.op_commit(request(p.StoreOp.COMMIT, payload))
        commit_s += time.perf_counter() - t
    return {"alloc_s": alloc_s, "commit_s": commit_s}
