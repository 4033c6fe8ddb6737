"""
Fast versions: Triton kernels that compute exactly what quantize.py and eden.py compute, and the NVFP4 GEMM.

Why kernels at all. On a Blackwell GPU the three GEMMs of a linear layer run natively in NVFP4. On Hopper (H100/H200)
and older there are no FP4 tensor cores: the GEMMs run in BF16 on the dequantized operands ("emulated" NVFP4, same
numbers, BF16 speed), so everything Quartet II adds is the quantization itself. Quantizing is memory-bound (a few
operations per byte), so the kernels are judged by how few bytes they move and how close they get to the copy
bandwidth. Bytes per element: BF16 = 2, packed NVFP4 = 0.5 (codes) + 1/16 (E4M3 scales) = 0.5625.

The kernels (each a Triton program over a tile; everything in between stays in registers):

- _amax_kernel: the tensor's absolute maximum (optionally of the transposed, rotated tensor), one read (2 B/elt).
  The maximum is reduced on the float's bit pattern as an integer, which orders non-negative floats correctly and
  makes NaN win, so a NaN anywhere poisons the tensor scale.
- _quantize_kernel: RTN or SR, 1x16 or 16x16, optional four-over-six, optional transposed read and 16/128-wide
  Hadamard rotation. Reads x (2) and writes the packed codes and E4M3 scales (0.5625) plus, for the emulated GEMM,
  code * group_scale in BF16 (2), which is exact (at most 6 significant bits). With the amax pass: ~6.6 B/elt.
- _eden_kernel: RHT-128 + MS-EDEN, phase one, for a 128x128 tile read once: it can emit the tile rotated along its
  rows (E for dX) and along its columns (E^T for dW) from that single read, or read a saved NVFP4 tensor and emit its
  transpose (re-quantization of X and W for the backward: dequantize + transpose + rotate + MS-EDEN in one pass). The
  rotation is a tensor-core dot with the +-1 Hadamard matrix, which the kernel generates in registers from the signs
  (H[i, j] = (-1)^popcount(i & j)); its products are exact in BF16, and 1/sqrt(128) is applied in FP32. It
  writes the packed codes and the corrected scales in FP32, and reduces the largest corrected scale: post hoc range
  alignment (see eden.py), so no separate pass for the global maximum is needed.
- _eden_finish_kernel: phase two, tiny: picks the tensor scale from that maximum, stochastically rounds every
  corrected scale to E4M3, and writes code * group_scale in BF16 for the emulated GEMM. Per element of E (both
  orientations): read 2, then per output 0.75 written + 0.75 read back + 2 written: ~9 B/elt.
- _dequantize_kernel: codes * scales (* tensor scale) to BF16 or FP32.

Exactness. Each kernel performs the reference's floating-point operations in the same order (IEEE division via
div_rn, E2M1/E4M3 rounding with integer bit arithmetic that is exact on every backend, the four-over-six errors in
FP64 so the choice does not depend on summation order), so codes and scales are bit-identical to the reference.
Two exceptions. The rotation, at float32 round-off: the kernel sums +-x on tensor cores (whose FP32 accumulation
order, and on GPUs alignment, is their own) and scales once; the reference multiplies by +-1/sqrt(128) and sums in
another order. That moves a value across a rounding boundary for a few elements in 10^4 at most (the tests bound
it). And the random bits (Philox from tl.rand here, torch's generator in the reference), so random
outputs are compared by their statistics and by lying on the two neighbours the reference allows.

The GEMM. nvfp4_mm(a, b) = a @ b^T for two NVFP4Tensors quantized along K. On sm_100+ it calls cuBLAS through
torch.nn.functional.scaled_mm with the packed codes as float4_e2m1fn_x2 and the scales rearranged into cuBLAS's 128x4
blocked layout (blocked_scales). Elsewhere it multiplies the BF16 code * group_scale operands and applies the product
of the two FP32 tensor scales where it is cheapest: to the smaller input operand (a weight) or to the output. That
costs one BF16 rounding the native GEMM does not have; the operands themselves are exact.

Dispatch. quantize, ms_eden_pair, requantize_ms_eden, dequantize and nvfp4_mm are what model.py calls: on a
CUDA tensor they run the kernels, on a CPU tensor the references in quantize.py and eden.py. The triton_* functions
run the kernels on any device (on a CPU under TRITON_INTERPRET=1, which is how the tests check them without a GPU).
"""

