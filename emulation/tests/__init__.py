"""Tests of the QEMU sandbox and its runner."""

from __future__ import annotations

import psutil


def running_children() -> list[psutil.Process]:
    """Child processes of this test process still running (zombies aside), except
    multiprocessing's resource tracker: a helper each interpreter starts at its first
    spawn and keeps until it exits (another module's test may have started it)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() == psutil.STATUS_ZOMBIE:
                continue
            if "multiprocessing.resource_tracker" in " ".join(c.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(c)
    return out
