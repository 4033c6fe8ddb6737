"""A/B of two kernels.py on a GPU, run from the repository root: every `bench.py kernels` case and MS-EDEN's launch
variants, a kernels.py of before (the first argument, e.g. `git show ebd04cb:kernels.py > /tmp/before.py`) against
the working tree's, on the same inputs and seeds, with the outputs compared. Optional second argument: a third
kernels.py timed on the RTN + 4/6 cases only. Prints one line per case and writes $OUT/ab.json.
NOTES.md, 2026-12-01 (evening), call 1."""
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
third = load(sys.argv[2], "kernels_third") if len(sys.argv) > 2 else None
SMOKE = not torch.cuda.is_available()  # on a CPU (TRITON_INTERPRET=1): a tiny run that checks this script only
device = "cpu" if SMOKE else "cuda"
torch.manual_seed(0)
seed = torch.tensor([1234], device=device)
signs = {n: random_signs(n, device=device) for n in (16, 32, 128)}
DEFAULT_BF16, DEFAULT_NVFP4 = new.EDEN_LAUNCH["bf16"], new.EDEN_LAUNCH["nvfp4"]


def quantizers(x):
    sr = dict(rounding="sr", fp4_max=SR_FP4_MAX, seed=seed)
    return {"RTN 1x16": dict(), "RTN + 4/6": dict(four_over_six=True), "RTN 16x16": dict(block="16x16"),
            "RTN 16x16 + 4/6": dict(block="16x16", four_over_six=True), "SR 1x16": sr,
            "SR + 4/6": dict(sr, four_over_six=True), "SR of RHT16(x^T)": dict(sr, transpose=True, signs=signs[16]),
            "SR of RHT32(x^T)": dict(sr, transpose=True, signs=signs[32]),
            "RTN of RHT16(x^T)": dict(transpose=True, signs=signs[16])}


def same_nvfp4(a, b):
    """(codes differing, scales differing, largest relative difference of code * scale) of two NVFP4Tensors."""
    codes = (a.codes != b.codes).sum().item()
    scales = (a.group_scale.view(torch.uint8) != b.group_scale.view(torch.uint8)).sum().item()
    scaled = 0.0
    if a.scaled_codes is not None and b.scaled_codes is not None:
        scaled = ((a.scaled_codes.float() - b.scaled_codes.float()).abs().max() /
                  b.scaled_codes.float().abs().max().clamp(min=1e-30)).item()
    return codes, scales, scaled


def same_phase1(a, b):
    codes = (a[0] != b[0]).sum().item()
    relative = ((a[1] - b[1]).abs() / b[1].abs().clamp(min=1e-30)).max().item()
    return codes, relative, a[2].item() == b[2].item()


rows_out = []


