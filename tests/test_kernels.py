"""kernels.py against the references in quantize.py and eden.py.

Without a GPU the kernels run in Triton's interpreter at small shapes (tile boundaries, awkward multiples of 128);
with one they run on it, at these shapes and at large ones. References always run on the CPU, whose float
arithmetic is plain IEEE."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import bench
import kernels
from conftest import ALL_E4M3, grid_neighbours
from eden import EDEN_FP8_MAX, eden_groups, inverse_rht, random_signs, rht
from quantize import (E2M1_VALUES, SR_FP4_MAX, NVFP4Tensor, decode_e2m1, e2m1_round, encode_e2m1, quantize_nvfp4,
                      unpack_codes)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"  # on the CPU the kernels run interpreted (tests/conftest.py)
FLOAT = torch.bfloat16 if GPU else torch.float32  # the widest input the kernels take: FP32 only in the interpreter
DTYPES = sorted({torch.bfloat16, FLOAT}, key=str)
QUANTIZE_SHAPES = [(48, 128), (192, 384), (320, 640)]  # rows: multiples of 16, columns: of 128
EDEN_SHAPES = [(128, 128), (128, 384), (384, 256)]


def varied(rows, cols, dtype=torch.bfloat16, seed=0):
    """Gaussian rows with magnitudes spread over 2^-12 ... 2^12, one all-zero 16x16 tile, on the kernel device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 13, (rows, 1), generator=g).float())
    x[16:32, 16:32] = 0
    return x.to(dtype).to(DEVICE)


def cpu(q):
    return NVFP4Tensor(q.codes.cpu(), q.group_scale.cpu(), q.tensor_scale.cpu(), q.shape, q.block,
                       None if q.gemm_operand is None else q.gemm_operand.cpu())


def assert_same_quantization(ours, reference):
    assert torch.equal(ours.codes, reference.codes)
    assert torch.equal(ours.group_scale.view(torch.uint8), reference.group_scale.view(torch.uint8))
    assert torch.equal(ours.tensor_scale, reference.tensor_scale)
    assert torch.equal(ours.gemm_operand.float(), reference.dequantize(tensor_scale=False))


# --- round to nearest: bit-identical ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", QUANTIZE_SHAPES)
@pytest.mark.parametrize("options", [dict(), dict(four_over_six=True), dict(block="16x16"),
                                     dict(block="16x16", four_over_six=True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rtn_kernel_is_bit_identical(shape, options, dtype):
    x = varied(*shape, dtype)
    assert_same_quantization(cpu(kernels.triton_quantize(x, **options)), quantize_nvfp4(x.cpu(), **options))


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_four_over_six_ties_keep_six_in_the_kernel_too(block):
    # Every group holds +-1536, so the tensor scale is 1 and the branches' group scales are exactly 256 (max -> 6)
    # and 384 (max -> 4). Rows 0-15: besides the maximum only zeros and halves of it, exact in both branches: a tie,
    # which keeps 6. Rows 16-31: three quarters of the maximum, 4.5 in the 6-branch (rounded, error 0.5) but exactly 3
    # in the 4-branch, which wins.
    x = torch.zeros(32, 128)
    x[:, ::16] = 1536.0
    x[:16, 3::16], x[:16, 7::16] = -768.0, 768.0
    x[16:, 5::16] = -1152.0
    x = x.to(DEVICE, FLOAT)  # every value here is exact in BF16
    ours = cpu(kernels.triton_quantize(x, four_over_six=True, block=block))
    reference = quantize_nvfp4(x.cpu(), four_over_six=True, block=block)
    assert_same_quantization(ours, reference)
    scales = reference.group_scale.float()
    if block == "1x16":
        assert (scales[:16] == 256).all() and (scales[16:] == 384).all()
    else:  # a 16x16 tile's error adds its rows: the first tile ties, the second has the 4-branch's lower error
        assert (scales[0] == 256).all() and (scales[1] == 384).all()


def test_rtn_kernel_from_a_transposed_view():
    x = varied(256, 192)  # the kernel reads x^T [192, 256] through strides
    ours = cpu(kernels.triton_quantize(x, transpose=True, four_over_six=True))
    assert_same_quantization(ours, quantize_nvfp4(x.cpu().t(), four_over_six=True))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(), dict(four_over_six=True), dict(block="16x16")])
def test_rtn_kernel_is_bit_identical_at_scale(options):
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) * 3
    assert_same_quantization(cpu(kernels.triton_quantize(x, **options)), quantize_nvfp4(x.cpu(), **options))


