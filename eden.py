"""
MS-EDEN: an unbiased NVFP4 quantizer for gradients, with the randomness in the 8-bit scales. Pure PyTorch.

Why unbiased: the backward pass of a linear layer multiplies gradients; if the quantized gradient is correct on
average, E[q(x)] = x, the optimizer sees the true gradient plus zero-mean noise, and noise averages out over steps
while a bias accumulates. Stochastic rounding (SR) of every 4-bit element is unbiased but noisy: its relative error on
Gaussian data is 23.5e-3, against 9.0e-3 for round-to-nearest (RTN). MS-EDEN is unbiased at about RTN's error, 9.4e-3.

1. Randomized Hadamard transform (RHT). Cut the last dimension into chunks of 128 and rotate each:

       rht(x) = x * H^T,   H = H128 * diag(s)

   where H128 is the 128x128 Sylvester Hadamard matrix divided by sqrt(128) (entries +-1/sqrt(128), orthogonal and
   symmetric) and s is a vector of 128 random signs. The rotation spreads every chunk's energy evenly, so rotated
   values look Gaussian whatever the input looked like, and outliers no longer dominate a group's scale. It never
   needs undoing: in a GEMM A * B^T both operands are rotated along the inner dimension with the same H, and
   (A H^T)(B H^T)^T = A H^T H B^T = A B^T. Fresh signs on every call make the rotation random.

2. EDEN's correction. RTN-quantize the rotated values y group by group (16 elements, codes c, group scale g), giving
   y_hat = c * g. RTN shrinks vectors on average (it rounds towards the grid), so rescale each group by

       S = <y, y> / <y, y_hat>.

   EDEN (Vargaftik et al., 2022) shows that over the random rotation, S * y_hat rotated back is unbiased for x:
   its component along y is scaled to exactly |y|, and by the symmetry of the random rotation everything orthogonal
   to y averages out to zero. The codes are untouched; only the group scale changes, g -> g * S.

3. MS ("micro-scaled"): g * S must be stored as an E4M3 number. Rounding it to nearest would bring the bias back,
   so it is rounded stochastically to one of its two E4M3 neighbours, which is unbiased. This is the whole trick:
   the randomness moves from sixteen 4-bit elements (steps of 1/3 to 1/2 of the value) to one 8-bit scale (steps of
   1/8 to 1/16 of it), which is why the error is so much lower than SR's.

4. The NVFP4 constants, the paper's. The group maximum maps to fp4_max = 6 * (16/17) / 0.93 ~= 6.07, past 6: the
   largest values clip a little, which lowers the error (S restores the lost length on average). The tensor scale
   maps the largest corrected scale to fp8_max = 256, not E4M3's 448: headroom for S if the tensor scale came first.
   Here it comes after S (below), so 256 ... 448 stays unused, at no cost: E4M3's relative step is the same there.

Step by step, for x with a last dimension that is a multiple of 128:

       y            = rht(x, s)
       scale_g      = amax(|y_g|) / fp4_max                  (FP32, the group's own unrounded scale; 0 if < 2^-126)
       u_g          = y_g * (fp4_max / amax(|y_g|))           (|u_g| <= fp4_max)
       codes_g      = E2M1_round(u_g)
       S_g          = <u_g, u_g> / <u_g, codes_g>             (= <y_g, y_g> / <y_g, y_hat_g>; 1 if all zero)
       tensor_scale = max_g(scale_g * S_g) / fp8_max          (post hoc range alignment)
       group_scale  = E4M3_stochastic_round(scale_g * S_g / tensor_scale)

The codes depend only on each group's own FP32 scale, so the tensor scale can be chosen after the fact from the
largest corrected scale: a GPU kernel computes codes and corrected scales in one pass over the data and fixes the
8-bit scales in a tiny second pass, with no separate pass for the global maximum. E[group_scale] * tensor_scale =
scale_g * S_g exactly, so E[dequantized] = S_g * codes_g * scale_g, EDEN's unbiased estimate.

Known limits: unbiasedness holds over the random signs; for one fixed rotation the estimate has a small bias.
Hadamard-128 with random signs is not a uniformly random rotation, and S is computed per 16-group rather than per
128-chunk; both are approximations that measure as unbiased well below the noise (bench.py quant, tests). A group
whose corrected scale is below E4M3's smallest step (2^-9 of 1/256 of the tensor's largest scale) is still rounded
without bias, but very coarsely. NaN or Inf anywhere makes the tensor scale, and so the whole result, NaN.

Dynamic range. The rotation sums 128 values, so it could overflow FP32 for inputs near FP32's maximum: finite
inputs beyond +-2^120 (1.3e36) saturate there first. A group whose scale_g is below FP32's smallest normal number
(2^-126: its reciprocal would overflow) quantizes to zero, and a tensor too small for its tensor scale gets the
tensor scale 1 (quantize.py, section 6): finite input never gives NaN.
"""