def timed(name, shape, variants, compare):
    """variants: {label: (module, function, setup)}; the first is the reference of the comparison."""
    results = {}
    for label, (module, fn, setup) in variants.items():
        setup(module)
        results[label] = fn(module)
    reference = results[next(iter(variants))]
    times = {label: [] for label in variants}
    for _ in range(1 if SMOKE else 5):  # interleaved rounds
        for label, (module, fn, setup) in variants.items():
            setup(module)
            times[label].append(0.0 if SMOKE else triton.testing.do_bench(lambda: fn(module), warmup=10, rep=60))
    for label in variants:
        t = sorted(times[label])
        diff = compare(results[label], reference)
        rows_out.append(dict(case=name, shape=list(shape), variant=label, ms=t[len(t) // 2], ms_min=t[0], ms_max=t[-1],
                             differs=diff))
        print(f"{name:<24}{str(tuple(shape)):<14}{label:<34}{t[len(t) // 2]:8.4f} ({t[0]:.4f}-{t[-1]:.4f})  {diff}",
              flush=True)
    for module in (before, new):
        module.EDEN_LAUNCH["bf16"], module.EDEN_LAUNCH["nvfp4"] = DEFAULT_BF16, DEFAULT_NVFP4


def plain(module):
    module.EDEN_LAUNCH["bf16"], module.EDEN_LAUNCH["nvfp4"] = DEFAULT_BF16, DEFAULT_NVFP4


def launch(bf16=None, nvfp4=None):
    def setup(module):
        plain(module)
        if bf16:
            module.EDEN_LAUNCH["bf16"] = bf16
        if nvfp4:
            module.EDEN_LAUNCH["nvfp4"] = nvfp4
    return setup


for shape in [(256, 256)] if SMOKE else [(16384, 4096), (32768, 3072), (32768, 768)]:
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    big = shape in ((16384, 4096), (256, 256))
    if big:
        timed("amax", shape, {m: (mod, lambda k: k._amax(x), plain) for m, mod in (("before", before), ("new", new))},
              lambda a, b: int(a.item() != b.item()))
    for name, options in quantizers(x).items():
        if not big and name not in ("RTN + 4/6", "SR of RHT16(x^T)"):
            continue
        variants = {m: (mod, lambda k, o=options: k.triton_quantize(x, **o), plain)
                    for m, mod in (("before", before), ("new", new))}
        if third is not None and "4/6" in name and "RTN" in name:
            variants["third"] = (third, lambda k, o=options: k.triton_quantize(x, **o), plain)
        timed(name, shape, variants, same_nvfp4)
    s = signs[128]
    variants = {"before": (before, lambda k: k.eden_phase1(x, s), plain),
                "new (4, -, 3/SM, 1 stage: default)": (new, lambda k: k.eden_phase1(x, s), plain),
                "new (4, -, 2/SM, 2 stages)": (new, lambda k: k.eden_phase1(x, s), launch(bf16=(4, None, 2, 2))),
                "new (4, -, 3/SM, 2 stages)": (new, lambda k: k.eden_phase1(x, s), launch(bf16=(4, None, 3, 2))),
                "new (4, 128 regs, 4/SM, 1 stage)": (new, lambda k: k.eden_phase1(x, s), launch(bf16=(4, 128, 4, 1))),
                "new (4, -, 2/SM, 3 stages)": (new, lambda k: k.eden_phase1(x, s), launch(bf16=(4, None, 2, 3)))}
    timed("MS-EDEN phase 1 pair", shape, variants, lambda a, b: (same_phase1(a[0], b[0]), same_phase1(a[1], b[1])))
    saved = new.triton_quantize(x, four_over_six=True, scaled_codes=False)
    variants = {"before": (before, lambda k: k.eden_phase1_requantize(saved, s), plain),
                "new (4, 168, 3/SM, 1 stage)": (new, lambda k: k.eden_phase1_requantize(saved, s), plain),
                "new (4, 128, 4/SM, 1 stage)": (new, lambda k: k.eden_phase1_requantize(saved, s),
                                                launch(nvfp4=(4, 128, 4, 1))),
                "new (4, 168, 3/SM, 2 stages)": (new, lambda k: k.eden_phase1_requantize(saved, s),
                                                 launch(nvfp4=(4, 168, 3, 2)))}
    timed("re-quantize phase 1", shape, variants, same_phase1)
    if big:
        phase1 = new.eden_phase1(x, s)
        timed("MS-EDEN phase 2", shape,
              {m: (mod, lambda k: k.eden_phase2(phase1[0], seed=seed), plain) for m, mod in (("before", before),
                                                                                              ("new", new))},
              same_nvfp4)
        timed("dequantize to BF16", shape,
              {m: (mod, lambda k: k.triton_dequantize(saved, torch.bfloat16), plain)
               for m, mod in (("before", before), ("new", new))},
              lambda a, b: (a != b).sum().item())
        timed("MS-EDEN pair (all)", shape,
              {m: (mod, lambda k: k.triton_ms_eden_pair(x, s, seed=seed), plain) for m, mod in (("before", before),
                                                                                               ("new", new))},
              lambda a, b: (same_nvfp4(a[0], b[0]), same_nvfp4(a[1], b[1])))
        timed("re-quantize (all)", shape,
              {m: (mod, lambda k: k.triton_requantize_ms_eden(saved, s, seed=seed), plain)
               for m, mod in (("before", before), ("new", new))}, same_nvfp4)
    del x
json.dump(rows_out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ab.json"), "w"), indent=1)
