"""The constraint compiler on its own: busy workers, timeouts, cached verdicts, keys per tokenizer.
(Killed compiles, mask probes, tenants and dropped jobs: test_costly_grammars.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from compute_service import Constraint
from compute_service.structured import compile_worker, grammar_compiler
from compute_service.structured.grammar_compiler import GrammarCompiler, GrammarCompilerConfig, choice_grammar
from pagedserve import cpu_preload
from pagedserve.errors import InvalidArgument, ResourceExhaustedError
from pagedserve.process import wait_until
from tests.structured.conftest import EOS, VOCAB, ByteModel

# About 0.3 s on an idle core (the time grows with the cube of the number of optional properties).
# Optional properties compile in superlinear time: 800 of any type take ~0.5 s on an idle core,
# ten times the timeout below, whatever the machine's load (400 integers, ~0.09 s, were too close).
SLOW = Constraint.json_schema(json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(800)}}))


def assert_closed(compiler: GrammarCompiler, pids: list[int]) -> None:
    """``close`` left no worker process behind."""
    compiler.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_queued_job_is_busy_and_the_slow_one_too_complex(byte_model: ByteModel) -> None:
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=1, timeout_s=0.05))
    pids = compiler.worker_pids()
    errors: list[Exception] = []

    def slow() -> None:
        try:
            compiler.compile(SLOW)
        except InvalidArgument as exc:
            errors.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    wait_until(lambda: compiler.num_running, 60, "the only worker to take the slow job", interval_s=0.001)
    with pytest.raises(ResourceExhaustedError, match="params.regex: every grammar compile worker is busy"):
        compiler.compile(Constraint.regex("[ab]+"))
    thread.join(60)
    assert [str(e) for e in errors] == [
        "params.json_schema: compiling took more than 0.05 s of CPU; the constraint is too complex"]
    start = time.monotonic()
    with pytest.raises(InvalidArgument, match="too complex"):  # remembered: refused at once
        compiler.compile(SLOW)
    assert time.monotonic() - start < 0.05

    def compiles() -> bool:  # the queued job runs once the worker is free
        try:
            return compiler.compile(Constraint.regex("[ab]+")) is not None
        except ResourceExhaustedError:
            return False

    wait_until(compiles, 120, "the queued job compiled", interval_s=0.01)
    assert_closed(compiler, pids + compiler.worker_pids())


def test_workers_start_with_the_first_constraint_and_their_start_is_not_its_wait(byte_model: ByteModel) -> None:
    """No process at construction (most services never see a constraint, and a worker imports
    xgrammar: seconds of CPU). The first compile starts them and waits for them without its
    queued wait running: a timeout shorter than a worker's start still compiles. Before: the
    constructor started both workers and waited for them."""
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=2, timeout_s=0.5))
    assert compiler.worker_pids() == [] and not compiler._starting
    assert compiler.compile(Constraint.regex("[ab]+")) is not None
    wait_until(lambda: len(compiler.worker_pids()) == 2, 120, "both workers ready")
    assert_closed(compiler, compiler.worker_pids())


def test_close_while_the_workers_start_leaves_no_process_and_answers_the_waiting_caller(
        byte_model: ByteModel) -> None:
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=2))
    errors: list[Exception] = []

    def first() -> None:
        try:
            compiler.compile(Constraint.regex("[ab]+"))
        except ResourceExhaustedError as exc:
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    wait_until(lambda: len(compiler._starting) == 2, 60, "both workers starting", interval_s=0.001)
    starting = [worker.process.pid for worker in list(compiler._starting.values())]
    compiler.close()
    thread.join(10)
    assert not thread.is_alive()
    assert [str(e) for e in errors] == ["params.regex: the grammar compiler is shut down"]
    for pid in starting:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert compiler.worker_pids() == []


def test_verdicts_are_cached_and_keys_depend_on_the_tokenizer(byte_model: ByteModel) -> None:
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=1))
    bad = Constraint.regex("(ab")
    for _ in range(2):
        with pytest.raises(InvalidArgument, match=r"^params.regex: Regex parsing error at position 4"):
            compiler.compile(bad)
    grammar = compiler.compile(Constraint.choice(["a", "b"]))
    assert compiler.compile(Constraint.choice(["a", "b"])) is grammar  # one compile, shared by every matcher
    # another stop set: another grammar
    with GrammarCompiler(byte_model.tokenizer, VOCAB, [256, EOS], GrammarCompilerConfig(num_threads=1)) as other:
        assert other.tokenizer_digest != compiler.tokenizer_digest
        assert other.cache_key(bad) != compiler.cache_key(bad)
    assert_closed(compiler, compiler.worker_pids())
    assert Constraint.choice(["ab", "c"]).digest() != Constraint.choice(["a", "bc"]).digest()


def test_choice_grammar_escapes_every_literal() -> None:
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_workers_run_without_the_compute_process_preload(byte_model: ByteModel, monkeypatch) -> None:
    """The compute process runs with Intel OpenMP preloaded (pagedserve/cpu_preload.py); its compile
    workers gain nothing from it, and one killed with it loaded (close kills them) left its registration
    file in /dev/shm: two of them outlived the compute container in tests/helm/test_image.py."""
    preload = cpu_preload.preload_env({})
    if preload is None:
        pytest.skip("no Intel OpenMP here to preload")
    for name, value in preload.items():
        monkeypatch.setenv(name, value)
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=1))
    compiler.start()  # workers start with the first constraint otherwise
    [pid] = compiler.worker_pids()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not [e for e in environ if e.startswith(b"LD_PRELOAD=") and b"libiomp5" in e]
    assert compiler.compile(Constraint.regex("[ab]+")) is not None
    assert_closed(compiler, [pid])
    assert not list(Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"))


def test_a_worker_ignores_ctrl_c_and_keeps_compiling(byte_model: ByteModel) -> None:
    """Ctrl-C reaches every process of `pagedserve up`'s group: a worker used to die of it with a
    KeyboardInterrupt traceback on the terminal. Its parent decides when it ends."""
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=1))
    compiler.start()
    [pid] = compiler.worker_pids()
    os.kill(pid, signal.SIGINT)
    assert compiler.compile(Constraint.regex("[ab]+")) is not None
    assert compiler.worker_pids() == [pid]
    assert_closed(compiler, [pid])


def test_workers_run_at_a_low_priority_and_the_timeout_counts_their_cpu(
        byte_model: ByteModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A costly compile beside a busy engine took half a core from its parallel region (other tenants'
    requests ran several times slower): the workers run at nice ``WORKER_NICE``. A worker that gets
    no CPU (stopped here, as a starved one would be) is not blamed: past 8x the timeout in wall time
    its request is told to retry (RESOURCE_EXHAUSTED, before: "too complex", remembered), and the
    same constraint compiles when asked again."""
    monkeypatch.setattr(grammar_compiler, "MIN_WALL_LIMIT_S", 0.0)
    compiler = GrammarCompiler(byte_model.tokenizer, VOCAB, [EOS], GrammarCompilerConfig(num_threads=1, timeout_s=0.25))
    assert compiler.compile(Constraint.regex("[ab]+")) is not None
    [pid] = compiler.worker_pids()
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + compile_worker.WORKER_NICE)  # 19: the lowest
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ResourceExhaustedError, match=r"^params.regex: the machine is too busy .* retry later"):
        compiler.compile(Constraint.regex("[cd]+"))
    assert 2.0 <= time.monotonic() - start < 10.0  # 8 x 0.25 s of wall time, not 0.25 s
    wait_until(lambda: len(compiler.worker_pids()) == 1, 120, "a fresh worker")
    assert compiler.compile(Constraint.regex("[cd]+")) is not None  # no verdict was kept
    assert_closed(compiler, [pid, *compiler.worker_pids()])
