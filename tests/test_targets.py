"""The GPUs this suite never runs on: every Triton kernel variant the launchers use compiles for Hopper (sm_90) and for
Blackwell (sm_100, sm_120) within each target's registers and shared memory (compiled, not run, by
tests/compile_targets.py), and a quantized GPT takes the native NVFP4 GEMM through torch.compile's Inductor, with
cuBLAS's part simulated from its documented layouts."""

import json
import os
import subprocess
import sys

import pytest
import torch

import eden
import kernels
from compile_targets import ROOT, TARGETS
from conftest import forward_backward, random_gpt
from quantize import decode_e2m1, quantize_nvfp4, unpack_codes

REGISTERS_PER_MULTIPROCESSOR = 65536


# --- the kernels, compiled for each target ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    out = tmp_path_factory.mktemp("targets") / "builds.json"
    script = os.path.join(ROOT, "tests", "compile_targets.py")
    subprocess.run([sys.executable, script, str(out), *map(str, TARGETS)], check=True, cwd=ROOT)
    return json.load(open(out))["rows"]


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_hopper_and_blackwell(builds):
    failed = [(r["arch"], r["kernel"], r["meta"], r["error"]) for r in builds if "error" in r]
    assert not failed, failed
    for arch in TARGETS:  # the same launches everywhere, but on Blackwell without the BF16 operand, plus its fallback
        kernels_built = {r["kernel"] for r in builds if r["arch"] == arch}
        assert {"_quantize_kernel", "_eden_phase1_kernel", "_eden_phase2_kernel", "_amax_kernel",
                "_rotated_amax_kernel"} <= kernels_built, (arch, kernels_built)
    assert any(r["kernel"] == "_dequantize_kernel" for r in builds if r["arch"] == 120)  # the emulated fallback


@pytest.mark.slow
def test_every_build_fits_its_target(builds):
    # What a launch asks of a multiprocessor must be there: shared memory for one program (the most a program may
    # take) and, for MS-EDEN phase one's persistent programs, registers and shared memory for all the programs a
    # multiprocessor holds at once (EDEN_LAUNCH).
    for r in builds:
        _, shared_per_multiprocessor, shared_per_program = TARGETS[r["arch"]]
        assert r["shared"] <= shared_per_program, r
        if r["kernel"] == "_eden_phase1_kernel":
            programs = r["programs_per_multiprocessor"]
            assert r["registers"] <= r["register_cap"], r
            assert programs * r["shared"] <= shared_per_multiprocessor, r
            assert programs * r["meta"]["num_warps"] * 32 * r["register_cap"] <= REGISTERS_PER_MULTIPROCESSOR, r
    # sm_120's launch shapes were chosen from these builds: its MS-EDEN phase one must not spill
    phase_one = [r for r in builds if r["arch"] == 120 and r["kernel"] == "_eden_phase1_kernel"]
    assert phase_one and all(r["spill_stores"] == 0 for r in phase_one), phase_one


# --- the native GEMM, simulated -------------------------------------------------------------------------------------

