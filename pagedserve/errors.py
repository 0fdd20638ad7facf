"""The one error scheme of the services.

- bad input from a caller: ``ValueError`` (mapped to INVALID_ARGUMENT by the server interceptor);
- a request that is well-formed but does not fit the current state: ``PreconditionError``
  (FAILED_PRECONDITION), e.g. attaching a model whose layout differs from the existing pool;
- running out of KV blocks is not an error at all but a normal result;
- anything else is a bug and surfaces as INTERNAL with the exception logged.
"""


class PreconditionError(Exception):
    """The request is valid but the service's state does not allow it."""
