"""The QEMU CXL developer sandbox.

THEORY OF OPERATION

Beluga's ``numa`` and ``dax`` backends need memory that a laptop or a CI box
does not have: a CPU-less NUMA node, a CXL Type-3 device behind /dev/dax0.0,
two hosts mapping the same CXL memory.  QEMU emulates all three.  A guest boots
Debian's own kernel with a tiny busybox initramfs, mounts the host's root
read-only over 9p, and runs the project's code *unmodified*, from this
checkout, with the host's Python, inside a chroot of that root.  Nothing is
installed in the guest, so what passes here is the code CI tests.

What the emulation is assumed to give, and what the checks in
``emulation/guest`` verify on it:

- ``numa``: node 1 has memory and no CPUs; pages bound to it land there.
- ``dax``: /dev/dax0.0 maps the CXL device; data written through it reads back.
- ``shared``: two guests whose devices share one memory file see each other's
  published blocks through their own /dev/dax0.0.

QEMU's software CPU (TCG) is coherent, so these runs prove the mapping and the
protocol, not the flushes; the non-coherent cache model in CI covers those.

    python -m emulation build
    python -m emulation run dax
    python -m emulation run shared

or from Python: ``emulation.run("dax", script, timeout) -> Result``.
"""

from emulation.builder import build
from emulation.errors import SandboxError, SandboxNotBuiltError, TopologyError
from emulation.runner import GuestResult, Result, run
from emulation.sandbox import Sandbox
from emulation.topology import TOPOLOGIES, Topology

__all__ = [
    "TOPOLOGIES",
    "GuestResult",
    "Result",
    "Sandbox",
    "SandboxError",
    "SandboxNotBuiltError",
    "Topology",
    "TopologyError",
    "build",
    "run",
]
