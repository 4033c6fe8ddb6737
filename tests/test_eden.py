"""MS-EDEN (eden.py): the rotation, the correction, the stochastic scales, and edge cases."""

import re

import pytest
import torch

import eden
from eden import (EDEN_FP4_MAX, EDEN_FP8_MAX, eden_groups, inverse_rht, quantize_ms_eden, random_signs, rht,
                  sylvester_matrix)
from quantize import E2M1_VALUES, decode_e2m1, e4m3_round, relative_error, unpack_codes


def test_hadamard_is_orthogonal_and_symmetric():
    h = sylvester_matrix(128).double() / 128 ** 0.5
    assert torch.allclose(h @ h.t(), torch.eye(128, dtype=torch.float64), atol=1e-6)
    assert torch.equal(h, h.t()) and (h.abs() == h[0, 0].abs()).all()
    with pytest.raises(ValueError, match="power of two"):
        sylvester_matrix(96)


def test_rotation_cancels_in_a_gemm_and_depends_on_the_signs():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=g), torch.randn(32, 512, generator=g)
    exact = a.double() @ b.double().t()
    s = random_signs(generator=g)
    rotated = rht(a, s) @ rht(b, s).t()
    # float32 round-off: K=512 terms, unit round-off 6e-8, random-walk growth -> ~1e-6 relative; 1e-5 is loose
    assert ((rotated.double() - exact).norm() / exact.norm()).item() < 1e-5
    other = random_signs(generator=g)
    mixed = rht(a, s) @ rht(b, other).t()
    assert ((mixed.double() - exact).norm() / exact.norm()).item() > 0.5
    assert torch.allclose(inverse_rht(rht(a, s), s), a, atol=1e-5)


def test_codes_and_correction():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(16, 256, generator=g)
    values, corrected = eden_groups(y)
    groups = y.unflatten(-1, (-1, 16))
    scale = groups.abs().amax(-1, keepdim=True) / EDEN_FP4_MAX
    # the group maximum maps to 6.07 and clips to 6; every other code is round-to-nearest of y / scale
    assert (values.abs().amax(-1) == 6).all()
    # brute force: no grid value is closer to y / scale than the chosen one
    grid = torch.cat([-E2M1_VALUES, E2M1_VALUES])
    distance = ((groups / scale).unsqueeze(-1) - grid).abs()
    chosen = ((groups / scale) - values).abs()
    assert (chosen <= distance.amin(-1)).all()
    # the correction makes <y, S * y_hat> = <y, y> per group
    overlap = (groups * values * corrected).sum(-1)
    assert torch.allclose(overlap, groups.square().sum(-1), rtol=1e-5)


def test_scales_are_stochastic_neighbours_of_the_corrected_scale():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 512, generator=g)
    s = random_signs(generator=g)
    values, corrected = eden_groups(rht(x, s))
    tensor_scale = corrected.max() / EDEN_FP8_MAX
    target = (corrected / tensor_scale).squeeze(-1)
    draws = torch.stack([quantize_ms_eden(x, s, g).group_scale.float() for _ in range(400)])
    nearest = e4m3_round(target)
    assert ((draws == draws.amax(0)) | (draws == draws.amin(0))).all()  # at most two distinct values per group
    assert ((draws - target).abs() <= (target * 2 ** -3)).all()  # within one E4M3 step of the target
    # the average scale is the corrected scale: std of one draw <= step/2 (step <= target/8)
    bound = 5 * target / 8 / 2 / 400 ** 0.5
    assert ((draws.mean(0) - target).abs() <= bound).all()
    assert (draws != nearest).any()  # it really is random, not round-to-nearest
    q = quantize_ms_eden(x, s, g)
    assert torch.equal(decode_e2m1(unpack_codes(q.codes)), values.flatten(-2))
    assert torch.equal(q.tensor_scale, tensor_scale)


def test_all_zero_input_and_groups():
    s = random_signs(generator=torch.Generator().manual_seed(3))
    assert torch.equal(quantize_ms_eden(torch.zeros(8, 256), s).dequantize(), torch.zeros(8, 256))
    x = torch.randn(8, 256)
    x[:4, :128] = 0  # whole 128-chunks of zeros stay zero groups after rotation
    out = quantize_ms_eden(x, s).dequantize()
    assert out.isfinite().all() and (out[:4, :128] == 0).all()


