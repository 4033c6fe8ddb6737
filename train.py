"""
Pre-train the Nanochat GPT on FineWeb-Edu, once per recipe (BF16, Quartet II, ...), and compare them.

    python train.py                               # BF16 vs Quartet II on one GPU, the bundled data, preset d12
    python train.py --preset tiny                 # a toy run that finishes in minutes on a CPU
    python train.py --data hf --preset d20        # stream HuggingFaceFW/fineweb-edu (needs the network)
    torchrun --nproc_per_node=8 train.py          # several GPUs (DDP)

Every recipe trains from the same seed on the same data order; a table compares the final validation bits per
byte, the gap to BF16, tokens per second and peak memory (OUT/summary.json; every step in OUT/metrics.jsonl, the
curves in OUT/loss.png with matplotlib).

Data. Documents are tokenized with GPT-2's BPE (tiktoken, from data/gpt2.tiktoken, no network), each followed by the
end-of-text token, concatenated, and cut into windows of seq_len + 1 tokens (inputs and targets shifted by one). The
bundled sample is 4,788 training and 253 validation documents of FineWeb-Edu (ODC-By 1.0), repeated in a new order
each epoch; with --data hf the documents stream through Hugging Face `datasets` and the first --val-docs of them are
the validation split. A step accumulates gradients until it has seen --batch-tokens tokens (across all GPUs); on a
GPU the micro-batch is the preset's, halved until it fits. The learning rate warms up, stays, and decays linearly to
0 over the last --warmdown of the steps (optimizers: model.py).

Speed. On a GPU the model is compiled, and on one GPU each micro-batch's forward + backward is captured in a CUDA
graph at the first step and replayed after (--cuda-graph): a quantized micro-batch launches hundreds of small
kernels, and issuing them one by one keeps the host busier than the GPU (a d12 Quartet II micro-batch: ~100 ms of
host time for ~94 ms of GPU time, H200).

Evaluation. Bits per byte = sum of target-token losses / (ln 2 * sum of the target tokens' UTF-8 bytes), end-of-text
excluded from both: a tokenizer-independent measure of compression.

Runs never lose work. OUT/run.json names the run (an id and the flags that define it); a lock keeps a second run out
of OUT. Each recipe's checkpoint is written every --checkpoint-every steps and at the end, atomically, with a
checksum of its contents. --resume continues every recipe exactly (data position, optimizer state, every GPU's
random state: bit for bit on a CPU, and on a GPU with --deterministic, without which the compiled backward's atomic
additions make even two uninterrupted runs differ in their last bits), refuses a checkpoint of another run or
changed flags that define the run, and extends a finished run given a larger --steps. A non-finite loss stops the
run, naming the step; the last good checkpoint stays.
"""

import argparse
import contextlib
import fcntl
import glob
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import random
import sys
import time
import uuid

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from tiktoken.load import load_tiktoken_bpe

from kernels import native_fp4_available
from model import GPT, GPT2_VOCAB, RECIPES, check_tokens, make_optimizers, recipe_names

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
# torch.compile's mode, the same for every recipe. "reduce-overhead" (CUDA graphs, which remove the host's launch
# work: a quantized d12 step keeps the host as busy as the GPU) runs, without cudagraph trees (compile_model), but
# held 35.7 GB at Quartet II's d12 against 23.4 in the default mode, and ran out of the H200's 140 GB at d20
# (NOTES.md): the default mode it is.
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
# The flags that define a run: --resume refuses to change them (--steps may grow: that extends the run).
RUN_FLAGS = ("depth", "seq_len", "batch_tokens", "warmup_steps", "warmdown", "lr_matrix", "lr_embedding", "lr_head",
             "eval_tokens", "data", "hf_dataset", "hf_config", "hf_files", "val_docs", "dtype", "seed")


