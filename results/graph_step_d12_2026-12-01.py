"""Call 6 of NOTES.md 2026-12-01 (last), run from the repository root on a GPU: a d12 micro-batch's compiled forward
+ backward captured whole in one torch.cuda.graph (what `bench.py train --cuda-graph` does), against the same
compiled model run normally: time, host time, peak memory, losses (and BF16's gradients) compared."""
import os, sys, json
sys.path.insert(0, os.getcwd())
import torch
import train, bench
from model import GPT, make_optimizers

def run(recipe, depth=12, calls=10):
    torch._dynamo.reset(); torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = GPT(depth, recipe, max_seq_len=2048).cuda()
    compiled = train.compile_model(model)
    static = torch.randint(0, 50257, (16, 2049), device="cuda")
    def fb():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(static[:, :-1], static[:, 1:])
        loss.backward()
        return loss
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fb()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=False)
    torch.cuda.reset_peak_memory_stats()
    loss_plain = fb().detach().clone()
    grads_plain = [p.grad.clone() for p in model.parameters()] if recipe == "bf16" else None
    torch.cuda.synchronize()
    peak_plain = torch.cuda.max_memory_allocated() / 1e9
    plain = bench.call_times_ms(fb, calls)
    host_plain = bench.host_ms(fb, plain[-1])
    model.zero_grad(set_to_none=False)
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = fb()
    model.zero_grad(set_to_none=False)
    graph.replay(); torch.cuda.synchronize()
    same_loss = torch.equal(static_loss, loss_plain)
    same_grads = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_plain)) if grads_plain else None
    graphs = bench.call_times_ms(graph.replay, calls)
    host_graph = bench.host_ms(graph.replay, graphs[-1])
    peak_graph = torch.cuda.max_memory_allocated() / 1e9
    row = dict(recipe=recipe, plain_ms=plain[len(plain) // 2], plain_range=[plain[0], plain[-1]], host_plain=host_plain,
               peak_plain=peak_plain, graph_ms=graphs[len(graphs) // 2], graph_range=[graphs[0], graphs[-1]],
               host_graph=host_graph, peak_graph=peak_graph, same_loss=same_loss, same_grads=same_grads)
    print(json.dumps(row), flush=True)
    return row

rows = []
for r in ("bf16", "quartet2", "nvidia"):
    try:
        rows.append(run(r))
    except Exception as e:
        print(r, "FAILED", type(e).__name__, str(e)[:400], flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "graph_step.json"), "w"), indent=1)
