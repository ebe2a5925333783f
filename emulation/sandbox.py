"""Where the built sandbox lives, and loading it for a run."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from emulation.errors import SandboxNotBuiltError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO = PACKAGE_DIR.parent
GUEST_DIR = PACKAGE_DIR / "guest"
CACHE = PACKAGE_DIR / ".cache"
STAMP = CACHE / "sandbox.json"
KERNEL = CACHE / "vmlinuz"
INITRAMFS = CACHE / "initramfs.cpio.gz"
RUNS = CACHE / "runs"

QEMU = "qemu-system-x86_64"
#: How QEMU runs the guest CPU.  ``tcg`` (software) works everywhere; ``kvm``
#: only where nested virtualisation really boots a guest, which the build
#: finds out by trying.  The variable overrides what the build found.
ACCEL_ENV = "BELUGA_QEMU_ACCEL"
ACCELS = ("tcg", "kvm")


@dataclass(frozen=True)
class Sandbox:
    """What a run needs: QEMU, the built kernel and initramfs, and how to accelerate."""

    qemu: str
    kernel: Path
    initramfs: Path
    kernel_release: str
    accel: str

    @classmethod
    def load(cls) -> Sandbox:
        """The built sandbox, or an error that says how to build it."""
        qemu = shutil.which(QEMU)
        missing = [] if qemu else [QEMU]
        missing += [p.name for p in (KERNEL, INITRAMFS, STAMP) if not p.exists()]
        if qemu is None or missing:
            raise SandboxNotBuiltError(
                f"the QEMU sandbox is not built (missing: {', '.join(missing)}); "
                "run python -m emulation build first"
            )
        try:
            stamp = json.loads(STAMP.read_text())
            release, accel = stamp["kernel_release"], stamp["accel"]
        except (ValueError, KeyError) as e:
            raise SandboxNotBuiltError(
                f"{STAMP} is damaged ({e}); run python -m emulation build first"
            ) from e
        return cls(qemu, KERNEL, INITRAMFS, release, accel_override() or accel)


def accel_override() -> str | None:
    """The accelerator forced by BELUGA_QEMU_ACCEL, if any."""
    accel = os.environ.get(ACCEL_ENV)
    if accel is not None and accel not in ACCELS:
        raise ValueError(f"{ACCEL_ENV} must be one of {', '.join(ACCELS)}, not {accel!r}")
    return accel
