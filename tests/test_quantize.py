"""The NVFP4 format (quantize.py): rounding helpers, codes, the quantizer's error levels and edge cases."""

import dataclasses

import pytest
import torch

import subprocess
import sys

import bench
import quantize
from eden import concentration, quantize_ms_eden, random_signs
from quantize import (SR_FP4_MAX, E2M1_VALUES, NVFP4Tensor, _quantize_groups, decode_e2m1, e2m1_round, e4m3_round,
                      e4m3_stochastic_round, encode_e2m1, pack_codes, quantize_nvfp4, relative_error, sr_noise,
                      to_groups, unpack_codes)

from conftest import ALL_E4M3, grid_neighbours


def log_uniform(n, low, high, generator):
    exponent = torch.empty(n).uniform_(low, high, generator=generator)
    sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return sign * torch.exp2(exponent)


# --- rounding helpers ---------------------------------------------------------------------------------------------

def test_e4m3_round_matches_torch_cast():
    g = torch.Generator().manual_seed(0)
    x = log_uniform(200_000, -12, 8.8, g)  # subnormals, normals, up to 448
    ties = (ALL_E4M3[1:] + ALL_E4M3[:-1]) / 2  # exact midpoints: must go to the even neighbour
    x = torch.cat([x, ties, -ties, ALL_E4M3, torch.zeros(1)])
    assert torch.equal(e4m3_round(x), x.to(torch.float8_e4m3fn).float())


def test_e4m3_round_saturates_and_keeps_nan():
    out = e4m3_round(torch.tensor([500.0, -1e30, float("inf"), float("nan")]))
    assert out[:3].tolist() == [448.0, -448.0, 448.0] and out[3].isnan()


def test_e4m3_stochastic_round_is_unbiased_across_the_normal_range():
    g = torch.Generator().manual_seed(1)
    values = log_uniform(64, -6, 8.7, g)  # the normal range 2^-6 ... 448
    samples = 20_000
    rounded = e4m3_stochastic_round(values.repeat(samples, 1), g)
    # every sample is one of the two E4M3 neighbours of its value
    lower, upper = (neighbour * values.sign() for neighbour in grid_neighbours(values, ALL_E4M3))
    assert ((rounded == lower) | (rounded == upper)).all()
    # the mean is the value itself: a Bernoulli(p) between neighbours has std step*sqrt(p(1-p)/n) <= step/(2 sqrt n)
    bound = 5 * (upper - lower).abs() / (2 * samples ** 0.5)
    assert ((rounded.mean(0) - values).abs() <= bound).all()


def test_e2m1_round_is_nearest_with_ties_to_even():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0, -0.74, -5.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -4.0]
    assert e2m1_round(x).tolist() == expected


def test_sr_noise_rounds_up_within_its_resolution():
    # Every draw is (k + 1/2) / 2^16 with k an integer in 0 ... 2^16 - 1, all of them about equally likely ...
    draws = sr_noise((8192,), torch.Generator().manual_seed(2))
    k = draws.double() * 2**16 - 0.5
    assert torch.equal(k, k.round()) and k.min() >= 0 and k.max() < 2**16
    # (a uniform k: its mean within 5 standard errors, and both ends of the range reached; each end is missed with
    # probability (1 - 1/256)^8192 = e^-32)
    assert abs(k.mean() - (2**16 - 1) / 2) <= 5 * 2**16 / (12 * 8192) ** 0.5
    assert k.min() < 2**8 and k.max() >= 2**16 - 2**8
    # ... so the probability of rounding up, the share of the 2^16 draws below the distance d, is within 2^-17 of d:
    # at most 2^-17 grid steps of bias, none on the grid (a 2^-16 lattice without the 1/2 would be up to 2^-16 off).
    every_draw = (torch.arange(2**16, dtype=torch.float64) + 0.5) / 2**16
    d = torch.cat([torch.rand(4000, generator=torch.Generator().manual_seed(3), dtype=torch.float64),
                   torch.tensor([0.0, 2**-18, 2**-17, 3 * 2**-17, 0.5, 1 - 2**-17, 1 - 2**-24], dtype=torch.float64)])
    p_up = torch.searchsorted(every_draw, d) / 2**16  # how many draws lie below d
    assert (p_up - d).abs().max() <= 2**-17 and p_up[4000] == 0


# --- codes ----------------------------------------------------------------------------------------------------------

