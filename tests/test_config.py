import importlib
import json
from pathlib import Path

import pytest

from memory_service.__main__ import build_parser
from memory_service.config import MemoryServiceConfig
from pagedserve.config import config_from_args

pytestmark = pytest.mark.unit


def test_config_file_keys_and_flag_override(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"block_size": 32, "max_num_blocks": 100, "enable_prefix_caching": False,
                                "memory_utilization_threshold": 0.5}))
    args = build_parser().parse_args(["--config", str(path), "--max-num-blocks", "7"])
    config = config_from_args(MemoryServiceConfig, args)
    assert (config.block_size, config.max_num_blocks, config.enable_prefix_caching) == (32, 7, False)
    assert config.memory_utilization_threshold == 0.5


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"block_size": 0}, "block_size"),
        ({"memory_utilization_threshold": 1.5}, "memory_utilization_threshold"),
        ({"max_num_blocks": -1}, "max_num_blocks"),
        ({"blok_size": 16}, "blok_size"),
    ],
)
def test_bad_config_names_the_value(tmp_path: Path, values: dict, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError, match=needle):
        config_from_args(MemoryServiceConfig, build_parser().parse_args(["--config", str(path)]))


def test_service_flags_come_from_the_dataclass_fields() -> None:
    """Every service's flags are derived from its config: a flag not given parses as None (so the
    file's value or the dataclass default holds), bools take true/false, repeated flags make a tuple."""
    from compute_service.__main__ import build_parser as compute_parser
    from gateway.__main__ import build_parser as gateway_parser
    from gateway.config import GatewayConfig

    args = build_parser().parse_args(["--enable-prefix-caching", "false", "--log-level", "warning"])
    config = config_from_args(MemoryServiceConfig, args)
    assert (config.enable_prefix_caching, config.log_level, config.block_size) == (False, "warning", 16)
    gateway = config_from_args(GatewayConfig, gateway_parser().parse_args(
        ["--backend", "unix:/a", "--backend", "127.0.0.1:1", "--log-prompts", "--metrics-port", "0"]))
    assert (gateway.backends, gateway.log_prompts, gateway.metrics_port) == (("unix:/a", "127.0.0.1:1"), True, 0)
    assert "(default 127.0.0.1:50052)" in " ".join(compute_parser().format_help().split())


@pytest.mark.parametrize("service", ["memory_service", "compute_service", "gateway"])
@pytest.mark.parametrize(("flag", "value", "needle"), [("--metrics-port", "65536", "metrics_port"),
                                                      ("--log-level", "loud", "log_level"),
                                                      ("--metrics-host", "", "metrics_host")])
def test_common_service_settings_are_validated_alike(service: str, flag: str, value: str, needle: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(f"{service}.__main__").main
    assert main(["--backend", "unix:/a", flag, value] if service == "gateway" else [flag, value]) == 2
    assert needle in capsys.readouterr().err
