"""
Fast versions: Triton kernels that compute exactly what quantize.py and eden.py compute, the operators through which
torch.compile sees them, and the NVFP4 GEMM. Each kernel mirrors a function there: read those two files first.

Why kernels. Hopper has no FP4 tensor cores (Blackwell has): it runs the GEMMs in BF16 on dequantized operands, so there
Quartet II adds only quantization, judged by the bytes it moves (BF16 2 per element, NVFP4 0.5 + 1/16) against the copy
bandwidth: read once, write little, bit tricks instead of branches, rotations on the tensor cores.

Part I, the kernels, bottom-up:
  1. Small floats by bit arithmetic, each named after the quantize.py function it mirrors: rounding to a grid, E4M3,
     E2M1, the bit codecs, the tensor scale, the random draws, packing; then tiles and rotations (eden.rht).
  2. The absolute maximum, amax = max |x| (or max |rht(x)|): the first pass of an RTN/SR quantization.
  3. The RTN/SR quantizer (quantize.quantize_nvfp4), one program per [16, 128] tile:
         tensor_scale = amax / (fp8_max * fp4_max)
         group_scale  = E4M3_round(group_amax * (1 / (fp4_max * tensor_scale)))
         code         = E2M1_round(x * (1 / (group_scale * tensor_scale)))       (SR: plus Philox noise)
  4. MS-EDEN (eden.quantize_ms_eden), two launches. Phase one rotates, rounds and corrects each group of x and x^T,
     and keeps the largest scale_g * S_g; phase two: tensor_scale = that / 256, group_scale = E4M3_SR(scale_g * S_g /
     tensor_scale). The backward's re-quantization of a saved NVFP4 tensor is phase one reading NVFP4.
  5. Dequantization: code * group_scale (* tensor_scale).
Part II, how torch.compile sees the kernels: custom operators and their shape-only fakes.
Part III, the GEMM: native on Blackwell (cuBLAS's NVFP4 GEMM through scaled_mm), emulated in BF16 elsewhere.

Inputs. On a GPU the kernels take BF16, as training under autocast gives them (FP32 is refused with one line): BF16
rotated by +-1 on the tensor cores is exact, and so is code * group_scale in BF16, the emulated GEMM's operand. In
Triton's CPU interpreter (the tests) they take FP32 too and rotate in FP32. `python kernels.py` checks each kernel.

Exactness. A kernel does the reference's floating-point operations in its order, with integer bit arithmetic where a
float instruction would round differently on some backend: codes and scales are bit-identical. Exceptions, bounded by
tests: rotations sum on the tensor cores in their own order, and MS-EDEN's group sums in the compiler's, so a value
next to a rounding boundary can cross it (at most 1 code in 2000; corrected scales within 1e-5); random draws differ.
"""

import math
import os
from functools import partial
from typing import NamedTuple, Optional

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # `python kernels.py` without a GPU: Triton's CPU interpreter

import triton  # noqa: E402 (after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402
from torch import Tensor  # noqa: E402

from eden import (EDEN_FP4_MAX, EDEN_FP8_MAX, HADAMARD, ROTATION_LIMIT, eden_groups, quantize_ms_eden,  # noqa: E402
                  random_signs, rht)
from quantize import (BLOCKS, E2M1_MAX, E4M3_MAX, ERROR_UNITS, GROUP, MIN_NORMAL, MIN_TENSOR_SCALE,  # noqa: E402
                      SR_FP4_MAX, SR_NOISE_BITS, NVFP4Tensor, check_quantizer, decode_e2m1, default_fp8_max,
                      quantize_nvfp4, round_to_grid, unpack_codes)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: how the tests run without GPU
_DOT_DTYPE = tl.constexpr(tl.float32 if INTERPRETED else tl.bfloat16)  # the rotations' operands
_HADAMARD = tl.constexpr(HADAMARD)  # the columns of every tile: one 128-chunk

# =====================================================================================================================
# Part I. The kernels. 1. Small floats by bit arithmetic: float32 = 2^(biased exponent - 127) * 1.mantissa, the
# exponent in bits 23-30, the sign in bit 31. (A kernel reads only globals that are constexpr.)
_FP32_BIAS, _ONE_BITS, _EXPONENT_BITS = tl.constexpr(127), tl.constexpr(127 << 23), tl.constexpr(0xFF << 23)  # 1.0


@triton.jit
def _power_of_two(exponent):
    """float32 2^exponent for an int32 exponent in [-126, 127], built from its bits."""
    return ((exponent + _FP32_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr, noise=None):
    """quantize.round_to_grid of |x| (the caller keeps the sign); stochastic given noise ~ U[0, 1)."""
    magnitude = tl.minimum(tl.abs(x), MAX)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - _FP32_BIAS
    step_exponent = tl.maximum(exponent, MIN_EXPONENT) - MANTISSA
    if noise is None:
        # Adding 2^23 steps leaves no bits below the step, so the FPU rounds to a multiple of it (ties to even).
        magic = _power_of_two(step_exponent + 23)
        rounded = (magnitude + magic) - magic
    else:
        steps = magnitude * _power_of_two(-step_exponent)  # exact: a power of two
        lower = tl.floor(steps)
        rounded = (lower + tl.where(noise < steps - lower, 1.0, 0.0)) * _power_of_two(step_exponent)
    return tl.minimum(rounded, MAX)


@triton.jit
def _e4m3_round(x, noise=None):
    """quantize.e4m3_round of x >= 0 (given noise, e4m3_stochastic_round)."""
    return _round_to_grid(x, 3, -6, 448.0, noise)


@triton.jit
def _e2m1_round(x):
    """quantize.e2m1_round to nearest of |x| < 7 (saturating at 6 is the caller's), and its 3-bit code, exactly. In the
    binade [2^e, 2^(e+1)) (e >= 0; below 1 the step stays 0.5) the step 2^(e-1) is the last place of magic = 2^(e+22):
    |x| + magic rounds to the grid, minus magic is exact, the sum's low bits count the steps k; the code is k + 2e."""
    binade = tl.maximum(x.to(tl.int32, bitcast=True) & _EXPONENT_BITS, _ONE_BITS)  # 2^max(e, 0), whatever x's sign
    magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
    total = tl.abs(x) + magic
    code = (total.to(tl.int32, bitcast=True) & 7) + (binade >> 22) - (_FP32_BIAS << 1)
    return total - magic, code


# The bit codecs. E4M3: 4 exponent bits (bias 7), 3 mantissa bits; below 2^-6 subnormal steps of 2^-9; 0x7F is NaN.
_E4M3_BIAS, _E4M3_NAN = tl.constexpr(7), tl.constexpr(0x7F)
_E4M3_MIN_NORMAL, _E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-6), tl.constexpr(2.0**-9)


@triton.jit
def _e2m1_code(magnitude):
    """quantize.encode_e2m1 of an E2M1 grid magnitude: its 3-bit code."""
    # From 1.0 up, bits >> 22 is (biased exponent, top mantissa bit): 1.0 -> 254 (code 2), 1.5 -> 255 (code 3), ...
    normal = (magnitude.to(tl.int32, bitcast=True) >> 22) - ((_FP32_BIAS << 1) - 2)
    return tl.where(magnitude >= 1.0, normal, (magnitude * 2.0).to(tl.int32))  # 0 -> 0, 0.5 -> 1


@triton.jit
def _e4m3_bits(value):
    """.to(torch.float8_e4m3fn) of a non-negative float32 on the E4M3 grid, as uint8 bits (NaN -> 0x7F)."""
    bits = value.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - (_FP32_BIAS - _E4M3_BIAS)) << 3) | ((bits >> 20) & 7)
    subnormal = (value * (1 / _E4M3_SUBNORMAL_STEP)).to(tl.int32)
    code = tl.where(value >= _E4M3_MIN_NORMAL, normal, subnormal)
    return tl.where(value != value, _E4M3_NAN, code).to(tl.uint8)


