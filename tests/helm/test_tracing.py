"""The chart's traces (tracing.otlpEndpoint): every service of it gets ``--otlp-traces-endpoint``, or none does.

Each container's args are parsed by the service's own parser and config, so the flag the chart
writes is one the service takes, with a value it accepts (docs/design.md, "Traces").
"""

from __future__ import annotations

import helm_python as helm
import pytest

import compute_service.__main__ as compute_main
import gateway.__main__ as gateway_main
import memory_service.__main__ as memory_main
from pagedserve.config import ServiceConfig
from tests.helm.chart import container, engine_pod, flag, gateway_pod, lint, render

ENDPOINT = "http://otel-collector.observability:4317"


def _containers(values: dict | None = None) -> dict[str, dict]:
    rendered = render(values)
    engine = engine_pod(rendered)
    return {"memory": container(engine, "memory"), "compute": container(engine, "compute"),
            "gateway": container(gateway_pod(rendered), "gateway")}


def test_no_traces_by_default() -> None:
    for name, c in _containers().items():
        assert "--otlp-traces-endpoint" not in c["args"], name


def test_an_endpoint_turns_traces_on_in_every_service() -> None:
    values = {"tracing": {"otlpEndpoint": ENDPOINT}}
    containers = _containers(values)
    assert {name: flag(c, "--otlp-traces-endpoint") for name, c in containers.items()} == dict.fromkeys(
        ("memory", "compute", "gateway"), ENDPOINT)
    # Each service's own parser takes the flag as the chart writes it, and its config the value.
    parsers = {"memory": memory_main.build_parser(), "compute": compute_main.build_parser(),
               "gateway": gateway_main.build_parser()}
    for name, parser in parsers.items():
        assert parser.parse_args(containers[name]["args"]).otlp_traces_endpoint == ENDPOINT, name
    assert ServiceConfig(otlp_traces_endpoint=ENDPOINT).otlp_traces_endpoint == ENDPOINT
    assert lint(values) == []


def test_behind_an_inference_pool_each_engine_pods_openai_front_traces_too() -> None:
    values = {"inferencePool": {"enabled": True}, "gateway": {"httpAllowedHosts": ["llm.example.com"]},
              "tracing": {"otlpEndpoint": ENDPOINT}}
    engine = engine_pod(render(values))
    assert {name: flag(container(engine, name), "--otlp-traces-endpoint") for name in ("memory", "compute", "openai")} \
        == dict.fromkeys(("memory", "compute", "openai"), ENDPOINT)
    assert gateway_main.build_parser().parse_args(container(engine, "openai")["args"]).otlp_traces_endpoint == ENDPOINT


@pytest.mark.parametrize("endpoint", ["otel:4317", "grpc://otel:4317", "http://otel collector:4317"])
def test_an_endpoint_without_its_scheme_fails_install_naming_the_key(endpoint: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        render({"tracing": {"otlpEndpoint": endpoint}})
    assert "/tracing/otlpEndpoint" in str(info.value)
