"""Bad values fail at install (values.schema.json, checked by Helm itself) with a message that names
the offending key."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import pytest

from gateway.core.tool_parsers import PARSER_NAMES
from tests.helm.chart import lint, render

BAD_VALUES = {
    "negative engine replicas": ({"engine": {"replicas": -1}}, "/engine/replicas"),
    "negative gateway replicas": ({"gateway": {"replicas": -2}}, "/gateway/replicas"),
    "unknown GPU mode": ({"gpu": {"mode": "tpu"}}, "/gpu/mode"),
    "missing model source": ({"model": {"source": None}}, "missing property 'source'"),
    "unknown model source": ({"model": {"source": "s3"}}, "/model/source"),
    "pvc source without a claim": ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
    "download source without a repo": ({"model": {"source": "download"}}, "/model/download/repo"),
    "misspelt key": ({"engine": {"replica": 2}}, "'replica' not allowed"),
    "port out of range": ({"gateway": {"port": 70000}}, "/gateway/port"),
    "relative socket dir": ({"engine": {"socketDir": "run/pagedserve"}}, "/engine/socketDir"),
    "bad shm size": ({"engine": {"shmSizeLimit": "lots"}}, "/engine/shmSizeLimit"),
    "tls without a server name": ({"gateway": {"tls": {"enabled": True, "secretName": "c"}}},
                                  "/gateway/tls/serverName"),
    "tls without a certificate": ({"gateway": {"tls": {"enabled": True, "serverName": "n"}}}, "/gateway/tls"),
    "unknown tool-call parser": ({"gateway": {"toolCallParser": "mistral"}}, "/gateway/toolCallParser"),
    "zero write-stall timeout": ({"gateway": {"writeStallTimeoutSeconds": 0}}, "/gateway/writeStallTimeoutSeconds"),
    "relative kv tier mount": ({"engine": {"memory": {"kvTier": {"mountPath": "kv"}}}},
                               "/engine/memory/kvTier/mountPath"),
    "bad kv tier size": ({"engine": {"memory": {"kvTier": {"sizeLimit": "big"}}}}, "/engine/memory/kvTier/sizeLimit"),
    "zero kv tier bytes": ({"engine": {"memory": {"kvTier": {"bytes": 0}}}}, "/engine/memory/kvTier/bytes"),
    "zero kv host tier bytes": ({"engine": {"memory": {"kvTier": {"hostBytes": 0}}}},
                                "/engine/memory/kvTier/hostBytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_fail_install_naming_the_key(case: str) -> None:
    values, expected = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    assert expected in str(info.value)
    # `helm lint` reports the same problem as an error.
    assert any(expected in finding["error"] for finding in lint(values))


def test_good_edge_values_pass() -> None:
    """Scaling engines to zero and the smallest valid settings are accepted."""
    rendered = render({"engine": {"replicas": 0, "memory": {"kvCacheBytes": None}}, "gateway": {"replicas": 1}})
    engine = rendered.one("Deployment", "-engine")
    assert engine["spec"]["replicas"] == 0
    [memory] = [c for c in engine["spec"]["template"]["spec"]["initContainers"] if c["name"] == "memory"]
    assert "--kv-cache-bytes" not in memory["args"]  # sized by memory_utilization_threshold instead


def test_cpu_pool_larger_than_dev_shm_fails_at_install() -> None:
    """On CPU the pool is a /dev/shm file: a pool beyond the emptyDir's size would be an eviction
    at run time, so the chart refuses it up front, naming both values."""
    too_big = {"gpu": {"mode": "none"}, "engine": {"shmSizeLimit": "512Mi", "memory": {"kvCacheBytes": 1 << 30}}}
    with pytest.raises(helm.HelmRenderError) as info:
        render(too_big)
    assert "engine.shmSizeLimit (512Mi) must be at least engine.memory.kvCacheBytes (1073741824)" in str(info.value)
    render({"gpu": {"mode": "none"}, "engine": {"shmSizeLimit": "1Gi", "memory": {"kvCacheBytes": 1 << 30}}})
    render({"gpu": {"mode": "dra"}, "engine": {"shmSizeLimit": "64Mi", "memory": {"kvCacheBytes": 1 << 30}}})


def test_tool_call_parser_choices_are_the_gateways() -> None:
    """The chart's enum for gateway.toolCallParser lists exactly the gateway's --tool-call-parser choices."""
    schema = json.loads((Path(__file__).parents[2] / "helm/pagedserve/values.schema.json").read_text())
    assert schema["properties"]["gateway"]["properties"]["toolCallParser"]["enum"] == list(PARSER_NAMES)
