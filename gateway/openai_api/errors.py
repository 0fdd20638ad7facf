"""The HTTP front's bad-input error, shared by the modules that convert request bodies."""

from __future__ import annotations

from pagedserve.errors import InvalidArgument


class ParamError(InvalidArgument):
    """Bad input naming the OpenAI parameter (the error body's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
