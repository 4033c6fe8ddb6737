"""
Pre-train the Nanochat GPT on FineWeb-Edu, once per recipe (BF16, Quartet II, ...), and compare them.

    python train.py                               # BF16 vs Quartet II on one GPU, the bundled data, preset d12
    python train.py --preset tiny                 # a toy run that finishes in minutes on a CPU
    python train.py --data hf --preset d20        # stream HuggingFaceFW/fineweb-edu (needs the network)
    torchrun --nproc_per_node=8 train.py          # several GPUs (DDP)

Every recipe trains from the same seed on the same data order. At the end a table compares the final validation
bits per byte, the gap to BF16, tokens per second and peak memory; OUT/metrics.jsonl has every step, OUT/summary.json
the table, OUT/loss.png the curves (with matplotlib).

Data. Documents are tokenized with GPT-2's BPE (tiktoken, built from data/gpt2.tiktoken, no network), each followed
by the end-of-text token, concatenated, and cut into windows of seq_len + 1 tokens (inputs and targets shifted by
one). The bundled data is 4,788 training and 253 validation documents of FineWeb-Edu (ODC-By 1.0); training repeats
it in a new shuffled order each epoch. With --data hf the documents stream through Hugging Face `datasets` and the
first --val-docs documents form the validation split.

Optimization (nanochat's recipe). Muon for the 2-D block weights: momentum, then the update is orthogonalized by 5
Newton-Schulz iterations (it replaces the update's singular values by ~1). AdamW for the embedding and lm_head. The
learning rate follows warmup-stable-decay: linear warmup, constant, then linear decay to 0 over the last
--warmdown fraction of the steps. A step accumulates gradients over micro-batches until it has seen --batch-tokens
tokens (across all GPUs).

Evaluation. Bits per byte = sum of target-token losses / (ln 2 * sum of the target tokens' UTF-8 bytes), with the
end-of-text token excluded from both sums: a tokenizer-independent measure of compression.

Safety. A checkpoint is written every --checkpoint-every steps and at the end, to a temporary file renamed over the
old one (a crash never leaves half a checkpoint). --resume continues each recipe exactly: same data position,
optimizer state and random state. A non-finite loss (or weights) stops the run, naming the step, and keeps the last
good checkpoint.
"""

import argparse
import contextlib
import glob
import gzip
import itertools
import json
import math
import os
import random
import sys
import time

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from tiktoken.load import load_tiktoken_bpe

from model import GPT, RECIPES

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
# torch.compile's mode for the model, the same for every recipe. "reduce-overhead" adds CUDA graphs; measured on an
# H200 it did not pay (NOTES.md), so the default mode it is.
COMPILE_MODE = "default"

# Presets: a flat set of defaults per size; any flag given on the command line wins.
PRESETS = {
    "tiny": dict(depth=2, seq_len=128, device_batch=8, batch_tokens=1024, steps=40, eval_every=20,
                 eval_tokens=8192),
    "small": dict(depth=4, seq_len=512, device_batch=64, batch_tokens=65536, steps=200, eval_every=50,
                  eval_tokens=262144),
    "d12": dict(depth=12, seq_len=1024, device_batch=32, batch_tokens=131072, steps=140, eval_every=35,
                eval_tokens=262144),
    "d20": dict(depth=20, seq_len=2048, device_batch=32, batch_tokens=524288, steps=2000, eval_every=250,
                eval_tokens=1048576),
}


class TrainingError(Exception):
    """A problem the user can fix (bad flags, missing data): reported in one line, without a traceback."""


# -----------------------------------------------------------------------------
# Data


def gpt2_tokenizer(path=os.path.join(DATA_DIR, "gpt2.tiktoken")):
    if not os.path.exists(path):
        raise TrainingError(f"tokenizer file {path} not found (it ships in data/)")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=load_tiktoken_bpe(path),
                             special_tokens={"<|endoftext|>": EOT})


def tokenize(tokenizer, texts):
    """Texts -> token arrays (int32), each followed by the end-of-text token."""
    return [np.array(tokens + [EOT], dtype=np.int32) for tokens in tokenizer.encode_ordinary_batch(texts)]


