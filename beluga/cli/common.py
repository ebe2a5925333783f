"""Options shared by command groups: which pool, how big, JSON output, and the one way
a config dataclass's fields become flags (:class:`ConfigFlag`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from beluga.pool import DEFAULT_POOL, POOL_ENV, resolve_pool
from beluga.units import parse_size


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    """--pool SPEC, or its pieces: --backend with --path/--node/--device (--path alone: shm)."""
    g = parser.add_argument_group("pool location")
    g.add_argument(
        "--pool",
        metavar="SPEC",
        help="pool spec, e.g. shm:/dev/shm/beluga, numa:1:/dev/shm/b, dax:/dev/dax0.0, "
        "interleave:2097152:dax:/dev/dax0.0,dax:/dev/dax1.0 "
        f"(default: ${POOL_ENV} or {DEFAULT_POOL})",
    )
    g.add_argument(
        "--backend",
        choices=["shm", "numa", "dax", "interleave"],
        help="build the spec from parts instead of --pool",
    )
    g.add_argument(
        "--path", help="shm/numa: the backing file (alone: --backend shm with this file)"
    )
    g.add_argument("--node", type=int, help="numa: the NUMA node to bind to")
    g.add_argument(
        "--device",
        action="append",
        default=[],
        help="dax/interleave: a /dev/daxX.Y device (repeat to interleave)",
    )
    g.add_argument(
        "--data-offset",
        type=parse_size,
        default=0,
        help="dax: start this far into the device (2 MiB multiple)",
    )
    g.add_argument(
        "--stripe",
        type=parse_size,
        default=2 << 20,
        help="interleave: stripe size (2 MiB multiple; default 2M)",
    )


def pool_spec(args: argparse.Namespace, default: str | None = DEFAULT_POOL) -> str:
    """The spec named by --pool or built from --backend and its parts (see resolve_pool).

    Raises:
        PoolNotNamedError: nothing names a pool and ``default`` is None.
    """
    backend = args.backend or ("shm" if args.path else None)  # --path alone: an shm pool
    if args.pool and backend:
        raise ValueError("give either --pool SPEC or --backend/--path with its options, not both")
    if not backend:
        if args.node is not None or args.device:
            raise ValueError("--node and --device need --backend numa, dax or interleave")
        return resolve_pool(args.pool, setting="--pool", default=default)
    path = args.path or "/dev/shm/beluga"
    if backend == "shm":
        return f"shm:{path}"
    if backend == "numa":
        if args.node is None:
            raise ValueError("--backend numa needs --node N (see 'beluga pool nodes')")
        return f"numa:{args.node}:{path}"
    if not args.device:
        raise ValueError(f"--backend {backend} needs --device /dev/daxX.Y")
    offset = f"@{args.data_offset}" if args.data_offset else ""
    devices = [f"dax:{d}{offset}" for d in args.device]
    if backend == "dax":
        if len(devices) > 1:
            raise ValueError("--backend dax takes one --device; use --backend interleave for more")
        return devices[0]
    return f"interleave:{args.stripe}:{','.join(devices)}"


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print (or write to FILE) a JSON document of named figures",
    )


_Config = TypeVar("_Config")
#: a ConfigFlag's default when the field's own is meant
FIELD_DEFAULT: Any = type("FieldDefault", (), {"__repr__": lambda self: "FIELD_DEFAULT"})()


@dataclass(frozen=True)
class ConfigFlag:
    """One field of a config dataclass as a command-line flag.

    The flag's default is the field's own (one home for every default) unless
    ``default`` overrides it; its type is the default's type unless ``type``
    says otherwise; a ``bool`` field is a switch.  ``help`` may name the default
    as ``{default}`` (``str.format``, so ``{default:g}`` works).

    Frozen: thread-safe and fork-safe.
    """

    field: str
    help: str
    #: the flag's name; default: ``--`` and the field's name with dashes
    flag: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = FIELD_DEFAULT
    choices: Sequence[str] | None = None
    metavar: str | None = None

    @property
    def name(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


def _field_default(config: type, name: str) -> Any:
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"{config.__name__}.{name} has no default to give its flag")
    raise ValueError(f"{config.__name__} has no field {name!r}")


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: type,
    flags: Sequence[ConfigFlag],
) -> None:
    """Add a flag per ``flags`` entry, each storing into its field's name (see
    :func:`config_from_args`)."""
    for flag in flags:
        default = (
            _field_default(config, flag.field) if flag.default is FIELD_DEFAULT else flag.default
        )
        text = flag.help.format(default=default)
        if isinstance(default, bool):
            if default:
                raise ValueError(f"{flag.name}: a switch's field must default to False")
            parser.add_argument(flag.name, dest=flag.field, action="store_true", help=text)
            continue
        kind = flag.type or (None if default is None else type(default))
        parser.add_argument(
            flag.name,
            dest=flag.field,
            type=kind,
            default=default,
            choices=flag.choices,
            # argparse's own metavar for the flag's name, whatever the field is called
            metavar=flag.metavar
            or (None if flag.choices else flag.name[2:].upper().replace("-", "_")),
            help=text,
        )


def config_from_args(
    config: type[_Config], args: argparse.Namespace, flags: Sequence[ConfigFlag], **fixed: Any
) -> _Config:
    """The config the flags of :func:`add_config_flags` name, with ``fixed`` fields besides."""
    return config(**{flag.field: getattr(args, flag.field) for flag in flags}, **fixed)