@triton.jit
def _e4m3_value(bits):
    """.float() of non-negative E4M3 bits."""
    bits = bits.to(tl.int32)
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    normal = (((exponent + (_FP32_BIAS - _E4M3_BIAS)) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * _E4M3_SUBNORMAL_STEP)
    return tl.where((bits & 0x7F) == _E4M3_NAN, float("nan"), value)


# The tensor scale, from an absolute maximum kept as int32 bits
_MIN_TENSOR_SCALE = tl.constexpr(MIN_TENSOR_SCALE)


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits, ordered as the floats are, NaN > Inf > finite: an atomic integer maximum lets a NaN win."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tensor_scale(amax_bits, limit):
    """quantize.tensor_scale_for: amax / limit; 1 below MIN_TENSOR_SCALE; NaN if amax is not finite."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, limit)
    scale = tl.where(scale < _MIN_TENSOR_SCALE, 1.0, scale)
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _flat_max(x):
    """The largest element of a 2-D tile, in one reduction over all its elements."""
    return tl.max(tl.reshape(x, (x.shape[0] * x.shape[1],), can_reorder=True), axis=0)


# Random draws
_SR_NOISE_STEP = tl.constexpr(2.0**-SR_NOISE_BITS)


@triton.jit
def _sr_noise(seed, first, COUNT: tl.constexpr):
    """quantize.sr_noise of elements first ... first + COUNT - 1 (first % 8 == 0): 8 per Philox call of 4 x 32 bits."""
    a, b, c, d = tl.randint4x(seed, first // 8 + tl.arange(0, COUNT // 8))
    words = tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), (COUNT // 2,))
    k = tl.reshape(tl.join(words & 0xFFFF, words >> 16), (COUNT,))
    return (k.to(tl.float32) + 0.5) * _SR_NOISE_STEP


# Packing: two codes per byte, the even element in the low nibble
@triton.jit
def _pack_codes(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """quantize.pack_codes: [ROWS, COLS] 4-bit codes -> [ROWS, COLS/2] bytes."""
    low, high = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _pack_code_words(groups, ROWS: tl.constexpr):
    """The same bytes as int32 words [ROWS, 16] of codes [ROWS, 8, 16] whose groups each lie in one thread (phase one):
    packed without moving data, stored as words. (The quantizer's layout spreads a group over two threads: bytes.)"""
    nibbles = tl.reshape(groups, (ROWS, 16, 8)) << (4 * tl.arange(0, 8))[None, None, :]
    return tl.sum(nibbles, axis=2)  # disjoint bit fields: the sum is their OR


# Decoding: a code's magnitude bits put in float32 bits 22-24 and its sign in bit 31 read as 2^-126 times its value
# (code 1, 0.5, becomes float32's subnormal 2^-127): two shifts, a mask and a multiplication by 2^126.
_E2M1_DECODE_MASK = tl.constexpr(-0x7E400000)  # 0x81C00000 as int32: bit 31 and bits 22-24
_E2M1_DECODE_SCALE = tl.constexpr(2.0**126)


@triton.jit
def _decode_codes(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """quantize.decode_e2m1(unpack_codes(packed)): [ROWS, COLS/2] bytes -> [ROWS, COLS] float32 (an even element keeps
    its byte's high nibble in bits 4-7, which the mask drops: one mask fewer per byte)."""
    packed = packed.to(tl.int32)
    code = tl.reshape(tl.join(packed, packed >> 4), (ROWS, COLS))
    bits = ((code << 28) | (code << 22)) & _E2M1_DECODE_MASK
    return bits.to(tl.float32, bitcast=True) * _E2M1_DECODE_SCALE


# Tiles
@triton.jit
def _offsets(row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr, PER: tl.constexpr = 1):
    """Offsets of the tile [ROWS, COLS] at (row0, col0) of a [*, width] tensor, one item per PER elements of a row."""
    return (row0 + tl.arange(0, ROWS))[:, None] * (width // PER) + (col0 // PER + tl.arange(0, COLS // PER))[None, :]


@triton.jit
def _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr,
               TRANSPOSE: tl.constexpr):
    """The [ROWS, COLS] tile at (row0, col0) of x, or of x^T read through swapped strides (faster than transposing)."""
    if TRANSPOSE:
        stride_r, stride_c = stride_c, stride_r
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    return tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c)


@triton.jit
def _load_nvfp4(codes_ptr, scales_ptr, row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr,
                TILE16: tl.constexpr):
    """NVFP4Tensor.dequantize(tensor_scale=False) (exact in BF16) of the tile at (row0, col0); TILE16: 16x16 groups."""
    packed = tl.load(codes_ptr + _offsets(row0, col0, width, ROWS, COLS, 2))
    scale_bits = tl.load(scales_ptr + _offsets(row0 // 16 if TILE16 else row0, col0, width,
                                               ROWS // 16 if TILE16 else ROWS, COLS, 16))
    values = tl.reshape(_decode_codes(packed, ROWS, COLS), (ROWS // 16, 16, COLS // 16, 16))
    scales = tl.reshape(_e4m3_value(scale_bits), (ROWS // 16, 1 if TILE16 else 16, COLS // 16, 1))
    return tl.reshape(values * scales, (ROWS, COLS))


# Rotations (eden.rht), which saturate finite inputs beyond ROTATION_LIMIT. The largest |sum| of +-x over a chunk is
# at least the chunk's largest |x| (the sums' squares add up to N times the inputs'), so sums within 2^119 (half the
# limit: a margin for rounding) mean no input needed saturating: the kernels rotate, and saturate only if that fails.
_ROTATION_LIMIT, _SATURATION_TEST = tl.constexpr(ROTATION_LIMIT), tl.constexpr(ROTATION_LIMIT / 2)


@triton.jit
def _rotation_matrix(signs_ptr, N: tl.constexpr, columns=None):
    """diag(s) H [N, N] in registers (eden.sylvester_matrix: H[i, j] = (-1)^popcount(i & j)), columns in this order."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :] if columns is None else columns[None, :]
    bits = i & j
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)  # bit 0 is now the parity of the 7 bits of i & j
    signs = tl.where(tl.load(signs_ptr + tl.arange(0, N)) < 0, -1.0, 1.0)[:, None]
    return (1 - 2 * (bits & 1)).to(tl.float32) * signs


@triton.jit
def _saturate(tile):
    """Finite values beyond +-ROTATION_LIMIT saturate there (as eden.rht); Inf and NaN stay."""
    saturated = tl.minimum(tl.maximum(tile, -_ROTATION_LIMIT), _ROTATION_LIMIT)
    return tl.where((tl.abs(tile) == float("inf")) | (tile != tile), tile, saturated).to(tile.dtype)


@triton.jit
def _rotate(tile, rotation, N: tl.constexpr, NORMALIZE: tl.constexpr = True):
    """eden.rht of tile [rows, 128]: its N-chunks times the matrix on the tensor cores, then times 1/sqrt(N)."""
    ROWS: tl.constexpr = tile.shape[0]
    chunks = tl.reshape(tile, (ROWS * _HADAMARD // N, N))
    rotated = tl.reshape(tl.dot(chunks.to(_DOT_DTYPE), rotation.to(_DOT_DTYPE)), (ROWS, _HADAMARD))
    return rotated * (N**-0.5) if NORMALIZE else rotated


# ---------------------------------------------------------------------------------------------------------------------
# 2. The absolute maximum, as int32 bits
@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    """amax_ptr (int32 [1], zeroed) <- bits of max |x| over a contiguous x. Reads 2 B/element."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(_abs_bits(x), axis=0))


@triton.jit
def _rotated_amax_kernel(x_ptr, stride_r, stride_c, signs_ptr, amax_ptr,  # in: x, its strides, float32 [N] signs
                         ROWS: tl.constexpr, N: tl.constexpr, TRANSPOSE: tl.constexpr):
    """amax_ptr (int32 [1], zeroed) <- bits of max |rht(x or x^T)|, one [ROWS, 128] tile per program."""
    tile = _load_tile(x_ptr, stride_r, stride_c, tl.program_id(0) * ROWS, tl.program_id(1) * _HADAMARD, ROWS,
                      _HADAMARD, TRANSPOSE)
    rotation = _rotation_matrix(signs_ptr, N)
    amax = _flat_max(_abs_bits(_rotate(tile, rotation, N)))
    if not (amax.to(tl.float32, bitcast=True) <= _SATURATION_TEST * (N**-0.5)):  # the test, normalized (NaN fails)
        amax = _flat_max(_abs_bits(_rotate(_saturate(tile), rotation, N)))
    tl.atomic_max(amax_ptr, amax)


# Launching. Each public launcher checks its inputs once, one line per problem: a kernel reads memory as they say.
KERNEL_DTYPES = (torch.bfloat16, torch.float32) if INTERPRETED else (torch.bfloat16,)
ROTATIONS = (16, 32, 128)  # the quantizer's rotation widths: NVIDIA's 16, TetraJet-v2's 32, MS-EDEN's 128


def check_input(t, multiple, what, transpose=False, blocks=None):
    """A one-line ValueError unless t, a tensor or (given blocks) an NVFP4Tensor, is something a kernel can read."""
    if blocks is None and not (isinstance(t, torch.Tensor) and t.dtype in KERNEL_DTYPES):
        raise ValueError(f"{what} takes bfloat16 on a GPU (train under autocast)"
                         f"{', or float32 interpreted' * INTERPRETED}; got {getattr(t, 'dtype', type(t))}")
    if blocks is not None and not (isinstance(t, NVFP4Tensor) and t.block in blocks):
        raise ValueError(f"{what} needs an NVFP4Tensor in {'/'.join(blocks)} groups, got "
                         f"{getattr(t, 'block', type(t).__name__)}")
    shape = t.shape[::-1] if transpose else t.shape
    if len(shape) != 2 or 0 in shape or shape[0] % multiple[0] or shape[1] % multiple[1]:
        raise ValueError(f"{what} needs a non-empty 2-D tensor whose {'transpose ' if transpose else ''}shape is a "
                         f"multiple of [{multiple[0]}, {multiple[1]}], got shape {tuple(t.shape)}")
    if blocks is not None and not (t.codes.is_contiguous() and t.group_scale.is_contiguous()):
        raise ValueError(f"{what} needs contiguous codes and group scales (call .contiguous() on them)")
    device = (t if blocks is None else t.codes).device
    if not (device.type == "cuda" or device.type == "cpu" and INTERPRETED):
        raise ValueError(f"{what} runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got {device}")


def check_rotation(signs, widths, device, what):
    """A ValueError unless signs is a 1-D float tensor on device whose length is one of widths."""
    if not (isinstance(signs, torch.Tensor) and signs.dim() == 1 and signs.numel() in widths
            and signs.is_floating_point() and signs.device == device):  # only their sign bits are read
        raise ValueError(f"{what} needs 1-D float signs of length {' or '.join(map(str, widths))} on {device}, got "
                         f"{getattr(signs, 'dtype', signs)} {tuple(getattr(signs, 'shape', ()))}")


def draw_seed(device, seed=None, what="the kernel"):
    """The Philox seed: seed, checked, or one drawn on the device from torch's generator (no host sync, a fresh one
    on every replay of a captured CUDA graph, reproducible after torch.manual_seed)."""
    if seed is None:
        return torch.randint(2**31 - 1, (1,), device=device)
    if not (isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.numel() == 1
            and seed.device == device):
        raise ValueError(f"{what} needs its seed as one int64 on {device}, got {seed!r}")
    return seed


def _ceil_div(a, b):  # ceil(a / b) for positive integers (triton.cdiv is slower on the host)
    return -(-a // b)


def _empty_nvfp4(rows, cols, block, device, gemm_operand, codes=None):
    """An NVFP4Tensor [rows, cols] for a kernel to fill, codes given or not, with a BF16 gemm operand if asked."""
    empty = partial(torch.empty, device=device)
    return NVFP4Tensor(empty(rows, cols // 2, dtype=torch.uint8) if codes is None else codes,
                       empty(rows // (GROUP if block == "16x16" else 1), cols // GROUP, dtype=torch.float8_e4m3fn),
                       empty((), dtype=torch.float32), torch.Size((rows, cols)), block,
                       empty(rows, cols, dtype=torch.bfloat16) if gemm_operand else None)


AMAX_BLOCK, ROTATED_AMAX_ROWS = 4096, 32  # per program (the rotated one: 16 rows where the rows are not 32s)


def amax(x, transpose=False, signs=None):
    """max |x| (or |rht(x or x^T, signs)|) as int32 bits [1], without a host sync: triton_quantize's first pass."""
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    if signs is None:  # without rotation, x^T has the maximum of x
        x = x.contiguous()
        _amax_kernel[(_ceil_div(x.numel(), AMAX_BLOCK),)](x, bits, x.numel(), BLOCK=AMAX_BLOCK)
        return bits
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    block = ROTATED_AMAX_ROWS if rows % ROTATED_AMAX_ROWS == 0 else 16
    _rotated_amax_kernel[(rows // block, cols // HADAMARD)](x, *x.stride(), signs, bits, ROWS=block, N=signs.numel(),
                                                            TRANSPOSE=transpose)
    return bits


# ---------------------------------------------------------------------------------------------------------------------
# 3. The RTN/SR quantizer (quantize.quantize_nvfp4): 1x16 or 16x16 groups, optional four-over-six, transpose and
# rotation. One program per [16, 128] tile, after the amax pass:
#
#     tile         = x[rows, cols], in float32 (x^T: read through swapped strides)              read 2 B/element
#     tile         = rht(tile, signs)      if rotated: N = 16, 32 or 128, an N x N matrix of +-1 on the tensor cores
#     tensor_scale = amax / (fp8_max * fp4_max)
#     group_scale  = E4M3_round(group_amax * (1 / (fp4_max * tensor_scale)))         per 1x16 group, or 16x16 tile
#     code         = E2M1_round(tile * (1 / (group_scale * tensor_scale)))          (SR: with 16-bit Philox noise)
#     four-over-six: the same with fp4_max * 4/6; keep the branch with the smaller integer squared error
#     store the packed codes and E4M3 scales (0.5625 B), for the emulated GEMM code * group_scale in BF16 (2 B)
_ERROR_UNITS = tl.constexpr(ERROR_UNITS)


@triton.jit
def _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, TILE16: tl.constexpr):
    """quantize._quantize_groups of groups [ROWS/16, 16, 8, 16]: E2M1 magnitudes and codes, E4M3 scales [.., 1], and
    four-over-six's error in FP64, exact (its units are integers: their sum is the same in any order)."""
    scale = _e4m3_round(group_amax * tl.math.div_rn(1.0, fp4_max * tensor_scale))  # one division per program
    scale = tl.where(scale == 0, 1.0, scale)
    scaled = groups * tl.math.div_rn(1.0, scale * tensor_scale)
    if noise is None:
        magnitude, code = _e2m1_round(tl.minimum(tl.abs(scaled), 6.0))
    else:
        magnitude = _round_to_grid(scaled, 1, 0, 6.0, noise)
        code = _e2m1_code(magnitude)
    units = ((tl.abs(scaled) - magnitude) * _ERROR_UNITS).to(tl.int32)  # truncated toward zero
    error = tl.sum(units * units, axis=3, keep_dims=True)
    if TILE16:
        error = tl.sum(error, axis=1, keep_dims=True)
    return magnitude, code, scale, error.to(tl.float64) * (scale * scale).to(tl.float64)


@triton.jit
def _quantize_kernel(x_ptr, stride_r, stride_c, signs_ptr, amax_ptr, seed_ptr,  # x, its float32 signs, amax bits
                     codes_ptr, scales_ptr, operand_ptr, tensor_scale_ptr,  # out (operand_ptr None: not written)
                     C, fp4_max, fp8_max, ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, ROTATION: tl.constexpr,
                     STOCHASTIC: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, TILE16: tl.constexpr):
    """RTN or SR quantization of a [ROWS, 128] tile per program of x [*, C], x^T, or their rotation (ROTATION > 0)."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _HADAMARD
    amax_bits = tl.load(amax_ptr)  # of what is quantized: for the tensor scale, and the saturation test below
    tile = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, _HADAMARD, TRANSPOSE).to(tl.float32)
    if ROTATION > 0:
        # The amax pass's largest rotated value fails the test if it did (and saturated): no reduction over the tile
        if not (amax_bits.to(tl.float32, bitcast=True) <= _SATURATION_TEST * (ROTATION**-0.5)):
            tile = _saturate(tile)
        tile = _rotate(tile, _rotation_matrix(signs_ptr, ROTATION), ROTATION)
    groups = tl.reshape(tile, (ROWS // 16, 16, 8, 16))  # [16-row blocks, row in block, group, element]
    group_amax = tl.max(tl.abs(groups), axis=3, keep_dims=True)
    if TILE16:
        group_amax = tl.max(group_amax, axis=1, keep_dims=True)
    tensor_scale = _tensor_scale(amax_bits, fp8_max * fp4_max)
    noise, noise4 = None, None  # round to nearest
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
        first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * (ROWS * _HADAMARD)  # this tile's draws
        noise = tl.reshape(_sr_noise(seed, first, ROWS * _HADAMARD), (ROWS // 16, 16, 8, 16))
        if FOUR_OVER_SIX:  # the second branch draws from counters past the whole tensor's
            numel = tl.num_programs(0) * tl.num_programs(1) * (ROWS * _HADAMARD)
            noise4 = tl.reshape(_sr_noise(seed, numel + first, ROWS * _HADAMARD), (ROWS // 16, 16, 8, 16))
    magnitude, code, scale, error = _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, TILE16)
    if FOUR_OVER_SIX:
        magnitude4, _, scale4, error4 = _quantize_branch(groups, group_amax, fp4_max * 4 / 6, tensor_scale, noise4,
                                                         TILE16)
        magnitude = tl.where(error4 < error, magnitude4, magnitude)  # a tie keeps the 6-branch
        scale = tl.where(error4 < error, scale4, scale)
        code = _e2m1_code(magnitude)  # of the chosen magnitude: fewer live registers than choosing between codes
    codes = tl.reshape(code | ((groups.to(tl.int32, bitcast=True) >> 28) & 8), (ROWS, _HADAMARD))  # sign: bit 31 -> 3
    tl.store(codes_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD, 2), _pack_codes(codes, ROWS, _HADAMARD))
    SCALE_ROWS: tl.constexpr = ROWS // 16 if TILE16 else ROWS  # one scale per 16x16 tile, or per 1x16 group
    tl.store(scales_ptr + _offsets(row0 // 16 if TILE16 else row0, col0, C, SCALE_ROWS, _HADAMARD, 16),
             _e4m3_bits(tl.reshape(scale, (SCALE_ROWS, 8))))
    if operand_ptr is not None:
        value = tl.where(groups.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude) * scale  # sign of x, -0 too
        tl.store(operand_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD),
                 tl.reshape(value, (ROWS, _HADAMARD)).to(tl.bfloat16))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(tensor_scale_ptr, tensor_scale)


QUANTIZE_ROWS, QUANTIZE_WARPS = 16, 4  # per program (larger tiles, or fewer warps, measured slower)


def triton_quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False,
                    signs=None, seed=None, gemm_operand=True):
    """quantize_nvfp4 of x [R, C] (or x^T, rotated by signs if given), R % 16 == C % 128 == 0: an NVFP4Tensor, with
    its BF16 gemm operand if asked."""
    check_input(x, (QUANTIZE_ROWS, HADAMARD), "triton_quantize", transpose)
    fp8_max = default_fp8_max(four_over_six)
    check_quantizer(rounding, block, fp4_max, fp8_max, four_over_six)
    if signs is not None:
        check_rotation(signs, ROTATIONS, x.device, "triton_quantize")
        signs = signs.float()
    seed = draw_seed(x.device, seed, "triton_quantize") if rounding == "sr" else None
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    q = _empty_nvfp4(rows, cols, block, x.device, gemm_operand)
    _quantize_kernel[(rows // QUANTIZE_ROWS, cols // HADAMARD)](
        x, *x.stride(), signs, amax(x, transpose, signs), seed, q.codes, q.group_scale.view(torch.uint8),
        q.gemm_operand, q.tensor_scale, cols, fp4_max, fp8_max, ROWS=QUANTIZE_ROWS, TRANSPOSE=transpose,
        ROTATION=0 if signs is None else signs.numel(), STOCHASTIC=rounding == "sr", FOUR_OVER_SIX=four_over_six,
        TILE16=block == "16x16", num_warps=QUANTIZE_WARPS)
    return q


# ---------------------------------------------------------------------------------------------------------------------
# 4. MS-EDEN (eden.quantize_ms_eden), step by step as eden.py computes it, along rows of 128-chunks:
#
#        y            = rht(x, s)
#        scale_g      = amax(|y_g|) / fp4_max                  (0 if below 2^-126: the group becomes zeros)
#        u_g          = y_g * (fp4_max / amax(|y_g|))           (|u_g| <= fp4_max ~= 6.07)
#        codes_g      = E2M1_round(u_g)
#        S_g          = <u_g, u_g> / <u_g, codes_g>             (1 if all zero)
#        tensor_scale = max_g(scale_g * S_g) / fp8_max          (post hoc range alignment)
#        group_scale  = E4M3_stochastic_round(scale_g * S_g / tensor_scale)
#
# Phase one: the first five lines and the maximum, for x and x^T from one read of x, rotating without the 1/sqrt(128)
# (folded into the group scale: one multiplication per group, not per element). Phase two: the last two lines.
_EDEN_FP4_MAX, _EDEN_FP8_MAX, _MIN_NORMAL = (tl.constexpr(v) for v in (EDEN_FP4_MAX, EDEN_FP8_MAX, MIN_NORMAL))
_EDEN_SCALE_PER_SUM = tl.constexpr(1 / (EDEN_FP4_MAX * math.sqrt(HADAMARD)))  # group scale per unnormalized sum


# Performance only: any column order gives the same numbers. In the register layout of Hopper's MMA the 4 lanes of a
# quad take turns holding 2 adjacent columns of the result, so in the natural order a 16-group is spread over 4
# threads (its sums need shuffles, its divisions run 4 times). With the rotation's columns permuted, accumulator
# column 64w + 8j + 2q + p (p within a lane's pair, q the lane in its quad, j the pair, w the half) holds output
# column 16(4w + q) + 2j + p (the kernel's columns: bits (w, j, q, p) as (w, q, j, p)): each group lies in one thread,
# and _group_maxima's reshape renames registers without moving data.
@triton.jit
def _group_maxima(sums, ROWS: tl.constexpr):
    """The 16-groups [ROWS, 8, 16] of sums [ROWS, 128] rotated as above, and their largest |sum| [.., 1] (NaN wins)."""
    groups = tl.reshape(tl.permute(tl.reshape(sums, (ROWS, 2, 8, 4, 2)), (0, 1, 3, 2, 4)), (ROWS, 8, 16))
    return groups, tl.reduce(tl.abs(groups), 2, _nan_max, keep_dims=True)


@triton.jit
def _eden_groups(groups, largest, tensor_scale, ROWS: tl.constexpr):
    """eden.eden_groups, phase one's math, on groups [ROWS, 8, 16] of rotation sums (sqrt(128) * rht) and their largest
    |sum|: the signed 4-bit codes and the corrected scales scale_g * S_g [ROWS, 8] (times an NVFP4 input's scale)."""
    scale = largest * _EDEN_SCALE_PER_SUM
    flushed = scale < _MIN_NORMAL  # a group this small becomes zeros
    scale = tl.where(flushed, 0.0, scale)
    scaled = groups * tl.where(flushed, 1.0, tl.math.div_rn(_EDEN_FP4_MAX, largest))  # u_g
    magnitude, code = _e2m1_round(scaled)  # |scaled| below 7: no saturation needed
    norm = tl.sum(scaled * scaled, axis=2, keep_dims=True)
    overlap = tl.sum(tl.abs(scaled) * magnitude, axis=2, keep_dims=True)  # = <scaled, its rounding>: same signs
    corrected = tl.reshape(scale * tl.where(overlap > 0, tl.math.div_rn(norm, overlap), 1.0), (ROWS, 8))
    corrected = corrected * tensor_scale  # the NVFP4 input's tensor scale, or 1
    return code | ((scaled.to(tl.int32, bitcast=True) >> 28) & 8), corrected  # the sign: bit 31 moved to bit 3


@triton.jit
def _eden_job_input(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, C, row0, col0,
                    JOB_ROWS: tl.constexpr, TRANSPOSED: tl.constexpr, SATURATE: tl.constexpr):
    """A job's input [JOB_ROWS, 128] at (row0, col0) of x or of the NVFP4 input (TRANSPOSED: of their transposes)."""
    ROWS: tl.constexpr = _HADAMARD if TRANSPOSED else JOB_ROWS
    COLS: tl.constexpr = JOB_ROWS if TRANSPOSED else _HADAMARD
    if x_ptr is not None:
        values = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, COLS, False)
        if SATURATE:
            values = _saturate(values)
    else:
        values = _load_nvfp4(nvfp4_codes_ptr, nvfp4_scales_ptr, row0, col0, C, ROWS, COLS, False)
    return tl.trans(values) if TRANSPOSED else values


@triton.jit
def _eden_jobs(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, rotation, tensor_scale, codes_ptr,
               corrected_ptr, R, C, first, step, job0, TILES: tl.constexpr, JOB_ROWS: tl.constexpr,
               TRANSPOSED: tl.constexpr):
    """The scheduling of phase one: a program's job (rows job0 ... of a tile, or TRANSPOSED those columns) in tiles
    first, first + step, ...: stored, and the largest corrected scale's bits."""
    largest_bits = tl.zeros((JOB_ROWS, 8), dtype=tl.int32)  # reduced across threads once, at the end
    tile_cols = C // _HADAMARD
    last = (R // _HADAMARD) * tile_cols - 1
    for i in tl.range(TILES, num_stages=1):  # one stage: the multiprocessor's other programs hide the loads
        tile = tl.minimum(first + i * step, last)  # past the end: the last tile again (the same values)
        row0 = (tile // tile_cols) * _HADAMARD
        col0 = (tile % tile_cols) * _HADAMARD
        if TRANSPOSED:  # columns col0 + job0 ... of x: rows of the output [C, R]
            in_row, in_col, out_row, out_col, width = row0, col0 + job0, col0 + job0, row0, R
        else:
            in_row, in_col, out_row, out_col, width = row0 + job0, col0, row0 + job0, col0, C
        values = _eden_job_input(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, C, in_row, in_col,
                                 JOB_ROWS, TRANSPOSED, False)
        groups, largest = _group_maxima(_rotate(values, rotation, _HADAMARD, False), JOB_ROWS)
        # Saturation almost never changes anything: tested after the rotation, on the largest sums, it lets the input
        # go to the tensor cores as loaded. An NVFP4 input (at most 6 * 448 * tensor scale) never needs it.
        if x_ptr is not None:
            if not (tl.reduce(largest, None, _nan_max) <= _SATURATION_TEST):
                values = _eden_job_input(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, C, in_row,
                                         in_col, JOB_ROWS, TRANSPOSED, True)
                groups, largest = _group_maxima(_rotate(values, rotation, _HADAMARD, False), JOB_ROWS)
        codes, corrected = _eden_groups(groups, largest, tensor_scale, JOB_ROWS)
        words_ptr = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # the packed codes as int32, 8 codes each
        words = _pack_code_words(codes, JOB_ROWS)
        tl.store(words_ptr + _offsets(out_row, out_col, width, JOB_ROWS, _HADAMARD, 8), words)
        tl.store(corrected_ptr + _offsets(out_row, out_col, width, JOB_ROWS, _HADAMARD, 16), corrected)
        largest_bits = tl.maximum(largest_bits, _abs_bits(corrected))
    if x_ptr is None:  # the job's maximum in one step, or in two (rows, then theirs): each input's better build
        return _flat_max(largest_bits)
    return tl.max(tl.max(largest_bits, axis=1), axis=0)


@triton.jit
def _eden_phase1_kernel(
        x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, nvfp4_tensor_scale_ptr, signs_ptr,  # input
        row_codes_ptr, row_corrected_ptr, row_amax_ptr,  # out [R, C] rotated along C (row_codes_ptr None: not made)
        col_codes_ptr, col_corrected_ptr, col_amax_ptr,  # out [C, R]: x^T rotated along R
        R, C, TILES_PER_PROGRAM: tl.constexpr, JOB_ROWS: tl.constexpr):
    """MS-EDEN phase one of x [R, C] (or, x_ptr None, of a 1x16 NVFP4 tensor: the backward's re-quantization of a saved
    X or W) rotated along its rows and/or of its transpose: packed codes, FP32 corrected scales and (atomically) their
    maximum. Reads 2 B/element (NVFP4: 0.5625), writes 0.75 per output. A 128 x 128 tile makes 128/JOB_ROWS row jobs
    and as many column jobs. Program p builds the rotation once, then does job p % jobs_per_tile of every (programs /
    jobs_per_tile)-th tile from p // jobs_per_tile: a tile's jobs run at once on neighbouring programs, and the tile is
    read from memory once (then from the L2 cache)."""
    j = tl.arange(0, _HADAMARD)  # performance only: the grouped column order (above _group_maxima)
    rotation = _rotation_matrix(signs_ptr, _HADAMARD, (j & 64) | ((j & 6) << 3) | ((j >> 2) & 14) | (j & 1))
    rotation = rotation.to(_DOT_DTYPE)  # converted once
    tensor_scale = 1.0 if x_ptr is not None else tl.load(nvfp4_tensor_scale_ptr)
    slices: tl.constexpr = _HADAMARD // JOB_ROWS  # row jobs (and column jobs) per tile
    jobs_per_tile: tl.constexpr = slices if row_codes_ptr is None else 2 * slices
    job = tl.program_id(0) % jobs_per_tile  # this program's job in each of its tiles: row jobs first
    first = tl.program_id(0) // jobs_per_tile
    step = tl.num_programs(0) // jobs_per_tile
    job0 = (job % slices) * JOB_ROWS
    if row_codes_ptr is not None and job < slices:
        tl.atomic_max(row_amax_ptr, _eden_jobs(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, rotation,
                                               tensor_scale, row_codes_ptr, row_corrected_ptr, R, C, first, step, job0,
                                               TILES_PER_PROGRAM, JOB_ROWS, False))
    else:
        tl.atomic_max(col_amax_ptr, _eden_jobs(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, rotation,
                                               tensor_scale, col_codes_ptr, col_corrected_ptr, R, C, first, step, job0,
                                               TILES_PER_PROGRAM, JOB_ROWS, True))


# Phase one's output: packed codes (uint8), corrected scales scale_g * S_g (float32), the bits of their maximum
Phase1 = NamedTuple("Phase1", [("codes", Tensor), ("corrected", Tensor), ("amax", Tensor)])
# Phase one's launch, by shared memory per multiprocessor. A program holds the rotation and its input (48 KB): four in
# 228 KB (Hopper, B200) hide each other's loads; two in ~100 KB (sm_120), where 32-row jobs keep from spilling.
EdenLaunch = NamedTuple("EdenLaunch", [("job_rows", int), ("warps", int), ("programs_per_multiprocessor", int)])
EDEN_LAUNCH = {"large": EdenLaunch(64, 4, 4), "small": EdenLaunch(32, 4, 2)}
SMALL_SHARED_MEMORY = 160 * 1024  # below this per multiprocessor, a GPU takes the "small" launch


def _gpu(device):
    """(multiprocessors, shared memory per multiprocessor); interpreted: 5 (to run phase one's loop) of a large GPU."""
    if device.type != "cuda":
        return 5, 228 * 1024
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_multiprocessor


def _persistent_grid(rows, cols, jobs_per_tile, programs_per_multiprocessor, multiprocessors):
    """(programs, tiles per program): as many programs as the multiprocessors hold, a multiple of jobs_per_tile."""
    tiles = rows * cols // HADAMARD**2
    per_job = min(tiles, max(1, programs_per_multiprocessor * multiprocessors // jobs_per_tile))
    return per_job * jobs_per_tile, _ceil_div(tiles, per_job)


def _eden_phase1(source, signs, rows, cols, device, both):
    """Phase one over [rows, cols] (source: the kernel's first six arguments): Phase1s of x and x^T, or of x^T."""
    def outputs(out_rows, out_cols):
        return Phase1(torch.empty(out_rows, out_cols // 2, dtype=torch.uint8, device=device),
                      torch.empty(out_rows, out_cols // GROUP, dtype=torch.float32, device=device),
                      torch.zeros(1, dtype=torch.int32, device=device))
    row_out, col_out = outputs(rows, cols) if both else Phase1(None, None, None), outputs(cols, rows)
    multiprocessors, shared = _gpu(device)
    job_rows, warps, per_multiprocessor = EDEN_LAUNCH["small" if shared < SMALL_SHARED_MEMORY else "large"]
    programs, per_program = _persistent_grid(rows, cols, (2 if both else 1) * HADAMARD // job_rows, per_multiprocessor,
                                             multiprocessors)
    registers = min(255, 65536 // (per_multiprocessor * warps * 32))  # each thread's share of 64K per multiprocessor
    _eden_phase1_kernel[(programs,)](*source, signs.float(), *row_out, *col_out, rows, cols, JOB_ROWS=job_rows,
                                     TILES_PER_PROGRAM=per_program, num_warps=warps, maxnreg=registers)
    return (row_out, col_out) if both else col_out


def eden_phase1(x, signs):
    """Phase one of x [R, C] rotated along C and of x^T [C, R] rotated along R, from one read of x: two Phase1."""
    check_input(x, (HADAMARD, HADAMARD), "MS-EDEN")
    check_rotation(signs, (HADAMARD,), x.device, "MS-EDEN")
    return _eden_phase1((x, *x.stride(), None, None, None), signs, *x.shape, x.device, both=True)


@triton.jit
def _eden_phase2_kernel(seed_ptr, corrected_ptr, amax_ptr, codes_ptr,  # in: a seed, a Phase1
                        scales_ptr, operand_ptr, tensor_scale_ptr,  # out: E4M3 bits, gemm operand (None: not made)
                        n_groups, seed_offset, GROUPS: tl.constexpr):
    """MS-EDEN phase two of GROUPS 16-groups per program (its draws: Philox of seed + seed_offset). Per element, reads
    the codes and the corrected scale (0.75 B), writes the E4M3 scale and the gemm operand (2.06 B)."""
    group = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    valid = group < n_groups
    tensor_scale = _tensor_scale(tl.load(amax_ptr), _EDEN_FP8_MAX)
    target = tl.math.div_rn(tl.load(corrected_ptr + group, mask=valid, other=0.0), tensor_scale)
    scale = _e4m3_round(target, tl.rand(tl.load(seed_ptr) + seed_offset, group))
    tl.store(scales_ptr + group, _e4m3_bits(scale), mask=valid)
    if operand_ptr is not None:
        packed = tl.load(codes_ptr + group[:, None] * 8 + tl.arange(0, 8)[None, :], mask=valid[:, None], other=0)
        value = _decode_codes(packed, GROUPS, 16) * scale[:, None]
        element = group[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(operand_ptr + element, value.to(tl.bfloat16), mask=valid[:, None])
    if tl.program_id(0) == 0:
        tl.store(tensor_scale_ptr, tensor_scale)


PHASE2_GROUPS = 256  # 16-groups per program


def eden_phase2(phase1, seed=None, gemm_operand=True, seed_offset=0):
    """Phase two of a Phase1: its NVFP4Tensor (E and E^T of one seed draw from seed + 0 and + 1: other streams)."""
    codes, corrected, amax_bits = phase1
    seed = draw_seed(codes.device, seed, "MS-EDEN")
    q = _empty_nvfp4(codes.shape[0], codes.shape[1] * 2, "1x16", codes.device, gemm_operand, codes)
    _eden_phase2_kernel[(_ceil_div(corrected.numel(), PHASE2_GROUPS),)](
        seed, corrected, amax_bits, codes, q.group_scale.view(torch.uint8), q.gemm_operand, q.tensor_scale,
        corrected.numel(), seed_offset, GROUPS=PHASE2_GROUPS)
    return q


def triton_ms_eden_pair(x, signs, seed=None, gemm_operand=True):
    """MS-EDEN of x [R, C] rotated along C and of x^T [C, R] rotated along R, from one read of x."""
    rows, cols = eden_phase1(x, signs)
    seed = draw_seed(x.device, seed, "MS-EDEN")
    return eden_phase2(rows, seed, gemm_operand), eden_phase2(cols, seed, gemm_operand, seed_offset=1)


def eden_phase1_requantize(q, signs):
    """Phase one of q.dequantize()^T rotated along R, q a 1x16 NVFP4 tensor [R, C], in one pass over q."""
    check_input(q, (HADAMARD, HADAMARD), "requantize_ms_eden", blocks=("1x16",))
    check_rotation(signs, (HADAMARD,), q.codes.device, "requantize_ms_eden")
    source = (None, 0, 0, q.codes, q.group_scale.view(torch.uint8), q.tensor_scale)  # no x: the NVFP4 tensor
    return _eden_phase1(source, signs, *q.shape, q.codes.device, both=False)


def triton_requantize_ms_eden(q, signs, seed=None, gemm_operand=True):
    """MS-EDEN of q.dequantize()^T for a 1x16 NVFP4 tensor q [R, C]: the backward's re-quantization of X and W."""
    return eden_phase2(eden_phase1_requantize(q, signs), seed, gemm_operand)


# ---------------------------------------------------------------------------------------------------------------------
# 5. Dequantization
@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, tensor_scale_ptr, out_ptr, C, ROWS: tl.constexpr,
                       TILE16: tl.constexpr, TENSOR_SCALE: tl.constexpr):
    """out [R, C] <- code * group_scale (* tensor_scale), one [ROWS, 128] tile per program."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _HADAMARD
    values = _load_nvfp4(codes_ptr, scales_ptr, row0, col0, C, ROWS, _HADAMARD, TILE16)
    if TENSOR_SCALE:
        values = values * tl.load(tensor_scale_ptr)
    tl.store(out_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD), values.to(out_ptr.dtype.element_ty))


DEQUANTIZE_ROWS, OUT_DTYPES = 16, (torch.bfloat16, torch.float16, torch.float32)


def triton_dequantize(q, dtype=torch.float32, tensor_scale=True):
    """q.dequantize(dtype, tensor_scale) for a 2-D NVFP4Tensor whose shape is a multiple of [16, 128]."""
    check_input(q, (DEQUANTIZE_ROWS, HADAMARD), "triton_dequantize", blocks=BLOCKS)
    if dtype not in OUT_DTYPES:
        raise ValueError(f"triton_dequantize writes bfloat16, float16 or float32, not {dtype}")
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.codes.device)
    _dequantize_kernel[(rows // DEQUANTIZE_ROWS, cols // HADAMARD)](
        q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, out, cols, ROWS=DEQUANTIZE_ROWS,
        TILE16=q.block == "16x16", TENSOR_SCALE=tensor_scale)
    return out


# =====================================================================================================================
# Part II. How torch.compile sees the kernels: custom operators of plain tensors (an NVFP4Tensor's codes, scale bits,
# tensor scale and gemm operand, empty for the native GEMM), the kernels on CUDA, the references elsewhere, a shape-only
# fake each. Randomness comes in as tensors drawn on the device (signs, a Philox seed): a captured CUDA graph draws
# afresh on every replay, and torch.manual_seed makes a run reproducible. model.py calls the wrappers at the end.
Quantized = tuple[Tensor, Tensor, Tensor, Tensor]
QuantizedPair = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _on_gpu(t):  # whether the operators run the Triton kernels on t (CUDA) or the references (any other device)
    return t.is_cuda


def _flatten(q, gemm_operand=False):
    """An NVFP4Tensor as an operator's outputs; its gemm operand made (for a reference's) if asked, else empty."""
    operand = q.gemm_operand
    if operand is None:
        operand = q.dequantize(torch.bfloat16, tensor_scale=False) if gemm_operand else q.codes.new_empty(0)
    return q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, operand.bfloat16()


def _unflatten(tensors, block):
    """The NVFP4Tensor of an operator's outputs (or inputs, with an empty gemm operand)."""
    codes, scale_bits, tensor_scale, operand = tensors
    return NVFP4Tensor(codes, scale_bits.view(torch.float8_e4m3fn), tensor_scale,
                       torch.Size((codes.shape[0], codes.shape[1] * 2)), block, operand if operand.numel() else None)


@torch.library.custom_op("nanoquartet::random_signs", mutates_args=())
def draw_signs(e: Tensor, n: int = HADAMARD) -> Tensor:
    """n random +-1.0: the rotation of a backward whose gradient is e. An operator of e, so that torch.compile keeps it
    in the backward graph (its partitioner may make a draw that depends on nothing twice: once in the forward)."""
    return random_signs(n, device=e.device)


@draw_signs.register_fake
def _(e, n=HADAMARD):
    return e.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("nanoquartet::quantize", mutates_args=())
def _quantize_op(x: Tensor, signs: Optional[Tensor], seed: Optional[Tensor], rounding: str, four_over_six: bool,
                 block: str, fp4_max: float, transpose: bool, gemm_operand: bool) -> Quantized:
    if _on_gpu(x):
        return _flatten(triton_quantize(x, rounding, four_over_six, block, fp4_max, transpose, signs, seed,
                                        gemm_operand))
    x = x.t() if transpose else x
    x = rht(x, signs) if signs is not None else x
    generator = None if seed is None else torch.Generator().manual_seed(int(seed.item()))  # the reference's draws
    return _flatten(quantize_nvfp4(x, rounding, four_over_six, block, fp4_max, generator=generator), gemm_operand)


@_quantize_op.register_fake
def _(x, signs, seed, rounding, four_over_six, block, fp4_max, transpose, gemm_operand):
    return _flatten(_empty_nvfp4(*(x.shape[::-1] if transpose else x.shape), block, x.device, gemm_operand))


@torch.library.custom_op("nanoquartet::ms_eden_pair", mutates_args=())
def _ms_eden_pair_op(x: Tensor, signs: Tensor, seed: Tensor, gemm_operand: bool) -> QuantizedPair:
    if _on_gpu(x):
        rows, cols = triton_ms_eden_pair(x, signs, seed, gemm_operand)
        return _flatten(rows) + _flatten(cols)
    generator = torch.Generator().manual_seed(int(seed.item()))
    return _flatten(quantize_ms_eden(x, signs, generator), gemm_operand) + _flatten(quantize_ms_eden(
        x.t(), signs, generator), gemm_operand)


@_ms_eden_pair_op.register_fake
def _(x, signs, seed, gemm_operand):
    return (_flatten(_empty_nvfp4(*x.shape, "1x16", x.device, gemm_operand))
            + _flatten(_empty_nvfp4(*x.shape[::-1], "1x16", x.device, gemm_operand)))


@torch.library.custom_op("nanoquartet::requantize_ms_eden", mutates_args=())
def _requantize_op(codes: Tensor, group_scale: Tensor, tensor_scale: Tensor, signs: Tensor, seed: Tensor,
                   gemm_operand: bool) -> Quantized:
    q = _unflatten((codes, group_scale, tensor_scale, codes.new_empty(0)), "1x16")
    if _on_gpu(codes):
        return _flatten(triton_requantize_ms_eden(q, signs, seed, gemm_operand))
    generator = torch.Generator().manual_seed(int(seed.item()))
    return _flatten(quantize_ms_eden(q.dequantize().t(), signs, generator), gemm_operand)


@_requantize_op.register_fake
def _(codes, group_scale, tensor_scale, signs, seed, gemm_operand):
    return _flatten(_empty_nvfp4(codes.shape[1] * 2, codes.shape[0], "1x16", codes.device, gemm_operand))


@torch.library.custom_op("nanoquartet::dequantize", mutates_args=())
def _dequantize_op(codes: Tensor, group_scale: Tensor, tensor_scale: Tensor, block: str, dtype: torch.dtype,
                   with_tensor_scale: bool) -> Tensor:
    q = _unflatten((codes, group_scale, tensor_scale, codes.new_empty(0)), block)
    if _on_gpu(codes) and q.shape[0] % DEQUANTIZE_ROWS == 0 and q.shape[1] % HADAMARD == 0:
        return triton_dequantize(q, dtype, with_tensor_scale)
    return q.dequantize(dtype, with_tensor_scale)


@_dequantize_op.register_fake
def _(codes, group_scale, tensor_scale, block, dtype, with_tensor_scale):
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=dtype)


def quantize_op(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False, signs=None):
    """NVFP4 quantization of x [R, C] along C (or of x^T along R, rotated by signs if given)."""
    seed = draw_seed(x.device) if rounding == "sr" else None
    return _unflatten(torch.ops.nanoquartet.quantize(x, signs, seed, rounding, four_over_six, block, float(fp4_max),
                                                     transpose, not native_fp4_available(x.device)), block)


def ms_eden_pair_op(x, signs):
    """(MS-EDEN of x [R, C] along C, MS-EDEN of x^T along R), both rotated by the 128 signs, from one read of x."""
    tensors = torch.ops.nanoquartet.ms_eden_pair(x, signs, draw_seed(x.device), not native_fp4_available(x.device))
    return _unflatten(tensors[:4], "1x16"), _unflatten(tensors[4:], "1x16")


def requantize_ms_eden_op(q, signs):
    """MS-EDEN of the transpose of a saved 1x16 NVFP4 tensor (the backward's re-quantization of X and W)."""
    tensors = torch.ops.nanoquartet.requantize_ms_eden(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, signs,
                                                       draw_seed(signs.device), not native_fp4_available(signs.device))
    return _unflatten(tensors, "1x16")


def dequantize_op(q, dtype=torch.float32, tensor_scale=True):
    """q.dequantize(dtype, tensor_scale): the kernel for 2-D CUDA tensors whose shape it tiles, else the reference."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"dequantize_op needs an NVFP4Tensor, got {type(q).__name__}")
    if len(q.shape) != 2:
        return q.dequantize(dtype, tensor_scale)
    return torch.ops.nanoquartet.dequantize(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, q.block, dtype,
                                            tensor_scale)


# =====================================================================================================================
# Part III. The GEMM: native NVFP4 on Blackwell (cuBLAS through torch's scaled_mm), emulated in BF16 elsewhere
def emulated_mm(a, b, out_dtype):
    """a @ b^T in out_dtype on code * group_scale (exact in BF16), the product of the two tensor scales applied where
    it is cheapest: to the smaller input (a weight, one BF16 rounding the native GEMM does not have) or to the output.
    A new tensor, never a view (torch 2.11's compiled backward gives a Function's view of an intermediate no grad)."""
    a_values, b_values = (dequantize_op(q, out_dtype, tensor_scale=False) if q.gemm_operand is None
                          else q.gemm_operand.to(out_dtype) for q in (a, b))
    alpha = a.tensor_scale * b.tensor_scale
    if b_values.numel() <= a.shape[0] * b.shape[0]:  # fold the tensor scales into the (smaller) weight operand
        return a_values @ (b_values * alpha).to(out_dtype).t()
    return (a_values @ b_values.t()) * alpha  # already out_dtype: a 0-dim FP32 factor keeps a tensor's dtype


def blocked_scales(group_scale):
    """[rows, K/16] E4M3 scales -> cuBLAS's layout: 128x4 tiles, (r, c) at byte (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = group_scale.shape
    padded_rows, padded_cols = _ceil_div(rows, 128) * 128, _ceil_div(cols, 4) * 4
    padded = torch.zeros(padded_rows, padded_cols, dtype=torch.uint8, device=group_scale.device)
    padded[:rows, :cols] = group_scale.view(torch.uint8)
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4)  # [tile row, r // 32, r % 32, tile col, c]
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1).view(torch.float8_e4m3fn)


def scales_1x16(q):
    """The group scales of q as one E4M3 scale per 16 elements along K: [rows, K/16]."""
    return q.group_scale.repeat_interleave(GROUP, dim=0) if q.block == "16x16" else q.group_scale


def native_mm_args(a, b, out_dtype=torch.bfloat16):
    """The arguments of torch.nn.functional.scaled_mm that compute a @ b^T in NVFP4 on sm_100+."""
    from torch.nn.functional import ScalingType, SwizzleType
    recipe = [ScalingType.BlockWise1x16, ScalingType.TensorWise]
    swizzle = [SwizzleType.SWIZZLE_32_4_4, SwizzleType.NO_SWIZZLE]
    return dict(mat_a=a.codes.view(torch.float4_e2m1fn_x2), mat_b=b.codes.view(torch.float4_e2m1fn_x2).t(),
                scale_a=[blocked_scales(scales_1x16(a)), a.tensor_scale.reshape(1)], scale_recipe_a=recipe,
                scale_b=[blocked_scales(scales_1x16(b)), b.tensor_scale.reshape(1)], scale_recipe_b=recipe,
                swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype)


@torch.compiler.assume_constant_result  # a property of the GPU: torch.compile evaluates it once, while tracing
def native_fp4_available(device):
    """Whether `device` has FP4 tensor cores (Blackwell, sm_100+) on a CUDA build (ROCm's report other capabilities)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.version.cuda is not None and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 10
            and hasattr(torch.nn.functional, "scaled_mm") and hasattr(torch, "float4_e2m1fn_x2"))


_native_refused = []  # the reason cuBLASLt gave, once it refused the NVFP4 GEMM: every later GEMM is emulated


@torch.library.custom_op("nanoquartet::native_mm", mutates_args=())
def _native_mm_op(a_codes: Tensor, a_scales: Tensor, a_tensor_scale: Tensor, b_codes: Tensor, b_scales: Tensor,
                  b_tensor_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b^T in NVFP4: an operator (Inductor's scaled_mm refuses the scales); refused by cuBLASLt, it emulates."""
    a, b = (_unflatten((codes, scales, tensor_scale, codes.new_empty(0)), "1x16") for codes, scales, tensor_scale
            in ((a_codes, a_scales, a_tensor_scale), (b_codes, b_scales, b_tensor_scale)))
    if not _native_refused:
        try:
            return torch.nn.functional.scaled_mm(**native_mm_args(a, b, out_dtype))
        except RuntimeError as error:
            _native_refused.append(str(error).splitlines()[0])
            print(f"nanoquartet: the native NVFP4 GEMM was refused ({_native_refused[0]}); emulating it in BF16")
    return emulated_mm(a, b, out_dtype)


@_native_mm_op.register_fake
def _(a_codes, a_scales, a_tensor_scale, b_codes, b_scales, b_tensor_scale, out_dtype):
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


def nvfp4_mm(a, b, out_dtype=torch.bfloat16):
    """a @ b^T for NVFP4 tensors a [M, K] and b [N, K] quantized along K: native on sm_100+, emulated elsewhere."""
    if not (isinstance(a, NVFP4Tensor) and isinstance(b, NVFP4Tensor) and len(a.shape) == len(b.shape) == 2):
        raise ValueError(f"nvfp4_mm needs two 2-D NVFP4Tensors, got {type(a).__name__}, {type(b).__name__}")
    if out_dtype not in OUT_DTYPES or a.shape[-1] != b.shape[-1] or a.codes.device != b.codes.device:
        raise ValueError(f"nvfp4_mm writes bfloat16, float16 or float32 from a common K and device, got {out_dtype} "
                         f"from {tuple(a.shape)} on {a.codes.device} and {tuple(b.shape)} on {b.codes.device}")
    if native_fp4_available(a.codes.device):
        return torch.ops.nanoquartet.native_mm(a.codes, scales_1x16(a).view(torch.uint8), a.tensor_scale, b.codes,
                                               scales_1x16(b).view(torch.uint8), b.tensor_scale, out_dtype)
    return emulated_mm(a, b, out_dtype)


if __name__ == "__main__":  # each kernel against its reference at a small shape; on a GPU, its time as well
    device = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU, interpreted (see the top of this file)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(128, 256, generator=g) * torch.exp2(torch.randint(-8, 9, (128, 1), generator=g))).bfloat16()
    signs = random_signs(generator=g)
    xd, sd = x.to(device), signs.to(device)

    def report(kernel, matches, what, bytes_per_element, timed):  # timed(x) -> the call timed at 8192 x 8192 on a GPU
        if device == "cuda":
            source = torch.empty(int(bytes_per_element * 8192**2) // 2, dtype=torch.uint8, device=device)
            call, target = timed(torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)), source.clone()
            ms, copy_ms = (triton.testing.do_bench(f) for f in (call, lambda: target.copy_(source)))
            what += f"; {ms:.3f} ms at 8192 x 8192, a copy of its bytes (read + written) {copy_ms:.3f} ms"
        print(f"{kernel:<21} {'matches' if matches else 'DIFFERS FROM'} its reference: {what}")

    report("_amax_kernel", amax(xd).view(torch.float32).item() == x.abs().max().item(), "max |x|, bit for bit", 2,
           lambda big: partial(amax, big))
    ratio = amax(xd, True, sd[:16]).view(torch.float32).item() / rht(x.t(), signs[:16]).abs().max().item()
    report("_rotated_amax_kernel", abs(ratio - 1) < 1e-6, "max |rht16(x^T)|, within 1e-6", 2,
           lambda big: partial(amax, big, True, sd[:16]))
    options = (dict(four_over_six=True), dict(block="16x16"), dict(rounding="sr", fp4_max=SR_FP4_MAX))
    ours, theirs = [[f(**o) for o in options] for f in (partial(triton_quantize, xd), partial(quantize_nvfp4, x))]
    same = [torch.equal(a.dequantize().cpu(), b.dequantize()) for a, b in zip(ours[:2], theirs[:2])]
    same.append(torch.equal(ours[2].group_scale.view(torch.uint8).cpu(), theirs[2].group_scale.view(torch.uint8)))
    report("_quantize_kernel", all(same), "RTN 1x16 + 4/6 and 16x16 values bit for bit, SR's scales too (with amax)",
           6.5625, lambda big: partial(triton_quantize, big, four_over_six=True))
    q, (rows, cols) = triton_quantize(xd), eden_phase1(xd, sd)
    saved = NVFP4Tensor(q.codes.cpu(), q.group_scale.cpu(), q.tensor_scale.cpu(), q.shape)
    pairs = ((rows, x), (cols, x.t()), (eden_phase1_requantize(q, sd), saved.dequantize().t()))
    off = max((decode_e2m1(unpack_codes(out.codes.cpu())).flatten() != eden_groups(rht(values, signs))[0].flatten())
              .float().mean() for out, values in pairs)
    report("_eden_phase1_kernel", off <= 5e-4, f"x, x^T, NVFP4: eden_groups' codes, {off:.1e} of them one step off",
           3.5, lambda big: partial(eden_phase1, big, sd))
    eden, corrected = eden_phase2(cols), cols.corrected.cpu()
    target, scale = corrected / (corrected.max() / EDEN_FP8_MAX), eden.group_scale.cpu().float()
    down, up = (round_to_grid(target, 3, -6, E4M3_MAX, noise=torch.full_like(target, n)) for n in (1.0, 0.0))
    report("_eden_phase2_kernel", ((scale == down) | (scale == up)).all(), "E4M3 scales rounded down or up", 2.8125,
           lambda big: partial(eden_phase2, eden_phase1(big, sd)[0]))
    report("_dequantize_kernel", torch.equal(triton_dequantize(q).cpu(), saved.dequantize()), "bit for bit", 2.5625,
           lambda big: partial(triton_dequantize, triton_quantize(big, gemm_operand=False), torch.bfloat16))
