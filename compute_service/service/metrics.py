"""Prometheus metrics of the compute service, read from the engine loop's snapshot at scrape time.

What a router outside pagedserve reads (the Gateway API Inference Extension's model-server protocol,
llm-d's metrics extractor) is here under our names, mapped in docs/design.md ("Metrics for routers"):
``pagedserve_compute_requests_waiting`` (vLLM's ``vllm:num_requests_waiting``),
``pagedserve_compute_requests_running`` (``vllm:num_requests_running``), ``pagedserve_compute_kv_usage``
(``vllm:kv_cache_usage_perc``, a fraction in [0, 1] as vLLM's is) and
``pagedserve_compute_cache_config_info{block_size,num_gpu_blocks}`` (``vllm:cache_config_info``,
vLLM's label names, which the routers read). The latency histograms are request_metrics.py's.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from compute_service.service.engine_loop import EngineLoop
from compute_service.service.servicer import ComputeServicer


class ComputeCollector(Collector):
    """``pagedserve_compute_*``: the Load RPC's figures, open streams, and totals since start."""

    def __init__(self, loop: EngineLoop, servicer: ComputeServicer) -> None:
        self._loop = loop
        self._servicer = servicer

    def collect(self) -> Iterator:
        load, totals = self._loop.load, self._loop.totals
        yield GaugeMetricFamily("pagedserve_compute_ready", "1 when attached to the memory service and serving",
                                value=float(self._servicer.is_ready and not self._servicer.is_draining))
        yield GaugeMetricFamily("pagedserve_compute_streams", "Open Generate streams", value=self._servicer.num_streams)
        info = self._servicer.info
        if info is not None:  # always, once serving: the metrics server starts after the model loads
            # Info's `kernels` as labels, value 1: alert on path="torch-fallback".
            path, _, level = info.kernels.partition(" ")
            kernels = GaugeMetricFamily("pagedserve_compute_kernels",
                                        "The kernels every step runs: path fused-cpp (level: the x86-64 level or "
                                        "native), torch-fallback, torch or triton", labels=["path", "level"])
            kernels.add_metric([path, level], 1.0)
            yield kernels
            paths = GaugeMetricFamily("pagedserve_compute_kernel_path",
                                      "The code each kernel runs on this CPU (Info's kernel_paths), value 1",
                                      labels=["kernel", "path"])
            for kernel, kernel_path in info.kernel_paths:
                paths.add_metric([kernel, kernel_path], 1.0)
            yield paths
        yield GaugeMetricFamily("pagedserve_compute_requests_running", "Requests generating", value=load.num_running)
        yield GaugeMetricFamily("pagedserve_compute_requests_waiting", "Requests queued", value=load.num_waiting)
        # Per tenant (the requests' ``tenant``; "" = none given): the fair queues of the scheduler.
        # Only tenants with requests in the engine appear, so the label set is bounded by the queue.
        per_tenant = GaugeMetricFamily("pagedserve_compute_tenant_requests",
                                       "Requests of each tenant in the engine, by state (running, waiting)",
                                       labels=["tenant", "state"])
        for queue in load.tenants:
            per_tenant.add_metric([queue.tenant, "running"], queue.num_running)
            per_tenant.add_metric([queue.tenant, "waiting"], queue.num_waiting)
        yield per_tenant
        yield GaugeMetricFamily("pagedserve_compute_kv_usage", "Share of KV blocks in use", value=load.kv_usage)
        lease = self._loop.lease
        if lease is not None:  # attached: the pool this engine allocates from (a new one after a re-attach)
            # Value 1, the facts as labels (vLLM's cache_config_info and its label names: routers read
            # block_size to hash prompts as the engine does, num_gpu_blocks to size their index of it).
            cache = GaugeMetricFamily("pagedserve_compute_cache_config_info",
                                      "The KV cache this engine allocates from: tokens per block, blocks in "
                                      "the pool (on the GPU, or in host memory on a CPU engine)",
                                      labels=["block_size", "num_gpu_blocks"])
            cache.add_metric([str(lease.block_size), str(lease.num_blocks)], 1.0)
            yield cache
        yield GaugeMetricFamily("pagedserve_compute_pending_tokens", "Tokens still to compute",
                                value=load.num_pending_tokens)
        yield GaugeMetricFamily("pagedserve_compute_prefix_cache_hit_rate",
                                "Prompt tokens served from cache / admitted", value=load.prefix_cache_hit_rate)
        yield CounterMetricFamily("pagedserve_compute_generated_tokens", "Tokens generated",
                                  value=totals.num_generated_tokens)
        yield CounterMetricFamily("pagedserve_compute_finished_requests", "Requests finished (any reason)",
                                  value=totals.num_finished_requests)
        yield CounterMetricFamily("pagedserve_compute_steps", "Engine steps", value=totals.num_steps)
        yield CounterMetricFamily("pagedserve_compute_failed_requests",
                                  "Requests ended by a failure of their own (finish_reason error or INTERNAL)",
                                  value=totals.num_failed_requests)
        yield CounterMetricFamily("pagedserve_compute_draft_tokens", "Speculative n-gram drafts computed",
                                  value=totals.num_draft_tokens)
        yield CounterMetricFamily("pagedserve_compute_accepted_draft_tokens",
                                  "Speculative drafts accepted (each saved one step of its sequence)",
                                  value=totals.num_accepted_draft_tokens)
        yield CounterMetricFamily("pagedserve_compute_memory_releases",
                                  "Idle spells after steps whose free activation memory was handed back to the system",
                                  value=totals.num_memory_releases)
        num_buffered, num_paused = self._servicer.buffer_stats()
        yield GaugeMetricFamily("pagedserve_compute_stream_buffered_outputs",
                                "Step outputs waiting in stream buffers for their clients", value=num_buffered)
        yield GaugeMetricFamily("pagedserve_compute_streams_paused",
                                "Streams whose buffer is full: their requests wait for the client", value=num_paused)
        yield CounterMetricFamily("pagedserve_compute_stalled_streams",
                                  "Streams aborted because their client read nothing for write_stall_timeout_s",
                                  value=self._servicer.num_stalled_streams)


def start_metrics_server(host: str, port: int, loop: EngineLoop, servicer: ComputeServicer) -> None:
    registry = CollectorRegistry()
    registry.register(ComputeCollector(loop, servicer))
    loop.request_times.register(registry)
    start_http_server(port, addr=host, registry=registry)