import math
import os

import torch
import triton
import triton.language as tl

from eden import EDEN_FP4_MAX, EDEN_FP8_MAX, HADAMARD, quantize_ms_eden, rht
from quantize import E2M1_MAX, E4M3_MAX, GROUP, NVFP4Tensor, quantize_nvfp4

# The Triton interpreter (CPU) gets BF16 dots wrong; there the rotation runs in FP32, exact for BF16 values.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TILE = 128  # columns per program, and rows and columns of an MS-EDEN tile
QUANTIZE_ROWS = 32  # rows per program of the RTN/SR quantizer (and of the rotated amax)
QUANTIZE_WARPS = 8
EDEN_WARPS = 16  # warps per 128x128 MS-EDEN tile (fewer registers per thread than 8)
FINISH_GROUPS = 256  # groups per program of the MS-EDEN second phase
AMAX_BLOCK = 4096  # elements per program of the plain amax pass
# constants the kernels read (Triton kernels may only read globals marked constexpr)
_EDEN_FP4_MAX = tl.constexpr(EDEN_FP4_MAX)
_EDEN_FP8_MAX = tl.constexpr(EDEN_FP8_MAX)
_INV_SQRT_128 = tl.constexpr(1 / math.sqrt(128))

# -----------------------------------------------------------------------------
# Device helpers: small floats by bit arithmetic


