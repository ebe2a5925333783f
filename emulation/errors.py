"""Errors of the QEMU sandbox, rooted in Beluga's one exception tree."""

from __future__ import annotations

from beluga.errors import BelugaError


class SandboxError(BelugaError):
    """The sandbox could not be built or a guest could not be run."""


class SandboxNotBuiltError(SandboxError):
    """QEMU, the kernel or the initramfs is missing: build the sandbox first."""


class TopologyError(ValueError):
    """A topology QEMU would refuse, or one that boots but cannot work."""