# --- stochastic rounding: deterministic scales, random codes ----------------------------------------------------------

@triton.jit
def _noise_kernel(seed_ptr, out_ptr, COUNT: tl.constexpr):
    first = tl.program_id(0) * COUNT
    tl.store(out_ptr + first + tl.arange(0, COUNT), kernels._sr_noise(tl.load(seed_ptr), first, COUNT))


def test_sr_noise_kernel_draws_on_the_reference_lattice():
    # The kernel's draws are quantize.sr_noise's (k + 1/2) / 2^16 (whose test derives the rounding bias from that),
    # with k spread over its whole range, different for every element block and seed, the same for the same seed.
    def draws(seed):
        out = torch.empty(4 * 4096, device=DEVICE)
        _noise_kernel[(4,)](torch.tensor([seed], device=DEVICE), out, COUNT=4096)
        return out.cpu().double()
    k = draws(7) * 2**16 - 0.5
    assert torch.equal(k, k.round()) and k.min() >= 0 and k.max() < 2**16
    assert abs(k.mean() - (2**16 - 1) / 2) <= 5 * 2**16 / (12 * k.numel()) ** 0.5
    assert k.min() < 2**8 and k.max() >= 2**16 - 2**8  # each missed with probability (1 - 1/256)^16384
    assert k.unique().numel() > 0.85 * k.numel()  # 16384 draws of 2^16 values: ~11% repeat by chance
    assert torch.equal(draws(7), draws(7)) and not torch.equal(draws(7), draws(8))


def neighbours(values):
    """The E2M1 magnitudes just below and above |values| (values already scaled into [0, 6])."""
    return grid_neighbours(values.clamp(-6, 6), E2M1_VALUES)


def scaled_input(x, q):
    """x / (group_scale * tensor_scale), per element, with q's (reference or kernel) scales."""
    return x.float() * (1 / (q.element_scales() * q.tensor_scale))


@pytest.mark.parametrize("shape", QUANTIZE_SHAPES[:2])
def test_sr_kernel_scales_exact_and_codes_on_neighbours(shape):
    x = varied(*shape)
    options = dict(rounding="sr", fp4_max=6 * 16 / 17)
    ours, reference = cpu(kernels.triton_quantize(x, **options)), quantize_nvfp4(x.cpu(), **options)
    assert torch.equal(ours.group_scale.view(torch.uint8), reference.group_scale.view(torch.uint8))
    assert torch.equal(ours.tensor_scale, reference.tensor_scale)
    lower, upper = neighbours(scaled_input(x.cpu(), reference))
    magnitude = decode_e2m1(unpack_codes(ours.codes)).abs()
    assert ((magnitude == lower) | (magnitude == upper)).all()


def kernel_sr(x, generator):
    return kernels.triton_quantize(x.to(DEVICE, FLOAT), rounding="sr", fp4_max=6 * 16 / 17).dequantize().cpu()


def kernel_ms_eden(x, generator):
    signs = random_signs(generator=generator)
    rows, _ = kernels.triton_ms_eden_pair(x.to(DEVICE, FLOAT), signs.to(DEVICE))
    return inverse_rht(rows.dequantize().cpu(), signs)


