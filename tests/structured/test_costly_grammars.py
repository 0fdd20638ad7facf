"""Grammars whose token masks cost too much never stall other requests (issue 27, items 1 and 6).

A mask fill that misses its deadline ends its own request (finish_reason "error") while the others
in its batch go on; costly grammars are refused at admission, by static limits on their text and
by a probe of their mask cost in the compile worker; compile workers are processes that are killed
at the timeout and shared fairly between tenants.
"""

from __future__ import annotations

import re
import time

import pytest

from compute_service import LLM, Constraint, SamplingParams
from pagedserve.errors import InvalidArgument
from compute_service.structured.logits_mask import num_abandoned_fills
from tests.structured.conftest import EOS, PROMPTS, VOCAB, ByteModel
from compute_service.engine.outputs import RequestOutput, collect

# Its mask's cost grows with every token (the Earley states of 30 x 30 ways to split the text):
# on the byte model about 0.5 ms at the first token, seconds by the 35th.
GROWING_REGEX = "(.{0,30}){0,30}x"


def run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams, object]]) -> dict[str, RequestOutput]:
    """Every request in the engine at once (a compiled grammar may come with each); their outputs."""
    for request_id, (prompt, params, grammar) in requests.items():
        llm.engine.add_request(request_id, prompt, params, grammar=grammar)
    results: dict[str, RequestOutput] = {}
    while len([r for r in results.values() if r.finished]) < len(requests):
        collect(results, llm.engine.step())
    llm.engine.step()  # frees the last blocks
    return results


def _wait_for_abandoned_fills() -> None:
    deadline = time.monotonic() + 120
    while num_abandoned_fills() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert num_abandoned_fills() == 0


def test_a_late_mask_ends_its_request_alone(llm: LLM, byte_model: ByteModel) -> None:
    import xgrammar as xgr

    # Compiled here, past the admission checks that would refuse it: the engine's deadline is the
    # last line of defence, for grammars whose cost shows only after the probe's steps.
    info = xgr.TokenizerInfo.from_huggingface(byte_model.tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
    costly = xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(GROWING_REGEX)
    others = {"plain": (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None),
              "regex": (PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0,
                                                   constraint=Constraint.regex("[ab]{1,30}c")), None)}
    alone = run(llm, others)
    failed_before, late_before = llm.engine.num_failed_requests, llm.engine.masker.pool.num_late

    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=Constraint.regex(GROWING_REGEX))
    outs = run(llm, {"costly": (PROMPTS[0], params, costly), **others})
    assert outs["costly"].outputs[0].finish_reason == "error"
    assert "mask" in outs["costly"].error
    assert len(outs["costly"].outputs[0].token_ids) < 40
    for request_id, ref in alone.items():  # the others: as if alone, to the token
        assert outs[request_id].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[request_id].outputs[0].finish_reason == ref.outputs[0].finish_reason
    assert len(outs["plain"].outputs[0].token_ids) == 40
    assert llm.engine.num_failed_requests - failed_before == 1
    assert llm.engine.masker.pool.num_late - late_before == 1
    assert not llm.engine.requests
    _wait_for_abandoned_fills()


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Constraint.regex("(.{0,60}){0,60}x"), "regex: nested repetitions multiply to 3600 copies"),
    (lambda: Constraint.regex("((a{0,10}){0,10}){0,11}"), "regex: nested repetitions multiply to 1100"),
    (lambda: Constraint.regex("(" * 65 + "a" + ")" * 65), "regex: groups nest deeper than 64 levels"),
    (lambda: Constraint.grammar('root ::= item{0,60} "x"\nitem ::= ([a-z]{0,30} ","){1,2}'),
     "grammar: nested repetitions multiply to 3600"),
    (lambda: Constraint.json_schema(_nested_schema(33)), "json_schema: subschemas nest deeper than 32"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"title": {
        "type": "array", "items": {"type": "string", "pattern": "(x{2,}){501}"}}}}),
     "json_schema (pattern at #/properties/title/items): nested repetitions multiply to 1002"),
    (lambda: Constraint.json_schema("[" * 5000 + "]" * 5000), "json_schema: nested deeper than"),
])
def test_static_limits_refuse_costly_shapes(make, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        make()


@pytest.mark.parametrize("make", [
    lambda: Constraint.regex("(.{0,30}){0,30}x"),  # 900: within the rule (the probe sees to it)
    lambda: Constraint.regex(".{0,5000}x"),  # one bound is not nested
    lambda: Constraint.regex(r"([a-z]+ )*\d{1,3}"),  # loops count as one copy
    lambda: Constraint.grammar('root ::= a\na ::= ("x" a){0,40} | "y"'),  # recursion is not nesting
    lambda: Constraint.json_schema(_nested_schema(32)),
    lambda: Constraint.json_schema({"type": "string", "pattern": "[{(]{5}\\{3}"}),
])
def test_static_limits_let_ordinary_shapes_through(make) -> None:
    make()


def test_the_http_front_refuses_them_naming_its_parameter() -> None:
    from gateway.openai_api import convert
    from gateway.openai_api.schema import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "structured_outputs": {"regex": "(.{0,60}){0,60}x"}})
    with pytest.raises(convert.ParamError) as info:
        convert.chat_prompt(body, "c")
    assert info.value.param == "structured_outputs.regex"
    assert "nested repetitions multiply to 3600 copies" in str(info.value)