import math

import torch

from quantize import (E2M1_MAX, GROUP, MIN_NORMAL, SR_FP4_MAX, NVFP4Tensor, check_generator, check_quantizable,
                      e2m1_round, e4m3_stochastic_round, encode_e2m1, pack_codes, quantize_nvfp4, relative_error,
                      tensor_scale_for)

HADAMARD = 128  # rotation size
EDEN_FP4_MAX = E2M1_MAX * (16 / 17) / 0.93
EDEN_FP8_MAX = 256.0
ROTATION_LIMIT = 2.0**120  # finite inputs saturate here before a rotation, which sums up to 128 of them


def sylvester_matrix(n=HADAMARD):
    """The n x n Sylvester Hadamard matrix of +-1 (n a power of two): H[i, j] = (-1)^popcount(i & j)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two, got {n}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:  # H_2k = [[H, H], [H, -H]]
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def random_signs(n=HADAMARD, generator=None, device=None):
    """n random +-1.0 (float32), on the generator's device unless device is given."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"random_signs needs a positive number of signs, got {n!r}")
    check_generator(generator)
    if device is None:
        device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2, (n,), generator=generator, device=device).float() * 2 - 1


def check_signs(signs, n=None):
    """Raise a ValueError unless signs is a 1-D tensor of +-1 whose length is n (or, without n, a power of two from 2
    to 128)."""
    if not isinstance(signs, torch.Tensor) or signs.dim() != 1 or not signs.is_floating_point() or signs.is_meta:
        raise ValueError(f"signs must be a 1-D float tensor of +-1 with data, got {getattr(signs, 'dtype', signs)} "
                         f"{tuple(getattr(signs, 'shape', ()))}")
    length = signs.numel()
    if (length != n) if n else (length < 2 or length > HADAMARD or length & (length - 1)):
        raise ValueError(f"signs must have {n or 'a power of two from 2 to 128'} entries, got {length}")
    if not signs.is_cuda and not (signs.abs() == 1).all():  # on a GPU this check would wait for the device
        raise ValueError("signs must hold only +1 and -1")


def _rotate(x, signs, inverse, what):
    """x * diag(s) * H128 (or, inverse, x * H128 * diag(s)) on each len(signs)-chunk of the last dimension, in FP32 as
    the kernels compute it: a sum of +-x (exact products), then one multiplication by 1/sqrt(n)."""
    check_signs(signs)
    n = signs.numel()
    check_quantizable(x, n, what=what)
    chunks = x.float().unflatten(-1, (-1, n))  # [..., C/n, n]
    signs = signs.to(device=x.device, dtype=torch.float32)
    sylvester = sylvester_matrix(n).to(x.device)
    if inverse:
        return ((chunks @ sylvester) * (1 / math.sqrt(n)) * signs).flatten(-2)
    saturated = chunks.clamp(-ROTATION_LIMIT, ROTATION_LIMIT)
    chunks = torch.where(chunks.isinf(), chunks, saturated)  # Inf stays Inf (and NaN stays NaN)
    return (((chunks * signs) @ sylvester) * (1 / math.sqrt(n))).flatten(-2)


def rht(x, signs):
    """x * diag(s) * H128 on each len(signs)-chunk of the last dimension (FP32; beyond +-ROTATION_LIMIT saturated)."""
    return _rotate(x, signs, inverse=False, what="rht")


def inverse_rht(y, signs):
    """Undo rht: y * H128 * diag(s) (H128, or H_n for n signs, is symmetric and orthogonal)."""
    return _rotate(y, signs, inverse=True, what="inverse_rht")


