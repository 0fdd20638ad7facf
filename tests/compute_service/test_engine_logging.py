"""The engine and scheduler log structured events with the request id: admitted, preempted,
finished (reason and token counts) and aborted; never the prompt itself."""

from __future__ import annotations

import random
from collections.abc import Callable

from structlog.testing import capture_logs

from compute_service import LLM, SamplingParams
from tests.conftest import TinyModel


def test_lifecycle_events_carry_the_request_id(make_tiny_model: Callable[[str], TinyModel]) -> None:
    rng = random.Random(9)
    low = [rng.randrange(3, 128) for _ in range(30)]  # 8 of the pool's 10 blocks of 4
    high = [rng.randrange(3, 128) for _ in range(12)]  # 3 blocks: low must make room
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(make_tiny_model("llama").path), dtype="float32",
             block_size=4, max_num_blocks=10, max_num_seqs=2) as llm:
        engine = llm.engine
        with capture_logs() as events:
            engine.add_request("low", low, params, priority=0)
            engine.step()
            engine.add_request("high", high, params, priority=5)
            while engine.has_unfinished():
                engine.step()
            engine.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
            engine.step()
            assert engine.abort("gone")
            while engine.has_unfinished():
                engine.step()

    def named(event: str) -> list[dict]:
        return [e for e in events if e["event"] == event]

    admitted = [(e["request_id"], e["num_prompt_tokens"], e["log_level"]) for e in named("admitted")]
    # low twice: at first and again after its preemption (recomputed from scratch).
    assert admitted == [("low", 30, "debug"), ("high", 12, "debug"), ("low", 30, "debug"), ("gone", 3, "debug")]
    assert all(e["seq_id"].startswith(f"{engine.memory.client_id}/") for e in named("admitted"))
    assert all(isinstance(e["num_cached_tokens"], int) for e in named("admitted"))
    assert [(e["request_id"], e["reason"], e["log_level"]) for e in named("preempted")] == [
        ("low", "make_room", "info")
    ]
    assert [(e["request_id"], e["log_level"]) for e in named("aborted")] == [("gone", "info")]
    finished = {e["request_id"]: e for e in named("finished")}
    assert list(finished) == ["high", "low", "gone"]
    assert {k: finished["low"][k] for k in ("reason", "num_prompt_tokens", "num_completion_tokens")} == {
        "reason": "length", "num_prompt_tokens": 30, "num_completion_tokens": 6
    }
    assert (finished["high"]["reason"], finished["high"]["num_completion_tokens"]) == ("length", 6)
    assert (finished["gone"]["reason"], finished["gone"]["num_prompt_tokens"]) == ("abort", 3)
    assert {e["component"] for e in events} == {"scheduler", "engine"}
    # No prompt (or any token list) in any event.
    assert not any(isinstance(value, (list, tuple)) for e in events for value in e.values())
