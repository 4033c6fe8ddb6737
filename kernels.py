"""
Fast versions: Triton kernels that compute exactly what quantize.py and eden.py compute, the operators through
which torch.compile sees them, and the NVFP4 GEMM.

Why kernels at all. On a Blackwell GPU the three GEMMs of a linear layer run natively in NVFP4. On Hopper (H100/H200)
and older there are no FP4 tensor cores: the GEMMs run in BF16 on the dequantized operands ("emulated" NVFP4, same
numbers, BF16 speed), so everything Quartet II adds is the quantization itself. Quantizing is memory-bound (a few
operations per byte), so a kernel is judged by how few bytes it moves and how close it gets to the copy bandwidth.
Bytes per element: BF16 = 2, packed NVFP4 = 0.5 (codes) + 1/16 (E4M3 scales) = 0.5625.

Every kernel works on tiles of TILE = 128 columns: one Hadamard chunk, eight 16-groups. Each kernel's docstring says
what it reads and writes. Besides the packed codes and scales, the quantizers write code * group_scale (exact in
BF16: at most 6 significant bits) for the emulated GEMM, which applies the FP32 tensor scales to its output.

Exactness. Each kernel performs the reference's floating-point operations in the same order (IEEE division via
div_rn, E2M1/E4M3 rounding with integer bit arithmetic or a magic addition, exact for every float32; four-over-six's
errors in integers, whose sums do not depend on their order), so codes and scales are bit-identical to the
reference. The exceptions: a rotation sums +-x on tensor cores, in their own FP32 order, and scales once (the
reference multiplies by +-1/sqrt(n); MS-EDEN's phase one folds the factor into its group scales instead), and
MS-EDEN's two sums per group run in the compiler's order, so a value can land on the other side of a rounding
boundary (at most 1 code in 2000 in the tests) and a corrected scale can differ in its last bits (at most 1e-5,
tested); the re-quantization applies the saved tensor scale to the corrected scales instead of to the values
(bounded the same way); and the random bits come from Philox here and from torch's generator there, so random
outputs are compared by their statistics.

Operators. quantize, ms_eden_pair, requantize_ms_eden and dequantize, what model.py calls, are PyTorch operators
(torch.library): plain tensors in and out (codes, group scales, tensor scale, code * group_scale), the kernels on
CUDA and the references of quantize.py and eden.py elsewhere, and a shape-only "fake" version with which
torch.compile traces a whole model through them without a graph break. They take their randomness as tensors drawn
on the device (the rotation's signs and a Philox seed), so a compiled step can be captured in a CUDA graph whose every
replay draws fresh randomness, and torch.manual_seed still makes a run reproducible. The Python functions around
them pack the tensors into the readable NVFP4Tensor.

The GEMM. nvfp4_mm(a, b) = a @ b^T for two NVFP4Tensors quantized along K: cuBLAS NVFP4 on sm_100+ through
torch.nn.functional.scaled_mm (scales rearranged into cuBLAS's 128x4 blocked layout), the BF16 emulation elsewhere.
"""

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from eden import EDEN_FP4_MAX, EDEN_FP8_MAX, HADAMARD, ROTATION_LIMIT, quantize_ms_eden, rht
from quantize import (E2M1_MAX, ERROR_UNITS, GROUP, MIN_NORMAL, MIN_TENSOR_SCALE, SR_NOISE_BITS, NVFP4Tensor,
                      check_quantizer, default_fp8_max, quantize_nvfp4)

# The Triton interpreter (CPU) gets BF16 dots wrong; there the rotation runs in FP32, exact for BF16 values.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TILE = HADAMARD  # columns per program: one Hadamard chunk, 8 groups of 16
QUANTIZE_ROWS, QUANTIZE_WARPS = 16, 4  # rows per program of the RTN/SR quantizer; measured best (NOTES.md)
ROTATED_AMAX_ROWS = 32  # the rotated amax pass measured 25% slower with 16 rows (NOTES.md); 16 if the rows need it
# MS-EDEN phase one works in jobs of EDEN_SUB = 64 rows. Its launch per input, each measured fastest on the H200
# (NOTES.md): (warps, register cap or None, programs per multiprocessor, stages: the input of the next jobs loaded
# while one is processed). What fits decides: a multiprocessor has 64K registers and 227 KB of shared memory, and
# a BF16 program holds the rotation (32 KB) and 16 KB per stage, so 2 stages let three programs share one. The
# re-quantization (NVFP4 input, no stages) needs 237 registers, so three fit only under a cap of 168 (a 40-byte
# spill). FP32 input (its dot runs on FMA units) spills 14 KB per thread with 4 warps: 8 warps at 128 registers
# spill 2 KB and ran 6.4x faster.
EDEN_SUB = 64
EDEN_LAUNCH = {"bf16": (4, None, 3, 2), "nvfp4": (4, 168, 3, 1), "fp32": (8, 128, 2, 3)}
FINISH_GROUPS = 256  # 16-groups per program of MS-EDEN's second phase
AMAX_BLOCK = 4096  # elements per program of the absolute-maximum pass
DEQUANTIZE_ROWS = 16
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Constants the kernels read (a Triton kernel reads only globals marked constexpr).
_TILE = tl.constexpr(TILE)
_EDEN_FP4_MAX = tl.constexpr(EDEN_FP4_MAX)
_EDEN_SCALE_PER_SUM = tl.constexpr(1 / (EDEN_FP4_MAX * math.sqrt(HADAMARD)))  # a group scale per unnormalized sum
_EDEN_FP8_MAX = tl.constexpr(EDEN_FP8_MAX)
_MIN_NORMAL = tl.constexpr(MIN_NORMAL)
_MIN_TENSOR_SCALE = tl.constexpr(MIN_TENSOR_SCALE)
_ROTATION_LIMIT = tl.constexpr(ROTATION_LIMIT)
_ERROR_UNITS = tl.constexpr(ERROR_UNITS)
_SR_NOISE_STEP = tl.constexpr(2.0**-SR_NOISE_BITS)
# float32 bit fields: value = 2^(exponent - 127) * 1.mantissa, the exponent in bits 23-30
_FP32_BIAS = tl.constexpr(127)
_E4M3_BIAS = tl.constexpr(7)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)
_E4M3_NAN = tl.constexpr(0x7F)
_E2M1_CODE_OF_ONE = tl.constexpr(2)  # codes 2..7 are 1, 1.5, 2, 3, 4, 6: two per binade
_ONE_BITS = tl.constexpr(_FP32_BIAS << 23)  # 1.0
_EXPONENT_BITS = tl.constexpr(0xFF << 23)

# -----------------------------------------------------------------------------
# Device helpers: small floats by bit arithmetic


