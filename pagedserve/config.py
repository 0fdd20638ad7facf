"""Config loading shared by the services: typed dataclasses filled from a JSON file, then CLI flags.

Each service owns a frozen dataclass that validates itself in ``__post_init__``, built on
``ServiceConfig`` (what every service has: metrics endpoint, log level); this module merges the
sources and derives each service's flags from its dataclass (name, type, default), so that a
default is written once, in the dataclass. Precedence: dataclass defaults < JSON config file <
flags given on the command line. The JSON file uses the source document's keys (``block_size``, ``max_num_blocks``,
``enable_prefix_caching``, ``memory_utilization_threshold``) plus any other field name of the
dataclass; unknown keys are an error, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pagedserve.log import add_log_format_flag
from pagedserve.process import add_parent_pid_flag

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServiceConfig:
    """The settings every service has, validated here once; each service's config extends it.

    Args:
        metrics_port: Prometheus metrics over HTTP on this port (None = no metrics server; 0 = any
            free port).
        metrics_host: the metrics server's bind address (it has no authentication: keep it local).
        log_level: one of LOG_LEVELS.
        otlp_traces_endpoint: send spans over OTLP/gRPC to this collector, ``http://HOST:PORT`` or
            ``https://HOST:PORT`` (None = no traces; pagedserve/tracing.py).
    """

    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a TCP port in [0, 65536), got {self.metrics_port}")
        if not self.metrics_host:
            raise ValueError("metrics_host must be a bind address, got an empty string")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not (endpoint.startswith(("http://", "https://")) and len(endpoint) > 8):
            raise ValueError(f"otlp_traces_endpoint must be http://HOST:PORT or https://HOST:PORT, got {endpoint!r}")


# Help for ServiceConfig's flags, which every service takes.
SERVICE_FLAGS = {
    "metrics_port": "serve Prometheus metrics over HTTP on this port (0 = any free port)",
    "metrics_host": "bind address of the metrics server (it has no authentication)",
    "log_level": "/".join(LOG_LEVELS),
    "otlp_traces_endpoint": "send trace spans over OTLP/gRPC to this collector, http://HOST:PORT or https://HOST:PORT "
                            "(default: no traces); a W3C traceparent from the caller is followed",
}


def check_listen(name: str, value: str, *, allow_unix: bool = True) -> None:
    """A listening address: ``host:port``, or ``unix:PATH`` where allowed; ValueError names ``name``."""
    if allow_unix and value.startswith("unix:"):
        if len(value) == len("unix:"):
            raise ValueError(f"{name} must be unix:PATH with a path, got {value!r}")
        return
    if ":" not in value:
        raise ValueError(f"{name} must be host:port{' or unix:PATH' if allow_unix else ''}, got {value!r}")


def parse_bool(text: str) -> bool:
    """A flag's true/false (also 1/0, yes/no, on/off)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_config_flags(parser: argparse.ArgumentParser, cls: type, helps: Mapping[str, str],
                     flag_names: Mapping[str, str] | None = None) -> None:
    """One flag per field of dataclass ``cls`` named in ``helps``, derived from the field: the flag
    ``--field-name`` (or ``flag_names[field]``), its type (``X | None`` is X; a bool takes
    true/false or nothing for true; a tuple is given once per item), and its default appended to
    the help. A flag not given parses as None, so ``build_config`` keeps the file's value or the
    dataclass default."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, text in helps.items():
        kind = _without_none(hints[name])
        default = fields[name].default
        if default in (None, (), dataclasses.MISSING):
            shown = ""
        else:
            shown = f" (default {str(default).lower() if isinstance(default, bool) else default})"
        kwargs: dict[str, Any] = {"dest": name, "help": (text + shown).replace("%", "%%")}
        if kind is bool:
            kwargs |= {"type": parse_bool, "nargs": "?", "const": True, "metavar": "true|false"}
        elif typing.get_origin(kind) is tuple:
            kwargs |= {"action": "append"}
        else:
            kwargs |= {"type": kind}
        parser.add_argument((flag_names or {}).get(name, "--" + name.replace("_", "-")), **kwargs)


def _without_none(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        [kind] = [k for k in typing.get_args(kind) if k is not type(None)]
    return kind


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a JSON object from ``path``; ValueError names the file on any problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def write_config_file(config: object, path: str | Path) -> Path:
    """Writes a config dataclass as the JSON object ``read_config_file`` reads (owner-only: 0600).
    How a whole config reaches a child service (``--config PATH``) without being turned back into
    flags by hand. Fields marked ``metadata={"secret": True}`` (a token) are left out: the child
    reads those from their own file."""
    path = Path(path)
    path.touch(mode=0o600)
    secrets = {f.name for f in dataclasses.fields(config) if f.metadata.get("secret")}
    values = {k: v for k, v in dataclasses.asdict(config).items() if k not in secrets}
    path.write_text(json.dumps(values, indent=1))
    return path


def build_config(cls: type[T], file_values: dict[str, Any], flag_values: dict[str, Any]) -> T:
    """Instantiate dataclass ``cls`` from file values overridden by flags that were given.

    Args:
        cls: a dataclass type.
        file_values: keys from the config file; every key must be a field of ``cls``.
        flag_values: parsed CLI flags; a value of None means "not given" and is skipped.
    Returns:
        The validated config (the dataclass's own ``__post_init__`` raises ValueError).
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(file_values) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(names)}")
    merged = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if k in names and v is not None})
    return cls(**merged)


def add_config_file_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=str, default=None, help="JSON config file (flags override it)")


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every service takes: ``--config``, ServiceConfig's, ``--log-format`` and ``--parent-pid``."""
    add_config_file_flag(parser)
    add_config_flags(parser, ServiceConfig, SERVICE_FLAGS)
    add_log_format_flag(parser)
    add_parent_pid_flag(parser)


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from ``--config`` (if any) and the other parsed flags (a tuple field's repeated
    flag arrives as a list and becomes a tuple)."""
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    flags = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    return build_config(cls, file_values, flags)
