"""
Fast versions: Triton kernels that compute exactly what quantize.py and eden.py compute, the operators through which
torch.compile sees them, and the NVFP4 GEMM. Each kernel mirrors a function there: read those two files first.

Why kernels. Hopper has no FP4 tensor cores: its GEMMs run in BF16 on the dequantized operands ("emulated" NVFP4, the
same numbers at BF16's speed), so all that Quartet II adds there is quantization, a few operations per byte. A
quantizer kernel is judged by the bytes it moves against the GPU's copy bandwidth:

    bytes per element: BF16 2, packed NVFP4 0.5 (codes) + 1/16 (E4M3 group scales) = 0.5625

so it reads its input once, writes a few bytes per element, uses integer bit tricks instead of branches and rotates
on the tensor cores. On Blackwell (sm_100, sm_120) the GEMMs run natively in NVFP4.

Part I, the kernels, bottom-up:
  1. Small floats by bit arithmetic, named after the quantize.py functions they mirror: rounding to a grid, E4M3,
     E2M1, the bit codecs, the tensor scale, the random draws, packing; then tiles and rotations (eden.rht).
  2. The absolute maximum, amax = max |x| (or max |rht(x)|): the first pass of an RTN/SR quantization.
  3. The RTN/SR quantizer (quantize.quantize_nvfp4), one program per [16, 128] tile:
         tensor_scale = amax / (fp8_max * fp4_max)
         group_scale  = E4M3_round(group_amax * (1 / (fp4_max * tensor_scale)))
         code         = E2M1_round(x * (1 / (group_scale * tensor_scale)))       (SR: plus Philox noise)
  4. MS-EDEN (eden.quantize_ms_eden) in two launches. Phase one rotates, rounds and corrects each group of x and x^T
     from one read of x, and keeps the largest corrected scale S_g * scale_g; phase two sets tensor_scale = that / 256
     and rounds each group_scale = S_g * scale_g / tensor_scale to E4M3 stochastically. The backward's re-quantization
     of a saved NVFP4 tensor is phase one reading NVFP4.
  5. Dequantization: code * group_scale (* tensor_scale).
Part II, how torch.compile sees the kernels: custom operators and their shape-only fakes.
Part III, the GEMM: native on Blackwell (cuBLAS's NVFP4 GEMM through scaled_mm), emulated in BF16 elsewhere.

Inputs. On a GPU the kernels take BF16, as training under autocast gives them; FP32 is refused with one line. A
rotation of BF16 values by +-1 entries is exact on the tensor cores (FP32 accumulation), and the emulated GEMM's
operand code * group_scale is exact in BF16. In Triton's CPU interpreter, where the tests run the kernels, they also
take FP32 and rotate in FP32 (its BF16 dot is wrong). On a CPU the operators run the references, for any float dtype.
`python kernels.py` checks every kernel against its reference, interpreted on a CPU, and times it on a GPU.

Exactness. A kernel does the reference's floating-point operations in the reference's order, with integer bit
arithmetic where a float instruction would round differently on some backend, so codes and scales are bit-identical
to quantize.py's and eden.py's. Three exceptions, each bounded by a test: a rotation sums +-x on tensor cores in
their own FP32 order (MS-EDEN also folds the 1/sqrt(128) into its group scales) and MS-EDEN's two sums per group run
in the compiler's order, so a value next to a rounding boundary can land on its other side (at most 1 code in 2000;
corrected scales within 1e-5); the re-quantization applies the saved tensor scale to the corrected scales rather
than to the values (the same bounds); and the random bits come from Philox here and from torch's generator there,
so random outputs are compared by their statistics.
"""

import math
import os
from dataclasses import replace
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
# Part I. The kernels
# ---------------------------------------------------------------------------------------------------------------------
# 1. Small floats by bit arithmetic. float32 = 2^(biased exponent - 127) * 1.mantissa: the exponent in bits 23-30, the
# sign in bit 31. (A kernel reads only globals that are constexpr.)
_FP32_BIAS = tl.constexpr(127)
_ONE_BITS = tl.constexpr(127 << 23)  # 1.0
_EXPONENT_BITS = tl.constexpr(0xFF << 23)


@triton.jit
def _power_of_two(exponent):
    """float32 2^exponent for an int32 exponent in [-126, 127], built from its bits."""
    return ((exponent + _FP32_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr, noise=None):
    """quantize.round_to_grid of |x| (the caller keeps the sign): to nearest, ties to even, or given noise ~ U[0, 1)
    stochastically."""
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
    """quantize.e2m1_round to nearest of |x| < 7 (saturating at 6 is the caller's), and that value's 3-bit code; exact
    for every float32 (tests/test_kernels.py). In the binade [2^e, 2^(e+1)) (e >= 0; below 1 the step stays 0.5) the
    grid step 2^(e-1) is the unit in the last place of magic = 2^(e+22). So |x| + magic rounds to the grid (the FPU's
    nearest-even), subtracting magic again is exact, and the sum's low mantissa bits count the steps k = rounded /
    2^(e-1) (2 to 4 in a binade, 0 to 2 below 1): the code is k + 2e (1.0 -> 2, 1.5 -> 3, 2 -> 4, ..., 6 -> 7)."""
    binade = tl.maximum(x.to(tl.int32, bitcast=True) & _EXPONENT_BITS, _ONE_BITS)  # 2^max(e, 0), whatever x's sign
    magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
    total = tl.abs(x) + magic
    code = (total.to(tl.int32, bitcast=True) & 7) + (binade >> 22) - (_FP32_BIAS << 1)
    return total - magic, code


# The bit codecs. E4M3: 4 exponent bits (bias 7), 3 mantissa bits; below 2^-6 subnormal steps of 2^-9; 0x7F is NaN.
_E4M3_BIAS = tl.constexpr(7)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)
_E4M3_NAN = tl.constexpr(0x7F)
# An E2M1 code's magnitude bits placed in float32 bits 22-24 and its sign in bit 31 read as float32 2^-126 * (the
# code's value): E2M1's exponent bias is 1, and code 1 (0.5) becomes float32's subnormal 2^-127. So decoding is two
# shifts and a mask, and one multiplication by 2^126.
_E2M1_DECODE_MASK = tl.constexpr(-0x7E400000)  # 0x81C00000 as int32: bit 31 and bits 22-24
_E2M1_DECODE_SCALE = tl.constexpr(2.0**126)


