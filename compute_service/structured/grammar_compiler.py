"""Compiling constraints into xgrammar grammars: off the engine thread and the event loop, cached, bounded.

Why a pool of our own daemon threads, not a ``ThreadPoolExecutor``: a compile cannot be interrupted
(it runs in C++), so one that exceeds its timeout keeps its thread until it finishes. An executor's
workers are joined at interpreter exit, so a runaway compile would hold a SIGTERM-ed service for as
long as it runs; daemon threads let the process exit. xgrammar releases the GIL while it compiles,
so the engine thread and the event loop keep running beside it.

The timeout counts from the moment a worker starts the job, not from submission: a request whose
job is still queued behind runaway compiles a timeout after it asked is told the compiler is busy
(RESOURCE_EXHAUSTED, retry), and is not blamed for a cost that is not its own. A constraint that
timed out is remembered as too costly, so asking again is refused at once instead of occupying
another worker. Failures (invalid schemas, regexes, grammars) are cached like successes: the
engine's message is the answer each time.

Cache key: sha256 of (tokenizer digest, compile options, kind, text); one compiler serves one
tokenizer, and the tokenizer digest keeps keys apart should the cache ever be shared.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from pagedserve.errors import InvalidArgument, ResourceExhaustedError
from pagedserve.log import get_logger

from compute_service.structured.constraint import Constraint

log = get_logger("grammar_compiler")

# Part of every cache key: change it when the options below change what a constraint compiles to.
_COMPILE_OPTIONS = "xgrammar-v1:any_whitespace=False,strict_mode=True"
# xgrammar prefixes its messages with "[time] /path/file.cc:line: " and sometimes a failed check's text.
_ENGINE_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_MAX_MESSAGE_CHARS = 500
# xgrammar 0.2's rule for the characters of a length-bounded JSON string (maxLength/minLength)
# lets raw control characters through, which no strict JSON parser accepts (its unbounded string
# rule excludes them). We compile the schema's EBNF with that one character class corrected.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


@dataclass(frozen=True)
class GrammarCompilerConfig:
    """Attributes:
        num_threads: compile workers (vLLM uses (cpus + 1) // 2).
        timeout_s: the longest one compile may run before its request is refused.
        cache_size: compiled grammars (and failures) kept, least recently used dropped first.
    """

    num_threads: int = 2
    timeout_s: float = 5.0
    cache_size: int = 256

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")


@dataclass(eq=False)
class _Job:
    constraint: Constraint
    started_at: float | None = None  # set by the worker
    timed_out: bool = False
    # (grammar, None) or (None, the engine's message): failures are results, not exceptions.
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def engine_message(exc: BaseException) -> str:
    """The grammar engine's own words, without its source-file prefix, bounded in length."""
    text = _ENGINE_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF alternation of string literals; JSON escaping is also EBNF string escaping."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        stop_token_ids: every token that ends the model's generation: the grammar allows them only
            where it may end, and the engine stops on them.
        config: threads, timeout and cache size.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 config: GrammarCompilerConfig | None = None) -> None:
        self.config = config or GrammarCompilerConfig()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=list(stop_token_ids))
        # One thread per compile: the pool gives the parallelism; xgrammar's own cache is off (ours
        # also keeps failures and timeouts).
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.tokenizer_digest = self._tokenizer_digest()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Job] = OrderedDict()
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.num_running = 0  # compiles in progress (the workers' counter; read anywhere)
        for i in range(self.config.num_threads):
            threading.Thread(target=self._work, name=f"grammar-compile-{i}", daemon=True).start()

    def _tokenizer_digest(self) -> str:
        info = self.tokenizer_info
        h = hashlib.sha256(json.dumps([info.vocab_size, info.vocab_type.name, info.stop_token_ids]).encode())
        for token in info.decoded_vocab:
            h.update(len(token).to_bytes(4, "little"))
            h.update(token)
        return h.hexdigest()

    def cache_key(self, constraint: Constraint) -> str:
        return hashlib.sha256(f"{self.tokenizer_digest}|{_COMPILE_OPTIONS}|{constraint.digest()}".encode()).hexdigest()

    # --- callers -----------------------------------------------------------------------------

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """Blocking compile (in-process callers). Raises InvalidArgument naming the field when the
        constraint is invalid or too costly, ResourceExhaustedError when every worker is busy."""
        job, since = self._submit(constraint), time.monotonic()
        while True:
            try:
                return self._result(job, job.future.result(timeout=self._remaining(job, since)))
            except concurrent.futures.TimeoutError:
                self._check_deadline(job, since)

    async def compile_async(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """``compile`` for the event loop: it waits without blocking the loop."""
        job, since = self._submit(constraint), time.monotonic()
        if job.future.done():
            return self._result(job, job.future.result())
        waiter = self._waiter(job)
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=self._remaining(job, since))
            if done:
                return self._result(job, waiter.result())
            self._check_deadline(job, since)

    @staticmethod
    def _waiter(job: _Job) -> asyncio.Future:
        """An event-loop future that follows the job's. Not ``asyncio.wrap_future``: cancelling that
        would cancel a queued job (whose worker then fails setting its result), and a compile that
        ends after the loop closed must not raise in the worker."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def copy(done: concurrent.futures.Future) -> None:  # on the loop
            if waiter.done():
                return
            if done.exception() is not None:
                waiter.set_exception(done.exception())
            else:
                waiter.set_result(done.result())

        def on_done(done: concurrent.futures.Future) -> None:  # in the worker thread
            try:
                loop.call_soon_threadsafe(copy, done)
            except RuntimeError:
                pass  # the event loop is closed (the service is exiting): nobody waits any more

        job.future.add_done_callback(on_done)
        return waiter

    def new_matcher(self, grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A fresh matcher (its own state) over a shared compiled grammar: one per completion."""
        return xgr.GrammarMatcher(grammar)

    # --- internals ---------------------------------------------------------------------------

    def _submit(self, constraint: Constraint) -> _Job:
        key = self.cache_key(constraint)
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
            else:
                job = self._cache[key] = _Job(constraint)
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)  # waiters still hold their job
                self._queue.put(job)
        if job.timed_out:
            raise self._too_costly(job)
        return job

    def _deadline(self, job: _Job, since: float) -> float:
        """A running job's clock runs from its start; a queued one's from when this caller came."""
        started = job.started_at
        return (started if started is not None else since) + self.config.timeout_s

    def _remaining(self, job: _Job, since: float) -> float:
        return max(0.0, self._deadline(job, since) - time.monotonic())

    def _check_deadline(self, job: _Job, since: float) -> None:
        """Called when a wait ran out: raise if the job is really past its deadline."""
        if time.monotonic() < self._deadline(job, since):
            return  # it started while we waited: its own clock runs from then
        if job.started_at is None:
            raise ResourceExhaustedError(
                f"params.{job.constraint.kind}: every grammar compile worker is busy; retry later")
        if not job.timed_out:
            job.timed_out = True
            log.warning("grammar_compile_timeout", kind=job.constraint.kind, timeout_s=self.config.timeout_s,
                        num_chars=len(job.constraint.spec) + sum(map(len, job.constraint.choices)))
        raise self._too_costly(job)

    def _too_costly(self, job: _Job) -> InvalidArgument:
        return InvalidArgument(f"params.{job.constraint.kind}: compiling took longer than {self.config.timeout_s} s; "
                          "the constraint is too complex")

    @staticmethod
    def _result(job: _Job, result: tuple[xgr.CompiledGrammar | None, str | None]) -> xgr.CompiledGrammar:
        grammar, error = result
        if grammar is None:
            raise InvalidArgument(f"params.{job.constraint.kind}: {error}")
        return grammar

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            job.started_at = time.monotonic()
            with self._lock:
                self.num_running += 1
            try:
                result = (self._compile(job.constraint), None)
            except (RuntimeError, ValueError, TypeError) as exc:  # the engine's verdict on the input
                result = (None, engine_message(exc))
            except BaseException as exc:  # a bug: it reaches the waiter and the log, never lost
                log.exception("grammar_compile_failed", kind=job.constraint.kind)
                job.future.set_exception(exc)
                continue
            finally:
                with self._lock:
                    self.num_running -= 1
            log.debug("grammar_compiled", kind=job.constraint.kind, ok=result[1] is None,
                      seconds=round(time.monotonic() - job.started_at, 4))
            job.future.set_result(result)

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        # Compact JSON (any_whitespace=False: ", " and ": " only) so a model cannot pad with
        # whitespace until max_tokens.
        if c.kind == "json_schema":
            try:
                json.loads(c.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
            return self._compile_json_schema(c.spec, strict_mode=True)
        if c.kind == "json_object":
            # strict_mode=False: any keys and values (strict mode would forbid undeclared properties).
            return self._compile_json_schema('{"type": "object"}', strict_mode=False)
        if c.kind == "regex":
            return self._compiler.compile_regex(c.spec)
        if c.kind == "choice":
            return self._compiler.compile_grammar(choice_grammar(c.choices))
        return self._compiler.compile_grammar(c.spec)

    def _compile_json_schema(self, schema: str, *, strict_mode: bool) -> xgr.CompiledGrammar:
        ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
        return self._compiler.compile_grammar(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
