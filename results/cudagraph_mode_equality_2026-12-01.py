"""Call 5 of NOTES.md 2026-12-01 (last), run from the repository root on a GPU: train.compile_model's CUDA-graph mode
against the default mode on a depth-2 GPT, losses over three steps of two micro-batches, every recipe."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import train
from model import GPT, make_optimizers

def losses(recipe, mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(2, recipe, max_seq_len=256).cuda()
    model.init_weights()
    flags = train.parse_args([])
    adamw, muon = make_optimizers(model, flags.lr_matrix, flags.lr_embedding, flags.lr_head)
    compiled = train.compile_model(model, mode)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for step in range(3):
        for micro in range(2):
            idx = torch.randint(0, 50000, (4, 257), device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(idx[:, :-1], idx[:, 1:])
            (loss / 2).backward()
            out.append(loss.item())
        adamw.step(); muon.step(); model.zero_grad(set_to_none=True)
    return out

a = losses("bf16", "default"); b = losses("bf16", "reduce-overhead")
print("bf16 default", a); print("bf16 graphs ", b, "identical" if a == b else "DIFFERENT")
for r in ("quartet2", "nvidia"):
    print(r, "graphs", losses(r, "reduce-overhead"), "default", losses(r, "default"))
