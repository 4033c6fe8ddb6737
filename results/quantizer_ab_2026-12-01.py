"""Calls 1 and 2 of NOTES.md 2026-12-01 (last), run from the repository root on a GPU: every RTN/SR quantizer at
several launch shapes, 216b39e's kernels.py against the working tree's, outputs compared bit for bit.
Call 1: `python results/quantizer_ab_2026-12-01.py --inductor`, the working tree with the E2M1-code change described
there (without the rtnT row), and inductor fusing an absolute maximum into relu^2 and RMS norm.
Call 2: the same without --inductor after `git apply results/quantizer_halves_2026-12-01.patch` (without the
64 x 8 shape)."""
import os, sys, types, json
sys.path.insert(0, os.getcwd())
import torch, triton
import kernels as new
from quantize import SR_FP4_MAX

def load(path, name):
    src = open(path).read().replace('"nanoquartet::', f'"{name}::')
    mod = types.ModuleType(name); mod.__file__ = path
    sys.modules[name] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod

import subprocess
open("/tmp/kernels_head.py", "w").write(subprocess.run(["git", "show", "216b39e:kernels.py"], capture_output=True,
                                                  text=True, check=True).stdout)
head = load("/tmp/kernels_head.py", "kernels_head")
dev = "cuda"
torch.manual_seed(0)
out_dir = os.environ.get("OUT", "/tmp")
x = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
s16 = torch.where(torch.rand(16, device=dev) < 0.5, -1.0, 1.0)
s32 = torch.where(torch.rand(32, device=dev) < 0.5, -1.0, 1.0)
seed = torch.tensor([1234], device=dev)
VARIANTS = {
    "rtn": dict(), "rtn46": dict(four_over_six=True), "16x16_46": dict(block="16x16", four_over_six=True),
    "16x16": dict(block="16x16"), "rtnT": dict(transpose=True),
    "sr": dict(rounding="sr", fp4_max=SR_FP4_MAX), "sr46": dict(rounding="sr", fp4_max=SR_FP4_MAX, four_over_six=True),
    "srT16": dict(rounding="sr", fp4_max=SR_FP4_MAX, transpose=True, signs=s16),
    "srT32": dict(rounding="sr", fp4_max=SR_FP4_MAX, transpose=True, signs=s32),
    "rtn16x16_46T": dict(block="16x16", four_over_six=True, transpose=True),
}
CONFIGS = [(16, 2), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)]

def run(mod, rows, warps, kw):
    mod.QUANTIZE_ROWS, mod.QUANTIZE_WARPS = rows, warps
    return mod.triton_quantize(x, seed=seed if kw.get("rounding") == "sr" else None, **kw)

def same(a, b):
    return (torch.equal(a.codes, b.codes) and torch.equal(a.group_scale.view(torch.uint8), b.group_scale.view(torch.uint8))
            and torch.equal(a.scaled_codes, b.scaled_codes) and torch.equal(a.tensor_scale, b.tensor_scale))

rows = []
for vname, kw in VARIANTS.items():
    ref = run(head, 16, 4, kw)
    cases = [("head", 16, 4, head)] + [("new", r, w, new) for r, w in CONFIGS]
    ident = {}
    for tag, r, w, mod in cases:
        ident[(tag, r, w)] = same(run(mod, r, w, kw), ref)
    times = {k: [] for k in ident}
    for _ in range(3):
        for tag, r, w, mod in cases:
            times[(tag, r, w)].append(triton.testing.do_bench(lambda: run(mod, r, w, kw), warmup=10, rep=80))
    for (tag, r, w), t in times.items():
        t = sorted(t)
        rows.append(dict(variant=vname, code=tag, rows=r, warps=w, ms=t[1], ms_min=t[0], ms_max=t[2],
                         identical=ident[(tag, r, w)]))
        print("%-14s %-5s %3d x %2d  %.4f  (%.4f-%.4f)  %s" % (vname, tag, r, w, t[1], t[0], t[2], ident[(tag, r, w)]),
              flush=True)
new.QUANTIZE_ROWS, new.QUANTIZE_WARPS = 16, 4
print("amax alone %.4f ms" % triton.testing.do_bench(lambda: new._amax(x), warmup=10, rep=80))
json.dump(rows, open(os.path.join(out_dir, "sweep.json"), "w"), indent=1)

if "--inductor" not in sys.argv:
    sys.exit()
# Inductor: can the producer of a quantizer's input compute its absolute maximum on the fly?
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
def relu2(h): return F.relu(h).square()
def relu2_rowamax(h):
    y = F.relu(h).square(); return y, y.abs().amax(dim=-1).amax()
def relu2_amax(h):
    y = F.relu(h).square(); return y, y.abs().amax()
def rms(x): return F.rms_norm(x, (x.size(-1),))
def rms_rowamax(x):
    y = F.rms_norm(x, (x.size(-1),)); return y, y.abs().amax(dim=-1).amax()
def rms_amax(x):
    y = F.rms_norm(x, (x.size(-1),)); return y, y.abs().amax()
h = torch.randn(32768, 3072, device=dev, dtype=torch.bfloat16)
r = torch.randn(32768, 768, device=dev, dtype=torch.bfloat16)
for name, fn, inp in [("relu2", relu2, h), ("relu2+rowamax", relu2_rowamax, h), ("relu2+amax", relu2_amax, h),
                      ("rms", rms, r), ("rms+rowamax", rms_rowamax, r), ("rms+amax", rms_amax, r)]:
    c = torch.compile(fn)
    res, code = run_and_get_code(c, inp)
    kernels_n = sum(s.count("@triton.jit") for s in code)
    ms = triton.testing.do_bench(lambda: c(inp), warmup=10, rep=100)
    ok = ""
    if isinstance(res, tuple):
        ok = torch.equal(res[1].float(), res[0].float().abs().max())
    print("%-16s kernels %d  %.4f ms  %s" % (name, kernels_n, ms, ok), flush=True)
    if name in ("relu2+rowamax", "rms+rowamax"):
        open(os.path.join(out_dir, name + ".py"), "w").write("\n\n".join(code))
y = relu2(h)
print("our amax of relu2 output %.4f ms" % triton.testing.do_bench(lambda: new._amax(y), warmup=10, rep=100))
