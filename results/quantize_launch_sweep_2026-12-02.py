"""Launch shapes of the RTN/SR quantizer per configuration (16384 x 4096 BF16), % of copy bandwidth; RTN outputs
checked bit-identical to the default shape's."""
import os, sys, json
sys.path.insert(0, ".")
import torch, triton
import kernels
from eden import random_signs
from quantize import SR_FP4_MAX
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
signs16 = random_signs(16, device="cuda")
n = x.numel()
copy = triton.testing.do_bench(lambda: x.clone(), warmup=20, rep=200)
copy_bw = 4 * n / copy  # bytes per ms
packed, scales, bf16 = 0.5, 1 / 16, 2
cases = {
    "rtn": (lambda: kernels.triton_quantize(x), 6 + packed + scales),
    "rtn46": (lambda: kernels.triton_quantize(x, four_over_six=True), 6 + packed + scales),
    "16x16": (lambda: kernels.triton_quantize(x, block="16x16"), 6 + packed + scales / 16),
    "sr": (lambda: kernels.triton_quantize(x, rounding="sr", fp4_max=SR_FP4_MAX), 6 + packed + scales),
    "srT16": (lambda: kernels.triton_quantize(x, rounding="sr", fp4_max=SR_FP4_MAX, transpose=True, signs=signs16),
              6 + packed + scales),
}
shapes = [(16, 4), (16, 2), (16, 8), (32, 4), (32, 8), (64, 8), (64, 4)]
rows = []
for name, (fn, bytes_per) in cases.items():
    kernels.QUANTIZE_ROWS, kernels.QUANTIZE_WARPS = 16, 4
    ref = fn()
    for r, w in shapes:
        kernels.QUANTIZE_ROWS, kernels.QUANTIZE_WARPS = r, w
        try:
            q = fn()
            same = bool(torch.equal(q.codes, ref.codes) and torch.equal(q.group_scale.view(torch.uint8), ref.group_scale.view(torch.uint8)))
            ms = triton.testing.do_bench(fn, warmup=20, rep=200)
            pct = 100 * bytes_per * n / ms / copy_bw
        except Exception as e:
            same, ms, pct = str(e)[:60], float("nan"), float("nan")
        rows.append(dict(case=name, rows=r, warps=w, ms=ms, pct_copy=pct, same=same))
        print(f"SWEEP {name:<6} rows {r:>2} warps {w}: {ms:.4f} ms {pct:5.1f}% of copy  same={same}", flush=True)
kernels.QUANTIZE_ROWS, kernels.QUANTIZE_WARPS = 16, 4
json.dump(dict(copy_ms=copy, rows=rows), open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep.json"), "w"), indent=1)
