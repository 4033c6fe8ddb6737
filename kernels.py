"""
Fast versions: Triton kernels that compute exactly what quantize.py and eden.py compute, the operators through which
torch.compile sees them, and the NVFP4 GEMM.

What this file teaches: how a quantizer becomes a memory-bound GPU kernel (one read of the input, a few bytes written
per element, integer bit tricks instead of branches, rotations on the tensor cores), and how such a kernel stays
bit-identical to its slow reference.

Why kernels at all. On Blackwell (sm_100, sm_120) the three GEMMs of a linear layer run natively in NVFP4. Hopper and
older GPUs have no FP4 tensor cores: the GEMMs run in BF16 on the dequantized operands ("emulated" NVFP4: the same
numbers at BF16's speed), so everything Quartet II adds is quantization, which needs a few operations per byte. A
kernel is therefore judged by the bytes it moves against the GPU's copy bandwidth:

    bytes per element: BF16 2, packed NVFP4 0.5 (codes) + 1/16 (E4M3 group scales) = 0.5625

One RTN/SR quantizer program, for a [16, 128] tile (eight 16-groups per row; a first pass found amax(|x|)):

    tile         = x[rows, cols] (or x^T, read through swapped strides)             read 2 B/element
    tile         = tile @ diag(signs) H_N       if rotated (N = 16, 32, 128: tensor cores, +-1 entries, exact)
    tensor_scale = amax / (fp8_max * fp4_max)
    group_scale  = E4M3_round(group_amax / (fp4_max * tensor_scale))              per group, or per 16x16 tile
    code         = E2M1_round(tile / (group_scale * tensor_scale))               (SR: + Philox noise)
    four-over-six: the same with fp4_max * 4/6; keep the branch with the smaller integer squared error
    store packed codes and E4M3 scales (0.5625 B); for the emulated GEMM also code * group_scale in BF16 (2 B)

MS-EDEN in two launches (post hoc range alignment, eden.py):

    phase one, per job of 64 rows (or 64 columns, transposed) of a 128 x 128 tile of x, for x and x^T at once:
        sums      = job @ diag(signs) H128, in BF16 on the tensor cores (sums of +-x, FP32 accumulation)
        per group: largest |sum|; codes = E2M1_round(sums * fp4_max / largest); S = <u, u> / <u, codes>
        store the codes and the corrected scale largest / (fp4_max * sqrt(128)) * S in FP32; atomic max of them
    phase two, per group: tensor_scale = max / 256; group_scale = E4M3 stochastic rounding(corrected / tensor_scale)

Exactness. A kernel does the reference's floating-point operations in the reference's order, with integer bit
arithmetic where a float instruction would round differently on some backend, so codes and scales are bit-identical
to quantize.py's and eden.py's. Three exceptions, each bounded by a test: a rotation sums +-x on tensor cores in
their own FP32 order (MS-EDEN also folds the 1/sqrt(128) into its group scales) and MS-EDEN's two sums per group run
in the compiler's order, so a value next to a rounding boundary can land on its other side (at most 1 code in 2000;
corrected scales within 1e-5); the re-quantization applies the saved tensor scale to the corrected scales rather
than to the values (the same bounds); and the random bits come from Philox here and from torch's generator there,
so random outputs are compared by their statistics.

Reading order: the kernels (RTN/SR quantizer, MS-EDEN's two phases, dequantization, absolute maximum); their
building blocks (small floats by bit arithmetic, tiles, rotations, random draws); the Python that checks inputs and
launches them, per GPU; the operators torch.compile sees; the GEMM.
"""

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from eden import EDEN_FP4_MAX, EDEN_FP8_MAX, HADAMARD, ROTATION_LIMIT, quantize_ms_eden, random_signs, rht
from quantize import (BLOCKS, E2M1_MAX, ERROR_UNITS, GROUP, MIN_NORMAL, MIN_TENSOR_SCALE, SR_NOISE_BITS, NVFP4Tensor,
                      check_quantizer, default_fp8_max, quantize_nvfp4)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: how the tests run without GPU
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROTATIONS = (16, 32, 128)  # rotation widths of the quantizer: NVIDIA's 16, TetraJet-v2's 32, MS-EDEN's 128
QUANTIZE_ROWS, QUANTIZE_WARPS = 16, 4  # rows per program of the RTN/SR quantizer (larger tiles measured slower)
ROTATED_AMAX_ROWS = 32  # 16 measured 25% slower; used only when the rows are a multiple of 16 alone
FINISH_GROUPS = 256  # 16-groups per program of MS-EDEN's second phase
AMAX_BLOCK = 4096  # elements per program of the absolute-maximum pass
DEQUANTIZE_ROWS = 16
# MS-EDEN phase one: (rows per job, warps, programs per multiprocessor, pipeline stages), for a BF16 rotation on the
# tensor cores and for an FP32 one (FMA units), on GPUs with 228 KB of shared memory per multiprocessor (Hopper,
# data-centre Blackwell) and with ~100 KB (consumer Blackwell, sm_120). A BF16 program holds the rotation (32 KB)
# and its input (16 KB per stage): four fit in 228 KB, and while one waits for its input the others compute. On
# sm_120 only two fit, and without Hopper's wgmma its dot keeps its accumulators in registers: 64-row jobs spill
# 1.6 KB per thread even at 255 registers, 32-row jobs none. The register cap is what the programs leave each
# thread of a multiprocessor's 64K registers (tests/test_targets.py compiles every variant for every target).
EDEN_LAUNCH = {"bf16": {"large": (64, 4, 4, 1), "small": (32, 4, 2, 1)},
               "fp32": {"large": (64, 8, 1, 3), "small": (32, 4, 1, 1)}}
SMALL_SHARED_MEMORY = 160 * 1024  # below this per multiprocessor, a GPU takes the "small" launches

# Constants read inside kernels (a Triton kernel reads only globals that are constexpr).
_HADAMARD = tl.constexpr(HADAMARD)
_EDEN_FP4_MAX = tl.constexpr(EDEN_FP4_MAX)
_EDEN_SCALE_PER_SUM = tl.constexpr(1 / (EDEN_FP4_MAX * math.sqrt(HADAMARD)))  # group scale per unnormalized sum
_EDEN_FP8_MAX = tl.constexpr(EDEN_FP8_MAX)
_MIN_NORMAL = tl.constexpr(MIN_NORMAL)
_MIN_TENSOR_SCALE = tl.constexpr(MIN_TENSOR_SCALE)
_ROTATION_LIMIT = tl.constexpr(ROTATION_LIMIT)
# Saturation tested after a rotation: the largest |sum| of +-x over a chunk (a rotation before its 1/sqrt(N)) is at
# least the chunk's largest |x| (the sums' squares add up to N times the inputs'), so sums all within 2^119 (half the
# limit: a margin for their rounding) mean that no input needed saturating; a NaN or Inf fails the test.
_SATURATION_TEST = tl.constexpr(ROTATION_LIMIT / 2)
_ERROR_UNITS = tl.constexpr(ERROR_UNITS)
_SR_NOISE_STEP = tl.constexpr(2.0**-SR_NOISE_BITS)
# float32 bit fields: value = 2^(biased exponent - 127) * 1.mantissa; exponent in bits 23-30, sign in bit 31
_FP32_BIAS = tl.constexpr(127)
_ONE_BITS = tl.constexpr(127 << 23)  # 1.0
_EXPONENT_BITS = tl.constexpr(0xFF << 23)
# E4M3: 4 exponent bits (bias 7), 3 mantissa bits; below 2^-6 subnormal steps of 2^-9; 0x7F is NaN
_E4M3_BIAS = tl.constexpr(7)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEP = tl.constexpr(2.0**-9)
_E4M3_NAN = tl.constexpr(0x7F)
# An E2M1 code's magnitude bits (exponent, exponent, mantissa) placed in float32 bits 22-24 and its sign in bit 31
# read as float32 2^-126 * (the code's value): E2M1's exponent bias is 1, and code 1 (0.5) becomes float32's
# subnormal 2^-127. So decoding is two shifts and a mask, and one multiplication by 2^126.
_E2M1_DECODE_MASK = tl.constexpr(-0x7E400000)  # 0x81C00000 as int32: bit 31 and bits 22-24
_E2M1_DECODE_SCALE = tl.constexpr(2.0**126)

