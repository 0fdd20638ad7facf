"""Structured logging shared by the services: one JSON event per line, or a readable console view.

Configured explicitly by each entry point (never at import time)."""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

LOG_FORMATS = ("json", "console")


def add_log_format_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--log-format`` flag every service takes."""
    parser.add_argument("--log-format", dest="log_format", choices=LOG_FORMATS,
                        help="json (one JSON object a line) or console (one readable line an event); "
                             "default: console on a terminal, json otherwise")


def configure_logging(level: str = "info", json: bool | None = None, log_format: str | None = None) -> None:
    """Route structlog and stdlib logging to stderr.

    Args:
        level: "debug", "info", "warning" or "error".
        json: JSON lines when True, a console renderer when False; None picks JSON unless stderr
            is a terminal (production and CI get JSON, a developer's shell gets colours).
        log_format: "json" or "console" (a ``--log-format`` flag's value); overrides ``json``.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be one of debug/info/warning/error, got {level!r}")
    if log_format is not None:
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
        json = log_format == "json"
    if json is None:
        json = not sys.stderr.isatty()
    # Console: one line an event (an exception's traceback follows it), colours only on a terminal.
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(
        colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A structlog logger bound to a component name."""
    return structlog.get_logger(component=name)
