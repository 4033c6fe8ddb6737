"""
The NVFP4 format: 4-bit floats with two levels of scale. Pure PyTorch, written to be read.

1. The element: E2M1
   A 4-bit float has one sign bit, two exponent bits and one mantissa bit. Its eight magnitudes are

       code  0    1    2    3    4    5    6    7
       value 0   0.5   1   1.5   2    3    4    6

   and bit 3 of the code is the sign ("code" in the formulas below: its signed value). Between 1 and 2 the step is
   0.5, between 2 and 4 it is 1, between 4 and 6 it is 2; below 1 the step stays 0.5 ("subnormals"). Two codes share
   a byte: the even-index element in the low nibble, the odd one in the high (as torch.float4_e2m1fn_x2 and cuBLAS).

2. Why scales, and why two levels
   Eight magnitudes cannot cover the range of real tensors, so values are stored divided by a scale. A scale per
   small group keeps every group's largest value near the top of the grid:

       value = code * group_scale * tensor_scale

   - group_scale: one per 16 consecutive elements along the GEMM's inner dimension ("1x16"), or one per 16x16 tile
     ("16x16", so that a matrix and its transpose share one quantization). It is an 8-bit float, E4M3: 4 bits of
     exponent, 3 of mantissa, largest value 448, smallest 2^-9. E4M3 is fine-grained (steps of 1/8 to 1/16 of the
     value) but its range (2^-9 ... 448) is far too narrow for a whole tensor.
   - tensor_scale: one FP32 per tensor that shifts every group scale into E4M3's range.

3. Round-to-nearest quantization (RTN), given fp4_max (the grid value the group maximum maps to) and fp8_max (the
   group scale of the group that holds the tensor's maximum):

       tensor_scale = amax(|x|) / (fp8_max * fp4_max)                  (1 if x is all zero: section 6)
       group_scale  = E4M3_round(group_amax * (1 / (fp4_max * tensor_scale)))  (1 if that rounds to 0)
       code         = E2M1_round(x * (1 / (group_scale * tensor_scale)))           (saturating at +-6)

   Every rounding here is to nearest, ties to even. Scales are applied as reciprocals, multiplied rather than
   divided by, as GPU kernels do (a correctly rounded division costs a GPU many instructions; the two can differ in
   the last bit).
   Rounding a normal group scale (2^-6 or more) can shrink it by up to 16/17, which pushes the group maximum a
   little past fp4_max; with fp4_max = 6 it saturates at 6.

4. Variants
   - Stochastic rounding (SR): round each x / (group_scale * tensor_scale) up or down to its two grid neighbours,
     up with probability equal to the distance from the lower one (in units of the step). Then
     E[code * group_scale * tensor_scale] = x exactly, as long as nothing clips: SR therefore scales with
     fp4_max = 6 * 16/17 (SR_FP4_MAX), so that even a group scale shrunk by 16/17 keeps the group maximum inside
     the grid. The random draw has 16 bits, (k + 1/2) / 2^16 for k uniform in 0 ... 2^16 - 1: a bias of at most
     2^-17 grid steps, and a kernel gets two elements' draws from one 32-bit random number.
   - Four-over-six (4/6): quantize each group twice, once mapping its maximum to fp4_max (6) and once to
     fp4_max * 4/6 (4, i.e. a group scale 1.5x larger), and keep the one with the smaller squared error (a tie keeps
     6). Mapping to 4 gives up the grid value 6, but the group's largest values then round between 3 and 4 instead
     of between 4 and 6: a finer step where most of the error is made. The 1.5x larger scale needs headroom in
     E4M3, so fp8_max is 256 instead of 448 (default_fp8_max). Choosing by error makes the quantizer biased, which
     is fine for the forward pass only.
     The squared error: with x' = x / (group_scale * tensor_scale), (x - value * group_scale * tensor_scale)^2 =
     tensor_scale^2 * group_scale^2 * (x' - value)^2, and tensor_scale is the same in both branches. So each
     branch's error is group_scale^2 * sum(units^2), units = trunc(ERROR_UNITS * (|x'| - |value|)): each element's
     error in integer 1/1024ths of a grid unit. Integers add up to the same sum in any order and the product with
     group_scale^2 is exact in FP64, so a GPU kernel, which adds in an order of its own, makes the same choice.

5. NaN and Inf: E2M1 has neither. A NaN or Inf anywhere in the input makes the tensor scale NaN, so the whole tensor
   dequantizes to NaN instead of silently turning into finite numbers.

6. Dynamic range. Every finite tensor up to FP32's largest value (3.4e38) quantizes normally. At the small end the
   kernels multiply by 1 / (group_scale * tensor_scale), which must stay finite: group scales are at least 2^-9
   (E4M3's smallest step), so the tensor scale must be at least MIN_TENSOR_SCALE = 2^-126 / 2^-9 = 2^-117 (2^-126:
   FP32's smallest normal number). A tensor whose absolute maximum is below MIN_TENSOR_SCALE * fp8_max * fp4_max
   (about 2^-106 = 1e-32 for RTN) gets the tensor scale 1 and quantizes to zeros, as an all-zero tensor does. A group
   under 2^-6 / fp8_max of the tensor's maximum gets a subnormal E4M3 scale, which rounding can shrink by more than
   16/17: SR then clips that group's largest values, a bias.

Below: rounding to a small float grid, codes and packing, NVFP4Tensor, the quantizer, python quantize.py's example.
"""