def cublas_nvfp4_mm(mat_a, mat_b, scale_a, scale_b, **_):
    """What cuBLAS computes from scaled_mm's arguments, decoded byte by byte from its documentation: mat_a [M, K/2]
    and mat_b^T [N, K/2] hold two E2M1 codes per byte (element 2k in the low nibble); scale [0] is E4M3, one per 16
    elements of a row along K, stored in 128x4 tiles (tile (i, j) covers rows 128i.. and scale columns 4j..; tiles in
    row-major order, 512 bytes each; row r, column c of a tile at byte (r % 32) * 16 + (r // 32) * 4 + c); scale[1]
    is the FP32 tensor scale."""
    def decode(packed, scales):
        bytes_ = packed.view(torch.uint8).long()
        rows, k = bytes_.shape[0], bytes_.shape[1] * 2
        codes = torch.zeros(rows, k, dtype=torch.long)
        codes[:, 0::2], codes[:, 1::2] = bytes_ & 15, bytes_ >> 4
        blocked, tensor_scale = scales[0].view(torch.uint8), scales[1]
        col_tiles = -(-(k // 16) // 4)
        r = torch.arange(rows)[:, None]
        c = (torch.arange(k) // 16)[None, :]
        index = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        group_scale = blocked[index].view(torch.float8_e4m3fn).double()
        return decode_e2m1(codes.to(torch.uint8)).double() * group_scale * tensor_scale.double()
    return decode(mat_a, scale_a) @ decode(mat_b.t(), scale_b).t()


def exact_values(q):
    """code * group_scale * tensor_scale in FP64, where it is exact."""
    return decode_e2m1(unpack_codes(q.codes)).double() * q.element_scales().double() * q.tensor_scale.double()


@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (192, 64, 96), (320, 48, 160)])
def test_native_gemm_arguments_decode_to_the_same_product(m, n, k):
    g = torch.Generator().manual_seed(8)
    a = quantize_nvfp4(torch.randn(m, k, generator=g) * 5, four_over_six=True)
    b = quantize_nvfp4(torch.randn(n, k, generator=g))
    w = quantize_nvfp4(torch.randn(k, n, generator=g), block="16x16").t()  # a 16x16 operand, transposed
    for right in (b, w):
        simulated = cublas_nvfp4_mm(**kernels.native_mm_args(a, right))
        reference = exact_values(a) @ exact_values(right).t()
        # the same exact products, summed in another order: FP64 round-off only (a misplaced scale gives O(1))
        assert ((simulated - reference).abs().max() / reference.abs().max()).item() < 1e-13


def test_blocked_layout_places_every_scale_where_cublas_reads_it():
    rows, cols = 200, 7  # both padded: to 256 rows (two tile rows) and 8 columns (two tile columns)
    scales = torch.randint(1, 127, (rows, cols), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    blocked = kernels.blocked_scales(scales.view(torch.float8_e4m3fn)).view(torch.uint8)
    assert blocked.numel() == 256 * 8
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    index = ((r // 128) * 2 + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4  # as documented
    assert torch.equal(blocked[index], scales)  # every scale where cuBLAS reads it
    padding = torch.ones(256 * 8, dtype=torch.bool)
    padding[index.flatten()] = False
    assert (blocked[padding] == 0).all() and index.unique().numel() == rows * cols  # the rest is zero padding


def simulated_native_gemm(calls):
    """A stand-in for torch.nn.functional.scaled_mm on Blackwell: cublas_nvfp4_mm, each call recorded."""
    def scaled_mm(**arguments):
        calls.append(arguments)
        return cublas_nvfp4_mm(**arguments).to(arguments["output_dtype"])
    return scaled_mm


def test_the_native_path_is_taken_on_cuda_builds_of_blackwell_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    cases = (((10, 0), "12.8", None, True), ((12, 0), "13.0", None, True), ((9, 0), "13.0", None, False),
             ((11, 0), None, "6.4", False), ((12, 0), None, "7.0", False))  # the last two: ROCm's gfx11, gfx12
    for capability, cuda_version, hip_version, expected in cases:
        monkeypatch.setattr(torch.version, "cuda", cuda_version)
        monkeypatch.setattr(torch.version, "hip", hip_version)
        assert kernels.native_fp4_available(cuda) == expected, (capability, cuda_version, hip_version)
    assert not kernels.native_fp4_available(torch.device("cpu"))


def native_operands(monkeypatch):
    """Operands as the quantizers make them on a Blackwell GPU (the native path forced, on the CPU's references)."""
    monkeypatch.setattr(kernels, "native_fp4_available", lambda device: True)
    g = torch.Generator().manual_seed(15)
    return (kernels.quantize_op(torch.randn(256, 384, generator=g), four_over_six=True),
            kernels.quantize_op(torch.randn(128, 384, generator=g), block="16x16"))


def test_on_blackwell_the_quantizers_skip_the_bf16_operand_and_the_native_gemm_reads_codes(monkeypatch):
    a, w = native_operands(monkeypatch)
    e = torch.randn(256, 128, generator=torch.Generator().manual_seed(16))
    signs = eden.random_signs(generator=torch.Generator().manual_seed(16))
    made = [a, w, *kernels.ms_eden_pair_op(e, signs), kernels.requantize_ms_eden_op(a, signs)]
    assert all(q.gemm_operand is None for q in made)  # ~2 of a quantization's ~6.6 bytes per element, not written
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", simulated_native_gemm(calls))
    for right in (w, w.t().t()):  # a 16x16 operand, also through its exact transpose
        out = kernels.nvfp4_mm(a, right, torch.float32).double()
        reference = exact_values(a) @ exact_values(right).t()
        assert ((out - reference).norm() / reference.norm()).item() < 1e-6  # FP32 output rounding only
    assert len(calls) == 2


def test_a_refused_native_gemm_says_so_once_and_emulates(monkeypatch, capsys):
    a, w = native_operands(monkeypatch)
    monkeypatch.setattr(kernels, "_native_refused", [])

    def refuse(**arguments):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore detail")
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", refuse)
    reference = exact_values(a) @ exact_values(w).t()
    for _ in range(3):
        out = kernels.nvfp4_mm(a, w, torch.float32).double()
        assert ((out - reference).norm() / reference.norm()).item() < 1e-6
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "CUBLAS_STATUS_NOT_SUPPORTED" in printed[0] and "emulating" in printed[0], printed


@pytest.mark.slow
def test_a_quantized_gpt_compiles_through_inductor_with_the_native_gemm(monkeypatch):
    # Blackwell's training step up to the hardware: the native path forced and cuBLAS's NVFP4 GEMM simulated, the
    # whole GPT compiled by Inductor as train.py compiles it. The native GEMM must reach the compiled code as the
    # operator it is (Inductor's own lowering of scaled_mm refuses the blocked scales) and run on every call.
    monkeypatch.setattr(kernels, "native_fp4_available", lambda device: True)
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", simulated_native_gemm(calls))
    gpt, tokens = random_gpt("quartet2")
    eager_loss, eager_grads = forward_backward(gpt, gpt, tokens, seed=1)
    per_step = len(calls)
    assert per_step == 3 * 4 * len(gpt.blocks)  # three GEMMs of q/k/v (one), proj, fc and the MLP's proj per block
    compiled = torch.compile(gpt, fullgraph=True, dynamic=False)
    for seed in (1, 2):
        loss, grads = forward_backward(gpt, compiled, tokens, seed)
        assert abs(loss.item() - eager_loss.item()) < 1e-4  # the forward is deterministic; Inductor fuses its floats
        assert all(g.isfinite().all() and ((g - e).norm() <= e.norm()).item() for g, e in zip(grads, eager_grads))
    assert len(calls) == 3 * per_step  # called by the compiled code at every step, not traced into it once


@pytest.mark.gpu
def test_native_gemm_on_blackwell_only():
    device = torch.device("cuda")
    if not kernels.native_fp4_available(device):
        pytest.skip("no FP4 tensor cores on this GPU (the arguments are checked by the simulation above)")
    a = kernels.triton_quantize(torch.randn(256, 512, device=device, dtype=torch.bfloat16))
    b = kernels.triton_quantize(torch.randn(384, 512, device=device, dtype=torch.bfloat16))
    out = kernels.nvfp4_mm(a, b).double().cpu()
    reference = a.dequantize().double().cpu() @ b.dequantize().double().cpu().t()
    assert ((out - reference).norm() / reference.norm()).item() < 2 ** -8
