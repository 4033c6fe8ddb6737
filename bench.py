"""
Measurements. Each table and figure of the README's Results comes from one of these commands:

    python bench.py quant    # quantizer error (the paper's Table 1) and unbiasedness (CPU or GPU)
    python bench.py grad     # gradient concentration of a layer's backward per recipe (the paper's Figure 9)
    python bench.py study    # train.py for recipes x seeds: the gaps to BF16 (the paper's Table 5, its ablations)
    python bench.py train    # tokens/s and peak memory of a training step per recipe, against compiled BF16 (GPU)
    python bench.py linear   # forward + backward of one linear layer per recipe, as a ratio to BF16 (GPU)
    python bench.py kernels  # each Triton kernel's time and bandwidth, against the device's copy bandwidth (GPU)

Each prints a table (--json PATH: rows and provenance; before Blackwell it says the NVFP4 GEMMs are emulated). GPU
times are medians after warm-up, with --cuda-graph (always for kernels) of graph replays, as train.py runs them.

Quantizer error is ||x - q(x)||^2 / ||x||^2 on N(0, 1) data. Unbiasedness shows as concentration: the mean of B
independent quantizations (or backward passes) of the same input has error variance / B + bias^2, so for an unbiased
quantizer B * error(mean of B) stays flat, while for a biased one it grows like B once the bias dominates.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton

import kernels
import train
from eden import inverse_rht, quantize_ms_eden, random_signs
from model import GPT, RECIPES, Linear, RecipeLinear, make_optimizers, recipe_names
from quantize import SR_FP4_MAX, quantize_nvfp4


def rtn_or_sr(**options):
    return lambda x, generator: quantize_nvfp4(x, generator=generator, **options).dequantize()


def ms_eden(x, generator):
    signs = random_signs(generator=generator)
    return inverse_rht(quantize_ms_eden(x, signs, generator).dequantize(), signs)


QUANTIZERS = {  # name -> (estimate of x, the paper's Table 1 relative error x 1e-3)
    "RTN 1x16": (rtn_or_sr(), 9.0),
    "RTN 1x16 + 4/6": (rtn_or_sr(four_over_six=True), 7.6),
    "RTN 16x16": (rtn_or_sr(block="16x16"), 12.4),
    "SR (fp4_max 6*16/17)": (rtn_or_sr(rounding="sr", fp4_max=SR_FP4_MAX), 23.5),
    "SR + 4/6": (rtn_or_sr(rounding="sr", fp4_max=SR_FP4_MAX, four_over_six=True), 17.5),
    "MS-EDEN": (ms_eden, 9.4),
}


def relative_error(estimate, x):
    return ((estimate.double() - x.double()).square().sum() / x.double().square().sum()).item()


def concentration(quantizer, x, batch_sizes, generator):
    """Relative error of the mean of B independent quantizations of x, for each B in batch_sizes (increasing)."""
    errors, total = {}, torch.zeros_like(x, dtype=torch.float64)
    for done in range(1, max(batch_sizes) + 1):
        total += quantizer(x, generator)
        if done in batch_sizes:
            errors[done] = relative_error(total / done, x)
    return errors


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
    if args.seq_len < 1 or args.tokens < args.seq_len or args.tokens % args.seq_len:
        raise ValueError(f"--tokens must be a multiple of --seq-len {args.seq_len}, got {args.tokens}")
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
    attention, captured = gpt.blocks[0].attn, {}

    def capture(name):
        def hook(module, inputs, output):  # X now, E when the backward reaches this layer
            captured[name] = [inputs[0].detach().flatten(0, 1)]
            output.register_hook(lambda grad: captured[name].append(grad.flatten(0, 1)))
        return hook
    for name in ("c_q", "c_k", "c_v"):
        getattr(attention, name).register_forward_hook(capture(name))
    gpt(tokens[:, :-1], tokens[:, 1:]).backward()
    return [(name, x, getattr(attention, name).weight.detach(), e) for name, (x, e) in captured.items()]


def forward_operand(t, q):
    """An operand as a recipe's forward multiplies it, from the reference quantizer, in FP64 (t if q is None)."""
    return t.double() if q is None else quantize_nvfp4(t, q.rounding, q.four_over_six, q.block).dequantize().double()


