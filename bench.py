"""
Measurements. Each table and figure of the README's Results comes from one of these commands:

    python bench.py quant        # quantizer error (the paper's Table 1) and unbiasedness (CPU or GPU)
    python bench.py grad         # gradient concentration of a layer's backward per recipe (the paper's Figure 9)
    python bench.py study        # train.py for recipes x seeds: the gaps to BF16, paired (the paper's Table 5)
    python bench.py train        # tokens/s and peak memory of a training step per recipe, against compiled BF16 (GPU)
    python bench.py linear       # forward + backward of one linear layer per recipe, as a ratio to BF16 (GPU)
    python bench.py kernels      # each Triton kernel's time and bandwidth, against the device's copy bandwidth (GPU)
    python bench.py fingerprint  # which files of results/ were measured on other numerics than today's

Each prints a table; --json PATH also writes it as a results file, one shape for all: the command, its provenance
(date, commit, device, versions), the fingerprint of the numerics that made it, and the rows. GPU times are medians
after warm-up, with --cuda-graph (always for kernels) of graph replays, as train.py runs them.

Quantizer error is ||x - q(x)||^2 / ||x||^2 on N(0, 1) data. Unbiasedness shows as concentration: the mean of B
independent quantizations (or backward passes) of the same input has error variance / B + bias^2, so for an unbiased
quantizer B * error(mean of B) stays flat, while for a biased one it grows like B once the bias dominates.

A claim that one recipe trains better than another needs seeds: each seed trains every recipe from the same weights
on the same data, so the difference of two recipes' final bpb is taken per seed (paired), and its mean gets a 95%
interval from Student's t over seeds. A difference is resolved when the interval excludes zero.
"""

import argparse
import ast
import concurrent.futures
import functools
import hashlib
import io
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time
import tokenize

import numpy as np
import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter (the fingerprint draws with them)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton

import kernels
import model
import train
from eden import concentration, ms_eden_estimate, random_signs
from model import GPT, RECIPES, Linear, RecipeLinear, make_optimizers, recipe_names
from quantize import E2M1_MAX, SR_FP4_MAX, NVFP4Tensor, default_fp8_max, quantize_nvfp4, relative_error

ROOT = os.path.dirname(os.path.abspath(__file__))


def rtn_or_sr(**options):
    return lambda x, generator: quantize_nvfp4(x, generator=generator, **options).dequantize()


QUANTIZERS = {  # name -> (estimate of x, the paper's Table 1 relative error x 1e-3)
    "RTN 1x16": (rtn_or_sr(), 9.0),
    "RTN 1x16 + 4/6": (rtn_or_sr(four_over_six=True), 7.6),
    "RTN 16x16": (rtn_or_sr(block="16x16"), 12.4),
    "SR (fp4_max 6*16/17)": (rtn_or_sr(rounding="sr", fp4_max=SR_FP4_MAX), 23.5),
    "SR + 4/6": (rtn_or_sr(rounding="sr", fp4_max=SR_FP4_MAX, four_over_six=True), 17.5),
    "MS-EDEN": (ms_eden_estimate, 9.4),
}


