"""Grammars whose token masks cost too much never stall other requests.

A mask fill that misses its deadline ends its own request (finish_reason "error") while the others
in its batch go on; costly grammars are refused at admission, by static limits on their text and
by a probe of their mask cost in the compile worker; compile workers are processes that are killed
at the timeout and shared fairly between tenants.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Iterator

import pytest

from compute_service import LLM, Constraint, SamplingParams
from pagedserve.errors import InvalidArgument, ResourceExhaustedError
from pagedserve.process import async_wait_until, wait_until
from compute_service.structured.grammar_compiler import GrammarCompiler, GrammarCompilerConfig
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
    wait_until(lambda: num_abandoned_fills() == 0, 120, "every abandoned mask fill finished")


def test_a_late_mask_ends_its_request_alone(llm: LLM, byte_model: ByteModel) -> None:
    import xgrammar as xgr

    # Compiled here, past the admission checks that would refuse it: the engine's deadline is the
    # last line of defence, for grammars whose cost shows only after the probe's steps.
    info = xgr.TokenizerInfo.from_huggingface(byte_model.tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
    xgr_compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    costly = xgr_compiler.compile_regex(GROWING_REGEX)
    others = {"plain": (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None),
              "regex": (PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0,
                                                   constraint=Constraint.regex("[ab]{1,30}c")),
                        xgr_compiler.compile_regex("[ab]{1,30}c"))}
    alone = run(llm, others)
    failed_before, fills_before = llm.engine.num_failed_requests, llm.engine.masker.num_failed_fills

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
    assert llm.engine.masker.num_failed_fills - fills_before == 1  # its mask: too costly or late
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


# --- the compiler: killable workers, the mask probe, tenants, dropped jobs -------------------------

TIMEOUT_S = 1.0


def _slow(prefix: str, title: str = "") -> Constraint:
    """A schema that compiles for seconds (1500 optional properties: the time grows with the cube of
    their number, ~5 s on an idle core), within every static limit; ``title`` changes only its text."""
    schema: dict = {"type": "object", "properties": {f"{prefix}{i}": {} for i in range(1500)}}
    return Constraint.json_schema({"title": title, **schema} if title else schema)


@pytest.fixture(scope="module")
def compiler(byte_model: ByteModel) -> Iterator[GrammarCompiler]:
    config = GrammarCompilerConfig(num_threads=2, timeout_s=TIMEOUT_S, max_jobs_per_tenant=1)
    with GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], config) as compiler:
        compiler.start()  # both workers ready before the first test counts them
        yield compiler
    for pid in compiler.worker_pids():
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ready(compiler: GrammarCompiler) -> None:
    wait_until(lambda: compiler.num_running == 0 and len(compiler.worker_pids()) == 2, 120, "idle workers")


def test_a_compile_past_its_timeout_is_killed_and_every_title_shares_the_verdict(compiler: GrammarCompiler) -> None:
    _ready(compiler)
    pids, num_started, num_killed = compiler.worker_pids(), compiler.num_started, compiler.num_killed
    with pytest.raises(InvalidArgument, match=f"^params.json_schema: compiling took more than {TIMEOUT_S} s of CPU"):
        compiler.compile(_slow("p", title="variant 0"), owner="a")
    assert compiler.num_running == 0  # killed, not compiling on in the background
    assert compiler.num_killed - num_killed == 1
    assert [_alive(pid) for pid in pids].count(False) == 1
    for title in ("variant 1", "variant 2", "variant 3"):  # the same schema but for its title: refused at once
        with pytest.raises(InvalidArgument, match="too complex"):
            compiler.compile(_slow("p", title=title), owner="a")
    assert compiler.num_started - num_started == 1
    _ready(compiler)  # the killed worker was replaced
    assert len(set(compiler.worker_pids()) - set(pids)) == 1


def test_the_probe_refuses_a_grammar_whose_masks_grow(compiler: GrammarCompiler) -> None:
    # It compiles in milliseconds; walking its masks is what refuses it: a mask over the probe's
    # limit, or (on a loaded machine) the walk killed at the timeout.
    with pytest.raises(InvalidArgument, match=r"^params.regex: (too costly to follow: one token mask took|"
                                              r"compiling took more than)"):
        compiler.compile(Constraint.regex(GROWING_REGEX))
    assert compiler.compile(Constraint.regex("[ab]{1,30}c|(de)+")) is not None


def test_one_tenants_compiles_take_one_worker_and_another_tenant_gets_the_other(compiler: GrammarCompiler) -> None:
    _ready(compiler)
    num_started = compiler.num_started
    outcomes: dict[str, str] = {}

    def tenant_a(prefix: str) -> None:
        try:
            compiler.compile(_slow(prefix), owner="a")
        except (InvalidArgument, ResourceExhaustedError) as exc:
            outcomes[prefix] = type(exc).__name__

    first = threading.Thread(target=tenant_a, args=("x",))
    first.start()
    wait_until(lambda: compiler.num_running == 1, 60, "tenant a's first compile running")
    second = threading.Thread(target=tenant_a, args=("y",))  # queued: tenant a's worker is taken
    second.start()
    wait_until(lambda: any(job.state == "queued" for job in list(compiler._cache.values())), 60, "a's second queued")
    assert compiler.compile(Constraint.regex("[xy]{2,9}z"), owner="b") is not None  # the other worker
    assert compiler.num_started - num_started == 2  # a's first, b's: a's second waited its turn
    first.join(120)
    second.join(120)
    assert outcomes["x"] == "InvalidArgument"  # killed at the timeout
    # a's second: busy (a's worker was still taken when its wait ran out), or killed in its turn
    assert outcomes["y"] in ("ResourceExhaustedError", "InvalidArgument")
    _ready(compiler)


def test_a_job_nobody_waits_for_is_dropped_or_killed(compiler: GrammarCompiler) -> None:
    _ready(compiler)
    num_started, num_killed = compiler.num_started, compiler.num_killed

    async def give_up() -> None:
        running = asyncio.create_task(compiler.compile_async(_slow("r"), owner="c"))
        await async_wait_until(lambda: compiler.num_running, 60, "the first job running")
        queued = asyncio.create_task(compiler.compile_async(_slow("s"), owner="c"))
        await async_wait_until(lambda: any(job.state == "queued" for job in list(compiler._cache.values())), 60,
                               "the second job queued")
        queued.cancel()  # its requests were cancelled: nobody waits any more
        running.cancel()
        assert [r.__class__ for r in await asyncio.gather(running, queued, return_exceptions=True)] == \
            [asyncio.CancelledError] * 2

    asyncio.run(give_up())
    wait_until(lambda: compiler.num_running == 0, 60, "the running job killed")
    assert compiler.num_killed - num_killed == 1  # the running one, long before its timeout
    assert compiler.num_started - num_started == 1  # the queued one never ran
    _ready(compiler)
