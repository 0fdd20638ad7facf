"""The greedy fast path: one argmax over the batch, identical to torch's (first maximum, NaN wins)."""

from __future__ import annotations

import pytest
import torch

from compute_service.engine.sampler import greedy_tokens

pytestmark = pytest.mark.unit


def test_greedy_tokens_equal_torch_argmax_on_ties_nan_and_inf() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(48, 4099, generator=g),
        torch.randint(-3, 3, (17, 1000), generator=g).float(),  # many ties: the first maximum
        torch.full((3, 333), float("-inf")),  # all -inf: index 0
    ]
    nan = torch.randn(9, 777, generator=g)
    nan[torch.rand(9, 777, generator=g) < 0.01] = float("nan")  # a NaN counts as the maximum
    nan[0, 5] = nan[0, 600] = float("nan")
    inf = torch.randn(4, 500, generator=g)
    inf[1, 10] = inf[1, 20] = float("inf")
    signed_zero = torch.zeros(2, 64)
    signed_zero[0, :10] = -0.0
    cases += [nan, inf, signed_zero, torch.randn(64, 8, generator=g).t()]  # the last one not contiguous
    for logits in cases:
        assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(cases[2]) == [0, 0, 0] and greedy_tokens(nan)[0] == 5 and greedy_tokens(inf)[1] == 10
    half = torch.randn(5, 300, generator=g).bfloat16()  # not float32: torch's own argmax
    assert greedy_tokens(half) == half.argmax(dim=-1).tolist()