class TrainingError(Exception):
    """A problem the user can fix (bad flags, missing data, a damaged checkpoint): one line, no traceback."""


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
    """The bundled FineWeb-Edu sample: a list of texts (gzipped JSON lines with a "text" field)."""
    files = sorted(glob.glob(os.path.join(data_dir, f"fineweb_edu_{split}_*.jsonl.gz")))
    if not files:
        raise TrainingError(f"no {split} data: {data_dir}/fineweb_edu_{split}_*.jsonl.gz not found "
                            f"(the sample ships in data/; or use --data hf)")
    texts = []
    for name in files:
        try:
            with gzip.open(name, "rt", encoding="utf-8") as f:
                texts.extend(json.loads(line)["text"] for line in f)
        except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
            raise TrainingError(f"{name} is not gzipped JSON lines with a \"text\" field ({type(error).__name__}: "
                                f"{error}); restore it from the repository") from None
    return texts


def streamed_texts(path, name=None, data_files=None, skip=0):
    """Texts streamed through Hugging Face `datasets` (a hub dataset, or local files with path="json")."""
    try:
        import datasets
    except ImportError:
        raise TrainingError("--data hf streams through Hugging Face datasets: pip install datasets") from None
    try:
        stream = datasets.load_dataset(path, name=name, data_files=data_files, split="train", streaming=True)
        for row in stream.skip(skip) if skip else stream:
            yield row["text"]
    except (OSError, ValueError, KeyError, ConnectionError) as error:
        raise TrainingError(f"could not stream {path} ({type(error).__name__}: {str(error)[:200]}); --data hf "
                            f"needs the network, or local files with --hf-dataset json --hf-files ...") from None


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
    them (every evaluation batch full: quantized recipes need whole multiples of 128 tokens, a compiled model one
    batch shape): a fixed set."""
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
# Processes, schedule, compilation


class Processes:
    """This process's device and rank, and the number of processes (DDP under torchrun; else one)."""

    def __init__(self, device):
        self.distributed = "RANK" in os.environ
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except RuntimeError:
            raise TrainingError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise TrainingError(f"--device {device} asked for, but PyTorch sees no CUDA GPU")
            self.device = torch.device("cuda", local_rank if self.device.index is None else self.device.index)
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

    def gather(self, value):
        """[rank 0's value, rank 1's, ...] on every rank."""
        values = [value]
        if self.distributed:
            values = [None] * self.world
            dist.all_gather_object(values, value)
        return values


def lr_multiplier(step, steps, warmup, warmdown):
    """Warmup-stable-decay: 0 -> 1 over `warmup` steps, 1, then linearly to 0 over the last `warmdown` fraction."""
    if step < warmup:
        return (step + 1) / warmup
    decay_start = steps * (1 - warmdown)
    return 1.0 if step < decay_start else max(0.0, (steps - step) / (steps - decay_start))


def compile_model(model, mode=COMPILE_MODE):
    """torch.compile the whole model as one graph: fullgraph, so that a graph break is an error, not a slowdown.
    mode "reduce-overhead" replays CUDA graphs, each graph with its own memory: with PyTorch's default cudagraph
    trees (one memory pool shared by the forward and backward graphs) the first backward failed, "accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run", for BF16 too (H200, NOTES.md). A graph's
    outputs are then overwritten by its next replay: use each forward's loss before the next forward."""
    mode_or_options = dict(mode=mode) if mode != "reduce-overhead" else dict(
        options={"triton.cudagraphs": True, "triton.cudagraph_trees": False})
    # torch.compile keeps what it compiled for GPT.forward across models and compiles it again for each new one
    # (every recipe, every seed in one process) and for evaluation; under fullgraph its eighth recompilation is an
    # error. Each model starts afresh.
    torch.compiler.reset()
    return torch.compile(model, fullgraph=True, dynamic=False, **mode_or_options)


