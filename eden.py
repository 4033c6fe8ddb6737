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

   EDEN (Vargaftik et al., 2022) shows that for a random rotation, S * y_hat is an unbiased estimate of y: the
   component of y_hat along y is scaled to exactly |y|, and by symmetry of the random rotation everything
   orthogonal to y averages out to zero. The codes are untouched; only the group scale changes, g -> g * S.

3. MS ("micro-scaled"): g * S must be stored as an E4M3 number. Rounding it to nearest would bring the bias back,
   so it is rounded stochastically to one of its two E4M3 neighbours, which is unbiased. This is the whole trick:
   the randomness moves from sixteen 4-bit elements (steps of 1/3 to 1/2 of the value) to one 8-bit scale (steps of
   1/8 to 1/16 of it), which is why the error is so much lower than SR's.

4. The NVFP4 constants. The group maximum maps to fp4_max = 6 * (16/17) / 0.93 ~= 6.07: slightly past 6, so the very
   largest values clip a little (it lowers the error, and the correction S absorbs the lost length on average).
   Group scales then leave headroom below E4M3's 448 for S: the tensor scale maps the largest corrected scale to
   fp8_max = 256.

Step by step, for x with a last dimension that is a multiple of 128:

       y            = rht(x, s)
       scale_g      = amax(|y_g|) / fp4_max                  (FP32, the group's own unrounded scale)
       u_g          = y_g * (1 / scale_g)                     (|u_g| <= fp4_max)
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
"""

import math

import torch

from quantize import (E2M1_MAX, GROUP, NVFP4Tensor, check_quantizable, e2m1_round, e4m3_stochastic_round,
                      encode_e2m1, pack_codes, tensor_scale_for)

HADAMARD = 128  # rotation size
EDEN_FP4_MAX = E2M1_MAX * (16 / 17) / 0.93
EDEN_FP8_MAX = 256.0


def hadamard_matrix(n=HADAMARD):
    """The n x n Sylvester Hadamard matrix divided by sqrt(n): symmetric and orthogonal (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix needs a power of two, got {n}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:  # H_2k = [[H, H], [H, -H]]
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(n)


def random_signs(n=HADAMARD, generator=None, device=None):
    """n random +-1.0 (float32), on the generator's device unless device is given."""
    if device is None:
        device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2, (n,), generator=generator, device=device).float() * 2 - 1


def _check_signs(signs, n):
    if signs.shape != (n,):
        raise ValueError(f"signs must have shape ({n},), got {tuple(signs.shape)}")


def rht(x, signs):
    """Rotate each consecutive chunk of len(signs) along the last dimension: x * diag(s) * H (float32)."""
    n = signs.numel()
    _check_signs(signs, n)
    check_quantizable(x, n, what="rht")
    chunks = x.float().unflatten(-1, (-1, n))  # [..., C/n, n]
    rotated = (chunks * signs.to(x.device)) @ hadamard_matrix(n).to(x.device)
    return rotated.flatten(-2)


def inverse_rht(y, signs):
    """Undo rht: y * H * diag(s) (H is symmetric and orthogonal)."""
    n = signs.numel()
    _check_signs(signs, n)
    check_quantizable(y, n, what="inverse_rht")
    chunks = y.float().unflatten(-1, (-1, n))
    return ((chunks @ hadamard_matrix(n).to(y.device)) * signs.to(y.device)).flatten(-2)


def eden_groups(rotated):
    """The deterministic part of MS-EDEN on already rotated values [..., C].

    Returns (E2M1 values [..., C/16, 16], corrected FP32 scales [..., C/16, 1])."""
    groups = rotated.float().unflatten(-1, (-1, GROUP))
    scale = groups.abs().amax(-1, keepdim=True) / EDEN_FP4_MAX
    scaled = groups * (1 / torch.where(scale == 0, torch.ones_like(scale), scale))  # |scaled| <= 6.07
    values = e2m1_round(scaled)
    # S = <y, y> / <y, y_hat>, computed on the scaled values so that squares cannot overflow. Both sums are 0 only
    # for an all-zero group (the group maximum always gets a nonzero code).
    norm = scaled.square().sum(-1, keepdim=True)
    overlap = (scaled * values).sum(-1, keepdim=True)
    correction = torch.where(overlap > 0, norm / overlap, torch.ones_like(norm))
    return values, scale * correction


def quantize_ms_eden(x, signs, generator=None):
    """MS-EDEN: rotate x (last dimension a multiple of 128) with rht(x, signs) and quantize it, unbiased, to NVFP4.

    The result holds the rotated values: pair it with an operand rotated by the same signs (rotations cancel in
    the GEMM), or undo the rotation with inverse_rht(result.dequantize(), signs)."""
    _check_signs(signs, HADAMARD)
    check_quantizable(x, HADAMARD, what="quantize_ms_eden")
    values, corrected_scale = eden_groups(rht(x, signs))
    tensor_scale = tensor_scale_for(corrected_scale.max(), EDEN_FP8_MAX)
    group_scale = e4m3_stochastic_round(corrected_scale / tensor_scale, generator)
    codes = pack_codes(encode_e2m1(values.flatten(-2)))
    return NVFP4Tensor(codes, group_scale.squeeze(-1).to(torch.float8_e4m3fn), tensor_scale, x.shape)
