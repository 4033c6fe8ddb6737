"""A/B of MS-EDEN phase one and the re-quantization: a kernels.py of before (first argument, e.g.
`git show 6af64b1:kernels.py > /tmp/before.py`) against another (second argument; e.g. 6af64b1's with
results/eden_h2xh64_2026-12-01.patch applied: the rotation as H2 x H64, two 64-wide dots), same inputs, outputs
compared, a few launch shapes of the new kernel. AB_ONLY=requant times the re-quantization only. Prints one line per
case; writes $OUT/ab.json. NOTES.md, 2026-12-01 (second night), calls 1-3."""
import json
import os
import sys
import types

sys.path.insert(0, os.getcwd())
import torch
import triton

from eden import random_signs


def load(path, name):
    source = open(path).read().replace('"nanoquartet::', f'"{name}::')  # its own operator namespace
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(source, path, "exec"), module.__dict__)
    return module


before = load(sys.argv[1], "kernels_before")
new = load(sys.argv[2], "kernels_new")
ONLY = os.environ.get("AB_ONLY")
SMOKE = not torch.cuda.is_available()  # on a CPU (TRITON_INTERPRET=1): checks this script only
device = "cpu" if SMOKE else "cuda"
torch.manual_seed(0)
seed = torch.tensor([1234], device=device)
signs = random_signs(device=device)
DEFAULTS = {m: dict(m.EDEN_LAUNCH) for m in (before, new)}
rows_out = []


def phase1_diff(a, b):
    """(codes differing, largest relative difference of the corrected scales, same maximum) of two phase-one results."""
    return ((a[0] != b[0]).sum().item(), ((a[1] - b[1]).abs() / b[1].abs().clamp(min=1e-30)).max().item(),
            a[2].item() == b[2].item())


def nvfp4_diff(a, b):
    return ((a.codes != b.codes).sum().item(), (a.group_scale.view(torch.uint8) != b.group_scale.view(torch.uint8))
            .sum().item())


def timed(name, shape, variants, compare):
    """variants: {label: (module, launch overrides, fn)}; the first is the reference of the comparison. Since
    2026-12-02 kernels.py launches the re-quantization with the "bf16" entry (it had an "nvfp4" one before)."""
    variants = {label: (module, {("bf16" if key == "nvfp4" and key not in DEFAULTS[module] else key): value
                                 for key, value in launch.items()}, fn)
                for label, (module, launch, fn) in variants.items()}
    results, times = {}, {label: [] for label in variants}
    for label, (module, launch, fn) in variants.items():
        module.EDEN_LAUNCH.update(DEFAULTS[module], **launch)
        results[label] = fn(module)
    for _ in range(1 if SMOKE else 5):  # interleaved rounds
        for label, (module, launch, fn) in variants.items():
            module.EDEN_LAUNCH.update(DEFAULTS[module], **launch)
            times[label].append(0.0 if SMOKE else triton.testing.do_bench(lambda: fn(module), warmup=10, rep=60))
    reference = results[next(iter(variants))]
    for label in variants:
        t = sorted(times[label])
        diff = compare(results[label], reference)
        rows_out.append(dict(case=name, shape=list(shape), variant=label, ms=t[len(t) // 2], ms_min=t[0],
                             ms_max=t[-1], differs=str(diff)))
        print(f"{name:<22}{str(tuple(shape)):<14}{label:<32}{t[len(t) // 2]:8.4f} ({t[0]:.4f}-{t[-1]:.4f})  {diff}",
              flush=True)
    for module in (before, new):
        module.EDEN_LAUNCH.update(DEFAULTS[module])


for shape in [(256, 256)] if SMOKE else [(16384, 4096), (32768, 3072), (32768, 768)]:
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    pair = lambda k: k.eden_phase1(x, signs)
    if ONLY != "requant":
        timed("phase 1 pair", shape, {
            "before": (before, {}, pair),
            "new (4, 128, 4/SM, 1)": (new, {}, pair),
            "new (4, -, 3/SM, 1)": (new, dict(bf16=(4, None, 3, 1)), pair),
            "new (4, 128, 4/SM, 2)": (new, dict(bf16=(4, 128, 4, 2)), pair),
            "new (4, -, 2/SM, 2)": (new, dict(bf16=(4, None, 2, 2)), pair),
            "new (8, 64, 4/SM, 1)": (new, dict(bf16=(8, 64, 4, 1)), pair),
        }, lambda a, b: (phase1_diff(a[0], b[0]), phase1_diff(a[1], b[1])))
    saved = new.triton_quantize(x, four_over_six=True, scaled_codes=False)
    requant = lambda k: k.eden_phase1_requantize(saved, signs)
    timed("re-quantize phase 1", shape, {
        "before": (before, {}, requant),
        "new (4, 168, 3/SM, 1)": (new, {}, requant),
        "new (4, 128, 4/SM, 1)": (new, dict(nvfp4=(4, 128, 4, 1)), requant),
        "new (4, 168, 3/SM, 2)": (new, dict(nvfp4=(4, 168, 3, 2)), requant),
    }, phase1_diff)
    if (shape[0] == 16384 or SMOKE) and ONLY != "requant":
        timed("MS-EDEN pair (all)", shape, {m: (mod, {}, lambda k: k.triton_ms_eden_pair(x, signs, seed=seed))
                                            for m, mod in (("before", before), ("new", new))},
              lambda a, b: (nvfp4_diff(a[0], b[0]), nvfp4_diff(a[1], b[1])))
    if shape[0] == 16384 or SMOKE:
        timed("re-quantize (all)", shape, {m: (mod, {}, lambda k: k.triton_requantize_ms_eden(saved, signs, seed=seed))
                                           for m, mod in (("before", before), ("new", new))}, nvfp4_diff)
        copy_ms = 0.0 if SMOKE else triton.testing.do_bench(lambda: x.clone(), warmup=10, rep=60)
        print(f"copy of x: {copy_ms:.4f} ms")
        rows_out.append(dict(case="copy", shape=list(shape), ms=copy_ms))

os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "ab.json"), "w") as f:
    json.dump(rows_out, f, indent=1)