@triton.jit
def _e2m1_code(magnitude):
    """quantize.encode_e2m1 of an E2M1 grid magnitude: its 3-bit code."""
    # From 1.0 up, bits >> 22 is (biased exponent, top mantissa bit): 1.0 -> 254 (code 2), 1.5 -> 255 (code 3), ...
    normal = (magnitude.to(tl.int32, bitcast=True) >> 22) - ((_FP32_BIAS << 1) - 2)
    return tl.where(magnitude >= 1.0, normal, (magnitude * 2.0).to(tl.int32))  # 0 -> 0, 0.5 -> 1


@triton.jit
def _code_sign(x):
    """A 4-bit code's sign bit (8) where x's float32 sign bit is set (-0.0 too): bit 31 moved to bit 3."""
    return (x.to(tl.int32, bitcast=True) >> 28) & 8


@triton.jit
def _e2m1_value(code):
    """quantize.decode_e2m1 of the 4-bit code in bits 0-3 of code (higher bits are ignored)."""
    bits = ((code << 28) | (code << 22)) & _E2M1_DECODE_MASK
    return bits.to(tl.float32, bitcast=True) * _E2M1_DECODE_SCALE


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
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = (((exponent + (_FP32_BIAS - _E4M3_BIAS)) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * _E4M3_SUBNORMAL_STEP)
    return tl.where((bits & 0x7F) == _E4M3_NAN, float("nan"), value)


# The tensor scale, from an absolute maximum kept as int32 bits
_MIN_TENSOR_SCALE = tl.constexpr(MIN_TENSOR_SCALE)


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: for non-negative floats integer order is float order, and NaN > Inf > every finite value,
    so an atomic integer maximum over them lets a NaN anywhere win."""
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
    """quantize.sr_noise for the elements first ... first + COUNT - 1 (first a multiple of 8). Philox makes four 32-bit
    numbers per call (tl.rand would use one), each of them two elements' 16 bits: one call per 8 elements."""
    a, b, c, d = tl.randint4x(seed, first // 8 + tl.arange(0, COUNT // 8))
    words = tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), (COUNT // 2,))
    k = tl.reshape(tl.join(words & 0xFFFF, words >> 16), (COUNT,))
    return (k.to(tl.float32) + 0.5) * _SR_NOISE_STEP


# Packing (quantize.pack_codes): two codes per byte, the even element in the low nibble


@triton.jit
def _pack_codes(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """quantize.pack_codes: [ROWS, COLS] 4-bit codes -> [ROWS, COLS/2] bytes."""
    low, high = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _pack_code_words(groups, ROWS: tl.constexpr):
    """The same bytes as little-endian int32 words: [ROWS, 8, 16] codes -> [ROWS, 16] words of 8. For groups that each
    lie in one thread (MS-EDEN's layout): it packs without moving data, and the store moves words, not bytes."""
    nibbles = tl.reshape(groups, (ROWS, 16, 8)) << (4 * tl.arange(0, 8))[None, None, :]
    return tl.sum(nibbles, axis=2)  # disjoint bit fields: the sum is their OR


@triton.jit
def _unpack_codes(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """quantize.unpack_codes: [ROWS, COLS/2] bytes -> [ROWS, COLS] int32, each code in bits 0-3 (an even element
    keeps its byte's high nibble in bits 4-7, which _e2m1_value ignores: one mask fewer per byte)."""
    packed = packed.to(tl.int32)
    return tl.reshape(tl.join(packed, packed >> 4), (ROWS, COLS))


# Tiles


@triton.jit
def _offsets(row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr, PER: tl.constexpr = 1):
    """Offsets [ROWS, COLS / PER] of the [ROWS, COLS] tile at (row0, col0) of a [*, width] tensor stored as one item
    per PER elements of a row: 1 for values, 2 for packed codes, 16 for 1x16 group scales (for 16x16 ones, pass the
    tile's 16-row block and the count of them as row0 and ROWS)."""
    rows = row0 + tl.arange(0, ROWS)
    return rows[:, None] * (width // PER) + (col0 // PER + tl.arange(0, COLS // PER))[None, :]


@triton.jit
def _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr,
               TRANSPOSE: tl.constexpr):
    """The [ROWS, COLS] tile at (row0, col0) of x, or of x^T read through swapped strides (faster than transposing
    x's tile in registers)."""
    if TRANSPOSE:
        stride_r, stride_c = stride_c, stride_r
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    return tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c)


@triton.jit
def _load_nvfp4(codes_ptr, scales_ptr, row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr,
                TILE16: tl.constexpr):
    """NVFP4Tensor.dequantize(tensor_scale=False) of the [ROWS, COLS] tile at (row0, col0) of an NVFP4 tensor [*,
    width] with 1x16 or (TILE16; row0 a multiple of 16) 16x16 groups: code * group_scale in float32 (exact in BF16)."""
    packed = tl.load(codes_ptr + _offsets(row0, col0, width, ROWS, COLS, 2))
    if TILE16:
        scale_bits = tl.load(scales_ptr + _offsets(row0 // 16, col0, width, ROWS // 16, COLS, 16))
    else:
        scale_bits = tl.load(scales_ptr + _offsets(row0, col0, width, ROWS, COLS, 16))
    values = tl.reshape(_e2m1_value(_unpack_codes(packed, ROWS, COLS)), (ROWS // 16, 16, COLS // 16, 16))
    scales = tl.reshape(_e4m3_value(scale_bits), (ROWS // 16, 1 if TILE16 else 16, COLS // 16, 1))
    return tl.reshape(values * scales, (ROWS, COLS))


# Rotations (eden.rht). Finite inputs beyond ROTATION_LIMIT saturate first. The largest |sum| of +-x over a chunk (a
# rotation before its 1/sqrt(N)) is at least the chunk's largest |x| (the sums' squares add up to N times the
# inputs'), so sums all within 2^119 (half the limit, a margin for their rounding) mean that no input needed
# saturating, and a NaN or Inf fails that test: the kernels rotate first and saturate only if the test fails.
_ROTATION_LIMIT = tl.constexpr(ROTATION_LIMIT)
_SATURATION_TEST = tl.constexpr(ROTATION_LIMIT / 2)


@triton.jit
def _rotation_matrix(signs_ptr, N: tl.constexpr, columns=None):
    """diag(s) * H as an [N, N] matrix of +-1 made in registers, H[i, j] = (-1)^popcount(i & j) (eden.sylvester_matrix;
    N a power of two, 16 to 128), its columns in the given order; only the sign bits of the N signs are read."""
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
def _fits_unsaturated(amax_bits, N: tl.constexpr):
    """Whether the bits of a normalized N-wide rotation's largest |value| pass the saturation test (NaN fails)."""
    return amax_bits.to(tl.float32, bitcast=True) <= _SATURATION_TEST * (N**-0.5)


@triton.jit
def _rotate(tile, rotation, N: tl.constexpr, NORMALIZE: tl.constexpr = True):
    """eden.rht of tile [rows, 128] with rotation = _rotation_matrix(signs, N): the tile seen as [rows * 128 / N, N]
    times the matrix, sums of +-x on the tensor cores (exact products, FP32 accumulation), then one multiplication
    by 1/sqrt(N) as eden.rht does; without NORMALIZE the sums, sqrt(N) * rht(tile)."""
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
    if not _fits_unsaturated(amax, N):
        amax = _flat_max(_abs_bits(_rotate(_saturate(tile), rotation, N)))
    tl.atomic_max(amax_ptr, amax)


# Launching. The kernels run on CUDA tensors (on CPU tensors in Triton's interpreter). Every public launcher checks
# its inputs once, with one line per problem: a kernel reads memory as its arguments describe it.
KERNEL_DTYPES = (torch.bfloat16, torch.float32) if INTERPRETED else (torch.bfloat16,)
ROTATIONS = (16, 32, 128)  # the quantizer's rotation widths: NVIDIA's 16, TetraJet-v2's 32, MS-EDEN's 128
AMAX_BLOCK, ROTATED_AMAX_ROWS = 4096, 32  # per program (the rotated one: 16 rows where the rows are not 32s)


def check_kernel_device(t, what):
    if not (t.is_cuda or t.is_cpu and INTERPRETED):
        raise ValueError(f"{what} runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got {t.device}")


def check_input(t, multiple, what, transpose=False, blocks=None):
    """A ValueError unless t is what a kernel takes: a tensor (BF16 on a GPU, FP32 too when interpreted) or, given
    blocks, an NVFP4Tensor with one of them and contiguous parts; 2-D, non-empty, on a device the kernels run on, its
    shape (transposed, if asked) a multiple of `multiple` = [rows, columns]."""
    if blocks is None and not (isinstance(t, torch.Tensor) and t.dtype in KERNEL_DTYPES):
        raise ValueError(f"{what} takes bfloat16 on a GPU (train under autocast)"
                         f"{', or float32 interpreted' if INTERPRETED else ''}; got {getattr(t, 'dtype', type(t))}")
    if blocks is not None and not (isinstance(t, NVFP4Tensor) and t.block in blocks):
        raise ValueError(f"{what} needs an NVFP4Tensor with {' or '.join(blocks)} groups, got "
                         f"{getattr(t, 'block', type(t).__name__)}")
    shape = t.shape[::-1] if transpose else t.shape
    if len(shape) != 2 or 0 in shape or shape[0] % multiple[0] or shape[1] % multiple[1]:
        raise ValueError(f"{what} needs a non-empty 2-D tensor whose {'transpose ' if transpose else ''}shape is a "
                         f"multiple of [{multiple[0]}, {multiple[1]}], got shape {tuple(t.shape)}")
    if blocks is not None and not (t.codes.is_contiguous() and t.group_scale.is_contiguous()):
        raise ValueError(f"{what} needs contiguous codes and group scales (call .contiguous() on them)")
    check_kernel_device(t if blocks is None else t.codes, what)


def check_rotation(signs, widths, device, what):
    """A ValueError unless signs is a 1-D float tensor on device whose length is one of widths (the kernels read only
    their sign bits; the references also check that they are +-1)."""
    if not isinstance(signs, torch.Tensor) or signs.dim() != 1 or signs.numel() not in widths or \
            not signs.is_floating_point() or signs.device != device:
        kind = f"{signs.dtype} {tuple(signs.shape)} on {signs.device}" if isinstance(signs, torch.Tensor) else signs
        raise ValueError(f"{what} needs 1-D float signs of length {' or '.join(map(str, widths))} on {device}, got "
                         f"{kind}")


def draw_seed(device, seed=None, what="the kernel"):
    """The Philox seed a kernel reads: seed, checked, or one drawn on the device from torch's generator (no host
    sync, a fresh one on every replay of a captured CUDA graph, reproducible after torch.manual_seed)."""
    if seed is None:
        return torch.randint(2**31 - 1, (1,), device=device)
    if not (isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.numel() == 1
            and seed.device == device):
        raise ValueError(f"{what} needs its seed as one int64 on {device}, got {seed!r}")
    return seed


def _ceil_div(a, b):
    """ceil(a / b) for positive integers (triton.cdiv is slower on the host)."""
    return -(-a // b)


def _empty_nvfp4(rows, cols, block, device, gemm_operand, codes=None):
    """An NVFP4Tensor [rows, cols] for a kernel to fill, codes given or not, with a BF16 gemm operand if asked."""
    def empty(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)
    return NVFP4Tensor(empty(rows, cols // 2, dtype=torch.uint8) if codes is None else codes,
                       empty(rows // (GROUP if block == "16x16" else 1), cols // GROUP, dtype=torch.float8_e4m3fn),
                       empty(dtype=torch.float32), torch.Size((rows, cols)), block,
                       empty(rows, cols, dtype=torch.bfloat16) if gemm_operand else None)


def amax(x, transpose=False, signs=None):
    """max |x| (or max |rht(x or x^T, signs)|) as int32 bits in a 1-element tensor, without a host sync: the first
    pass of triton_quantize, which checks x and signs."""
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    if signs is None:  # without rotation, x^T has the maximum of x
        x = x.contiguous()
        _amax_kernel[(_ceil_div(x.numel(), AMAX_BLOCK),)](x, bits, x.numel(), BLOCK=AMAX_BLOCK)
        return bits
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    block = ROTATED_AMAX_ROWS if rows % ROTATED_AMAX_ROWS == 0 else QUANTIZE_ROWS
    _rotated_amax_kernel[(rows // block, cols // HADAMARD)](x, *x.stride(), signs, bits, ROWS=block,
                                                             N=signs.numel(), TRANSPOSE=transpose)
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
    """quantize._quantize_groups of groups [ROWS/16, 16, 8, 16], to nearest or, given noise, stochastically: E2M1
    magnitudes and codes, E4M3 scales [.., 1] and four-over-six's error group_scale^2 * sum(units^2) per group, in
    FP64 (exact; the units are integers, so any order gives the same sum)."""
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
    """RTN or SR quantization of a [ROWS, 128] tile per program of x [*, C], x^T, or their rotation by ROTATION signs
    (0: none). Reads 2 B/element, writes 0.5625 and 2 for the gemm operand: ~6.6 B/element with the amax pass."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _HADAMARD
    amax_bits = tl.load(amax_ptr)  # of what is quantized: for the tensor scale, and the saturation test below
    tile = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, _HADAMARD, TRANSPOSE).to(tl.float32)
    if ROTATION > 0:
        # The amax pass found the largest rotated value of the whole tensor (after saturating, where its test
        # failed, and then it fails this one too): the same test on it saves a reduction over the tile.
        if not _fits_unsaturated(amax_bits, ROTATION):
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

    codes = tl.reshape(code | _code_sign(groups), (ROWS, _HADAMARD))
    tl.store(codes_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD, 2), _pack_codes(codes, ROWS, _HADAMARD))
    if TILE16:
        tl.store(scales_ptr + _offsets(row0 // 16, col0, C, ROWS // 16, _HADAMARD, 16),
                 _e4m3_bits(tl.reshape(scale, (ROWS // 16, 8))))
    else:
        tl.store(scales_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD, 16), _e4m3_bits(tl.reshape(scale, (ROWS, 8))))
    if operand_ptr is not None:
        value = tl.where(groups.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude) * scale  # sign of x, -0 too
        tl.store(operand_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD),
                 tl.reshape(value, (ROWS, _HADAMARD)).to(tl.bfloat16))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(tensor_scale_ptr, tensor_scale)


QUANTIZE_ROWS, QUANTIZE_WARPS = 16, 4  # per program (larger tiles, or fewer warps, measured slower)


def triton_quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False,
                    signs=None, seed=None, gemm_operand=True):
    """The kernel version of quantize_nvfp4 for x [R, C] (or x^T, rotated by signs if given): R a multiple of 16,
    C of 128 (after transposing). Returns an NVFP4Tensor, with its BF16 gemm_operand if asked."""
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
# Phase one does the first five lines and the maximum, for x and x^T from one read of x; phase two, a small pass over
# the corrected scales, the last two. Phase one rotates without the 1/sqrt(128) and folds that factor into the group
# scale: one multiplication per group instead of one per element.
_EDEN_FP4_MAX = tl.constexpr(EDEN_FP4_MAX)
_EDEN_SCALE_PER_SUM = tl.constexpr(1 / (EDEN_FP4_MAX * math.sqrt(HADAMARD)))  # group scale per unnormalized sum
_MIN_NORMAL = tl.constexpr(MIN_NORMAL)

# Performance only: any column order gives the same numbers. In the register layout of Hopper's MMA the 4 lanes of a
# quad take turns holding 2 adjacent columns of the result, so in the natural order a 16-group is spread over 4
# threads (its sums need shuffles, its divisions run 4 times). With the rotation's columns permuted, accumulator
# column 64w + 8j + 2q + p (p within a lane's pair, q the lane in its quad, j the pair, w the half) holds output
# column 16(4w + q) + 2j + p: each group lies in one thread, and _grouped renames registers without moving data.


@triton.jit
def _grouped_columns():
    """The rotation's 128 columns in the order _grouped undoes: the bits (w, j, q, p) as those of (w, q, j, p)."""
    j = tl.arange(0, _HADAMARD)
    return (j & 64) | ((j & 6) << 3) | ((j >> 2) & 14) | (j & 1)


@triton.jit
def _grouped(sums, ROWS: tl.constexpr):
    """[ROWS, 128] sums of a dot with the _grouped_columns rotation -> [ROWS, 8, 16], its 16-groups in output order."""
    return tl.reshape(tl.permute(tl.reshape(sums, (ROWS, 2, 8, 4, 2)), (0, 1, 3, 2, 4)), (ROWS, 8, 16))


@triton.jit
def _group_maxima(sums, ROWS: tl.constexpr):
    """(groups [ROWS, 8, 16], their largest |sum| [ROWS, 8, 1]) of a job's rotation sums; a NaN is a group's largest."""
    groups = _grouped(sums, ROWS)
    return groups, tl.reduce(tl.abs(groups), 2, _nan_max, keep_dims=True)


@triton.jit
def _eden_groups(groups, largest, tensor_scale, ROWS: tl.constexpr):
    """eden.eden_groups, the math of phase one, on groups [ROWS, 8, 16] of rotation sums (sqrt(128) * rht) and their
    largest |sum| [ROWS, 8, 1]: the signed 4-bit codes [ROWS, 8, 16] and corrected scales scale_g * S_g [ROWS, 8]."""
    scale = largest * _EDEN_SCALE_PER_SUM
    flushed = scale < _MIN_NORMAL  # a group this small becomes zeros
    scale = tl.where(flushed, 0.0, scale)
    scaled = groups * tl.where(flushed, 1.0, tl.math.div_rn(_EDEN_FP4_MAX, largest))  # u_g
    magnitude, code = _e2m1_round(scaled)  # |scaled| below 7: no saturation needed
    norm = tl.sum(scaled * scaled, axis=2, keep_dims=True)
    overlap = tl.sum(tl.abs(scaled) * magnitude, axis=2, keep_dims=True)  # = <scaled, its rounding>: same signs
    corrected = tl.reshape(scale * tl.where(overlap > 0, tl.math.div_rn(norm, overlap), 1.0), (ROWS, 8))
    corrected = corrected * tensor_scale  # the NVFP4 input's tensor scale, or 1
    return code | _code_sign(scaled), corrected


@triton.jit
def _eden_job_input(x_ptr, stride_r, stride_c, nvfp4_codes_ptr, nvfp4_scales_ptr, C, row0, col0,
                    JOB_ROWS: tl.constexpr, TRANSPOSED: tl.constexpr, SATURATE: tl.constexpr):
    """A job's input [JOB_ROWS, 128]: the tile of x at (row0, col0), or (TRANSPOSED) the transpose of its
    [128, JOB_ROWS] tile there; of x (saturated if SATURATE) or, without x, code * group_scale of the NVFP4 input
    (its tensor scale goes to the corrected scales instead)."""
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
    """The scheduling of phase one: a program's jobs, stored, and their largest corrected scale as int32 bits. Program
    p does job p % JOBS_PER_TILE of tile p // JOBS_PER_TILE and of every (programs / JOBS_PER_TILE)-th tile after it:
    rows job0 ... job0 + JOB_ROWS - 1 of the 128 x 128 tile rotated along C, or (TRANSPOSED) those columns, whose
    transpose is rotated along R. A tile's jobs run at once on neighbouring programs: it is read from memory once."""
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
        # Saturation (eden.rht) almost never changes anything: it is tested after the rotation, on the largest sums,
        # and the input goes to the tensor cores as loaded. An NVFP4 input (at most 6 * 448 * tensor scale) never
        # needs it.
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
    """MS-EDEN phase one of x [R, C] (or, x_ptr None, of a 1x16 NVFP4 tensor: the backward's re-quantization of the
    saved X and W, dequantized, transposed, rotated and quantized in one pass) rotated along its rows, and/or of its
    transpose: packed codes, FP32 corrected scales and (atomically) their maximum's bits. Reads 2 B/element (0.5625
    from NVFP4), writes 0.75 per output. A tile makes 128/JOB_ROWS row jobs and as many column jobs; a program builds
    the rotation once, then does jobs of one kind."""
    rotation = _rotation_matrix(signs_ptr, _HADAMARD, _grouped_columns()).to(_DOT_DTYPE)  # converted once
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


class Phase1(NamedTuple):  # one output of phase one: what phase two needs
    codes: Tensor  # uint8 [rows, cols / 2], packed
    corrected: Tensor  # float32 [rows, cols / 16]: the corrected group scales scale_g * S_g
    amax: Tensor  # int32 [1]: the bits of the largest of them


class EdenLaunch(NamedTuple):  # phase one's launch on a GPU
    job_rows: int  # rows (or columns) of a 128 x 128 tile per job
    warps: int
    programs_per_multiprocessor: int
    register_cap: int  # what the programs leave each thread of a multiprocessor's 64K registers
    multiprocessors: int


# Phase one's (job rows, warps, programs per multiprocessor), by shared memory per multiprocessor. A program holds the
# rotation (32 KB) and its input (16 KB): four fit in 228 KB (Hopper, B200) and hide each other's loads; two fit in
# ~100 KB (sm_120), where 32-row jobs keep the dot's accumulators in registers without spilling.
EDEN_LAUNCH = {"large": (64, 4, 4), "small": (32, 4, 2)}
SMALL_SHARED_MEMORY = 160 * 1024  # below this per multiprocessor, a GPU takes the "small" launch


def _gpu(device):
    """(multiprocessors, shared memory per multiprocessor in bytes) of the device the kernels run on; for the
    interpreter, 5 multiprocessors (so that the tests run phase one's loop and its end) of a large GPU."""
    if device.type != "cuda":
        return 5, 228 * 1024
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_multiprocessor


def eden_launch(device):
    multiprocessors, shared = _gpu(device)
    job_rows, warps, programs = EDEN_LAUNCH["small" if shared < SMALL_SHARED_MEMORY else "large"]
    return EdenLaunch(job_rows, warps, programs, min(255, 65536 // (programs * warps * 32)), multiprocessors)


def _persistent_grid(rows, cols, jobs_per_tile, programs_per_multiprocessor, multiprocessors):
    """(programs, tiles per program) of phase one over [rows, cols]: as many programs as the multiprocessors hold at
    once, a multiple of jobs_per_tile, each doing one job of every (programs / jobs_per_tile)-th tile."""
    tiles = rows * cols // HADAMARD**2
    per_job = min(tiles, max(1, programs_per_multiprocessor * multiprocessors // jobs_per_tile))
    return per_job * jobs_per_tile, _ceil_div(tiles, per_job)


def _eden_phase1(source, signs, rows, cols, device, both):
    """Phase one of an input [rows, cols] (source: the kernel's first six arguments): the Phase1 of x [rows, cols] and
    of x^T [cols, rows] if both, else of x^T."""
    def outputs(out_rows, out_cols):
        return Phase1(torch.empty(out_rows, out_cols // 2, dtype=torch.uint8, device=device),
                      torch.empty(out_rows, out_cols // GROUP, dtype=torch.float32, device=device),
                      torch.zeros(1, dtype=torch.int32, device=device))
    row_out, col_out = outputs(rows, cols) if both else Phase1(None, None, None), outputs(cols, rows)
    launch = eden_launch(device)
    jobs_per_tile = (2 if both else 1) * HADAMARD // launch.job_rows
    programs, per_program = _persistent_grid(rows, cols, jobs_per_tile, launch.programs_per_multiprocessor,
                                             launch.multiprocessors)
    _eden_phase1_kernel[(programs,)](*source, signs.float(), *row_out, *col_out, rows, cols,
                                     TILES_PER_PROGRAM=per_program, JOB_ROWS=launch.job_rows, num_warps=launch.warps,
                                     maxnreg=launch.register_cap)
    return (row_out, col_out) if both else col_out


def eden_phase1(x, signs):
    """Phase one of x [R, C] rotated along C and of x^T [C, R] rotated along R, from one read of x: two Phase1."""
    check_input(x, (HADAMARD, HADAMARD), "MS-EDEN")
    check_rotation(signs, (HADAMARD,), x.device, "MS-EDEN")
    return _eden_phase1((x, *x.stride(), None, None, None), signs, *x.shape, x.device, both=True)


# Phase two: per group, reads the codes and the FP32 corrected scale (0.75 B/element), writes the E4M3 scale and the
# BF16 gemm operand (2.06 B).
_EDEN_FP8_MAX = tl.constexpr(EDEN_FP8_MAX)


@triton.jit
def _eden_phase2_kernel(seed_ptr, corrected_ptr, amax_ptr, codes_ptr,  # in: a seed, a Phase1
                        scales_ptr, operand_ptr, tensor_scale_ptr,  # out: E4M3 bits, gemm operand (None: not made)
                        n_groups, seed_offset, GROUPS: tl.constexpr):
    """MS-EDEN phase two of GROUPS 16-groups per program: the tensor scale from the largest corrected scale, E4M3
    stochastic rounding of each corrected scale (Philox numbers first_draw + group), and code * group_scale."""
    group = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    valid = group < n_groups
    tensor_scale = _tensor_scale(tl.load(amax_ptr), _EDEN_FP8_MAX)
    target = tl.math.div_rn(tl.load(corrected_ptr + group, mask=valid, other=0.0), tensor_scale)
    scale = _e4m3_round(target, tl.rand(tl.load(seed_ptr) + seed_offset, group))
    tl.store(scales_ptr + group, _e4m3_bits(scale), mask=valid)
    if operand_ptr is not None:
        packed = tl.load(codes_ptr + group[:, None] * 8 + tl.arange(0, 8)[None, :], mask=valid[:, None], other=0)
        value = _e2m1_value(_unpack_codes(packed, GROUPS, 16)) * scale[:, None]
        element = group[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(operand_ptr + element, value.to(tl.bfloat16), mask=valid[:, None])
    if tl.program_id(0) == 0:
        tl.store(tensor_scale_ptr, tensor_scale)


PHASE2_GROUPS = 256  # 16-groups per program


def eden_phase2(phase1, seed=None, gemm_operand=True, seed_offset=0):
    """Phase two of a Phase1: its NVFP4Tensor. The stochastic rounding takes the Philox numbers first_draw, first_draw
    + 1, ... of seed: tensors quantized with one seed (E and E^T of one backward) take disjoint ones."""
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
    return (eden_phase2(rows, seed, gemm_operand),
            eden_phase2(cols, seed, gemm_operand, seed_offset=1))


def eden_phase1_requantize(q, signs):
    """Phase one of q.dequantize()^T rotated along R, for a 1x16 NVFP4 tensor q [R, C], in one pass over q (code *
    group_scale is exact in BF16: the tensor cores rotate it)."""
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


DEQUANTIZE_ROWS = 16
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
# Part II. How torch.compile sees the kernels: custom operators with plain tensors in and out (an NVFP4Tensor as its
# codes, group scale bits as uint8, tensor scale and gemm operand, empty where the native GEMM does not need it), the
# kernels on CUDA (which check their inputs) and the references elsewhere (which check theirs), and a shape-only fake
# for tracing. Their randomness comes in as tensors drawn on the device (the signs, a Philox seed): a captured CUDA
# graph draws afresh on every replay, and torch.manual_seed still makes a run reproducible.

Quantized = tuple[Tensor, Tensor, Tensor, Tensor]
QuantizedPair = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _on_gpu(t):
    """Whether the operators run the Triton kernels on t (CUDA) or the references (any other device)."""
    return t.is_cuda


def _flatten(q):
    """An NVFP4Tensor as an operator's outputs."""
    operand = q.gemm_operand if q.gemm_operand is not None else q.codes.new_empty(0, dtype=torch.bfloat16)
    return q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, operand


def _unflatten(tensors, block):
    """The NVFP4Tensor of an operator's outputs (or inputs, with an empty gemm operand)."""
    codes, scale_bits, tensor_scale, operand = tensors
    return NVFP4Tensor(codes, scale_bits.view(torch.float8_e4m3fn), tensor_scale,
                       torch.Size((codes.shape[0], codes.shape[1] * 2)), block, operand if operand.numel() else None)


def _reference_outputs(q, gemm_operand):
    """A reference's NVFP4Tensor as an operator's outputs, with its gemm operand if asked."""
    return _flatten(replace(q, gemm_operand=q.dequantize(torch.bfloat16, tensor_scale=False)) if gemm_operand else q)


def _generator(seed):
    """A CPU generator seeded from the op's seed tensor, so that the references draw reproducibly from it too."""
    return None if seed is None else torch.Generator().manual_seed(int(seed.item()))


@torch.library.custom_op("nanoquartet::random_signs", mutates_args=())
def _random_signs_op(like: Tensor, n: int) -> Tensor:
    return random_signs(n, device=like.device)


@_random_signs_op.register_fake
def _(like, n):
    return like.new_empty(n, dtype=torch.float32)


def draw_signs(e, n=HADAMARD):
    """n random +-1.0 on e's device: the rotation of a backward whose gradient is e. An operator of e, so that
    torch.compile keeps the draw, and every quantization it feeds, in the backward graph (a draw that depends on
    nothing its partitioner may make twice, once in the forward graph: the GEMM's operands would then differ)."""
    return torch.ops.nanoquartet.random_signs(e, n)


@torch.library.custom_op("nanoquartet::quantize", mutates_args=())
def _quantize_op(x: Tensor, signs: Optional[Tensor], seed: Optional[Tensor], rounding: str, four_over_six: bool,
                 block: str, fp4_max: float, transpose: bool, gemm_operand: bool) -> Quantized:
    if _on_gpu(x):
        return _flatten(triton_quantize(x, rounding, four_over_six, block, fp4_max, transpose, signs, seed,
                                        gemm_operand))
    x = x.t() if transpose else x
    x = rht(x, signs) if signs is not None else x
    return _reference_outputs(quantize_nvfp4(x, rounding, four_over_six, block, fp4_max, generator=_generator(seed)),
                              gemm_operand)


@_quantize_op.register_fake
def _(x, signs, seed, rounding, four_over_six, block, fp4_max, transpose, gemm_operand):
    return _flatten(_empty_nvfp4(*(x.shape[::-1] if transpose else x.shape), block, x.device, gemm_operand))


@torch.library.custom_op("nanoquartet::ms_eden_pair", mutates_args=())
def _ms_eden_pair_op(x: Tensor, signs: Tensor, seed: Tensor, gemm_operand: bool) -> QuantizedPair:
    if _on_gpu(x):
        rows, cols = triton_ms_eden_pair(x, signs, seed, gemm_operand)
        return _flatten(rows) + _flatten(cols)
    generator = _generator(seed)
    return (_reference_outputs(quantize_ms_eden(x, signs, generator), gemm_operand)
            + _reference_outputs(quantize_ms_eden(x.t(), signs, generator), gemm_operand))


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
    return _reference_outputs(quantize_ms_eden(q.dequantize().t(), signs, _generator(seed)), gemm_operand)


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


# What model.py calls: NVFP4Tensors in and out, through the operators. The BF16 gemm operand is made only for the
# emulated GEMM (the native one reads codes and scales): ~2 of the ~6.6 bytes per element of a quantization.


def quantize_op(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False, signs=None):
    """NVFP4 quantization of x [R, C] along C (or of x^T along R, rotated by signs if given): R a multiple of 16 and
    C of 128 (after transposing)."""
    seed = draw_seed(x.device) if rounding == "sr" else None
    return _unflatten(torch.ops.nanoquartet.quantize(x, signs, seed, rounding, four_over_six, block, float(fp4_max),
                                                     transpose, not native_fp4_available(x.device)), block)


def ms_eden_pair_op(x, signs):
    """(MS-EDEN of x [R, C] along C, MS-EDEN of x^T along R), both rotated by the 128 signs, from one read of x."""
    tensors = torch.ops.nanoquartet.ms_eden_pair(x, signs, draw_seed(x.device), not native_fp4_available(x.device))
    return _unflatten(tensors[:4], "1x16"), _unflatten(tensors[4:], "1x16")


def requantize_ms_eden_op(q, signs):
    """MS-EDEN of the transpose of a saved 1x16 NVFP4 tensor (the backward's re-quantization of X and W)."""
    device = q.codes.device
    tensors = torch.ops.nanoquartet.requantize_ms_eden(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, signs,
                                                       draw_seed(device), not native_fp4_available(device))
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


def blocked_scales(group_scale):
    """[rows, K/16] E4M3 scales -> cuBLAS's 128x4 blocked layout (flat): pad to [round_up(rows, 128),
    round_up(K/16, 4)], cut into 128x4 tiles in row-major tile order; inside a tile, element (r, c) goes to byte
    (r % 32) * 16 + (r // 32) * 4 + c."""
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
    """Whether `device` has FP4 tensor cores (Blackwell, sm_100+) on a CUDA build of PyTorch that can drive them
    (ROCm builds report their own architecture as the capability)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.version.cuda is not None and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 10
            and hasattr(torch.nn.functional, "scaled_mm") and hasattr(torch, "float4_e2m1fn_x2"))


_native_refused = []  # the reason cuBLASLt gave, once it refused the NVFP4 GEMM: every later GEMM is emulated


@torch.library.custom_op("nanoquartet::native_mm", mutates_args=())
def _native_mm_op(a_codes: Tensor, a_scales: Tensor, a_tensor_scale: Tensor, b_codes: Tensor, b_scales: Tensor,
                  b_tensor_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b^T in NVFP4 (1x16 scales as uint8). An operator, so that Inductor calls it as it is: its own lowering of
    scaled_mm does not take the blocked scales. If cuBLASLt refuses (a part or driver without NVFP4 support), it says
    so once and emulates this and every later GEMM."""
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


def emulated_mm(a, b, out_dtype):
    """a @ b^T in out_dtype on code * group_scale (the gemm operands, or the dequantized codes), the product of the
    two FP32 tensor scales applied where it is cheapest: to the smaller input (a weight, one BF16 rounding the native
    GEMM does not have) or to the output. The result is a new tensor, never a view (torch 2.11's compiled backward
    gives an autograd Function's view of an intermediate a zero gradient)."""
    a_values, b_values = (dequantize_op(q, out_dtype, tensor_scale=False) if q.gemm_operand is None
                          else q.gemm_operand.to(out_dtype) for q in (a, b))
    alpha = a.tensor_scale * b.tensor_scale
    if b_values.numel() <= a.shape[0] * b.shape[0]:  # fold the tensor scales into the (smaller) weight operand
        return a_values @ (b_values * alpha).to(out_dtype).t()
    return (a_values @ b_values.t()) * alpha  # already out_dtype: a 0-dim FP32 factor keeps a tensor's dtype


def nvfp4_mm(a, b, out_dtype=torch.bfloat16):
    """a @ b^T for NVFP4 tensors a [M, K] and b [N, K] quantized along K: native on sm_100+, emulated elsewhere."""
    if not (isinstance(a, NVFP4Tensor) and isinstance(b, NVFP4Tensor) and len(a.shape) == len(b.shape) == 2):
        raise ValueError(f"nvfp4_mm needs two 2-D NVFP4Tensors, got {type(a).__name__}, {type(b).__name__}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"nvfp4_mm writes bfloat16, float16 or float32, not {out_dtype}")
    if a.shape[-1] != b.shape[-1] or a.codes.device != b.codes.device:
        raise ValueError(f"nvfp4_mm needs a common K and device, got {tuple(a.shape)} on {a.codes.device} and "
                         f"{tuple(b.shape)} on {b.codes.device}")
    if native_fp4_available(a.codes.device):
        return torch.ops.nanoquartet.native_mm(a.codes, scales_1x16(a).view(torch.uint8), a.tensor_scale, b.codes,
                                               scales_1x16(b).view(torch.uint8), b.tensor_scale, out_dtype)
    return emulated_mm(a, b, out_dtype)


# =====================================================================================================================
# Checks shared with tests/test_kernels.py, and `python kernels.py`: each kernel against its reference


def _expect(ok, what):
    if not ok:
        raise AssertionError(what)


def check_same_quantization(ours, reference):
    """An AssertionError unless a kernel's NVFP4Tensor is bit-identical to the reference's (on the CPU)."""
    _expect(torch.equal(ours.codes.cpu(), reference.codes), "codes differ")
    _expect(torch.equal(ours.group_scale.cpu().view(torch.uint8), reference.group_scale.view(torch.uint8)), "scales")
    _expect(torch.equal(ours.tensor_scale.cpu(), reference.tensor_scale), "tensor scales differ")
    _expect(ours.gemm_operand is not None and torch.equal(ours.gemm_operand.cpu().float(),
                                                          reference.dequantize(tensor_scale=False)), "gemm operand")


def check_eden_phase1(phase1, rotated):
    """An AssertionError unless a Phase1 matches eden.eden_groups of the reference rotation within the bounds of its
    order of sums: at most 1 code in 2000 differs, by one grid step, and where a group's codes agree its corrected
    scale agrees to 1e-5; amax is the largest corrected scale."""
    codes, corrected, amax_bits = (t.cpu() for t in phase1)
    values, reference = eden_groups(rotated)
    ours = decode_e2m1(unpack_codes(codes)).view_as(values)
    differ = ours != values
    step = torch.where(values.abs() >= 4, 2.0, torch.where(values.abs() >= 2, 1.0, 0.5))
    _expect(differ.float().mean() <= 5e-4 and ((ours - values).abs()[differ] <= step[differ]).all(), "codes")
    relative = (corrected - reference.squeeze(-1)).abs() / reference.squeeze(-1).clamp(min=1e-30)
    _expect((relative[~differ.any(-1)] <= 1e-5).all(), "corrected scales beyond 1e-5")
    _expect(amax_bits.view(torch.float32).item() == corrected.max().item(), "amax is not the largest corrected scale")


def check_on_grid_neighbours(chosen, exact, *grid):
    """An AssertionError unless each of chosen is exact rounded down or up on round_to_grid's grid (mantissa bits,
    minimum exponent, maximum): what stochastic rounding may give."""
    down, up = (round_to_grid(exact, *grid, noise=torch.full_like(exact, n)) for n in (1.0, 0.0))
    _expect(((chosen == down) | (chosen == up)).all(), "a value is not on a grid neighbour")


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU, in the interpreter (top of the file)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(128, 256, generator=g) * torch.exp2(torch.randint(-8, 9, (128, 1), generator=g))).bfloat16()
    signs = random_signs(generator=g)
    xd, sd = x.to(device), signs.to(device)
    q, (rows, cols) = triton_quantize(xd, four_over_six=True), eden_phase1(xd, sd)

    def quantizers():
        check_same_quantization(q, quantize_nvfp4(x, four_over_six=True))
        check_same_quantization(triton_quantize(xd, block="16x16"), quantize_nvfp4(x, block="16x16"))
        sr, reference = triton_quantize(xd, "sr", fp4_max=SR_FP4_MAX), quantize_nvfp4(x, "sr", fp4_max=SR_FP4_MAX)
        _expect(torch.equal(sr.group_scale.cpu().view(torch.uint8), reference.group_scale.view(torch.uint8))
                and torch.equal(sr.tensor_scale.cpu(), reference.tensor_scale), "SR's scales")
        scaled = x.float() * (1 / (reference.element_scales() * reference.tensor_scale))
        check_on_grid_neighbours(decode_e2m1(unpack_codes(sr.codes.cpu())).abs(), scaled.abs(), 1, 0, E2M1_MAX)

    def phase2():
        eden, tensor_scale = eden_phase2(cols), cols.corrected.cpu().max() / EDEN_FP8_MAX
        _expect(torch.equal(eden.tensor_scale.cpu(), tensor_scale), "tensor scale")
        check_on_grid_neighbours(eden.group_scale.cpu().float(), cols.corrected.cpu() / tensor_scale, 3, -6, E4M3_MAX)
        _expect(torch.equal(eden.gemm_operand.float(), eden.dequantize(tensor_scale=False)), "gemm operand")

    rht16 = rht(x.t(), signs[:16]).abs().max()
    if device == "cuda":  # timed at 8192 x 8192 against a copy of the same bytes
        big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        big_q, big_phase1 = triton_quantize(big, four_over_six=True, gemm_operand=False), eden_phase1(big, sd)[1]
    checks = [  # kernel, what matches its reference, the check, a call at the large shape and its bytes per element
        ("_amax_kernel", "max |x| bit for bit", lambda: _expect(amax(xd).view(torch.float32).cpu() == x.abs().max(),
                                                                "amax"), lambda: amax(big), 2),
        ("_rotated_amax_kernel", "max |rht16(x^T)| within 1e-6", lambda: _expect(abs(amax(xd, True, sd[:16]).view(
            torch.float32).cpu() / rht16 - 1) < 1e-6, "amax"), lambda: amax(big, True, sd[:16]), 2),
        ("_quantize_kernel", "RTN (1x16 + 4/6, 16x16) bit for bit; SR's scales too, its codes on grid neighbours",
         quantizers, lambda: triton_quantize(big, four_over_six=True), 6.5625),
        ("_eden_phase1_kernel", "x, x^T and an NVFP4 input within the bounds of eden_groups (1 code in 2000)",
         lambda: [check_eden_phase1(out, rht(values, signs)) for out, values in ((rows, x), (cols, x.t()), (
             eden_phase1_requantize(q, sd), NVFP4Tensor(*(t.cpu() for t in (q.codes, q.group_scale, q.tensor_scale)),
                                                        q.shape).dequantize().t()))], lambda: eden_phase1(big, sd), 3.5),
        ("_eden_phase2_kernel", "tensor scale bit for bit, group scales on E4M3 neighbours", phase2,
         lambda: eden_phase2(big_phase1), 2.8125),
        ("_dequantize_kernel", "bit for bit", lambda: _expect(torch.equal(triton_dequantize(q), q.dequantize()),
                                                              "values"), lambda: triton_dequantize(big_q, torch.bfloat16), 2.5625),
    ]
    for kernel, what, check, timed, bytes_per_element in checks:
        check()
        if device == "cuda":
            copy = torch.empty(int(bytes_per_element * big.numel()) // 2, dtype=torch.uint8, device=device)
            ms, copy_ms = (triton.testing.do_bench(f) for f in (timed, lambda: torch.empty_like(copy).copy_(copy)))
            what += f"; {ms:.3f} ms at 8192 x 8192, a copy of its bytes {copy_ms:.3f} ms"
        print(f"{kernel:<21} matches its reference: {what}")
