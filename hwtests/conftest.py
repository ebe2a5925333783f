"""What hardware to test, checked before any test touches it.

Configuration, from the environment:

``BELUGA_HW_DAX``
    comma-separated device-DAX devices, ``/dev/daxX.Y`` or ``/dev/daxX.Y@OFFSET``
    (several are also tested interleaved every 2 MiB).  **The tests overwrite
    them**: name scratch devices only.
``BELUGA_HW_NUMA``
    a NUMA node number: CXL memory onlined as system RAM (a CPU-less node).
``BELUGA_HW_STAND_IN=1``
    the chicken bit for CI: accept regular files standing in for devices and a
    node that has CPUs, so that this suite itself can run where there is no
    hardware.  Never set it in the lab.

Nothing configured: every hardware test skips and says what to set.  Something
configured but wrong (missing, not device-DAX, too small, no such node, a node
with CPUs, too little free memory): the tests fail and say what is wrong.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from beluga.pool.dax import DaxBackend
from hwtests.hwconfig import STRIPE, HwConfig, dax_problems, numa_problems, numa_spec


@pytest.fixture(scope="session")
def hw_config() -> HwConfig:
    config = HwConfig.from_env()
    if not config.dax and config.numa is None:
        pytest.skip(
            "no CXL hardware configured: set BELUGA_HW_DAX=/dev/daxX.Y[,...] (scratch devices: "
            "the tests overwrite them) and/or BELUGA_HW_NUMA=N (a CPU-less node)"
        )
    return config


@pytest.fixture(scope="session")
def dax_config(hw_config: HwConfig) -> HwConfig:
    """The configuration, when it names devices (not yet checked)."""
    if not hw_config.dax:
        pytest.skip("BELUGA_HW_DAX is not set (no device-DAX devices to test)")
    return hw_config


@pytest.fixture(scope="session")
def numa_config(hw_config: HwConfig) -> HwConfig:
    """The configuration, when it names a node (not yet checked)."""
    if hw_config.numa is None:
        pytest.skip("BELUGA_HW_NUMA is not set (no NUMA node to test)")
    return hw_config


@pytest.fixture(scope="session")
def hw_dax(dax_config: HwConfig) -> list[str]:
    """Checked device specs (``dax:PATH[@OFFSET]``); a wrong configuration fails here."""
    problems = dax_problems(dax_config)
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    return [DaxBackend.from_spec(entry).spec for entry in dax_config.dax]


@pytest.fixture(scope="session")
def hw_numa(numa_config: HwConfig) -> int:
    """The checked node; a wrong configuration fails here."""
    problems = numa_problems(numa_config)
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    assert numa_config.numa is not None
    return int(numa_config.numa)


@pytest.fixture(params=["dax", "numa"])
def hw_target(request: pytest.FixtureRequest) -> Iterator[str]:
    """A spec for a pool on each configured kind of memory (devices interleaved if several)."""
    if request.param == "dax":
        specs = request.getfixturevalue("hw_dax")
        yield specs[0] if len(specs) == 1 else f"interleave:{STRIPE}:{','.join(specs)}"
        return
    spec = numa_spec(request.getfixturevalue("hw_numa"))
    yield spec
    path = spec.split(":", 2)[2]
    for leftover in (path, path + ".creating"):
        if os.path.exists(leftover):
            os.unlink(leftover)
