"""Structured outputs in the engine, in process, on a tiny random-weight byte-tokenizer Llama.

Greedy constrained output equals transformers under xgrammar's own logits processor token for
token; sampled outputs over 8 seeds always validate (jsonschema, re.fullmatch, the choice list)
unless they stop on length; constrained requests batch next to unconstrained ones, survive
preemption, share cached prefixes, fork (n > 1) with a matcher each, stop on stop strings, keep
raw-logit logprobs and reproduce with seeds.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from compute_service import LLM, Constraint, SamplingParams
from compute_service.engine.outputs import RequestOutput, collect
from tests.structured.conftest import EOS, PROMPTS, VOCAB, ByteModel, hf_constrained_greedy

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -3, "maximum": 3}},
         "required": ["x", "y"]}
SCHEMAS = {
    "nested": {"type": "object", "required": ["name", "tags", "dims"], "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "dims": {"type": "object", "required": ["w", "h", "ok"], "properties": {
            "w": {"type": "integer", "minimum": 1, "maximum": 99},
            "h": {"type": "number", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"}}}}},
    "defs": {"$defs": {"point": POINT}, "type": "object", "required": ["origin", "path"], "properties": {
        "origin": {"$ref": "#/$defs/point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2}}},
    "enum_array": {"type": "array", "items": {"enum": [1, 2.5, "three", None, True]}, "minItems": 2, "maxItems": 4},
}
REGEXES = [r"\d{3}-[a-z]{2,4}", r"(foo|bar)+\d", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?"]
CHOICES = ["yes", "no", "maybe so", 'q"uote\\d', "ça va"]
SEEDS = range(8)


def run_batch(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    """All requests in one engine at once (continuous batching), outputs in request order."""
    ids = [f"batch-{i}" for i in range(len(requests))]
    for request_id, (prompt, params) in zip(ids, requests):
        llm.engine.add_request(request_id, prompt, params)
    results: dict[str, RequestOutput] = {}
    num_finished = 0
    while num_finished < len(ids):
        num_finished += len(collect(results, llm.engine.step()))  # each step's news, accumulated
    llm.engine.step()  # frees the last blocks
    return [results[i] for i in ids]


def is_valid(constraint: Constraint, text: str) -> bool:
    if constraint.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(constraint.spec))
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if constraint.kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            return False
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    return text in constraint.choices


CONSTRAINTS = ([Constraint.json_schema(s) for s in SCHEMAS.values()] + [Constraint.json_object()]
               + [Constraint.regex(r) for r in REGEXES] + [Constraint.choice(CHOICES)])
CONSTRAINT_IDS = [*SCHEMAS, "json_object", "regex0", "regex1", "regex2", "choice"]


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_greedy_equals_transformers_with_xgrammar(llm: LLM, byte_model: ByteModel, kind: str) -> None:
    compile_fn, constraint = {
        # No length-bounded strings: there our grammar corrects xgrammar's (see grammar_compiler.py).
        "json_schema": (lambda c: c.compile_json_schema(json.dumps(SCHEMAS["defs"]), any_whitespace=False),
                        Constraint.json_schema(SCHEMAS["defs"])),
        "regex": (lambda c: c.compile_regex(REGEXES[0]), Constraint.regex(REGEXES[0])),
        "choice": (lambda c: c.compile_grammar('root ::= "yes" | "no" | "maybe so"'),
                   Constraint.choice(["yes", "no", "maybe so"])),
    }[kind]
    for prompt in PROMPTS[:2]:
        expected = hf_constrained_greedy(byte_model, compile_fn, prompt, 48)
        [out] = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, constraint=constraint))
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == ("eos" if expected[-1] == EOS else "length")


def test_every_output_validates_over_seeds(llm: LLM) -> None:
    # Every constraint x (8 seeds at temperature 1.0 + greedy), and an unconstrained request, in one
    # continuous batch: one engine run instead of one per constraint.
    requests = []
    for constraint in CONSTRAINTS:
        requests += [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=128, temperature=1.0, seed=i,
                                                                constraint=constraint)) for i in SEEDS]
        requests.append((PROMPTS[0], SamplingParams(max_tokens=128, temperature=0.0, constraint=constraint)))
    free = (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0))
    outs = run_batch(llm, [*requests, free])
    per_constraint = len(SEEDS) + 1
    for k, (constraint, name) in enumerate(zip(CONSTRAINTS, CONSTRAINT_IDS)):
        completions = [o.outputs[0] for o in outs[k * per_constraint:(k + 1) * per_constraint]]
        for c in completions:
            assert c.finish_reason in ("eos", "length"), name
            if c.finish_reason == "eos":
                assert is_valid(constraint, c.text), (name, c.text)
        assert sum(c.finish_reason == "eos" for c in completions) >= 6, (name, [c.text for c in completions])
    [alone] = llm.generate([free[0]], free[1])
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids  # batching changed nothing


def test_n_completions_each_follow_their_own_matcher(llm: LLM) -> None:
    constraint = Constraint.json_schema(SCHEMAS["defs"])
    [out] = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=80, temperature=1.0, seed=7, n=6,
                                                      constraint=constraint))
    texts = [c.text for c in out.outputs]
    assert all(c.finish_reason == "eos" and is_valid(constraint, c.text) for c in out.outputs), texts
    assert len(set(texts)) >= 3  # they really sampled apart


def test_preemption_keeps_the_grammar_state(byte_model: ByteModel, llm: LLM) -> None:
    constraint = Constraint.json_schema(SCHEMAS["defs"])
    requests = [(p, SamplingParams(max_tokens=60, temperature=0.0, constraint=constraint)) for p in PROMPTS]
    requests += [(p, SamplingParams(max_tokens=60, temperature=1.0, seed=i, constraint=constraint))
                 for i, p in enumerate(PROMPTS)]
    roomy = run_batch(llm, requests)
    # 20 blocks of 4 tokens for 8 sequences of ~60 tokens: preempted and recomputed, mid-JSON.
    with LLM(str(byte_model.path), dtype="float32", block_size=4, max_num_blocks=20, max_num_seqs=8) as tight:
        squeezed = run_batch(tight, requests)
        assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]


def test_prefix_cache_hit_gives_the_same_constrained_output(llm: LLM) -> None:
    prompt = PROMPTS[0] * 3  # 21 tokens: 5 full blocks to share
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=Constraint.regex(REGEXES[2]))
    [first] = llm.generate([prompt], params)
    [second] = llm.generate([prompt], params)
    assert second.num_cached_tokens >= 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_stop_string_cuts_a_constrained_output(llm: LLM) -> None:
    constraint = Constraint.regex(r"\d{3}-\d{3}")
    [full] = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0.0, constraint=constraint))
    [cut] = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0.0, constraint=constraint,
                                                      stop=["-"]))
    assert re.fullmatch(r"\d{3}-\d{3}", full.outputs[0].text)
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].text == full.outputs[0].text[:3]


def test_seed_reproduces_a_constrained_sample(llm: LLM) -> None:
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=123, constraint=Constraint.json_object())
    [a] = llm.generate([PROMPTS[0]], params)
    [b] = run_batch(llm, [(PROMPTS[0], params), (PROMPTS[1], SamplingParams(max_tokens=30, seed=5))])[:1]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_logprobs_are_the_raw_logits_log_softmax(llm: LLM, byte_model: ByteModel) -> None:
    prompt = PROMPTS[3]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=3,
                                                  constraint=Constraint.choice(["alpha", "beta", "gamma"])))
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = byte_model.hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1)  # (T, V), nothing masked
    for i, lp in enumerate(out.outputs[0].logprobs):
        assert lp.logprob == pytest.approx(float(expected[i, tokens[i]]), abs=1e-3)
        assert lp.top_token_ids == expected[i].topk(3).indices.tolist()  # unmasked top tokens
    # Under a mask the chosen token would be near-certain; raw logprobs of a random model are not.
    assert min(lp.logprob for lp in out.outputs[0].logprobs) < -1.0


@pytest.mark.parametrize(("constraint", "message"), [
    (Constraint.regex("(ab"), "params.regex: Regex parsing error"),
    (Constraint.json_schema("{not json"), "params.json_schema: not valid JSON"),
    (Constraint.json_schema('{"type": "foo"}'), 'params.json_schema: Unsupported type "foo"'),
    (Constraint.grammar('root ::= foo'), 'params.grammar: EBNF parser error at line 1, column 10: Rule "foo"'),
])
def test_invalid_constraint_is_a_value_error_naming_the_field(llm: LLM, constraint: Constraint, message: str) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, constraint=constraint))
    assert str(info.value).startswith(message)
    assert not llm.engine.requests  # refused before anything was queued


def test_constraint_sizes_and_combinations_are_checked() -> None:
    with pytest.raises(ValueError, match=r"regex: at most 4096 characters, got 4097"):
        Constraint.regex("a" * 4097)
    with pytest.raises(ValueError, match=r"choice.choices must hold 1 to 256"):
        Constraint.choice([])
    with pytest.raises(ValueError, match=r"choice.choices\[1\] must have 1 to 1024"):
        Constraint.choice(["a", ""])
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with regex"):
        SamplingParams(ignore_eos=True, constraint=Constraint.regex("a"))
    with pytest.raises(ValueError, match="min_tokens cannot be combined with choice"):
        SamplingParams(min_tokens=1, constraint=Constraint.choice(["a"]))


def test_mask_matches_masked_fill_and_skips_unconstrained_batches(llm: LLM) -> None:
    import xgrammar as xgr

    from compute_service.structured.logits_mask import LogitsMasker

    masker = LogitsMasker(VOCAB)
    logits = torch.randn(3, VOCAB)
    assert masker.apply(logits, [None, None, None]).logits is logits  # nothing constrained: no copy, no work
    grammar = llm.engine.grammars.compile(Constraint.regex(r"[ab]c"))
    matcher = llm.engine.grammars.new_matcher(grammar)
    result = masker.apply(logits, [None, matcher, None])
    masked = result.logits
    assert result.failures == {}
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    llm.engine.grammars.new_matcher(grammar).fill_next_token_bitmask(bitmask)
    bits = (bitmask[0, torch.arange(VOCAB) // 32] >> (torch.arange(VOCAB) % 32)) & 1  # (V,) 1 = allowed
    assert bits.sum() == 2  # "a" and "b"
    assert torch.equal(masked[1], logits[1].masked_fill(bits == 0, float("-inf")))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    raw = logits.clone()
    in_place = masker.apply(logits, [None, llm.engine.grammars.new_matcher(grammar), None], keep_raw=False).logits
    assert in_place is logits and torch.equal(logits, masked) and not torch.equal(logits, raw)


def _three_requests(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    regex = Constraint.regex(REGEXES[0])
    return [(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, constraint=regex)),
            (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, constraint=regex)),
            (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0))]


def _run_with_fault(llm: LLM, requests: list[tuple[list[int], SamplingParams]],
                    inject) -> tuple[list[RequestOutput], int]:
    """run_batch, ``inject(engine, seq_of_batch_0)`` called once batch-0 has its sequence."""
    before = llm.engine.num_failed_requests
    for i, (prompt, params) in enumerate(requests):
        llm.engine.add_request(f"batch-{i}", prompt, params)
    inject(llm.engine, llm.engine.requests["batch-0"].completions[0].seq)
    results: dict[str, RequestOutput] = {}
    num_finished = 0
    while num_finished < len(requests):
        num_finished += len(collect(results, llm.engine.step()))
    llm.engine.step()
    return [results[f"batch-{i}"] for i in range(len(requests))], llm.engine.num_failed_requests - before


@pytest.mark.parametrize("stage", ["accept", "mask"])
def test_a_grammar_failure_ends_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    # The engine's per-request failure isolation covers the grammar: a matcher that rejects its own
    # sampled token, or whose mask cannot be filled, ends that request with finish_reason "error";
    # the constrained and unconstrained requests batched with it finish exactly as they do alone.
    requests = _three_requests(llm)
    alone = run_batch(llm, requests)

    def inject(engine, seq) -> None:
        if stage == "accept":
            seq.matcher.accept_token = lambda token: False  # instance attribute: only this matcher
            return
        bad, real_apply = seq.matcher, engine.masker.apply

        def apply(logits, matchers, **kwargs):
            if any(m is bad for m in matchers):
                raise RuntimeError("mask fill failed")
            return real_apply(logits, matchers, **kwargs)

        monkeypatch.setattr(engine.masker, "apply", apply)

    outs, num_failed = _run_with_fault(llm, requests, inject)
    assert num_failed == 1
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error" and outs[0].error
    assert outs[0].outputs[0].token_ids == []  # the rejected (or never sampled) token is not reported
    for out, ref in zip(outs[1:], alone[1:]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    assert re.fullmatch(REGEXES[0], outs[1].outputs[0].text) or outs[1].outputs[0].finish_reason == "length"
