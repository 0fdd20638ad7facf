"""The one error scheme of the services.

- bad input from a caller: ``InvalidArgument`` (INVALID_ARGUMENT), its message naming the field;
  it is the only type mapped to INVALID_ARGUMENT: a bare ``ValueError`` escaping a handler is a
  bug like any other exception and surfaces as INTERNAL;
- a request that is well-formed but does not fit the current state: ``PreconditionError``
  (FAILED_PRECONDITION), e.g. attaching a model whose layout differs from the existing pool;
- a request id that is already running: ``AlreadyExistsError`` (ALREADY_EXISTS);
- a full queue: ``ResourceExhaustedError`` (RESOURCE_EXHAUSTED), answered at once;
- a dependency that is down (the memory service, every backend): ``UnavailableError`` (UNAVAILABLE);
- the caller's deadline passed while a dependency worked: ``DeadlineExceededError``;
- a caller that is known but not allowed what it asks: ``PermissionDeniedError``;
- a call without the credential its target needs: ``UnauthenticatedError`` (UNAUTHENTICATED);
- one request failed on its own (its sampling, detokenizing, stop checks), the others run on:
  ``RequestFailedError`` (INTERNAL with its message; the failure was logged where it happened);
- a client that stopped reading its stream for longer than the write-stall timeout:
  ``StreamStalledError``, a DeadlineExceededError (the request is aborted, its blocks freed);
- running out of KV blocks is not an error at all but a normal result;
- anything else is a bug and surfaces as INTERNAL with the exception logged with its traceback.

The mapping to status codes lives once, in ``pagedserve.rpc``. Messages echo what the caller sent
through ``echo``, which keeps them short whatever the caller sent (gRPC carries the message in a
metadata header, and a header beyond the limit turns the answer into RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

# Characters of a caller's value that an error message repeats; the rest becomes "...".
ECHO_CHARS = 64


class InvalidArgument(ValueError):
    """The caller sent bad input; the message names the field as the wire spells it."""


class PreconditionError(Exception):
    """The request is valid but the service's state does not allow it."""


class AlreadyExistsError(Exception):
    """The request names something (a request id) that already exists."""


class ResourceExhaustedError(Exception):
    """The service is at a configured limit (queue length, streams per client); retry later."""


class UnavailableError(Exception):
    """A service this one depends on cannot be reached; retry, possibly elsewhere."""


class DeadlineExceededError(Exception):
    """The caller's deadline passed before the answer was complete."""


class PermissionDeniedError(Exception):
    """The caller is who it says, but may not do what it asks (a limit its operator set)."""


class UnauthenticatedError(Exception):
    """The call lacks the credential (a service token) that what it names requires."""


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters (plus "..."), for error messages.

    A string is cut before ``repr`` so that a megabyte-long value costs nothing to echo; a huge
    integer is described by its size (its decimal text costs quadratic time, and beyond 4,300
    digits Python refuses to make it at all).
    """
    if isinstance(value, str | bytes) and len(value) > limit:
        return repr(value[:limit]) + "..."
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # > limit decimal digits, surely
        sign = "-" if value < 0 else ""
        return f"{sign}an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class RequestFailedError(Exception):
    """One request failed on its own (not the service): INTERNAL, with this message."""


class StreamStalledError(DeadlineExceededError):
    """The client did not read its stream for longer than the write-stall timeout."""