def exact_gradients(recipe, x, w, e):
    """(dX, dW) that the recipe's backward estimates, in FP64: the exact gradients of its quantized forward, E W_q and
    E^T X_q, except that a weight gradient from the unquantized X (the NVIDIA recipes') estimates E^T X."""
    return e.double() @ forward_operand(w, recipe.w), e.double().t() @ forward_operand(x, None if recipe.x_dw_bf16
                                                                                         else recipe.x)


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
            for index, gradient in enumerate(("dX", "dW")):
                curve = [errors[b][index] for b in batches]
                growth = curve[-1] * batches[-1] / curve[0] if curve[0] > 1e-10 else None  # else exact (BF16)
                rows.append(dict(recipe=recipe, layer=name, gradient=gradient, batches=batches, errors=curve,
                                 growth=growth))
                print(f"{recipe:<24}{name:>6}{gradient:>10}{curve[0]:>11.2e}{curve[-1]:>12.2e}"
                      f"{'exact' if growth is None else f'{growth:.2f}':>9}", flush=True)
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
    figure.savefig(path, dpi=120, metadata={"Description": f"{command}; {provenance()}"})


def bench_study(args):
    """train.py for every seed (resuming what an earlier invocation left, if its flags are these), then the table."""
    recipes, runs = args.recipes, {}
    for seed in args.seeds:
        out = os.path.join(args.out, f"seed{seed}")
        flags = ["--preset", args.preset, "--recipe", ",".join(recipes), "--seed", str(seed), "--out", out]
        resume = ["--resume"] if os.path.exists(os.path.join(out, "run.json")) else []
        if train.main(flags + resume + args.train_flags) is not None:
            continue
        runs[seed] = {r["recipe"]: r["val_bpb"] for r in json.load(open(os.path.join(out, "summary.json")))["rows"]}
    return study_rows(runs, recipes, args.preset)


def study_rows(runs, recipes, preset):
    """The comparison of {seed: {recipe: final validation bpb}}: the mean gap to BF16 +- its standard deviation over
    seeds, and how much smaller Quartet II's gap is than each baseline's (recipes that quantize both passes)."""
    gaps = {r: [100 * (bpb[r] / bpb["bf16"] - 1) for bpb in runs.values()] for r in recipes if r != "bf16"}
    mean = {r: sum(g) / len(g) for r, g in gaps.items()}
    std = {r: (sum((x - mean[r]) ** 2 for x in g) / (len(g) - 1)) ** 0.5 for r, g in gaps.items() if len(g) > 1}
    print(f"\npreset {preset}, seeds {list(runs)}: final validation bpb, gap to BF16 (mean +- std over seeds)")
    print(f"{'recipe':<16}" + "".join(f"{f'seed {s}':>10}" for s in runs) + f"{'gap':>18}{'Q-II gap smaller by':>22}")
    rows = []
    for recipe in recipes:
        row = dict(recipe=recipe, bpb={s: runs[s][recipe] for s in runs}, gap_pct=mean.get(recipe),
                   gap_std=std.get(recipe))
        baseline = RECIPES[recipe].x is not None and RECIPES[recipe].e_dx is not None  # quantizes both passes
        if baseline and recipe != "quartet2" and "quartet2" in mean and mean[recipe] > 0:
            row["quartet2_gap_reduction_pct"] = 100 * (1 - mean["quartet2"] / mean[recipe])
        rows.append(row)
        gap = (f"{mean[recipe]:+.2f}%" if recipe in mean else "") + (f" +- {std[recipe]:.2f}%" if recipe in std else "")
        reduction = f"{row['quartet2_gap_reduction_pct']:.0f}%" if "quartet2_gap_reduction_pct" in row else ""
        print(f"{recipe:<16}" + "".join(f"{runs[s][recipe]:>10.4f}" for s in runs) + f"{gap:>18}{reduction:>22}")
    return rows


# -----------------------------------------------------------------------------
# Speed on the GPU


def gpu():
    if not torch.cuda.is_available():
        raise ValueError("this measurement needs a CUDA GPU")
    native = kernels.native_fp4_available(torch.device("cuda"))
    print(f"{provenance()}; NVFP4 GEMMs {'native (cuBLAS)' if native else 'emulated in BF16 (no FP4 tensor cores)'}")
    return torch.device("cuda")


def median_ms(fn, graph=False):
    """ms per call of fn: the median of CUDA-event timings, or (graph) of CUDA-graph replays of back-to-back calls."""
    from triton.testing import do_bench, do_bench_cudagraph
    return do_bench_cudagraph(fn, 100, return_mode="median") if graph else do_bench(fn, 50, 300, return_mode="median")


