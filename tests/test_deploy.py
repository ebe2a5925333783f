"""The systemd units in deploy/systemd run commands the beluga CLI accepts."""

from __future__ import annotations

import configparser
import os
import shlex
import string

import pytest

from beluga.cli import build_parser

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "deploy", "systemd")


def _env() -> dict[str, str]:
    out = {}
    with open(os.path.join(DEPLOY, "beluga.env")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                out[key] = value
    return out


def _unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(os.path.join(DEPLOY, name))
    return unit


@pytest.mark.parametrize(
    ("name", "standby", "port_key"),
    [
        ("beluga-serve.service", False, "BELUGA_METRICS_PORT"),
        ("beluga-standby.service", True, "BELUGA_STANDBY_METRICS_PORT"),
    ],
)
def test_a_unit_runs_beluga_serve_with_restart_and_metrics(
    name: str, standby: bool, port_key: str
) -> None:
    env = _env()
    service = _unit(name)["Service"]
    assert service["EnvironmentFile"] == "/etc/beluga/beluga.env"
    assert service["Restart"] in ("on-failure", "always")
    argv = shlex.split(string.Template(service["ExecStart"]).substitute(env))
    assert os.path.basename(argv[0]) == "beluga"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.standby is standby
    assert args.pool == env["BELUGA_POOL"] and args.coherence == env["BELUGA_COHERENCE"]
    assert args.metrics_port == int(env[port_key])
