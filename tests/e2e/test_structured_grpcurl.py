"""Structured outputs through the gateway, from the real ``grpcurl`` (reflection only, JSON bodies
as a user types them). The e2e model's EOS is an ordinary byte token, so the text is checked on the
token ids without their final EOS."""

from __future__ import annotations

import json
import re

import jsonschema

from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import Gateway
from tests.e2e.test_grpcurl import _json_stream, grpcurl

GENERATE = "pagedserve.gateway.v1.Gateway/Generate"
SCHEMA = {"type": "object", "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}


def _text(service_model: ServiceModel, choice: dict) -> str:
    ids = [int(t) for t in choice["token_ids"]]
    if choice["finish_reason"] == "eos":  # the model's EOS ids: the config's (208) and the tokenizer's </s>
        assert ids[-1] in (service_model.eos_token_id, 257)
        ids = ids[:-1]
    return service_model.tokenizer.decode(ids)


def test_constraints_through_the_gateway(gateway: Gateway, service_model: ServiceModel) -> None:
    bodies = [
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"regex": r"[A-Z]{2}-\d{2,3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-\d{2,3}", t) is not None),
        ({"choice": {"choices": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for constraint, is_valid in bodies:
        body = {"prompt": "Answer: ", "params": {"max_tokens": 48, "temperature": 1.0, "seed": 3, "n": 2, **constraint}}
        out = grpcurl(gateway, GENERATE, data=body)
        assert out.returncode == 0, out.stderr
        choices = json.loads(out.stdout)["choices"]
        assert len(choices) == 2
        for choice in choices:
            assert choice["finish_reason"] in ("eos", "length")
            if choice["finish_reason"] == "eos":
                assert is_valid(_text(service_model, choice)), (constraint, choice)
    streamed = grpcurl(gateway, "pagedserve.gateway.v1.Gateway/GenerateStream",
                       data={"prompt": "Code: ", "params": {"max_tokens": 16, "temperature": 0, "regex": r"\d{4}"}})
    assert streamed.returncode == 0, streamed.stderr
    pieces = _json_stream(streamed.stdout)
    assert pieces[-1]["finish_reason"] == "eos"
    token_ids = [t for p in pieces for t in p.get("token_ids", [])]
    assert re.fullmatch(r"\d{4}", _text(service_model, {"finish_reason": "eos", "token_ids": token_ids}))


def test_bad_constraints_through_the_gateway(gateway: Gateway) -> None:
    for params, message in [
        ({"regex": "(ab"}, "params.regex: Regex parsing error"),  # the compute service compiles
        ({"json_object": False}, "params.json_object must be true when set"),  # the gateway checks
        ({"grammar": "x" * 40000}, "params.grammar: at most 32768 characters, got 40000"),
        ({"choice": {"choices": []}}, "params.choice.choices must hold 1 to 256 strings, got 0"),
    ]:
        out = grpcurl(gateway, GENERATE, data={"prompt": "x", "params": {"max_tokens": 4, **params}})
        assert out.returncode != 0
        assert "Code: InvalidArgument" in out.stderr and message in out.stderr, out.stderr