def training_step(depth, recipe, args, device, accumulation):
    """A training step as train.py runs it, on random tokens: (ms of args.calls forward + backward passes back to back,
    sorted; the host's ms for one; an optimizer step's median ms; the step's peak memory in GB)."""
    torch.manual_seed(0)
    model, flags = GPT(depth, recipe, max_seq_len=args.seq_len).to(device), train.parse_args([])  # its learning rates
    adamw, muon = make_optimizers(model, flags.lr_matrix, flags.lr_embedding, flags.lr_head)
    runner = train.compile_model(model) if args.compile else model
    batch = torch.randint(0, 50257, (args.device_batch, args.seq_len + 1), device=device)

    def forward_backward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            runner(batch[:, :-1], batch[:, 1:]).backward()

    def optimizer_step():
        adamw.step()
        muon.step()

    def whole_step():
        for _ in range(accumulation):
            forward_backward()
        optimizer_step()
        model.zero_grad(set_to_none=not args.cuda_graph)  # a captured backward adds into the same gradient tensors

    whole_step()  # compiles, warms up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if args.cuda_graph:  # captured after the reset: a replay allocates nothing, the capture holds its memory
        forward_backward = train.cuda_graph(forward_backward)[0]  # whole_step now replays it too
    whole_step()
    torch.cuda.synchronize()
    peak_memory = torch.cuda.max_memory_allocated() / 1e9
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls + 1)]
    events[0].record()
    for event in events[1:]:  # as in training: the next call's host work overlaps the GPU's
        forward_backward()
        event.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in zip(events, events[1:]))
    pause, tic = 1.25 * times[-1] / 1e3, time.perf_counter()  # host time: calls spaced so the GPU has caught up
    for _ in range(5):
        forward_backward()
        time.sleep(pause)
    torch.cuda.synchronize()
    ms_host = 1e3 * ((time.perf_counter() - tic) / 5 - pause)
    return times, ms_host, median_ms(optimizer_step), peak_memory