def cuda_graph(fn, warmups=3):
    """fn (no arguments; static tensors in and out) captured in a CUDA graph: returns (replay, fn's output), the output
    living in the graph's memory and refreshed by each replay. A replay launches every kernel of fn at once, so the
    host's time per call drops to ~1 ms (a compiled quantized d12 micro-batch keeps the host ~100 ms busy without
    it). The warm-up calls (which compile) run on a side stream, as torch.cuda.graph requires. Randomness drawn on the
    device is drawn anew on each replay (CUDA's generator is graph-safe); gradients that exist before the capture
    are added into in place (train.py's accumulation), ones made during it live in the graph's memory. Captured
    whole, fn frees its temporaries inside the graph's own memory as it goes: a captured d12 micro-batch needed no
    more memory than an uncaptured one (H200, NOTES.md)."""
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
# The run directory: run.json, a lock, checksummed checkpoints, metrics


def write_atomically(path, write):
    """write(a temporary name of this process), then rename it over path: a crash never leaves half a file."""
    temporary = f"{path}.{os.getpid()}.tmp"
    write(temporary)
    os.replace(temporary, path)


def lock(out):
    """Create OUT and take OUT/.lock, an flock the OS drops when its process ends (even by a crash), or refuse while
    another process holds it. Returns the function that releases it."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out {out} is a file, not a directory")
    try:
        os.makedirs(out, exist_ok=True)
        held = open(os.path.join(out, ".lock"), "a")
    except OSError as error:
        raise TrainingError(f"--out {out} is not writable ({error.strerror})") from None
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        raise TrainingError(f"{out} is in use by another run; wait for it or use another --out") from None
    return held.close


def open_run(args, processes):
    """The run's id: a new one written to OUT/run.json (which must not hold a run, unless --overwrite), or with
    --resume the one in OUT/run.json, whose flags must be the ones given."""
    path = os.path.join(args.out, "run.json")
    flags = {name: getattr(args, name) for name in RUN_FLAGS} | dict(world=processes.world)
    if not args.resume:
        if os.path.exists(path) and not args.overwrite:
            raise TrainingError(f"{args.out} holds a run: continue it with --resume, replace it with --overwrite, or "
                                f"use another --out")
        run = dict(run_id=processes.gather(uuid.uuid4().hex)[0], flags=flags)
        if processes.rank == 0:
            for stale in glob.glob(os.path.join(args.out, "*", "checkpoint.pt")) + [metrics_path(args.out)]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
            write_atomically(path, lambda name: json.dump(run, open(name, "w"), indent=1))
        return run["run_id"]
    try:
        run = json.load(open(path))
    except FileNotFoundError:
        raise TrainingError(f"nothing to resume: {path} not found (start without --resume)") from None
    except (OSError, ValueError) as error:
        raise TrainingError(f"{path} is unreadable ({error}); restore it or start over with --overwrite") from None
    changed = [f"--{name.replace('_', '-')} {run['flags'].get(name)!r} -> {value!r}" for name, value in flags.items()
               if run["flags"].get(name) != value]
    if changed:
        raise TrainingError(f"--resume cannot change flags that define the run: {', '.join(changed)}")
    return run["run_id"]


def save_checkpoint(path, state):
    """torch.save's bytes of the state, and their SHA-256, in one file written atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomically(path, lambda name: torch.save(dict(payload=payload, sha256=hashlib.sha256(
        payload.numpy()).hexdigest()), name))


