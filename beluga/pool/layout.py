"""The self-describing pool: superblock and region table.

Offset 0 holds the superblock; every region starts on a 2 MiB boundary (a
device-DAX mapping is 2 MiB aligned, and so are our offsets on a tmpfs file)::

    [0, 2 MiB)        superblock (first 4 KiB), the RPC server's doorbell (two
                      wake-up lines at 4 KiB, see beluga.rpc), rest reserved
    host region       host lines (each written only by its holder), grant lines
                      and claim answers (written only by the server), the claim
                      lobby and the server seat (beluga.pool.hosts owns the format)
    RPC area          one ring per client host (layout owned by beluga.rpc;
                      a ring opens with control, status and two wake-up lines)
    index             the pool-resident hash index: buckets of one line each,
                      written only by the metadata server, probed by every host
                      with loads; then per host a hint counts line and a ring of
                      hints, each written only by that host (index.c owns the
                      formats; beluga.server.index is the server's writer)
    data area         block header table (one line per block), the commit table
                      (one u64 per block: the version the server committed) and the
                      service line (the server's persistent counters), both written
                      only by the server, then payloads

The superblock is written once, by the creator, and sealed with a CRC32C.
Attaching checks magic, layout version, checksum, sizes and the region table,
and refuses a mismatch with an error that says what to do.
"""

from __future__ import annotations

import struct
import time
import uuid
from dataclasses import asdict, dataclass, replace

from beluga._native import _core
from beluga.coherence import LINE, seal_record, unseal_record
from beluga.errors import LayoutVersionError, PoolError

MAGIC = b"BELUGA\x00P"
LAYOUT_VERSION = 4  # 2: host grants, claim lobby, server seat, commit table; 3: index region;
# 4: keys digested with BLAKE3 (blake3.c), not BLAKE2b
REGION_ALIGN = 2 << 20
SUPERBLOCK_BYTES = 4096
LABEL_BYTES = 64

_FORMAT = struct.Struct("<8sIIQ16sIIQIIQQQQQQQQQQ64sQQQ")


def align_up(value: int, align: int = REGION_ALIGN) -> int:
    return (value + align - 1) // align * align


def lobby_lines(max_hosts: int) -> int:
    """Claim-request lines of the lobby: twice the hosts, so collisions stay rare."""
    return min(1024, max(16, 2 * max_hosts))


def host_region_lines(max_hosts: int) -> int:
    """Lines of the host region: hosts, grants, lobby, answers, server seat."""
    return 2 * max_hosts + 2 * lobby_lines(max_hosts) + 1


COMMIT_BYTES = 8  # one little-endian u64 per block in the commit table
IX_SLOTS = _core.IX_SLOTS  # entries per index bucket (index.c)
IX_HINT_LINES = _core.IX_HINT_LINES  # lines of each host's hints after the buckets


def index_buckets(nblocks: int) -> int:
    """Buckets for ``nblocks`` blocks: a power of two >= nblocks (a third of the slots fill).

    Every value holds at least one block, so entries never outnumber blocks;
    with two buckets per key and three slots per bucket, cuckoo insertion at
    that load practically never needs more than a few moves.
    """
    return 1 << (max(2, nblocks) - 1).bit_length()


def index_bytes(nblocks: int, max_hosts: int) -> int:
    """Bytes of the index region: the buckets, then each host's hint lines."""
    return (index_buckets(nblocks) + max_hosts * IX_HINT_LINES) * LINE


@dataclass(frozen=True)
class Region:
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Geometry:
    """What a pool is made of; chosen at create time, fixed afterwards."""

    max_hosts: int = 32
    rpc_bytes_per_host: int = 1 << 20
    block_size: int = 64 << 10  # pool block, bytes

    def __post_init__(self) -> None:
        if not 1 <= self.max_hosts <= 4096:
            raise ValueError(f"max_hosts must be in 1..4096, not {self.max_hosts}")
        if self.rpc_bytes_per_host < 4096 or self.rpc_bytes_per_host % 4096:
            raise ValueError(
                "rpc_bytes_per_host must be a positive multiple of 4096, "
                f"not {self.rpc_bytes_per_host}"
            )
        if self.block_size < 4096 or self.block_size % 4096:
            raise ValueError(
                f"block_size must be a positive multiple of 4096, not {self.block_size}"
            )


