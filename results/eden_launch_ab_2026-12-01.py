"""MS-EDEN phase one's launch variants (kernels.EDEN_LAUNCH: warps, register cap, programs per multiprocessor,
stages), timed on a GPU in interleaved rounds, outputs compared with the default's. Run from the repository root
after `git apply results/eden_register_prefetch_2026-12-01.patch` (stages 0: the next job's input loaded into
registers while one is processed; not adopted); writes $OUT/launch_ab.json. NOTES.md, 2026-12-01 (evening), call 4."""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton

import kernels
from eden import random_signs

VARIANTS = {"bf16": [(4, 128, 4, 1), (4, 168, 3, 0), (4, None, 2, 0)], "nvfp4": [(4, 168, 3, 1), (4, 168, 3, 0)]}
default = dict(kernels.EDEN_LAUNCH)
signs = random_signs(128, device="cuda")
rows = []
for shape in [(16384, 4096), (32768, 3072), (32768, 768)]:
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    saved = kernels.triton_quantize(x, four_over_six=True, scaled_codes=False)
    for key, run in (("bf16", lambda: kernels.eden_phase1(x, signs)[1]),
                     ("nvfp4", lambda: kernels.eden_phase1_requantize(saved, signs))):
        reference = run()
        times = {launch: [] for launch in VARIANTS[key]}
        same = {}
        for launch in VARIANTS[key]:
            kernels.EDEN_LAUNCH[key] = launch
            out = run()
            same[launch] = bool(torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1]))
        for _ in range(5):
            for launch in VARIANTS[key]:
                kernels.EDEN_LAUNCH[key] = launch
                times[launch].append(triton.testing.do_bench(run, warmup=10, rep=60))
        kernels.EDEN_LAUNCH.update(default)
        for launch, t in times.items():
            t = sorted(t)
            rows.append(dict(input=key, shape=list(shape), launch=list(launch), ms=t[2], ms_min=t[0], ms_max=t[-1],
                             same_as_default=same[launch]))
            print(f"{key:<6}{str(shape):<15}{str(launch):<20}{t[2]:8.4f} ({t[0]:.4f}-{t[-1]:.4f}) same {same[launch]}",
                  flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_ab.json"), "w"), indent=1)
