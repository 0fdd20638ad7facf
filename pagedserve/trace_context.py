"""What every service needs of traces without importing OpenTelemetry (``pagedserve.tracing``).

``tracer_for`` builds a service's ``Tracer`` only when ``--otlp-traces-endpoint`` is set: a service
without it never imports the SDK, and holds ``None`` where a tracer would be.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.tracing import Tracer

TRACEPARENT = "traceparent"  # the W3C trace context header (gRPC metadata keys are lower case too)


def tracer_for(endpoint: str | None, service_name: str) -> Tracer | None:
    """The service's tracer, exporting to ``endpoint``; None (and no import) without one."""
    if not endpoint:
        return None
    from pagedserve.tracing import Tracer

    return Tracer(endpoint, service_name)


def traceparent_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The ``traceparent`` of a call's metadata (gRPC's ``invocation_metadata()``), if any."""
    for key, value in metadata or ():
        if key == TRACEPARENT:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None