def load_checkpoint(path, run_id=None):
    """The checkpoint at path, checked: plain data (weights_only, so no code runs), intact, and of this run (of any
    run if run_id is None)."""
    if not os.path.isfile(path):
        raise TrainingError(f"checkpoint {path} not found")
    try:
        outer = torch.load(path, map_location="cpu", weights_only=True)
        intact = hashlib.sha256(outer["payload"].numpy()).hexdigest() == outer["sha256"]
        state = torch.load(io.BytesIO(outer["payload"].numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as error:  # an empty, truncated or foreign file fails in many ways
        raise TrainingError(f"checkpoint {path} is unreadable ({type(error).__name__}); delete it to restart that "
                            f"recipe") from None
    if not intact:
        raise TrainingError(f"checkpoint {path} is corrupt (its checksum does not match); delete it to restart")
    if run_id is not None and state["run_id"] != run_id:
        raise TrainingError(f"checkpoint {path} belongs to another run; delete it, or use another --out")
    return state


def rng_state(device):
    return dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def metrics_path(out):
    return os.path.join(out, "metrics.jsonl")


def read_metrics(out):
    """The records of OUT/metrics.jsonl; a partial line (a crash while writing) is skipped."""
    records = []
    for line in open(metrics_path(out)) if os.path.exists(metrics_path(out)) else []:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def keep_metrics(out, recipe, step):
    """Drop the recipe's records after `step` (a resumed run writes them again) and partial lines."""
    kept = [r for r in read_metrics(out) if r["recipe"] != recipe or r["step"] <= step]
    write_atomically(metrics_path(out), lambda name: open(name, "w").writelines(json.dumps(r) + "\n" for r in kept))


# -----------------------------------------------------------------------------
# Training one recipe


def micro_batch_problem(args, device_batch, world):
    """Why micro-batches of device_batch windows on each of `world` devices cannot make up a step of --batch-tokens,
    or why a recipe refuses their tokens (the model's own rule); None if they can."""
    per_step = args.seq_len * device_batch * world
    if args.batch_tokens % per_step:
        return (f"--batch-tokens {args.batch_tokens} must be a multiple of seq_len x device_batch x GPUs = "
                f"{args.seq_len} x {device_batch} x {world} = {per_step}")
    for recipe in args.recipes:
        try:
            check_tokens(recipe, args.seq_len * device_batch)
        except ValueError as error:
            return str(error)
    return None


def fit_device_batch(model, args, processes):
    """The largest micro-batch, from the preset's down by halves, whose forward + backward fits in 90% of the GPU's
    memory (the rest is for the optimizer's state); every rank takes the smallest of their choices."""
    batch = args.device_batch
    torch.cuda.set_per_process_memory_fraction(0.9, processes.device)
    while True:
        try:
            tokens = torch.randint(0, model.vocab_size, (batch, args.seq_len + 1), device=processes.device)
            with torch.autocast("cuda", dtype=getattr(torch, args.dtype)):
                model(tokens[:, :-1], tokens[:, 1:]).backward()
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1 or micro_batch_problem(args, batch // 2, processes.world):
                raise TrainingError(f"a micro-batch of {batch} x {args.seq_len} tokens does not fit in the GPU's "
                                    f"memory, nor does a smaller one; use a smaller --seq-len or model") from None
            batch //= 2
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0, processes.device)
    return min(processes.gather(batch))


def evaluate(model, windows, bytes_per_token, processes, args):
    """Validation bits per byte over the fixed validation windows (each rank takes a share)."""
    model.eval()
    device, dtype = processes.device, getattr(torch, args.dtype)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # losses, bytes
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        for batch in windows[processes.rank::processes.world].split(args.device_batch):
            batch = batch.to(device)
            losses = model(batch[:, :-1], batch[:, 1:], reduction="none")
            sums += torch.stack(bpb_sums(losses, batch[:, 1:].flatten(), bytes_per_token.to(device)))
    model.train()
    loss_sum, byte_sum = processes.all_sum(sums).tolist()
    return loss_sum / (math.log(2) * byte_sum)


class Training:
    """One recipe's training: model, optimizers, data position and history, from scratch or from its checkpoint."""

    def __init__(self, recipe, args, processes, documents, run_id):
        self.name, self.args, self.processes, self.run_id = recipe, args, processes, run_id
        self.path = os.path.join(args.out, recipe, "checkpoint.pt")
        checkpoint = load_checkpoint(self.path, run_id) if args.resume and os.path.exists(self.path) else None
        self.start = checkpoint["step"] if checkpoint else 0
        if self.start > args.steps:
            raise TrainingError(f"[{recipe}] --steps {args.steps} is below its checkpoint's step {self.start}: a run "
                                f"can be extended, not shortened")
        device = processes.device
        torch.manual_seed(args.seed)  # the same initial weights for every recipe and rank
        self.model = GPT(args.depth, recipe, max_seq_len=args.seq_len).to(device)
        self.compiled = compile_model(self.model) if args.compile else self.model
        if args.fit_device_batch:
            args.device_batch = fit_device_batch(self.compiled, args, processes)
            processes.log(f"[{recipe}] micro-batch of {args.device_batch} x {args.seq_len} tokens (fits this GPU)")
        self.adamw, self.muon = make_optimizers(self.model, args.lr_matrix, args.lr_embedding, args.lr_head)
        self.windows = Windows(documents, args.seq_len, checkpoint and checkpoint["data"])
        torch.manual_seed(args.seed + 1 + processes.rank)  # quantization randomness differs across ranks
        self.history = dict(tokens_per_s=[], final_bpb=None, peak_memory_gb=None)
        if checkpoint:
            self.model.load_state_dict(checkpoint["model"])
            self.adamw.load_state_dict(checkpoint["adamw"])
            self.muon.load_state_dict(checkpoint["muon"])
            rng = checkpoint["rng"][processes.rank]
            torch.set_rng_state(rng["cpu"])
            if device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], device)
            self.history = checkpoint["history"]
            processes.log(f"[{recipe}] resumed from {self.path} at step {self.start}")
        if processes.rank == 0:
            keep_metrics(args.out, recipe, self.start)
        self.trained = self.compiled if not processes.distributed else torch.nn.parallel.DistributedDataParallel(
            self.compiled, device_ids=[device.index] if device.type == "cuda" else None)
        self.replay = None  # with --cuda-graph: the captured micro-batch, made at the first step

    def forward_backward(self, tokens, micro_batches):
        """One micro-batch's forward and backward (its share of the step's mean loss); returns its loss."""
        dtype = getattr(torch, self.args.dtype)
        with torch.autocast(self.processes.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = self.trained(tokens[:, :-1], tokens[:, 1:])
        (loss / micro_batches).backward()
        return loss.detach()

    def capture(self, micro_batches):
        """The micro-batch's forward + backward as a CUDA graph on a static token buffer: returns replay(tokens) ->
        loss. The random state is put back after the warm-up and the capture, so the run draws the same numbers as
        one without graphs (and a resumed run the same as an uninterrupted one)."""
        device = self.processes.device
        tokens = torch.zeros(self.args.device_batch, self.args.seq_len + 1, dtype=torch.long, device=device)
        random_state = torch.cuda.get_rng_state(device)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)  # the graph adds into these
        replay, loss = cuda_graph(lambda: self.forward_backward(tokens, micro_batches))
        torch.cuda.set_rng_state(random_state, device)
        self.model.zero_grad(set_to_none=False)  # the warm-up's gradients

        def replay_on(chunk):
            tokens.copy_(chunk)
            replay()
            return loss  # overwritten by the next replay: read it before then
        return replay_on

    def step(self, step):
        """One optimizer step over --batch-tokens tokens; returns the mean loss."""
        args, processes, device = self.args, self.processes, self.processes.device
        multiplier = lr_multiplier(step, args.steps, args.warmup_steps, args.warmdown)
        for group in self.adamw.param_groups + self.muon.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
        self.muon.param_groups[0]["momentum"] = 0.85 + 0.10 * min(step / 300, 1)  # Muon's momentum warms up
        batch = self.windows.next_batch(args.batch_tokens // args.seq_len)[processes.rank::processes.world]
        if device.type == "cuda":  # the step's windows in one copy that does not stop the host
            batch = batch.pin_memory().to(device, non_blocking=True)
        micro_batches = batch.split(args.device_batch)
        if args.cuda_graph and self.replay is None:
            self.replay = self.capture(len(micro_batches))
        loss_sum = torch.zeros((), device=device)
        for micro, chunk in enumerate(micro_batches):
            if self.replay is not None:
                loss_sum += self.replay(chunk)
                continue
            last = micro == len(micro_batches) - 1  # DDP all-reduces the gradients on the last micro-batch only
            with contextlib.nullcontext() if last or not processes.distributed else self.trained.no_sync():
                loss_sum += self.forward_backward(chunk, len(micro_batches))
        self.adamw.step()
        self.muon.step()
        self.model.zero_grad(set_to_none=self.replay is None)  # a captured backward adds into the same tensors
        # The loss is read only now, so that the host queues the optimizer while the GPU finishes the backward. A
        # non-finite loss has then spoiled the weights, but they are never saved: the last checkpoint stays good.
        loss = processes.all_sum(loss_sum).item() / (len(micro_batches) * processes.world)
        if not math.isfinite(loss):
            raise TrainingError(f"[{self.name}] non-finite loss ({loss}) at step {step + 1}; stopping. The last "
                                f"good checkpoint (if any) is kept at {self.path}")
        return loss, multiplier

    def save(self, step):
        rng = self.processes.gather(rng_state(self.processes.device))  # every rank's, each resumes its own
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            raise TrainingError(f"[{self.name}] non-finite weights at step {step}; stopping. The last good "
                                f"checkpoint (if any) is kept at {self.path}")
        if self.processes.rank == 0:
            save_checkpoint(self.path, dict(run_id=self.run_id, step=step, model=self.model.state_dict(),
                                            adamw=self.adamw.state_dict(), muon=self.muon.state_dict(),
                                            data=self.windows.state_dict(), rng=rng, history=self.history))


def train_recipe(recipe, args, processes, data, run_id):
    """Train one recipe from scratch or from its checkpoint; return its row of the summary table (None if it
    stopped early with --stop-after)."""
    documents, validation, bytes_per_token = data
    training, device, losses = Training(recipe, args, processes, documents, run_id), processes.device, []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.time()
    for step in range(training.start, args.steps):
        tic = time.time()
        loss, multiplier = training.step(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            training.history["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        seconds = time.time() - tic
        if step - training.start >= 3:  # compilation and warm-up stay out of the throughput
            training.history["tokens_per_s"].append(args.batch_tokens / seconds)
        losses.append(loss)
        remaining = (time.time() - began) / (step + 1 - training.start) * (args.steps - step - 1)
        processes.log(f"[{recipe}] step {step + 1:5d}/{args.steps} | loss {loss:.4f} | lr x{multiplier:.2f} | "
                      f"{seconds * 1000:7.1f} ms | {args.batch_tokens / seconds:,.0f} tok/s | "
                      f"eta {remaining / 60:.1f} min")
        record = dict(run_id=run_id, recipe=recipe, step=step + 1, loss=loss, lr_multiplier=multiplier,
                      tokens_per_s=args.batch_tokens / seconds)
        done = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or done:
            bpb = evaluate(training.trained, validation, bytes_per_token, processes, args)
            record["val_bpb"] = training.history["final_bpb"] = bpb
            processes.log(f"[{recipe}] step {step + 1}: validation bpb {bpb:.4f}")
        if processes.rank == 0:
            with open(metrics_path(args.out), "a") as f:
                f.write(json.dumps(record) + "\n")
        stopping = args.stop_after and step + 1 - training.start >= args.stop_after
        if done or (step + 1) % args.checkpoint_every == 0 or stopping:
            training.save(step + 1)
        if stopping and not done:
            processes.log(f"[{recipe}] stopped after {args.stop_after} steps as asked; continue with --resume")
            return None
    if len(losses) >= 20 and min(losses[-5:]) > 0.99 * math.log(GPT2_VOCAB):
        raise TrainingError(f"[{recipe}] the model did not learn (the loss stayed at ln(vocabulary) = "
                            f"{math.log(GPT2_VOCAB):.2f}); lower the learning rates")
    throughput = training.history["tokens_per_s"]
    return dict(recipe=recipe, val_bpb=training.history["final_bpb"], steps=args.steps,
                tokens=args.steps * args.batch_tokens, peak_memory_gb=training.history["peak_memory_gb"],
                tokens_per_s=sum(throughput) / len(throughput) if throughput else float("nan"))


# -----------------------------------------------------------------------------
# The comparison


def summarize(rows, processes, args):
    baseline = next((r["val_bpb"] for r in rows if r["recipe"] == "bf16"), None)
    processes.log(f"\n{'recipe':<10}{'val bpb':>10}{'gap to bf16':>13}{'tokens/s':>12}{'peak memory':>13}")
    for r in rows:
        r["gap_pct"] = 100 * (r["val_bpb"] / baseline - 1) if baseline and r["val_bpb"] else None
        gap = f"{r['gap_pct']:+.2f}%" if r["gap_pct"] is not None else "-"
        memory = f"{r['peak_memory_gb']:.1f} GB" if r["peak_memory_gb"] is not None else "-"
        processes.log(f"{r['recipe']:<10}{r['val_bpb']:>10.4f}{gap:>13}{r['tokens_per_s']:>12,.0f}{memory:>13}")
    device = processes.device
    summary = dict(rows=rows, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   world_size=processes.world, date=time.strftime("%Y-%m-%d"), args=vars(args),
                   emulated_nvfp4=not native_fp4_available(device))
    write_atomically(os.path.join(args.out, "summary.json"), lambda name: json.dump(summary, open(name, "w"), indent=1))
    plot(args.out)


def pyplot():
    """matplotlib.pyplot drawing to files (no display), or None if matplotlib is not installed (it is optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(out):
    """Loss and validation curves per recipe to OUT/loss.png, if matplotlib is installed."""
    plt = pyplot()
    if plt is None:
        return
    records = read_metrics(out)
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


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a one-line error pointing at --help, not argparse's usage block
        sys.exit(f"train.py: error: {message} (see python train.py --help)")


def parse_args(argv=None):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--recipe", default="bf16,quartet2", help=f"comma-separated recipes to train, from {','.join(RECIPES)}")
    add("--preset", choices=list(PRESETS), help="defaults for a model size (default: d12 on a GPU)")
    add("--depth", type=int, help="transformer depth; width = 64 * depth")
    add("--seq-len", type=int, help="tokens per training window")
    add("--device-batch", type=int, help="windows per micro-batch on each device (default: the preset's, halved "
                                         "until it fits the GPU)")
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
    add("--cuda-graph", action=argparse.BooleanOptionalAction,
        help="capture each micro-batch's forward + backward in a CUDA graph and replay it, so the host only launches "
             "the graph (default: on one GPU with --compile)")
    add("--device", default="auto", help="cuda, cuda:N or cpu (default: the GPU if there is one)")
    add("--seed", type=int, default=0, help="seed of the weights, the data order and the quantization randomness")
    add("--deterministic", action="store_true",
        help="make a GPU run repeat bit for bit (torch.use_deterministic_algorithms; 5-7%% fewer tokens/s at d12 "
             "on an H200): without it, the compiled embedding backward adds its gradients with atomic additions, "
             "whose order varies between runs")
    add("--out", default="runs/latest", help="output directory (run.json, checkpoints, metrics, summary, plot)")
    add("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    add("--resume", action="store_true", help="continue the run in --out from its checkpoints")
    add("--overwrite", action="store_true", help="replace the run in --out with a new one")
    add("--stop-after", type=int, default=0, help="stop after this many steps in this invocation (checkpointed); "
                                                  "continue later with --resume")
    return parser.parse_args(argv)


def resolve(args, processes):
    """Fill the preset's defaults and check every flag before any work, with a one-line error if one cannot work."""
    if args.preset is None:
        if processes.device.type != "cuda":
            raise TrainingError("no GPU found: the default run (preset d12) needs one. Try --preset tiny, which "
                                "finishes in under 3 minutes on a CPU")
        args.preset = "d12"
    args.fit_device_batch = args.device_batch is None and processes.device.type == "cuda"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if processes.device.type == "cuda" else "float32")
    args.compile = processes.device.type == "cuda" if args.compile is None else args.compile
    if args.cuda_graph is None:
        args.cuda_graph = processes.device.type == "cuda" and args.compile and not processes.distributed
    elif args.cuda_graph and (processes.device.type != "cuda" or processes.distributed):
        raise TrainingError("--cuda-graph runs on one GPU (on several, DDP's gradient all-reduce is not captured)")
    try:
        args.recipes = recipe_names(args.recipe)
    except ValueError as error:
        raise TrainingError(str(error)) from None
    numbers = dict(depth=1, seq_len=1, device_batch=1, batch_tokens=1, steps=1, eval_every=1, eval_tokens=1,
                   checkpoint_every=1, warmup_steps=0, stop_after=0, val_docs=0)  # smallest allowed value
    for name, smallest in numbers.items():
        if getattr(args, name) < smallest:
            raise TrainingError(f"--{name.replace('_', '-')} must be at least {smallest}, got {getattr(args, name)}")
    for name in ("lr_matrix", "lr_embedding", "lr_head"):
        if not 0 < getattr(args, name) < math.inf:  # also refuses NaN
            raise TrainingError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if not 0 <= args.warmdown <= 1:
        raise TrainingError(f"--warmdown must be a fraction in [0, 1], got {args.warmdown}")
    problem = micro_batch_problem(args, args.device_batch, processes.world)
    if problem:
        raise TrainingError(problem)
    try:  # the model's own rules (depth, layer sizes), checked on a weightless model
        with torch.device("meta"):
            for recipe in args.recipes:
                GPT(args.depth, recipe, max_seq_len=args.seq_len)
    except ValueError as error:
        raise TrainingError(str(error)) from None
    return args


@contextlib.contextmanager
def deterministic(enabled):
    """With enabled, PyTorch's deterministic algorithms (and cuBLAS's fixed workspace, which they require) inside the
    block, the previous setting after it; torch.empty stays unfilled (filling every new tensor with NaN, as that mode
    does by default, would cost a write per byte)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    had_workspace = "CUBLAS_WORKSPACE_CONFIG" in os.environ
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any GEMM
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
        if not had_workspace:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def main(argv=None):
    args = parse_args(argv)
    with deterministic(args.deterministic):
        return run_recipes(args)


def run_recipes(args):
    release = None
    try:
        processes = Processes(args.device)
        args = resolve(args, processes)
        if processes.rank == 0:  # the one process that writes to OUT
            release = lock(args.out)
        tokenizer = gpt2_tokenizer()
        documents, validation = data_sources(args, tokenizer)
        data = (documents, validation_windows(validation, args.seq_len, args.eval_tokens // args.seq_len,
                                              args.device_batch * processes.world), token_bytes(tokenizer))
        run_id = open_run(args, processes)
        processes.log(f"device {processes.device} x {processes.world}, preset {args.preset}: depth {args.depth}, "
                      f"seq_len {args.seq_len}, {args.batch_tokens:,} tokens/step, {args.steps} steps, recipes "
                      f"{args.recipes}, run {run_id[:8]} in {args.out}")
        rows = []
        for recipe in args.recipes:
            row = train_recipe(recipe, args, processes, data, run_id)
            if row is None:  # --stop-after
                return
            rows.append(row)
        summarize(rows, processes, args)
    except TrainingError as error:
        sys.exit(f"train.py: error: {error}")
    finally:
        if release:
            release()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