@dataclass(frozen=True)
class Superblock:
    pool_size: int
    uuid: bytes
    created_ns: int
    max_hosts: int
    hosts: Region
    rpc: Region
    index: Region  # the pool-resident hash index, then the hosts' hint lines
    headers: Region  # block header table (data area, part 1)
    payloads: Region  # block payloads (data area, part 3)
    block_size: int  # pool block, bytes
    nblocks: int
    nbuckets: int = 0  # index buckets (a power of two)
    label: str = ""
    layout_version: int = LAYOUT_VERSION
    line_size: int = LINE
    flags: int = 0

    @property
    def rpc_bytes_per_host(self) -> int:
        """Bytes of each host's ring: the RPC area shared out, in whole 4 KiB pages."""
        return self.rpc.length // self.max_hosts // 4096 * 4096

    def block_header_offset(self, block: int) -> int:
        return self.headers.offset + block * LINE

    def block_payload_offset(self, block: int) -> int:
        return self.payloads.offset + block * self.block_size

    def hint_offset(self, host_id: int) -> int:
        """The first of ``host_id``'s hint lines (its counts line), after the buckets."""
        return self.index.offset + (self.nbuckets + host_id * IX_HINT_LINES) * LINE

    @property
    def commits(self) -> Region:
        """The commit table (data area, part 2): right after the header table."""
        return Region(self.headers.offset + self.nblocks * LINE, self.nblocks * COMMIT_BYTES)

    def block_commit_offset(self, block: int) -> int:
        return self.commits.offset + block * COMMIT_BYTES

    @property
    def service_offset(self) -> int:
        """The service line (data area, part 2, after the commit table)."""
        return align_up(self.commits.end, LINE)

    def describe(self) -> dict[str, object]:
        d = asdict(self)
        d["uuid"] = str(uuid.UUID(bytes=self.uuid))
        return d

    def pack(self) -> bytes:
        label = self.label.encode()
        if len(label) > LABEL_BYTES:
            raise ValueError(f"a pool label is at most {LABEL_BYTES} bytes of UTF-8")
        body = _FORMAT.pack(
            MAGIC,
            self.layout_version,
            SUPERBLOCK_BYTES,
            self.pool_size,
            self.uuid,
            self.line_size,
            REGION_ALIGN,
            self.created_ns,
            self.max_hosts,
            self.flags,
            self.hosts.offset,
            self.hosts.length,
            self.rpc.offset,
            self.rpc.length,
            self.headers.offset,
            self.headers.length,
            self.payloads.offset,
            self.payloads.length,
            self.block_size,
            self.nblocks,
            label,
            self.index.offset,
            self.index.length,
            self.nbuckets,
        )
        return seal_record(body, SUPERBLOCK_BYTES)  # the checksum covers the 4 KiB before it