def bench_train(args):
    device = gpu()
    tokens = args.device_batch * args.seq_len
    print(f"training step of train.py's presets: micro-batches of {args.device_batch} x {args.seq_len} tokens, BF16 "
          f"autocast, {'compiled' if args.compile else 'eager'}{', in CUDA graphs' if args.cuda_graph else ''}")
    print(f"{'depth':>5} {'recipe':<10}{'accum':>6}{'fwd+bwd ms':>11}{'range ms':>14}{'host ms':>8}{'optim ms':>9}"
          f"{'step ms':>9}{'tokens/s':>11}{'vs bf16':>8}{'peak GB':>8}")
    rows = []
    for depth in args.depth:
        preset = train.PRESETS.get(f"d{depth}", train.PRESETS["d12"])
        accumulation, baseline = max(1, preset["batch_tokens"] // tokens), None
        for recipe in args.recipes:
            times, ms_host, ms_opt, peak_memory = training_step(depth, recipe, args, device, accumulation)
            ms_fb = times[len(times) // 2]  # the median (the upper one of an even count)
            torch.cuda.empty_cache()
            ms_step = accumulation * ms_fb + ms_opt
            tokens_per_s = accumulation * tokens / (ms_step * 1e-3)
            baseline = tokens_per_s if recipe == "bf16" else baseline  # bf16 comes first by default
            ratio = tokens_per_s / baseline if baseline else None
            rows.append(dict(depth=depth, recipe=recipe, accumulation=accumulation, forward_backward_ms=ms_fb,
                             forward_backward_all_ms=times, host_ms=ms_host, optimizer_ms=ms_opt, step_ms=ms_step,
                             tokens_per_s=tokens_per_s, vs_bf16=ratio, peak_memory_gb=peak_memory,
                             compiled=args.compile, cuda_graph=args.cuda_graph))
            print(f"{depth:>5} {recipe:<10}{accumulation:>6}{ms_fb:>11.1f}{f'{times[0]:.1f}-{times[-1]:.1f}':>14}"
                  f"{ms_host:>8.1f}{ms_opt:>9.1f}{ms_step:>9.1f}{tokens_per_s:>11,.0f}"
                  f"{f'{ratio:.2f}x' if ratio else '-':>8}{peak_memory:>8.1f}", flush=True)
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
    saved = kernels.triton_quantize(x, four_over_six=True, scaled_codes=False)
    phase1 = kernels.eden_phase1(x, signs128)
    source, target = x.flatten(), torch.empty(rows * cols, device=device, dtype=torch.bfloat16)
    copy = 4 * rows * cols / (median_ms(lambda: target.copy_(source), graph=True) * 1e-3)  # read + write, per s
    packed, scales, bf16, fp32_scales = 0.5, 1 / 16, 2.0, 4 / 16  # bytes per element
    rtn = 2 + 2 + packed + scales + bf16  # the amax pass reads x, the quantizer reads it and writes three outputs
    cases = {  # name -> (function, bytes read + written per element)
        "amax (read)": (lambda: kernels._amax(x), 2),
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
    results = []
    for name, (fn, bytes_per_element) in cases.items():
        ms = median_ms(fn, graph=True)
        bandwidth = bytes_per_element * rows * cols / (ms * 1e-3)
        results.append(dict(kernel=name, ms=ms, bytes_per_element=bytes_per_element, tb_per_s=bandwidth / 1e12,
                            fraction_of_copy=bandwidth / copy))
        print(f"{name:<38}{ms:>8.3f}{bytes_per_element:>7.2f}{bandwidth / 1e12:>7.2f}{100 * bandwidth / copy:>7.0f}%")
    return dict(copy_tb_per_s=copy / 1e12, shape=[rows, cols], kernels=results)


# -----------------------------------------------------------------------------
# Flags


def provenance():
    """Where a measurement comes from: date, commit, device, versions."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{time.strftime('%Y-%m-%d')}, commit {commit}, {device}, torch {torch.__version__}, triton " \
           f"{triton.__version__}"


STUDY_SETS = {"--seed", "--recipe", "--out", "--resume", "--overwrite", "--stop-after", "--preset"}  # of train.py


def recipe_list(text):
    try:  # model.recipe_names, its error as argparse's
        return recipe_names(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    command = {name: commands.add_parser(name, help=text) for name, text in (
        ("quant", "quantizer error (paper Table 1) and unbiasedness"), ("grad", "gradient concentration per recipe "
         "(the paper's Figure 9)"), ("study", "train.py for recipes x seeds, and the comparison table (GPU)"),
        ("train", "a training step per recipe (GPU)"), ("linear", "one linear layer, forward + backward, per recipe "
         "(GPU)"), ("kernels", "Triton kernels: time and bandwidth (GPU)"))}
    quant, grad, study, training, linear, kernel = (command[name].add_argument for name in command)
    gpu_there = torch.cuda.is_available()  # on a CPU grad's smaller model and fewer tokens keep it to ~10 minutes
    for add, recipes in ((grad, "quartet2,quartet2_no46,nvidia,tetrajet2,bwd_e_sr,bwd_e_sr46"), (training, "bf16,"
                         "quartet2,nvidia"), (study, "bf16,quartet2,quartet2_no46,nvidia,nvidia46,tetrajet2")):
        add("--recipes", type=recipe_list, default=recipes)
    quant("--size", type=int, default=4096, help="the test tensor is size x size")
    quant("--batches", type=int, default=64, help="B for the concentration check")
    grad("--batches", type=int, default=1024 if gpu_there else 256, help="the largest B")
    grad("--depth", type=int, default=12 if gpu_there else 4)
    grad("--tokens", type=int, default=4096 if gpu_there else 1024, help="tokens of the captured inputs")
    grad("--seq-len", type=int, default=512)
    grad("--checkpoint", help="a train.py checkpoint to take the weights from (default: initialized)")
    grad("--png", default="concentration.png", help="the log-log plot")
    study("--seeds", type=int, nargs="+", default=[0, 1, 2])
    study("--preset", default="small")
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
        add("--json", metavar="PATH", help="also write the rows, with their provenance, as JSON")
    args = parser.parse_args(argv)
    args.command_line = f"python bench.py {' '.join(sys.argv[1:] if argv is None else argv)}"
    command = args.command
    for bad, message in ((command == "train" and args.calls < 1, "--calls must be at least 1"),
                         (command == "study" and "bf16" not in args.recipes, "study compares with bf16: include it"),
                         (command == "study" and STUDY_SETS & set(args.train_flags), f"study sets {STUDY_SETS} itself"),
                         (command == "quant" and (args.size % 128 or args.size < 128 or args.batches < 2),
                          "--size must be a positive multiple of 128 and --batches at least 2"),
                         (command == "grad" and (args.batches < 2 or args.batches & (args.batches - 1)),
                          "--batches must be a power of two, at least 2"),
                         (not 0 <= getattr(args, "seed", 0) < 2**31, "--seed must be in [0, 2^31)")):
        if bad:
            parser.error(message)
    for path, ending in ((args.json, ""), (getattr(args, "png", None), ".png")):  # before hours of work, not after
        if path and (os.path.isdir(path) or not path.endswith(ending) or not os.access(
                os.path.dirname(os.path.abspath(path)), os.W_OK)):
            parser.error(f"cannot write {path}: a {ending or 'file'} path in a writable directory is needed")
    run = dict(quant=bench_quant, grad=bench_grad, study=bench_study, train=bench_train, linear=bench_linear,
               kernels=bench_kernels)[args.command]
    try:
        rows = run(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(command=args.command_line, provenance=provenance(), rows=rows), f, indent=1)
    except (ValueError, OSError, train.TrainingError) as error:  # bad flags or files: one line, no traceback
        sys.exit(f"bench.py: error: {error}")
    except (MemoryError, RuntimeError) as error:  # the GPU's, Python's or the CPU allocator's out-of-memory
        if (reason := train.out_of_memory(error)) is None:
            raise
        sys.exit(f"bench.py: error: out of memory ({reason}); lower the sizes `bench.py {command} --help` lists")
    return rows


if __name__ == "__main__":
    main()
