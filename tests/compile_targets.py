"""Compile every Triton kernel variant a training step launches, for GPUs this machine may not have:

    python tests/compile_targets.py OUT.json 90 100 120      # sm_90 (Hopper), sm_100 and sm_120 (Blackwell)

It imports kernels.py without Triton's interpreter, records every kernel launch of the linear layers' forward +
backward (every recipe, in BF16 as training autocasts it, with each target's launch shapes; recorded, not run) and
compiles each with Triton for each target, through a stand-in for Triton's GPU driver that names the target, with
the launch's own grid, constants, warps and register cap. ptxas reports MS-EDEN phase one's registers and spills;
the table and OUT.json list every build, with the provenance (tests/test_targets.py checks them)."""

import json
import os
import re
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# target -> (multiprocessors, shared memory per multiprocessor, the most one program may take), from NVIDIA's
# tuning guides: H100/H200, B200, RTX 5090
TARGETS = {90: (132, 228 * 1024, 227 * 1024), 100: (148, 228 * 1024, 227 * 1024),
           120: (170, 100 * 1024, 99 * 1024)}


def record_launches(arch):
    """Every distinct kernel launch of the linear layers' forward + backward in every recipe, in BF16, as the
    launchers would make them on `arch` (a native NVFP4 GEMM from sm_100 on, whose quantizers skip the BF16
    operand; its refusal by cuBLASLt falls back to the dequantization kernel). Returns [(kernel, grid, args, meta)]."""
    from triton.runtime.jit import JITFunction
    import kernels
    import model
    multiprocessors, shared, _ = TARGETS[arch]
    kernels._on_gpu = lambda t: True  # the operators take the kernels' path for CPU tensors,
    kernels.check_input = lambda *args, **kwargs: None  # the launchers accept them,
    kernels._gpu = lambda device: (multiprocessors, shared)  # and size their launches for the target
    kernels.native_fp4_available = lambda device: arch >= 100
    torch.nn.functional.scaled_mm = lambda **arguments: (_ for _ in ()).throw(RuntimeError("no GPU here"))
    launches, seen = [], set()

    def record(kernel, *args, grid, warmup, **meta):
        key = (kernel.__name__, tuple(str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
                                      for a in args), tuple(sorted(meta.items())))
        if key not in seen:
            seen.add(key)
            launches.append((kernel, grid, args, meta))
    JITFunction.run = record
    for recipe in model.RECIPES:
        x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(384, 256, dtype=torch.bfloat16, requires_grad=True)
        model.RecipeLinear.apply(x, w, recipe).backward(torch.randn(256, 384, dtype=torch.bfloat16))
    # MS-EDEN phase one loops over a number of tiles fixed at compile time: a d12 micro-batch's too
    e = torch.randn(32768, 768, dtype=torch.bfloat16)
    kernels.eden_phase1(e, torch.ones(128))
    kernels.eden_phase1_requantize(kernels.triton_quantize(e, gemm_operand=False), torch.ones(128))
    return launches


def ptxas_resources(compiled, arch):
    """Registers, stack and spills (bytes) of a compiled kernel, from the ptxas that built it."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch).path  # the ptxas Triton itself builds the target with
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(compiled.asm["ptx"])
        source.flush()
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", source.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    stack, stores, loads = map(int, re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                                              r"spill loads", log).groups())
    return dict(registers=int(re.search(r"Used (\d+) registers", log).group(1)), stack=stack, spill_stores=stores,
                spill_loads=loads)


def compile_for(arch):
    """[one row per distinct launch]: kernel, meta-parameters, and the build's resources or its error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction
    import kernels
    run = JITFunction.run  # record_launches replaces it

    class StandIn:  # what a JIT function asks the driver: the target, a device (one per target) and a stream
        target = GPUTarget("cuda", arch, 32)

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            return arch

        def get_current_stream(self, device=None):
            return 0
    rows, launches = [], record_launches(arch)
    triton.runtime.driver.set_active(StandIn())  # this process compiles for arch only
    for kernel, grid, args, meta in launches:
        row = dict(arch=arch, kernel=kernel.__name__, meta={k: v for k, v in meta.items() if k != "maxnreg"},
                   register_cap=meta.get("maxnreg"))
        try:
            compiled = run(kernel, *args, grid=grid, warmup=True, **meta)
            row["shared"] = compiled.metadata.shared
            if kernel.__name__ == "_eden_phase1_kernel":  # its persistent programs share a multiprocessor: their
                row.update(ptxas_resources(compiled, arch))  # resources, and how many of them (kernels.EDEN_LAUNCH)
                size = "small" if TARGETS[arch][1] < kernels.SMALL_SHARED_MEMORY else "large"
                row["programs_per_multiprocessor"] = kernels.EDEN_LAUNCH[size].programs_per_multiprocessor
        except Exception as error:  # a compiler crash is the finding
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        rows.append(row)
    return rows


def main(out, archs):
    """One process per target (the launchers' patches belong to one target), all at once; the rows to `out`."""
    # No GPU of this machine takes part: the same builds on a CPU-only machine and on a GPU host.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | dict(CUDA_VISIBLE_DEVICES="")
    processes = {arch: subprocess.Popen([sys.executable, __file__, "--one", str(arch)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
                 for arch in archs}
    rows = []
    for arch, process in processes.items():
        stdout, stderr = process.communicate()
        if process.returncode:
            raise SystemExit(f"sm_{arch}: {stderr.strip().splitlines()[-1] if stderr.strip() else 'failed'}")
        rows += json.loads(stdout.strip().splitlines()[-1])
    import bench  # a results file whose fingerprint is the kernels' source: a change of code makes it stale
    command = " ".join(["python tests/compile_targets.py", out, *map(str, archs)])
    bench.write_results(out, command, rows, fingerprint_of=bench.source_fingerprint())
    print(f"{'target':<8}{'kernel':<22}{'shared KB':>10}{'registers':>10}{'spills B':>9}  meta")
    for r in rows:
        status = f"{r['shared'] / 1024:>10.1f}" if "error" not in r else f"  FAILED: {r['error']}"
        if "registers" in r:
            status += f"{r['registers']:>10}{r['spill_stores']:>9}"
        print(f"sm_{r['arch']:<5}{r['kernel']:<22}{status}  {r['meta']}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    if sys.argv[1:2] == ["--one"] and len(sys.argv) == 3 and sys.argv[2] in map(str, TARGETS):
        rows = compile_for(int(sys.argv[2]))
        print(json.dumps(rows))
    elif len(sys.argv) < 3 or sys.argv[1].startswith("-") or not all(a in map(str, TARGETS) for a in sys.argv[2:]):
        raise SystemExit(f"usage: python tests/compile_targets.py OUT.json TARGET... (targets: "
                         f"{' '.join(map(str, TARGETS))})")
    else:
        main(sys.argv[1], [int(a) for a in sys.argv[2:]])