def plan(pool_size: int, geometry: Geometry, label: str = "") -> Superblock:
    """Lay out a pool of ``pool_size`` bytes, or say why it cannot hold one block."""
    if pool_size <= 0 or pool_size % REGION_ALIGN:
        raise ValueError(
            f"pool size must be a positive multiple of 2 MiB ({REGION_ALIGN}), not {pool_size}"
        )
    hosts = Region(REGION_ALIGN, align_up(host_region_lines(geometry.max_hosts) * LINE))
    rpc = Region(hosts.end, align_up(geometry.max_hosts * geometry.rpc_bytes_per_host))
    per_block = LINE + COMMIT_BYTES  # header and commit word of each block
    room = pool_size - rpc.end
    nblocks = max(0, (room - 2 * REGION_ALIGN) // (geometry.block_size + per_block))

    def need(n: int) -> int:
        ix = align_up(index_bytes(n, geometry.max_hosts))
        return ix + align_up(n * per_block + 2 * LINE) + n * geometry.block_size

    while nblocks and need(nblocks) > room:
        nblocks -= 1
    index = Region(rpc.end, align_up(index_bytes(max(nblocks, 1), geometry.max_hosts)))
    data_off = index.end
    if nblocks < 1:
        need = data_off + REGION_ALIGN + align_up(geometry.block_size)
        raise ValueError(
            f"a {pool_size}-byte pool cannot hold one {geometry.block_size}-byte pool block after "
            f"{data_off} bytes of superblock, host table, RPC area and index; use at least "
            f"{align_up(need)} bytes, or fewer --max-hosts"
        )
    headers = Region(data_off, align_up(nblocks * per_block + 2 * LINE))  # + commits, service
    payloads = Region(headers.end, nblocks * geometry.block_size)
    return Superblock(
        pool_size=pool_size,
        uuid=uuid.uuid4().bytes,
        created_ns=time.time_ns(),
        max_hosts=geometry.max_hosts,
        hosts=hosts,
        rpc=rpc,
        index=index,
        headers=headers,
        payloads=payloads,
        block_size=geometry.block_size,
        nblocks=nblocks,
        nbuckets=index_buckets(nblocks),
        label=label,
    )


def blocks_holding(nbytes: int, geometry: Geometry) -> int:
    """Blocks of ``geometry`` whose payloads hold ``nbytes`` bytes (at least one)."""
    if nbytes < 0:
        raise ValueError(f"a byte count is not negative, not {nbytes}")
    return max(1, -(-nbytes // geometry.block_size))


def pool_size_for(blocks: int, geometry: Geometry, align: int = REGION_ALIGN) -> int:
    """The smallest pool size (a multiple of ``align``) that :func:`plan` gives ``blocks`` blocks.

    The inverse of ``plan(size, geometry).nblocks``, which never falls as
    the size grows; ``align`` is a multiple of 2 MiB (an interleaved pool's stripe).
    """
    if blocks < 1:
        raise ValueError(f"a pool holds at least one block, not {blocks}")
    if align < REGION_ALIGN or align % REGION_ALIGN:
        raise ValueError(f"a pool size is aligned to a multiple of 2 MiB, not {align}")
    size = align_up(blocks * (geometry.block_size + LINE), align)  # a lower bound: no regions yet
    while True:
        try:
            if plan(size, geometry).nblocks >= blocks:
                return size
        except ValueError:
            pass  # not even one block fits yet
        size += align


def _check_header(raw: bytes, where: str) -> None:
    """Refuse what is not a superblock of this layout version, or is corrupted."""
    magic, version = _FORMAT.unpack_from(raw)[:2]
    if magic != MAGIC:
        raise PoolError(
            f"{where} is not a Beluga pool (no superblock magic); create one with "
            "'beluga pool create', or --force to overwrite whatever is there"
        )
    if version > LAYOUT_VERSION:
        raise LayoutVersionError(
            f"{where} was made with layout version {version}, newer than this Beluga's "
            f"{LAYOUT_VERSION}; upgrade Beluga on this host"
        )
    if version < LAYOUT_VERSION:
        raise LayoutVersionError(
            f"{where} uses old layout version {version}; this Beluga reads version "
            f"{LAYOUT_VERSION}: recreate the pool with 'beluga pool create --force'"
        )
    if unseal_record(raw[:SUPERBLOCK_BYTES]) is None:
        raise PoolError(
            f"{where} has a corrupted superblock (checksum mismatch); the pool cannot be "
            "trusted: destroy it and create it again"
        )


def _problems(sb: Superblock, sb_bytes: int, align: int, mapped_size: int) -> list[str]:
    """What is inconsistent in a decoded superblock (nothing, for a sound one)."""
    problems = []
    if sb_bytes != SUPERBLOCK_BYTES or align != REGION_ALIGN:
        problems.append(f"superblock size {sb_bytes} / alignment {align} not understood")
    if sb.line_size != LINE:
        problems.append(f"line size {sb.line_size} differs from this host's {LINE}")
    if sb.pool_size > mapped_size:
        problems.append(
            f"it claims {sb.pool_size} bytes but only {mapped_size} are mapped (truncated?)"
        )
    prev_end = REGION_ALIGN
    for r in (sb.hosts, sb.rpc, sb.index, sb.headers, sb.payloads):
        if r.offset % REGION_ALIGN or r.offset < prev_end or r.end > sb.pool_size:
            problems.append(f"region [{r.offset}, {r.end}) is misplaced")
        prev_end = max(prev_end, r.end)
    max_hosts, nblocks, nbuckets = sb.max_hosts, sb.nblocks, sb.nbuckets
    if (
        max_hosts < 1
        or sb.hosts.length < host_region_lines(max_hosts) * LINE
        or sb.rpc.length < max(max_hosts, 1) * 4096
    ):
        problems.append(f"host table does not fit {max_hosts} hosts")
    if (
        sb.block_size < 4096
        or nblocks < 1
        or sb.headers.length < nblocks * (LINE + COMMIT_BYTES) + 2 * LINE
        or sb.payloads.length != nblocks * sb.block_size
    ):
        problems.append("data area does not match its block count")
    if (
        nbuckets < 1
        or nbuckets & (nbuckets - 1)
        or nbuckets < nblocks
        or sb.index.length < (nbuckets + max_hosts * IX_HINT_LINES) * LINE
    ):
        problems.append(f"index of {nbuckets} buckets does not fit its region or block count")
    return problems


def unpack(raw: bytes, mapped_size: int, where: str = "the pool") -> Superblock:
    """Decode and check a superblock read from a mapping of ``mapped_size`` bytes."""
    if len(raw) < SUPERBLOCK_BYTES:
        raise PoolError(f"{where} is too small to hold a Beluga superblock")
    _check_header(raw, where)
    (
        _,
        version,
        sb_bytes,
        pool_size,
        uid,
        line,
        align,
        created,
        max_hosts,
        flags,
        h_off,
        h_len,
        r_off,
        r_len,
        hd_off,
        hd_len,
        p_off,
        p_len,
        block_size,
        nblocks,
        label,
        ix_off,
        ix_len,
        nbuckets,
    ) = _FORMAT.unpack_from(raw)
    sb = Superblock(
        pool_size=pool_size,
        uuid=uid,
        created_ns=created,
        max_hosts=max_hosts,
        hosts=Region(h_off, h_len),
        rpc=Region(r_off, r_len),
        index=Region(ix_off, ix_len),
        headers=Region(hd_off, hd_len),
        payloads=Region(p_off, p_len),
        block_size=block_size,
        nblocks=nblocks,
        nbuckets=nbuckets,
        layout_version=version,
        line_size=line,
        flags=flags,
    )
    problems = _problems(sb, sb_bytes, align, mapped_size)
    if problems:
        raise PoolError(
            f"{where} has an inconsistent superblock: {'; '.join(problems)}; "
            "destroy it and create it again"
        )
    try:
        text = label.rstrip(b"\0").decode()
    except UnicodeDecodeError as e:
        raise PoolError(f"{where} has an undecodable label; recreate the pool") from e
    return replace(sb, label=text)
