"""Call 3 of NOTES.md 2026-12-01 (last), run from the repository root on a GPU: mode="reduce-overhead" with and
without cudagraph trees on a depth-2 GPT, forward + backward of two micro-batches per step."""
import os, sys, traceback
sys.path.insert(0, os.getcwd())
import torch
import torch._inductor.config as ic
from model import GPT

def run(name, recipe="bf16", mark=False, autocast_inside=False, trees=True, steps=4, grad_none=True):
    torch._dynamo.reset()
    ic.triton.cudagraph_trees = trees
    torch.manual_seed(0)
    model = GPT(2, recipe, max_seq_len=256).cuda()
    model.init_weights()
    if autocast_inside:
        class Wrap(torch.nn.Module):
            def __init__(s, m): super().__init__(); s.m = m
            def forward(s, a, b):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return s.m(a, b)
        target = Wrap(model)
    else:
        target = model
    compiled = torch.compile(target, mode="reduce-overhead", fullgraph=True, dynamic=False)
    idx = torch.randint(0, 50000, (4, 257), device="cuda")
    try:
        for step in range(steps):
            for micro in range(2):
                if mark:
                    torch.compiler.cudagraph_mark_step_begin()
                if autocast_inside:
                    loss = compiled(idx[:, :-1], idx[:, 1:])
                else:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = compiled(idx[:, :-1], idx[:, 1:])
                (loss / 2).backward()
            model.zero_grad(set_to_none=grad_none)
        torch.cuda.synchronize()
        print(f"{name}: OK, loss {loss.item():.4f}", flush=True)
    except Exception as e:
        tb = traceback.format_exc().splitlines()
        where = [l for l in tb if 'model.py' in l or 'train' in l][-3:]
        print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]} | {where}", flush=True)

run("bf16 plain")
run("bf16 mark", mark=True)
run("bf16 autocast inside", autocast_inside=True)
run("bf16 autocast inside + mark", autocast_inside=True, mark=True)
run("bf16 no trees", trees=False)
run("quartet2 autocast inside + mark", recipe="quartet2", autocast_inside=True, mark=True)