@triton.jit
def _power_of_two(exponent):
    """float32 2^exponent for an int32 exponent in [-126, 127], built from its bits."""
    return ((exponent + _FP32_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(x, noise, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr,
                   STOCHASTIC: tl.constexpr):
    """|x| rounded to the grid of a small float (as quantize._round_to_grid): nearest-even, or up with probability
    equal to the distance from the lower neighbour when STOCHASTIC (noise ~ U[0,1)). Returns the magnitude."""
    magnitude = tl.minimum(tl.abs(x), MAX)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - _FP32_BIAS
    step_exponent = tl.maximum(exponent, MIN_EXPONENT) - MANTISSA
    if STOCHASTIC:
        steps = magnitude * _power_of_two(-step_exponent)  # exact: a power of two
        lower = tl.floor(steps)
        rounded = (lower + tl.where(noise < steps - lower, 1.0, 0.0)) * _power_of_two(step_exponent)
    else:
        # Adding 2^23 steps leaves no bits below the step, so the FPU rounds to a multiple of it (ties to even).
        magic = _power_of_two(step_exponent + 23)
        rounded = (magnitude + magic) - magic
    return tl.minimum(rounded, MAX)


@triton.jit
def _e2m1_round(x, noise, STOCHASTIC: tl.constexpr):
    """|x| rounded to E2M1 {0, 0.5, ..., 6} (1 mantissa bit, smallest exponent 0), saturating at 6."""
    return _round_to_grid(x, noise, 1, 0, 6.0, STOCHASTIC)


@triton.jit
def _e4m3_round(x):
    """x >= 0 rounded to the nearest E4M3 value (3 mantissa bits, smallest exponent -6), saturating at 448."""
    return _round_to_grid(x, x, 3, -6, 448.0, False)  # the second x fills the unused noise argument


@triton.jit
def _e4m3_stochastic_round(x, noise):
    """x >= 0 rounded up to the next E4M3 value with probability equal to its distance from the lower one
    (in grid steps), else down: unbiased up to the saturation at 448."""
    return _round_to_grid(x, noise, 3, -6, 448.0, True)


@triton.jit
def _e2m1_nearest(magnitude):
    """For magnitude >= 0: (its E2M1 rounding, to nearest with ties to even and saturating at 6, and that value's
    3-bit code), exact for every float32 (tests/test_kernels.py). E2M1 has one mantissa bit: in the binade
    [2^e, 2^(e+1)) (e >= 0; below 1 the step stays 0.5) the grid step is 2^(e-1), the unit in the last place of
    magic = 2^(e+22). So magnitude + magic rounds to the grid (the FPU's nearest-even), subtracting magic again is
    exact, and the sum's low mantissa bits count the steps k = rounded / 2^(e-1) (2, 3 or 4 in a binade, 0 to 2
    below 1): the code is k + 2e (1.0 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7)."""
    magnitude = tl.minimum(magnitude, 6.0)
    binade = tl.maximum(magnitude.to(tl.int32, bitcast=True), _ONE_BITS) & _EXPONENT_BITS  # 2^max(e, 0)
    magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
    total = magnitude + magic
    code = (total.to(tl.int32, bitcast=True) & 7) + (binade >> 22) - (_FP32_BIAS << 1)
    return total - magic, code


@triton.jit
def _with_sign_of(magnitude, x):
    """magnitude with the sign bit of x (-0.0 keeps its sign, as torch.copysign does)."""
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)


@triton.jit
def _code_sign(x):
    """The sign bit of a 4-bit code (8) where x's sign bit is set: float32 bit 31 moved to bit 3."""
    return (x.to(tl.int32, bitcast=True) >> 28) & 8


@triton.jit
def _e2m1_code(magnitude, x):
    """4-bit code of an E2M1 grid magnitude, with the sign bit of x (as quantize.encode_e2m1)."""
    bits = magnitude.to(tl.int32, bitcast=True)
    # From 1.0 up, bits >> 22 is (biased exponent, top mantissa bit): 1.0 -> 254, 1.5 -> 255, 2.0 -> 256, ...
    normal = (bits >> 22) - ((_FP32_BIAS << 1) - _E2M1_CODE_OF_ONE)
    code = tl.where(magnitude >= 1.0, normal, (magnitude * 2.0).to(tl.int32))  # 0 -> 0, 0.5 -> 1
    return code | _code_sign(x)


@triton.jit
def _e2m1_value(code):
    """float32 value of a 4-bit code."""
    magnitude_code = code & 7
    exponent = (magnitude_code >> 1) + _FP32_BIAS - 1  # codes 2, 3 -> 2^0; 4, 5 -> 2^1; 6, 7 -> 2^2
    normal = ((exponent << 23) | ((magnitude_code & 1) << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(magnitude_code >= 2, normal, magnitude_code.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3_bits(value):
    """uint8 bits of a non-negative float32 that lies on the E4M3 grid (NaN -> 0x7F)."""
    bits = value.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - (_FP32_BIAS - _E4M3_BIAS)) << 3) | ((bits >> 20) & 7)
    subnormal = (value * (1 / _E4M3_SUBNORMAL_STEP)).to(tl.int32)  # multiples of 2^-9
    code = tl.where(value >= _E4M3_MIN_NORMAL, normal, subnormal)
    return tl.where(value != value, _E4M3_NAN, code).to(tl.uint8)


@triton.jit
def _e4m3_value(bits):
    """float32 value of non-negative E4M3 bits."""
    bits = bits.to(tl.int32)
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = (((exponent + (_FP32_BIAS - _E4M3_BIAS)) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * _E4M3_SUBNORMAL_STEP)
    return tl.where((bits & 0x7F) == _E4M3_NAN, float("nan"), value)


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: for non-negative floats integer order is float order, and NaN > Inf > every finite value,
    so an atomic integer maximum over them lets a NaN anywhere win."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tensor_scale(amax_ptr, limit):
    """As quantize.tensor_scale_for: amax / limit; 1 below MIN_TENSOR_SCALE; NaN if amax is not finite."""
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, limit)
    scale = tl.where(scale < _MIN_TENSOR_SCALE, 1.0, scale)
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _pack(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] 4-bit codes -> [ROWS, COLS/2] bytes, the even element in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _unpack(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS/2] bytes -> [ROWS, COLS] int32 codes."""
    packed = packed.to(tl.int32)
    return tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, COLS))


@triton.jit
def _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr,
               TRANSPOSE: tl.constexpr):
    """The [ROWS, COLS] tile at (row0, col0) of x, or of x^T with TRANSPOSE (read through swapped strides: measured
    as fast as reading x's tile and transposing it in registers, NOTES.md)."""
    if TRANSPOSE:
        stride_r, stride_c = stride_c, stride_r
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    return tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c)


@triton.jit
def _codes_at(row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Offsets [ROWS, COLS/2] of the packed codes of the [ROWS, COLS] tile at (row0, col0) of a [*, width] tensor
    (two codes per byte)."""
    rows = row0 + tl.arange(0, ROWS)
    return rows[:, None] * (width // 2) + (col0 // 2 + tl.arange(0, COLS // 2))[None, :]


@triton.jit
def _groups_at(row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Offsets [ROWS, COLS/16] of the group scales (one per 16 columns) of that tile. For 16x16 groups, pass the
    tile's first 16-row block and their count as row0 and ROWS."""
    rows = row0 + tl.arange(0, ROWS)
    return rows[:, None] * (width // 16) + (col0 // 16 + tl.arange(0, COLS // 16))[None, :]


@triton.jit
def _scaled_codes(codes_ptr, scales_ptr, row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr,
                  TILE16: tl.constexpr):
    """code * group_scale (exact in BF16) of the [ROWS, COLS] tile at (row0, col0) of an NVFP4 tensor [*, width]
    with 1x16 groups, or with 16x16 ones (TILE16; row0 a multiple of 16)."""
    packed = tl.load(codes_ptr + _codes_at(row0, col0, width, ROWS, COLS))
    values = tl.reshape(_e2m1_value(_unpack(packed, ROWS, COLS)), (ROWS // 16, 16, COLS // 16, 16))
    if TILE16:
        scales = _e4m3_value(tl.load(scales_ptr + _groups_at(row0 // 16, col0, width, ROWS // 16, COLS)))
        values = values * tl.reshape(scales, (ROWS // 16, 1, COLS // 16, 1))
    else:
        scales = _e4m3_value(tl.load(scales_ptr + _groups_at(row0, col0, width, ROWS, COLS)))
        values = values * tl.reshape(scales, (ROWS // 16, 16, COLS // 16, 1))
    return tl.reshape(values, (ROWS, COLS))


@triton.jit
def _rotation_matrix(signs_ptr, N: tl.constexpr, GROUPED: tl.constexpr = False):
    """diag(s) * H as an [N, N] matrix of +-1 (N a power of two, 16 to 128), generated in registers:
    H[i, j] = (-1)^popcount(i & j) (Sylvester). Only the sign bit of each entry of signs is used.
    GROUPED (N = 128): the columns in the order _grouped undoes: column 64w + 8j + 2q + p is H's column
    16(4w + q) + 2j + p."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    if GROUPED:  # the bits of (w, j, q, p) rearranged into those of (w, q, j, p)
        j = (j & 64) | ((j & 6) << 3) | ((j >> 2) & 14) | (j & 1)
    bits = i & j
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)  # bit 0 is now the parity of the 7 bits of i & j
    signs = tl.where(tl.load(signs_ptr + tl.arange(0, N)) < 0, -1.0, 1.0)[:, None]
    return (1 - 2 * (bits & 1)).to(tl.float32) * signs


@triton.jit
def _saturate(tile):
    """Finite values beyond +-ROTATION_LIMIT saturate there (as eden.rht), so that a rotation cannot overflow. The
    elementwise work runs only for a tile that holds such a value (or Inf or NaN, which stay): almost never. The
    test is one maximum over the whole tile (each thread's values, then across threads): a maximum over rows, then
    over columns, took twice the instructions."""
    if tl.max(tl.abs(tile)) > _ROTATION_LIMIT:
        saturated = tl.minimum(tl.maximum(tile, -_ROTATION_LIMIT), _ROTATION_LIMIT)
        tile = tl.where((tl.abs(tile) == float("inf")) | (tile != tile), tile, saturated).to(tile.dtype)
    return tile


@triton.jit
def _rotate(tile, rotation, N: tl.constexpr, DOT_FP32: tl.constexpr, NORMALIZE: tl.constexpr = True):
    """rht(tile) for tile [rows, 128] (saturated) and rotation = _rotation_matrix(signs, N): each N-chunk of a row
    times the [N, N] matrix (the tile seen as [rows * 128 / N, N]); the sum of +-x runs on tensor cores in FP32
    (exact products), then one multiplication by 1/sqrt(N), as eden.rht computes it. Without NORMALIZE: the sums
    themselves, sqrt(N) * rht(tile) (for MS-EDEN, whose codes do not depend on a common factor)."""
    ROWS: tl.constexpr = tile.shape[0]
    chunks = tl.reshape(tile, (ROWS * _TILE // N, N))
    if DOT_FP32:  # FP32 operands: no TF32 truncation
        rotated = tl.dot(chunks.to(tl.float32), rotation, input_precision="ieee")
    else:  # BF16 input: exact in BF16
        rotated = tl.dot(chunks.to(tl.bfloat16), rotation.to(tl.bfloat16))
    rotated = tl.reshape(rotated, (ROWS, _TILE))
    return rotated * (1 / math.sqrt(N)) if NORMALIZE else rotated


@triton.jit
def _uniform_noise(seed, first, COUNT: tl.constexpr):
    """Stochastic rounding's COUNT draws (k + 1/2) / 2^16 (as quantize.sr_noise) for the elements first ...
    first + COUNT - 1 (first a multiple of 8). Philox makes four 32-bit numbers per call (tl.rand would use one),
    and each number gives two elements their 16 bits: one call per 8 elements."""
    a, b, c, d = tl.randint4x(seed, first // 8 + tl.arange(0, COUNT // 8))
    words = tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), (COUNT // 2,))
    k = tl.reshape(tl.join(words & 0xFFFF, words >> 16), (COUNT,))
    return (k.to(tl.float32) + 0.5) * _SR_NOISE_STEP


# -----------------------------------------------------------------------------
# The absolute maximum (the tensor scale's input)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    """amax_ptr (int32 [1], zeroed) <- bits of max |x| over a contiguous x. Reads 2 B/element (BF16)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(_abs_bits(x), axis=0))


@triton.jit
def _rotated_amax_kernel(
        x_ptr, stride_r, stride_c,  # input x (its strides), read transposed when TRANSPOSE
        signs_ptr,  # float32 [N]: the rotation's signs
        amax_ptr,  # output: int32 [1], zeroed
        ROWS: tl.constexpr, N: tl.constexpr, TRANSPOSE: tl.constexpr, DOT_FP32: tl.constexpr):
    """amax_ptr <- bits of max |rht(x or x^T)| over one [ROWS, 128] tile per program."""
    tile = _load_tile(x_ptr, stride_r, stride_c, tl.program_id(0) * ROWS, tl.program_id(1) * _TILE, ROWS, _TILE,
                      TRANSPOSE)
    rotated = _rotate(_saturate(tile), _rotation_matrix(signs_ptr, N), N, DOT_FP32)
    tl.atomic_max(amax_ptr, tl.max(tl.max(_abs_bits(rotated), axis=1), axis=0))


# -----------------------------------------------------------------------------
# RTN / SR quantization, 1x16 or 16x16, optional four-over-six, transpose and rotation


@triton.jit
def _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, STOCHASTIC: tl.constexpr,
                     TILE16: tl.constexpr):
    """One quantization of groups [ROWS/16, 16, 8, 16] (as quantize._quantize_groups): E2M1 magnitudes, E4M3 scales
    [.., 1] and four-over-six's error per group: group_scale^2 * sum(units^2) in FP64 (exact), the units in
    integers, so that the sum is the same in any order."""
    scale = _e4m3_round(group_amax * tl.math.div_rn(1.0, fp4_max * tensor_scale))  # one division per program
    scale = tl.where(scale == 0, 1.0, scale)
    scaled = groups * tl.math.div_rn(1.0, scale * tensor_scale)
    magnitude = _e2m1_round(scaled, noise, STOCHASTIC)
    units = ((tl.abs(scaled) - magnitude) * _ERROR_UNITS).to(tl.int32)  # truncated toward zero
    error = tl.sum(units * units, axis=3, keep_dims=True)
    if TILE16:
        error = tl.sum(error, axis=1, keep_dims=True)
    return magnitude, scale, error.to(tl.float64) * (scale * scale).to(tl.float64)


@triton.jit
def _quantize_kernel(
        x_ptr, stride_r, stride_c,  # input x (its strides), read transposed when TRANSPOSE
        signs_ptr,  # float32 [ROTATION]: the rotation's signs (None without rotation)
        amax_ptr,  # int32 [1]: bits of the absolute maximum of what is quantized, from an amax kernel
        seed_ptr,  # int64 [1]: Philox seed (None unless STOCHASTIC)
        codes_ptr, scales_ptr, scaled_ptr, tensor_scale_ptr,  # outputs; scaled_ptr None: not written
        C, fp4_max, fp8_max,  # columns of the quantized tensor; the quantizer's constants
        ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, ROTATION: tl.constexpr,  # ROTATION: chunk width, 0 for none
        STOCHASTIC: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, TILE16: tl.constexpr, DOT_FP32: tl.constexpr):
    """RTN or SR quantization (as quantize.quantize_nvfp4) of one [ROWS, 128] tile per program of x, x^T, or their
    rotation. Reads the tile (2 B/element) and writes packed codes and E4M3 scales (0.5625) and code * group_scale
    (2, for the emulated GEMM); with the amax pass, ~6.6 B/element."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _TILE
    tile = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, _TILE, TRANSPOSE).to(tl.float32)
    if ROTATION > 0:
        tile = _rotate(_saturate(tile), _rotation_matrix(signs_ptr, ROTATION), ROTATION, DOT_FP32)
    groups = tl.reshape(tile, (ROWS // 16, 16, 8, 16))  # [16-row tiles, row in tile, group, element]
    group_amax = tl.max(tl.abs(groups), axis=3, keep_dims=True)
    if TILE16:
        group_amax = tl.max(group_amax, axis=1, keep_dims=True)
    tensor_scale = _tensor_scale(amax_ptr, fp8_max * fp4_max)

    noise = groups  # placeholders, read only when STOCHASTIC
    noise4 = groups
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
        first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * (ROWS * _TILE)  # this tile's counters
        noise = tl.reshape(_uniform_noise(seed, first, ROWS * _TILE), (ROWS // 16, 16, 8, 16))
        if FOUR_OVER_SIX:  # the second branch draws from counters past the whole tensor's
            numel = tl.num_programs(0) * tl.num_programs(1) * (ROWS * _TILE)
            noise4 = tl.reshape(_uniform_noise(seed, numel + first, ROWS * _TILE), (ROWS // 16, 16, 8, 16))
    magnitude, scale, error = _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, STOCHASTIC, TILE16)
    if FOUR_OVER_SIX:
        magnitude4, scale4, error4 = _quantize_branch(groups, group_amax, fp4_max * 4 / 6, tensor_scale, noise4,
                                                      STOCHASTIC, TILE16)
        magnitude = tl.where(error4 < error, magnitude4, magnitude)  # a tie keeps the 6-branch
        scale = tl.where(error4 < error, scale4, scale)

    codes = tl.reshape(_e2m1_code(magnitude, groups), (ROWS, _TILE))
    tl.store(codes_ptr + _codes_at(row0, col0, C, ROWS, _TILE), _pack(codes, ROWS, _TILE))
    if TILE16:
        tl.store(scales_ptr + _groups_at(row0 // 16, col0, C, ROWS // 16, _TILE),
                 _e4m3_bits(tl.reshape(scale, (ROWS // 16, 8))))
    else:
        tl.store(scales_ptr + _groups_at(row0, col0, C, ROWS, _TILE), _e4m3_bits(tl.reshape(scale, (ROWS, 8))))
    if scaled_ptr is not None:
        rows = row0 + tl.arange(0, ROWS)
        cols = col0 + tl.arange(0, _TILE)
        value = tl.reshape(_with_sign_of(magnitude, groups) * scale, (ROWS, _TILE))
        tl.store(scaled_ptr + rows[:, None] * C + cols[None, :], value.to(scaled_ptr.dtype.element_ty))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(tensor_scale_ptr, tensor_scale)


# -----------------------------------------------------------------------------
# MS-EDEN: phase one (rotate, codes, corrected scales, their maximum), phase two (tensor scale, SR of the scales)


@triton.jit
def _grouped(rotated, ROWS: tl.constexpr):
    """[ROWS, 128] -> [ROWS, 8, 16]: the 16-groups of a dot's result with _rotation_matrix(signs, 128, GROUPED=True),
    in output order. Why the detour: in the register layout of Hopper's MMA, the 4 lanes of a quad take turns
    holding 2 adjacent columns of the result, so in the natural order a 16-group is spread over 4 threads: its sums
    need shuffles and its per-group work (two divisions) runs 4 times. With the matrix's columns permuted,
    accumulator column 64w + 8j + 2q + p (p within a lane's pair, q the lane in its quad, j the pair, w the half)
    holds output column 16(4w + q) + 2j + p, so each group lies in one thread, and this reshape and permute rename
    registers without moving data. (Any layout gives the same numbers; this one is the fast one.)"""
    return tl.reshape(tl.permute(tl.reshape(rotated, (ROWS, 2, 8, 4, 2)), (0, 1, 3, 2, 4)), (ROWS, 8, 16))


@triton.jit
def _eden_store(sums, tensor_scale, codes_ptr, corrected_ptr, row0, col0, width, ROWS: tl.constexpr,
                GROUPED: tl.constexpr):
    """MS-EDEN phase one (as eden.eden_groups) of a [ROWS, 128] tile at (row0, col0) of an output [*, width], from
    its rotation's unnormalized sums (sqrt(128) * rht: the codes and the correction do not depend on a common
    factor, so the 1/sqrt(128) is folded into each group's scale, one multiplication per group instead of one per
    element): stores the packed codes and the corrected scales (times tensor_scale), and returns the latter as
    int32 bits. GROUPED: the sums come from a dot with the GROUPED rotation matrix."""
    groups = _grouped(sums, ROWS) if GROUPED else tl.reshape(sums, (ROWS, 8, 16))
    largest = tl.max(tl.abs(groups), axis=2, keep_dims=True)
    scale = largest * _EDEN_SCALE_PER_SUM
    flushed = scale < _MIN_NORMAL  # a group this small becomes zeros
    scale = tl.where(flushed, 0.0, scale)
    scaled = groups * tl.where(flushed, 1.0, tl.math.div_rn(_EDEN_FP4_MAX, largest))  # |scaled| <= 6.07
    magnitude, code = _e2m1_nearest(tl.abs(scaled))
    norm = tl.sum(scaled * scaled, axis=2, keep_dims=True)
    overlap = tl.sum(tl.abs(scaled) * magnitude, axis=2, keep_dims=True)  # = <scaled, its rounding>: same signs
    corrected = tl.reshape(scale * tl.where(overlap > 0, tl.math.div_rn(norm, overlap), 1.0), (ROWS, 8))
    corrected = corrected * tensor_scale
    codes = tl.reshape(code | _code_sign(scaled), (ROWS, _TILE))
    tl.store(codes_ptr + _codes_at(row0, col0, width, ROWS, _TILE), _pack(codes, ROWS, _TILE))
    tl.store(corrected_ptr + _groups_at(row0, col0, width, ROWS, _TILE), corrected)
    return _abs_bits(corrected)


@triton.jit
def _eden_input(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, C, row0, col0, ROWS: tl.constexpr,
                COLS: tl.constexpr):
    """The [ROWS, COLS] tile at (row0, col0) of phase one's input: x (saturated), or code * group_scale of the NVFP4
    input (exact in BF16; its tensor scale is applied to the corrected scales instead)."""
    if x_ptr is not None:
        values = _saturate(_load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, COLS, False))
    else:
        values = _scaled_codes(in_codes_ptr, in_scales_ptr, row0, col0, C, ROWS, COLS, False)
    return values


@triton.jit
def _eden_jobs(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, rotation, tensor_scale, codes_ptr,
               corrected_ptr, R, C, first, step, sub0, TRANSPOSED: tl.constexpr, TILES: tl.constexpr,
               SUB: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr, GROUPED: tl.constexpr):
    """One program's jobs: the same part of tiles first, first + step, ...: rows sub0 ... sub0 + SUB - 1 rotated
    along C, or (TRANSPOSED) columns sub0 ... sub0 + SUB - 1, whose transpose [SUB, 128] is rotated along R. With
    STAGES > 1 the loads of the next tiles are issued while this one is processed. Returns the largest corrected
    scale as int32 bits."""
    largest = tl.zeros((SUB, 8), dtype=tl.int32)  # reduced across threads once, at the end
    tile_cols = C // _TILE
    last = (R // _TILE) * tile_cols - 1
    for i in tl.range(TILES, num_stages=STAGES):
        tile = tl.minimum(first + i * step, last)  # past the end: the last tile again (the same values)
        row0 = (tile // tile_cols) * _TILE
        col0 = (tile % tile_cols) * _TILE
        if TRANSPOSED:  # columns col0 + sub0 ... of x: rows of the output [C, R]
            values = tl.trans(_eden_input(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, C, row0,
                                          col0 + sub0, _TILE, SUB))
            out_row, out_col, width = col0 + sub0, row0, R
        else:
            values = _eden_input(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, C, row0 + sub0, col0, SUB,
                                 _TILE)
            out_row, out_col, width = row0 + sub0, col0, C
        sums = _rotate(values, rotation, _TILE, DOT_FP32, False)
        largest = tl.maximum(largest, _eden_store(sums, tensor_scale, codes_ptr, corrected_ptr, out_row, out_col,
                                                  width, SUB, GROUPED))
    return tl.max(tl.max(largest, axis=1), axis=0)


@triton.jit
def _eden_kernel(
        x_ptr, stride_r, stride_c,  # input: x [R, C] (or None, when the input is the NVFP4 tensor below)
        in_codes_ptr, in_scales_ptr, in_tensor_scale_ptr,  # input: a 1x16 NVFP4 tensor [R, C] (or None)
        signs_ptr,  # float32 [128]: the rotation's signs
        row_codes_ptr, row_corrected_ptr, row_amax_ptr,  # output [R, C], rotated along C (None: not computed)
        col_codes_ptr, col_corrected_ptr, col_amax_ptr,  # output [C, R], the transpose rotated along R
        R, C, TILES_PER_PROGRAM: tl.constexpr, SUB: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr,
        GROUPED: tl.constexpr):
    """MS-EDEN phase one (post hoc range alignment, eden.py): packed codes, FP32 corrected scales and
    (atomically) their maximum, for x rotated along its rows and/or for its transpose.
    From an NVFP4 input this is the backward's re-quantization of the saved X and W: dequantize, transpose, rotate
    and quantize in one pass (code * group scale is exact in BF16, and the tensor scale, which does not change the
    codes, multiplies the corrected scales). Reads 2 B/element (0.5625 from NVFP4), writes 0.75 per output.
    Work comes in jobs: each 128x128 tile of x gives 128/SUB row jobs ([SUB, 128] rotated along C) and 128/SUB
    column jobs ([128, SUB], transposed and rotated along R). Program p does job p % jobs_per_tile of every
    (num_programs / jobs_per_tile)-th tile, so the jobs of one tile run at the same time on neighbouring programs
    and the tile is read from memory once (then from the L2 cache). Each program builds the rotation once."""
    rotation = _rotation_matrix(signs_ptr, _TILE, GROUPED)
    if not DOT_FP32:  # converted once: half the registers it holds across the loop
        rotation = rotation.to(tl.bfloat16)
    tensor_scale = 1.0 if x_ptr is not None else tl.load(in_tensor_scale_ptr)
    slices: tl.constexpr = _TILE // SUB  # row jobs (and column jobs) per tile
    jobs_per_tile: tl.constexpr = slices if row_codes_ptr is None else 2 * slices
    part = tl.program_id(0) % jobs_per_tile  # this program's job in each of its tiles
    first = tl.program_id(0) // jobs_per_tile
    step = tl.num_programs(0) // jobs_per_tile
    sub0 = (part % slices) * SUB
    # Jobs 0 ... slices - 1 of a tile are row jobs, the others column jobs (all of them, for the re-quantization).
    if row_codes_ptr is not None and part < slices:
        tl.atomic_max(row_amax_ptr, _eden_jobs(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, rotation,
                                               tensor_scale, row_codes_ptr, row_corrected_ptr, R, C, first, step, sub0,
                                               False, TILES_PER_PROGRAM, SUB, STAGES, DOT_FP32, GROUPED))
    else:
        tl.atomic_max(col_amax_ptr, _eden_jobs(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, rotation,
                                               tensor_scale, col_codes_ptr, col_corrected_ptr, R, C, first, step, sub0,
                                               True, TILES_PER_PROGRAM, SUB, STAGES, DOT_FP32, GROUPED))


@triton.jit
def _eden_finish(corrected_ptr, amax_ptr, codes_ptr, scales_ptr, scaled_ptr, tensor_scale_ptr, n_groups, block,
                 seed, counter0, GROUPS: tl.constexpr):
    """Phase two for GROUPS consecutive 16-groups of one tensor: tensor scale from the largest corrected scale,
    E4M3 stochastic rounding of each corrected scale, and code * group_scale for the emulated GEMM."""
    group = block * GROUPS + tl.arange(0, GROUPS)
    valid = group < n_groups
    tensor_scale = _tensor_scale(amax_ptr, _EDEN_FP8_MAX)
    target = tl.math.div_rn(tl.load(corrected_ptr + group, mask=valid, other=0.0), tensor_scale)
    scale = _e4m3_stochastic_round(target, tl.rand(seed, counter0 + group))
    tl.store(scales_ptr + group, _e4m3_bits(scale), mask=valid)
    if scaled_ptr is not None:
        packed = tl.load(codes_ptr + group[:, None] * 8 + tl.arange(0, 8)[None, :], mask=valid[:, None], other=0)
        value = _e2m1_value(_unpack(packed, GROUPS, 16)) * scale[:, None]
        element = group[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(scaled_ptr + element, value.to(scaled_ptr.dtype.element_ty), mask=valid[:, None])
    if block == 0:
        tl.store(tensor_scale_ptr, tensor_scale)


@triton.jit
def _eden_finish_kernel(
        seed_ptr,  # int64 [1]: Philox seed
        corrected1, amax1, codes1, scales1, scaled1, tensor_scale1, n_groups1,  # first tensor
        corrected2, amax2, codes2, scales2, scaled2, tensor_scale2, n_groups2,  # second (n_groups2 = 0: none)
        GROUPS: tl.constexpr):
    """MS-EDEN phase two for up to two tensors in one launch (E and E^T of one backward). Per element reads the
    codes and FP32 scales (0.75 B) and writes E4M3 scales and code * group_scale (2.06 B)."""
    seed = tl.load(seed_ptr)
    blocks1 = tl.cdiv(n_groups1, GROUPS)
    block = tl.program_id(0)
    if block < blocks1:
        _eden_finish(corrected1, amax1, codes1, scales1, scaled1, tensor_scale1, n_groups1, block, seed, 0, GROUPS)
    else:
        _eden_finish(corrected2, amax2, codes2, scales2, scaled2, tensor_scale2, n_groups2, block - blocks1, seed,
                     n_groups1, GROUPS)


# -----------------------------------------------------------------------------
# Dequantization


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, tensor_scale_ptr, out_ptr, C, ROWS: tl.constexpr,
                       TILE16: tl.constexpr, TENSOR_SCALE: tl.constexpr):
    """out [R, C] <- code * group_scale (* tensor_scale), one [ROWS, 128] tile per program."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _TILE
    values = _scaled_codes(codes_ptr, scales_ptr, row0, col0, C, ROWS, _TILE, TILE16)
    if TENSOR_SCALE:
        values = values * tl.load(tensor_scale_ptr)
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, _TILE)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], values.to(out_ptr.dtype.element_ty))


# -----------------------------------------------------------------------------
# Launching the kernels (on a CPU too, under TRITON_INTERPRET=1: that is how the tests check them without a GPU)


def check_matrix(x, row_multiple, col_multiple, what, transpose=False):
    """Raise a ValueError unless x is a non-empty 2-D BF16/FP16/FP32 tensor whose shape (transposed, if asked) is a
    multiple of [row_multiple, col_multiple]."""
    if not isinstance(x, torch.Tensor) or x.dtype not in KERNEL_DTYPES:
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} needs a bfloat16, float16 or float32 tensor, got {kind}")
    rows, cols = (x.shape[-1], x.shape[0]) if transpose else (x.shape[0] if x.dim() else 0, x.shape[-1])
    if x.dim() != 2 or x.numel() == 0 or rows % row_multiple or cols % col_multiple:
        raise ValueError(f"{what} needs a 2-D tensor whose {'transpose ' if transpose else ''}shape is a multiple of "
                         f"[{row_multiple}, {col_multiple}], got shape {tuple(x.shape)}")


def check_kernel_device(t, what):
    if not (t.is_cuda or t.is_cpu and INTERPRETED):
        raise ValueError(f"{what} runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got {t.device}")


def check_rotation(signs, sizes, what):
    """Raise a ValueError unless signs is a 1-D float tensor whose length is in sizes. (Only their sign bits are
    used by the kernels; the references also check that they are +-1.)"""
    if not isinstance(signs, torch.Tensor) or signs.dim() != 1 or signs.numel() not in sizes:
        shape = tuple(signs.shape) if isinstance(signs, torch.Tensor) else type(signs).__name__
        raise ValueError(f"{what} needs 1-D signs of length {' or '.join(map(str, sizes))}, got {shape}")


ROTATIONS = (16, 32, 128)  # rotation widths of the quantizer: NVIDIA's 16, TetraJet-v2's 32, MS-EDEN's 128


def _ceil_div(a, b):
    """ceil(a / b) for positive integers. (triton.cdiv is a Triton function: called from Python it costs ~10 us of
    host time per call, and the host bounds the small layers' speed.)"""
    return -(-a // b)


def _multiprocessors(device):
    """The GPU's multiprocessors; the interpreter pretends to have 5, so that the tests run phase one's loop over
    tiles and its end (the last tile done twice)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 5


def _persistent_grid(rows, cols, jobs_per_tile, programs_per_multiprocessor, multiprocessors):
    """(programs, tiles per program) of MS-EDEN phase one over [rows, cols]: as many programs as the multiprocessors
    hold at once, a multiple of jobs_per_tile, each doing one job of every (programs / jobs_per_tile)-th tile."""
    tiles = rows * cols // TILE**2
    per_job = min(tiles, max(1, programs_per_multiprocessor * multiprocessors // jobs_per_tile))
    return per_job * jobs_per_tile, _ceil_div(tiles, per_job)


def _dot_fp32(x):
    """Rotate in FP32 for FP32 input (and always in the interpreter); BF16 input rotates exactly in BF16."""
    return INTERPRETED or x.dtype != torch.bfloat16


def _grouped_order(dot_fp32):
    """Whether MS-EDEN phase one rotates with the GROUPED matrix (_grouped): for the tensor-core dot of BF16, and
    in the interpreter, which checks it. A GPU's FP32 dot runs on FMA units in a layout of its own, which the order
    does not fit, and with it the largest corrected scale came out wrong on the H200 (cause not found, NOTES.md)."""
    return INTERPRETED or not dot_fp32


def draw_seed(device):
    """A Philox seed drawn on the device from torch's generator: no host synchronization, a fresh seed on every
    replay of a captured CUDA graph, and reproducible after torch.manual_seed."""
    return torch.randint(2**31 - 1, (1,), device=device)


def _amax(x, transpose=False, signs=None):
    """Absolute maximum of x (or of rht(x or x^T, signs)) as int32 bits in a 1-element tensor, without a host sync."""
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    if signs is None:  # without rotation, x^T has the maximum of x
        x = x.contiguous()
        _amax_kernel[(_ceil_div(x.numel(), AMAX_BLOCK),)](x, amax, x.numel(), BLOCK=AMAX_BLOCK)
        return amax
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    block = ROTATED_AMAX_ROWS if rows % ROTATED_AMAX_ROWS == 0 else QUANTIZE_ROWS
    _rotated_amax_kernel[(rows // block, cols // TILE)](
        x, *x.stride(), signs, amax, ROWS=block, N=signs.numel(), TRANSPOSE=transpose, DOT_FP32=_dot_fp32(x))
    return amax


def empty_quantized(rows, cols, block, out_dtype, device):
    """Outputs of a quantizer of [rows, cols]: codes, group scales, tensor scale, code * group_scale."""
    return (torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),) + empty_scales(rows, cols, block,
                                                                                             out_dtype, device)


def empty_scales(rows, cols, block, out_dtype, device):
    """The outputs besides the codes: group scales, tensor scale, code * group_scale."""
    scale_rows = rows if block == "1x16" else rows // GROUP
    return (torch.empty(scale_rows, cols // GROUP, dtype=torch.float8_e4m3fn, device=device),
            torch.empty((), dtype=torch.float32, device=device),
            torch.empty(rows, cols, dtype=out_dtype, device=device))


def triton_quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False,
                    signs=None, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """The kernel version of quantize_nvfp4 for x [R, C] (or x^T, rotated by signs if given): R a multiple of 16,
    C of 128 (after transposing). Returns an NVFP4Tensor, with code * group_scale in out_dtype if scaled_codes."""
    check_matrix(x, QUANTIZE_ROWS, TILE, "triton_quantize", transpose)
    check_kernel_device(x, "triton_quantize")
    fp8_max = default_fp8_max(four_over_six)
    check_quantizer(rounding, block, fp4_max, fp8_max, four_over_six)
    if signs is not None:
        check_rotation(signs, ROTATIONS, "triton_quantize")
        signs = signs.to(device=x.device, dtype=torch.float32)
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    codes, scales, tensor_scale, scaled = empty_quantized(rows, cols, block, out_dtype, x.device)
    if rounding == "sr" and seed is None:
        seed = draw_seed(x.device)
    _quantize_kernel[(rows // QUANTIZE_ROWS, cols // TILE)](
        x, *x.stride(), signs, _amax(x, transpose, signs), seed if rounding == "sr" else None,
        codes, scales.view(torch.uint8), scaled if scaled_codes else None, tensor_scale,
        cols, fp4_max, fp8_max,
        ROWS=QUANTIZE_ROWS, TRANSPOSE=transpose, ROTATION=0 if signs is None else signs.numel(),
        STOCHASTIC=rounding == "sr", FOUR_OVER_SIX=four_over_six, TILE16=block == "16x16",
        DOT_FP32=_dot_fp32(x), num_warps=QUANTIZE_WARPS)
    return NVFP4Tensor(codes, scales, tensor_scale, torch.Size((rows, cols)), block, scaled if scaled_codes else None)


def _phase1_outputs(rows, cols, device):
    """Phase-one outputs for an MS-EDEN result [rows, cols]: packed codes, FP32 corrected scales, their maximum."""
    return (torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),
            torch.empty(rows, cols // GROUP, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def _launch_phase1(inputs, signs, rows, cols, row_out, col_out, launch, dot_fp32):
    """_eden_kernel over an input [rows, cols]: inputs are its first six arguments (x and its strides, or the NVFP4
    tensor's codes, scale bits and tensor scale); row_out None for the column jobs only; launch a key of
    EDEN_LAUNCH."""
    device = col_out[0].device
    warps, registers, programs_per_multiprocessor, stages = EDEN_LAUNCH[launch]
    jobs_per_tile = (1 if row_out is None else 2) * TILE // EDEN_SUB
    programs, per_program = _persistent_grid(rows, cols, jobs_per_tile, programs_per_multiprocessor,
                                             _multiprocessors(device))
    _eden_kernel[(programs,)](
        *inputs, signs.to(device=device, dtype=torch.float32), *(row_out or (None, None, None)), *col_out,
        rows, cols, TILES_PER_PROGRAM=per_program, SUB=EDEN_SUB, STAGES=stages, DOT_FP32=dot_fp32,
        GROUPED=_grouped_order(dot_fp32), num_warps=warps, maxnreg=registers)


def eden_phase1(x, signs):
    """Phase one for x [R, C] rotated along C and for x^T [C, R] rotated along R, from one read of x. Returns two
    (packed codes, FP32 corrected scales, largest corrected scale as int32 bits)."""
    check_matrix(x, TILE, TILE, "MS-EDEN")
    check_kernel_device(x, "MS-EDEN")
    check_rotation(signs, (HADAMARD,), "MS-EDEN")
    rows, cols = x.shape
    row_out, col_out = _phase1_outputs(rows, cols, x.device), _phase1_outputs(cols, rows, x.device)
    dot_fp32 = _dot_fp32(x)
    _launch_phase1((x, *x.stride(), None, None, None), signs, rows, cols, row_out, col_out,
                   "fp32" if dot_fp32 else "bf16", dot_fp32)
    return row_out, col_out


def check_nvfp4(q, what, multiple):
    """Raise a ValueError unless q is a 2-D 1x16 NVFP4Tensor whose shape is a multiple of [multiple, multiple]."""
    if not isinstance(q, NVFP4Tensor) or q.block != "1x16" or len(q.shape) != 2:
        raise ValueError(f"{what} needs a 2-D NVFP4Tensor with 1x16 groups, got {type(q).__name__}")
    if q.shape[0] % multiple or q.shape[1] % multiple:
        raise ValueError(f"{what} needs a shape that is a multiple of [{multiple}, {multiple}], got {tuple(q.shape)}")


def eden_phase1_requantize(q, signs):
    """Phase one for q.dequantize()^T, q a 1x16 NVFP4 tensor [R, C]: dequantize, transpose, rotate along R. (Its
    input, code * group_scale, is exact in BF16: the GPU rotates it on tensor cores whatever q's source was.)"""
    check_nvfp4(q, "requantize_ms_eden", TILE)
    check_kernel_device(q.codes, "requantize_ms_eden")
    check_rotation(signs, (HADAMARD,), "requantize_ms_eden")
    rows, cols = q.shape
    out = _phase1_outputs(cols, rows, q.codes.device)
    _launch_phase1((None, 0, 0, q.codes, q.group_scale.view(torch.uint8), q.tensor_scale), signs, rows, cols, None,
                   out, "nvfp4", INTERPRETED)
    return out


def eden_phase2(first, second=None, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """Phase two for one or two phase-one results (codes, corrected scales, their maximum), in one launch.
    Returns the NVFP4 tensor, or a pair of them."""
    parts = [first] if second is None else [first, second]
    seed = draw_seed(first[0].device) if seed is None else seed
    results, arguments = [], []
    for codes, corrected, amax in parts:
        rows, cols = codes.shape[0], codes.shape[1] * 2
        scales, tensor_scale, scaled = empty_scales(rows, cols, "1x16", out_dtype, codes.device)
        scaled = scaled if scaled_codes else None
        results.append(NVFP4Tensor(codes, scales, tensor_scale, torch.Size((rows, cols)), "1x16", scaled))
        arguments.append((corrected, amax, codes, scales.view(torch.uint8), scaled, tensor_scale, corrected.numel()))
    blocks = sum(_ceil_div(a[-1], FINISH_GROUPS) for a in arguments)
    if second is None:
        arguments.append(arguments[0][:-1] + (0,))  # an empty second tensor
    _eden_finish_kernel[(blocks,)](seed, *arguments[0], *arguments[1], GROUPS=FINISH_GROUPS)
    return results[0] if second is None else tuple(results)


def triton_ms_eden_pair(x, signs, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """MS-EDEN of x [R, C] rotated along C and of x^T [C, R] rotated along R, from one read of x."""
    row_out, col_out = eden_phase1(x, signs)
    return eden_phase2(row_out, col_out, seed, out_dtype, scaled_codes)


def triton_requantize_ms_eden(q, signs, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """MS-EDEN of q.dequantize()^T for a 1x16 NVFP4 tensor q [R, C]: one pass over q, then phase two."""
    return eden_phase2(eden_phase1_requantize(q, signs), None, seed, out_dtype, scaled_codes)


def triton_dequantize(q, dtype=torch.float32, tensor_scale=True):
    """q.dequantize(dtype, tensor_scale) for a 2-D NVFP4Tensor whose shape is a multiple of [16, 128]."""
    if not isinstance(q, NVFP4Tensor) or len(q.shape) != 2 or q.shape[0] % DEQUANTIZE_ROWS or q.shape[1] % TILE:
        raise ValueError(f"triton_dequantize needs a 2-D NVFP4Tensor whose shape is a multiple of "
                         f"[{DEQUANTIZE_ROWS}, {TILE}], got {getattr(q, 'shape', type(q).__name__)}")
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.codes.device)
    _dequantize_kernel[(rows // DEQUANTIZE_ROWS, cols // TILE)](
        q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, out, cols, ROWS=DEQUANTIZE_ROWS,
        TILE16=q.block == "16x16", TENSOR_SCALE=tensor_scale)
    return out


# -----------------------------------------------------------------------------
# The operators torch.compile sees: plain tensors in and out, the kernels on CUDA, the references elsewhere, and a
# shape-only fake version for tracing

Quantized = tuple[Tensor, Tensor, Tensor, Tensor]  # codes, group scale bits (uint8), tensor scale, code * scale
QuantizedPair = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # two of them


def _parts(q):
    """The tensors of q, its E4M3 scales as their uint8 bits (operators pass plain integer and float tensors)."""
    return q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, q.scaled_codes


def _nvfp4(parts, block):
    """The NVFP4Tensor of an operator's tensors (_parts' inverse); the code * group_scale cache may be None."""
    codes, scale_bits, tensor_scale, scaled = parts
    return NVFP4Tensor(codes, scale_bits.view(torch.float8_e4m3fn), tensor_scale,
                       torch.Size((codes.shape[0], codes.shape[1] * 2)), block, scaled)


def _fake(rows, cols, block, out_dtype, device):
    """Outputs of the right shapes and dtypes, for tracing."""
    codes, scales, tensor_scale, scaled = empty_quantized(rows, cols, block, out_dtype, device)
    return codes, scales.view(torch.uint8), tensor_scale, scaled


def _reference_parts(q, out_dtype):
    q.scaled_codes = q.dequantize(out_dtype, tensor_scale=False)
    return _parts(q)


def _generator(seed):
    """A CPU generator seeded from the op's seed tensor, so that the references draw reproducibly from it too."""
    return None if seed is None else torch.Generator().manual_seed(int(seed.item()))


@torch.library.custom_op("nanoquartet::quantize", mutates_args=())
def _quantize_op(x: Tensor, signs: Optional[Tensor], seed: Optional[Tensor], rounding: str, four_over_six: bool,
                 block: str, fp4_max: float, transpose: bool, out_dtype: torch.dtype) -> Quantized:
    if x.is_cuda:
        return _parts(triton_quantize(x, rounding, four_over_six, block, fp4_max, transpose, signs, seed, out_dtype))
    x = x.t() if transpose else x
    x = rht(x, signs) if signs is not None else x
    return _reference_parts(quantize_nvfp4(x, rounding, four_over_six, block, fp4_max, generator=_generator(seed)),
                            out_dtype)


@_quantize_op.register_fake
def _(x, signs, seed, rounding, four_over_six, block, fp4_max, transpose, out_dtype):
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    return _fake(rows, cols, block, out_dtype, x.device)


@torch.library.custom_op("nanoquartet::ms_eden_pair", mutates_args=())
def _ms_eden_pair_op(x: Tensor, signs: Tensor, seed: Tensor, out_dtype: torch.dtype) -> QuantizedPair:
    if x.is_cuda:
        rows, cols = triton_ms_eden_pair(x, signs, seed, out_dtype)
        return _parts(rows) + _parts(cols)
    generator = _generator(seed)
    return (_reference_parts(quantize_ms_eden(x, signs, generator), out_dtype)
            + _reference_parts(quantize_ms_eden(x.t(), signs, generator), out_dtype))


@_ms_eden_pair_op.register_fake
def _(x, signs, seed, out_dtype):
    rows, cols = x.shape
    return _fake(rows, cols, "1x16", out_dtype, x.device) + _fake(cols, rows, "1x16", out_dtype, x.device)


@torch.library.custom_op("nanoquartet::requantize_ms_eden", mutates_args=())
def _requantize_op(codes: Tensor, group_scale: Tensor, tensor_scale: Tensor, signs: Tensor, seed: Tensor,
                   out_dtype: torch.dtype) -> Quantized:
    q = _nvfp4((codes, group_scale, tensor_scale, None), "1x16")
    if codes.is_cuda:
        return _parts(triton_requantize_ms_eden(q, signs, seed, out_dtype))
    return _reference_parts(quantize_ms_eden(q.dequantize().t(), signs, _generator(seed)), out_dtype)


@_requantize_op.register_fake
def _(codes, group_scale, tensor_scale, signs, seed, out_dtype):
    return _fake(codes.shape[1] * 2, codes.shape[0], "1x16", out_dtype, codes.device)


@torch.library.custom_op("nanoquartet::dequantize", mutates_args=())
def _dequantize_op(codes: Tensor, group_scale: Tensor, tensor_scale: Tensor, block: str, dtype: torch.dtype,
                   with_tensor_scale: bool) -> Tensor:
    q = _nvfp4((codes, group_scale, tensor_scale, None), block)
    if codes.is_cuda and q.shape[0] % DEQUANTIZE_ROWS == 0 and q.shape[1] % TILE == 0:
        return triton_dequantize(q, dtype, with_tensor_scale)
    return q.dequantize(dtype, with_tensor_scale)


@_dequantize_op.register_fake
def _(codes, group_scale, tensor_scale, block, dtype, with_tensor_scale):
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=dtype)


# -----------------------------------------------------------------------------
# What model.py calls


def quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False, signs=None,
             out_dtype=None):
    """NVFP4 quantization of x [R, C] along C (or of x^T along R, rotated by signs if given): R a multiple of 16 and
    C of 128 (after transposing). The result carries code * group_scale in out_dtype (default x's dtype)."""
    check_matrix(x, QUANTIZE_ROWS, TILE, "quantize", transpose)
    check_quantizer(rounding, block, fp4_max, default_fp8_max(four_over_six), four_over_six)
    if signs is not None:
        check_rotation(signs, ROTATIONS, "quantize")
    seed = draw_seed(x.device) if rounding == "sr" else None
    parts = torch.ops.nanoquartet.quantize(x, signs, seed, rounding, four_over_six, block, float(fp4_max), transpose,
                                           out_dtype or x.dtype)
    return _nvfp4(parts, block)


def ms_eden_pair(x, signs, out_dtype=None):
    """(MS-EDEN of x [R, C] along C, MS-EDEN of x^T along R), both rotated by the 128 signs, from one read of x."""
    check_matrix(x, TILE, TILE, "ms_eden_pair")
    check_rotation(signs, (HADAMARD,), "ms_eden_pair")
    parts = torch.ops.nanoquartet.ms_eden_pair(x, signs, draw_seed(x.device), out_dtype or x.dtype)
    return _nvfp4(parts[:4], "1x16"), _nvfp4(parts[4:], "1x16")


def requantize_ms_eden(q, signs, out_dtype=torch.bfloat16):
    """MS-EDEN of the transpose of a saved 1x16 NVFP4 tensor (the backward's re-quantization of X and W)."""
    check_nvfp4(q, "requantize_ms_eden", TILE)
    check_rotation(signs, (HADAMARD,), "requantize_ms_eden")
    parts = torch.ops.nanoquartet.requantize_ms_eden(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, signs,
                                                     draw_seed(q.codes.device), out_dtype)
    return _nvfp4(parts, "1x16")


def dequantize(q, dtype=torch.float32, tensor_scale=True):
    """q.dequantize(dtype, tensor_scale): the kernel for 2-D CUDA tensors whose shape it tiles, else the reference."""
    if len(q.shape) != 2:
        return q.dequantize(dtype, tensor_scale)
    return torch.ops.nanoquartet.dequantize(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, q.block, dtype,
                                            tensor_scale)


# -----------------------------------------------------------------------------
# The GEMM


def blocked_scales(group_scale):
    """[rows, K/16] E4M3 scales -> cuBLAS's 128x4 blocked layout (flat): pad to [round_up(rows, 128),
    round_up(K/16, 4)], cut into 128x4 tiles in row-major tile order; inside a tile, element (r, c) goes to byte
    (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = group_scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
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
    """Whether `device` has FP4 tensor cores (Blackwell, sm_100+) and this PyTorch can drive them."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
            and hasattr(torch.nn.functional, "scaled_mm") and hasattr(torch, "float4_e2m1fn_x2"))


def _operand(q, dtype):
    if q.scaled_codes is not None:
        return q.scaled_codes if q.scaled_codes.dtype == dtype else q.scaled_codes.to(dtype)
    return dequantize(q, dtype, tensor_scale=False)


def nvfp4_mm(a, b, out_dtype=torch.bfloat16):
    """a @ b^T for NVFP4 tensors a [M, K] and b [N, K] quantized along K: native on sm_100+, emulated elsewhere, where
    the product of the two FP32 tensor scales is applied where it is cheapest: to the smaller input (a weight, one
    BF16 rounding the native GEMM does not have) or to the output."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"nvfp4_mm needs a common K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if native_fp4_available(a.codes.device):
        return torch.nn.functional.scaled_mm(**native_mm_args(a, b, out_dtype))
    a_values, b_values = _operand(a, out_dtype), _operand(b, out_dtype)
    alpha = a.tensor_scale * b.tensor_scale
    if b_values.numel() <= a.shape[0] * b.shape[0]:  # fold the tensor scales into the (smaller) weight operand
        return a_values @ (b_values * alpha).to(out_dtype).t()
    return ((a_values @ b_values.t()) * alpha).to(out_dtype)
