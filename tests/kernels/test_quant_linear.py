"""The quantized linear (csrc/quant_linear.h) against a float reference: every path (AMX tiles where
the CPU has them, AVX512-BF16 dot products, the widened fallback for float32 activations), both
widths, per-channel and grouped scales, with and without mins and bias, one pass of rows and several.

The reference multiplies the same bf16 activations by the weight `dequantize` gives (the scalar
reading of the packed layout), rounded to bf16 where the kernel de-quantizes into bf16, in float64:
the kernel may differ only by float32 summation order. Where a decode batch multiplies int8
activations, or a prompt past it does (AVX512-VNNI, CPUs without AMX: `_int8_activations`), the
reference takes those activations as the kernel quantizes them."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import cpu_ops, quant

pytestmark = pytest.mark.skipif(cpu_ops.load() is None or cpu_ops.load().quant_linear_isa() != "avx512-bf16",
                                reason="the quantized kernels need a build with AVX512-BF16")


def _paths() -> list[bool]:
    return [False, True] if quant.tiles() else [False]


def _few_rows(rows: int, weight: quant.QuantizedWeight) -> bool:
    """Whether `rows` take the few-row path (csrc/quant_linear.h `fused`: one symmetric scale per column,
    up to 4 rows; scales per group, any width, up to 2 rows), which multiplies the integers as they are."""
    per_column = weight.bits == 8 and weight.mins is None and weight.group == weight.in_features
    return rows <= (4 if per_column else 2)


def _int8_rows(rows: int, weight: quant.QuantizedWeight, tiles: bool) -> bool:
    """Whether `rows` multiply int8 activations (csrc/quant_linear.h `vnni_rows`, `vnni_tile_rows`)."""
    tile_rows = quant.vnni_tile_rows()
    return (not tiles and not _few_rows(rows, weight) and weight.group % 16 == 0
            and (rows <= quant.vnni_rows() or 0 < tile_rows <= rows))


def _int8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the VNNI path quantizes it for a weight with `group` inputs per scale, de-quantized in
    float64: per row and block of inputs (the group, or 32 where the group is a larger multiple of 32),
    q = round(x * (127 / amax)) to nearest even in float32, times amax / 127."""
    group = 32 if group > 32 and group % 32 == 0 else group
    rows, inputs = x.shape
    xf = x.float().view(rows, inputs // group, group)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv)
    assert q.abs().max() <= 127
    return (q.double() * (amax / 127).double()).view(rows, inputs)


def _split_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """float32 x as `linear_float` multiplies it (csrc/quant_linear.h `quantize_split`), in float64: its
    int8 values as `_int8_activations`, plus the int8 values of what those leave (x - q * scale, rounded
    to float32 once, as the kernel's fused multiply-add does)."""
    first = _int8_activations(x, group)
    rest = (x.double() - first).float()
    return first + _int8_activations(rest, group)


def _bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """float32 x as `linear_float` multiplies it in the few-row path, in float64: its rounding to bf16
    plus what that leaves (exact in float32) rounded to bf16."""
    high = x.bfloat16()
    return high.double() + (x - high.float()).bfloat16().double()


def _float_reference(x: torch.Tensor, weight: quant.QuantizedWeight) -> torch.Tensor:
    """What a float32 x times `weight` gives where `quant.float_vnni()`: two rows a row as bf16 parts
    where they fit the few-row path, else as int8 parts; elsewhere (the weight widened) x itself;
    times the integers as they are."""
    if quant.float_vnni() and weight.group % 16 == 0:
        xs = _bf16_parts(x) if _few_rows(2 * x.shape[0], weight) else _split_activations(x, weight.group)
    else:
        xs = x.double()
    y = xs @ weight.dequantize().double().T
    return y + weight.bias.double() if weight.bias is not None else y


def _reference(x: torch.Tensor, weight: quant.QuantizedWeight, tiles: bool = False) -> torch.Tensor:
    w = weight.dequantize()
    # The few-row path and the int8 one multiply the integers as they are; elsewhere each value is
    # rounded to bf16 as it is de-quantized.
    rows = x.shape[0]
    int8 = _int8_rows(rows, weight, tiles)
    w = w.double() if _few_rows(rows, weight) or int8 else w.bfloat16().double()
    y = (_int8_activations(x, weight.group) if int8 else x.double()) @ w.T
    return y + weight.bias.double() if weight.bias is not None else y


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (200, 96), (128, 640), (600, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 24, 33, 70, 200])
def test_quant_linear_equals_the_dequantized_product(scheme, out_features, in_features, rows):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features + rows)
    weight = quant.quantize(torch.randn(out_features, in_features, generator=generator) * 0.1, scheme)
    weight = weight.with_bias(torch.randn(out_features, generator=generator))
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    for tiles in _paths():
        y = torch.ops.pagedserve_cpu.quant_linear(x, weight.q, weight.scales, weight.mins, weight.bias, weight.bits,
                                                  weight.group, weight.out_features, tiles, True)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), _reference(x, weight, tiles), rtol=1e-5, atol=1e-4, msg=f"tiles={tiles}")
    rounded = quant.linear(x, weight)  # bf16 out: the float32 product rounded once
    assert rounded.dtype == torch.bfloat16
    reference = _reference(x, weight, quant.tiles())
    torch.testing.assert_close(rounded.float(), reference.float().bfloat16().float(), rtol=1e-2, atol=1e-2)
    precise = quant.linear(x.float(), weight)  # float32 activations: split in two int8 parts (or widened)
    assert precise.dtype == torch.float32
    torch.testing.assert_close(precise.double(), _float_reference(x.float(), weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [5, 16, 24, 33, 40])
def test_quant_linear_with_inputs_off_the_tiles_step_equals_the_dequantized_product(rows):
    # 48 inputs (int8, one scale per output): not a whole number of the tile loop's 32-input steps, so
    # ATen's brgemm takes the rows the tile loop would (csrc/quant_linear.h `tile_rows`); without AMX,
    # int8 activations in one 48-input block, past 32 rows the VNNI tiles' loop of any quad count.
    generator = torch.Generator().manual_seed(48 + rows)
    weight = quant.quantize(torch.randn(130, 48, generator=generator) * 0.1, "int8")
    x = torch.randn(rows, 48, generator=generator).bfloat16()
    for tiles in _paths():
        y = torch.ops.pagedserve_cpu.quant_linear(x, weight.q, weight.scales, weight.mins, None, weight.bits,
                                                  weight.group, weight.out_features, tiles, True)
        torch.testing.assert_close(y.double(), _reference(x, weight, tiles), rtol=1e-5, atol=1e-4, msg=f"tiles={tiles}")


@pytest.mark.parametrize(("bits", "low", "high", "group", "with_min"),
                         [(8, -32, 32, 16, False), (8, 0, 32, 32, True), (6, -32, 32, 16, False), (6, 0, 32, 32, True),
                          (6, -32, 32, 256, False), (4, 0, 16, 32, True), (4, 0, 16, 256, False),
                          (4, 0, 16, 8, True)])  # groups of 8: the few-row group sums one input at a time
@pytest.mark.parametrize("rows", [1, 2, 5, 40, 200])
def test_quant_linear_with_a_files_groups_equals_the_dequantized_product(bits, low, high, group, with_min, rows):
    """Integers and scales as GGUF files hold them (Q6_K: groups of 16, no min; Q5_K: groups of 32 with
    mins; each at 8 bits and at the 6 bits they are served at; Q4_K: 4-bit with mins; and 4 and 6 bits
    with one scale per 256 inputs, no min), every path: the product of the weight they stand for."""
    generator = torch.Generator().manual_seed(rows * 100 + group + bits)
    out_features, in_features = 128, 256
    q = torch.randint(low, high, (out_features, in_features), generator=generator)
    scale = (torch.rand(out_features, in_features // group, generator=generator) * 0.01).half().float()
    minimum = -(torch.rand(out_features, in_features // group, generator=generator) * 0.1) if with_min else None
    weight = quant.pack(q, scale, minimum, bits)
    _assert_every_path_gives_the_reference(torch.randn(rows, in_features, generator=generator).bfloat16(), weight)


def _assert_every_path_gives_the_reference(x: torch.Tensor, weight: quant.QuantizedWeight) -> None:
    """float32 out on each path (tiles where the CPU has them) against `_reference`, and bf16 out (200
    rows: oneDNN's matmul on the widened blocks, csrc/quant_linear.h `linear_onednn`, or where the CPU
    has VNNI and no AMX, `vnni_tiles`) rounded once."""
    def run(tiles: bool, float_out: bool) -> torch.Tensor:
        return torch.ops.pagedserve_cpu.quant_linear(x, weight.q, weight.scales, weight.mins, None, weight.bits,
                                                     weight.group, weight.out_features, tiles, float_out)

    for tiles in _paths():
        torch.testing.assert_close(run(tiles, True).double(), _reference(x, weight, tiles), rtol=1e-5, atol=1e-4,
                                   msg=f"tiles={tiles}")
    reference = _reference(x, weight, quant.tiles())
    torch.testing.assert_close(run(quant.tiles(), False).float(), reference.float().bfloat16().float(), rtol=1e-2,
                               atol=1e-2)


def _k_quant(bits: int, group: int, with_min: bool, out_features: int, in_features: int, generator: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Integers, scales and mins as a K-quant holds them: each scale (min) a whole multiple of its
    superblock's float16 d (-dmin), with those factors: 0..63 times (Q4_K, Q5_K), -128..127 at 6 bits
    (Q6_K's signed int8 sc)."""
    low, high = {6: (-32, 32), 4: (0, 16)}[bits]
    q = torch.randint(low, high, (out_features, in_features), generator=generator)
    supers, per = in_features // quant.SUPERBLOCK, quant.SUPERBLOCK // group
    d = (torch.rand(out_features, supers, generator=generator) * 1e-3).half().float()
    sc_low, sc_high = (-128, 128) if bits == 6 else (0, 64)
    sc = torch.randint(sc_low, sc_high, (out_features, supers * per), generator=generator)
    sc[0, :2] = torch.tensor([-128, 127]) if bits == 6 else torch.tensor([0, 63])  # the ends of the range
    scale = sc * d.repeat_interleave(per, dim=1)
    if not with_min:
        return q, scale, None, d, None
    dmin = -(torch.rand(out_features, supers, generator=generator) * 1e-2).half().float()
    minimum = torch.randint(0, 64, (out_features, supers * per), generator=generator) * dmin.repeat_interleave(per, 1)
    return q, scale, minimum, d, dmin


@pytest.mark.parametrize(("bits", "group", "with_min"), [(4, 32, True), (6, 16, False), (6, 32, True), (4, 64, False)])
@pytest.mark.parametrize("rows", [1, 2, 5, 40, 200])
def test_compact_k_quant_scales_equal_the_product_of_the_weight_they_stand_for(bits, group, with_min, rows):
    """Scales and mins held as 8-bit multiples of a float16 per 256 inputs (a K-quant's d and dmin): every
    path multiplies by exactly q * (multiple * d) + multiple * -dmin, and the weight is smaller."""
    generator = torch.Generator().manual_seed(rows + bits + group)
    out_features, in_features = 136, 512  # a partial last block of columns
    q, scale, minimum, d, dmin = _k_quant(bits, group, with_min, out_features, in_features, generator)
    weight = quant.pack(q, scale, minimum, bits, d, dmin)
    plain = quant.pack(q, scale, minimum, bits)
    assert weight.compact and not plain.compact and weight.nbytes < plain.nbytes
    expected = q.float() * scale.repeat_interleave(group, dim=1)
    if minimum is not None:
        expected += minimum.repeat_interleave(group, dim=1)
    torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=0)  # exact, not float16-rounded
    ids = torch.tensor([0, 135, 64, 7])
    torch.testing.assert_close(quant.QuantizedLinear((weight,), "Q4_K").rows(ids), expected[ids], rtol=0, atol=0)
    _assert_every_path_gives_the_reference(torch.randn(rows, in_features, generator=generator).bfloat16(), weight)


def test_scales_that_are_not_whole_multiples_stay_float16():
    """A factor that does not divide its scales (or is not a float16 value, or mins without their
    factor, or 8 bits) leaves the float16 form: never a rounded scale."""
    generator = torch.Generator().manual_seed(3)
    q, scale, minimum, d, dmin = _k_quant(4, 32, True, 64, 256, generator)
    assert quant.pack(q, scale, minimum, 4, d, dmin).compact
    assert not quant.pack(q, scale * 1.001, minimum, 4, d, dmin).compact
    assert not quant.pack(q, scale, minimum, 4, d + 1e-9, dmin).compact
    assert not quant.pack(q, scale, minimum, 4, d, None).compact
    assert not quant.pack(q, scale * 3, minimum, 4, d, dmin).compact  # multiples past 127
    assert not quant.pack(q.clamp(max=15), scale, minimum, 8, d, dmin).compact
    one_scale = scale[:, ::8].contiguous()  # groups of 256: a factor and a multiple would not be smaller
    assert not quant.pack(q, one_scale, None, 4, d, None).compact


def test_bad_compact_operands_are_refused_by_name():
    generator = torch.Generator().manual_seed(4)
    q, scale, minimum, d, dmin = _k_quant(4, 32, True, 64, 256, generator)
    weight = quant.pack(q, scale, minimum, 4, d, dmin)
    x = torch.randn(1, 256).bfloat16()
    ops = torch.ops.pagedserve_cpu
    with pytest.raises(RuntimeError, match="compact scales are for 6 and 4 bits, with groups that divide 256"):
        ops.quant_linear(x, weight.q, weight.scales, weight.mins, None, 8, 32, 64, False, False)
    with pytest.raises(RuntimeError, match="compact scales are for 6 and 4 bits, with groups that divide 256"):
        ops.quant_linear(x, weight.q, weight.scales, weight.mins, None, 4, 24, 64, False, False)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.quant_linear(x, weight.q, weight.scales[..., :-1].contiguous(), None, None, 4, 32, 64, False, False)
    with pytest.raises(RuntimeError, match="mins must match scales"):
        ops.quant_linear(x, weight.q, weight.scales, torch.zeros(1, 8, 64).half(), None, 4, 32, 64, False, False)
    y = ops.quant_linear(x, weight.q, weight.scales, weight.mins, None, 4, 32, 64, False, False)
    assert torch.isfinite(y).all()


def test_quantize_rounds_to_the_nearest_level_per_group():
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=generator)
    w[3, 130:140] *= 50  # one large group: its row's other group keeps its own, finer scale
    for inputs, group in ((256, 128), (576, 64), (96, 32), (50, 50)):  # SmolLM2's 576: 64; else one per output
        x = torch.randn(64, inputs, generator=generator) if inputs != 256 else w
        int8 = quant.quantize(x, "int8")
        groups = x.view(64, inputs // group, group)
        step = (groups.abs().amax(-1) / 127)[..., None]  # (64, groups, 1)
        assert int8.group == group == quant.int8_group(inputs) and int8.mins is None
        assert ((int8.dequantize().view(groups.shape) - groups).abs() <= step * 0.5 + 1e-3 * step).all()
    int8 = quant.quantize(w, "int8")
    assert (int8.dequantize()[3, :128] - w[3, :128]).abs().max() < 0.02  # not the large group's step
    int4 = quant.quantize(w, "int4")
    groups = w.view(64, 8, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15)[..., None]  # (64, 8, 1)
    assert int4.group == 32 and int4.mins is not None
    assert ((int4.dequantize().view(64, 8, 32) - groups).abs() <= step * 0.5 + 2e-3 * step + 1e-3).all()
    assert int4.nbytes < int8.nbytes < w.bfloat16().nbytes  # kept as integers: 0.5 / 1 byte a weight


def test_pack_keeps_the_files_integers_and_scales_exactly():
    """Integers and scales as a file holds them (4-bit with mins, 6- and 8-bit signed without, 6 and 8
    with), N not a multiple of the block: the weight read back is q * scale + min, exactly, element by
    element."""
    generator = torch.Generator().manual_seed(2)
    for bits, low, high, with_min in ((4, 0, 16, True), (8, -128, 128, False), (8, 0, 64, True), (6, -32, 32, False),
                                      (6, 0, 32, True)):
        q = torch.randint(low, high, (72, 64), generator=generator)
        scale = (torch.rand(72, 4, generator=generator) + 0.5).half().float()
        minimum = -(torch.rand(72, 4, generator=generator)).half().float() if with_min else None
        weight = quant.pack(q, scale, minimum, bits)
        expected = q.float() * scale.repeat_interleave(16, dim=1)
        if minimum is not None:
            expected = expected + minimum.repeat_interleave(16, dim=1)
        torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=0)
        ids = torch.tensor([0, 71, 5, 64])
        rows = quant.QuantizedLinear((weight,), "test").rows(ids)
        torch.testing.assert_close(rows, expected[ids], rtol=0, atol=0)


def test_bad_operands_are_refused_by_name():
    weight = quant.quantize(torch.randn(64, 32), "int8")
    x = torch.randn(2, 32).bfloat16()
    ops = torch.ops.pagedserve_cpu
    with pytest.raises(RuntimeError, match="bits must be 8, 6 or 4"):
        ops.quant_linear(x, weight.q, weight.scales, None, None, 2, weight.group, 64, False, False)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.quant_linear(torch.randn(2, 30).bfloat16(), weight.q, weight.scales, None, None, 8, weight.group, 64,
                         False, False)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.quant_linear(x, weight.q[:-1], weight.scales, None, None, 8, weight.group, 64, False, False)
    with pytest.raises(RuntimeError, match="n out of range"):
        ops.quant_linear(x, weight.q, weight.scales, None, None, 8, weight.group, 65, False, False)
    with pytest.raises(RuntimeError, match="out of range"):
        quant.QuantizedLinear((weight,), "test").rows(torch.tensor([64]))
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quant.quantize(torch.randn(64, 32), "int3")
    with pytest.raises(ValueError, match=r"4-bit integers must be in \[0, 15\], got \[16, 16\]"):
        quant.pack(torch.full((64, 32), 16), torch.ones(64, 1), None, 4)
    with pytest.raises(ValueError, match=r"6-bit integers must be in \[-32, 31\], got \[32, 32\]"):
        quant.pack(torch.full((64, 32), 32), torch.ones(64, 1), None, 6)
    with pytest.raises(ValueError, match="whole groups of 32"):
        quant.quantize(torch.randn(64, 48), "int4")
    zero = quant.quantize(torch.zeros(64, 32), "int8")  # an all-zero row: q 0, a finite scale, not 0 / 0
    assert torch.equal(zero.dequantize(), torch.zeros(64, 32))


def _random_weight(bits: int, group: int, with_min: bool, generator: torch.Generator) -> quant.QuantizedWeight:
    """A (192, 512) weight of random integers in the width's range, float16-exact scales per `group`
    inputs, mins if `with_min`, and a bias."""
    out_features, in_features = 192, 512
    low, high = {8: (-128, 128), 6: (-32, 32), 4: (0, 16)}[bits]
    q = torch.randint(low, high, (out_features, in_features), generator=generator)
    scale = (torch.rand(out_features, in_features // group, generator=generator) * 0.01).half().float()
    minimum = -(torch.rand(out_features, in_features // group, generator=generator) * 0.1) if with_min else None
    return quant.pack(q, scale, minimum, bits).with_bias(torch.randn(out_features, generator=generator))


@pytest.mark.skipif(not quant.vnni_rows(), reason="int8 activations run on CPUs with AVX512-VNNI and no AMX tiles")
@pytest.mark.parametrize(("bits", "group", "with_min"),
                         [(8, 16, False), (8, 128, False), (6, 16, False), (6, 32, True), (4, 32, True),
                          (4, 32, False)])
@pytest.mark.parametrize("rows", [3, 4, 5, 6, 7, 32, 33, 34, 35])
def test_int8_activations_keep_outliers_zeros_and_every_row_count(bits, group, with_min, rows):
    """The VNNI paths (csrc/quant_linear.h `vnni_block` at every remainder of its 4-row passes, and past
    32 rows `vnni_tiles` at every remainder of its 3-row tiles), with an outlier 1000x its neighbours in
    one group (its scale is that group's alone), a row of zeros and a group of zeros (scale 0: no NaN):
    equal to its reference, and within 1% of the bf16 activations' product (what int8 activations cost)."""
    generator = torch.Generator().manual_seed(rows * 10 + bits + group)
    weight = _random_weight(bits, group, with_min, generator)
    x = torch.randn(rows, weight.in_features, generator=generator)
    x[0, 5] = 1000.0
    x[1] = 0.0
    x[2, group:2 * group] = 0.0
    x = x.bfloat16()
    y = torch.ops.pagedserve_cpu.quant_linear(x, weight.q, weight.scales, weight.mins, weight.bias, bits, group,
                                              weight.out_features, False, True)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), _reference(x, weight), rtol=1e-5, atol=1e-4)
    exact = x.double() @ weight.dequantize().double().T + weight.bias.double()
    rest = slice(1, None)  # the outlier's row would dominate a norm over all rows
    assert (y[rest].double() - exact[rest]).norm() / exact[rest].norm() < 1e-2
    torch.testing.assert_close(y[1].double(), weight.bias.double(), rtol=0, atol=1e-6)  # zeros: the bias alone


@pytest.mark.skipif(not quant.vnni_tile_rows(), reason="the VNNI paths take these rows only on CPUs with VNNI, no AMX")
def test_with_int8_activations_off_the_bf16_paths_give_the_reference():
    """Off (a model whose int8 activations disagree with bf16 ones: compute_service/model/activation_check.py;
    what a CPU with AVX512-BF16 and no VNNI takes), 5 and 40 rows de-quantize into bf16 and 200 (bf16
    out) go to oneDNN (`linear_onednn`), each equal to the bf16-rounded weight's product; on again, the
    int8 paths are back."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (192, 512), generator=generator)
    scale = (torch.rand(192, 16, generator=generator) * 0.01).half().float()
    minimum = -(torch.rand(192, 16, generator=generator) * 0.1)
    weight = quant.pack(q, scale, minimum, 4)
    assert not quant.set_int8_activations(False)
    assert quant.vnni_rows() == 0 and quant.vnni_tile_rows() == 0 and quant.onednn_rows() > 0
    for rows in (5, 40, 200):
        x = torch.randn(rows, 512, generator=generator).bfloat16()
        assert not _int8_rows(rows, weight, False)
        _assert_every_path_gives_the_reference(x, weight)
    assert quant.set_int8_activations(True)
    assert quant.vnni_rows() > 0 and quant.vnni_tile_rows() > 0 and quant.onednn_rows() == 0
    x = torch.randn(40, 512, generator=generator).bfloat16()
    assert _int8_rows(40, weight, False)
    _assert_every_path_gives_the_reference(x, weight)
    quant.release_scratch()  # what the engine does when idle: the next prompt takes its scratch again
    _assert_every_path_gives_the_reference(x, weight)


@pytest.mark.skipif(not quant.float_vnni(), reason="float32 activations multiply the integers on AVX512-VNNI")
@pytest.mark.parametrize(("bits", "group", "with_min"),
                         [(8, 16, False), (8, 128, False), (8, 512, False), (6, 16, False), (6, 32, True),
                          (4, 32, True), (4, 256, False)])  # (8, 512): one scale per column, 2 rows as 4 bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 17, 18, 40])
def test_float32_activations_split_in_two_parts_nearly_equal_the_exact_product(bits, group, with_min, rows):
    """A float32 model's linears (csrc/quant_linear.h `linear_float`): one row (two with one scale per
    column) as two bf16 rows on the few-row path; more as two int8 rows each, 2 x 16 rows on
    `vnni_block`, 17 and more (34 int8 rows) on `vnni_tiles` with every remainder of its 3-row tiles.
    Equal to the reference of the split, within 2^-13 of the exact float64 product and several times
    closer than bf16 activations, with an outlier, a zero row and a zero group (3 rows and more); int8
    activations switched off (a bf16 model's choice) leave this path as it is."""
    generator = torch.Generator().manual_seed(rows * 10 + bits + group)
    weight = _random_weight(bits, group, with_min, generator)
    x = torch.randn(rows, weight.in_features, generator=generator)
    specials = rows > 2
    if specials:
        x[0, 5] = 1000.0
        x[1] = 0.0
        x[2, group:2 * group] = 0.0
    rest = slice(1, None) if specials else slice(None)  # the outlier's row would dominate a norm over all rows
    exact = x.double() @ weight.dequantize().double().T + weight.bias.double()
    for int8_activations in (True, False):
        quant.set_int8_activations(int8_activations)
        y = quant.linear(x, weight)
        assert y.dtype == torch.float32 and torch.isfinite(y).all()
        torch.testing.assert_close(y.double(), _float_reference(x, weight), rtol=1e-5, atol=1e-4)
        error = float((y[rest].double() - exact[rest]).norm() / exact[rest].norm())
        assert error < 2**-13, error
        if specials:
            torch.testing.assert_close(y[1].double(), weight.bias.double(), rtol=0, atol=1e-6)
    quant.set_int8_activations(True)
    bf16 = quant.linear(x.bfloat16(), weight, float_out=True).double()
    assert float((bf16[rest] - exact[rest]).norm() / exact[rest].norm()) > 4 * error  # what the split buys
