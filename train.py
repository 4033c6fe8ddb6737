"""
Pre-train the Nanochat GPT on FineWeb-Edu once per recipe (BF16, Quartet II, ...), compare them, and let them write.

    python train.py                          # BF16 vs Quartet II on one GPU, preset d12: ~5 minutes on an H200
    python train.py --preset tiny            # a toy run on a CPU: a few minutes
    python train.py --resume                 # continue the newest run (runs/latest), or extend it with more --steps
    python train.py --sample "Photosynthesis is"   # the newest run's models continue a prompt; no training
    python train.py --data hf --preset d20   # stream HuggingFaceFW/fineweb-edu (needs the network)
    torchrun --nproc_per_node=8 train.py --device-batch 16   # 8 GPUs (DDP): 131k tokens a step, 16 x 1024 each

Top to bottom: the data (every recipe starts from the same weights and reads the same windows in the same order); a
recipe's training (micro-batches add up to --batch-tokens, then Muon and AdamW step; on one GPU each micro-batch is a
CUDA graph's replay) and its evaluation in bits per byte; the run's directory (atomic writes, a lock, and --resume
exact with the run's own flags and data); the comparison table and the samples.
"""

import argparse
import base64
import contextlib
import fcntl
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import pathlib
import random
import sys
import textwrap
import time

import numpy as np
import tiktoken
import torch
import torch.distributed as dist

from kernels import native_fp4_available
from model import GPT, GPT2_VOCAB, RECIPES, check_tokens, make_optimizers, recipe_names

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TOKENIZER_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # OpenAI's r50k_base.tiktoken
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
RUNS = "runs"
PRESETS = {  # defaults per size (a flag given on the command line wins), a row each
    name: dict(zip(("depth", "seq_len", "device_batch", "batch_tokens", "steps", "eval_every", "eval_tokens",
                    "keep_checkpoints"), values)) for name, *values in (
        ("tiny", 2, 128, 8, 1024, 40, 20, 8192, False),
        ("small", 4, 512, 64, 2**16, 200, 50, 2**18, True),
        ("d12", 12, 1024, 32, 2**17, 140, 35, 2**18, True),
        ("d20", 20, 2048, 32, 2**19, 2000, 250, 2**20, True))}
# What defines a run: --resume refuses to change these (--steps may grow; --device-batch shapes the validation set)
RUN_FLAGS = ("depth", "seq_len", "batch_tokens", "device_batch", "warmup_steps", "warmdown", "lr_matrix",
             "lr_embedding", "lr_head", "eval_tokens", "data", "hf_dataset", "hf_config", "hf_files", "val_docs",
             "dtype", "seed")
PROMPTS = ("Photosynthesis is the process", "The French Revolution began")  # every model continues these at the end
TEMPERATURE, TOP_K = 0.8, 200  # of the samples, as nanoGPT's


class TrainingError(Exception):
    """A problem the user can fix (bad flags, missing data, a damaged checkpoint): one line, no traceback."""


# -----------------------------------------------------------------------------
# Data: documents, cut into windows; bits per byte
def gpt2_tokenizer(path=os.path.join(DATA_DIR, "gpt2.tiktoken")):
    """GPT-2's BPE from the shipped file, checked against its SHA-256 (tiktoken's loader caches an unchecked copy)."""
    content = pathlib.Path(path).read_bytes()
    if hashlib.sha256(content).hexdigest() != TOKENIZER_SHA256:
        raise TrainingError(f"{path} is not GPT-2's vocabulary (its SHA-256 differs); restore it from the repository")
    ranks = {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, content.splitlines())}
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT})


def tokenize(tokenizer, texts):
    """Texts -> token arrays (int32), each followed by the end-of-text token."""
    return [np.array(tokens + [EOT], dtype=np.int32) for tokens in tokenizer.encode_ordinary_batch(texts)]


def local_texts(split, data_dir=DATA_DIR, digest=None):
    """The bundled sample's texts (gzipped JSON lines with a "text" string); each file's name and bytes into digest."""
    texts = []
    for path in sorted(pathlib.Path(data_dir).glob(f"fineweb_edu_{split}_*.jsonl.gz")):  # data_dir is no pattern
        try:
            content = path.read_bytes()
            texts += [json.loads(line)["text"] for line in gzip.decompress(content).splitlines() if line.strip()]
            assert all(isinstance(text, str) for text in texts), "a \"text\" that is not a string"
        except (OSError, EOFError, ValueError, KeyError, TypeError, AssertionError) as error:
            raise TrainingError(f"{path} is not gzipped JSON lines with a \"text\" string ({type(error).__name__}: "
                                f"{error}); restore it from the repository") from None
        if digest:
            digest.update(path.name.encode() + content)
    if not texts:  # no files, or empty ones
        raise TrainingError(f"no {split} documents in {data_dir} (the sample ships in data/; or use --data hf)")
    return texts


def streamed_texts(path, name=None, data_files=None, order=None):
    """Texts streamed by Hugging Face `datasets`; order = (skip, seed, start): skip, shuffle through a buffer, skip."""
    try:
        import datasets
    except ImportError:
        raise TrainingError("--data hf streams through Hugging Face datasets: pip install datasets") from None
    try:
        stream = datasets.load_dataset(path, name=name, data_files=data_files, split="train", streaming=True)
        if order:
            stream = stream.skip(order[0]).shuffle(seed=order[1], buffer_size=10_000).skip(order[2])
        for row in stream:
            if not isinstance(row.get("text"), str):
                raise ValueError(f"a document without a \"text\" string: {str(row)[:80]}")
            yield row["text"]
    except (OSError, ValueError, KeyError, ConnectionError, RuntimeError) as error:
        raise TrainingError(f"could not stream {path} ({type(error).__name__}: {str(error)[:200]}); --data hf "
                            f"needs the network, or local files with --hf-dataset json --hf-files ...") from None