def test_pack_unpack_is_identity_for_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    pairs = torch.cartesian_prod(codes, codes).flatten()  # every code next to every code, both nibbles
    assert torch.equal(unpack_codes(pack_codes(pairs)), pairs)
    assert pack_codes(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # even element in the low nibble


def test_encode_decode_round_trip():
    values = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert values[:8].tolist() == E2M1_VALUES.tolist() and (values[8:] == -E2M1_VALUES).all()
    assert torch.equal(encode_e2m1(values), torch.arange(16, dtype=torch.uint8))


# --- the quantizer --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(bench.QUANTIZERS))
def test_table1_error_within_3_percent_of_the_paper(name):
    quantizer, paper = bench.QUANTIZERS[name]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1024, 4096, generator=g)
    ours = relative_error(quantizer(x, g), x) * 1e3
    assert abs(ours / paper - 1) <= 0.03, f"{name}: {ours:.2f}e-3 vs paper {paper}e-3"


@pytest.mark.parametrize("name,unbiased", [("SR (fp4_max 6*16/17)", True), ("MS-EDEN", True),
                                           ("RTN 1x16", False), ("SR + 4/6", False)])
def test_concentration_separates_unbiased_from_biased(name, unbiased):
    # error(mean of B) = variance/B + bias^2. With ~4096 independent groups, B*error(B)/error(1) fluctuates by about
    # sqrt(2/4096) ~ 2%, so +-10% is a 5-sigma band; a bias with bias^2/variance > 0.1/B leaves it.
    quantizer, _ = bench.QUANTIZERS[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1024, generator=g)
    batch_sizes = [1, 4, 16, 64, 256]
    errors = concentration(quantizer, x, batch_sizes, g)
    growth = [errors[b] * b / errors[1] for b in batch_sizes]
    if unbiased:
        assert all(0.9 < r < 1.1 for r in growth), growth
    else:
        assert growth[-1] > 4, growth


