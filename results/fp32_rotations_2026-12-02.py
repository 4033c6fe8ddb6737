"""FP32 input to a rotation on the GPU: the FP32 kernels (FMA dots) against the PyTorch references."""
import sys; sys.path.insert(0, ".")
import torch, triton
import kernels
from eden import random_signs, quantize_ms_eden, rht
from quantize import quantize_nvfp4, SR_FP4_MAX
torch.manual_seed(0)
for shape in [(4096, 4096), (16384, 4096)]:
    x = torch.randn(*shape, device="cuda", dtype=torch.float32)
    s128, s16 = random_signs(128, device="cuda"), random_signs(16, device="cuda")
    cases = {
        "MS-EDEN pair, kernel": lambda: kernels.triton_ms_eden_pair(x, s128),
        "MS-EDEN pair, reference": lambda: (quantize_ms_eden(x, s128), quantize_ms_eden(x.t(), s128)),
        "SR RHT16(x^T), kernel": lambda: kernels.triton_quantize(x, "sr", fp4_max=SR_FP4_MAX, transpose=True, signs=s16),
        "SR RHT16(x^T), reference": lambda: quantize_nvfp4(rht(x.t(), s16), "sr", fp4_max=SR_FP4_MAX),
        "RTN RHT128(x), kernel": lambda: kernels.triton_quantize(x, signs=s128),
        "RTN RHT128(x), reference": lambda: quantize_nvfp4(rht(x, s128)),
    }
    for name, fn in cases.items():
        try:
            ms = triton.testing.do_bench(fn, warmup=5, rep=50)
        except Exception as e:
            ms = f"error {str(e)[:80]}"
        print(f"FP32ROT {shape} {name:<28} {ms if isinstance(ms, str) else f'{ms:.3f} ms'}", flush=True)