def data_sources(args, tokenizer):
    """(documents(epoch, start), validation documents, the files' SHA-256): the bundled sample, or the stream."""
    if args.data == "local":
        digest = hashlib.sha256()
        train, val = local_texts("train", args.data_dir, digest), local_texts("val", args.data_dir, digest)
        return shuffled_epochs(tokenize(tokenizer, train), args.seed), tokenize(tokenizer, val), digest.hexdigest()
    name = args.hf_config or None
    validation = list(itertools.islice(streamed_texts(args.hf_dataset, name, args.hf_files), args.val_docs))

    def epoch_stream(epoch, start):  # each epoch's order seeded as shuffled_epochs seeds it
        order = args.val_docs, args.seed * 1000003 + epoch, start
        return (tokenize(tokenizer, [text])[0] for text in streamed_texts(args.hf_dataset, name, args.hf_files, order))
    return epoch_stream, tokenize(tokenizer, validation), None  # a stream is named by its flags


def shuffled_epochs(documents, seed):
    """documents(epoch, start) over a fixed list, in a new order each epoch (reproducible from the seed)."""
    def epoch_documents(epoch, start):
        order = list(range(len(documents)))
        random.Random(seed * 1000003 + epoch).shuffle(order)  # another order for every epoch and every --seed
        return (documents[i] for i in order[start:])
    return epoch_documents


class Windows:
    """Token arrays packed into windows of seq_len + 1 tokens, epoch after epoch; its position resumes exactly."""

    def __init__(self, documents, seq_len, state=None):
        state = state or dict(epoch=0, document=0, buffer=[])
        self.documents, self.seq_len, self.epoch, self.document = documents, seq_len, state["epoch"], state["document"]
        self.buffer, self.stream = np.array(state["buffer"], dtype=np.int32), documents(self.epoch, self.document)

    def state_dict(self):
        return dict(epoch=self.epoch, document=self.document, buffer=self.buffer.tolist())

    def next_batch(self, count):  # [count, seq_len + 1]
        needed, pieces, have = count * (self.seq_len + 1), [self.buffer], len(self.buffer)
        while have < needed:
            if (tokens := next(self.stream, None)) is None:  # this epoch is over: start the next one
                if self.document == 0:
                    raise TrainingError("the training data holds no documents")
                self.epoch, self.document, self.stream = self.epoch + 1, 0, self.documents(self.epoch + 1, 0)
                continue
            self.document, have = self.document + 1, have + len(tokens)
            pieces.append(tokens)
        tokens = np.concatenate(pieces)
        self.buffer = tokens[needed:]
        return torch.from_numpy(tokens[:needed].astype(np.int64)).view(count, self.seq_len + 1)