def local_texts(split, data_dir=DATA_DIR):
    """The bundled FineWeb-Edu sample: a list of texts."""
    files = sorted(glob.glob(os.path.join(data_dir, f"fineweb_edu_{split}_*.jsonl.gz")))
    if not files:
        raise TrainingError(f"no {split} data: {data_dir}/fineweb_edu_{split}_*.jsonl.gz not found "
                            f"(the sample ships in data/; or use --data hf)")
    texts = []
    for name in files:
        with gzip.open(name, "rt", encoding="utf-8") as f:
            texts.extend(json.loads(line)["text"] for line in f)
    return texts


def streamed_texts(path, name=None, data_files=None, skip=0):
    """Texts streamed through Hugging Face `datasets` (a hub dataset, or local files with path="json")."""
    import datasets
    stream = datasets.load_dataset(path, name=name, data_files=data_files, split="train", streaming=True)
    for row in stream.skip(skip) if skip else stream:
        yield row["text"]


class Windows:
    """Packs token arrays (documents) into windows of seq_len + 1 tokens, epoch after epoch. Its position (epoch,
    documents read, leftover tokens) goes into checkpoints, so a resumed run sees exactly the windows it would have.

    documents(epoch, start) must return an iterator over that epoch's token arrays from document `start` on."""

    def __init__(self, documents, seq_len, state=None):
        self.documents, self.seq_len = documents, seq_len
        state = state or dict(epoch=0, document=0, buffer=[])
        self.epoch, self.document = state["epoch"], state["document"]
        self.buffer = np.array(state["buffer"], dtype=np.int32)
        self.stream = self.documents(self.epoch, self.document)

    def state_dict(self):
        return dict(epoch=self.epoch, document=self.document, buffer=self.buffer.tolist())

    def next_batch(self, count):
        """The next `count` windows: [count, seq_len + 1]."""
        needed = count * (self.seq_len + 1)
        pieces, have = [self.buffer], len(self.buffer)
        while have < needed:
            tokens = next(self.stream, None)
            if tokens is None:  # this epoch is over: start the next one
                if self.document == 0:
                    raise TrainingError("the training data holds no documents")
                self.epoch, self.document = self.epoch + 1, 0
                self.stream = self.documents(self.epoch, 0)
                continue
            self.document += 1
            pieces.append(tokens)
            have += len(tokens)
        tokens = np.concatenate(pieces)
        self.buffer = tokens[needed:]
        return torch.from_numpy(tokens[:needed].astype(np.int64)).view(count, self.seq_len + 1)


def shuffled_epochs(documents, seed):
    """documents(epoch, start) over a fixed list, in a new order each epoch (reproducible from the seed)."""
    def epoch_documents(epoch, start):
        order = list(range(len(documents)))
        random.Random(seed * 1000003 + epoch).shuffle(order)
        return (documents[i] for i in order[start:])
    return epoch_documents


def data_sources(args, tokenizer):
    """(training documents(epoch, start), validation token arrays) for --data local or hf."""
    if args.data == "local":
        return (shuffled_epochs(tokenize(tokenizer, local_texts("train", args.data_dir)), args.seed),
                tokenize(tokenizer, local_texts("val", args.data_dir)))
    name = args.hf_config or None
    validation = tokenize(tokenizer, list(itertools.islice(streamed_texts(args.hf_dataset, name, args.hf_files),
                                                           args.val_docs)))

    def documents(epoch, start):  # the stream after the validation documents, restarted each epoch
        texts = streamed_texts(args.hf_dataset, name, args.hf_files, skip=args.val_docs + start)
        return (tokenize(tokenizer, [text])[0] for text in texts)
    return documents, validation