def on_grid_tensor(rows, cols, block, generator):
    """A tensor that NVFP4 represents exactly: codes * E4M3 group scales * 2^k, every group's max code 6 and one
    group scale 448 (so the tensor scale is exactly 2^k)."""
    codes = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
    codes[:, ::16] = 7 | (codes[:, ::16] & 8)  # +-6 in every 1x16 group (and so in every 16x16 tile)
    scale_rows = rows if block == "1x16" else rows // 16
    scales = ALL_E4M3[torch.randint(1, 127, (scale_rows, cols // 16), generator=generator)]
    scales[0, 0] = 448.0
    power = 2.0 ** torch.randint(-20, 20, (), generator=generator).item()
    q = NVFP4Tensor(pack_codes(codes), scales.to(torch.float8_e4m3fn), torch.tensor(power), torch.Size((rows, cols)),
                    block)
    return q, q.dequantize()


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_rtn_is_lossless_on_the_grid(block):
    g = torch.Generator().manual_seed(4)
    q, x = on_grid_tensor(64, 256, block, g)
    ours = quantize_nvfp4(x, block=block)
    assert torch.equal(ours.dequantize(), x)
    assert torch.equal(ours.tensor_scale, q.tensor_scale)
    assert torch.equal(ours.group_scale.float(), q.group_scale.float())
    # codes agree except the sign of zeros
    same = (unpack_codes(ours.codes) == unpack_codes(q.codes)) | ((unpack_codes(q.codes) & 7) == 0)
    assert same.all()


def test_16x16_tiles_share_one_scale_and_commute_with_transpose():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=g)
    q, qt = quantize_nvfp4(x, block="16x16"), quantize_nvfp4(x.t(), block="16x16")
    assert q.group_scale.shape == (4, 8)
    assert torch.equal(q.dequantize().t(), qt.dequantize())


def test_four_over_six_keeps_the_branch_with_the_smaller_error():
    # Each branch's error is measured in integer 1/1024ths of a grid unit (section 4): moving an element's error u
    # (in grid units) by at most d moves u^2 by at most d * (2|u| + d). Where the exact errors differ by more than
    # both branches' bounds, 4/6 must keep the smaller; nowhere may it be worse than that bound.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 256, generator=g) * torch.rand(256, 1, generator=g) * 10
    q46 = quantize_nvfp4(x, four_over_six=True)
    groups = to_groups(x, "1x16").double()
    tensor_scale = q46.tensor_scale.double()
    group_amax = groups.abs().amax(-1, keepdim=True).float()
    errors, bounds, scaled_values = [], [], []
    for fp4_max in (6.0, 4.0):  # the two branches, exactly as 4/6 builds them
        values, group_scale, _ = _quantize_groups(groups.float(), group_amax, fp4_max, q46.tensor_scale, None)
        unit = group_scale.double() * tensor_scale  # one grid step of 1 in x's units
        u = (groups - values.double() * unit) / unit  # each element's error in grid units
        errors.append((u * unit).square().sum(-1))
        step = 1 / 1024 + 2.0**-20  # the truncation, plus FP32's two roundings of x' (|x'| < 8) in the quantizer
        bounds.append((unit.square() * step * (2 * u.abs().sum(-1, keepdim=True) + 16 * step)).squeeze(-1))
        scaled_values.append(values * group_scale)  # exact in FP32
    kept = to_groups(q46.dequantize(tensor_scale=False), "1x16")
    pick4 = (kept != scaled_values[0]).any(-1)
    assert torch.equal(kept, torch.where(pick4[..., None], scaled_values[1], scaled_values[0]))  # one branch or other
    chosen = torch.where(pick4, errors[1], errors[0])
    clear = (errors[0] - errors[1]).abs() > bounds[0] + bounds[1]
    assert clear.float().mean() > 0.95  # the bound is loose, but leaves most groups to check
    assert torch.equal(chosen[clear], torch.minimum(errors[0], errors[1])[clear])
    assert (chosen <= torch.minimum(errors[0], errors[1]) + bounds[0] + bounds[1]).all()
    assert (errors[1] < errors[0]).float().mean() > 0.2  # the 4-branch wins often: the test compares something


QUANTIZE_OPTIONS = [dict(), dict(four_over_six=True), dict(block="16x16"), dict(rounding="sr", fp4_max=SR_FP4_MAX),
                    dict(rounding="sr", four_over_six=True)]


@pytest.mark.parametrize("options", QUANTIZE_OPTIONS)
def test_zeros_give_exact_zeros(options):
    x = torch.zeros(32, 64)
    assert torch.equal(quantize_nvfp4(x, **options).dequantize(), x)
    x = torch.randn(32, 64)
    x[:16, :16] = 0  # an all-zero group (and 16x16 tile) inside a nonzero tensor
    out = quantize_nvfp4(x, **options).dequantize()
    assert out.isfinite().all() and (out[:16, :16] == 0).all()


@pytest.mark.parametrize("options", QUANTIZE_OPTIONS)
@pytest.mark.parametrize("power", [-100, -40, 40, 120])
def test_quantization_is_the_same_at_every_scale(options, power):
    # Multiplying by a power of two is exact in every float format, so in FP32's normal range the quantizer must
    # give the same codes and group scales, and a tensor scale times the same power of two.
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    q = quantize_nvfp4(x, generator=torch.Generator().manual_seed(8), **options)
    scaled = quantize_nvfp4(x * 2.0**power, generator=torch.Generator().manual_seed(8), **options)
    assert torch.equal(scaled.codes, q.codes) and torch.equal(scaled.group_scale.float(), q.group_scale.float())
    assert scaled.tensor_scale.item() == q.tensor_scale.item() * 2.0**power


@pytest.mark.parametrize("options", QUANTIZE_OPTIONS)
@pytest.mark.parametrize("largest", [1e-45, 1e-38, 1e-33])
def test_tensors_too_small_for_the_format_become_zeros(options, largest):
    # Below MIN_TENSOR_SCALE * fp8_max * fp4_max (~1e-32), 1 / (group_scale * tensor_scale) would overflow.
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
    q = quantize_nvfp4(x / x.abs().max() * largest, **options)
    assert q.tensor_scale.item() == 1.0 and (q.dequantize() == 0).all()


@pytest.mark.parametrize("options", QUANTIZE_OPTIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_propagate_as_nan(options, bad):
    x = torch.randn(32, 64)
    x[5, 7] = bad
    out = quantize_nvfp4(x, **options).dequantize()
    assert out.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_dtypes(dtype):
    x = torch.randn(16, 64).to(dtype)
    q = quantize_nvfp4(x)
    reference = quantize_nvfp4(x.float())
    assert q.shape == x.shape and torch.equal(q.codes, reference.codes)
    assert relative_error(q.dequantize(), x.float()) < 0.012


def test_batched_input_quantizes_along_the_last_dimension():
    x = torch.randn(3, 5, 32)
    q = quantize_nvfp4(x)
    assert q.codes.shape == (3, 5, 16) and q.group_scale.shape == (3, 5, 2)
    assert torch.equal(q.dequantize(), quantize_nvfp4(x.reshape(15, 32)).dequantize().view(3, 5, 32))


@pytest.mark.parametrize("x,options,message", [
    (torch.randn(4, 40), {}, "multiples of 16"),
    (torch.randn(40, 32), dict(block="16x16"), r"the last 2 dimension\(s\) to be multiples of 16"),
    (torch.randn(32), dict(block="16x16"), "at least 2 dimension"),
    (torch.tensor(1.0), {}, "at least 1 dimension"),
    (torch.ones(4, 16, dtype=torch.int32), {}, "floating-point"),
    (torch.ones(4, 16, dtype=torch.uint8), {}, "floating-point"),
    (torch.randn(4, 16), dict(rounding="nearest"), "rounding must be"),
    (torch.randn(4, 16), dict(block="1x32"), "block must be"),
    (torch.randn(4, 16), dict(four_over_six=True, fp8_max=448.0), "no room in E4M3"),
    (torch.randn(4, 16), dict(fp8_max=0.0), "no room in E4M3"),
    (torch.randn(4, 16), dict(fp4_max=0.0), "fp4_max"),
    (torch.randn(4, 16), dict(fp4_max=float("nan")), "fp4_max"),
    (torch.empty(0, 16), {}, "non-empty"),
    (torch.empty(4, 16, device="meta"), {}, "meta tensor"),
])
def test_bad_input_raises_a_clear_error(x, options, message):
    with pytest.raises(ValueError, match=message):
        quantize_nvfp4(x, **options)


def test_an_nvfp4_tensor_refuses_parts_that_do_not_fit():
    q = quantize_nvfp4(torch.randn(32, 64))
    parts = dict(codes=q.codes, group_scale=q.group_scale, tensor_scale=q.tensor_scale, shape=q.shape, block=q.block)
    NVFP4Tensor(**parts)  # as made
    for change in (dict(block="16X16"), dict(shape=torch.Size((32, 128))), dict(codes=q.codes.float()),
                   dict(group_scale=q.group_scale.view(torch.uint8)), dict(tensor_scale=torch.ones(2)),
                   dict(codes=q.codes[:, :16]), dict(group_scale=q.group_scale[:16]),
                   dict(gemm_operand=torch.zeros(32, 32)), dict(block="16x16"), dict(shape=torch.Size((32, 8))),
                   dict(tensor_scale=q.tensor_scale.reshape(1, 1)), dict(gemm_operand=torch.zeros(32, 64))):
        with pytest.raises(ValueError, match="NVFP4Tensor"):
            NVFP4Tensor(**(parts | change))


def test_an_nvfp4_tensor_cannot_change_after_it_was_checked():
    # A kernel trusts the parts it was built from (triton_dequantize would read past a group_scale made smaller)
    q = quantize_nvfp4(torch.randn(32, 64))
    for name, value in (("shape", torch.Size((64, 64))), ("block", "16x16"), ("group_scale", q.group_scale[:16]),
                        ("gemm_operand", torch.zeros(32, 64, dtype=torch.bfloat16))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(q, name, value)


def test_the_quantizers_give_no_gradient():
    # A gradient through the tensor scale alone would be meaningless: the results carry none
    x = torch.randn(128, 128, requires_grad=True)
    assert not quantize_nvfp4(x).dequantize().requires_grad
    assert not quantize_ms_eden(x, random_signs()).dequantize().requires_grad


def test_the_worked_example_is_the_quantizer_step_by_step():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 5
    tensor_scale, group_scale, codes, dequantized = quantize.worked_example(x)
    q = quantize_nvfp4(x)
    assert torch.equal(tensor_scale, q.tensor_scale) and group_scale == q.group_scale[0, 0].float()
    assert torch.equal(codes, unpack_codes(q.codes)[0, :16]) and torch.equal(dequantized, q.dequantize()[0, :16])


def test_the_roundings_compared_show_their_errors_and_bias():
    generator = torch.Generator().manual_seed(4)
    errors = quantize.compare_roundings(torch.randn(128, 256, generator=generator), 16, generator)
    assert errors["round to nearest"][1] == errors["round to nearest"][0]  # deterministic: the mean is itself
    assert errors["four-over-six"][0] < errors["round to nearest"][0] < errors["stochastic rounding"][0]
    # unbiased: variance / 16 (2048 groups: a 15% band is ~5 standard deviations)
    assert 0.85 < 16 * errors["stochastic rounding"][1] / errors["stochastic rounding"][0] < 1.15


@pytest.mark.parametrize("script,expected", [("quantize.py", ["tensor scale ts = amax(|x|) / (448 * 6)", "4-bit code",
                                                              "stochastic rounding", "its noise averages out"]),
                                             ("eden.py", ["MS-EDEN", "The rotation undone"])])
def test_the_concepts_run_as_scripts(script, expected):
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True,
                         cwd=bench.ROOT).stdout
    assert all(text in out for text in expected), out


def test_a_generator_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="torch.Generator"):
        quantize_nvfp4(torch.randn(16, 16), "sr", generator=5)
