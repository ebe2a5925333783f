"""The beluga command: success paths print, failures exit non-zero with a message."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from beluga.cli import main
from beluga.cli.common import (
    ConfigFlag,
    add_config_flags,
    add_pool_args,
    config_from_args,
    pool_spec,
)
from beluga.errors import PoolNotNamedError


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "beluga", *args], capture_output=True, text=True, timeout=120
    )


def test_pool_create_info_destroy(shm_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "pool",
                "create",
                "--path",
                shm_path,
                "--backend",
                "shm",
                "--size",
                "32M",
                "--max-hosts",
                "4",
                "--label",
                "ci",
            ]
        )
        == 0
    )
    assert "created shm:" in capsys.readouterr().out
    assert main(["pool", "info", "--pool", shm_path, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["label"] == "ci" and facts["pool_size"] == 32 << 20
    assert main(["pool", "info", "--pool", shm_path]) == 0
    assert "max_hosts" in capsys.readouterr().out
    assert main(["pool", "destroy", "--pool", shm_path]) == 0
    assert not os.path.exists(shm_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pool", "info", "--pool", "/dev/shm/beluga-test-missing"], "beluga pool create"),
        (["pool", "create", "--pool", "/dev/shm/beluga-test-x", "--size", "3M"], "2 MiB"),
        (["pool", "create", "--pool", "rdma:x", "--size", "32M"], "unknown pool backend"),
        (["pool", "create", "--backend", "numa", "--size", "32M"], "--node"),
        (["bench", "memops", "--sizes", "12Q"], "not a size"),
    ],
)
def test_errors_exit_nonzero_with_a_message(args: list[str], message: str) -> None:
    out = run(*args)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_existing_pool_needs_force(shm_path: str) -> None:
    assert (
        run("pool", "create", "--pool", shm_path, "--size", "32M", "--max-hosts", "4").returncode
        == 0
    )
    again = run("pool", "create", "--pool", shm_path, "--size", "32M", "--max-hosts", "4")
    assert again.returncode == 1 and "--force" in again.stderr
    assert run("pool", "destroy", "--pool", shm_path).returncode == 0


@pytest.mark.leaves("writes")  # the memops bench seals blocks with no server
def test_bench_memops_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "memops", "--sizes", "64,16K", "--budget", "1M", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    figures = doc["figures"]
    for method in ("memcpy", "nt_store", "publish", "read_validated"):
        assert figures[f"memops.{method}.16KiB.p50_us"] > 0
        assert figures[f"memops.{method}.16KiB.p99_us"] >= figures[f"memops.{method}.16KiB.p50_us"]
    assert doc["machine"]["selected"]["crc"] in ("vpclmulqdq", "hw", "sw")


def test_bench_rpc_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "rpc", "--iterations", "200", "--duration", "0.05", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    for transport in ("slot-c", "slot-python", "tcp", "unix"):
        assert 0 < figures[f"rpc.{transport}.rtt_p50_us"] <= figures[f"rpc.{transport}.rtt_p99_us"]
        assert figures[f"rpc.{transport}.mops_d128"] > 0


def _pool_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_pool_args(parser)
    return parser.parse_args(list(argv))


def test_path_alone_names_an_shm_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    assert pool_spec(_pool_args("--path", "/dev/shm/x")) == "shm:/dev/shm/x"
    assert pool_spec(_pool_args("--backend", "numa", "--node", "1", "--path", "/p")) == "numa:1:/p"
    with pytest.raises(ValueError, match="not both"):
        pool_spec(_pool_args("--pool", "shm:/a", "--path", "/b"))
    with pytest.raises(ValueError, match="need --backend"):
        pool_spec(_pool_args("--node", "1"))


def test_pool_is_the_flag_else_the_environment_else_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    assert pool_spec(_pool_args()) == "shm:/dev/shm/beluga"
    with pytest.raises(PoolNotNamedError, match="set --pool to a pool spec"):
        pool_spec(_pool_args(), default=None)  # a bench then makes a scratch pool
    monkeypatch.setenv("BELUGA_POOL", "shm:/dev/shm/from-env")
    assert (
        pool_spec(_pool_args()) == pool_spec(_pool_args(), default=None) == "shm:/dev/shm/from-env"
    )
    assert pool_spec(_pool_args("--pool", "shm:/dev/shm/flag")) == "shm:/dev/shm/flag"


def test_a_missing_pool_names_the_command_that_creates_it(shm_path: str) -> None:
    out = run("pool", "info", "--path", shm_path)
    assert out.returncode != 0 and f"beluga pool create --pool shm:{shm_path}" in out.stderr
    assert run("pool", "create", "--path", shm_path, "--size", "64M").returncode == 0
    assert run("pool", "info", "--path", shm_path).returncode == 0
    assert run("pool", "destroy", "--path", shm_path).returncode == 0
    assert not os.path.exists(shm_path)


def test_a_config_flag_defaults_to_its_field_and_fills_it() -> None:
    from beluga.chaos.config import ChaosConfig
    from beluga.cli.chaos import ROUND_FLAGS, SETUP_FLAGS

    flags = ROUND_FLAGS + SETUP_FLAGS
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ChaosConfig, flags)
    config = config_from_args(ChaosConfig, parser.parse_args([]), flags)
    assert config == ChaosConfig(faults=1000)  # the config's own defaults, --faults aside
    args = parser.parse_args(
        ["--write-lease", "2.5", "--pool-size", "32M", "--standby", "2", "--emulated-hosts"]
    )
    config = config_from_args(ChaosConfig, args, flags, writer_client="mooncake")
    assert (config.write_lease_s, config.pool_bytes, config.standbys) == (2.5, 32 << 20, 2)
    assert config.emulated_hosts and config.writer_client == "mooncake"


def test_a_config_flag_names_a_field_the_config_has() -> None:
    from beluga.bench.vllm import Trace

    with pytest.raises(ValueError, match="Trace has no field 'prefix'"):
        add_config_flags(argparse.ArgumentParser(), Trace, [ConfigFlag("prefix", "")])
