import json
from pathlib import Path

import pytest

from memory_service.__main__ import build_parser
from memory_service.config import MemoryServiceConfig
from pagedserve.config import config_from_args


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
