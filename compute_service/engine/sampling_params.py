"""How to pick tokens for one request: a validated dataclass, the engine's own type (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The ranges, defaults and limits live once, in pagedserve.sampling_rules: the gateway checks
# public requests with the same functions, and resolves unset fields with the same defaults.
from pagedserve.sampling_rules import (MAX_LOGIT_BIAS_ENTRIES, check_constrained_sampling, check_sampling,
                                       logit_bias_pairs, resolve_sampling)

from compute_service.structured.constraint import Constraint

_DEFAULT: dict = resolve_sampling({})  # every field's default: what an unset one means


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules of one request.

    Attributes:
        max_tokens: tokens to generate at most.
        temperature: 0 = greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; top_k: keep the k best (0 = all); min_p: drop tokens whose
            probability is below min_p times the best one's.
        seed: per-request generator seed, for reproducible sampling.
        stop: strings that end generation (they are not part of the returned text).
        stop_token_ids: tokens that end generation (besides the model's EOS tokens).
        ignore_eos: keep going past EOS (benchmarks).
        min_tokens: no EOS / stop before this many tokens.
        repetition_penalty: > 1 penalises tokens of the prompt and output (divides positive
            logits, multiplies negative ones); presence_penalty / frequency_penalty subtract a
            constant / a per-occurrence amount for tokens already generated.
        n: completions per prompt (forked sequences share the prompt's blocks).
        logprobs: None = none; 0 = the sampled token's log-probability; N = also the N most likely.
        prompt_logprobs: None = none; N = the log-probability of each prompt token after the first
            (and the N most likely tokens at its position); then max_tokens may be 0 (score only).
        pooling: None = generate; "last" / "mean" = an embedding request (max_tokens 0): the final
            normed hidden state at the last prompt position, or averaged over the prompt.
        logit_bias: (token id, bias) pairs, sorted by id, added to the logits before anything else
            (penalties, a constraint's mask, sampling); a mapping given is turned into them.
    """

    max_tokens: int = _DEFAULT["max_tokens"]
    temperature: float = _DEFAULT["temperature"]
    top_p: float = _DEFAULT["top_p"]
    top_k: int = _DEFAULT["top_k"]
    min_p: float = _DEFAULT["min_p"]
    seed: int | None = _DEFAULT["seed"]
    stop: tuple[str, ...] = _DEFAULT["stop"]
    stop_token_ids: tuple[int, ...] = _DEFAULT["stop_token_ids"]
    ignore_eos: bool = _DEFAULT["ignore_eos"]
    min_tokens: int = _DEFAULT["min_tokens"]
    repetition_penalty: float = _DEFAULT["repetition_penalty"]
    presence_penalty: float = _DEFAULT["presence_penalty"]
    frequency_penalty: float = _DEFAULT["frequency_penalty"]
    n: int = _DEFAULT["n"]
    logprobs: int | None = _DEFAULT["logprobs"]
    logit_bias: tuple[tuple[int, float], ...] = _DEFAULT["logit_bias"]
    prompt_logprobs: int | None = _DEFAULT["prompt_logprobs"]
    pooling: str | None = _DEFAULT["pooling"]
    constraint: Constraint | None = None
    stop_token_id_set: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)
    # What the engine derives from these fields once per request rather than once per step (the
    # sampler's tensor of ids masked under min_tokens); not part of the request's value.
    derived: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES:  # else check_sampling names the count
            pairs = logit_bias_pairs(self.logit_bias)
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        # Raises InvalidArgument naming the field (without the wire's "params." prefix: the
        # service's edge adds it). Counts are checked before any element.
        check_sampling(vars(self), prefix="")
        # Built once: the engine asks "is this token a stop token?" for every token it samples,
        # and a set answers in constant time whatever the number of stop ids.
        object.__setattr__(self, "stop_token_id_set", frozenset(self.stop_token_ids))
        if self.constraint is not None:
            check_constrained_sampling(self.constraint.kind, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                                       pooling=self.pooling, prefix="")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