def validation_windows(documents, seq_len, count, multiple=1):
    """The first `count` windows of the validation documents (fewer if they run out), a multiple of `multiple` of
    them (so that every evaluation batch is full: quantized recipes need whole multiples of 128 tokens, and a
    compiled model one batch shape): a fixed set."""
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int32)
    count = min(count, len(tokens) // (seq_len + 1)) // multiple * multiple
    if count == 0:
        raise TrainingError(f"the validation split must hold at least {multiple} window(s) of seq_len + 1 = "
                            f"{seq_len + 1} tokens (--eval-tokens {multiple * seq_len} or more, or a smaller "
                            f"--device-batch)")
    return torch.from_numpy(tokens[:count * (seq_len + 1)].astype(np.int64)).view(count, seq_len + 1)


def token_bytes(tokenizer):
    """UTF-8 length of every token, 0 for special tokens (so bits per byte leaves them out)."""
    lengths = [len(tokenizer.decode_single_token_bytes(t)) for t in range(tokenizer.n_vocab)]
    lengths[EOT] = 0
    return torch.tensor(lengths, dtype=torch.float64)


def bpb_sums(losses, targets, bytes_per_token):
    """(sum of the losses, sum of the UTF-8 bytes) over the targets that have bytes: bpb = a / (ln 2 * b)."""
    counted = bytes_per_token[targets] > 0
    return losses.double()[counted].sum(), bytes_per_token[targets].sum()


# -----------------------------------------------------------------------------
# Optimizer


def newton_schulz(g, steps=5):
    """Approximately orthogonalize each matrix of g [..., rows, cols] (replace its singular values by ~1) with a
    quintic Newton-Schulz iteration, in BF16 (Keller Jordan's coefficients, chosen to push singular values into
    [0.7, 1.2] quickly)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz, for 2-D weight matrices (nesterov momentum). The matrices of one
    shape are orthogonalized together, as one batch: a few large launches instead of many small ones (the d12 model
    has 72 matrices of 2 shapes). torch.optim.Muon computes the same update one matrix at a time."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                by_shape.setdefault(p.shape, []).append(p)
            for (rows, cols), params in by_shape.items():
                grads = [p.grad for p in params]
                buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
                torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
                nesterov = torch.stack(grads).lerp_(torch.stack(buffers), group["momentum"])  # [n, rows, cols]
                updates = newton_schulz(nesterov).to(params[0].dtype).unbind(0)
                torch._foreach_add_(params, updates, alpha=-group["lr"] * max(1, rows / cols) ** 0.5)


def compile_model(model, mode=COMPILE_MODE):
    """torch.compile the whole model as one graph: fullgraph, so that a graph break is an error, not a slowdown."""
    return torch.compile(model, fullgraph=True, dynamic=False, mode=mode)


def make_optimizers(model, args):
    scale = (model.width / 768) ** -0.5  # nanochat's AdamW learning rates are tuned at width 768
    adamw = torch.optim.AdamW([dict(params=[model.embedding.weight], lr=args.lr_embedding * scale),
                               dict(params=[model.lm_head.weight], lr=args.lr_head * scale)],
                              betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=model.embedding.weight.is_cuda)
    muon = Muon(model.matrix_parameters(), lr=args.lr_matrix)
    for optimizer in (adamw, muon):
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
    return [adamw, muon]


def lr_multiplier(step, steps, warmup, warmdown):
    """Warmup-stable-decay: 0 -> 1 over `warmup` steps, 1, then linearly to 0 over the last `warmdown` fraction."""
    if step < warmup:
        return (step + 1) / warmup
    decay_start = steps * (1 - warmdown)
    return 1.0 if step < decay_start else max(0.0, (steps - step) / (steps - decay_start))


# -----------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path, state):
    """Write to a temporary file, then rename over the old checkpoint: a crash never leaves half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = path + ".tmp"
    torch.save(state, temporary)
    os.replace(temporary, path)


def check_finite(model, recipe, step, checkpoint_path):
    """Refuse to checkpoint non-finite weights (the last good checkpoint stays)."""
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise TrainingError(f"[{recipe}] non-finite weights at step {step}; stopping. The last good checkpoint "
                            f"(if any) is kept at {checkpoint_path}")


def rng_state():
    return dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


# -----------------------------------------------------------------------------
# Training one recipe


class Context:
    """Where this process runs: device, DDP rank and world size."""

    def __init__(self, device):
        self.distributed = "RANK" in os.environ
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device == "auto":
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def log(self, *message):
        if self.rank == 0:
            print(*message, flush=True)

    def all_sum(self, tensor):
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor


def evaluate(model, windows, bytes_per_token, ctx, args, dtype):
    """Validation bits per byte over the fixed validation windows (each rank takes a share)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    byte_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    mine = windows[ctx.rank::ctx.world]
    bytes_per_token = bytes_per_token.to(ctx.device)
    with torch.no_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
        for batch in mine.split(args.device_batch):
            batch = batch.to(ctx.device)
            torch.compiler.cudagraph_mark_step_begin()
            losses = model(batch[:, :-1], batch[:, 1:], reduction="none")
            losses_counted, bytes_counted = bpb_sums(losses, batch[:, 1:].flatten(), bytes_per_token)
            loss_sum += losses_counted
            byte_sum += bytes_counted
    model.train()
    return (ctx.all_sum(loss_sum) / (math.log(2) * ctx.all_sum(byte_sum))).item()


def train_recipe(recipe, args, ctx, data, log_file):
    """Train one recipe from scratch (or from its checkpoint); return its row of the summary table."""
    documents, validation, bytes_per_token = data
    dtype = getattr(torch, args.dtype)
    checkpoint_path = os.path.join(args.out, recipe, "checkpoint.pt")
    checkpoint = torch.load(checkpoint_path, weights_only=False) if args.resume and os.path.exists(
        checkpoint_path) else None

    torch.manual_seed(args.seed)  # the same initial weights for every recipe and rank
    model = GPT(args.depth, recipe, max_seq_len=args.seq_len).to(ctx.device)
    optimizers = make_optimizers(model, args)
    windows = Windows(documents, args.seq_len, checkpoint and checkpoint["data"])
    torch.manual_seed(args.seed + 1 + ctx.rank)  # quantization randomness differs across ranks, reproducibly
    start, history = 0, dict(tokens_per_s=[], final_bpb=None)
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
        for optimizer, state in zip(optimizers, checkpoint["optimizers"]):
            optimizer.load_state_dict(state)
        set_rng_state(checkpoint["rng"])
        start, history = checkpoint["step"], checkpoint["history"]
        ctx.log(f"[{recipe}] resumed from {checkpoint_path} at step {start}")
    trained = compile_model(model) if args.compile else model
    if ctx.distributed:
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=[ctx.device.index]
                                                            if ctx.device.type == "cuda" else None)

    def checkpoint_state(step):
        return dict(model=model.state_dict(), optimizers=[o.state_dict() for o in optimizers], data=windows.state_dict(),
                    rng=rng_state(), step=step, history=history, recipe=recipe, args=vars(args))

    windows_per_step = args.batch_tokens // args.seq_len
    accumulation = windows_per_step // (args.device_batch * ctx.world)
    tokens_per_step = windows_per_step * args.seq_len
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    began = time.time()
    for step in range(start, args.steps):
        multiplier = lr_multiplier(step, args.steps, args.warmup_steps, args.warmdown)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * multiplier
        optimizers[1].param_groups[0]["momentum"] = 0.85 + 0.10 * min(step / 300, 1)  # Muon momentum warmup
        batch = windows.next_batch(windows_per_step)[ctx.rank::ctx.world]  # this rank's share of the step
        tic = time.time()
        loss_sum = torch.zeros((), device=ctx.device)
        for micro, chunk in enumerate(batch.split(args.device_batch)):
            chunk = chunk.to(ctx.device)
            sync = micro == accumulation - 1 or not ctx.distributed
            with contextlib.nullcontext() if sync else trained.no_sync():  # all-reduce on the last only
                torch.compiler.cudagraph_mark_step_begin()  # with CUDA graphs: the previous outputs are consumed
                with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = trained(chunk[:, :-1], chunk[:, 1:])
                (loss / accumulation).backward()
            loss_sum += loss.detach()
        loss_value = ctx.all_sum(loss_sum).item() / (accumulation * ctx.world)
        if not math.isfinite(loss_value):
            raise TrainingError(f"[{recipe}] non-finite loss ({loss_value}) at step {step + 1}; stopping. The last "
                                f"good checkpoint (if any) is kept at {checkpoint_path}")
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.time() - tic
        tokens_per_s = tokens_per_step / seconds
        if step - start >= 3:  # leave compilation and warm-up out of the throughput
            history["tokens_per_s"].append(tokens_per_s)
        remaining = (time.time() - began) / (step + 1 - start) * (args.steps - step - 1)
        ctx.log(f"[{recipe}] step {step + 1:5d}/{args.steps} | loss {loss_value:.4f} | lr x{multiplier:.2f} | "
                f"{seconds * 1000:7.1f} ms | {tokens_per_s:,.0f} tok/s | eta {remaining / 60:.1f} min")
        record = dict(recipe=recipe, step=step + 1, loss=loss_value, lr_multiplier=multiplier, tokens_per_s=tokens_per_s)
        done = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or done:
            record["val_bpb"] = evaluate(trained, validation, bytes_per_token, ctx, args, dtype)
            ctx.log(f"[{recipe}] step {step + 1}: validation bpb {record['val_bpb']:.4f}")
            history["final_bpb"] = record["val_bpb"]
        if ctx.rank == 0:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        stopping = bool(args.stop_after) and step + 1 - start >= args.stop_after
        if not done and ((step + 1) % args.checkpoint_every == 0 or stopping):
            check_finite(model, recipe, step + 1, checkpoint_path)
            if ctx.rank == 0:
                save_checkpoint(checkpoint_path, checkpoint_state(step + 1))
        if stopping and not done:
            ctx.log(f"[{recipe}] stopping after {args.stop_after} steps as asked; continue with --resume")
            return None
    if "row" not in history:  # finished just now (a resumed, finished recipe returns its stored row)
        throughput = history["tokens_per_s"]
        history["row"] = dict(
            recipe=recipe, val_bpb=history["final_bpb"], steps=args.steps, tokens=args.steps * tokens_per_step,
            tokens_per_s=sum(throughput) / len(throughput) if throughput else float("nan"),
            peak_memory_gb=torch.cuda.max_memory_allocated(ctx.device) / 1e9 if ctx.device.type == "cuda" else None)
        check_finite(model, recipe, args.steps, checkpoint_path)
        if ctx.rank == 0:
            save_checkpoint(checkpoint_path, checkpoint_state(args.steps))
    return history["row"]


# -----------------------------------------------------------------------------
# The comparison


def summarize(rows, ctx, args):
    baseline = next((r["val_bpb"] for r in rows if r["recipe"] == "bf16"), None)
    for r in rows:
        r["gap_pct"] = 100 * (r["val_bpb"] / baseline - 1) if baseline and r["val_bpb"] else None
    ctx.log(f"\n{'recipe':<10}{'val bpb':>10}{'gap to bf16':>13}{'tokens/s':>12}{'peak memory':>13}")
    for r in rows:
        gap = f"{r['gap_pct']:+.2f}%" if r["gap_pct"] is not None else "-"
        memory = f"{r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] is not None else "-"
        ctx.log(f"{r['recipe']:<10}{r['val_bpb']:>10.4f}{gap:>13}{r['tokens_per_s']:>12,.0f}{memory:>13}")
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    summary = dict(rows=rows, device=device, world_size=ctx.world, date=time.strftime("%Y-%m-%d"), args=vars(args),
                   emulated_nvfp4=not (ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device)[0] >= 10))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(args.out)


def metrics_file(args):
    """OUT/metrics.jsonl, ready for appending: a fresh (not resumed) run drops the earlier records of the recipes it
    is about to train and keeps the others, so recipes can be trained by separate invocations into one OUT."""
    path = os.path.join(args.out, "metrics.jsonl")
    if not args.resume and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["recipe"] not in args.recipes]
        with open(path, "w") as f:
            f.writelines(kept)
    return path


def plot(out):
    """Loss and validation curves per recipe to OUT/loss.png, if matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        mine = [r for r in records if r["recipe"] == recipe]
        left.plot([r["step"] for r in mine], [r["loss"] for r in mine], label=recipe, linewidth=0.8)
        evals = [r for r in mine if "val_bpb" in r]
        right.plot([r["step"] for r in evals], [r["val_bpb"] for r in evals], marker="o", label=recipe)
    left.set(xlabel="step", ylabel="training loss (nats/token)", yscale="log")
    right.set(xlabel="step", ylabel="validation bits per byte")
    for axes in (left, right):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(os.path.join(out, "loss.png"), dpi=120)


# -----------------------------------------------------------------------------
# Flags


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: sys.exit(f"train.py: error: {message} (see python train.py --help)")
    add = parser.add_argument
    add("--recipe", default="bf16,quartet2", help=f"comma-separated recipes to train, from {','.join(RECIPES)}")
    add("--preset", choices=list(PRESETS), help="defaults for a model size (default: d12 on a GPU)")
    add("--depth", type=int, help="transformer depth; width = 64 * depth")
    add("--seq-len", type=int, help="tokens per training window")
    add("--device-batch", type=int, help="windows per micro-batch on each device")
    add("--batch-tokens", type=int, help="tokens per optimizer step, across all devices")
    add("--steps", type=int, help="optimizer steps")
    add("--warmup-steps", type=int, default=0, help="linear learning-rate warmup steps")
    add("--warmdown", type=float, default=0.2, help="fraction of the steps over which the learning rate decays to 0")
    add("--lr-matrix", type=float, default=0.02, help="Muon learning rate (block matrices)")
    add("--lr-embedding", type=float, default=0.2, help="AdamW learning rate of the embedding (at width 768)")
    add("--lr-head", type=float, default=0.004, help="AdamW learning rate of lm_head (at width 768)")
    add("--eval-every", type=int, help="steps between validation evaluations")
    add("--eval-tokens", type=int, help="validation tokens per evaluation (the first ones of the split)")
    add("--data", choices=["local", "hf"], default="local", help="bundled sample, or stream Hugging Face")
    add("--data-dir", default=DATA_DIR, help="where the bundled sample lives")
    add("--hf-dataset", default="HuggingFaceFW/fineweb-edu", help="with --data hf: dataset path (or 'json')")
    add("--hf-config", default="sample-10BT", help="with --data hf: dataset configuration")
    add("--hf-files", nargs="*", help="with --data hf: local data files for the dataset (e.g. with 'json')")
    add("--val-docs", type=int, default=500, help="with --data hf: the first N documents are the validation split")
    add("--dtype", choices=["bfloat16", "float32"], help="autocast dtype (default bfloat16 on GPU, float32 on CPU)")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model (default: on a GPU)")
    add("--device", default="auto", help="cuda, cuda:N or cpu (default: the GPU if there is one)")
    add("--seed", type=int, default=0, help="seed of the weights, the data order and the quantization randomness")
    add("--out", default="runs/latest", help="output directory (checkpoints, metrics, summary, plot)")
    add("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    add("--resume", action="store_true", help="continue each recipe from its checkpoint in --out")
    add("--stop-after", type=int, default=0, help="stop after this many steps in this run (checkpointed), e.g. "
                                                  "to fit a time limit; continue later with --resume")
    return parser.parse_args(argv)


def resolve(args, ctx):
    """Fill preset defaults and check that the settings can work, with a one-line error if not."""
    if args.preset is None:
        if ctx.device.type != "cuda":
            raise TrainingError("no GPU found: the default run (preset d12) needs one. Try --preset tiny, which "
                                "finishes in under 3 minutes on a CPU")
        args.preset = "d12"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if ctx.device.type == "cuda" else "float32")
    args.compile = ctx.device.type == "cuda" if args.compile is None else args.compile
    args.recipes = [r.strip() for r in args.recipe.split(",") if r.strip()]
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown or not args.recipes:
        raise TrainingError(f"unknown recipe(s) {unknown or args.recipe!r}; choose from {','.join(RECIPES)}")
    per_step = args.seq_len * args.device_batch * ctx.world
    if args.batch_tokens % per_step:
        raise TrainingError(f"--batch-tokens {args.batch_tokens} must be a multiple of seq_len x device_batch x "
                            f"GPUs = {args.seq_len} x {args.device_batch} x {ctx.world} = {per_step}")
    if args.depth < 2 or args.depth % 2:
        raise TrainingError(f"--depth must be even (width = 64 * depth must be a multiple of 128), got {args.depth}")
    if any(r != "bf16" for r in args.recipes) and (args.seq_len * args.device_batch) % 128:
        raise TrainingError(f"quantized recipes need seq_len x device_batch to be a multiple of 128, got "
                            f"{args.seq_len} x {args.device_batch}")
    if min(args.steps, args.eval_every, args.eval_tokens, args.checkpoint_every) <= 0:
        raise TrainingError("--steps, --eval-every, --eval-tokens and --checkpoint-every must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        ctx = Context(args.device)
        args = resolve(args, ctx)
        ctx.log(f"device {ctx.device} x {ctx.world}, preset {args.preset}: depth {args.depth}, seq_len {args.seq_len}, "
                f"{args.batch_tokens:,} tokens/step, {args.steps} steps, recipes {args.recipes}")
        tokenizer = gpt2_tokenizer()
        documents, validation = data_sources(args, tokenizer)
        data = (documents, validation_windows(validation, args.seq_len, args.eval_tokens // args.seq_len,
                                              args.device_batch * ctx.world),
                token_bytes(tokenizer))
        os.makedirs(args.out, exist_ok=True)
        rows = []
        with open(metrics_file(args), "a") as log_file:
            for recipe in args.recipes:
                row = train_recipe(recipe, args, ctx, data, log_file)
                if row is None:  # --stop-after
                    return
                rows.append(row)
        summarize(rows, ctx, args)
    except TrainingError as error:
        sys.exit(f"train.py: error: {error}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