@pytest.mark.slow
@pytest.mark.parametrize("quantizer,name", [(kernel_sr, "SR (fp4_max 6*16/17)"), (kernel_ms_eden, "MS-EDEN")])
def test_random_kernels_match_reference_error_and_are_unbiased(quantizer, name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 256, generator=g).to(FLOAT).float()  # 2048 groups, ~2 s a kernel call interpreted
    reference_quantizer, _ = bench.QUANTIZERS[name]
    draws = []  # the error of each of the 32 quantizations that the concentration below averages

    def recorded(x, g):
        q = quantizer(x, g)
        draws.append(bench.relative_error(q, x))
        return q
    # unbiased: B * error(mean of B) stays flat. error(mean of B) = variance / B + bias^2; over 2048 independent
    # groups B * error(B) / error(1) fluctuates by about sqrt(2 / 2048) ~ 3%, so +-15% is a 5-sigma band, which a
    # bias with bias^2 / variance > 0.15 / B leaves
    errors = bench.concentration(recorded, x, [1, 4, 16, 32], g)
    growth = [errors[b] * b / errors[1] for b in errors]
    assert all(0.85 < r < 1.15 for r in growth), growth
    # The error level agrees within the noise of its estimate (4 standard errors of the difference of two means),
    # plus 1%: the kernel's rotation sums on tensor cores, the reference on the CPU, so a rare value lands on the
    # other side of a rounding boundary (the phase-one tests bound that to 5e-4 of the codes).
    ours = torch.tensor(draws)
    theirs = torch.tensor([bench.relative_error(reference_quantizer(x, g), x) for _ in range(8)])
    sigma = (ours.var() / len(ours) + theirs.var() / len(theirs)).sqrt()
    assert len(ours) == 32 and abs(ours.mean() - theirs.mean()) <= 4 * sigma + 0.01 * theirs.mean()


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer,name", [(kernel_sr, "SR (fp4_max 6*16/17)"), (kernel_ms_eden, "MS-EDEN")])
def test_random_kernels_error_within_one_percent_at_scale(quantizer, name):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 4096, generator=g).bfloat16().float()
    reference_quantizer, _ = bench.QUANTIZERS[name]
    ours, theirs = bench.relative_error(quantizer(x, g), x), bench.relative_error(reference_quantizer(x, g), x)
    assert abs(ours / theirs - 1) < 0.01


@pytest.mark.parametrize("shape", [(256, 128), (256, 48)])  # x^T's rows: a multiple of 32, and of 16 only
def test_rotated_transposed_kernels(shape):  # the NVIDIA recipe's dW operands: SR of RHT16(E^T), RTN of RHT16(X^T)
    # A 16-wide rotation of BF16 values scales by exactly 1/4, but the kernel sums its 16 products on tensor cores,
    # whose FP32 accumulation order (and, on GPUs, alignment) differs from the reference's: the rotated values agree
    # to a few ulp (2^-22 relative). A scale or code can then change only where a value lies that close to a rounding
    # boundary, a chance of order 1e-6 per value; the test allows 1 in 1000 (in the interpreter they are identical).
    x = varied(*shape)
    x[:, -1] *= 4  # the largest values in x^T's last row: the amax pass must reach it
    signs = random_signs(16)
    rotated = rht(x.cpu().t(), signs)
    for options in (dict(rounding="sr", fp4_max=6 * 16 / 17), dict()):
        ours = cpu(kernels.triton_quantize(x, transpose=True, signs=signs.to(DEVICE), **options))
        reference = quantize_nvfp4(rotated, **options)
        assert abs(ours.tensor_scale.item() / reference.tensor_scale.item() - 1) < 1e-6
        same_scale = ours.group_scale.view(torch.uint8) == reference.group_scale.view(torch.uint8)
        assert same_scale.float().mean() >= 0.999
        lower, upper = neighbours(scaled_input(rotated, ours))  # with the kernel's own scales
        magnitude = decode_e2m1(unpack_codes(ours.codes)).abs()
        allowed = (magnitude == lower) | (magnitude == upper)
        if "rounding" not in options:  # round to nearest: the nearer neighbour, as the reference picked
            allowed = decode_e2m1(unpack_codes(ours.codes)) == decode_e2m1(unpack_codes(reference.codes))
        assert allowed.float().mean() >= 0.999


# --- MS-EDEN ---------------------------------------------------------------------------------------------------------

