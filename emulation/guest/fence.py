"""The sandbox's fence between two guests: a mailbox in CXL memory past the pool.

A real pod cuts a host off the pool through something outside it (the fabric
manager unbinds its port, the BMC powers it off); ``beluga serve --standby
--fence COMMAND`` runs that command.  The two guests of the ``shared``
topology have no such controller, so guest 0 runs one for itself: an agent
that watches a mailbox in the shared CXL device, beyond the pool's bytes,
and SIGKILLs its server when asked, then answers once the server is gone.

``python emulation/guest/fence.py`` is the fence command guest 1's standby
runs: it posts a request naming the server's pid (``BELUGA_FENCE_PID``),
waits for the agent's answer, and exits 0 only when the agent says that
process is gone (1 on a refusal or after :data:`WAIT_S`).

The mailbox is two 8-byte words a cache line apart (request, answer), each a
sequence number in the high 32 bits and a pid in the low 32, written with
plain stores: the harness, not the system under test, and QEMU's shared CXL
memory is one host file both guests' (cacheless, emulated) CPUs reach, so no
flush is needed for the other guest to see a store.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time

#: where the mailbox lies on the device: past the pool (64 MiB), at a mapping boundary
MAILBOX_AT = 128 << 20
MAP_BYTES = 2 << 20  # device dax maps in 2 MiB units
WAIT_S = 30.0
_WORD = struct.Struct("<Q")
REQUEST, ANSWER = 0, 64
REFUSED = 0xFFFFFFFF  # the answer's pid when the agent would not kill the process named


class Mailbox:
    """The two mailbox words on the shared device.  Not thread-safe; fork-unsafe."""

    def __init__(self, device: str) -> None:
        fd = os.open(device, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, MAP_BYTES, mmap.MAP_SHARED, offset=MAILBOX_AT)
        finally:
            os.close(fd)

    def read(self, at: int) -> tuple[int, int]:
        """(sequence, pid) of the word at ``at``."""
        (word,) = _WORD.unpack_from(self.map, at)
        return word >> 32, word & 0xFFFFFFFF

    def write(self, at: int, seq: int, pid: int) -> None:
        """Store (sequence, pid) at ``at``."""
        _WORD.pack_into(self.map, at, (seq << 32) | pid)

    def close(self) -> None:
        self.map.close()


class Agent:
    """Guest 0's fence controller: kills ``server`` when a request names its pid."""

    def __init__(self, mailbox: Mailbox, server: subprocess.Popen[bytes]) -> None:
        self.mailbox, self.server = mailbox, server
        self.fenced = threading.Event()
        self._stop = threading.Event()
        self.mailbox.write(REQUEST, 0, 0)
        self.mailbox.write(ANSWER, 0, 0)
        self._thread = threading.Thread(target=self._run, name="fence-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        answered = 0
        while not self._stop.wait(0.02):
            seq, pid = self.mailbox.read(REQUEST)
            if seq == answered:
                continue
            if pid != self.server.pid:
                self.mailbox.write(ANSWER, seq, REFUSED)
            else:
                self.server.send_signal(signal.SIGKILL)
                self.server.wait(WAIT_S)
                self.fenced.set()
                self.mailbox.write(ANSWER, seq, pid)
            answered = seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def request(device: str, pid: int, wait_s: float = WAIT_S) -> bool:
    """Ask guest 0's agent to fence ``pid``; True once it answers that the process is gone."""
    box = Mailbox(device)
    try:
        seq = box.read(REQUEST)[0] + 1
        box.write(REQUEST, seq, pid)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            got_seq, got_pid = box.read(ANSWER)
            if got_seq == seq:
                return got_pid == pid
            time.sleep(0.02)
        return False
    finally:
        box.close()


def main() -> int:
    pid = int(os.environ["BELUGA_FENCE_PID"])
    device = os.environ["BELUGA_DAX"]
    ok = request(device, pid)
    print(f"fence of pid {pid}: {'done' if ok else 'NOT done'}", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
