"""The one dtype-name map: names round-trip, aliases parse, anything else is a clear ValueError."""

import pytest
import torch

from pagedserve import dtypes
from pagedserve.dtypes import AUTO, DTYPES, dtype_name, parse_dtype, resolve_auto

pytestmark = pytest.mark.unit


def test_names_round_trip_and_aliases_parse() -> None:
    assert list(DTYPES) == ["float32", "float16", "bfloat16"]
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name and parse_dtype(name) == dtype
    assert (parse_dtype("fp32"), parse_dtype("fp16"), parse_dtype("bf16")) == (
        torch.float32, torch.float16, torch.bfloat16)


def test_unsupported_dtypes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="'int8' is not one of .*bfloat16"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="torch.int8 is not one of float32, float16, bfloat16"):
        dtype_name(torch.int8)


def test_auto_is_bfloat16_where_the_cpu_has_native_bf16_and_float32_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(dtypes.platform, "machine", lambda: "x86_64")
    assert resolve_auto("cpu", {"avx512f", "avx512_bf16"}) == ("bfloat16", "cpu has avx512_bf16")
    assert resolve_auto("cpu", {"amx_tile", "amx_bf16", "avx512_bf16"}) == ("bfloat16", "cpu has amx_bf16")
    name, reason = resolve_auto("cpu", {"avx512f", "avx512bw", "avx2"})  # AVX-512 without BF16: emulated
    assert name == "float32" and "no native bf16" in reason
    assert resolve_auto("cuda", set()) == ("bfloat16", "cuda")
    monkeypatch.setattr(dtypes.platform, "machine", lambda: "aarch64")
    assert resolve_auto("cpu", {"avx512_bf16"})[0] == "float32"  # x86 flag names only


def test_engine_config_defaults_to_auto_and_names_a_bad_dtype() -> None:
    from compute_service.engine.config import EngineConfig

    assert EngineConfig().dtype == AUTO and EngineConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of float32, float16, bfloat16, got 'fp8'"):
        EngineConfig(dtype="fp8")