def assert_phase1_matches(kernel_out, rotated):
    """Phase one against eden_groups on the reference rotation. The kernel sums +-x in its own order and folds the
    1/sqrt(128) into the group scales; the reference multiplies by +-1/sqrt(128): the values differ in the last bits,
    which can move a value across a rounding boundary of the grid. Bound: at most 1 code in 2000 differs, by one grid
    step, and where the codes agree the corrected scales agree to 1e-5."""
    codes, corrected, amax = (t.cpu() for t in kernel_out)
    values, reference_corrected = eden_groups(rotated)
    ours = decode_e2m1(unpack_codes(codes)).view_as(values)
    differ = ours != values
    assert differ.float().mean() <= 5e-4
    step = torch.where(values.abs() >= 4, 2.0, torch.where(values.abs() >= 2, 1.0, 0.5))
    assert ((ours - values).abs()[differ] <= step[differ]).all()
    same_group = ~differ.any(-1)
    relative = (corrected - reference_corrected.squeeze(-1)).abs() / reference_corrected.squeeze(-1).clamp(min=1e-30)
    assert (relative[same_group] <= 1e-5).all()
    assert amax.view(torch.float32).item() == corrected.max().item()


@pytest.mark.parametrize("shape", EDEN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_eden_phase1_matches_reference(shape, dtype):
    x = varied(*shape, dtype, seed=3)
    signs = random_signs(generator=torch.Generator().manual_seed(3))
    rows, cols = kernels.eden_phase1(x, signs.to(DEVICE))
    assert_phase1_matches(rows, rht(x.cpu(), signs))
    assert_phase1_matches(cols, rht(x.cpu().t(), signs))


@pytest.mark.parametrize("shape", EDEN_SHAPES)
def test_requantize_phase1_matches_reference(shape):
    q = kernels.triton_quantize(varied(*shape, seed=4), four_over_six=True)
    signs = random_signs(generator=torch.Generator().manual_seed(4))
    out = kernels.eden_phase1_requantize(q, signs.to(DEVICE))
    assert_phase1_matches(out, rht(cpu(q).dequantize().t(), signs))


@pytest.mark.parametrize("multiprocessors", [1, 5, 16, 78, 114, 132])
def test_eden_phase1_grid_covers_every_job(multiprocessors):
    # Program p does job p % J of tiles p // J, p // J + P / J, ... (clamped to the last tile), as _eden_jobs
    # walks them: every (tile, job) must be done, for any tile count and GPU size.
    for tiles, jobs_per_tile, per_multiprocessor in itertools.product((1, 3, 7, 64, 263, 4096), (2, 4, 8), (2, 3)):
        programs, per_program = kernels._persistent_grid(tiles * 128, 128, jobs_per_tile, per_multiprocessor,
                                                         multiprocessors)
        assert programs % jobs_per_tile == 0
        step = programs // jobs_per_tile
        done = {(min(p // jobs_per_tile + i * step, tiles - 1), p % jobs_per_tile)
                for p in range(programs) for i in range(per_program)}
        assert done == {(t, j) for t in range(tiles) for j in range(jobs_per_tile)}


@pytest.mark.parametrize("sub", [32, 128])
def test_eden_phase1_jobs_of_any_height(sub, monkeypatch):
    # Phase one cuts each 128x128 tile into jobs of some rows (and columns); every height gives the same result.
    monkeypatch.setattr(kernels, "EDEN_LAUNCH", {size: launch._replace(job_rows=sub) for size, launch in
                                                 kernels.EDEN_LAUNCH.items()})
    x = varied(384, 256, seed=13)
    signs = random_signs(generator=torch.Generator().manual_seed(13))
    rows, cols = kernels.eden_phase1(x, signs.to(DEVICE))
    assert_phase1_matches(rows, rht(x.cpu(), signs))
    assert_phase1_matches(cols, rht(x.cpu().t(), signs))
    q = kernels.triton_quantize(x)
    assert_phase1_matches(kernels.eden_phase1_requantize(q, signs.to(DEVICE)), rht(cpu(q).dequantize().t(), signs))


@pytest.mark.slow
def test_eden_phase2_rounds_scales_stochastically_to_neighbours():
    x = varied(128, 256, seed=5)
    codes, corrected, amax = kernels.eden_phase1(x, random_signs(device=DEVICE))[0]
    tensor_scale = corrected.max().cpu() / EDEN_FP8_MAX
    target = corrected.cpu() / tensor_scale
    lower, upper = grid_neighbours(target, ALL_E4M3)
    draws = []
    for _ in range(200):
        q = cpu(kernels.eden_phase2((codes, corrected, amax)))
        scale = q.group_scale.float()
        assert ((scale == lower) | (scale == upper)).all() and torch.equal(q.tensor_scale, tensor_scale)
        assert torch.equal(q.gemm_operand.float(), q.dequantize(tensor_scale=False))
        draws.append(scale)
    mean = torch.stack(draws).mean(0)  # unbiased: within 5 standard errors of the target (std <= step / 2)
    assert ((mean - target).abs() <= 5 * (upper - lower) / 2 / 200 ** 0.5 + 1e-12).all()
    assert not torch.equal(draws[0], draws[1])  # fresh randomness on every call


def test_eden_pair_draws_apart_for_x_and_its_transpose_and_repeats_after_manual_seed():
    # x symmetric: x and x^T give the same phase one, so only the draws of phase two tell the two outputs apart. They
    # must differ (E and E^T of one backward take disjoint Philox numbers), and repeat after torch.manual_seed.
    a = varied(128, 128, seed=17)
    x = (a + a.t()).contiguous()
    signs = random_signs(generator=torch.Generator().manual_seed(17)).to(DEVICE)
    rows, cols = kernels.eden_phase1(x, signs)
    assert torch.equal(rows.corrected, cols.corrected) and torch.equal(rows.codes, cols.codes)
    torch.manual_seed(0)
    first = kernels.triton_ms_eden_pair(x, signs)
    assert not torch.equal(first[0].group_scale.view(torch.uint8), first[1].group_scale.view(torch.uint8))
    torch.manual_seed(0)
    again = kernels.triton_ms_eden_pair(x, signs)
    assert all(torch.equal(a.group_scale.view(torch.uint8), b.group_scale.view(torch.uint8))
               for a, b in zip(first, again))


@pytest.mark.gpu
def test_eden_kernels_at_scale():
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    signs = random_signs(device="cuda")
    rows, cols = kernels.eden_phase1(x, signs)
    assert_phase1_matches(rows, rht(x.cpu(), signs.cpu()))
    assert_phase1_matches(cols, rht(x.cpu().t(), signs.cpu()))
    q = kernels.triton_quantize(x, four_over_six=True)
    assert_phase1_matches(kernels.eden_phase1_requantize(q, signs), rht(cpu(q).dequantize().t(), signs.cpu()))


# --- dequantization, edge cases, the GEMM ----------------------------------------------------------------------------

@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel(block, dtype):
    q = kernels.triton_quantize(varied(192, 256, seed=6), block=block)
    assert torch.equal(kernels.triton_dequantize(q, dtype).cpu(), cpu(q).dequantize(dtype))
    assert torch.equal(kernels.triton_dequantize(q, dtype, tensor_scale=False).cpu(),
                       cpu(q).dequantize(dtype, tensor_scale=False))


@pytest.mark.parametrize("options", [dict(), dict(four_over_six=True), dict(rounding="sr"), dict(block="16x16")])
def test_kernels_on_zeros_and_nan(options):
    zeros = torch.zeros(64, 128, device=DEVICE, dtype=torch.bfloat16)
    assert (kernels.triton_quantize(zeros, **options).dequantize() == 0).all()
    x = varied(64, 128)
    x[3, 100] = float("nan")
    assert kernels.triton_quantize(x, **options).dequantize().isnan().all()


def test_eden_kernels_on_zeros_and_nan():
    signs = random_signs(device=DEVICE)
    for out in kernels.triton_ms_eden_pair(torch.zeros(128, 256, device=DEVICE, dtype=torch.bfloat16), signs):
        assert (out.dequantize() == 0).all()
    x = varied(128, 256)
    x[7, 9] = float("inf")
    for out in kernels.triton_ms_eden_pair(x, signs):
        assert out.dequantize().isnan().all()


def test_kernels_refuse_bad_shapes():
    with pytest.raises(ValueError, match=r"multiple of \[16, 128\]"):
        kernels.triton_quantize(varied(64, 128)[:, :100])
    with pytest.raises(ValueError, match=r"multiple of \[16, 128\]"):
        kernels.triton_quantize(varied(48, 128)[:40])
    with pytest.raises(ValueError, match=r"multiple of \[128, 128\]"):
        kernels.triton_ms_eden_pair(varied(128, 256)[:, :192], random_signs(device=DEVICE))


def test_on_a_gpu_the_kernels_take_bfloat16_only(monkeypatch):
    monkeypatch.setattr(kernels, "KERNEL_DTYPES", (torch.bfloat16,))  # as on a GPU (the interpreter takes FP32 too)
    x = varied(128, 128, torch.float32)
    for call in (lambda: kernels.triton_quantize(x), lambda: kernels.eden_phase1(x, random_signs(device=DEVICE))):
        with pytest.raises(ValueError, match=r"takes bfloat16 on a GPU \(train under autocast\).*got torch.float32"):
            call()


def test_emulated_gemm_equals_product_of_dequantized_operands():
    g = torch.Generator().manual_seed(7)
    a_x, b_x = torch.randn(256, 384, generator=g), torch.randn(128, 384, generator=g)
    exact = lambda a, b: a.dequantize().double() @ b.dequantize().double().t()
    # references on the CPU (FP32 operands: exact up to FP32 accumulation)
    a, b = quantize_nvfp4(a_x, four_over_six=True), quantize_nvfp4(b_x, four_over_six=True)
    out = kernels.nvfp4_mm(a, b, torch.float32).double()
    assert ((out - exact(a, b)).norm() / exact(a, b).norm()).item() < 1e-6
    # kernels with BF16 code * scale operands: one BF16 rounding of the scaled weight and of the output (2^-9 each)
    a, b = (kernels.triton_quantize(t.to(DEVICE, FLOAT), block=block) for t, block in ((a_x, "1x16"), (b_x, "16x16")))
    for left, right in [(a, b), (a, b.t().t())]:
        out = kernels.nvfp4_mm(left, right).double().cpu()
        reference = exact(cpu(left), cpu(right))
        assert ((out - reference).norm() / reference.norm()).item() < 2 ** -8


# --- arguments, dynamic range, and the rounding bit trick ------------------------------------------------------------

def test_entry_points_refuse_bad_arguments():
    x = varied(64, 128)
    for bad, message in ((dict(block="16X16"), "block must be one of"), (dict(rounding="SR"), "rounding must be"),
                         (dict(fp4_max=0.0), "fp4_max"), (dict(fp4_max=float("nan")), "fp4_max")):
        with pytest.raises(ValueError, match=message):
            kernels.triton_quantize(x, **bad)
        with pytest.raises(ValueError, match=message):
            kernels.quantize_op(x.cpu(), **bad)  # on a CPU the operator's reference refuses them too
    with pytest.raises(ValueError, match="signs of length"):
        kernels.triton_quantize(x, signs=random_signs(64, device=DEVICE))
    for tensor in (torch.ones(64, 128, dtype=torch.int32), torch.ones(64, 128, dtype=torch.bool)):
        with pytest.raises(ValueError, match="takes bfloat16"):
            kernels.triton_quantize(tensor.to(DEVICE))
    with pytest.raises(ValueError, match="signs of length 128"):
        kernels.triton_ms_eden_pair(varied(128, 128), random_signs(16, device=DEVICE))
    for empty in (varied(16, 128)[:0], varied(16, 128)[0, 0]):
        with pytest.raises(ValueError, match="non-empty 2-D tensor"):
            kernels.triton_quantize(empty)
    with pytest.raises(ValueError, match=r"multiple of \[16, 128\]"):
        kernels.triton_dequantize(quantize_nvfp4(torch.randn(16, 16)))
    q = quantize_nvfp4(torch.randn(16, 16))  # a shape the kernel does not tile: the dispatch uses the reference
    assert torch.equal(kernels.dequantize_op(q), q.dequantize())


@pytest.mark.parametrize("largest", [1e-45, 1e-38, 1e-33, 3e38])
@pytest.mark.parametrize("options", [dict(), dict(four_over_six=True), dict(rounding="sr", fp4_max=SR_FP4_MAX)])
def test_kernels_at_the_ends_of_the_float32_range(largest, options):
    # Tiny tensors become zeros (quantize.py, section 6), huge ones quantize normally: never NaN from finite input.
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(10))
    x = (x / x.abs().max() * largest).to(DEVICE, FLOAT)
    ours = cpu(kernels.triton_quantize(x, **options))
    reference = quantize_nvfp4(x.cpu(), **options)
    assert torch.equal(ours.tensor_scale, reference.tensor_scale) and ours.dequantize().isfinite().all()
    if "rounding" not in options:
        assert_same_quantization(ours, reference)
    if largest < 1e-32:
        assert (ours.dequantize() == 0).all()
    else:
        assert bench.relative_error(ours.dequantize(), x.cpu()) < 0.04


@pytest.mark.parametrize("largest", [1e-45, 1e-38, 1e36, 2e36, 3e38])
def test_ms_eden_kernels_at_the_ends_of_the_float32_range(largest):
    # Groups too small for a normal FP32 scale become zeros; inputs beyond 2^120 (1.3e36) saturate before the
    # rotation. The kernel tests for that after rotating (sums beyond 2^119): at 1e36 the test fires but nothing
    # needs saturating, at 2e36 a few inputs do, at 3e38 most do and the unsaturated sums overflow.
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(11))
    x = (x / x.abs().max() * largest).to(DEVICE, FLOAT)
    signs = random_signs(generator=torch.Generator().manual_seed(11))
    rows, cols = kernels.eden_phase1(x, signs.to(DEVICE))
    assert_phase1_matches(rows, rht(x.cpu(), signs))
    assert_phase1_matches(cols, rht(x.cpu().t(), signs))
    for out in kernels.triton_ms_eden_pair(x, signs.to(DEVICE)):
        assert cpu(out).dequantize().isfinite().all()


@pytest.mark.parametrize("largest", [1e36, 2e36, 3e38])  # nothing to saturate; some inputs; the sums overflow
def test_rotated_quantizer_saturates_huge_inputs(largest):
    # The rotated amax pass rotates first and tests afterwards (as MS-EDEN does): huge inputs must give the
    # reference's tensor scale (from saturated inputs), not an overflow.
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(14))
    x = (x / x.abs().max() * largest).to(DEVICE, FLOAT)
    signs = random_signs(16, generator=torch.Generator().manual_seed(14))
    ours = cpu(kernels.triton_quantize(x, transpose=True, signs=signs.to(DEVICE)))
    reference = quantize_nvfp4(rht(x.cpu().t(), signs))
    assert abs(ours.tensor_scale.item() / reference.tensor_scale.item() - 1) < 1e-6
    assert ours.dequantize().isfinite().all()
    agree = decode_e2m1(unpack_codes(ours.codes)) == decode_e2m1(unpack_codes(reference.codes))
    assert agree.float().mean() >= 0.999


