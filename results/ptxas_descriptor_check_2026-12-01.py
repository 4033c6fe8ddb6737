"""Does ptxas compile MS-EDEN phase one's wgmma descriptors correctly? On a CPU (no GPU needed): build `_eden_kernel`
of a kernels.py (first argument) for sm_90 with Triton's compiler (a stand-in driver that reports an sm_90 GPU),
disassemble it with the bundled nvdisasm, and trace every wgmma (HGMMA) whose operands both come from shared memory
back through the uniform registers along each of the kernel's two paths (row jobs, column jobs): each descriptor's
address word must come from the shared-memory base (S2UR), not from a kernel parameter (ULDC). The ptxas in use is
Triton's bundled one, or TRITON_PTXAS_PATH.

    python results/ptxas_descriptor_check_2026-12-01.py kernels.py
    TRITON_PTXAS_PATH=/path/to/cuda-13/bin/ptxas python results/ptxas_descriptor_check_2026-12-01.py kernels.py

Found with it (NOTES.md, 2026-12-01 second night): results/eden_h2xh64_2026-12-01.patch built by ptxas 12.8 (Triton
3.6's) takes its column jobs' second-dot descriptors from a register that only the row jobs' path sets (the GPU then
reads past the shared memory: compute-sanitizer's fault is at the first flagged instruction); built by ptxas 13.0 or
13.5, every descriptor comes from the base. HEAD's kernels.py is clean with either."""
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.getcwd())
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver


class Sm90(CudaDriver):  # compiles for an H100/H200 without one
    def __init__(self):
        self.utils = None

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def sass_of_phase1(path, rows=2048, cols=2048, tiles=2):
    driver.set_active(Sm90())
    module = types.ModuleType("checked_kernels")
    module.__file__ = path
    exec(compile(open(path).read().replace('"nanoquartet::', '"checked::'), path, "exec"), module.__dict__)
    x = torch.zeros(rows, cols, dtype=torch.bfloat16)
    out = lambda r, c: (torch.empty(r, c // 2, dtype=torch.uint8), torch.empty(r, c // 16), torch.zeros(1, dtype=torch.int32))
    kernel = module._eden_kernel.warmup(x, *x.stride(), None, None, None, torch.ones(128), *out(rows, cols),
                                        *out(cols, rows), rows, cols, TILES_PER_PROGRAM=tiles, SUB=int(os.environ.get("EDEN_SUB", 64)), STAGES=1,
                                        DOT_FP32=False, GROUPED=True, num_warps=4, maxnreg=128, grid=(1,))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def check(sass):
    lines = sass.splitlines()
    code = []  # (address, opcode, operands)
    for line in lines:
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?(\S+)\s*(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(3), m.group(4)))
    branch = next(k for k, (_, op, _) in enumerate(code) if op == "BRA")  # row jobs fall through, column jobs jump
    label = re.search(r"\((\.L_x_\d+)\)", code[branch][2]).group(1)
    after = lines[next(i for i, l in enumerate(lines) if l.startswith(label + ":")):]
    target = next(int(m.group(1), 16) for m in (re.match(r"\s+/\*([0-9a-f]+)\*/", l) for l in after) if m)
    jump = next(k for k, (a, _, _) in enumerate(code) if a == target)
    paths = {"row jobs": code[:branch] + code[branch + 1:jump], "column jobs": code[:branch] + code[jump:]}

    def written_and_read(op, operands):
        parts = [p.strip() for p in operands.split(",")]
        read = [int(r) for p in parts[1:] for r in re.findall(r"\bUR(\d+)\b", p)]
        if not parts or not parts[0].startswith("UR"):
            return [], read
        wide = ".64" in op
        first = int(parts[0][2:])
        return ([first, first + 1] if wide else [first]), (read + [r + 1 for r in read] if wide else read)

    flagged = 0
    for name, path in paths.items():
        for k, (address, op, operands) in enumerate(path):
            if not (op.startswith("HGMMA") and k >= branch and re.match(r"R\d+,\s*gdesc", operands)):
                continue  # only wgmmas with both operands in shared memory: gdesc[A, A, B, B]
            first = int(re.search(r"gdesc\[UR(\d+)\]", operands).group(1))
            for operand, registers in (("A", (first, first + 1)), ("B", (first + 2, first + 3))):
                needed, roots, j = set(registers), set(), k - 1
                while needed and j >= 0:
                    a2, op2, operands2 = path[j]
                    written, read = written_and_read(op2, operands2)
                    if needed & set(written):
                        needed -= set(written)
                        if op2.startswith("ULDC") or op2 == "S2UR":
                            roots.add(f"{op2}@{a2:x}")
                        needed |= set(read) - {255}
                    j -= 1
                bad = not any(r.startswith("S2UR") for r in roots) or any(r.startswith("ULDC") for r in roots)
                flagged += bad
                if bad:
                    print(f"{name}: HGMMA at {address:x}, operand {operand} (UR{registers[0]}): from {sorted(roots)}")
    return flagged


if __name__ == "__main__":
    count = check(sass_of_phase1(sys.argv[1]))
    print(f"{count} descriptors not from the shared-memory base")