from dataclasses import dataclass
from typing import Optional

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
SR_FP4_MAX = E2M1_MAX * 16 / 17  # stochastic rounding that never clips (section 4)
FOUR_OVER_SIX_FP8_MAX = 256.0  # headroom in E4M3 for four-over-six's 1.5x larger scales (section 4)
MIN_NORMAL = 2.0**-126  # FP32's smallest normal number: its reciprocal is still finite
MIN_TENSOR_SCALE = MIN_NORMAL / 2.0**-9  # times the smallest E4M3 group scale, still normal (section 6)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitude of codes 0..7
GROUP = 16  # elements per group scale (along the last dimension, or 16x16 tiles)
ERROR_UNITS = 1024  # four-over-six measures errors in integer 1/1024ths of a grid unit (section 4)
SR_NOISE_BITS = 16  # random bits per element of stochastic rounding (section 4)
BLOCKS = ("1x16", "16x16")
ROUNDINGS = ("rtn", "sr")

# -----------------------------------------------------------------------------
# Rounding to a small float grid. With m mantissa bits, the binade [2^e, 2^(e+1)) has the step 2^(e-m); below the
# smallest normal exponent e_min the step stays 2^(e_min-m) (subnormals). E2M1: m = 1, e_min = 0, max 6; E4M3: m = 3,
# e_min = -6, max 448. One function rounds to either.


def round_to_grid(x, mantissa_bits, min_exponent, max_value, noise=None):
    """Round x (float32) to the grid; nearest-even if noise is None, else stochastically (noise ~ U[0,1))."""
    magnitude = x.abs().clamp(max=max_value)  # saturate; NaN stays NaN
    _, frexp_exponent = torch.frexp(magnitude)  # magnitude = mantissa * 2^frexp_exponent, mantissa in [0.5, 1)
    exponent = (frexp_exponent - 1).clamp(min=min_exponent)
    step = torch.exp2((exponent - mantissa_bits).float())  # power of two: dividing by it is exact
    steps = magnitude / step
    if noise is None:
        rounded = torch.round(steps)  # ties to even
    else:
        lower = torch.floor(steps)
        rounded = lower + (noise < steps - lower).float()  # up with probability = distance from lower
    return torch.copysign((rounded * step).clamp(max=max_value), x)


def sr_noise(shape, generator=None, device=None):
    """Stochastic rounding's draws (k + 1/2) / 2^16, k uniform in 0 ... 2^16 - 1 (section 4): rounding up when noise < d
    (the distance from the lower neighbour) has probability ceil(2^16 d - 1/2) / 2^16, within 2^-17 of d, 0 at d = 0."""
    k = torch.randint(0, 2**SR_NOISE_BITS, shape, generator=generator, device=device)
    return (k.float() + 0.5) / 2**SR_NOISE_BITS


def e2m1_round(x, noise=None):
    """Round float32 values to the E2M1 grid {0, 0.5, ..., 6}, saturating at +-6 (stochastically given noise)."""
    return round_to_grid(x, 1, 0, E2M1_MAX, noise)


def e4m3_round(x):
    """Round float32 values to the nearest E4M3 value (ties to even), saturating at +-448; returns float32."""
    return round_to_grid(x.float(), 3, -6, E4M3_MAX)


def e4m3_stochastic_round(x, generator=None):
    """Round float32 values up or down to a neighbouring E4M3 value, unbiased inside [-448, 448]."""
    return round_to_grid(x.float(), 3, -6, E4M3_MAX, torch.rand(x.shape, generator=generator, device=x.device))


# -----------------------------------------------------------------------------
# Codes and packing