@triton.jit
def _nearest_kernel(x_ptr, magnitude_ptr, code_ptr, BLOCK: tl.constexpr, SATURATE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    magnitude, code = kernels._e2m1_round(tl.minimum(tl.abs(x), 6.0) if SATURATE else x)
    tl.store(magnitude_ptr + offsets, magnitude)
    tl.store(code_ptr + offsets, code)


def test_e2m1_bit_trick_equals_the_reference_rounding():
    # Every grid value, every midpoint and their float32 neighbours (ties go to even), values past 6, random ones.
    # The trick rounds |x| < 7 by itself, either sign (MS-EDEN's values stay below 6.08); RTN saturates at 6 first.
    grid = E2M1_VALUES
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([6.07, 6.9999995, 7.0, 1e30])])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(-1.0)), torch.nextafter(points, torch.tensor(9.0))])
    x = torch.cat([near, torch.rand(4096 - len(near), generator=torch.Generator().manual_seed(12)) * 7.5]).abs()
    x[1::2] = -x[1::2]
    reference = e2m1_round(x).abs()
    for saturate in (True, False):
        magnitude, code = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int32)
        inputs, magnitude, code = x.to(DEVICE), magnitude.to(DEVICE), code.to(DEVICE)
        _nearest_kernel[(4,)](inputs, magnitude, code, BLOCK=1024, SATURATE=saturate)
        valid = torch.ones_like(x, dtype=torch.bool) if saturate else x.abs() < 7
        assert valid.sum() > 3500  # most of them
        assert torch.equal(magnitude.cpu()[valid], reference[valid])
        assert torch.equal(code.cpu()[valid], encode_e2m1(reference).int()[valid])
    assert (magnitude.cpu()[x.abs() == 7.0] == 8.0).all()  # unsaturated, 7 would round to 8: callers saturate