def bench_quant(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(args.seed)
    x = torch.randn(args.size, args.size, generator=generator, device=device)
    small = torch.randn(64, 1024, generator=generator, device=device)
    print(f"relative error ||x-q(x)||^2/||x||^2 on a {args.size}x{args.size} N(0,1) tensor ({device}); concentration"
          f" = B * error(mean of B={args.batches}) / error(one), on 64x1024: ~1 unbiased, ~B biased")
    print(f"{'quantizer':<22}{'ours e-3':>10}{'paper e-3':>11}{'diff':>8}{'concentration':>15}{'unbiased':>10}")
    rows = []
    for name, (quantizer, paper) in QUANTIZERS.items():
        ours = relative_error(quantizer(x, generator), x) * 1e3
        errors = concentration(quantizer, small, [1, args.batches], generator)
        growth = errors[args.batches] * args.batches / errors[1]
        rows.append(dict(quantizer=name, error_e3=ours, paper_e3=paper, diff_pct=100 * (ours / paper - 1),
                         concentration=growth, unbiased=bool(growth < 2)))
        print(f"{name:<22}{ours:>10.2f}{paper:>11.1f}{rows[-1]['diff_pct']:>7.1f}%{growth:>15.2f}"
              f"{'yes' if growth < 2 else 'no':>10}")
    return rows


# -----------------------------------------------------------------------------
# The paper's comparison: gradient concentration (its Figure 9), and a study of recipes x seeds


def captured_layers(args, device):
    """(name, X [T, in], W [out, in], E [T, out]) of block 0's q, k, v projections, from a BF16 forward and backward
    of a d{depth} GPT on the bundled validation text: with a train.py checkpoint's weights, or nanochat's
    initialization but random output projections and lm_head (at zero, no gradient would reach q, k, v)."""
    torch.manual_seed(args.seed)
    gpt = GPT(args.depth, "bf16", max_seq_len=args.seq_len).to(device)
    if args.checkpoint:
        try:
            gpt.load_state_dict(train.load_checkpoint(args.checkpoint)["model"])
        except RuntimeError:  # the tensors' shapes differ
            raise ValueError(f"{args.checkpoint} holds another model size than --depth {args.depth} --seq-len "
                             f"{args.seq_len}: pass the run's") from None
    else:
        with torch.no_grad():
            for module in [gpt.lm_head] + [m for block in gpt.blocks for m in (block.attn.c_proj, block.mlp.c_proj)]:
                module.weight.normal_(0, module.weight.shape[1] ** -0.5)
    documents = train.tokenize(train.gpt2_tokenizer(), train.local_texts("val"))
    tokens = train.validation_windows(documents, args.seq_len, args.tokens // args.seq_len).to(device)
    layers, captured = {name: getattr(gpt.blocks[0].attn, name) for name in ("c_q", "c_k", "c_v")}, {}

    def capture(layer, inputs, output):  # X now, E when the backward reaches the layer
        captured[layer] = [inputs[0].detach().flatten(0, 1)]
        output.register_hook(lambda grad: captured[layer].append(grad.flatten(0, 1)))
    for layer in layers.values():
        layer.register_forward_hook(capture)
    gpt(tokens[:, :-1], tokens[:, 1:]).backward()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # a GPU's kernels take BF16, as under autocast
    return [(name, *(t.to(dtype) for t in (captured[layer][0], layer.weight.detach(), captured[layer][1])))
            for name, layer in layers.items()]


def forward_operand(t, q):
    """An operand as a recipe's forward multiplies it, from the reference quantizer, in FP64 (t if q is None)."""
    return t.double() if q is None else quantize_nvfp4(t, q.rounding, q.four_over_six, q.block).dequantize().double()


def exact_gradients(recipe, x, w, e):
    """(dX, dW) that the recipe's backward estimates, in FP64: the exact gradients of its quantized forward, E W_q and
    E^T X_q, except that a weight gradient from the unquantized X (the NVIDIA recipes') estimates E^T X."""
    x_operand = forward_operand(x, None if recipe.x_dw_bf16 else recipe.x)
    return e.double() @ forward_operand(w, recipe.w), e.double().t() @ x_operand


def bench_grad(args):
    """Error of the mean of B = 1, 2, 4, ... backward passes: falls like 1/B if unbiased, levels off at a bias."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [2**i for i in range(int(math.log2(args.batches)) + 1)]
    print(f"relative error of the mean of B backward passes, block 0 of a d{args.depth} GPT, {args.tokens} tokens "
          f"({device}); growth = B_max * error(B_max) / error(1): ~1 unbiased, larger biased")
    print(f"{'recipe':<24}{'layer':>6}{'gradient':>10}{'error(1)':>11}{f'error({batches[-1]})':>12}{'growth':>9}")
    rows = []
    for name, x, w, e in captured_layers(args, device):
        for recipe in args.recipes:
            torch.manual_seed(args.seed)
            exact = exact_gradients(RECIPES[recipe], x, w, e)
            sums, errors = [torch.zeros_like(g) for g in exact], {}
            for b in range(1, batches[-1] + 1):
                xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
                RecipeLinear.apply(xr, wr, recipe).backward(e)
                for total, grad in zip(sums, (xr.grad, wr.grad)):
                    total += grad.double()
                if b in batches:
                    errors[b] = [relative_error(total / b, g) for total, g in zip(sums, exact)]
            r = RECIPES[recipe]  # a gradient no backward quantizer draws for is exact up to its GEMM's rounding (~1e-6
            quantized = dict(dX=r.e_dx or r.w_dx, dW=r.e_dw or r.x_dw)  # in BF16 on a GPU): no growth to measure
            for index, gradient in enumerate(("dX", "dW")):
                curve = [errors[b][index] for b in batches]
                growth = curve[-1] * batches[-1] / curve[0] if quantized[gradient] and curve[0] > 0 else None
                rows.append(dict(recipe=recipe, layer=name, gradient=gradient, batches=batches, errors=curve,
                                 growth=growth))
                print(f"{recipe:<24}{name:>6}{gradient:>10}{curve[0]:>11.2e}{curve[-1]:>12.2e}"
                      f"{'exact' if growth is None else f'{growth:.2f}':>9}", flush=True)
    if args.png:
        plot_concentration(rows, args.png, args.command_line)
    return rows


def plot_concentration(rows, path, command):
    if (plt := train.pyplot()) is None:
        return
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, gradient in zip(axes, ("dX", "dW")):
        curves = [r for r in rows if r["gradient"] == gradient and r["layer"] == "c_q" and r["growth"] is not None]
        for row, style in zip(curves, ["o-", "s--", "^-", "v:", "D-.", "x-", "*--", "+:"]):
            ax.loglog(row["batches"], row["errors"], style, label=row["recipe"], markersize=5)
        ax.set(title=f"{gradient} of block 0's q projection", xlabel="B (backward passes averaged)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("relative error of the mean of B")
    axes[1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Description": json.dumps(results_head(command))})


def bench_study(args):
    """train.py for every seed, as subprocesses (--parallel at a time on one GPU), then the comparison. The study's
    record (--json, else OUT/study.json) is rewritten after each seed and read back first: a seed it holds, measured
    on the same numerics with the same flags, is not trained again; an unfinished seed resumes from its checkpoints."""
    record = args.json or os.path.join(args.out, "study.json")
    runs = finished_seeds(args, record)
    numerics = fingerprint()  # here, not in the pool's threads: computing it patches model.matmul for a while
    os.makedirs(args.out, exist_ok=True)

    def train_seed(seed):  # -> {recipe: its summary row and samples}
        out = os.path.join(args.out, f"seed{seed}")
        flags = ["--preset", args.preset, "--recipe", ",".join(args.recipes), "--seed", str(seed), "--out", out]
        stamp = pathlib.Path(f"{out}.numerics")  # a seed's run resumes only on the numerics it began with
        if os.path.exists(os.path.join(out, "run.json")):
            flags += ["--resume"] if stamp.exists() and stamp.read_text() == numerics else ["--overwrite"]
        stamp.write_text(numerics)
        print(f"seed {seed}: training, log in {out}.log", flush=True)
        with open(f"{out}.log", "w") as log:
            code = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags, *args.train_flags],
                                  stdout=log, stderr=subprocess.STDOUT).returncode
        last = (pathlib.Path(log.name).read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
        if code:
            raise ValueError(f"seed {seed} failed: {f'killed by signal {-code}' if code < 0 else last} ({log.name})")
        try:
            summary = json.loads(pathlib.Path(out, "summary.json").read_text())
        except (OSError, ValueError):
            raise ValueError(f"seed {seed} wrote no summary.json: {last} ({log.name})") from None
        return {row["recipe"]: row | dict(samples=summary["samples"][row["recipe"]]) for row in summary["rows"]}

    failed = []
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(train_seed, seed): seed for seed in args.seeds if seed not in runs}
        for future in concurrent.futures.as_completed(futures):
            try:
                runs[futures[future]] = future.result()
            except ValueError as error:  # the other seeds go on: the record keeps what they finish
                failed.append(str(error))
            else:
                write_results(record, args.command_line, study_rows(runs, args.recipes))
    if failed:
        raise ValueError(f"{'; '.join(failed)}; the seeds that finished are in {record}: run again to train the rest")
    rows = study_rows(runs, args.recipes)
    print_study(rows, args.preset)
    first = os.path.join(args.out, f"seed{args.seeds[0]}")
    if args.png and os.path.exists(os.path.join(first, "metrics.jsonl")):  # the first seed's loss curves
        train.plot(first, json.dumps(results_head(args.command_line)), args.png)
    return rows


def finished_seeds(args, record):
    """{seed: {recipe: its train.py summary row}} of every seed that the study's record holds, if it was measured on
    these numerics with these flags; else {}. A record that holds recipes not asked for is refused (rewriting it
    would drop them)."""
    if not os.path.exists(record):
        return {}
    try:
        old = json.loads(pathlib.Path(record).read_text())
    except ValueError:
        old = None
    if not (isinstance(old, dict) and str(old.get("command")).startswith("python bench.py study")):
        raise ValueError(f"{record} is not a study's record, and the study would overwrite it: give another --json")
    try:
        old_args = parse_args(shlex.split(old["command"])[2:], check_paths=False)
        by_recipe = {row["recipe"]: row["runs"] for row in old["rows"]}
    except (ValueError, KeyError, TypeError, SystemExit):  # a record of an older shape
        return {}
    same_flags = (old_args.preset, old_args.train_flags) == (args.preset, args.train_flags)
    if old.get("fingerprint") != fingerprint() or not same_flags or not set(args.recipes) <= set(by_recipe):
        return {}
    if extra := set(by_recipe) - set(args.recipes):
        raise ValueError(f"the study's record holds {', '.join(sorted(extra))} too: ask for every recipe it holds, "
                         f"or give another --json")
    seeds = set.intersection(*(set(runs) for runs in by_recipe.values()))
    return {int(seed): {r: dict(recipe=r, **by_recipe[r][seed]) for r in args.recipes} for seed in seeds}


def t_quantile_975(df):
    """Student's t distribution's 97.5% quantile with df degrees of freedom (the half-width of a 95% interval in
    standard errors): where its CDF, integrated by the trapezoid rule, crosses 0.975."""
    t = np.linspace(0, 100, 200_001)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_norm - (df + 1) / 2 * np.log1p(t**2 / df))
    cdf = 0.5 + np.concatenate([[0], np.cumsum((density[1:] + density[:-1]) / 2 * (t[1] - t[0]))])
    return float(np.interp(0.975, cdf, t))


def paired(differences):
    """The mean of per-seed differences, their standard deviation, the 95% interval of the mean (Student's t; with one
    seed only the mean) and whether it excludes zero."""
    n = len(differences)
    mean = sum(differences) / n
    if n < 2:
        return dict(mean=mean, std=None, interval=None, resolved=False)
    std = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return dict(mean=mean, std=std, interval=[mean - half, mean + half], resolved=abs(mean) > half)


PAPER_GAP_REDUCTION_PCT = {"nvidia": 19, "nvidia46": 17, "tetrajet2": 27}  # Quartet II's, the paper's 560M model


def study_rows(runs, recipes):
    """The comparison of {seed: {recipe: summary row}}, one row per recipe: its gap to BF16 in % and, against every
    other recipe, bpb minus the other's, each paired by seed (see paired)."""
    seeds = sorted(runs)
    bpb = {r: [runs[s][r]["val_bpb"] for s in seeds] for r in recipes}
    rows = []
    for recipe in recipes:
        row = dict(recipe=recipe, seeds=seeds, runs={str(s): {k: runs[s][recipe].get(k) for k in (
            "val_bpb", "tokens_per_s", "peak_memory_gb", "samples")} for s in seeds})
        if "bf16" in recipes and recipe != "bf16":
            row["gap_pct"] = paired([100 * (b / base - 1) for b, base in zip(bpb[recipe], bpb["bf16"])])
        row["versus"] = {other: paired([a - b for a, b in zip(bpb[recipe], bpb[other])]) | dict(
            lower_in=sum(a < b for a, b in zip(bpb[recipe], bpb[other]))) for other in recipes if other != recipe}
        rows.append(row)
    gaps = {row["recipe"]: row["gap_pct"]["mean"] for row in rows if "gap_pct" in row}
    for row in rows:
        if row["recipe"] in PAPER_GAP_REDUCTION_PCT and gaps.get(row["recipe"], 0) > 0 and "quartet2" in gaps:
            row["quartet2_gap_reduction_pct"] = 100 * (1 - gaps["quartet2"] / gaps[row["recipe"]])
            row["paper_gap_reduction_pct"] = PAPER_GAP_REDUCTION_PCT[row["recipe"]]
    return rows


def print_study(rows, preset):
    """The table: per recipe its gap to BF16 and, against Quartet II, the paired difference in bpb."""
    seeds, by_recipe = rows[0]["seeds"], {row["recipe"]: row for row in rows}
    print(f"\npreset {preset}, {len(seeds)} seed(s) {seeds}: final validation bpb (mean over seeds), gap to BF16 and "
          f"bpb minus quartet2's per seed (mean [95% interval]; resolved if the interval excludes 0)")
    print(f"{'recipe':<15}{'bpb':>8}{'gap to bf16':>26}{'minus quartet2':>34}{'quartet2 lower in':>19}")
    interval = lambda p, f, unit="": f"{p['mean']:{f}}{unit}" + (f" [{p['interval'][0]:{f}}, {p['interval'][1]:{f}}]"
                                                             if p["interval"] else "")
    for row in rows:
        mean_bpb = sum(run["val_bpb"] for run in row["runs"].values()) / len(seeds)
        gap = interval(row["gap_pct"], "+.2f", "%") if "gap_pct" in row else ""
        versus = row["versus"].get("quartet2")
        difference = interval(versus, "+.4f") + (" resolved" if versus["resolved"] else "") if versus else ""
        lower = f"{by_recipe['quartet2']['versus'][row['recipe']]['lower_in']}/{len(seeds)}" if versus else ""
        print(f"{row['recipe']:<15}{mean_bpb:>8.4f}{gap:>26}{difference:>34}{lower:>19}")


# -----------------------------------------------------------------------------
# Speed on the GPU


def gpu():
    if not torch.cuda.is_available():
        raise ValueError("this measurement needs a CUDA GPU")
    native = kernels.native_fp4_available(torch.device("cuda"))
    print(f"{', '.join(str(v) for v in provenance().values())}; NVFP4 GEMMs "
          f"{'native (cuBLAS)' if native else 'emulated in BF16 (no FP4 tensor cores)'}")
    return torch.device("cuda")


def median_ms(fn, graph=False):
    """ms per call of fn: the median of CUDA-event timings, or (graph) of CUDA-graph replays of back-to-back calls."""
    from triton.testing import do_bench, do_bench_cudagraph
    return do_bench_cudagraph(fn, 100, return_mode="median") if graph else do_bench(fn, 50, 300, return_mode="median")


def training_step(depth, recipe, args, device, accumulation):
    """A training step as train.py runs it, on random tokens: (the median ms of args.calls forward + backward passes
    run back to back, as in training, where the host queues the next while the GPU runs this one; the median ms of
    an optimizer step; the step's peak memory in GB)."""
    torch.manual_seed(0)
    gpt, flags = GPT(depth, recipe, max_seq_len=args.seq_len).to(device), train.parse_args([])  # its learning rates
    optimizers = make_optimizers(gpt, flags.lr_matrix, flags.lr_embedding, flags.lr_head)
    runner = train.compile_model(gpt) if args.compile else gpt
    batch = torch.randint(0, 50257, (args.device_batch, args.seq_len + 1), device=device)

    def forward_backward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            runner(batch[:, :-1], batch[:, 1:]).backward()

    def optimizer_step():
        for optimizer in optimizers:
            optimizer.step()

    for measured in (False, True):  # compiles and warms up, then (--cuda-graph) captures, then a measured step
        for _ in range(accumulation):
            forward_backward()
        optimizer_step()
        gpt.zero_grad(set_to_none=not args.cuda_graph)  # a captured backward adds into the same gradient tensors
        torch.cuda.synchronize()
        if not measured:
            torch.cuda.reset_peak_memory_stats()  # a replay allocates nothing: the capture holds its memory
            forward_backward = train.cuda_graph(forward_backward)[0] if args.cuda_graph else forward_backward
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls + 1)]
    events[0].record()
    for event in events[1:]:
        forward_backward()
        event.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in zip(events, events[1:]))
    return times[len(times) // 2], median_ms(optimizer_step), torch.cuda.max_memory_allocated() / 1e9


def bench_train(args):
    device, tokens, rows = gpu(), args.device_batch * args.seq_len, []
    print(f"training step of train.py's presets: micro-batches of {args.device_batch} x {args.seq_len} tokens, BF16 "
          f"autocast, {'compiled' if args.compile else 'eager'}{', in CUDA graphs' if args.cuda_graph else ''}\n"
          f"{'depth':>5} {'recipe':<10}{'accum':>6}{'fwd+bwd ms':>11}{'optim ms':>9}{'step ms':>9}{'tokens/s':>11}"
          f"{'vs bf16':>8}{'peak GB':>8}")
    for depth in args.depth:
        accumulation = max(1, train.PRESETS.get(f"d{depth}", train.PRESETS["d12"])["batch_tokens"] // tokens)
        for recipe in args.recipes:
            ms_fb, ms_opt, peak_memory = training_step(depth, recipe, args, device, accumulation)
            torch.cuda.empty_cache()
            ms_step = accumulation * ms_fb + ms_opt
            tokens_per_s = accumulation * tokens / (ms_step * 1e-3)
            baseline = next((r["tokens_per_s"] for r in rows if (r["depth"], r["recipe"]) == (depth, "bf16")), None)
            rows.append(dict(depth=depth, recipe=recipe, accumulation=accumulation, forward_backward_ms=ms_fb,
                             optimizer_ms=ms_opt, step_ms=ms_step, tokens_per_s=tokens_per_s,
                             peak_memory_gb=peak_memory, vs_bf16=tokens_per_s / baseline if baseline else None,
                             compiled=args.compile, cuda_graph=args.cuda_graph))
            ratio = f"{rows[-1]['vs_bf16']:.2f}x" if baseline else "-"
            print(f"{depth:>5} {recipe:<10}{accumulation:>6}{ms_fb:>11.1f}{ms_opt:>9.1f}{ms_step:>9.1f}"
                  f"{tokens_per_s:>11,.0f}{ratio:>8}{peak_memory:>8.1f}", flush=True)
    return rows


LINEAR_SHAPES = {
    "800M QKV": (2048, 6144), "800M Out": (2048, 2048), "800M UpGate": (2048, 11264), "800M Down": (5632, 2048),
    "3B QKV": (3072, 9216), "3B Out": (3072, 3072), "3B UpGate": (3072, 16384), "3B Down": (8192, 3072),
    "d12 fc": (768, 3072), "d12 proj": (3072, 768), "d20 fc": (1280, 5120), "d20 proj": (5120, 1280),
}


def bench_linear(args):
    device = gpu()
    print(f"forward + backward of {args.tokens} tokens, {'compiled' if args.compile else 'eager'}"
          f"{', captured in a CUDA graph' if args.cuda_graph else ''}\n{'layer':<13}{'in->out':>13}{'bf16 ms':>9}"
          f"{'quartet2':>10}{'nvidia':>9}   peak extra memory GB (bf16 / quartet2 / nvidia)")
    rows = []
    for name, (d_in, d_out) in LINEAR_SHAPES.items():
        if args.only and not any(word in name for word in args.only):
            continue
        x = torch.randn(args.tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.tokens, d_out, device=device, dtype=torch.bfloat16)
        row = dict(layer=name, d_in=d_in, d_out=d_out, tokens=args.tokens, compiled=args.compile,
                   cuda_graph=args.cuda_graph)
        reference = torch.nn.Linear(d_in, d_out, bias=False, device=device, dtype=torch.bfloat16)
        for recipe in ("bf16", "quartet2", "nvidia"):
            layer = reference if recipe == "bf16" else Linear(d_in, d_out, recipe).to(device)
            layer.weight.data.copy_(reference.weight.float())
            runner = train.compile_model(layer) if args.compile else layer

            def step():
                layer.weight.grad = x.grad = None
                runner(x).backward(grad)
            step()  # compiles, warms up
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row[f"{recipe}_memory_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
            row[f"{recipe}_ms"] = median_ms(train.cuda_graph(step)[0] if args.cuda_graph else step)
        row |= {f"{recipe}_ratio": row[f"{recipe}_ms"] / row["bf16_ms"] for recipe in ("quartet2", "nvidia")}
        rows.append(row)
        print(f"{name:<13}{f'{d_in}->{d_out}':>13}{row['bf16_ms']:>9.3f}{row['quartet2_ratio']:>9.2f}x"
              f"{row['nvidia_ratio']:>8.2f}x   {row['bf16_memory_gb']:.2f} / {row['quartet2_memory_gb']:.2f}"
              f" / {row['nvidia_memory_gb']:.2f}")
        torch.cuda.empty_cache()
    return rows


def bench_kernels(args):
    device = gpu()
    rows, cols = args.rows, args.cols
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    signs128, signs16 = random_signs(128, device=device), random_signs(16, device=device)
    saved = kernels.triton_quantize(x, four_over_six=True, gemm_operand=False)
    phase1 = kernels.eden_phase1(x, signs128)
    source, target = x.flatten(), torch.empty(rows * cols, device=device, dtype=torch.bfloat16)
    copy = 4 * rows * cols / (median_ms(lambda: target.copy_(source), graph=True) * 1e-3)  # read + write, per s
    packed, scales, bf16, fp32_scales = 0.5, 1 / 16, 2.0, 4 / 16  # bytes per element
    rtn = 2 + 2 + packed + scales + bf16  # the amax pass reads x, the quantizer reads it and writes three outputs
    cases = {  # name -> (function, bytes read + written per element)
        "amax (read)": (lambda: kernels.amax(x), 2),
        "RTN 1x16 (amax + quantize)": (lambda: kernels.triton_quantize(x), rtn),
        "RTN 1x16 + 4/6 (amax + quantize)": (lambda: kernels.triton_quantize(x, four_over_six=True), rtn),
        "RTN 16x16 (amax + quantize)": (lambda: kernels.triton_quantize(x, block="16x16"), rtn - scales + scales / 16),
        "SR 1x16 (amax + quantize)": (lambda: kernels.triton_quantize(x, rounding="sr", fp4_max=SR_FP4_MAX), rtn),
        "SR of RHT16(x^T) (amax + quantize)": (lambda: kernels.triton_quantize(
            x, rounding="sr", fp4_max=SR_FP4_MAX, transpose=True, signs=signs16), rtn),
        "MS-EDEN phase 1, x and x^T": (lambda: kernels.eden_phase1(x, signs128), 2 + 2 * (packed + fp32_scales)),
        "MS-EDEN phase 2, one output": (lambda: kernels.eden_phase2(phase1[0]), packed + fp32_scales + scales + bf16),
        "MS-EDEN x and x^T (all)": (lambda: kernels.triton_ms_eden_pair(x, signs128),
                                    2 + 2 * (2 * (packed + fp32_scales) + scales + bf16)),
        "re-quantize phase 1": (lambda: kernels.eden_phase1_requantize(saved, signs128),
                                packed + scales + packed + fp32_scales),
        "re-quantize NVFP4 -> MS-EDEN^T (all)": (lambda: kernels.triton_requantize_ms_eden(saved, signs128),
                                                 packed + scales + 2 * (packed + fp32_scales) + scales + bf16),
        "dequantize to BF16": (lambda: kernels.triton_dequantize(saved, torch.bfloat16), packed + scales + bf16),
    }
    print(f"{rows}x{cols} BF16 input; device copy {copy / 1e12:.2f} TB/s (read + write)")
    print(f"{'kernel':<38}{'ms':>8}{'B/elt':>7}{'TB/s':>7}{'% copy':>8}")
    results = [dict(kernel="copy (read + write)", shape=[rows, cols], ms=4 * rows * cols / copy * 1e3,
                    bytes_per_element=4, tb_per_s=copy / 1e12, fraction_of_copy=1.0)]
    for name, (fn, bytes_per_element) in cases.items():
        ms = median_ms(fn, graph=True)
        bandwidth = bytes_per_element * rows * cols / (ms * 1e-3)
        results.append(dict(kernel=name, shape=[rows, cols], ms=ms, bytes_per_element=bytes_per_element,
                            tb_per_s=bandwidth / 1e12, fraction_of_copy=bandwidth / copy))
        print(f"{name:<38}{ms:>8.3f}{bytes_per_element:>7.2f}{bandwidth / 1e12:>7.2f}{100 * bandwidth / copy:>7.0f}%")
    return results


# -----------------------------------------------------------------------------
# Results: one shape for every file in results/, and a fingerprint of the numerics that made it

def provenance():
    """Where a measurement comes from: date, commit ("+ uncommitted changes" if the code differs from it; "no git
    checkout" if this directory is not the root of one), device and versions."""
    def git(*words):  # "" without git
        try:
            return subprocess.run(["git", *words], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        except OSError:
            return ""
    if os.path.realpath(git("rev-parse", "--show-toplevel") or "/") != os.path.realpath(ROOT):
        commit = "no git checkout"
    else:  # results/, dev/ and the README are not code: rewriting a result does not make the next one dirty
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results", ":!dev", ":!README.md")
        dirty += git("ls-files", "--others", "--exclude-standard", "--", "*.py")  # new code not yet committed
        commit = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")
    return dict(date=time.strftime("%Y-%m-%d"), commit=commit,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)


def results_head(command, fingerprint_of=None):
    """What a results file holds besides its rows, and a figure in its PNG metadata: the command that made it, its
    provenance and the fingerprint of what produced it (the numerics, unless given)."""
    return dict(command=command, provenance=provenance(), fingerprint=fingerprint_of or fingerprint())


def write_results(path, command, rows, fingerprint_of=None):
    data = results_head(command, fingerprint_of) | dict(rows=rows)
    train.write_atomically(path, json.dumps(data, indent=1).encode())


def grid_values(shape, generator, step, largest):
    """BF16-exact values: multiples of step below `largest`, which the first element takes. On such inputs every
    sum a quantizer makes (a rotation's, a group's) is exact in any order, so its output is the same on any CPU."""
    values = torch.randint(-int(largest / step) + 1, int(largest / step), shape, generator=generator) * step
    values.view(-1)[0] = largest
    return values.bfloat16()


@functools.cache
def fingerprint():
    """A hash of everything that decides the numbers in results/: every recipe's GEMM operands in a linear layer's
    forward and backward on grid inputs, the kernels' random draws for a fixed seed, a small GPT's losses, gradient
    norms and bits per byte over two training steps, the presets, default flags, schedule, data order and data files.
    All are exact or rounded to 3 digits, and computed on the CPU, so that every machine and torch version agrees (a
    GPU machine asks a CPU-only process: its kernels may order a sum otherwise than Triton's interpreter)."""
    if torch.cuda.is_available():
        return subprocess.run([sys.executable, "-c", "import bench; print(bench.fingerprint())"], cwd=ROOT, check=True,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                              text=True).stdout.splitlines()[-1]
    digest, generator = hashlib.sha256(), torch.Generator().manual_seed(0)

    def add(*items):  # a tensor's bytes, anything else's repr
        for item in items:
            is_tensor = isinstance(item, torch.Tensor)
            digest.update(item.reshape(-1).view(torch.uint8).numpy().tobytes() if is_tensor else repr(item).encode())

    def record(a, b, dtype):  # model.matmul with its operands hashed
        for t in (a, b):
            if isinstance(t, NVFP4Tensor):
                add(t.codes, t.group_scale.view(torch.uint8), f"{t.tensor_scale.item():.3g}")
            else:
                add(t.float())
        return matmul(a, b, dtype)
    matmul, model.matmul = model.matmul, record
    try:
        for name, recipe in RECIPES.items():  # tensor scales 2^-10: the re-quantized operands are exact too
            largest = lambda q: (default_fp8_max(q.four_over_six) * E2M1_MAX if q else 2688) / 1024
            x = grid_values((128, 128), generator, 1 / 16, largest(recipe.x)).requires_grad_()
            w = grid_values((256, 128), generator, 1 / 16, largest(recipe.w)).requires_grad_()
            torch.manual_seed(0)
            RecipeLinear.apply(x, w, name).backward(grid_values((128, 256), generator, 1 / 8, 2.0))
    finally:
        model.matmul = matmul
    x, seed = grid_values((32, 128), generator, 1 / 16, 2.0), torch.tensor([1234])  # in Triton's interpreter
    signs = torch.ones(128).index_fill_(0, torch.arange(0, 128, 3), -1)
    for t, options in ((x, {}), (x, dict(four_over_six=True)), (x.t(), dict(transpose=True, signs=signs[:16])),
                       (x, dict(signs=signs[:32]))):
        q = kernels.triton_quantize(t, "sr", fp4_max=SR_FP4_MAX, seed=seed, **options)
        add(q.codes, q.group_scale.view(torch.uint8), q.tensor_scale)
    corrected = torch.rand(32, 8, generator=generator) * 4  # MS-EDEN phase one's output, made up
    codes = torch.randint(0, 256, (32, 64), generator=generator, dtype=torch.uint8)
    amax = corrected.max().view(torch.int32).reshape(1)
    q = kernels.eden_phase2((codes, corrected, amax), seed=seed)
    add(q.group_scale.view(torch.uint8), q.tensor_scale)
    torch.manual_seed(0)
    gpt, tokens = GPT(2, max_seq_len=64), torch.randint(0, 50257, (2, 65), generator=generator)
    flags = train.parse_args([])
    optimizers = make_optimizers(gpt, flags.lr_matrix, flags.lr_embedding, flags.lr_head)
    for _ in range(2):
        loss = gpt(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        add(f"{loss.item():.3g}", [f"{p.grad.norm().item():.3g}" for p in gpt.parameters()])
        for optimizer in optimizers:
            optimizer.step()
        gpt.zero_grad()
    flags.dtype, flags.device_batch = "float32", 1  # train.py's evaluation: its bits per byte, to 3 digits
    add(f"{train.evaluate(gpt, tokens, train.token_bytes(train.gpt2_tokenizer()), train.Processes('cpu'), flags):.3g}")
    order = train.shuffled_epochs(list(range(100)), 0)
    add(train.PRESETS, {k: v for k, v in vars(flags).items() if k in train.RUN_FLAGS}, list(order(1, 0)),
        [train.lr_multiplier(step, 100, 10, 0.2) for step in range(100)])
    for name in sorted(n for n in os.listdir(train.DATA_DIR) if n.endswith((".gz", ".tiktoken"))):  # what train reads
        add(name, pathlib.Path(train.DATA_DIR, name).read_bytes())
    return "numerics " + digest.hexdigest()[:16]


def source_fingerprint(path=os.path.join(ROOT, "kernels.py")):
    """A hash of a source file's code without its comments, docstrings and blank lines: what compiled builds depend on.
    It hashes text, not the syntax tree, whose printed form changes between Python versions."""
    source = pathlib.Path(path).read_text()
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            lines[row - 1] = lines[row - 1][:column]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                            ast.Constant):
            lines[body[0].lineno - 1:body[0].end_lineno] = [""] * (body[0].end_lineno - body[0].lineno + 1)
    code = "\n".join(line.rstrip() for line in lines if line.strip())
    return "kernels.py " + hashlib.sha256(code.encode()).hexdigest()[:16]


def png_description(path):
    """The "Description" text of a PNG file's metadata, or None."""
    from PIL import Image  # matplotlib's own dependency, which writes it
    with Image.open(path) as image:
        return image.text.get("Description")


RESULT_KEYS = ["command", "provenance", "fingerprint", "rows"]
PROVENANCE_KEYS = ["date", "commit", "device", "torch", "triton", "cuda"]


def has_the_one_shape(data, png):
    """Whether a results file's data holds its keys in order, the provenance's too, a fingerprint and rows (a PNG's
    rows are its picture)."""
    if not isinstance(data, dict) or list(data) != RESULT_KEYS[:3 if png else 4]:
        return False
    rows = [{}] if png else data["rows"]
    return isinstance(data["provenance"], dict) and list(data["provenance"]) == PROVENANCE_KEYS and isinstance(
        data["fingerprint"], str) and isinstance(rows, list) and rows != [] and all(isinstance(r, dict) for r in rows)


def stale_results(directory=os.path.join(ROOT, "results")):
    """The files of results/ that do not have the one shape, or whose fingerprint is not the current code's, each
    with the reason."""
    stale = []
    for name in sorted(os.listdir(directory)):
        path, png = os.path.join(directory, name), name.endswith(".png")
        try:
            data = json.loads(png_description(path) or "null") if png else json.loads(pathlib.Path(path).read_text())
        except (ValueError, OSError):  # OSError: not an image PIL can read
            stale.append(f"{name}: not a results file (JSON, or a PNG with it in its metadata)")
            continue
        if not has_the_one_shape(data, png):
            stale.append(f"{name}: not a results file of the one shape ({', '.join(RESULT_KEYS)})")
            continue
        expected = source_fingerprint() if data["fingerprint"].startswith("kernels.py") else fingerprint()
        if data["fingerprint"] != expected:
            stale.append(f"{name}: measured on other numerics ({data['fingerprint']}, now {expected}); run again: "
                         f"{data['command']}")
    return stale


def check_results(args):
    stale = stale_results()
    print(f"numerics: {fingerprint()}, builds: {source_fingerprint()}")
    print("\n".join(stale) or "every result in results/ is current")
    if stale:
        sys.exit(1)  # a script can tell


# -----------------------------------------------------------------------------
# Flags


# name -> what it measures, from the docstring's list
COMMANDS = {line.split()[2]: line.partition("# ")[2] for line in __doc__.splitlines()
            if line.startswith("    python bench.py ")}
STUDY_SETS = {"--seed", "--recipe", "--out", "--resume", "--overwrite", "--stop-after", "--preset"}  # of train.py
FLAG_RULES = [  # (the commands, whether their flags break the rule, what to say)
    ("quant", lambda a: a.size % 128 or a.size < 128 or a.batches < 2,
     "--size must be a positive multiple of 128 and --batches at least 2"),
    ("grad", lambda a: a.batches < 2 or a.batches & (a.batches - 1), "--batches must be a power of two, at least 2"),
    ("grad", lambda a: a.seq_len < 1 or a.tokens < 1 or a.tokens % a.seq_len,
     "--seq-len must be positive and --tokens a positive multiple of it"),
    ("quant grad", lambda a: not 0 <= a.seed < 2**31, "--seed must be in [0, 2^31)"),
    ("study", lambda a: "bf16" not in a.recipes, "study compares with bf16: include it"),
    ("study", lambda a: STUDY_SETS & set(a.train_flags), f"study sets {', '.join(sorted(STUDY_SETS))} itself"),
    ("study", lambda a: a.parallel < 1 or len(set(a.seeds)) < len(a.seeds) or not all(0 <= s < 2**31 for s in a.seeds),
     "--parallel must be at least 1, and --seeds distinct, in [0, 2^31)"),
    ("train", lambda a: a.calls < 1, "--calls must be at least 1"),
]


def recipe_list(text):
    try:  # model.recipe_names, its error as argparse's
        return recipe_names(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv=None, check_paths=True):
    """The command and its flags, each checked before any work: one line per bad one (the output paths too, unless
    check_paths is False)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    flag = {name: subparsers.add_parser(name, help=text).add_argument for name, text in COMMANDS.items()}
    quant, grad, study, training, linear, kernel = (flag[name] for name in ("quant", "grad", "study", "train",
                                                                             "linear", "kernels"))
    gpu_there = torch.cuda.is_available()  # on a CPU grad's smaller model and fewer tokens keep it to ~10 minutes
    grad("--recipes", type=recipe_list, default="quartet2,quartet2_no46,nvidia,tetrajet2,bwd_e_sr,bwd_e_sr46")
    study("--recipes", type=recipe_list, default="bf16,quartet2,quartet2_no46,nvidia,nvidia46,tetrajet2")
    training("--recipes", type=recipe_list, default="bf16,quartet2,nvidia")
    quant("--size", type=int, default=4096, help="the test tensor is size x size")
    quant("--batches", type=int, default=64, help="B for the concentration check")
    grad("--batches", type=int, default=1024 if gpu_there else 256, help="the largest B")
    grad("--depth", type=int, default=12 if gpu_there else 4)
    grad("--tokens", type=int, default=4096 if gpu_there else 1024, help="tokens of the captured inputs")
    grad("--seq-len", type=int, default=512)
    grad("--checkpoint", help="a train.py checkpoint to take the weights from (default: initialized)")
    study("--seeds", type=int, nargs="+", default=list(range(8)))
    study("--preset", default="small")
    study("--parallel", type=int, default=1, help="seeds trained at once (on one GPU: each takes its memory; "
          "their tokens/s mean less)")
    study("--out", default="runs/study", help="one train.py run directory per seed below it")
    study("train_flags", nargs="*", help="more train.py flags, after --")
    training("--depth", type=int, nargs="+", default=[12, 20])
    training("--seq-len", type=int, default=2048)
    training("--device-batch", type=int, default=16)
    training("--calls", type=int, default=20, help="forward + backward passes timed per recipe")
    linear("--tokens", type=int, default=32768)
    linear("--only", nargs="*", help="layer names containing these words (e.g. 3B d20)")
    kernel("--rows", type=int, default=16384)
    kernel("--cols", type=int, default=4096)
    for add in (quant, grad):
        add("--seed", type=int, default=0)
    for add in (training, linear):
        add("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile as train.py does")
        add("--cuda-graph", action="store_true", help="time replays of each forward + backward in a CUDA graph")
    for add in (quant, grad, study, training, linear, kernel):
        add("--json", metavar="PATH", help="write the rows as a results file (command, provenance, fingerprint)")
    for add in (grad, study):
        add("--png", help="the figure (grad: the concentration curves; study: the first seed's loss curves)")
    args = parser.parse_args(argv)
    args.command_line = f"python bench.py {shlex.join(sys.argv[1:] if argv is None else argv)}"
    for commands, broken, message in FLAG_RULES:
        if args.command in commands.split() and broken(args):
            parser.error(message)
    for path, ending in ((getattr(args, "json", None), ".json"), (getattr(args, "png", None), ".png")):
        folder = os.path.dirname(os.path.abspath(path or "."))
        if check_paths and path and (os.path.isdir(path) or not path.endswith(ending) or not os.path.isdir(folder)
                                     or not os.access(folder, os.W_OK)):  # before hours of work
            parser.error(f"cannot write {path}: a {ending} path in a writable directory is needed")
    return args


def main(argv=None):
    args = parse_args(argv)
    run = dict(quant=bench_quant, grad=bench_grad, study=bench_study, train=bench_train, linear=bench_linear,
               kernels=bench_kernels, fingerprint=check_results)[args.command]
    try:
        rows = run(args)
        if getattr(args, "json", None):
            write_results(args.json, args.command_line, rows)
    except (ValueError, OSError, train.TrainingError) as error:  # bad flags or files: one line, no traceback
        sys.exit(f"bench.py: error: {error}")
    except (MemoryError, RuntimeError) as error:  # the GPU's, Python's or the CPU allocator's out-of-memory
        if (reason := train.out_of_memory(error)) is None:
            raise
        sys.exit(f"bench.py: error: out of memory ({reason}); lower the sizes `bench.py {args.command} --help` lists")
    return rows


if __name__ == "__main__":
    main()
