"""Config loading shared by the services: typed dataclasses filled from a JSON file, then CLI flags.

Each service owns a frozen dataclass that validates itself in ``__post_init__``; this module only
merges the sources. Precedence: dataclass defaults < JSON config file < flags given on the command
line. The JSON file uses the source document's keys (``block_size``, ``max_num_blocks``,
``enable_prefix_caching``, ``memory_utilization_threshold``) plus any other field name of the
dataclass; unknown keys are an error, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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
    flags by hand."""
    path = Path(path)
    path.touch(mode=0o600)
    path.write_text(json.dumps(dataclasses.asdict(config), indent=1))
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


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from ``--config`` (if any) and the other parsed flags."""
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    return build_config(cls, file_values, vars(args))