def validation_windows(documents, seq_len, count, multiple=1, bytes_per_token=None):
    """The first `count` windows of the documents, or fewer, a multiple of `multiple`; with text if bytes_per_token."""
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int32)
    if (count := min(count, len(tokens) // (seq_len + 1)) // multiple * multiple) == 0:
        raise TrainingError(f"the validation split holds no {multiple} window(s) of {seq_len + 1} tokens: raise "
                            f"--eval-tokens to {multiple * seq_len}, or lower --device-batch")
    windows = torch.from_numpy(tokens[:count * (seq_len + 1)].astype(np.int64)).view(count, seq_len + 1)
    if bytes_per_token is not None and bytes_per_token[windows[:, 1:]].sum() == 0:
        raise TrainingError("the validation documents hold no text, only end-of-text tokens")
    return windows


def token_bytes(tokenizer):
    """UTF-8 length of every token, 0 for special tokens (so bits per byte leaves them out)."""
    lengths = [len(tokenizer.decode_single_token_bytes(t)) for t in range(tokenizer.n_vocab)]
    lengths[EOT] = 0
    return torch.tensor(lengths, dtype=torch.float64)


def bpb_sums(losses, targets, bytes_per_token):
    """(a, b): the targets' summed loss and UTF-8 bytes, end-of-text left out. Bits per byte, a / (ln 2 * b)."""
    return losses.double()[bytes_per_token[targets] > 0].sum(), bytes_per_token[targets].sum()


# -----------------------------------------------------------------------------
# Devices, compilation, CUDA graphs
class Processes:
    """This process's device and rank among the run's processes (DDP under torchrun; else one process)."""

    def __init__(self, device):
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if not (rank is world is None or str(rank).isdigit() and str(world).isdigit() and int(rank) < int(world)):
            raise TrainingError(f"RANK={rank}, WORLD_SIZE={world}: start several processes with torchrun")
        self.rank, self.world, self.distributed = int(rank or 0), int(world or 1), rank is not None
        self.log = (lambda *message: print(*message, flush=True)) if self.rank == 0 else (lambda *message: None)
        try:
            self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
            assert self.device.type in ("cpu", "cuda")
        except (RuntimeError, AssertionError):
            raise TrainingError(f"--device {device!r} is not a device here: train.py runs on cpu or cuda") from None
        if self.device.type == "cuda":  # cuda alone: under torchrun the process's LOCAL_RANK, else GPU 0
            index = int(os.environ.get("LOCAL_RANK", 0)) if self.device.index is None else self.device.index
            if index >= torch.cuda.device_count():
                raise TrainingError(f"--device {device}: PyTorch sees {torch.cuda.device_count()} CUDA GPU(s)")
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def all_sum(self, tensor):
        return dist.all_reduce(tensor) or tensor if self.distributed else tensor

    def gather(self, value):  # [rank 0's value, rank 1's, ...] on every rank
        values = [value] * self.world
        return dist.all_gather_object(values, value) or values if self.distributed else values

    def from_rank0(self, work, *args):  # rank 0 does the work; every rank returns its result, or raises its error
        try:
            outcome = (work(*args), None) if self.rank == 0 else None
        except TrainingError as error:
            outcome = None, str(error)
        result, error = self.gather(outcome)[0]
        if error is not None:
            raise TrainingError(error)
        return result


def autocast(device, dtype):
    return torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32")


def compile_model(model):
    """torch.compile as one graph, from an empty cache: else a model's eighth recompilation of GPT.forward fails."""
    torch.compiler.reset()
    return torch.compile(model, fullgraph=True, dynamic=False)


def cuda_graph(fn, warmups=3):
    """fn (static tensors in and out) in a CUDA graph: (replay, fn's output, refreshed by each replay), warmed up (and
    compiled) on a side stream as torch.cuda.graph requires. A replay draws anew and adds into existing gradients."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-up's cached blocks: a capture cannot free them when it needs the memory
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph.replay, output


# -----------------------------------------------------------------------------
# A recipe's training: the loop (its checkpoints too); its setup, its step; evaluation
def train_recipe(recipe, args, processes, data):
    """Train one recipe from its first step or its checkpoint: its row of the table (None if --stop-after stops it)."""
    (documents, validation, bytes_per_token), device = data, processes.device
    model, trained, optimizers, micro_batch, start, windows, history = setup_recipe(recipe, documents, args, processes)
    seconds, later = [], args.steps * (len(args.recipes) - 1 - args.recipes.index(recipe))  # the recipes after it
    for step in range(start + 1, args.steps + 1):  # numbered from 1, as the log and metrics.jsonl count them
        tic = time.time()
        batch = windows.next_batch(args.batch_tokens // args.seq_len)[processes.rank::processes.world]
        loss, multiplier = train_step(model, trained, optimizers, micro_batch, batch, step - 1, args, processes)
        loss = loss.item()  # read only now (the host queued the optimizer while the GPU finished the backward): synced
        if not math.isfinite(loss):  # the weights it spoiled are never saved: the last checkpoint stays good
            raise TrainingError(f"[{recipe}] non-finite loss ({loss}) at step {step}; stopped, checkpoint kept")
        history["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        seconds.append(time.time() - tic)
        record = dict(run_id=args.run_id, recipe=recipe, step=step, loss=loss, lr_multiplier=multiplier,
                      tokens_per_s=args.batch_tokens / seconds[-1])
        history["tokens_per_s"] += [record["tokens_per_s"]] if step - start > 3 else []  # not compiling, warming up
        history["lowest_loss"] = min(history["lowest_loss"], loss)
        pace = sorted(seconds)[len(seconds) // 2] / 60  # minutes of the median step (the first compiles)
        processes.log(f"[{recipe}] step {step:5d}/{args.steps} | loss {loss:.4f} | {seconds[-1] * 1000:.0f} ms, "
                      f"{record['tokens_per_s']:,.0f} tok/s | eta {(args.steps - step) * pace:.1f} min, run ~"
                      f"{(args.steps - step + later) * pace:.1f} min")
        if step % args.eval_every == 0 or step == args.steps:
            record["val_bpb"] = history["final_bpb"] = evaluate(trained, validation, bytes_per_token, processes, args)
            processes.log(f"[{recipe}] step {step}: validation bpb {record['val_bpb']:.4f}")
        stopping = args.stop_after and step - start >= args.stop_after and step < args.steps
        if step % args.checkpoint_every == 0 or step == args.steps or stopping:
            rng = processes.gather(dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device)
                                        if device.type == "cuda" else None))  # every rank's: each resumes its own
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                raise TrainingError(f"[{recipe}] non-finite weights at step {step}; stopped, checkpoint kept")
            record["checkpoint"] = True  # appended once the checkpoint is written: a recipe that had one says so
            processes.from_rank0(save_checkpoint, checkpoint_path(args.out, recipe), dict(  # its error stops all ranks
                run_id=args.run_id, recipe=recipe, step=step, model=model.state_dict(), rng=rng, history=history,
                adamw=optimizers[0].state_dict(), muon=optimizers[1].state_dict(), data=windows.state_dict(),
                record=record))
        if processes.rank == 0:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            if args.new_dir and step == 1 and recipe == args.recipes[0]:
                make_latest(args.out)  # a run becomes runs/latest once it has trained a step
        if stopping:
            processes.log(f"[{recipe}] stopped after {args.stop_after} steps as asked; continue with --resume")
            return None
    if args.steps >= args.warmup_steps + 3 and history["lowest_loss"] >= 0.99 * math.log(GPT2_VOCAB):
        raise TrainingError(f"[{recipe}] the model did not learn (its loss never fell 1% below ln(vocabulary) = "
                            f"{math.log(GPT2_VOCAB):.2f}); lower the learning rates")
    speeds = history["tokens_per_s"]
    return dict(recipe=recipe, val_bpb=history["final_bpb"], steps=args.steps, tokens=args.steps * args.batch_tokens,
                peak_memory_gb=history["peak_memory_gb"], tokens_per_s=sum(speeds) / len(speeds) if speeds else None)


def setup_recipe(recipe, documents, args, processes):
    """(model, model as trained (compiled, DDP), (AdamW, Muon), micro_batch(tokens) -> loss, the step it resumes after
    or 0, Windows, history): the seed's weights (the same for every recipe and rank), then the recipe's checkpoint."""
    path, records, device = checkpoint_path(args.out, recipe), read_metrics(args.out), processes.device
    written = any(r["recipe"] == recipe and r.get("checkpoint") for r in records)  # then it must be there
    checkpoint = load_checkpoint(path, args.run_id, recipe) if written or os.path.exists(path) else None
    start = checkpoint["step"] if checkpoint else 0
    if start > args.steps:
        raise TrainingError(f"[{recipe}] --steps {args.steps} is below its checkpoint's step {start}: a run can be "
                            f"extended, not shortened")
    torch.manual_seed(args.seed)
    model = GPT(args.depth, recipe, max_seq_len=args.seq_len).to(device)
    adamw, muon = make_optimizers(model, args.lr_matrix, args.lr_embedding, args.lr_head)
    torch.manual_seed(args.seed + 1 + processes.rank)  # the quantization's randomness differs across ranks
    if checkpoint:
        for part, state in ((model, "model"), (adamw, "adamw"), (muon, "muon")):
            part.load_state_dict(checkpoint[state])
        rng, on_gpu = checkpoint["rng"][processes.rank], device.type == "cuda"
        if (rng["cuda"] is not None) != on_gpu:  # a GPU's random state cannot be restored on a CPU, nor the reverse
            where = "a GPU" if rng["cuda"] is not None else "the CPU"
            raise TrainingError(f"[{recipe}] its checkpoint was written on {where}: resume it there, or start over")
        torch.set_rng_state(rng["cpu"])
        if on_gpu:
            torch.cuda.set_rng_state(rng["cuda"], device)
        processes.log(f"[{recipe}] resumed at step {start}")
    if processes.rank == 0:  # it writes its records after the checkpoint again; partial lines go too
        kept = [r for r in records if r["recipe"] != recipe or checkpoint and r["step"] < start]
        kept += [checkpoint["record"]] if checkpoint else []  # a kill may have come between it and its record
        write_atomically(os.path.join(args.out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in kept).encode())
    trained = compile_model(model) if args.compile else model
    if processes.distributed:
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=None if device.index is None else
                                                            [device.index])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    micro_batches = args.batch_tokens // (args.seq_len * args.device_batch * processes.world)

    def micro_batch(tokens):
        with autocast(device, args.dtype):
            loss = trained(tokens[:, :-1], tokens[:, 1:])
        (loss / micro_batches).backward()
        return loss.detach()
    windows = Windows(documents, args.seq_len, checkpoint and checkpoint["data"])
    history = checkpoint["history"] if checkpoint else dict(tokens_per_s=[], final_bpb=None, peak_memory_gb=None,
                                                            lowest_loss=math.inf)
    if not args.cuda_graph or start == args.steps:
        return model, trained, (adamw, muon), micro_batch, start, windows, history
    # --cuda-graph on a static buffer; the random state put back after the capture draws what an uncaptured run draws
    static = torch.zeros(args.device_batch, args.seq_len + 1, dtype=torch.long, device=device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.random.fork_rng([device]):
        replay, loss = cuda_graph(lambda: micro_batch(static))
    model.zero_grad(set_to_none=False)  # the warm-up's gradients

    def captured(tokens):
        static.copy_(tokens)
        replay()
        return loss  # read before the next replay
    return model, trained, (adamw, muon), captured, start, windows, history


def train_step(model, trained, optimizers, micro_batch, batch, step, args, processes):
    """Optimizer step `step` (from 0) on this rank's windows, DDP all-reducing at the last micro-batch: (loss, lr)."""
    adamw, muon = optimizers
    multiplier = lr_multiplier(step, args.steps, args.warmup_steps, args.warmdown)
    for group in adamw.param_groups + muon.param_groups:
        group["lr"] = group["initial_lr"] * multiplier
    muon.param_groups[0]["momentum"] = 0.85 + 0.10 * min(step / 300, 1)  # Muon's momentum warms up
    if processes.device.type == "cuda":  # the step's windows in one copy that does not stop the host
        batch = batch.pin_memory().to(processes.device, non_blocking=True)
    chunks, loss_sum = batch.split(args.device_batch), torch.zeros((), device=processes.device)
    for i, chunk in enumerate(chunks):
        with trained.no_sync() if processes.distributed and i < len(chunks) - 1 else contextlib.nullcontext():
            loss_sum += micro_batch(chunk)
    adamw.step()
    muon.step()
    model.zero_grad(set_to_none=not args.cuda_graph)  # a captured backward adds into the same tensors
    return processes.all_sum(loss_sum) / (len(chunks) * processes.world), multiplier


def lr_multiplier(step, steps, warmup, warmdown):
    """Warmup-stable-decay: 0 -> 1 over `warmup` steps, 1, then linearly to 0 over the last `warmdown` fraction."""
    if step < warmup:
        return (step + 1) / warmup
    decay_start = steps * (1 - warmdown)
    return 1.0 if step < decay_start else max(0.0, (steps - step) / (steps - decay_start))


def evaluate(model, windows, bytes_per_token, processes, args):
    """Validation bits per byte over the fixed validation windows (each rank takes a share)."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=processes.device)  # losses, bytes
    with torch.no_grad(), autocast(processes.device, args.dtype):
        for batch in windows[processes.rank::processes.world].split(args.device_batch):
            batch = batch.to(processes.device)
            losses = model(batch[:, :-1], batch[:, 1:], reduction="none")
            sums += torch.stack(bpb_sums(losses, batch[:, 1:].flatten(), bytes_per_token.to(processes.device)))
    model.train()
    loss_sum, byte_sum = processes.all_sum(sums).tolist()
    return loss_sum / (math.log(2) * byte_sum)


# -----------------------------------------------------------------------------
# The run's directory: where a run lives, and how nothing in it is lost
def claim_run(args, world, fingerprint, cleanup):
    """Rank 0's (OUT, run id): a new runs/<date>-<time>-<id>, --out, or runs/latest to resume; locked until cleanup."""
    out = os.path.join(RUNS, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}") if args.new_dir else \
        os.path.realpath(args.out or os.path.join(RUNS, "latest"))
    run = read_run(out, "resume") if args.resume else None
    try:
        names = set(os.listdir(out)) if os.path.isdir(out) else set()
        if "run.json" not in names and names - {".lock", "run.json.tmp"}:  # .tmp: a run killed as it began
            raise TrainingError(f"{out} holds files that are not a run of train.py; use an empty or new --out")
        os.makedirs(out, exist_ok=True)
        lock = os.open(os.path.join(out, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        cleanup.callback(os.close, lock)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the OS drops it when the process ends, even by a crash
    except BlockingIOError:
        raise TrainingError(f"{out} is in use by another run; wait for it or use another --out") from None
    except OSError as error:
        raise TrainingError(f"--out {out} is not a writable directory, or its .lock is not a file ({error.strerror})") \
            from None
    for folder in (os.path.join(out, recipe) for recipe in args.recipes):  # a file, or a broken link
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise TrainingError(f"{folder} is not a directory, and checkpoints go there; move it away")
    flags = {name: getattr(args, name) for name in RUN_FLAGS if args.data == "hf" or not name.startswith(
        ("hf_", "val_"))} | dict(world=world)
    if run:
        if changed := [f"--{name.replace('_', '-')} {run['flags'].get(name)!r} -> {value!r}"
                       for name, value in flags.items() if run["flags"].get(name) != value]:
            raise TrainingError(f"--resume cannot change flags that define the run: {', '.join(changed)}")
        if run.get("data_sha256") != fingerprint:
            raise TrainingError("the training data is not the run's (another --data-dir, or changed files)")
        return out, run["run_id"]
    if os.path.exists(os.path.join(out, "run.json")) and not args.overwrite:
        raise TrainingError(f"{out} holds a run: continue it with --resume, replace it with --overwrite")
    for name in ("metrics.jsonl", "summary.json", "loss.png", *(os.path.join(r, "checkpoint.pt") for r in RECIPES)):
        with contextlib.suppress(FileNotFoundError):  # a replaced run's files, and only those (else there are none)
            os.remove(os.path.join(out, name))
    run = dict(run_id=os.urandom(16).hex(), flags=flags, data_sha256=fingerprint)
    write_atomically(os.path.join(out, "run.json"), json.dumps(run, indent=1).encode())
    return out, run["run_id"]


def read_run(out, purpose):
    """OUT/run.json, to resume or sample its run: the run's id, the flags that define it, its data's fingerprint."""
    if not os.path.isfile(path := os.path.join(out, "run.json")):
        raise TrainingError(f"nothing to {purpose}: {path} not found (name the run's directory with --out)")
    with contextlib.suppress(ValueError, AttributeError, KeyError):  # not JSON, or not a run's
        run = json.loads(pathlib.Path(path).read_text())
        if isinstance(run.get("run_id"), str) and {"depth", "seq_len", "dtype", "seed"} <= run["flags"].keys():
            return run
    raise TrainingError(f"{path} is not a run.json of train.py; restore it, or --overwrite the run")


def make_latest(out):
    """runs/latest -> OUT, atomically, by a link of this process's own renamed over it (a user's directory stays)."""
    latest, temporary = os.path.join(RUNS, "latest"), os.path.join(RUNS, f"latest.{os.getpid()}.tmp")
    if os.path.islink(latest) or not os.path.exists(latest):
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        os.symlink(os.path.basename(out), temporary)
        os.replace(temporary, latest)


def write_atomically(path, *chunks):
    """The bytes to path.tmp, flushed to the disk and renamed over path: a crash or a full disk keeps the previous
    version (the run's lock keeps out a second writer); an error removes path.tmp and says why in one line."""
    temporary, kept = f"{path}.tmp", "; its previous version is kept" if os.path.exists(path) else ""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(temporary, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise TrainingError(f"could not write {path} ({error.strerror or error}){kept}") from None
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    with contextlib.suppress(OSError):  # the rename made durable, where the filesystem can
        os.fsync(directory)
    os.close(directory)


def checkpoint_path(out, recipe):
    return os.path.join(out, recipe, "checkpoint.pt")


def save_checkpoint(path, state):
    """torch.save's bytes after their SHA-256 (64 hexadecimal digits), written atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomically(path, hashlib.sha256(buffer.getbuffer()).hexdigest().encode(), buffer.getbuffer())


def load_checkpoint(path, run_id=None, recipe=None):
    """The checkpoint at path, checked: plain data (weights_only: no code runs), whole, of this run and recipe."""
    try:
        with open(path, "rb") as f:
            digest, payload = f.read(64), f.read()
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        owner = state["run_id"], state["recipe"], state["step"], state["model"]
    except FileNotFoundError:  # the hint for a run's own checkpoint (bench.py loads any)
        raise TrainingError(f"checkpoint {path} not found" + (": restore it, or start a new run (a tiny run deletes "
                            "its checkpoints when done, unless --keep-checkpoints)" if run_id else "")) from None
    except Exception as error:  # empty, truncated or foreign: it fails in many ways
        raise TrainingError(f"checkpoint {path} is unreadable ({type(error).__name__}): not train.py's") from None
    if problem := ("is corrupt (its checksum differs)" if hashlib.sha256(payload).hexdigest().encode() != digest else
                   "belongs to another run" if run_id not in (None, owner[0]) else
                   f"is the {owner[1]} recipe's, not {recipe}'s" if recipe not in (None, owner[1]) else None):
        raise TrainingError(f"checkpoint {path} {problem}; restore the run's, or start over")
    return state


def read_metrics(out):
    """The records of OUT/metrics.jsonl; a line that is not one (a crash while writing) is skipped."""
    path, records = os.path.join(out, "metrics.jsonl"), []
    for line in pathlib.Path(path).read_text(errors="replace").splitlines() if os.path.exists(path) else []:
        with contextlib.suppress(ValueError, AttributeError):
            record = json.loads(line)
            if all(isinstance(record.get(key), kind) for key, kind in dict(recipe=str, step=int, loss=float).items()):
                records.append(record)
    return records


# -----------------------------------------------------------------------------
# The comparison, and the samples: every model continues the same prompts
def summarize(rows, args, processes):
    """Rank 0's end of a run: the table, the samples, OUT/summary.json and loss.png; the checkpoints unless kept."""
    baseline, device = next((r["val_bpb"] for r in rows if r["recipe"] == "bf16"), None), processes.device
    print(f"\n{'recipe':<14}{'val bpb':>10}{'gap to bf16':>13}{'tokens/s':>12}{'peak memory':>13}")
    for r in rows:
        r["gap_pct"] = 100 * (r["val_bpb"] / baseline - 1) if baseline and r["val_bpb"] else None
        gap = f"{r['gap_pct']:+.2f}%" if r["gap_pct"] is not None else "-"
        memory = f"{r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] is not None else "-"
        speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"  # measured after 3 steps
        print(f"{r['recipe']:<14}{r['val_bpb']:>10.4f}{gap:>13}{speed:>12}{memory:>13}")
    emulated = not native_fp4_available(device)
    print("One seed per recipe: at small sizes, gaps of a few tenths of a percent are noise (bench.py study measures "
          "it).\nTokens/s: " + ("of PyTorch's reference code, on a CPU." if device.type == "cpu" else "quantizing, "
          "without faster GEMMs (no FP4 tensor cores)." if emulated else "with NVFP4 GEMMs on FP4 tensor cores."))
    print(f"\nEvery model continues the same prompts with the same draws (temperature {TEMPERATURE}, top {TOP_K}):")
    samples = recipe_samples(args, device, args.recipes, PROMPTS)
    summary = dict(run_id=args.run_id, rows=rows, prompts=PROMPTS, samples=samples, date=time.strftime("%Y-%m-%d"),
                   args=vars(args), device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   world_size=processes.world, torch=torch.__version__, emulated_nvfp4=emulated)
    write_atomically(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=1, default=str).encode())
    plot(args.out, f"train.py run {args.run_id[:8]}, {summary['device']}, {summary['date']}")
    for recipe in () if args.keep_checkpoints else args.recipes:
        with contextlib.suppress(FileNotFoundError):
            os.remove(checkpoint_path(args.out, recipe))
    size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(args.out) for name in names)
    print(f"\n{args.out}: {size / 1e6:,.1f} MB, " + ("its checkpoints kept for --resume and --sample (delete it when "
          "done)" if args.keep_checkpoints else "its checkpoints deleted (--keep-checkpoints keeps them)"))


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said) if matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")


def plot(out, provenance, path=None):
    """Training loss and validation bpb per recipe to path (else OUT/loss.png), the run named in its metadata."""
    if (plt := pyplot()) is None:
        return
    records, (figure, axes) = read_metrics(out), plt.subplots(1, 2, figsize=(11, 4))
    for recipe in dict.fromkeys(r["recipe"] for r in records):
        mine = [r for r in records if r["recipe"] == recipe]
        axes[0].plot([r["step"] for r in mine], [r["loss"] for r in mine], label=recipe, linewidth=0.8)
        axes[1].plot(*zip(*[(r["step"], r["val_bpb"]) for r in mine if "val_bpb" in r]), marker="o", label=recipe)
    for side, label, scale in zip(axes, ("training loss (nats/token)", "validation bits per byte"), ("log", "linear")):
        side.set(xlabel="step", ylabel=label, yscale=scale)
        side.legend()
        side.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(image := io.BytesIO(), format="png", dpi=120, metadata={"Description": provenance})
    plt.close(figure)
    write_atomically(path or os.path.join(out, "loss.png"), image.getvalue())


def recipe_samples(args, device, recipes, prompts):
    """{recipe: its model's continuations of the prompts}, printed: each from its checkpoint, with the same draws."""
    tokenizer, samples = gpt2_tokenizer(), {}
    for recipe in recipes:
        with torch.random.fork_rng(devices=[]):  # initial weights, which the checkpoint's replace
            model = GPT(args.depth, recipe, max_seq_len=args.seq_len).to(device)
        model.load_state_dict(load_checkpoint(checkpoint_path(args.out, recipe), args.run_id, recipe)["model"])
        samples[recipe] = []
        for prompt in prompts:
            tokens = torch.tensor([[EOT] + tokenizer.encode_ordinary(prompt)], device=device)  # as a document starts
            generator = torch.Generator(device).manual_seed(args.seed)  # training's draws stay as they were
            with autocast(device, args.dtype):
                written = model.generate(tokens, args.sample_tokens, TEMPERATURE, TOP_K, generator)[0, tokens.shape[1]:]
            samples[recipe].append(tokenizer.decode(written.tolist()).split("<|endoftext|>")[0])  # a document's end
    for i, prompt in enumerate(prompts):
        print(f"\n{prompt} ...")
        for recipe, texts in samples.items():
            print(textwrap.fill(" ".join(texts[i].split()) or "(ended at once)", 120, initial_indent=f"  {recipe:<14}",
                                subsequent_indent=" " * 16))
    return samples


def sample_run(args, device):
    """--sample: the run's models (--out, or runs/latest) continue the prompt with its seed (on a GPU in BF16)."""
    args.out = os.path.realpath(args.out or os.path.join(RUNS, "latest"))
    run, recipes = read_run(args.out, "sample"), list(dict.fromkeys(r["recipe"] for r in read_metrics(args.out)))
    if not recipes:
        raise TrainingError(f"nothing to sample: no model of {args.out} has trained a step")
    args.depth, args.seq_len, args.seed = (run["flags"][name] for name in ("depth", "seq_len", "seed"))
    args.dtype = "bfloat16" if device.type == "cuda" else run["flags"]["dtype"]
    args.run_id = run["run_id"]
    recipe_samples(args, device, recipes, [args.sample])


# -----------------------------------------------------------------------------
# Flags, and the run
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: sys.exit(f"train.py: error: {message} (see python train.py --help)")  # one line
    add, boolean = parser.add_argument, argparse.BooleanOptionalAction
    add("--recipe", default="bf16,quartet2", help=f"comma-separated recipes to train, from {','.join(RECIPES)}")
    add("--preset", choices=list(PRESETS), help="defaults for a model size (default: d12 on a GPU)")
    add("--depth", type=int, help="transformer depth; width = 64 * depth")
    add("--seq-len", type=int, help="tokens per training window")
    add("--device-batch", type=int, help="windows per micro-batch on each device (halve it if one does not fit)")
    add("--batch-tokens", type=int, help="tokens per optimizer step, across all devices")
    add("--steps", type=int, help="optimizer steps")
    add("--warmup-steps", type=int, default=0, help="linear learning-rate warmup steps")
    add("--warmdown", type=float, default=0.2, help="fraction of the steps over which the learning rate decays to 0")
    add("--lr-matrix", type=float, default=0.02, help="Muon learning rate (block matrices)")
    add("--lr-embedding", type=float, default=0.2, help="AdamW learning rate of the embedding (at width 768)")
    add("--lr-head", type=float, default=0.004, help="AdamW learning rate of lm_head (at width 768)")
    add("--eval-every", type=int, help="steps between validation evaluations")
    add("--eval-tokens", type=int, help="validation tokens per evaluation (the first ones of the split)")
    add("--data", choices=["local", "hf"], default="local", help="the bundled sample, or stream from Hugging Face")
    add("--data-dir", default=DATA_DIR, help="where the bundled sample lives")
    add("--hf-dataset", default="HuggingFaceFW/fineweb-edu", help="with --data hf: dataset path (or 'json')")
    add("--hf-config", default="sample-10BT", help="with --data hf: dataset configuration")
    add("--hf-files", nargs="*", help="with --data hf: local data files for the dataset (e.g. with 'json')")
    add("--val-docs", type=int, default=500, help="with --data hf: the first N documents are the validation split")
    add("--dtype", choices=["bfloat16", "float32"], help="autocast dtype (default bfloat16 on GPU, float32 on CPU)")
    add("--compile", action=boolean, help="torch.compile the model (default: on a GPU)")
    add("--cuda-graph", action=boolean, help="capture each micro-batch in a CUDA graph (default: one GPU, compiled)")
    add("--device", default="auto", help="cuda, cuda:N or cpu (default: the GPU if there is one)")
    add("--seed", type=int, default=0, help="seed of the weights, the data order and the quantization randomness")
    add("--deterministic", action="store_true", help="repeat a GPU run bit for bit (5-7%% fewer tokens/s at d12)")
    add("--out", help="the run's directory (default: a new runs/<date>-<time>-<id>; with --resume, runs/latest)")
    add("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    add("--resume", action="store_true", help="continue the run in --out (default: the newest) from its checkpoints")
    add("--overwrite", action="store_true", help="replace the run in --out with a new one")
    add("--stop-after", type=int, default=0, help="stop after this many steps, checkpointed (then --resume)")
    add("--keep-checkpoints", action=boolean, help="keep them at the end, for --resume and --sample (not: preset tiny)")
    add("--sample", metavar="PROMPT", help="no training: the models of the run in --out (or runs/latest) continue it")
    add("--sample-tokens", type=int, default=48, help="tokens a sample writes (at a run's end, and with --sample)")
    return parser.parse_args(argv)


def resolve(args, processes):
    """Fill in the preset's defaults and check every flag before any work: a one-line error for one that cannot be."""
    cuda, world = processes.device.type == "cuda", processes.world
    if args.preset is None and not cuda:
        raise TrainingError("no GPU found: the default run (preset d12) needs one; --preset tiny runs on a CPU")
    args.preset = args.preset or "d12"
    for key, value in (PRESETS[args.preset] | dict(dtype="bfloat16" if cuda else "float32", compile=cuda)).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if args.cuda_graph is None:
        args.cuda_graph = cuda and args.compile and not processes.distributed
    args.new_dir, args.recipes = args.out is None and not args.resume, recipe_names(args.recipe)  # ValueError: main's
    value, flag, per_step = vars(args), lambda name: "--" + name.replace("_", "-"), args.seq_len * args.device_batch
    least = dict(depth=1, seq_len=1, device_batch=1, batch_tokens=1, steps=1, eval_every=1, eval_tokens=1,
                 checkpoint_every=1, warmup_steps=0, stop_after=0, val_docs=0, sample_tokens=0)
    checks = [(value[k] < low, f"{flag(k)} must be at least {low}, got {value[k]}") for k, low in least.items()]
    checks += [(not 0 < value[k] < torch.finfo(torch.float32).max, f"{flag(k)} must be a positive number, got "
                f"{value[k]}") for k in ("lr_matrix", "lr_embedding", "lr_head")]  # NaN too
    checks += [
        (not 0 <= args.seed < 2**31, f"--seed must be in [0, 2^31), got {args.seed}"),
        (not 0 <= args.warmdown <= 1, f"--warmdown must be a fraction in [0, 1], got {args.warmdown}"),
        (per_step > 0 and args.batch_tokens % (per_step * world), f"--batch-tokens {args.batch_tokens} must be a "
         f"multiple of seq_len x device_batch x GPUs = {args.seq_len} x {args.device_batch} x {world}"),
        (args.cuda_graph and (not cuda or processes.distributed), "--cuda-graph runs on one GPU (DDP is not captured)"),
        (cuda and args.dtype == "float32" and args.recipes != ["bf16"],
         "the NVFP4 kernels take bfloat16 on a GPU: use --dtype bfloat16"),
        (args.out is not None and not args.out.strip(), "--out is empty: name a directory, or leave it out"),
        (args.overwrite and (args.resume or args.out is None),
         "--overwrite replaces the run in a given --out (and does not go with --resume)"),
        (args.data == "hf" and args.hf_dataset == "json" and not args.hf_files, "--hf-dataset json reads --hf-files")]
    if problems := [message for bad, message in checks if bad]:
        raise TrainingError(problems[0])
    with torch.device("meta"):  # the model's own rules (depth, layer and token counts), on a weightless model
        for recipe in args.recipes:
            GPT(args.depth, recipe, max_seq_len=args.seq_len)
            check_tokens(recipe, args.seq_len * args.device_batch)
    return args


def deterministic(cleanup):
    """Deterministic algorithms (the compiled embedding backward adds in a varying order) until `cleanup`."""
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:  # the workspace they need, read when cuBLAS starts
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        cleanup.callback(os.environ.pop, "CUBLAS_WORKSPACE_CONFIG", None)
    cleanup.callback(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled())
    cleanup.callback(setattr, torch.utils.deterministic, "fill_uninitialized_memory",
                     torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # else torch.empty writes every byte


def out_of_memory(error):
    """The first line of an error that is running out of memory (the GPU's, Python's, the CPU allocator's), or None."""
    reason = (str(error) or type(error).__name__).splitlines()[0][:100]
    memory = isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)) or "can't allocate memory" in reason
    return reason if memory else None


def amount(count):
    """A count in a few digits: 960, 41K, 4.86M, 1.2B."""
    return next((f"{count / size:.3g}{unit}" for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if count >= size),
                str(count))


def main(argv=None):
    args = parse_args(argv)
    try:
        with contextlib.ExitStack() as cleanup:  # what the run holds or changed: its lock, --deterministic's settings
            if args.deterministic:
                deterministic(cleanup)
            processes = Processes(args.device)
            if args.sample is not None:
                return sample_run(args, processes.device)
            args, tokenizer = resolve(args, processes), gpt2_tokenizer()
            documents, validation, fingerprint = data_sources(args, tokenizer)
            bytes_per_token = token_bytes(tokenizer)
            validation = validation_windows(validation, args.seq_len, args.eval_tokens // args.seq_len,
                                            args.device_batch * processes.world, bytes_per_token)
            args.out, args.run_id = processes.from_rank0(claim_run, args, processes.world, fingerprint, cleanup)
            passes = args.steps * args.batch_tokens / sum(map(len, documents(0, 0))) if args.data == "local" else 0
            processes.log(f"run {args.run_id[:8]} in {args.out}, on {processes.device} x {processes.world}\npreset "
                          f"{args.preset}: depth {args.depth}, recipes {', '.join(args.recipes)}, {len(validation)} "
                          f"validation windows of {args.seq_len} tokens\n{args.steps} steps of "
                          f"{amount(args.batch_tokens)} tokens: {amount(args.steps * args.batch_tokens)} tokens per "
                          f"recipe" + (f", {passes:.2g} passes over the bundled sample" if passes else ""))
            rows = []
            for recipe in args.recipes:
                rows.append(train_recipe(recipe, args, processes, (documents, validation, bytes_per_token)))
                if rows[-1] is None:  # --stop-after
                    return
            if processes.rank == 0:
                summarize(rows, args, processes)
    except (TrainingError, ValueError, OSError) as error:  # ValueError: the model's rules; OSError: a file's
        sys.exit(f"train.py: error: {error}")
    except KeyboardInterrupt:
        sys.exit("train.py: interrupted; --resume continues from the last checkpoint")
    except (MemoryError, RuntimeError) as error:
        if (reason := out_of_memory(error)) is None:
            raise
        sys.exit(f"train.py: error: out of memory ({reason}); halve --device-batch (gradient accumulation keeps the "
                 f"step's tokens), or use a smaller model")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
