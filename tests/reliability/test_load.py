"""Load through the gateway: concurrent streaming clients all complete, well-formed, none lost or
answered twice, blocks back to idle; a burst beyond the gateway's queue is RESOURCE_EXHAUSTED at once.

The benchmark runs 256 clients on the default model; here 24 clients on the tiny model.
"""

from __future__ import annotations

from pagedserve_testing import load
from pagedserve_testing.stack import Stack
from pagedserve.process import wait_until
from tests.reliability.conftest import GATEWAY_MAX_QUEUED

NUM_CLIENTS, MAX_TOKENS = 24, 12
OK_STREAMS = 'pagedserve_gateway_requests_total{method="GenerateStream",status="OK"}'


def test_concurrent_streams_all_complete_once(stack: Stack) -> None:
    before = load.metric(stack.gateway.metrics_port, OK_STREAMS)
    report = load.run_streams(stack.gateway.address, NUM_CLIENTS, MAX_TOKENS, timeout_s=60, tag="t-load")
    assert report.codes == {"OK": NUM_CLIENTS}
    assert report.num_well_formed(MAX_TOKENS) == NUM_CLIENTS, [
        r for r in report.results if not r.is_well_formed(MAX_TOKENS)]
    assert len({r.request_id for r in report.results}) == NUM_CLIENTS
    # The gateway answered each exactly once (no retry answered a request twice).
    assert load.metric(stack.gateway.metrics_port, OK_STREAMS) - before == NUM_CLIENTS
    assert report.ttft_percentiles_ms()["p99"] > 0
    stack.wait_idle()


def test_overload_beyond_the_queue_is_refused_before_any_accepted_stream_ends(stack: Stack) -> None:
    num, max_tokens = GATEWAY_MAX_QUEUED + 16, 240
    # Sampled: one step per token, so the first accepted stream ends ~240 steps after it starts (a
    # greedy one, its drafts accepted, could end before the gateway has refused the last arrivals).
    # At 60 tokens (~0.6 s here) a loaded CI machine once took longer than that to open all 48
    # streams: slots freed before the last arrivals, and only 7 were refused.
    report = load.run_streams(stack.gateway.address, num, max_tokens, timeout_s=90, tag="t-over", temperature=1.0)
    codes = report.codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes.get("RESOURCE_EXHAUSTED", 0) >= 16 and codes.get("OK", 0) >= GATEWAY_MAX_QUEUED - 4, codes
    # Refused at once, not after waiting for a slot: every refusal comes before the first accepted
    # stream has all its tokens (an order, which holds on a loaded machine as on an idle one).
    refused = [r.elapsed_s for r in report.results if r.code == "RESOURCE_EXHAUSTED"]
    accepted = [r.elapsed_s for r in report.results if r.code == "OK"]
    assert max(refused) < min(accepted), f"a refusal took {max(refused):.2f} s, a stream ended at {min(accepted):.2f} s"
    assert report.num_well_formed(max_tokens) == codes["OK"]
    stack.wait_idle()


def test_a_client_that_vanishes_with_open_streams_has_them_all_aborted(stack: Stack) -> None:
    num = 20
    # Each stream stops at its full 1 KiB flow-control window (see load.vanishing_client): all stay
    # open until the kill, and then only the gateway's abort can end them before its write-stall
    # timeout (30 s, longer than wait_idle's 20 s).
    finished_before = load.metric(stack.gateway.metrics_port, OK_STREAMS)
    client = load.vanishing_client(stack.gateway.address, num, 900)
    try:
        wait_until(lambda: load.metric(stack.gateway.metrics_port, "pagedserve_gateway_queue_length") >= num, 60,
                   "every stream held by the gateway")
        assert stack.num_used_blocks() > 0
    finally:
        client.kill()
        client.wait()
    stats = stack.wait_idle(timeout_s=20)
    assert stack.compute_load().num_running == 0 and stats.num_sequences == 0
    assert load.metric(stack.gateway.metrics_port, "pagedserve_gateway_queue_length") == 0
    assert load.metric(stack.gateway.metrics_port, OK_STREAMS) == finished_before  # aborted, none ran to its end