# -----------------------------------------------------------------------------
# 1. The RTN / SR quantizer: 1x16 or 16x16 groups, optional four-over-six, transpose and rotation


@triton.jit
def _quantize_kernel(
        # input: x and its strides; the rotation's float32 signs; the absolute maximum of what is quantized, as
        # int32 bits (from an amax kernel); the int64 Philox seed
        x_ptr, stride_r, stride_c, signs_ptr, amax_ptr, seed_ptr,
        # output: packed codes, E4M3 scale bits, code * group_scale (None: not written), the tensor scale
        codes_ptr, scales_ptr, scaled_ptr, tensor_scale_ptr,
        # sizes and the quantizer's constants: columns of the quantized tensor, fp4_max and fp8_max
        C, fp4_max, fp8_max,
        # meta-parameters: rows per program; read x^T; rotation width (0: none); SR; 4/6; 16x16 groups; FP32 dot
        ROWS: tl.constexpr, TRANSPOSE: tl.constexpr, ROTATION: tl.constexpr, STOCHASTIC: tl.constexpr,
        FOUR_OVER_SIX: tl.constexpr, TILE16: tl.constexpr, DOT_FP32: tl.constexpr):
    """RTN or SR quantization (as quantize.quantize_nvfp4) of one [ROWS, 128] tile per program of x, x^T, or their
    rotation. Reads the tile (2 B/element) and writes packed codes and E4M3 scales (0.5625) and code * group_scale
    (2); with the amax pass, ~6.6 B/element."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _HADAMARD
    amax_bits = tl.load(amax_ptr)  # of what is quantized: for the tensor scale, and the saturation test below
    tile = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, _HADAMARD, TRANSPOSE).to(tl.float32)
    if ROTATION > 0:
        # The amax pass found the largest rotated value of the whole tensor (after saturating, where its test
        # failed, and then it fails this one too): the same test on it saves a reduction over the tile. Only if it
        # fails can an input need saturating.
        if not _rotated_within_test(amax_bits, ROTATION):
            tile = _saturate(tile)
        tile = _rotate(tile, _rotation_matrix(signs_ptr, ROTATION), ROTATION, DOT_FP32)
    groups = tl.reshape(tile, (ROWS // 16, 16, 8, 16))  # [16-row blocks, row in block, group, element]
    group_amax = tl.max(tl.abs(groups), axis=3, keep_dims=True)
    if TILE16:
        group_amax = tl.max(group_amax, axis=1, keep_dims=True)
    tensor_scale = _tensor_scale(amax_bits, fp8_max * fp4_max)

    noise, noise4 = None, None  # round to nearest
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
        first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * (ROWS * _HADAMARD)  # this tile's draws
        noise = tl.reshape(_uniform_noise(seed, first, ROWS * _HADAMARD), (ROWS // 16, 16, 8, 16))
        if FOUR_OVER_SIX:  # the second branch draws from counters past the whole tensor's
            numel = tl.num_programs(0) * tl.num_programs(1) * (ROWS * _HADAMARD)
            noise4 = tl.reshape(_uniform_noise(seed, numel + first, ROWS * _HADAMARD), (ROWS // 16, 16, 8, 16))
    magnitude, code, scale, error = _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, TILE16)
    if FOUR_OVER_SIX:
        magnitude4, _, scale4, error4 = _quantize_branch(groups, group_amax, fp4_max * 4 / 6, tensor_scale, noise4,
                                                         TILE16)
        magnitude = tl.where(error4 < error, magnitude4, magnitude)  # a tie keeps the 6-branch
        scale = tl.where(error4 < error, scale4, scale)
        code = _e2m1_code(magnitude)  # of the chosen magnitude: fewer live registers than choosing between codes

    codes = tl.reshape(code | _code_sign(groups), (ROWS, _HADAMARD))
    tl.store(codes_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD, 2), _pack(codes, ROWS, _HADAMARD))
    if TILE16:
        tl.store(scales_ptr + _offsets(row0 // 16, col0, C, ROWS // 16, _HADAMARD, 16),
                 _e4m3_bits(tl.reshape(scale, (ROWS // 16, 8))))
    else:
        tl.store(scales_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD, 16), _e4m3_bits(tl.reshape(scale, (ROWS, 8))))
    if scaled_ptr is not None:
        value = tl.where(groups.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude) * scale  # sign of x, -0 too
        tl.store(scaled_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD),
                 tl.reshape(value, (ROWS, _HADAMARD)).to(scaled_ptr.dtype.element_ty))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(tensor_scale_ptr, tensor_scale)


@triton.jit
def _quantize_branch(groups, group_amax, fp4_max, tensor_scale, noise, TILE16: tl.constexpr):
    """One quantization of groups [ROWS/16, 16, 8, 16] (as quantize._quantize_groups), to nearest or, given noise,
    stochastically: E2M1 magnitudes and codes, E4M3 scales [.., 1] and four-over-six's error per group,
    group_scale^2 * sum(units^2) in FP64 (exact), the units integers, so that any order gives the same sum."""
    scale = _e4m3_round(group_amax * tl.math.div_rn(1.0, fp4_max * tensor_scale))  # one division per program
    scale = tl.where(scale == 0, 1.0, scale)
    scaled = groups * tl.math.div_rn(1.0, scale * tensor_scale)
    if noise is None:
        magnitude, code = _e2m1_nearest(tl.minimum(tl.abs(scaled), 6.0))
    else:
        magnitude = _round_to_grid(scaled, 1, 0, 6.0, noise)
        code = _e2m1_code(magnitude)
    units = ((tl.abs(scaled) - magnitude) * _ERROR_UNITS).to(tl.int32)  # truncated toward zero
    error = tl.sum(units * units, axis=3, keep_dims=True)
    if TILE16:
        error = tl.sum(error, axis=1, keep_dims=True)
    return magnitude, code, scale, error.to(tl.float64) * (scale * scale).to(tl.float64)


# -----------------------------------------------------------------------------
# 2. MS-EDEN phase one: rotate, codes, corrected scales and their maximum (post hoc range alignment, eden.py)


@triton.jit
def _eden_kernel(
        # input: x [R, C] and its strides, or (x_ptr None) a 1x16 NVFP4 tensor [R, C]: codes, scale bits, tensor
        # scale; the rotation's float32 signs [128]
        x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, in_tensor_scale_ptr, signs_ptr,
        # output [R, C] rotated along C (row_codes_ptr None: not computed): codes, FP32 corrected scales, their
        # maximum as int32 bits; output [C, R], the transpose rotated along R: the same three
        row_codes_ptr, row_corrected_ptr, row_amax_ptr, col_codes_ptr, col_corrected_ptr, col_amax_ptr,
        R, C,  # sizes
        TILES_PER_PROGRAM: tl.constexpr, SUB: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr,
        GROUPED: tl.constexpr):
    """MS-EDEN phase one for x rotated along its rows and/or for its transpose: packed codes, FP32 corrected scales
    and (atomically) their maximum. From an NVFP4 input this is the backward's re-quantization of the saved X and W:
    dequantize, transpose, rotate and quantize in one pass. Reads 2 B/element (0.5625 from NVFP4), writes 0.75 per
    output. Work comes in jobs: each 128 x 128 tile of x gives 128/SUB row jobs ([SUB, 128] rotated along C) and
    128/SUB column jobs ([128, SUB], transposed and rotated along R). Program p does job p % jobs_per_tile of every
    (num_programs / jobs_per_tile)-th tile, so one tile's jobs run at the same time on neighbouring programs and the
    tile is read from memory once (then from the L2 cache). Each program builds the rotation once."""
    rotation = _rotation_matrix(signs_ptr, _HADAMARD, GROUPED)
    if not DOT_FP32:  # converted once: half the registers it holds across the loop
        rotation = rotation.to(tl.bfloat16)
    tensor_scale = 1.0 if x_ptr is not None else tl.load(in_tensor_scale_ptr)
    slices: tl.constexpr = _HADAMARD // SUB  # row jobs (and column jobs) per tile
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
def _eden_jobs(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, rotation, tensor_scale, codes_ptr,
               corrected_ptr, R, C, first, step, sub0, TRANSPOSED: tl.constexpr, TILES: tl.constexpr,
               SUB: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr, GROUPED: tl.constexpr):
    """One program's jobs: the same part of tiles first, first + step, ...: rows sub0 ... sub0 + SUB - 1 rotated
    along C, or (TRANSPOSED) columns sub0 ... sub0 + SUB - 1, whose transpose [SUB, 128] is rotated along R. With
    STAGES > 1 the loads of the next tiles are issued while this one is processed. Returns the largest corrected
    scale as int32 bits."""
    largest_bits = tl.zeros((SUB, 8), dtype=tl.int32)  # reduced across threads once, at the end
    tile_cols = C // _HADAMARD
    last = (R // _HADAMARD) * tile_cols - 1
    for i in tl.range(TILES, num_stages=STAGES):
        tile = tl.minimum(first + i * step, last)  # past the end: the last tile again (the same values)
        row0 = (tile // tile_cols) * _HADAMARD
        col0 = (tile % tile_cols) * _HADAMARD
        if TRANSPOSED:  # columns col0 + sub0 ... of x: rows of the output [C, R]
            in_row, in_col, out_row, out_col, width = row0, col0 + sub0, col0 + sub0, row0, R
        else:
            in_row, in_col, out_row, out_col, width = row0 + sub0, col0, row0 + sub0, col0, C
        values = _eden_input(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, C, in_row, in_col, SUB,
                             TRANSPOSED, False)
        groups, largest = _group_maxima(_rotate(values, rotation, _HADAMARD, DOT_FP32, False), SUB, GROUPED)
        # Saturation (eden.rht) almost never changes anything, so it is tested after the rotation, on the largest
        # sums (a NaN fails the test too), and the input goes to the tensor cores as it was loaded. An NVFP4 input
        # (at most 6 * 448 * tensor scale) never needs it.
        if x_ptr is not None:
            if not (tl.reduce(largest, None, _nan_max) <= _SATURATION_TEST):
                values = _eden_input(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, C, in_row, in_col, SUB,
                                     TRANSPOSED, True)
                groups, largest = _group_maxima(_rotate(values, rotation, _HADAMARD, DOT_FP32, False), SUB, GROUPED)
        largest_bits = tl.maximum(largest_bits, _eden_store(groups, largest, tensor_scale, codes_ptr, corrected_ptr,
                                                            out_row, out_col, width, SUB))
    # From NVFP4 input Triton 3.6's sm_100 compiler fails on the two-step maximum (rows, then row maxima); from BF16
    # input the one-step maximum spills 24 more bytes per thread on sm_90: each input takes the one that compiles best.
    if x_ptr is None:
        return _flat_max(largest_bits)
    return tl.max(tl.max(largest_bits, axis=1), axis=0)


@triton.jit
def _eden_input(x_ptr, stride_r, stride_c, in_codes_ptr, in_scales_ptr, C, row0, col0, SUB: tl.constexpr,
                TRANSPOSED: tl.constexpr, SATURATE: tl.constexpr):
    """A job's input [SUB, 128]: the [SUB, 128] tile of x at (row0, col0), or (TRANSPOSED) the transpose of its
    [128, SUB] tile there; of x (saturated if SATURATE), or code * group_scale of the NVFP4 input (exact in BF16;
    its tensor scale goes to the corrected scales instead)."""
    ROWS: tl.constexpr = _HADAMARD if TRANSPOSED else SUB
    COLS: tl.constexpr = SUB if TRANSPOSED else _HADAMARD
    if x_ptr is not None:
        values = _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS, COLS, False)
        if SATURATE:
            values = _saturate(values)
    else:
        packed, scale_bits = _load_nvfp4(in_codes_ptr, in_scales_ptr, row0, col0, C, ROWS, COLS, False)
        values = _scaled_codes(packed, scale_bits, ROWS, COLS, False)
    return tl.trans(values) if TRANSPOSED else values


@triton.jit
def _group_maxima(sums, SUB: tl.constexpr, GROUPED: tl.constexpr):
    """(groups [SUB, 8, 16], their largest |sum| [SUB, 8, 1]) of a job's unnormalized rotation sums [SUB, 128],
    GROUPED if the rotation matrix was (_grouped); a NaN anywhere in a group is its largest."""
    groups = _grouped(sums, SUB) if GROUPED else tl.reshape(sums, (SUB, 8, 16))
    return groups, tl.reduce(tl.abs(groups), 2, _nan_max, keep_dims=True)


@triton.jit
def _eden_store(groups, largest, tensor_scale, codes_ptr, corrected_ptr, row0, col0, width, ROWS: tl.constexpr):
    """MS-EDEN phase one (as eden.eden_groups) of the [ROWS, 128] tile at (row0, col0) of an output [*, width], from
    the groups [ROWS, 8, 16] of its rotation's unnormalized sums (sqrt(128) * rht) and their largest |sum| [.., 1]:
    the 1/sqrt(128) is folded into the group scale, one multiplication per group instead of one per element. Stores
    the packed codes and the corrected scales (times tensor_scale); returns the latter as int32 bits."""
    scale = largest * _EDEN_SCALE_PER_SUM
    flushed = scale < _MIN_NORMAL  # a group this small becomes zeros
    scale = tl.where(flushed, 0.0, scale)
    scaled = groups * tl.where(flushed, 1.0, tl.math.div_rn(_EDEN_FP4_MAX, largest))  # |scaled| <= 6.07
    magnitude, code = _e2m1_nearest(scaled)  # |scaled| below 7: no saturation needed
    norm = tl.sum(scaled * scaled, axis=2, keep_dims=True)
    overlap = tl.sum(tl.abs(scaled) * magnitude, axis=2, keep_dims=True)  # = <scaled, its rounding>: same signs
    corrected = tl.reshape(scale * tl.where(overlap > 0, tl.math.div_rn(norm, overlap), 1.0), (ROWS, 8))
    corrected = corrected * tensor_scale
    words_ptr = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # the packed codes as int32, 8 codes each
    words = _pack_words(code | _code_sign(scaled), ROWS)
    tl.store(words_ptr + _offsets(row0, col0, width, ROWS, _HADAMARD, 8), words)
    tl.store(corrected_ptr + _offsets(row0, col0, width, ROWS, _HADAMARD, 16), corrected)
    return _abs_bits(corrected)


# -----------------------------------------------------------------------------
# 3. MS-EDEN phase two (tensor scale, SR of the scales), dequantization, the absolute maximum


@triton.jit
def _eden_finish_kernel(
        seed_ptr,  # int64 [1]: the Philox seed
        # per tensor: phase one's corrected scales and their maximum and codes; out: E4M3 scale bits, code *
        # group_scale (None: not written), the tensor scale; the number of groups (0: no second tensor)
        corrected1, amax1, codes1, scales1, scaled1, tensor_scale1, n_groups1,
        corrected2, amax2, codes2, scales2, scaled2, tensor_scale2, n_groups2,
        GROUPS: tl.constexpr):
    """MS-EDEN phase two for one or two tensors in one launch (E and E^T of one backward). Per element reads the
    codes and FP32 scales (0.75 B) and writes the E4M3 scales and code * group_scale (2.06 B)."""
    seed = tl.load(seed_ptr)
    blocks1 = tl.cdiv(n_groups1, GROUPS)
    block = tl.program_id(0)
    if block < blocks1:
        _eden_finish(corrected1, amax1, codes1, scales1, scaled1, tensor_scale1, n_groups1, block, seed, 0, GROUPS)
    else:
        _eden_finish(corrected2, amax2, codes2, scales2, scaled2, tensor_scale2, n_groups2, block - blocks1, seed,
                     n_groups1, GROUPS)


@triton.jit
def _eden_finish(corrected_ptr, amax_ptr, codes_ptr, scales_ptr, scaled_ptr, tensor_scale_ptr, n_groups, block,
                 seed, counter0, GROUPS: tl.constexpr):
    """Phase two for GROUPS consecutive 16-groups of one tensor: the tensor scale from the largest corrected scale,
    E4M3 stochastic rounding of each corrected scale, and code * group_scale for the emulated GEMM."""
    group = block * GROUPS + tl.arange(0, GROUPS)
    valid = group < n_groups
    tensor_scale = _tensor_scale(tl.load(amax_ptr), _EDEN_FP8_MAX)
    target = tl.math.div_rn(tl.load(corrected_ptr + group, mask=valid, other=0.0), tensor_scale)
    scale = _e4m3_round(target, tl.rand(seed, counter0 + group))
    tl.store(scales_ptr + group, _e4m3_bits(scale), mask=valid)
    if scaled_ptr is not None:
        packed = tl.load(codes_ptr + group[:, None] * 8 + tl.arange(0, 8)[None, :], mask=valid[:, None], other=0)
        value = _e2m1_value(_unpack(packed, GROUPS, 16)) * scale[:, None]
        element = group[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(scaled_ptr + element, value.to(scaled_ptr.dtype.element_ty), mask=valid[:, None])
    if block == 0:
        tl.store(tensor_scale_ptr, tensor_scale)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, tensor_scale_ptr, out_ptr, C, ROWS: tl.constexpr,
                       TILE16: tl.constexpr, TENSOR_SCALE: tl.constexpr):
    """out [R, C] <- code * group_scale (* tensor_scale), one [ROWS, 128] tile per program."""
    row0 = tl.program_id(0) * ROWS
    col0 = tl.program_id(1) * _HADAMARD
    packed, scale_bits = _load_nvfp4(codes_ptr, scales_ptr, row0, col0, C, ROWS, _HADAMARD, TILE16)
    values = _scaled_codes(packed, scale_bits, ROWS, _HADAMARD, TILE16)
    if TENSOR_SCALE:
        values = values * tl.load(tensor_scale_ptr)
    tl.store(out_ptr + _offsets(row0, col0, C, ROWS, _HADAMARD), values.to(out_ptr.dtype.element_ty))


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    """amax_ptr (int32 [1], zeroed) <- bits of max |x| over a contiguous x. Reads 2 B/element (BF16)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(_abs_bits(x), axis=0))