def encode_e2m1(values):
    """E2M1 grid values (float) -> 4-bit codes (uint8): magnitude index in bits 0-2, sign in bit 3."""
    grid = E2M1_VALUES.to(values.device)
    magnitude_code = torch.searchsorted(grid, values.abs().nan_to_num(0.0)).clamp(max=7)
    return (magnitude_code | (torch.signbit(values).to(torch.int64) << 3)).to(torch.uint8)


def decode_e2m1(codes):
    """4-bit codes (uint8) -> float32 values."""
    grid = E2M1_VALUES.to(codes.device)
    magnitude = grid[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -magnitude, magnitude)


def pack_codes(codes):
    """[..., C] 4-bit codes -> [..., C/2] bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed):
    """[..., C/2] bytes -> [..., C] 4-bit codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


# -----------------------------------------------------------------------------
# The container


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4 along its last dimension (1x16) or in 16x16 tiles over its last two.

    codes:        uint8 [..., R, C/2], two 4-bit codes per byte
    group_scale:  float8_e4m3fn [..., R, C/16] (1x16) or [..., R/16, C/16] (16x16)
    tensor_scale: float32, one element
    shape:        the logical shape [..., R, C]
    block:        "1x16" or "16x16"
    gemm_operand: optional code * group_scale in BF16 (exact), the operand of the BF16 GEMM that stands in for NVFP4
                  on GPUs without FP4 tensor cores; the tensor scale is applied to its output (kernels.emulated_mm).
    Immutable: a kernel reads its parts as they were checked when it was made.
    """

    codes: torch.Tensor
    group_scale: torch.Tensor
    tensor_scale: torch.Tensor
    shape: torch.Size
    block: str = "1x16"
    gemm_operand: Optional[torch.Tensor] = None

    def __post_init__(self):
        """Refuse parts that do not fit together (a kernel reading them would read garbage or past their end)."""
        object.__setattr__(self, "shape", torch.Size(self.shape))  # the one assignment a frozen dataclass allows
        tiled = self.block == "16x16"
        if self.block not in BLOCKS or len(self.shape) < 1 + tiled or any(n % GROUP for n in self.shape[-1 - tiled:]):
            raise ValueError(f"NVFP4Tensor: block must be one of {BLOCKS}, over sizes that are multiples of 16, got "
                             f"{self.block!r} for shape {tuple(self.shape)}")
        *lead, cols = self.shape
        tiles = (*lead[:-1], lead[-1] // GROUP) if tiled else lead
        for name, dtype, shape in (("codes", torch.uint8, (*lead, cols // 2)), ("tensor_scale", torch.float32, ()),
                                   ("group_scale", torch.float8_e4m3fn, (*tiles, cols // GROUP)),
                                   ("gemm_operand", torch.bfloat16, tuple(self.shape))):
            part, device = getattr(self, name), getattr(self.codes, "device", None)
            fits = isinstance(part, torch.Tensor) and (part.dtype, part.device, part.shape) == (dtype, device, shape)
            if not fits and (name != "gemm_operand" or part is not None):
                raise ValueError(f"NVFP4Tensor of shape {tuple(self.shape)} ({self.block}): {name} must be {dtype} "
                                 f"{shape} on {device}, got {getattr(part, 'dtype', type(part).__name__)} "
                                 f"{tuple(getattr(part, 'shape', ()))}")

    def element_scales(self):
        """group_scale expanded to one float32 per element: [..., R, C]."""
        scales = self.group_scale.float().repeat_interleave(GROUP if self.block == "16x16" else 1, dim=-2)
        return scales.repeat_interleave(GROUP, dim=-1)

    def dequantize(self, dtype=torch.float32, tensor_scale=True):
        """code * group_scale * tensor_scale (the last factor left out if tensor_scale=False)."""
        values = decode_e2m1(unpack_codes(self.codes)) * self.element_scales()
        return (values * self.tensor_scale if tensor_scale else values).to(dtype)

    def t(self):
        """The transpose of a 2-D tensor quantized in 16x16 tiles. A tile's scale serves both orientations, so this
        is exact: it is why the NVIDIA recipe quantizes W in 16x16 tiles and reuses it for W^T."""
        if self.block != "16x16" or len(self.shape) != 2:
            raise ValueError("only a 2-D tensor quantized in 16x16 tiles can be transposed without re-quantizing")
        rows, cols = self.shape
        codes = pack_codes(unpack_codes(self.codes).t().contiguous())
        operand = None if self.gemm_operand is None else self.gemm_operand.t()
        return NVFP4Tensor(codes, self.group_scale.t().contiguous(), self.tensor_scale, torch.Size((cols, rows)),
                           self.block, operand)


# -----------------------------------------------------------------------------
# The quantizer


def check_quantizable(x, multiple, dims=1, what="quantize_nvfp4"):
    """A ValueError unless x is a non-empty float tensor with data, its last `dims` sizes multiples of `multiple`."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.is_meta:
        kind = "a meta tensor" if getattr(x, "is_meta", False) else getattr(x, "dtype", type(x).__name__)
        raise ValueError(f"{what} needs a floating-point tensor with data (float32, bfloat16 or float16), got {kind}")
    if x.dim() < dims or x.numel() == 0 or any(size % multiple for size in x.shape[x.dim() - dims:]):
        raise ValueError(f"{what} needs a non-empty tensor with at least {dims} dimension(s), the last {dims} "
                         f"dimension(s) to be multiples of {multiple}, got shape {tuple(x.shape)}")


