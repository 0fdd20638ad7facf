"""Token choice: the next token of each sampling sequence, from its row of the step's logits.

In order: the request's logit biases, its grammar's mask, then the sampler (sampler.py). The chooser
also owns what that needs per sequence: the grammar compiler and each completion's matcher, and
the seeded generators. Why the
per-row failure isolation lives here: a grammar's mask and the sampler run batched, so one request's
failure (a mask that raised or came too late, a sampler error on its row) would otherwise end every
request of the step. A batch that raises is chosen again one row at a time, and only the rows that
fail again end their requests (finish_reason "error"); the others get the tokens they would get alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compute_service.engine.config import EngineConfig
from compute_service.engine.sampler import apply_logit_bias, sample
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.sequence import FinishReason, Sequence
from compute_service.model.model_config import ModelConfig
from compute_service.structured.grammar_compiler import GrammarCompiler
from compute_service.structured.logits_mask import LogitsMasker

# Ends one request with finish_reason "error": (request_id, stage, exception). The engine's.
FailRequest = Callable[[str, str, Exception], None]


class TokenChooser:
    """Picks tokens under biases, grammar masks and sampling parameters; a failure ends its request alone.

    Args:
        model_config: the model's (its vocabulary, and its end tokens: banned under min_tokens).
        tokenizer: for the grammars (None: the engine refuses constrained requests).
        config: the grammar masks' time bounds.
        fail_request: called as soon as a request's row fails, so that its other rows later in the
            same batch (n > 1 completions) see it failed and are skipped.
        grammars: the constraint compiler, shared by the engines a service builds around one model
            (None: made on the first constrained request, and closed by ``close``).
    """

    def __init__(self, model_config: ModelConfig, tokenizer: Any | None, config: EngineConfig,
                 fail_request: FailRequest, grammars: GrammarCompiler | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.masker = LogitsMasker(model_config.vocab_size, timeout_s=config.mask_fill_timeout_s,
                                   max_fill_cpu_s=config.mask_fill_max_cpu_s)
        self._fail_request = fail_request
        self._grammars = grammars
        self._owns_grammars = grammars is None  # made here on first use: closed by ``close``

    @property
    def grammars(self) -> GrammarCompiler:
        """The constraint compiler (built on first use: loading the tokenizer's vocabulary takes a while)."""
        if self._grammars is None:
            config = self.model_config
            self._grammars = GrammarCompiler(self.tokenizer, config.vocab_size, config.eos_token_ids)
        return self._grammars

    def close(self) -> None:
        """Stop what this chooser started itself: the grammar compiler's worker processes."""
        if self._owns_grammars and self._grammars is not None:
            self._grammars.close()
            self._grammars = None

    def new_matcher(self, grammar: Any | None) -> Any | None:
        """A completion's own matcher of its request's compiled grammar (None: unconstrained)."""
        return self.grammars.new_matcher(grammar) if grammar is not None else None

    @staticmethod
    def new_generator(params: SamplingParams, index: int) -> torch.Generator | None:
        """Completion ``index``'s random stream: its own only for a seeded request.

        Why only then: the sampler draws a seeded row exactly as every earlier version did (one
        exponential per vocabulary entry, ~4 ms a row on the default model). An unseeded row draws
        from the nucleus alone (inverse CDF on torch's global generator): the same distribution, a
        tenth of the sampler's cost.
        """
        if params.is_greedy or params.seed is None:
            return None
        generator = torch.Generator()
        generator.manual_seed((params.seed + index) % 2**64)
        return generator

    def choose(self, rows: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        """The next token of each sequence, None for a sequence whose request failed.

        Args:
            rows: (B, V) raw logits, one row per sequence in ``seqs``; this step's own rows, which
                nothing else reads while they are chosen from (constrained rows may be masked in place).
            seqs: the sequences, each with its params, generator and grammar matcher.
        Returns:
            B token ids (None: the request failed, now or before, and gets nothing more).
        """
        try:
            return self._mask_and_sample(rows, seqs)
        except Exception:  # isolated below, one sequence at a time
            # (A seeded sequence sampled before the failure draws again: only on this failure path.
            # Masking a row twice under the same matcher state gives the same row.)
            tokens: list[int | None] = []
            for seq, row in zip(seqs, rows):
                try:
                    [token] = self._mask_and_sample(row[None], [seq])
                except Exception as exc:  # the request's error
                    self._fail_request(seq.request_id, "sampling", exc)
                    token = None
                tokens.append(token)
            return tokens

    @staticmethod
    def accept(seq: Sequence, token: int) -> None:
        """Advance the sequence's grammar by ``token``, which was chosen under its mask.

        Raises:
            RuntimeError: the grammar rejected it: a bug, not bad input (it ends this request alone,
                finish_reason "error"; the token is never reported).
        """
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            raise RuntimeError(f"{seq.seq_id}: the grammar rejected sampled token {token} despite its mask")

    def _mask_and_sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        """Next tokens from (B, V) logits, rows of this step's logits that nothing else reads. Logit
        biases are added first, into a copy (the raw rows stay for logprobs, and for n > 1 forks,
        which add their bias again). Constrained rows are masked: in place, unless a sequence asks for
        logprobs (the raw rows' log-softmax) and no bias made a copy already, then in a copy. n > 1
        forks sample again from a parent's row: their matchers are in the parent's state, so a row
        already masked for it is the row they would mask.

        A sequence whose mask failed (or came too late: ``LogitsMasker``) fails its request here and
        gets None, and so does any sequence of an already failed request (its matcher may still be
        in an abandoned fill: it is never touched again)."""
        raw = logits
        logits = apply_logit_bias(logits, seqs)  # a new tensor when any sequence has a bias
        if any(seq.matcher is not None for seq in seqs):
            keep_raw = logits is raw and any(seq.params.logprobs is not None for seq in seqs)
            matchers = [None if seq.finish_reason is FinishReason.ERROR else seq.matcher for seq in seqs]
            masked = self.masker.apply(logits, matchers, keep_raw=keep_raw)
            logits = masked.logits
            for row, exc in masked.failures.items():
                self._fail_request(seqs[row].request_id, "masking", exc)
        tokens = sample(logits, seqs, self.model_config.eos_token_ids)
        return [None if seq.finish_reason is FinishReason.ERROR else token for seq, token in zip(seqs, tokens)]
