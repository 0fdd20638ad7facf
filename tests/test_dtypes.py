"""The one dtype-name map: names round-trip, aliases parse, anything else is a clear ValueError."""

import pytest
import torch

from pagedserve.dtypes import DTYPES, dtype_name, parse_dtype

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
