"""The HTTP front's errors: OpenAI error objects with the status the gRPC front's code has.

Every failure is answered as ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status of the gRPC code the same request gets on the gRPC front (``STATUS``); bad input names the
OpenAI parameter (``ParamError``, or the gRPC field a core message starts with, mapped here).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import grpc
from starlette.responses import JSONResponse

from pagedserve import rpc
from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument
from pagedserve.log import get_logger

log = get_logger("gateway.openai")

# The HTTP status of each gRPC code, as the same request gets it on the gRPC front.
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}
# The access line's status of an HTTP answer that no gRPC code gave (the gRPC front's names).
_ACCESS_STATUS = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                  404: "NOT_FOUND", 409: "ALREADY_EXISTS", 413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT",
                  429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
# "params.top_p must be ...", "messages[2].role must be ...": the OpenAI parameter a message names.
_PARAM = re.compile(r"^(?:params\.)?([a-z_]+)")



class ParamError(InvalidArgument):
    """Bad input naming the OpenAI parameter (the error body's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class HttpError(Exception):
    """An answer other than 200, with its OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def renamed_param(error: HttpError, names: Mapping[str, str]) -> HttpError:
    """The error naming the parameter as an endpoint's client spells it (``names``: the chat or core
    name -> this endpoint's; ``/v1/embeddings`` says ``input`` where the core says ``prompt``), in
    ``param`` and at the head of the message."""
    name = re.match(r"[a-z_]*", error.param or "")[0]  # type: ignore[index]
    if name not in names:
        return error
    message = names[name] + error.message[len(name):] if error.message.startswith(name) else error.message
    return HttpError(error.status, message, names[name])


def access_status(status: int) -> str:
    """The access line's status of an HTTP answer (``INTERNAL`` for any other 5xx)."""
    return _ACCESS_STATUS.get(status, "INTERNAL" if status >= 500 else "UNKNOWN")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """An OpenAI error object. A 404 is ``model_not_found`` only when it names ``model``: an unknown
    route or stored response said so sent clients looking for a wrong model name."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = None if status == 404 and param != "model" else _CODES.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def as_http_error(exc: BaseException, constraint_param: str | None = None) -> HttpError:
    """The HTTP answer of a failed request: the status its gRPC code has, the message naming the field.

    ``constraint_param``: the OpenAI parameter that gave the request's constraint (``response_format``,
    ``structured_outputs.json``, ...); the compute service's verdict on the constraint names the
    gRPC field (``params.json_schema``), so the answer names this parameter instead.
    """
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, ParamError):
        return HttpError(400, str(exc), exc.param)
    code = rpc.status_for(exc)
    message = str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        match = _PARAM.match(message)
        param = match.group(1) if match else None
        if constraint_param and param in rules.CONSTRAINT_KINDS:
            return HttpError(400, f"{constraint_param}: {message.removeprefix('params.')}", constraint_param)
        return HttpError(400, message.removeprefix("params."), param)
    if code not in STATUS:  # a bug: logged with its traceback, answered 500
        log.error("openai_internal_error", error=repr(exc), exc_info=exc)
        return HttpError(500, "internal error")
    return HttpError(STATUS[code], message)


def error_response(exc: BaseException, constraint_param: str | None = None) -> JSONResponse:
    """``as_http_error``'s answer as a response."""
    error = as_http_error(exc, constraint_param)
    return JSONResponse(error_body(error.status, error.message, error.param), status_code=error.status)
