"""Two straight tiny quartet2 runs on the GPU per mode: are their final weights equal? Which differ, by how much?"""
import json, os, sys
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import torch
import train
out = os.environ.get("OUT", "/tmp")
data = "data"
def run(argv):
    try: train.main(argv)
    except SystemExit as e: return str(e.code)
def ckpt(path):
    run_id = json.load(open(os.path.join(path, "run.json")))["run_id"]
    return train.load_checkpoint(os.path.join(path, "quartet2", "checkpoint.pt"), run_id)
modes = {"default": [], "no-compile": ["--no-compile"], "deterministic": []}
for mode, extra in modes.items():
    if mode == "deterministic":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    base = ["--preset", "tiny", "--depth", "2", "--seq-len", "64", "--device-batch", "2", "--batch-tokens", "256",
            "--eval-every", "5", "--eval-tokens", "1024", "--steps", "8", "--recipe", "quartet2",
            "--checkpoint-every", "3", *extra]
    paths = [f"{out}/{mode}/{i}" for i in range(2)]
    results = [run(base + ["--out", p]) for p in paths]
    a, b = (ckpt(p)["model"] for p in paths)
    diffs = {n: (t.float() - b[n].float()).abs().max().item() for n, t in a.items() if not torch.equal(t, b[n])}
    la, lb = ([r["loss"] for r in train.read_metrics(p)] for p in paths)
    print(f"RESUME-DIAG {mode}: results {results} losses equal {la == lb}; differing tensors {len(diffs)}/{len(a)}:",
          {k: f"{v:.3g}" for k, v in list(diffs.items())[:8]}, flush=True)