def check_quantizer(rounding, block, fp4_max, fp8_max, four_over_six):
    """Raise a ValueError unless the quantizer's settings are ones it can honour."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    if not 0.5 <= fp4_max <= 2 * E2M1_MAX:  # also refuses NaN
        raise ValueError(f"fp4_max (the grid value a group's maximum maps to) must lie in [0.5, 12], got {fp4_max}")
    if not 1.0 <= fp8_max * (1.5 if four_over_six else 1.0) <= E4M3_MAX:
        raise ValueError(f"fp8_max={fp8_max} leaves no room in E4M3 (1 ... 448) for the scales it implies")


def check_generator(generator):  # a clear error, where torch's own comes from deep inside a random draw
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def default_fp8_max(four_over_six):
    return FOUR_OVER_SIX_FP8_MAX if four_over_six else E4M3_MAX


def tensor_scale_for(largest, limit):
    """largest / limit as the FP32 tensor scale: NaN if largest is NaN or Inf, 1 if the quotient is below
    MIN_TENSOR_SCALE (an all-zero tensor, or one too small to quantize: it becomes zeros, section 6)."""
    scale = largest.float() / limit
    scale = torch.where(scale < MIN_TENSOR_SCALE, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(largest), scale, torch.full_like(scale, float("nan")))


def to_groups(x, block):
    """[..., R, C] -> [..., R, C/16, 16] (1x16) or [..., R/16, C/16, 256] (16x16 tiles, through [..., R/16, 16, C/16,
    16])."""
    if block == "1x16":
        return x.unflatten(-1, (-1, GROUP))
    return x.unflatten(-1, (-1, GROUP)).unflatten(-3, (-1, GROUP)).transpose(-3, -2).flatten(-2)


def from_groups(groups, block):
    """Inverse of to_groups."""
    if block == "1x16":
        return groups.flatten(-2)
    return groups.unflatten(-1, (GROUP, GROUP)).transpose(-3, -2).flatten(-2).flatten(-3, -2)


def _quantize_groups(groups, group_amax, fp4_max, tensor_scale, noise):
    """One RTN/SR pass: returns (E2M1 values, E4M3 group scales as float32, four-over-six's error per group)."""
    group_scale = e4m3_round(group_amax * (1 / (fp4_max * tensor_scale)))  # one reciprocal per tensor
    group_scale = torch.where(group_scale == 0, torch.ones_like(group_scale), group_scale)
    scaled = groups * (1 / (group_scale * tensor_scale))  # times the reciprocal, as kernels do
    values = e2m1_round(scaled, noise)
    units = ((scaled.abs() - values.abs()) * ERROR_UNITS).to(torch.int32)  # truncated toward zero
    error = units.square().sum(-1, keepdim=True).double() * group_scale.double().square()  # exact
    return values, group_scale, error.squeeze(-1)


def quantize_nvfp4(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, fp8_max=None,
                   generator=None):
    """Quantize x to NVFP4 along its last dimension (1x16) or in 16x16 tiles over its last two dimensions.

    rounding: "rtn" (nearest) or "sr" (stochastic, unbiased if nothing clips; use fp4_max = 6*16/17 for that).
    four_over_six: per group, keep the better of mapping the maximum to fp4_max or to fp4_max * 4/6.
    fp8_max: the largest group's scale; 448, or 256 with four_over_six (headroom for its 1.5x larger scales).
    """
    fp8_max = default_fp8_max(four_over_six) if fp8_max is None else fp8_max
    check_quantizer(rounding, block, fp4_max, fp8_max, four_over_six)
    check_quantizable(x, GROUP, dims=1 if block == "1x16" else 2)
    check_generator(generator)
    x = x.detach()  # no gradient: through the tensor scale alone it would be meaningless

    groups = to_groups(x.float(), block)  # [..., groups, 16 or 256]
    group_amax = groups.abs().amax(-1, keepdim=True)
    tensor_scale = tensor_scale_for(groups.abs().amax(), fp8_max * fp4_max)
    noise = sr_noise(groups.shape, generator, x.device) if rounding == "sr" else None

    values, group_scale, error = _quantize_groups(groups, group_amax, fp4_max, tensor_scale, noise)
    if four_over_six:
        noise4 = sr_noise(groups.shape, generator, x.device) if rounding == "sr" else None
        values4, group_scale4, error4 = _quantize_groups(groups, group_amax, fp4_max * 4 / 6, tensor_scale, noise4)
        pick4 = (error4 < error).unsqueeze(-1)  # a tie keeps the 6-branch
        values = torch.where(pick4, values4, values)
        group_scale = torch.where(pick4, group_scale4, group_scale)

    codes = pack_codes(encode_e2m1(from_groups(values, block)))
    return NVFP4Tensor(codes, group_scale.squeeze(-1).to(torch.float8_e4m3fn), tensor_scale, x.shape, block)


# -----------------------------------------------------------------------------
# See it work: python quantize.py


def relative_error(estimate, x):  # ||estimate - x||^2 / ||x||^2 in FP64: the paper's Table 1 measure
    return ((estimate.double() - x.double()).square().sum() / x.double().square().sum()).item()


def worked_example(x):
    """Section 3 by hand on the first group of x [R, C], printed step by step; returns what quantize_nvfp4 stores for
    it (the tests check they are the same): tensor_scale, group_scale, codes, dequantized values."""
    tensor_scale, group = tensor_scale_for(x.abs().amax(), E4M3_MAX * E2M1_MAX), x[0, :GROUP].float()
    unrounded = group.abs().amax() * (1 / (E2M1_MAX * tensor_scale))
    group_scale = e4m3_round(unrounded)
    scaled = group * (1 / (group_scale * tensor_scale))
    codes, dequantized = encode_e2m1(e2m1_round(scaled)), e2m1_round(scaled) * group_scale * tensor_scale
    print(f"NVFP4 step by step on the first 16 values of a {x.shape[0]} x {x.shape[1]} N(0, 1) tensor x:\n"
          f"  tensor scale ts = amax(|x|) / (448 * 6) = {x.abs().max():.3f} / 2688 = {tensor_scale:.4g} (FP32)\n"
          f"  group scale gs = E4M3(amax(|group|) / (6 * ts)) = E4M3({unrounded:.2f}) = {group_scale:g} (8 bits)")
    for name, t in (("x", group), ("x / (gs * ts)", scaled), ("nearest E2M1", e2m1_round(scaled)),
                    ("4-bit code", codes.float()), ("E2M1 * gs * ts", dequantized)):
        print(f"  {name:<18}" + "".join(f"{v:6.0f}" if name == "4-bit code" else f"{v:6.2f}" for v in t.tolist()))
    print(f"  its relative error ||x - q(x)||^2 / ||x||^2: {1e3 * relative_error(dequantized, group):.2f} x 1e-3")
    return tensor_scale, group_scale, codes, dequantized


def compare_roundings(x, draws=64, generator=None):
    """Each rounding's error on x, and the error of the mean of `draws` quantizations: a deterministic quantizer's
    error is all bias and does not fall; an unbiased one's falls like 1 / draws. Returns {name: (one, mean)}."""
    errors = {}
    print(f"Relative error x 1e-3 on a {x.shape[0]} x {x.shape[1]} N(0, 1) tensor\n{'once':>29}  mean of {draws}")
    for name, options in (("round to nearest", {}), ("four-over-six", dict(four_over_six=True)),
                          ("stochastic rounding", dict(rounding="sr", fp4_max=SR_FP4_MAX))):
        estimates = [quantize_nvfp4(x, generator=generator, **options).dequantize(torch.float64) for _ in range(draws)]
        errors[name] = one, mean = relative_error(estimates[0], x), relative_error(sum(estimates) / draws, x)
        print(f"  {name:<20}{1e3 * one:7.2f}{1e3 * mean:12.2f} " + ("unbiased: its noise averages out" if mean < one / 2
                                                                    else "deterministic: its error is all bias"))
    return errors


if __name__ == "__main__":
    generator = torch.Generator().manual_seed(0)
    worked_example(torch.randn(16, 64, generator=generator))
    compare_roundings(torch.randn(256, 256, generator=generator), generator=generator)
