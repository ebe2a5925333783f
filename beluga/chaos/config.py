"""What a chaos round is asked to do: the fault kinds, their weights, the round's config.

The one home of :class:`ChaosConfig` (and of the command line that replays a
round), so that the driver and the report both read it without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from beluga.errors import BelugaError

KINDS = (
    "kill_server",
    "stop_server",
    "stall_server",
    "kill_writer",
    "kill_reader",
    "stop_writer",
    "stop_reader",
    "stop_mid_payload",
    "corrupt_rpc_line",
    "corrupt_rpc_buffer",
    "corrupt_header",
    "corrupt_payload",
    "corrupt_index",
)
WEIGHTS = {
    "kill_server": 4,
    "stop_server": 5,
    "stall_server": 3,  # only with standbys
    "kill_writer": 7,
    "kill_reader": 5,
    "stop_writer": 7,
    "stop_reader": 5,
    "stop_mid_payload": 9,
    "corrupt_rpc_line": 10,
    "corrupt_rpc_buffer": 9,
    "corrupt_header": 8,
    "corrupt_payload": 8,
    "corrupt_index": 8,
}
COHERENCE = ("native", "mixed", "model")


class ChaosError(BelugaError):
    """The chaos run itself could not proceed (not a finding about Beluga).

    Its message says what it waited for and how to rerun (seed, bounds).
    """


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.  ``seed=None`` draws one (it is printed and reported).

    Frozen (treat ``weights`` as read-only too): thread-safe and fork-safe.
    """

    faults: int = 200
    seed: int | None = None
    writers: int = 3
    inplace_writers: int = 2
    readers: int = 3
    keys_per_writer: int = 12
    coherence: str = "native"  # native | mixed (odd role slots model) | model (all)
    write_lease_s: float = 0.75
    read_lease_s: float = 0.5
    fault_interval_s: float = 0.3  # mean gap between faults
    hang_bound_s: float = 30.0
    rpc_timeout_s: float = 4.0
    connect_timeout_s: float = 6.0
    server_start_timeout_s: float = 30.0
    max_reuse_wait_s: float = 2.0  # past the lease, waiting for the extent to be reused
    pool_path: str | None = None  # default: a unique /dev/shm/beluga-chaos-* file
    pool_bytes: int = 64 << 20  # freed extents are reused within seconds; nothing is evicted
    block_size: int = 16 << 10  # pool block, bytes (Geometry.block_size)
    max_value_blocks: int = 3
    role_pause_s: float = 0.002
    settle_s: float = 1.5
    max_inject_s: float = 1200.0  # stop injecting after this long, whatever the count
    standbys: int = 0  # `beluga serve --standby` processes waiting beside the server
    takeover_after_s: float = 1.0  # the standbys' --takeover-after (the product default is 5)
    #: each server and standby a host of its own (BELUGA_EMULATED_HOST): a standby then sees
    #: a server only by its heartbeat and fences it with a --fence command, as across machines
    emulated_hosts: bool = False
    #: a writer client of a layer above chaos for writer slots 2, 5, ... (roles.CLIENTS):
    #: "mooncake", the Mooncake drop-in (import beluga.compat.mooncake.chaos first); None: none
    writer_client: str | None = None
    weights: dict[str, float] = field(default_factory=lambda: dict(WEIGHTS))

    def __post_init__(self) -> None:
        if self.coherence not in COHERENCE:
            raise ValueError(f"coherence must be one of {COHERENCE}, not {self.coherence!r}")
        if self.writers < 1 or self.inplace_writers < 0 or self.readers < 1:
            raise ValueError("a chaos run needs at least one writer and one reader")
        unknown = set(self.weights) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; the kinds are {KINDS}")
        if self.faults < 0 or self.write_lease_s <= 0 or self.hang_bound_s <= 0:
            raise ValueError("faults, write_lease_s and hang_bound_s must be positive")
        if not 0 <= self.standbys <= 8:
            raise ValueError(f"standbys must be 0..8, not {self.standbys}")
        if self.emulated_hosts and not self.standbys:
            raise ValueError("emulated_hosts is for standbys: give standbys >= 1")
        if self.takeover_after_s <= 0:
            raise ValueError(f"takeover_after_s must be above 0, not {self.takeover_after_s}")


def replay_command(seed: int, c: ChaosConfig) -> str:
    """The ``beluga chaos`` command line that replays a run's faults (``c``: its config)."""
    extra = "" if c.coherence == "native" else f" --coherence {c.coherence}"
    extra += f" --standby {c.standbys}" if c.standbys else ""
    extra += f" --takeover-after {c.takeover_after_s:g}" if c.takeover_after_s != 1.0 else ""
    extra += " --emulated-hosts" if c.emulated_hosts else ""
    return f"beluga chaos --seed {seed} --faults {c.faults}{extra}"