def eden_groups(rotated):
    """The deterministic part of MS-EDEN on already rotated values [..., C].

    Returns (E2M1 values [..., C/16, 16], corrected FP32 scales [..., C/16, 1])."""
    groups = rotated.float().unflatten(-1, (-1, GROUP))
    largest = groups.abs().amax(-1, keepdim=True)
    scale = largest * (1 / EDEN_FP4_MAX)  # a multiplication by an FP32 constant, as the kernel computes it
    flushed = scale < MIN_NORMAL  # a group this small becomes zeros
    scale = torch.where(flushed, torch.zeros_like(scale), scale)
    scaled = groups * torch.where(flushed, torch.ones_like(scale), EDEN_FP4_MAX / largest)  # |scaled| <= 6.07
    values = e2m1_round(scaled)
    # S = <y, y> / <y, y_hat>, computed on the scaled values so that squares cannot overflow. The overlap is 0 only
    # for an all-zero or flushed group (otherwise the group maximum gets a nonzero code).
    norm = scaled.square().sum(-1, keepdim=True)
    overlap = (scaled * values).sum(-1, keepdim=True)
    correction = torch.where(overlap > 0, norm / overlap, torch.ones_like(norm))
    return values, scale * correction


def quantize_ms_eden(x, signs, generator=None):
    """MS-EDEN: rotate x (last dimension a multiple of 128) with rht(x, signs) and quantize it, unbiased, to NVFP4.

    The result holds the rotated values: pair it with an operand rotated by the same signs (rotations cancel in
    the GEMM), or undo the rotation with inverse_rht(result.dequantize(), signs)."""
    check_signs(signs, HADAMARD)
    check_quantizable(x, HADAMARD, what="quantize_ms_eden")
    check_generator(generator)
    values, corrected_scale = eden_groups(rht(x.detach(), signs))  # no gradient, as quantize_nvfp4
    tensor_scale = tensor_scale_for(corrected_scale.max(), EDEN_FP8_MAX)
    group_scale = e4m3_stochastic_round(corrected_scale / tensor_scale, generator)
    codes = pack_codes(encode_e2m1(values.flatten(-2)))
    return NVFP4Tensor(codes, group_scale.squeeze(-1).to(torch.float8_e4m3fn), tensor_scale, x.shape)


# -----------------------------------------------------------------------------
# See it work: python eden.py


def ms_eden_estimate(x, generator=None):
    """x as MS-EDEN estimates it: rotated by fresh signs, quantized, dequantized and rotated back."""
    return inverse_rht(quantize_ms_eden(x, signs := random_signs(generator=generator), generator).dequantize(), signs)


def concentration(quantizer, x, batch_sizes, generator=None):
    """{B: relative error of the mean of B quantizations quantizer(x, generator)}: variance / B + bias^2, so an
    unbiased quantizer's error falls like 1 / B, and a biased one's stops at its bias."""
    errors, total = {}, torch.zeros_like(x, dtype=torch.float64)
    for done in range(1, max(batch_sizes) + 1):
        total += quantizer(x, generator)
        if done in batch_sizes:
            errors[done] = relative_error(total / done, x)
    return errors


def demo(x, batch_sizes=(1, 4, 16, 64, 256), generator=None):
    """MS-EDEN's point, printed: the error of the mean of B quantizations, per quantizer; {name: {B: error}}."""
    quantizers = {"round to nearest": lambda x, g: quantize_nvfp4(x).dequantize(), "stochastic rounding":
                  lambda x, g: quantize_nvfp4(x, "sr", fp4_max=SR_FP4_MAX, generator=g).dequantize(),
                  "MS-EDEN": ms_eden_estimate}
    curves = {name: concentration(q, x, batch_sizes, generator) for name, q in quantizers.items()}
    print(f"Relative error x 1e-3 of the mean of B quantizations of a {x.shape[0]} x {x.shape[1]} N(0, 1) tensor\n"
          f"{'B':>5}" + "".join(f"{name:>22}" for name in quantizers))
    for b in batch_sizes:
        print(f"{b:>5}" + "".join(f"{1e3 * curve[b]:>22.3f}" for curve in curves.values()))
    undone = relative_error(inverse_rht(rht(x, signs := random_signs(generator=generator)), signs), x)
    print(f"Round to nearest keeps its error (deterministic: a bias). SR and MS-EDEN are unbiased: theirs falls like "
          f"1 / B,\nMS-EDEN's 2.5x lower. The rotation undone: relative error {undone:.0e} (FP32 round-off, squared).")
    return curves


if __name__ == "__main__":
    generator = torch.Generator().manual_seed(0)
    demo(torch.randn(64, 1024, generator=generator), generator=generator)