@triton.jit
def _power_of_two(exponent):
    """float32 2^exponent for an int32 exponent in [-126, 127], built from its bits."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(x, noise, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr,
                   STOCHASTIC: tl.constexpr):
    """|x| rounded to the grid of a small float (as quantize._round_to_grid): nearest-even, or up with probability
    equal to the distance from the lower neighbour when STOCHASTIC (noise ~ U[0,1)). Returns the magnitude."""
    magnitude = tl.minimum(tl.abs(x), MAX)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
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
def _e2m1_code(magnitude, x):
    """4-bit code of an E2M1 grid magnitude, with the sign bit of x (as quantize.encode_e2m1)."""
    bits = magnitude.to(tl.int32, bitcast=True)
    code = tl.where(magnitude >= 1.0, (bits >> 22) - 252, (magnitude * 2.0).to(tl.int32))  # 1.0 -> 2 ... 6.0 -> 7
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    return code | sign


@triton.jit
def _e2m1_value(code):
    """float32 value of a 4-bit code."""
    magnitude_code = code & 7
    normal = ((((magnitude_code >> 1) + 126) << 23) | ((magnitude_code & 1) << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(magnitude_code >= 2, normal, magnitude_code.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3_bits(value):
    """uint8 bits of a non-negative float32 that lies on the E4M3 grid (NaN -> 0x7F)."""
    bits = value.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    subnormal = (value * 512.0).to(tl.int32)  # multiples of 2^-9
    code = tl.where(value >= 0.015625, normal, subnormal)
    return tl.where(value != value, 0x7F, code).to(tl.uint8)


@triton.jit
def _e4m3_value(bits):
    """float32 value of non-negative E4M3 bits."""
    bits = bits.to(tl.int32)
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * 0.001953125)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _tensor_scale(amax_ptr, limit):
    """As quantize.tensor_scale_for: amax / limit, 1 if amax is 0, NaN if amax is not finite."""
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, limit))
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
def _rotate(tile, signs_ptr, N: tl.constexpr, DOT_FP32: tl.constexpr):
    """tile [rows, 128] times diag(s) * H_pm1 for each N-chunk (N = 16 or 128), accumulated in FP32. The +-1
    Hadamard matrix is generated in registers: H[i, j] = (-1)^popcount(i & j) (Sylvester), zero off the diagonal
    blocks when N < 128."""
    i = tl.arange(0, 128)[:, None]
    j = tl.arange(0, 128)[None, :]
    bits = i & j & (N - 1)
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)  # bit 0 is now the parity of i & j
    signs = tl.load(signs_ptr + tl.arange(0, 128) % N)[:, None]
    rotation = tl.where((i // N) == (j // N), (1 - 2 * (bits & 1)).to(tl.float32) * signs, 0.0)
    if DOT_FP32:  # FP32 inputs: exact products, no TF32 truncation
        return tl.dot(tile.to(tl.float32), rotation, input_precision="ieee")
    return tl.dot(tile.to(tl.bfloat16), rotation.to(tl.bfloat16))


@triton.jit
def _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    return tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c)


@triton.jit
def _uniform_noise(seed, first, COUNT: tl.constexpr):
    """COUNT uniform floats in [0, 1) for counters first ... first + COUNT - 1: Philox makes four 32-bit numbers
    per call, all of them used (tl.rand would use one)."""
    a, b, c, d = tl.randint4x(seed, first // 4 + tl.arange(0, COUNT // 4))
    bits = tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), (COUNT,))
    return tl.random.uint_to_uniform_float(bits)


# -----------------------------------------------------------------------------
# The absolute maximum


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x|; as integers, NaN > Inf > every finite value
    tl.atomic_max(amax_ptr, tl.max(bits, axis=0))


@triton.jit
def _rotated_amax_kernel(x_ptr, stride_r, stride_c, signs_ptr, amax_ptr, ROWS: tl.constexpr, N: tl.constexpr,
                         SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
    tile = _load_tile(x_ptr, stride_r, stride_c, tl.program_id(0) * ROWS, tl.program_id(1) * 128, ROWS, 128)
    rotated = _rotate(tile, signs_ptr, N, DOT_FP32) * SCALE
    bits = rotated.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))


# -----------------------------------------------------------------------------
# RTN / SR quantization, 1x16 or 16x16, optional four-over-six, transpose and rotation


@triton.jit
def _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, STOCHASTIC: tl.constexpr,
                     TILE16: tl.constexpr):
    """One quantization of [R/16, 16, 8, 16] groups (as quantize._quantize_groups): E2M1 magnitudes, E4M3 scales,
    and the squared error per group in FP64."""
    target = tl.math.div_rn(tl.math.div_rn(group_amax, fp4_max), tensor_scale)
    scale = _round_to_grid(target, target, 3, -6, 448.0, False)
    scale = tl.where(scale == 0, 1.0, scale)
    inverse = tl.math.div_rn(1.0, scale * tensor_scale)
    magnitude = _round_to_grid(groups * inverse, noise, 1, 0, 6.0, STOCHASTIC)
    value = tl.where(groups.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)
    difference = groups.to(tl.float64) - value.to(tl.float64) * scale.to(tl.float64) * tensor_scale.to(tl.float64)
    error = tl.sum(difference * difference, axis=3, keep_dims=True)
    if TILE16:
        error = tl.sum(error, axis=1, keep_dims=True)
    return magnitude, scale, error


@triton.jit
def _quantize_kernel(x_ptr, stride_r, stride_c, signs_ptr, amax_ptr, seed,
                     codes_ptr, scales_ptr, scaled_ptr, tensor_scale_ptr,
                     C, fp4_max, fp4_max_46, limit,
                     ROWS: tl.constexpr, ROTATE: tl.constexpr, N: tl.constexpr, SCALE: tl.constexpr,
                     STOCHASTIC: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, TILE16: tl.constexpr,
                     WRITE_SCALED: tl.constexpr, DOT_FP32: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * 128
    tile = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, 128).to(tl.float32)  # [ROWS, 128]
    if ROTATE:
        tile = _rotate(tile, signs_ptr, N, DOT_FP32) * SCALE  # 1/sqrt(N)
    groups = tl.reshape(tile, (ROWS // 16, 16, 8, 16))  # [row tiles, row in tile, group, element]
    group_amax = tl.max(tl.abs(groups), axis=3, keep_dims=True)
    if TILE16:
        group_amax = tl.max(group_amax, axis=1, keep_dims=True)
    tensor_scale = _tensor_scale(amax_ptr, limit)

    noise = groups  # unused unless STOCHASTIC
    if STOCHASTIC:
        first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * (ROWS * 128)  # this tile's counters
        noise = tl.reshape(_uniform_noise(seed, first, ROWS * 128), (ROWS // 16, 16, 8, 16))
    magnitude, scale, error = _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, STOCHASTIC, TILE16)
    if FOUR_OVER_SIX:
        magnitude4, scale4, error4 = _quantize_branch(groups, group_amax, fp4_max_46, tensor_scale, noise,
                                                      STOCHASTIC, TILE16)
        magnitude = tl.where(error4 < error, magnitude4, magnitude)  # a tie keeps the 6-branch
        scale = tl.where(error4 < error, scale4, scale)

    codes = tl.reshape(_e2m1_code(magnitude, groups), (ROWS, 128))
    half = col0 // 2 + tl.arange(0, 64)
    rows = row0 + tl.arange(0, ROWS)
    tl.store(codes_ptr + rows[:, None] * (C // 2) + half[None, :], _pack(codes, ROWS, 128))
    groups_out = col0 // 16 + tl.arange(0, 8)
    if TILE16:
        tiles = row0 // 16 + tl.arange(0, ROWS // 16)
        tl.store(scales_ptr + tiles[:, None] * (C // 16) + groups_out[None, :],
                 _e4m3_bits(tl.reshape(scale, (ROWS // 16, 8))))
    else:
        tl.store(scales_ptr + rows[:, None] * (C // 16) + groups_out[None, :],
                 _e4m3_bits(tl.reshape(scale, (ROWS, 8))))
    if WRITE_SCALED:
        value = tl.where(groups.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude) * scale
        cols = col0 + tl.arange(0, 128)
        tl.store(scaled_ptr + rows[:, None] * C + cols[None, :], tl.reshape(value, (ROWS, 128)).to(tl.bfloat16))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(tensor_scale_ptr, tensor_scale)


# -----------------------------------------------------------------------------
# MS-EDEN: phase one (rotate, codes, corrected scales, their maximum) and phase two (tensor scale, SR of scales)


@triton.jit
def _eden_groups(rotated, ROWS: tl.constexpr):
    """As eden.eden_groups on [ROWS, 128] rotated values: 4-bit codes [ROWS, 128], corrected scales [ROWS, 8]."""
    groups = tl.reshape(rotated, (ROWS, 8, 16))
    scale = tl.math.div_rn(tl.max(tl.abs(groups), axis=2, keep_dims=True), _EDEN_FP4_MAX)
    scaled = groups * tl.math.div_rn(1.0, tl.where(scale == 0, 1.0, scale))
    magnitude = _round_to_grid(scaled, scaled, 1, 0, 6.0, False)
    value = tl.where(scaled.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)
    norm = tl.sum(scaled * scaled, axis=2, keep_dims=True)
    overlap = tl.sum(scaled * value, axis=2, keep_dims=True)
    correction = tl.where(overlap > 0, tl.math.div_rn(norm, overlap), 1.0)
    codes = tl.reshape(_e2m1_code(magnitude, scaled), (ROWS, 128))
    return codes, tl.reshape(scale * correction, (ROWS, 8))


@triton.jit
def _eden_store(rotated, codes_ptr, corrected_ptr, amax_ptr, row0, col0, width):
    """Phase-one outputs of a rotated [128, 128] tile at (row0, col0) of an output [*, width]."""
    codes, corrected = _eden_groups(rotated, 128)
    rows = row0 + tl.arange(0, 128)
    half = col0 // 2 + tl.arange(0, 64)
    tl.store(codes_ptr + rows[:, None] * (width // 2) + half[None, :], _pack(codes, 128, 128))
    groups = col0 // 16 + tl.arange(0, 8)
    tl.store(corrected_ptr + rows[:, None] * (width // 16) + groups[None, :], corrected)
    bits = corrected.to(tl.int32, bitcast=True)  # non-negative (or NaN): integer order is float order
    tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _eden_kernel(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, in_tensor_scale_ptr, signs_ptr,
                 row_codes_ptr, row_corrected_ptr, row_amax_ptr, col_codes_ptr, col_corrected_ptr, col_amax_ptr,
                 R, C, FROM_NVFP4: tl.constexpr, ROWS_OUT: tl.constexpr, COLS_OUT: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    """One 128x128 tile of an [R, C] input (BF16/FP32, or NVFP4 along C): MS-EDEN phase one of the tile rotated along
    C (output [R, C]) and/or of its transpose rotated along R (output [C, R])."""
    row0 = tl.program_id(0) * 128
    col0 = tl.program_id(1) * 128
    scale = _INV_SQRT_128
    if FROM_NVFP4:  # code * group scale is exact in BF16; the tensor scale joins the 1/sqrt(128) in FP32
        rows = row0 + tl.arange(0, 128)
        packed = tl.load(in_codes_ptr + rows[:, None] * (C // 2) + (col0 // 2 + tl.arange(0, 64))[None, :])
        group_scale = _e4m3_value(tl.load(in_scales_ptr + rows[:, None] * (C // 16)
                                          + (col0 // 16 + tl.arange(0, 8))[None, :]))
        values = tl.reshape(_e2m1_value(_unpack(packed, 128, 128)), (128, 8, 16)) * group_scale[:, :, None]
        tile = tl.reshape(values, (128, 128))
        scale = scale * tl.load(in_tensor_scale_ptr)
    else:
        tile = _load_tile(x_ptr, stride_r, stride_c, row0, col0, 128, 128)
    if ROWS_OUT:
        rotated = _rotate(tile, signs_ptr, 128, DOT_FP32) * scale
        _eden_store(rotated, row_codes_ptr, row_corrected_ptr, row_amax_ptr, row0, col0, C)
    if COLS_OUT:
        rotated = _rotate(tl.trans(tile), signs_ptr, 128, DOT_FP32) * scale
        _eden_store(rotated, col_codes_ptr, col_corrected_ptr, col_amax_ptr, col0, row0, R)


@triton.jit
def _eden_finish(corrected_ptr, amax_ptr, codes_ptr, scales_ptr, scaled_ptr, tensor_scale_ptr, n_groups, block,
                 seed, counter0, GROUPS: tl.constexpr, WRITE_SCALED: tl.constexpr):
    """Phase two for GROUPS consecutive 16-groups of one tensor: tensor scale from the largest corrected scale,
    E4M3 stochastic rounding of each corrected scale, and code * group_scale in BF16."""
    group = block * GROUPS + tl.arange(0, GROUPS)
    valid = group < n_groups
    tensor_scale = _tensor_scale(amax_ptr, _EDEN_FP8_MAX)
    target = tl.math.div_rn(tl.load(corrected_ptr + group, mask=valid, other=0.0), tensor_scale)
    noise = tl.rand(seed, counter0 + group)
    scale = _round_to_grid(target, noise, 3, -6, 448.0, True)
    tl.store(scales_ptr + group, _e4m3_bits(scale), mask=valid)
    if WRITE_SCALED:
        packed = tl.load(codes_ptr + group[:, None] * 8 + tl.arange(0, 8)[None, :], mask=valid[:, None], other=0)
        value = _e2m1_value(_unpack(packed, GROUPS, 16)) * scale[:, None]
        element = group[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(scaled_ptr + element, value.to(tl.bfloat16), mask=valid[:, None])
    if block == 0:
        tl.store(tensor_scale_ptr, tensor_scale)


@triton.jit
def _eden_finish_kernel(seed, corrected1, amax1, codes1, scales1, scaled1, tensor_scale1, n_groups1,
                        corrected2, amax2, codes2, scales2, scaled2, tensor_scale2, n_groups2,
                        GROUPS: tl.constexpr, WRITE_SCALED: tl.constexpr):
    """Phase two for up to two tensors in one launch (one launch less per backward: launches cost host time)."""
    blocks1 = tl.cdiv(n_groups1, GROUPS)
    block = tl.program_id(0)
    if block < blocks1:
        _eden_finish(corrected1, amax1, codes1, scales1, scaled1, tensor_scale1, n_groups1, block, seed, 0,
                     GROUPS, WRITE_SCALED)
    else:
        _eden_finish(corrected2, amax2, codes2, scales2, scaled2, tensor_scale2, n_groups2, block - blocks1, seed,
                     n_groups1, GROUPS, WRITE_SCALED)


# -----------------------------------------------------------------------------
# Dequantization


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, tensor_scale_ptr, out_ptr, C, ROWS: tl.constexpr,
                       TILE16: tl.constexpr, TENSOR_SCALE: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * 128
    rows = row0 + tl.arange(0, ROWS)
    packed = tl.load(codes_ptr + rows[:, None] * (C // 2) + (col0 // 2 + tl.arange(0, 64))[None, :])
    groups = col0 // 16 + tl.arange(0, 8)
    values = tl.reshape(_e2m1_value(_unpack(packed, ROWS, 128)), (ROWS // 16, 16, 8, 16))
    if TILE16:
        tiles = row0 // 16 + tl.arange(0, ROWS // 16)
        scales = _e4m3_value(tl.load(scales_ptr + tiles[:, None] * (C // 16) + groups[None, :]))
        values = values * tl.reshape(scales, (ROWS // 16, 1, 8, 1))
    else:
        scales = _e4m3_value(tl.load(scales_ptr + rows[:, None] * (C // 16) + groups[None, :]))
        values = values * tl.reshape(scales, (ROWS // 16, 16, 8, 1))
    if TENSOR_SCALE:
        values = values * tl.load(tensor_scale_ptr)
    cols = col0 + tl.arange(0, 128)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], tl.reshape(values, (ROWS, 128)).to(out_ptr.dtype.element_ty))


# -----------------------------------------------------------------------------
# Python side: launching the kernels


def _signs(signs, device):
    """The rotation's random signs as float32 on the kernel's device (the kernels build H from them)."""
    if signs.numel() not in (16, 128):
        raise ValueError(f"the kernels rotate 16- or 128-chunks, got {signs.numel()} signs")
    return signs.to(device=device, dtype=torch.float32)


def _random_seed(generator=None):
    """A Philox seed drawn on the host from a CPU generator (default: torch's global one), so launching needs no
    device work and no synchronization, and checkpoints that save the CPU random state reproduce it."""
    return int(torch.randint(0, 2**31 - 1, (), generator=generator))


def _dot_fp32(x):
    """Rotate in FP32 for FP32 input (and always in the interpreter); BF16 input rotates exactly in BF16."""
    return INTERPRETED or x.dtype == torch.float32


def _amax(x, transpose=False, signs=None):
    """Absolute maximum of x (or of rht(x^T, signs)) as int32 bits in a 1-element tensor, without a host sync."""
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    if signs is None:
        x = x.contiguous()
        _amax_kernel[(triton.cdiv(x.numel(), AMAX_BLOCK),)](x, amax, x.numel(), BLOCK=AMAX_BLOCK)
        return amax
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    strides = (x.stride(1), x.stride(0)) if transpose else x.stride()
    _rotated_amax_kernel[(rows // QUANTIZE_ROWS, cols // TILE)](x, *strides, signs, amax, ROWS=QUANTIZE_ROWS,
                                                                 N=signs.numel(), SCALE=1 / math.sqrt(signs.numel()),
                                                                 DOT_FP32=_dot_fp32(x))
    return amax


def triton_quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False,
                    signs=None, generator=None, scaled_codes=True):
    """The kernel version of quantize(): 2-D x, last dimension a multiple of 128, rows of 64 (after transposing)."""
    if x.dim() != 2 or four_over_six and rounding == "sr":
        raise ValueError("triton_quantize handles 2-D tensors and four-over-six with round-to-nearest only")
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    if rows % QUANTIZE_ROWS or cols % TILE:
        raise ValueError(f"triton_quantize needs [rows, cols] multiples of [{QUANTIZE_ROWS}, {TILE}], "
                         f"got {[rows, cols]}")
    fp8_max = 256.0 if four_over_six else E4M3_MAX
    signs = None if signs is None else _signs(signs, x.device)
    amax = _amax(x, transpose, signs)
    strides = (x.stride(1), x.stride(0)) if transpose else x.stride()
    device = x.device
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    scale_rows = rows if block == "1x16" else rows // GROUP
    scales = torch.empty(scale_rows, cols // GROUP, dtype=torch.float8_e4m3fn, device=device)
    scaled = torch.empty(rows, cols, dtype=torch.bfloat16, device=device) if scaled_codes else codes
    tensor_scale = torch.empty((), dtype=torch.float32, device=device)
    seed = _random_seed(generator) if rounding == "sr" else 0
    _quantize_kernel[(rows // QUANTIZE_ROWS, cols // TILE)](
        x, *strides, amax if signs is None else signs, amax, seed, codes, scales.view(torch.uint8), scaled,
        tensor_scale, cols, fp4_max, fp4_max * 4 / 6, fp8_max * fp4_max,
        ROWS=QUANTIZE_ROWS, ROTATE=signs is not None, N=1 if signs is None else signs.numel(),
        SCALE=1.0 if signs is None else 1 / math.sqrt(signs.numel()),
        STOCHASTIC=rounding == "sr", FOUR_OVER_SIX=four_over_six, TILE16=block == "16x16",
        WRITE_SCALED=scaled_codes, DOT_FP32=_dot_fp32(x), num_warps=QUANTIZE_WARPS)
    return NVFP4Tensor(codes, scales, tensor_scale, torch.Size((rows, cols)), block,
                       scaled if scaled_codes else None)


def _eden_outputs(rows, cols, device):
    """Phase-one outputs for an MS-EDEN result [rows, cols]: packed codes, FP32 corrected scales, their maximum."""
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    corrected = torch.empty(rows, cols // GROUP, dtype=torch.float32, device=device)
    return codes, corrected, torch.zeros(1, dtype=torch.int32, device=device)


def _check_eden_input(rows, cols):
    if rows % HADAMARD or cols % HADAMARD:
        raise ValueError(f"MS-EDEN kernels need both dimensions to be multiples of {HADAMARD}, got {[rows, cols]}")


def eden_phase1(x, signs):
    """Phase one for x [R, C] rotated along C and for x^T [C, R] rotated along R, from one read of x.
    Returns two (packed codes, FP32 corrected scales, largest corrected scale as int32 bits)."""
    rows, cols = x.shape
    _check_eden_input(rows, cols)
    row_out, col_out = _eden_outputs(rows, cols, x.device), _eden_outputs(cols, rows, x.device)
    _eden_kernel[(rows // 128, cols // 128)](
        x, *x.stride(), x, x, x, _signs(signs, x.device), *row_out, *col_out, rows, cols,
        FROM_NVFP4=False, ROWS_OUT=True, COLS_OUT=True, DOT_FP32=_dot_fp32(x), num_warps=EDEN_WARPS)
    return row_out, col_out


def eden_phase1_requantize(q, signs):
    """Phase one for q.dequantize()^T, q a 1x16 NVFP4 tensor [R, C]: dequantize, transpose, rotate along R."""
    if q.block != "1x16" or len(q.shape) != 2:
        raise ValueError("requantize_ms_eden needs a 2-D NVFP4 tensor with 1x16 groups")
    rows, cols = q.shape
    _check_eden_input(rows, cols)
    out = _eden_outputs(cols, rows, q.codes.device)
    _eden_kernel[(rows // 128, cols // 128)](  # the row outputs are not written (ROWS_OUT=False)
        q.codes, 0, 0, q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, _signs(signs, q.codes.device),
        *out, *out, rows, cols, FROM_NVFP4=True, ROWS_OUT=False, COLS_OUT=True, DOT_FP32=INTERPRETED,
        num_warps=EDEN_WARPS)
    return out


def _finish_outputs(codes, corrected, scaled_codes):
    device = codes.device
    rows, cols = codes.shape[0], codes.shape[1] * 2
    scales = torch.empty(corrected.shape, dtype=torch.float8_e4m3fn, device=device)
    scaled = torch.empty(rows, cols, dtype=torch.bfloat16, device=device) if scaled_codes else codes
    return scales, scaled, torch.empty((), dtype=torch.float32, device=device)


def eden_phase2(first, second=None, generator=None, scaled_codes=True):
    """Phase two for one or two phase-one results (codes, corrected scales, their maximum), in one launch.
    Returns the NVFP4 tensor, or a pair of them."""
    parts = [first] if second is None else [first, second]
    outputs = [_finish_outputs(codes, corrected, scaled_codes) for codes, corrected, _ in parts]
    arguments = [(corrected, amax, codes, scales.view(torch.uint8), scaled, tensor_scale, corrected.numel())
                 for (codes, corrected, amax), (scales, scaled, tensor_scale) in zip(parts, outputs)]
    blocks = sum(triton.cdiv(a[-1], FINISH_GROUPS) for a in arguments)
    if second is None:
        arguments.append(arguments[0][:-1] + (0,))  # an empty second tensor
    _eden_finish_kernel[(blocks,)](_random_seed(generator), *arguments[0], *arguments[1], GROUPS=FINISH_GROUPS,
                                   WRITE_SCALED=scaled_codes)
    results = tuple(NVFP4Tensor(codes, scales, tensor_scale, torch.Size((codes.shape[0], codes.shape[1] * 2)),
                                "1x16", scaled if scaled_codes else None)
                    for (codes, _, _), (scales, scaled, tensor_scale) in zip(parts, outputs))
    return results[0] if second is None else results


def triton_ms_eden_pair(x, signs, generator=None, scaled_codes=True):
    """MS-EDEN of x [R, C] rotated along C and of x^T [C, R] rotated along R, from one read of x."""
    row_out, col_out = eden_phase1(x, signs)
    return eden_phase2(row_out, col_out, generator, scaled_codes)


def triton_requantize_ms_eden(q, signs, generator=None, scaled_codes=True):
    """MS-EDEN of q.dequantize()^T for a 1x16 NVFP4 tensor q [R, C]: one pass over q, then phase two."""
    return eden_phase2(eden_phase1_requantize(q, signs), None, generator, scaled_codes)


def triton_dequantize(q, dtype=torch.float32, tensor_scale=True):
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.codes.device)
    block_rows = 16
    _dequantize_kernel[(rows // block_rows, cols // TILE)](
        q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, out, cols, ROWS=block_rows,
        TILE16=q.block == "16x16", TENSOR_SCALE=tensor_scale)
    return out


# -----------------------------------------------------------------------------
# The dispatch point: kernels on CUDA, references elsewhere


def quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False, signs=None,
             generator=None):
    """NVFP4 quantization of x (or of rht(x^T, signs) with transpose/signs) along the last dimension."""
    if x.is_cuda and x.dim() == 2 and not (four_over_six and rounding == "sr"):
        return triton_quantize(x, rounding, four_over_six, block, fp4_max, transpose, signs, generator)
    x = x.t() if transpose else x
    x = rht(x, signs) if signs is not None else x
    return quantize_nvfp4(x, rounding, four_over_six, block, fp4_max, generator=generator)


def ms_eden_pair(x, signs, generator=None):
    """(MS-EDEN of x along its last dimension, MS-EDEN of x^T along its first), from one read on CUDA."""
    if x.is_cuda:
        return triton_ms_eden_pair(x, signs, generator=generator)
    return quantize_ms_eden(x, signs, generator), quantize_ms_eden(x.t(), signs, generator)


def requantize_ms_eden(q, signs, generator=None):
    """MS-EDEN of the transpose of a saved NVFP4 tensor (the backward's re-quantization of X and W)."""
    if q.codes.is_cuda:
        return triton_requantize_ms_eden(q, signs, generator)
    return quantize_ms_eden(q.dequantize().t(), signs, generator)


def dequantize(q, dtype=torch.float32, tensor_scale=True):
    if q.codes.is_cuda and len(q.shape) == 2:
        return triton_dequantize(q, dtype, tensor_scale)
    return q.dequantize(dtype, tensor_scale)


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


def native_fp4_available(device):
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
            and hasattr(torch.nn.functional, "scaled_mm") and hasattr(torch, "float4_e2m1fn_x2"))


def _operand(q, dtype):
    if q.scaled_codes is not None:
        return q.scaled_codes if q.scaled_codes.dtype == dtype else q.scaled_codes.to(dtype)
    return dequantize(q, dtype, tensor_scale=False)


def nvfp4_mm(a, b, out_dtype=torch.bfloat16):
    """a @ b^T for NVFP4 tensors a [M, K] and b [N, K] quantized along K: native on sm_100+, emulated elsewhere."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"nvfp4_mm needs a common K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if native_fp4_available(a.codes.device):
        return torch.nn.functional.scaled_mm(**native_mm_args(a, b, out_dtype))
    a_values, b_values = _operand(a, out_dtype), _operand(b, out_dtype)
    alpha = a.tensor_scale * b.tensor_scale
    if b_values.numel() <= a.shape[0] * b.shape[0]:  # fold the tensor scales into the (smaller) weight operand
        return a_values @ (b_values * alpha).to(out_dtype).t()
    return ((a_values @ b_values.t()) * alpha).to(out_dtype)