@pytest.mark.parametrize("power", [-90, -40, 40, 110])
def test_ms_eden_is_the_same_at_every_scale(power):
    # A power of two commutes exactly with the rotation and every scale computation in FP32's normal range.
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(4))
    s = random_signs(generator=torch.Generator().manual_seed(4))
    q = quantize_ms_eden(x, s, torch.Generator().manual_seed(5))
    scaled = quantize_ms_eden(x * 2.0**power, s, torch.Generator().manual_seed(5))
    assert torch.equal(scaled.codes, q.codes) and torch.equal(scaled.group_scale.float(), q.group_scale.float())
    assert scaled.tensor_scale.item() == q.tensor_scale.item() * 2.0**power


@pytest.mark.parametrize("largest", [1e-45, 1e-38, 3e38])
def test_the_ends_of_the_float32_range_give_zeros_or_saturate(largest):
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(6))
    x = x / x.abs().max() * largest
    out = quantize_ms_eden(x, random_signs()).dequantize()
    assert out.isfinite().all()
    if largest < 1e-30:  # every group's scale is below FP32's normal range: zeros
        assert (out == 0).all()
    else:  # beyond 2^120 the input saturates there; the result is that of the saturated tensor
        assert out.abs().max() < 2.0**128 and (out != 0).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_propagate_as_nan(bad):
    x = torch.randn(8, 256)
    x[3, 200] = bad
    assert quantize_ms_eden(x, random_signs()).dequantize().isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_dtypes(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 256, generator=g).to(dtype)
    s = random_signs(generator=g)
    out = inverse_rht(quantize_ms_eden(x, s, g).dequantize(), s)
    assert 0.008 < relative_error(out, x.float()) < 0.011  # the MS-EDEN error level (9.4e-3)


@pytest.mark.parametrize("x,signs,message", [
    (torch.randn(4, 64), random_signs(), "multiples of 128"),
    (torch.randn(4, 200), random_signs(), "multiples of 128"),
    (torch.tensor(1.0), random_signs(), "at least 1 dimension"),
    (torch.ones(4, 128, dtype=torch.int64), random_signs(), "floating-point"),
    (torch.randn(4, 128), random_signs(64), "signs must have 128 entries"),
    (torch.randn(4, 128), random_signs() * 2, "only \\+1 and -1"),
    (torch.randn(4, 128), random_signs().view(2, 64), "1-D float tensor"),
    (torch.randn(4, 128), torch.full((128,), 1j), "1-D float tensor"),
    (torch.randn(4, 128), torch.ones(128, dtype=torch.bool), "1-D float tensor"),
    (torch.randn(4, 128), torch.ones(128, device="meta"), "with data"),
])
def test_bad_input_raises_a_clear_error(x, signs, message):
    with pytest.raises(ValueError, match=message):
        quantize_ms_eden(x, signs)


def test_the_demo_shows_rtn_biased_and_ms_eden_unbiased_below_sr(capsys):
    # The mean of B quantizations: variance / B + bias^2. Over 4096 groups B * error(B) / error(1) fluctuates by a
    # few percent for an unbiased quantizer (a 15% band is ~5 sigma); round to nearest is deterministic, so its
    # mean is itself.
    generator = torch.Generator().manual_seed(1)
    curves = eden.demo(torch.randn(64, 1024, generator=generator), (1, 8, 64), generator)
    rtn, sr, ms_eden = curves["round to nearest"], curves["stochastic rounding"], curves["MS-EDEN"]
    assert rtn[64] == rtn[1]
    for curve in (sr, ms_eden):
        assert all(0.85 < b * curve[b] / curve[1] < 1.15 for b in (8, 64)), curve
    assert all(ms_eden[b] < sr[b] / 2 for b in (1, 8, 64)) and abs(ms_eden[1] / rtn[1] - 1) < 0.1
    undone = re.search(r"The rotation undone: relative error (\S+) \(FP32", capsys.readouterr().out)
    assert undone and float(undone.group(1)) < 1e-10  # FP32 round-off, squared: relative error is a squared norm


def test_random_signs_and_generators_are_checked():
    for n in (0, -1, 2.5):
        with pytest.raises(ValueError, match="positive number of signs"):
            random_signs(n)
    with pytest.raises(ValueError, match="torch.Generator"):
        random_signs(generator=5)
    with pytest.raises(ValueError, match="torch.Generator"):
        quantize_ms_eden(torch.randn(16, 128), random_signs(), generator=5)
