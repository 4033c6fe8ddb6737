"""A/B of two kernels.py on a GPU, from the repository root: `python results/kernels_ab_2026-12-02.py BEFORE.py`
times the quantizers, MS-EDEN's phases and the re-quantization of BEFORE.py and of the working tree's kernels.py,
interleaved, on the same inputs and seeds, and counts the outputs that differ (codes, scale bits, code * scale; the
random ones draw the same Philox numbers, so they must agree too). Prints a table, writes $OUT/ab.json if OUT is set.
On a CPU (TRITON_INTERPRET=1) it runs one tiny shape untimed: a check of the script. NOTES.md, 2026-12-02 (session
two), call 1."""
import json
import os
import sys
import types

sys.path.insert(0, os.getcwd())
import torch
import triton

import kernels as new
from eden import random_signs
from quantize import SR_FP4_MAX


def load(path, name):
    source = open(path).read().replace('"nanoquartet::', f'"{name}::')  # its own operator namespace
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(source, path, "exec"), module.__dict__)
    return module


before = load(sys.argv[1], "kernels_before")
GPU = torch.cuda.is_available()
device = "cuda" if GPU else "cpu"
torch.manual_seed(0)
seed = torch.tensor([1234], device=device)
signs = {n: random_signs(n, device=device) for n in (16, 32, 128)}
sr = dict(rounding="sr", fp4_max=SR_FP4_MAX, seed=seed)
QUANTIZERS = {"RTN 1x16": dict(), "RTN + 4/6": dict(four_over_six=True), "RTN 16x16": dict(block="16x16"),
              "RTN 16x16 + 4/6": dict(block="16x16", four_over_six=True), "SR 1x16": sr,
              "SR + 4/6": dict(sr, four_over_six=True), "SR of RHT16(x^T)": dict(sr, transpose=True, signs=signs[16]),
              "SR of RHT32(x^T)": dict(sr, transpose=True, signs=signs[32]),
              "RTN of RHT16(x^T)": dict(transpose=True, signs=signs[16])}


def differing(a, b):
    """Elements that differ between two outputs (NVFP4Tensors, tuples of them, or phase-one triples)."""
    if isinstance(a, tuple) and isinstance(a[0], torch.Tensor):  # phase one: codes, corrected scales, maximum
        return int((a[0] != b[0]).sum() + (a[1] != b[1]).sum() + (a[2] != b[2]).sum())
    if isinstance(a, tuple):
        return sum(differing(x, y) for x, y in zip(a, b))
    count = (a.codes != b.codes).sum() + (a.group_scale.view(torch.uint8) != b.group_scale.view(torch.uint8)).sum()
    return int(count + (a.tensor_scale != b.tensor_scale).sum() + (a.scaled_codes != b.scaled_codes).sum())


rows = []


def case(name, shape, fn):
    """fn(module) -> output; both modules' outputs compared, then timed in 5 interleaved rounds."""
    outputs = {label: fn(module) for label, module in (("before", before), ("after", new))}
    times = {"before": [], "after": []}
    for _ in range(5 if GPU else 1):
        for label, module in (("before", before), ("after", new)):
            times[label].append(triton.testing.do_bench(lambda: fn(module), warmup=10, rep=50) if GPU else 0.0)
    medians = {label: sorted(t)[len(t) // 2] for label, t in times.items()}
    row = dict(case=name, shape=list(shape), before_ms=medians["before"], after_ms=medians["after"],
               differing=differing(outputs["after"], outputs["before"]))
    rows.append(row)
    print(f"{name:<28}{str(tuple(shape)):<16}{medians['before']:9.4f}{medians['after']:9.4f}"
          f"{medians['after'] / max(medians['before'], 1e-9):8.3f}  differing {row['differing']}", flush=True)


print(f"{'case':<28}{'shape':<16}{'before':>9}{'after':>9}{'ratio':>8}")
for shape in [(16384, 4096), (32768, 768), (32768, 3072)] if GPU else [(256, 256)]:
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    big = shape[1] == 4096 or not GPU
    for name, options in QUANTIZERS.items():
        if big or name in ("RTN + 4/6", "SR of RHT16(x^T)"):
            case(name, shape, lambda k, o=options: k.triton_quantize(x, **o))
    phase1 = new.eden_phase1(x, signs[128])
    case("MS-EDEN phase 2, pair", shape, lambda k: k.eden_phase2(*phase1, seed=seed))
    case("MS-EDEN x and x^T (all)", shape, lambda k: k.triton_ms_eden_pair(x, signs[128], seed=seed))
    saved = new.triton_quantize(x, four_over_six=True, scaled_codes=False)
    case("re-quantize (all)", shape, lambda k: k.triton_requantize_ms_eden(saved, signs[128], seed=seed))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
