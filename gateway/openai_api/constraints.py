"""Structured-output parameters of the OpenAI API to the gateway core's ``Constraint``.

Three spellings reach one constraint: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``), vLLM's ``structured_outputs`` extension (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) and vLLM's older top-level ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``. At most one may be given. Only the shape is checked here
(and the sizes, by ``pagedserve.sampling_rules.check_constraint``, the gRPC API's own bounds, so
the error names the OpenAI parameter); whether a schema, regex or grammar is valid is the compute
service's verdict, which comes back as INVALID_ARGUMENT and is answered as a 400 naming the
parameter that gave it (``constraint_param``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.core.types import Constraint
from gateway.openai_api.errors import ParamError
from pagedserve import sampling_rules as rules
from pagedserve.errors import InvalidArgument

# vLLM's structured_outputs keys, as the public oneof names them.
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Given:
    """One constraint as the client gave it: the OpenAI parameter naming it, its kind and value."""

    param: str
    kind: str
    value: Any


def _param_error(param: str, message: str) -> ParamError:
    return ParamError(param, message)


def _schema_text(param: str, schema: Any) -> str:
    """A JSON schema as its JSON text (clients send an object, or its text already)."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema, separators=(",", ":"))
    raise _param_error(param, f"{param} must be a JSON schema (an object), got {type(schema).__name__}")


def _from_response_format(response_format: dict[str, Any] | None) -> list[Given]:
    if response_format is None:
        return []
    kind = response_format.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [Given("response_format", "json_object", True)]
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _param_error("response_format",
                               "response_format.json_schema must be an object with a 'schema' (and a 'name')")
        return [Given("response_format", "json_schema", spec["schema"])]
    raise _param_error("response_format", f"response_format.type must be text, json_object or json_schema, "
                                          f"got {str(kind)[:64]!r}")


def _from_structured_outputs(value: Any) -> list[Given]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise _param_error("structured_outputs", "structured_outputs must be an object")
    unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_OUTPUTS and v is not None)
    if unknown:
        raise _param_error("structured_outputs", f"structured_outputs: {', '.join(unknown)[:200]} not supported; "
                                                 f"give one of {', '.join(_STRUCTURED_OUTPUTS)}")
    # json_object: false reads as "not this one", as vLLM takes it.
    return [Given(f"structured_outputs.{key}", kind, value[key]) for key, kind in _STRUCTURED_OUTPUTS.items()
            if value.get(key) is not None and value.get(key) is not False]


def given_constraints(body: Any) -> list[Given]:
    """Every constraint a request body gives, in every spelling."""
    found = _from_response_format(body.response_format)
    found += _from_structured_outputs(body.structured_outputs)
    found += [Given(name, kind, getattr(body, name)) for name, kind in _GUIDED.items()
              if getattr(body, name) is not None]
    return found


def constraint_of(body: Any) -> tuple[Constraint | None, str | None]:
    """The body's constraint and the OpenAI parameter that gave it ((None, None): none).

    Raises ParamError naming the parameter for more than one constraint, a wrong shape or a size
    beyond the gRPC API's bounds.
    """
    found = given_constraints(body)
    if not found:
        return None, None
    if len(found) > 1:
        raise _param_error(found[1].param, f"{found[1].param}: give at most one constraint, got "
                                           f"{', '.join(g.param for g in found)}")
    [given] = found
    param, kind, value = given.param, given.kind, given.value
    if kind == "json_object":
        if value is not True:
            raise _param_error(param, f"{param} must be true")
        return Constraint("json_object"), param
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise _param_error(param, f"{param} must be a list of strings")
        _check(param, kind, "", value)
        return Constraint("choice", choices=tuple(value)), param
    text = _schema_text(param, value) if kind == "json_schema" else value
    if not isinstance(text, str):
        raise _param_error(param, f"{param} must be a string, got {type(value).__name__}")
    _check(param, kind, text, ())
    return Constraint(kind, text), param


def _check(param: str, kind: str, spec: str, choices: Any) -> None:
    try:
        rules.check_constraint(kind, spec, choices, name=param)
    except InvalidArgument as exc:
        raise _param_error(param, str(exc)) from None
