"""The one error scheme of the services.

- bad input from a caller: ``ValueError`` (mapped to INVALID_ARGUMENT by the server interceptor);
- a request that is well-formed but does not fit the current state: ``PreconditionError``
  (FAILED_PRECONDITION), e.g. attaching a model whose layout differs from the existing pool;
- a request id that is already running: ``AlreadyExistsError`` (ALREADY_EXISTS);
- a full queue: ``ResourceExhaustedError`` (RESOURCE_EXHAUSTED), answered at once;
- a dependency that is down (the memory service, every backend): ``UnavailableError`` (UNAVAILABLE);
- running out of KV blocks is not an error at all but a normal result;
- anything else is a bug and surfaces as INTERNAL with the exception logged with its traceback.
"""


class PreconditionError(Exception):
    """The request is valid but the service's state does not allow it."""


class AlreadyExistsError(Exception):
    """The request names something (a request id) that already exists."""


class ResourceExhaustedError(Exception):
    """The service is at a configured limit (queue length, streams per client); retry later."""


class UnavailableError(Exception):
    """A service this one depends on cannot be reached; retry, possibly elsewhere."""
