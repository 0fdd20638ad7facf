"""Structured outputs through a real compute service (``python -m compute_service`` beside a memory
service): bad constraints are INVALID_ARGUMENT before any work, and a pathological one times out
cleanly while other requests keep being served."""

from __future__ import annotations

import json
import re
import threading
import time

from pathlib import Path

import grpc
import pytest

from pagedserve.compute.v1 import compute_pb2 as cpb
from tests.compute_service.service_fixtures import running_services
from tests.structured.conftest import EOS, PROMPTS, ByteModel

# Every property optional: xgrammar's compile time grows with the cube of their number (about 3 s
# for 700 on one core), though the schema stays under the 32768-character limit.
# ~2.5 s to compile on an idle core (1200 optional properties of any type, superlinear), within the
# size limit: eight times the service's 0.3 s timeout (800 integers, ~0.2 s idle, were too close).
PATHOLOGICAL = json.dumps({"type": "object", "properties": {str(i): {} for i in range(1200)}}, separators=(",", ":"))


@pytest.fixture(scope="module")
def compute_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("constraints") / "compute.log"


@pytest.fixture(scope="module")
def services(byte_model: ByteModel, compute_log: Path):
    with running_services(byte_model.path, memory_args=("--max-num-blocks", "256"),
                          compute_args=("--grammar-compile-timeout-s", "0.3"), compute_log=compute_log) as running:
        yield running


def _error(services, **params) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        services.generate(PROMPTS[0], timeout=30, max_tokens=8, **params)
    return info.value


@pytest.mark.parametrize(("params", "message"), [
    ({"regex": "(ab"}, "params.regex: Regex parsing error at position 4: The parenthesis is not closed."),
    ({"json_schema": "{not json"}, "params.json_schema: not valid JSON: Expecting property name"),
    ({"json_schema": '{"type": "foo"}'}, 'params.json_schema: Unsupported type "foo"'),
    ({"grammar": "root ::= foo"}, 'params.grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ({"json_object": False}, "params.json_object must be true when set"),
    ({"regex": "a" * 4097}, "params.regex: at most 4096 characters, got 4097"),
    ({"regex": r"a\uD800"}, r"params.regex: \uD800 is a lone surrogate (U+D800-DFFF), not text"),
    ({"json_schema": json.dumps({"type": "string", "pattern": "[\\uD800-\\uDBFF]"})},
     "params.json_schema: the class [\\uD800-\\uDBFF] admits only surrogates"),
    ({"choice": cpb.ChoiceList()}, "params.choice.choices must hold 1 to 256 strings, got 0"),
    ({"regex": "a", "ignore_eos": True}, "params.ignore_eos cannot be combined with regex"),
    # Static limits (pagedserve/grammar_limits.py), before any compile: a review's 16 characters
    ({"regex": "(.{0,60}){0,60}x"}, "params.regex: nested repetitions multiply to 3600 copies; the upper bounds"),
    ({"grammar": 'root ::= r{0,60} "x"\nr ::= [a-z]{0,60}'}, "params.grammar: nested repetitions multiply to 3600"),
    ({"json_schema": json.dumps({"type": "string", "pattern": "(a{0,99}){0,99}"})},
     "params.json_schema (pattern at #): nested repetitions multiply to 9801"),
])
def test_bad_constraint_is_invalid_argument(services, params: dict, message: str) -> None:
    error = _error(services, **params)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(message), error.details()
    services.wait_released()  # nothing was queued


def test_constrained_generate_streams_a_matching_completion(services, byte_model: ByteModel) -> None:
    replies = services.generate(PROMPTS[1], max_tokens=24, temperature=0.0, regex=r"[a-z]{2,5}@\d{2}")
    tokens = [t for r in replies for t in r.token_ids]
    assert replies[-1].finish_reason == "eos" and tokens[-1] == EOS
    assert re.fullmatch(r"[a-z]{2,5}@\d{2}", "".join(r.text for r in replies))
    choice = services.generate(PROMPTS[2], max_tokens=24, n=3, temperature=1.0, seed=1,
                               choice=cpb.ChoiceList(choices=["left", "right", "centre"]))
    texts: dict[int, str] = {}
    for reply in choice:
        texts[reply.index] = texts.get(reply.index, "") + reply.text
    assert sorted(texts) == [0, 1, 2] and set(texts.values()) <= {"left", "right", "centre"}


def test_pathological_schema_times_out_while_others_are_served(services, compute_log: Path) -> None:
    result: dict[str, object] = {}

    def slow() -> None:
        start = time.monotonic()
        try:
            services.generate(PROMPTS[0], timeout=60, max_tokens=8, json_schema=PATHOLOGICAL)
        except grpc.RpcError as exc:
            result["error"], result["seconds"] = exc, time.monotonic() - start

    thread = threading.Thread(target=slow)
    thread.start()
    # While it compiles: an unconstrained and a constrained request complete.
    plain = services.generate(PROMPTS[1], max_tokens=6, temperature=0.0)
    assert sum(len(r.token_ids) for r in plain) == 6 and plain[-1].finish_reason == "length"
    # As a client told "busy; retry later" does: a queued compile waits only the 0.3 s timeout to start,
    # and on 2 loaded cores (the whole suite running) the free worker can take longer to pick it up.
    for attempt in range(5):
        try:
            digits = services.generate(PROMPTS[2], max_tokens=8, temperature=0.0, regex=r"\d{3}")
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "retry later" not in exc.details() or attempt == 4:
                raise
            time.sleep(0.2)
    assert re.fullmatch(r"\d{3}", "".join(r.text for r in digits))
    thread.join(60)
    error = result["error"]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "params.json_schema: compiling took more than 0.3 s of CPU; the constraint is too complex"
    assert result["seconds"] < 10  # refused at its timeout, long before the compile would end
    # Asked again: refused from the cached verdict, no second worker spent on it. A second compile would
    # run into the timeout again and log it; given more than the timeout's CPU time to show, it has not.
    again = _error(services, json_schema=PATHOLOGICAL)
    assert again.code() == grpc.StatusCode.INVALID_ARGUMENT and again.details() == error.details()
    services.wait_released()
    time.sleep(1.5)
    assert compute_log.read_text().count('"grammar_compile_timeout"') == 1