@triton.jit
def _rotated_amax_kernel(x_ptr, stride_r, stride_c, signs_ptr, amax_ptr,  # in: x, its strides, float32 [N] signs
                         ROWS: tl.constexpr, N: tl.constexpr, TRANSPOSE: tl.constexpr, DOT_FP32: tl.constexpr):
    """amax_ptr (int32 [1], zeroed) <- bits of max |rht(x or x^T)|, one [ROWS, 128] tile per program."""
    tile = _load_tile(x_ptr, stride_r, stride_c, tl.program_id(0) * ROWS, tl.program_id(1) * _HADAMARD, ROWS,
                      _HADAMARD, TRANSPOSE)
    rotation = _rotation_matrix(signs_ptr, N)
    amax = _flat_max(_abs_bits(_rotate(tile, rotation, N, DOT_FP32)))
    if not _rotated_within_test(amax, N):
        amax = _flat_max(_abs_bits(_rotate(_saturate(tile), rotation, N, DOT_FP32)))
    tl.atomic_max(amax_ptr, amax)


# -----------------------------------------------------------------------------
# 4. Building blocks: small floats by bit arithmetic


@triton.jit
def _power_of_two(exponent):
    """float32 2^exponent for an int32 exponent in [-126, 127], built from its bits."""
    return ((exponent + _FP32_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr, noise=None):
    """|x| rounded to the grid of a small float (the kernels' version of quantize.round_to_grid), saturating at MAX:
    to nearest with ties to even, or, given noise ~ U[0, 1), up with probability equal to the distance from the lower
    neighbour."""
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
    """x >= 0 rounded to E4M3 (quantize.e4m3_round), saturating at 448: to nearest, or, given noise, up with
    probability equal to the distance from the lower neighbour (unbiased below 448)."""
    return _round_to_grid(x, 3, -6, 448.0, noise)


@triton.jit
def _e2m1_nearest(x):
    """(E2M1 rounding of |x| < 7, to nearest with ties to even; that value's 3-bit code), exact for every float32
    (tests/test_kernels.py); saturating at 6 is the caller's. E2M1 has one mantissa bit: in the binade [2^e, 2^(e+1))
    (e >= 0; below 1 the step stays 0.5) the grid step is 2^(e-1), the unit in the last place of magic = 2^(e+22).
    So |x| + magic rounds to the grid (the FPU's nearest-even), subtracting magic again is exact, and the sum's low
    mantissa bits count the steps k = rounded / 2^(e-1) (2, 3 or 4 in a binade, 0 to 2 below 1): the code is k + 2e
    (1.0 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7). The binade comes from x's exponent bits, whatever its sign."""
    binade = tl.maximum(x.to(tl.int32, bitcast=True) & _EXPONENT_BITS, _ONE_BITS)  # 2^max(e, 0)
    magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
    total = tl.abs(x) + magic
    code = (total.to(tl.int32, bitcast=True) & 7) + (binade >> 22) - (_FP32_BIAS << 1)
    return total - magic, code


@triton.jit
def _code_sign(x):
    """A 4-bit code's sign bit (8) where x's float32 sign bit is set (-0.0 too): bit 31 moved to bit 3."""
    return (x.to(tl.int32, bitcast=True) >> 28) & 8


@triton.jit
def _e2m1_code(magnitude):
    """3-bit code of an E2M1 grid magnitude (as quantize.encode_e2m1)."""
    # From 1.0 up, bits >> 22 is (biased exponent, top mantissa bit): 1.0 -> 254 (code 2), 1.5 -> 255 (code 3), ...
    normal = (magnitude.to(tl.int32, bitcast=True) >> 22) - ((_FP32_BIAS << 1) - 2)
    return tl.where(magnitude >= 1.0, normal, (magnitude * 2.0).to(tl.int32))  # 0 -> 0, 0.5 -> 1


@triton.jit
def _e2m1_value(code):
    """float32 value of the 4-bit code in bits 0-3 of code (higher bits are ignored): see _E2M1_DECODE_MASK."""
    bits = ((code << 28) | (code << 22)) & _E2M1_DECODE_MASK
    return bits.to(tl.float32, bitcast=True) * _E2M1_DECODE_SCALE


@triton.jit
def _e4m3_bits(value):
    """uint8 bits of a non-negative float32 that lies on the E4M3 grid (NaN -> 0x7F)."""
    bits = value.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - (_FP32_BIAS - _E4M3_BIAS)) << 3) | ((bits >> 20) & 7)
    subnormal = (value * (1 / _E4M3_SUBNORMAL_STEP)).to(tl.int32)
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
def _tensor_scale(amax_bits, limit):
    """As quantize.tensor_scale_for: amax / limit; 1 below MIN_TENSOR_SCALE; NaN if amax is not finite."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, limit)
    scale = tl.where(scale < _MIN_TENSOR_SCALE, 1.0, scale)
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _flat_max(x):
    """The largest element of a 2-D tile, in one reduction over all its elements. (A maximum over rows, then over
    the row maxima, after a BF16 dot on Blackwell's tensor-memory MMA crashes Triton 3.6's sm_100 compiler.)"""
    return tl.max(tl.reshape(x, (x.shape[0] * x.shape[1],), can_reorder=True), axis=0)


# -----------------------------------------------------------------------------
# Building blocks: tiles (packing, addressing, loading), rotations, random draws


@triton.jit
def _pack(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] 4-bit codes -> [ROWS, COLS/2] bytes, the even element in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _pack_words(groups, ROWS: tl.constexpr):
    """[ROWS, 8, 16] 4-bit codes -> [ROWS, 16] int32, 8 codes per word, the first in the low nibble: the bytes _pack
    would make, read as little-endian words. With each group in one thread (phase one's grouped order) the words are
    packed without moving data, and the store's layout conversion moves 4-byte words instead of single bytes (the
    re-quantization's first pass ~7% faster on an H200)."""
    nibbles = tl.reshape(groups, (ROWS, 16, 8)) << (4 * tl.arange(0, 8))[None, None, :]
    return tl.sum(nibbles, axis=2)  # disjoint bit fields: the sum is their OR


@triton.jit
def _unpack(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS/2] bytes -> [ROWS, COLS] int32, each code in bits 0-3. The even element keeps its byte's high
    nibble in bits 4-7, which _e2m1_value ignores (one mask fewer per byte)."""
    packed = packed.to(tl.int32)
    return tl.reshape(tl.join(packed, packed >> 4), (ROWS, COLS))


@triton.jit
def _offsets(row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr, PER: tl.constexpr = 1):
    """Offsets of the [ROWS, COLS] tile at (row0, col0) of a [*, width] tensor stored as one item per PER elements
    of a row: [ROWS, COLS / PER]. PER = 1 for values, 2 for packed codes, 16 for 1x16 group scales (for 16x16 ones,
    pass the tile's 16-row block and the count of them as row0 and ROWS)."""
    rows = row0 + tl.arange(0, ROWS)
    return rows[:, None] * (width // PER) + (col0 // PER + tl.arange(0, COLS // PER))[None, :]


@triton.jit
def _load_tile(x_ptr, stride_r, stride_c, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr,
               TRANSPOSE: tl.constexpr):
    """The [ROWS, COLS] tile at (row0, col0) of x, or of x^T with TRANSPOSE (read through swapped strides: as fast
    as reading x's tile and transposing it in registers, on an H200)."""
    if TRANSPOSE:
        stride_r, stride_c = stride_c, stride_r
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    return tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c)


@triton.jit
def _load_nvfp4(codes_ptr, scales_ptr, row0, col0, width, ROWS: tl.constexpr, COLS: tl.constexpr,
                TILE16: tl.constexpr):
    """(packed codes [ROWS, COLS/2], E4M3 scale bits) of the [ROWS, COLS] tile at (row0, col0) of an NVFP4 tensor
    [*, width] with 1x16 groups ([ROWS, COLS/16] scales), or with 16x16 ones (TILE16: [ROWS/16, COLS/16]; row0 a
    multiple of 16)."""
    packed = tl.load(codes_ptr + _offsets(row0, col0, width, ROWS, COLS, 2))
    if TILE16:
        scale_bits = tl.load(scales_ptr + _offsets(row0 // 16, col0, width, ROWS // 16, COLS, 16))
    else:
        scale_bits = tl.load(scales_ptr + _offsets(row0, col0, width, ROWS, COLS, 16))
    return packed, scale_bits


@triton.jit
def _scaled_codes(packed, scale_bits, ROWS: tl.constexpr, COLS: tl.constexpr, TILE16: tl.constexpr):
    """code * group_scale (exact in BF16), [ROWS, COLS] float32, of what _load_nvfp4 loaded."""
    values = tl.reshape(_e2m1_value(_unpack(packed, ROWS, COLS)), (ROWS // 16, 16, COLS // 16, 16))
    if TILE16:
        values = values * tl.reshape(_e4m3_value(scale_bits), (ROWS // 16, 1, COLS // 16, 1))
    else:
        values = values * tl.reshape(_e4m3_value(scale_bits), (ROWS // 16, 16, COLS // 16, 1))
    return tl.reshape(values, (ROWS, COLS))


@triton.jit
def _rotation_matrix(signs_ptr, N: tl.constexpr, GROUPED: tl.constexpr = False):
    """diag(s) * H as an [N, N] matrix of +-1 (N a power of two, 16 to 128), generated in registers:
    H[i, j] = (-1)^popcount(i & j) (Sylvester). Only the sign bit of each of the N signs is used.
    GROUPED (N = 128): the columns in the order _grouped undoes."""
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
def _grouped(sums, ROWS: tl.constexpr):
    """[ROWS, 128] -> [ROWS, 8, 16]: the 16-groups of a dot's result with _rotation_matrix(signs, 128, GROUPED=True),
    in output order. Why the detour: in the register layout of Hopper's MMA the 4 lanes of a quad take turns holding
    2 adjacent columns of the result, so in the natural order a 16-group is spread over 4 threads (its sums need
    shuffles, its divisions run 4 times). With the matrix's columns permuted, accumulator column 64w + 8j + 2q + p
    (p within a lane's pair, q the lane in its quad, j the pair, w the half) holds output column 16(4w + q) + 2j + p,
    so each group lies in one thread, and this reshape and permute rename registers without moving data. (Any
    layout gives the same numbers; this one is the fast one.)"""
    return tl.reshape(tl.permute(tl.reshape(sums, (ROWS, 2, 8, 4, 2)), (0, 1, 3, 2, 4)), (ROWS, 8, 16))


@triton.jit
def _saturate(tile):
    """Finite values beyond +-ROTATION_LIMIT saturate there (as eden.rht), so that a rotation cannot overflow; Inf
    and NaN stay. Called only where _SATURATION_TEST failed: almost never."""
    saturated = tl.minimum(tl.maximum(tile, -_ROTATION_LIMIT), _ROTATION_LIMIT)
    return tl.where((tl.abs(tile) == float("inf")) | (tile != tile), tile, saturated).to(tile.dtype)


@triton.jit
def _rotated_within_test(amax_bits, N: tl.constexpr):
    """Whether a largest |rht| (int32 bits of a normalized N-wide rotation's maximum) passes _SATURATION_TEST, so
    that no input of the rotation needed saturating (a NaN fails)."""
    return amax_bits.to(tl.float32, bitcast=True) <= _SATURATION_TEST * (N**-0.5)


@triton.jit
def _rotate(tile, rotation, N: tl.constexpr, DOT_FP32: tl.constexpr, NORMALIZE: tl.constexpr = True):
    """rht(tile) for tile [rows, 128] and rotation = _rotation_matrix(signs, N): each N-chunk of a row times the
    [N, N] matrix (the tile seen as [rows * 128 / N, N]); the sum of +-x runs on tensor cores in FP32 (exact
    products), then one multiplication by 1/sqrt(N), as eden.rht computes it. Without NORMALIZE: the sums themselves,
    sqrt(N) * rht(tile) (MS-EDEN's codes and correction do not depend on a common factor)."""
    ROWS: tl.constexpr = tile.shape[0]
    chunks = tl.reshape(tile, (ROWS * _HADAMARD // N, N))
    if DOT_FP32:  # FP32 operands: no TF32 truncation
        rotated = tl.dot(chunks.to(tl.float32), rotation.to(tl.float32), input_precision="ieee")
    else:  # BF16 input: exact in BF16
        rotated = tl.dot(chunks.to(tl.bfloat16), rotation.to(tl.bfloat16))
    rotated = tl.reshape(rotated, (ROWS, _HADAMARD))
    return rotated * (N**-0.5) if NORMALIZE else rotated


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
# 5. Launching the kernels (on a CPU too, under TRITON_INTERPRET=1: that is how the tests check them without a GPU)


def check_matrix(x, row_multiple, col_multiple, what, transpose=False):
    """Raise a ValueError unless x is a non-empty 2-D BF16/FP16/FP32 tensor whose shape (transposed, if asked) is a
    multiple of [row_multiple, col_multiple]."""
    if not isinstance(x, torch.Tensor) or x.dtype not in KERNEL_DTYPES:
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} needs a bfloat16, float16 or float32 tensor, got {kind}")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"{what} needs a non-empty 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    if rows % row_multiple or cols % col_multiple:
        raise ValueError(f"{what} needs a 2-D tensor whose {'transpose ' if transpose else ''}shape is a multiple of "
                         f"[{row_multiple}, {col_multiple}], got shape {tuple(x.shape)}")


def check_nvfp4(q, what, blocks=("1x16",), multiple=(16, HADAMARD)):
    """Raise a ValueError unless q is a 2-D NVFP4Tensor with one of the blocks whose shape is a multiple of
    `multiple` and whose parts are contiguous on one device: the kernels address its memory directly (its dtypes and
    shapes were checked when it was made, quantize.NVFP4Tensor)."""
    if not isinstance(q, NVFP4Tensor) or q.block not in blocks or len(q.shape) != 2:
        raise ValueError(f"{what} needs a 2-D NVFP4Tensor with {' or '.join(blocks)} groups, got "
                         f"{getattr(q, 'block', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    if q.shape[0] % multiple[0] or q.shape[1] % multiple[1]:
        raise ValueError(f"{what} needs a shape that is a multiple of [{multiple[0]}, {multiple[1]}], got "
                         f"{tuple(q.shape)}")
    if not (q.codes.is_contiguous() and q.group_scale.is_contiguous()):
        raise ValueError(f"{what} needs contiguous codes and group scales (call .contiguous() on them)")


def check_kernel_device(t, what):
    if not (t.is_cuda or t.is_cpu and INTERPRETED):
        raise ValueError(f"{what} runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got {t.device}")


def check_rotation(signs, sizes, what, device):
    """Raise a ValueError unless signs is a 1-D float tensor on device whose length is in sizes (the kernels read only
    their sign bits; the references also check that they are +-1)."""
    if not isinstance(signs, torch.Tensor) or signs.dim() != 1 or signs.numel() not in sizes or \
            not signs.is_floating_point() or signs.device != device:
        kind = f"{signs.dtype} {tuple(signs.shape)} on {signs.device}" if isinstance(signs, torch.Tensor) else signs
        raise ValueError(f"{what} needs 1-D float signs of length {' or '.join(map(str, sizes))} on {device}, got "
                         f"{kind}")


def check_outputs(out_dtype, seed, device, what):
    """Raise a ValueError unless out_dtype is a float dtype the kernels write and seed (if any) is one int64 on device
    (a kernel reads it there)."""
    if out_dtype not in KERNEL_DTYPES:
        raise ValueError(f"{what} writes bfloat16, float16 or float32, not {out_dtype}")
    if seed is not None and not (isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.numel() == 1
                                 and seed.device == device):
        raise ValueError(f"{what} needs its seed as one int64 on {device}, got {seed!r}")


def _ceil_div(a, b):
    """ceil(a / b) for positive integers (triton.cdiv, a Triton function, costs ~10 us of host time per call)."""
    return -(-a // b)


def _dot_fp32(x):
    """Rotate in FP32 for FP32 input (and always in the interpreter, whose BF16 dots are wrong); BF16 input rotates
    exactly in BF16."""
    return INTERPRETED or x.dtype != torch.bfloat16


def _gpu(device):
    """(multiprocessors, shared memory per multiprocessor in bytes) of the device the kernels run on; for the
    interpreter, 5 multiprocessors (so that the tests run phase one's loop and its end) of a large GPU."""
    if device.type != "cuda":
        return 5, 228 * 1024
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_multiprocessor


def eden_launch(device, dot_fp32):
    """(rows per job, warps, register cap, programs per multiprocessor, stages, multiprocessors) of MS-EDEN phase
    one on device (EDEN_LAUNCH)."""
    multiprocessors, shared = _gpu(device)
    size = "small" if shared < SMALL_SHARED_MEMORY else "large"
    sub, warps, programs, stages = EDEN_LAUNCH["fp32" if dot_fp32 else "bf16"][size]
    return sub, warps, min(255, 65536 // (programs * warps * 32)), programs, stages, multiprocessors


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
    _rotated_amax_kernel[(rows // block, cols // HADAMARD)](
        x, *x.stride(), signs, amax, ROWS=block, N=signs.numel(), TRANSPOSE=transpose, DOT_FP32=_dot_fp32(x))
    return amax


def empty_quantized(rows, cols, block, out_dtype, device, codes=True):
    """The outputs of a quantizer of [rows, cols]: (codes,) group scales, tensor scale, code * group_scale."""
    scale_rows = rows if block == "1x16" else rows // GROUP
    return ((torch.empty(rows, cols // 2, dtype=torch.uint8, device=device),) if codes else ()) + (
        torch.empty(scale_rows, cols // GROUP, dtype=torch.float8_e4m3fn, device=device),
        torch.empty((), dtype=torch.float32, device=device), torch.empty(rows, cols, dtype=out_dtype, device=device))


def triton_quantize(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False,
                    signs=None, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """The kernel version of quantize_nvfp4 for x [R, C] (or x^T, rotated by signs if given): R a multiple of 16,
    C of 128 (after transposing). Returns an NVFP4Tensor, with code * group_scale in out_dtype if scaled_codes."""
    check_matrix(x, QUANTIZE_ROWS, HADAMARD, "triton_quantize", transpose)
    check_kernel_device(x, "triton_quantize")
    check_outputs(out_dtype, seed, x.device, "triton_quantize")
    fp8_max = default_fp8_max(four_over_six)
    check_quantizer(rounding, block, fp4_max, fp8_max, four_over_six)
    if signs is not None:
        check_rotation(signs, ROTATIONS, "triton_quantize", x.device)
        signs = signs.float()
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    codes, scales, tensor_scale, scaled = empty_quantized(rows, cols, block, out_dtype, x.device)
    if rounding == "sr" and seed is None:
        seed = draw_seed(x.device)
    _quantize_kernel[(rows // QUANTIZE_ROWS, cols // HADAMARD)](
        x, *x.stride(), signs, _amax(x, transpose, signs), seed if rounding == "sr" else None,
        codes, scales.view(torch.uint8), scaled if scaled_codes else None, tensor_scale,
        cols, fp4_max, fp8_max,
        ROWS=QUANTIZE_ROWS, TRANSPOSE=transpose, ROTATION=0 if signs is None else signs.numel(),
        STOCHASTIC=rounding == "sr", FOUR_OVER_SIX=four_over_six, TILE16=block == "16x16",
        DOT_FP32=_dot_fp32(x), num_warps=QUANTIZE_WARPS)
    return NVFP4Tensor(codes, scales, tensor_scale, torch.Size((rows, cols)), block, scaled if scaled_codes else None)


def _persistent_grid(rows, cols, jobs_per_tile, programs_per_multiprocessor, multiprocessors):
    """(programs, tiles per program) of MS-EDEN phase one over [rows, cols]: as many programs as the multiprocessors
    hold at once, a multiple of jobs_per_tile, each doing one job of every (programs / jobs_per_tile)-th tile."""
    tiles = rows * cols // HADAMARD**2
    per_job = min(tiles, max(1, programs_per_multiprocessor * multiprocessors // jobs_per_tile))
    return per_job * jobs_per_tile, _ceil_div(tiles, per_job)


def _phase1(inputs, signs, rows, cols, device, pair, dot_fp32):
    """_eden_kernel over an input [rows, cols] (inputs: its first six arguments), for x and x^T (pair) or x^T only,
    rotating in FP32 if dot_fp32. Returns (packed codes, FP32 corrected scales, their maximum as int32 bits) of each
    output, [rows, cols] and [cols, rows]."""
    def outputs(out_rows, out_cols):
        return (torch.empty(out_rows, out_cols // 2, dtype=torch.uint8, device=device),
                torch.empty(out_rows, out_cols // GROUP, dtype=torch.float32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
    row_out, col_out = outputs(rows, cols) if pair else (None, None, None), outputs(cols, rows)
    sub, warps, registers, per_multiprocessor, stages, multiprocessors = eden_launch(device, dot_fp32)
    jobs_per_tile = (2 if pair else 1) * HADAMARD // sub
    programs, per_program = _persistent_grid(rows, cols, jobs_per_tile, per_multiprocessor, multiprocessors)
    # The rotation's columns in _grouped's order for the tensor cores' BF16 dot (and in the interpreter, which
    # checks it); a GPU's FP32 dot runs on FMA units in another layout, and with that order the largest corrected
    # scale came out wrong on an H200 (cause not found).
    _eden_kernel[(programs,)](
        *inputs, signs.to(device=device, dtype=torch.float32), *row_out, *col_out, rows, cols,
        TILES_PER_PROGRAM=per_program, SUB=sub, STAGES=stages, DOT_FP32=dot_fp32,
        GROUPED=INTERPRETED or not dot_fp32, num_warps=warps, maxnreg=registers)
    return (row_out, col_out) if pair else col_out


def eden_phase1(x, signs):
    """Phase one for x [R, C] rotated along C and for x^T [C, R] rotated along R, from one read of x. Returns two
    (packed codes, FP32 corrected scales, largest corrected scale as int32 bits)."""
    check_matrix(x, HADAMARD, HADAMARD, "MS-EDEN")
    check_kernel_device(x, "MS-EDEN")
    check_rotation(signs, (HADAMARD,), "MS-EDEN", x.device)
    return _phase1((x, *x.stride(), None, None, None), signs, *x.shape, x.device, True, _dot_fp32(x))


def eden_phase1_requantize(q, signs):
    """Phase one for q.dequantize()^T, q a 1x16 NVFP4 tensor [R, C]: dequantize, transpose, rotate along R. (Its
    input, code * group_scale, is exact in BF16: the GPU rotates it on tensor cores whatever q's source was.)"""
    check_nvfp4(q, "requantize_ms_eden", multiple=(HADAMARD, HADAMARD))
    check_kernel_device(q.codes, "requantize_ms_eden")
    check_rotation(signs, (HADAMARD,), "requantize_ms_eden", q.codes.device)
    inputs = (None, 0, 0, q.codes, q.group_scale.view(torch.uint8), q.tensor_scale)  # no x: the NVFP4 tensor
    return _phase1(inputs, signs, *q.shape, q.codes.device, False, INTERPRETED)


def eden_phase2(first, second=None, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """Phase two for one or two phase-one results (codes, corrected scales, their maximum), in one launch.
    Returns the NVFP4 tensor, or a pair of them."""
    parts = [first] if second is None else [first, second]
    check_outputs(out_dtype, seed, first[0].device, "MS-EDEN")
    seed = draw_seed(first[0].device) if seed is None else seed
    results, arguments = [], []
    for codes, corrected, amax in parts:
        rows, cols = codes.shape[0], codes.shape[1] * 2
        scales, tensor_scale, scaled = empty_quantized(rows, cols, "1x16", out_dtype, codes.device, codes=False)
        scaled = scaled if scaled_codes else None
        results.append(NVFP4Tensor(codes, scales, tensor_scale, torch.Size((rows, cols)), "1x16", scaled))
        arguments.append((corrected, amax, codes, scales.view(torch.uint8), scaled, tensor_scale, corrected.numel()))
    blocks = sum(_ceil_div(a[-1], FINISH_GROUPS) for a in arguments)
    if second is None:  # the second tensor's arguments: the first's again, with no groups
        arguments.append(arguments[0][:-1] + (0,))
    _eden_finish_kernel[(blocks,)](seed, *arguments[0], *arguments[1], GROUPS=FINISH_GROUPS)
    return results[0] if second is None else tuple(results)


def triton_ms_eden_pair(x, signs, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """MS-EDEN of x [R, C] rotated along C and of x^T [C, R] rotated along R, from one read of x."""
    return eden_phase2(*eden_phase1(x, signs), seed, out_dtype, scaled_codes)


def triton_requantize_ms_eden(q, signs, seed=None, out_dtype=torch.bfloat16, scaled_codes=True):
    """MS-EDEN of q.dequantize()^T for a 1x16 NVFP4 tensor q [R, C]: one pass over q, then phase two."""
    return eden_phase2(eden_phase1_requantize(q, signs), None, seed, out_dtype, scaled_codes)


def triton_dequantize(q, dtype=torch.float32, tensor_scale=True):
    """q.dequantize(dtype, tensor_scale) for a 2-D NVFP4Tensor whose shape is a multiple of [16, 128]."""
    check_nvfp4(q, "triton_dequantize", BLOCKS, (DEQUANTIZE_ROWS, HADAMARD))
    check_kernel_device(q.codes, "triton_dequantize")
    check_outputs(dtype, None, q.codes.device, "triton_dequantize")
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.codes.device)
    _dequantize_kernel[(rows // DEQUANTIZE_ROWS, cols // HADAMARD)](
        q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, out, cols, ROWS=DEQUANTIZE_ROWS,
        TILE16=q.block == "16x16", TENSOR_SCALE=tensor_scale)
    return out


# -----------------------------------------------------------------------------
# 6. The operators torch.compile sees: plain tensors in and out (codes, group scale bits as uint8, tensor scale,
# code * group_scale: empty where the native GEMM does not need it), the kernels on CUDA and the references
# elsewhere, and a shape-only fake version for tracing. Their randomness comes in as tensors drawn on the device (the
# signs, a Philox seed), so a captured CUDA graph draws afresh on every replay and torch.manual_seed still makes a
# run reproducible.

Quantized = tuple[Tensor, Tensor, Tensor, Tensor]
QuantizedPair = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _on_gpu(t):
    """Whether the operators run the Triton kernels on t (CUDA) or the references (any other device)."""
    return t.is_cuda


def _parts(q, out_dtype):
    scaled = q.scaled_codes if q.scaled_codes is not None else q.codes.new_empty(0, dtype=out_dtype)
    return q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, scaled


def _from_parts(parts, block):
    """The NVFP4Tensor of an operator's tensors (_parts' inverse); an empty code * group_scale becomes None."""
    codes, scale_bits, tensor_scale, scaled = parts
    return NVFP4Tensor(codes, scale_bits.view(torch.float8_e4m3fn), tensor_scale,
                       torch.Size((codes.shape[0], codes.shape[1] * 2)), block, scaled if scaled.numel() else None)


def _fake(rows, cols, block, out_dtype, device, scaled_codes):
    codes, scales, tensor_scale, scaled = empty_quantized(rows, cols, block, out_dtype, device)
    return codes, scales.view(torch.uint8), tensor_scale, scaled if scaled_codes else scaled.new_empty(0)


def _reference_parts(q, out_dtype, scaled_codes):
    q.scaled_codes = q.dequantize(out_dtype, tensor_scale=False) if scaled_codes else None
    return _parts(q, out_dtype)


def _generator(seed):
    """A CPU generator seeded from the op's seed tensor, so that the references draw reproducibly from it too."""
    return None if seed is None else torch.Generator().manual_seed(int(seed.item()))


@torch.library.custom_op("nanoquartet::random_signs", mutates_args=())
def _random_signs_impl(like: Tensor, n: int) -> Tensor:
    return random_signs(n, device=like.device)


@_random_signs_impl.register_fake
def _(like, n):
    return like.new_empty(n, dtype=torch.float32)


def draw_signs(e, n=HADAMARD):
    """n random +-1.0 on e's device: the rotation of a backward whose gradient is e. An operator of e, so that
    torch.compile keeps the draw and every quantization it feeds in the backward graph. (A draw that depends on
    nothing, its partitioner may make twice: once in the forward graph, where it moves a re-quantization of the saved
    X or W, and again in the backward for E. The operands of a GEMM would then be rotated differently.)"""
    return torch.ops.nanoquartet.random_signs(e, n)


@torch.library.custom_op("nanoquartet::quantize", mutates_args=())
def _quantize_impl(x: Tensor, signs: Optional[Tensor], seed: Optional[Tensor], rounding: str, four_over_six: bool,
                   block: str, fp4_max: float, transpose: bool, out_dtype: torch.dtype,
                   scaled_codes: bool) -> Quantized:
    if _on_gpu(x):
        return _parts(triton_quantize(x, rounding, four_over_six, block, fp4_max, transpose, signs, seed, out_dtype,
                                      scaled_codes), out_dtype)
    x = x.t() if transpose else x
    x = rht(x, signs) if signs is not None else x
    return _reference_parts(quantize_nvfp4(x, rounding, four_over_six, block, fp4_max, generator=_generator(seed)),
                            out_dtype, scaled_codes)


@_quantize_impl.register_fake
def _(x, signs, seed, rounding, four_over_six, block, fp4_max, transpose, out_dtype, scaled_codes):
    return _fake(*((x.shape[1], x.shape[0]) if transpose else x.shape), block, out_dtype, x.device, scaled_codes)


@torch.library.custom_op("nanoquartet::ms_eden_pair", mutates_args=())
def _ms_eden_pair_impl(x: Tensor, signs: Tensor, seed: Tensor, out_dtype: torch.dtype,
                       scaled_codes: bool) -> QuantizedPair:
    if _on_gpu(x):
        rows, cols = triton_ms_eden_pair(x, signs, seed, out_dtype, scaled_codes)
        return _parts(rows, out_dtype) + _parts(cols, out_dtype)
    generator = _generator(seed)
    return (_reference_parts(quantize_ms_eden(x, signs, generator), out_dtype, scaled_codes)
            + _reference_parts(quantize_ms_eden(x.t(), signs, generator), out_dtype, scaled_codes))


@_ms_eden_pair_impl.register_fake
def _(x, signs, seed, out_dtype, scaled_codes):
    return (_fake(*x.shape, "1x16", out_dtype, x.device, scaled_codes)
            + _fake(x.shape[1], x.shape[0], "1x16", out_dtype, x.device, scaled_codes))


@torch.library.custom_op("nanoquartet::requantize_ms_eden", mutates_args=())
def _requantize_impl(codes: Tensor, group_scale: Tensor, tensor_scale: Tensor, signs: Tensor, seed: Tensor,
                     out_dtype: torch.dtype, scaled_codes: bool) -> Quantized:
    q = _from_parts((codes, group_scale, tensor_scale, codes.new_empty(0)), "1x16")
    if _on_gpu(codes):
        return _parts(triton_requantize_ms_eden(q, signs, seed, out_dtype, scaled_codes), out_dtype)
    return _reference_parts(quantize_ms_eden(q.dequantize().t(), signs, _generator(seed)), out_dtype, scaled_codes)


@_requantize_impl.register_fake
def _(codes, group_scale, tensor_scale, signs, seed, out_dtype, scaled_codes):
    return _fake(codes.shape[1] * 2, codes.shape[0], "1x16", out_dtype, codes.device, scaled_codes)


@torch.library.custom_op("nanoquartet::dequantize", mutates_args=())
def _dequantize_impl(codes: Tensor, group_scale: Tensor, tensor_scale: Tensor, block: str, dtype: torch.dtype,
                     with_tensor_scale: bool) -> Tensor:
    q = _from_parts((codes, group_scale, tensor_scale, codes.new_empty(0)), block)
    if _on_gpu(codes) and q.shape[0] % DEQUANTIZE_ROWS == 0 and q.shape[1] % HADAMARD == 0:
        return triton_dequantize(q, dtype, with_tensor_scale)
    return q.dequantize(dtype, with_tensor_scale)


@_dequantize_impl.register_fake
def _(codes, group_scale, tensor_scale, block, dtype, with_tensor_scale):
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=dtype)


# What model.py calls: NVFP4Tensors in and out, through the operators. The BF16 code * group_scale is made only for
# the emulated GEMM (the native one reads codes and scales): ~2 of the ~6.6 bytes per element of a quantization.


def quantize_op(x, rounding="rtn", four_over_six=False, block="1x16", fp4_max=E2M1_MAX, transpose=False, signs=None,
                out_dtype=None):
    """NVFP4 quantization of x [R, C] along C (or of x^T along R, rotated by signs if given): R a multiple of 16 and
    C of 128 (after transposing). For the emulated GEMM the result carries code * group_scale in out_dtype (default
    x's dtype)."""
    check_matrix(x, QUANTIZE_ROWS, HADAMARD, "quantize_op", transpose)
    check_quantizer(rounding, block, fp4_max, default_fp8_max(four_over_six), four_over_six)
    check_outputs(out_dtype or x.dtype, None, x.device, "quantize_op")
    if signs is not None:
        check_rotation(signs, ROTATIONS, "quantize_op", x.device)
    seed = draw_seed(x.device) if rounding == "sr" else None
    parts = torch.ops.nanoquartet.quantize(x, signs, seed, rounding, four_over_six, block, float(fp4_max), transpose,
                                           out_dtype or x.dtype, not native_fp4_available(x.device))
    return _from_parts(parts, block)


def ms_eden_pair_op(x, signs, out_dtype=None):
    """(MS-EDEN of x [R, C] along C, MS-EDEN of x^T along R), both rotated by the 128 signs, from one read of x."""
    check_matrix(x, HADAMARD, HADAMARD, "ms_eden_pair_op")
    check_rotation(signs, (HADAMARD,), "ms_eden_pair_op", x.device)
    check_outputs(out_dtype or x.dtype, None, x.device, "ms_eden_pair_op")
    parts = torch.ops.nanoquartet.ms_eden_pair(x, signs, draw_seed(x.device), out_dtype or x.dtype,
                                               not native_fp4_available(x.device))
    return _from_parts(parts[:4], "1x16"), _from_parts(parts[4:], "1x16")


def requantize_ms_eden_op(q, signs, out_dtype=torch.bfloat16):
    """MS-EDEN of the transpose of a saved 1x16 NVFP4 tensor (the backward's re-quantization of X and W)."""
    check_nvfp4(q, "requantize_ms_eden_op", multiple=(HADAMARD, HADAMARD))
    check_rotation(signs, (HADAMARD,), "requantize_ms_eden_op", q.codes.device)
    check_outputs(out_dtype, None, q.codes.device, "requantize_ms_eden_op")
    device = q.codes.device
    parts = torch.ops.nanoquartet.requantize_ms_eden(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, signs,
                                                     draw_seed(device), out_dtype, not native_fp4_available(device))
    return _from_parts(parts, "1x16")


def dequantize_op(q, dtype=torch.float32, tensor_scale=True):
    """q.dequantize(dtype, tensor_scale): the kernel for 2-D CUDA tensors whose shape it tiles, else the reference."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"dequantize_op needs an NVFP4Tensor, got {type(q).__name__}")
    check_outputs(dtype, None, q.codes.device, "dequantize_op")
    if len(q.shape) != 2:
        return q.dequantize(dtype, tensor_scale)
    return torch.ops.nanoquartet.dequantize(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale, q.block, dtype,
                                            tensor_scale)


# -----------------------------------------------------------------------------
# 7. The GEMM: native NVFP4 on Blackwell (cuBLAS through torch's scaled_mm), emulated in BF16 elsewhere


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
def _native_mm_impl(a_codes: Tensor, a_scales: Tensor, a_tensor_scale: Tensor, b_codes: Tensor, b_scales: Tensor,
                    b_tensor_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b^T in NVFP4 (1x16 scales as uint8). An operator, so that Inductor calls it as it is: its own lowering of
    scaled_mm does not take the blocked scales. If cuBLASLt refuses (a part or driver without NVFP4 support), it says
    so once and emulates this and every later GEMM."""
    a, b = (_from_parts((codes, scales, tensor_scale, codes.new_empty(0)), "1x16") for codes, scales, tensor_scale
            in ((a_codes, a_scales, a_tensor_scale), (b_codes, b_scales, b_tensor_scale)))
    if not _native_refused:
        try:
            return torch.nn.functional.scaled_mm(**native_mm_args(a, b, out_dtype))
        except RuntimeError as error:
            _native_refused.append(str(error).splitlines()[0])
            print(f"nanoquartet: the native NVFP4 GEMM was refused ({_native_refused[0]}); emulating it in BF16")
    return emulated_mm(a, b, out_dtype)


@_native_mm_impl.register_fake
def _(a_codes, a_scales, a_tensor_scale, b_codes, b_scales, b_tensor_scale, out_dtype):
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


def _operand(q, dtype):
    if q.scaled_codes is not None:
        return q.scaled_codes if q.scaled_codes.dtype == dtype else q.scaled_codes.to(dtype)
    return dequantize_op(q, dtype, tensor_scale=False)


def emulated_mm(a, b, out_dtype):
    """a @ b^T in out_dtype on code * group_scale (exact in BF16), the product of the two FP32 tensor scales applied
    where it is cheapest: to the smaller input (a weight, one BF16 rounding the native GEMM does not have) or to the
    output. The result is a new tensor, never a view: an autograd Function that returns a view of an intermediate
    gets a zero gradient in torch 2.11's compiled backward."""
    a_values, b_values = _operand(a, out_dtype), _operand(b, out_dtype)
    alpha = a.tensor_scale * b.tensor_scale
    if b_values.numel() <= a.shape[0] * b.shape[0]:  # fold the tensor scales into the (smaller) weight operand
        return a_values @ (b_values * alpha).to(out_dtype).t()
    return (a_values @ b_values.t()) * alpha  # already out_dtype: a 0-dim FP32 factor keeps a tensor's dtype


def nvfp4_mm(a, b, out_dtype=torch.bfloat16):
    """a @ b^T for NVFP4 tensors a [M, K] and b [N, K] quantized along K: native on sm_100+, emulated elsewhere."""
    check_nvfp4(a, "nvfp4_mm", BLOCKS, (1, 1))
    check_nvfp4(b, "nvfp4_mm", BLOCKS, (1, 1))
    check_outputs(out_dtype, None, a.codes.device, "nvfp4_mm")
    if a.shape[-1] != b.shape[-1] or a.codes.device != b.codes.device:
        raise ValueError(f"nvfp4_mm needs a common K and device, got {tuple(a.shape)} on {a.codes.device} and "
                         f"{tuple(b.shape)} on {b.codes.device}")
    if native_fp4_available(a.codes.device):
        return torch.ops.nanoquartet.native_mm(a.codes, scales_1x16(a).view(torch.uint8), a.tensor_scale, b.codes,
                                               scales_1x16(b).view(torch.uint8), b.tensor_scale, out_dtype)
    return emulated_mm(a, b, out_dtype)
