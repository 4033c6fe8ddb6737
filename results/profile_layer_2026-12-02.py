"""Where a small layer's time goes, kernel by kernel (GPU): `python results/profile_layer_2026-12-02.py [IN OUT]`
(default d12 fc, 768 -> 3072, 32768 tokens). Each recipe's compiled forward + backward is captured in a CUDA graph as
`bench.py linear --cuda-graph` does; the replay is timed by CUDA events, and torch.profiler lists the kernels of 10
uncaptured calls (the same kernels: the graph replays them without the host's launches in between). Prints, per recipe:
the replay's ms, the sum of its kernels' ms, and each kernel's ms and count per call. NOTES.md, 2026-12-02
(session two)."""
import collections
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import ProfilerActivity, profile

import train
from bench import layer_step, median_ms
from model import Linear

d_in, d_out = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (768, 3072)
tokens = 32768
device = torch.device("cuda")
x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
grad = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)
reference = torch.nn.Linear(d_in, d_out, bias=False, device=device, dtype=torch.bfloat16)
for recipe in ("bf16", "quartet2", "nvidia"):
    torch.compiler.reset()
    layer = reference if recipe == "bf16" else Linear(d_in, d_out, recipe).to(device)
    step, _ = layer_step(layer, x, grad, train.COMPILE_MODE)
    replay = train.cuda_graph(step)[0]
    replay_ms = median_ms(replay)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.time_range.elapsed_us() / 1e3 / 10  # ms per call
            kernels[event.name][1] += 1 / 10
    total = sum(ms for ms, _ in kernels.values())
    print(f"\n{recipe} {d_in}->{d_out}, {tokens} tokens: replay {replay_ms:.3f} ms, kernels {total:.3f} ms, "
          f"{sum(n for _, n in kernels.values()):.0f} kernels per call")
    for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f"  {ms:8.4f} ms  x{count:4.1f}  {name[:110]}")