def test_kernels_refuse_an_nvfp4_tensor_they_cannot_address():
    q = kernels.triton_quantize(varied(128, 256))
    strided = NVFP4Tensor(q.codes.t().contiguous().t(), q.group_scale, q.tensor_scale, q.shape)  # a view
    tiles = kernels.triton_quantize(varied(128, 256), block="16x16")
    signs = random_signs(device=DEVICE)
    for call, tensor, message in ((kernels.triton_dequantize, strided, "contiguous"),
                                  (kernels.eden_phase1_requantize, strided, "contiguous"),
                                  (kernels.eden_phase1_requantize, tiles, "1x16 groups"),
                                  (kernels.triton_dequantize, quantize_nvfp4(torch.randn(16, 16)), "multiple of"),
                                  (kernels.triton_dequantize, varied(128, 256), "NVFP4Tensor")):
        with pytest.raises(ValueError, match=message):
            call(tensor, signs) if call is kernels.eden_phase1_requantize else call(tensor)


def test_seeds_signs_and_output_dtypes_are_checked():
    x = varied(32, 128)
    for call, message in ((lambda: kernels.triton_quantize(x, rounding="sr", seed=torch.tensor([], dtype=torch.long,
                                                                                               device=DEVICE)), "seed"),
                          (lambda: kernels.triton_quantize(x, rounding="sr", seed=torch.tensor([1.5], device=DEVICE)),
                           "seed"),
                          (lambda: kernels.triton_dequantize(kernels.triton_quantize(x), torch.int32),
                           "writes bfloat16"),
                          (lambda: kernels.triton_quantize(x, signs=torch.ones(16, device="meta")), "float signs"),
                          (lambda: kernels.triton_quantize(x, signs=torch.ones(16, dtype=torch.bool, device=DEVICE)),
                           "float signs"),
                          (lambda: kernels.dequantize_op(x, torch.float32), "needs an NVFP4Tensor"),
                          (lambda: kernels.nvfp4_mm(quantize_nvfp4(torch.randn(16, 32)), x), "NVFP4Tensor")):
        with pytest.raises(ValueError, match=message):
            call()
    q = quantize_nvfp4(torch.randn(32, 128))
    with pytest.raises(ValueError, match="writes bfloat16"):
        kernels.nvfp4_mm(q, q, torch.int32)


@pytest.mark.slow
def test_python_kernels_py_checks_every_kernel_against_its_reference():
    # `python kernels.py` on a CPU: Triton's interpreter (the script sets TRITON_INTERPRET), one line per kernel
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | dict(CUDA_VISIBLE_DEVICES="")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = subprocess.run([sys.executable, "kernels.py"], cwd=root, env=env, capture_output=True, text=True,
                           check=True, timeout=600).stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["_amax_kernel", "_rotated_amax_kernel", "_quantize_kernel",
                                                   "_eden_phase1_kernel", "_eden_phase2_kernel", "_dequantize_kernel"]
    assert all(" matches its reference: " in line for line in lines), lines
