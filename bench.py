"""
Measurements. Every number in the README comes from one of these commands:

    python bench.py quant    # quantizer error table (paper Table 1) and unbiasedness, CPU or GPU

Each prints a short table; --json PATH writes the same rows as JSON.

Quantizer error is ||x - q(x)||^2 / ||x||^2 on an N(0,1) tensor. Unbiasedness shows as concentration: the mean of B
independent quantizations of the same tensor has error variance/B + bias^2, so for an unbiased quantizer
B * error(mean of B) stays flat, while for a biased one it grows like B once the bias dominates.
"""

import argparse
import json
import sys

import torch

from eden import inverse_rht, quantize_ms_eden, random_signs
from quantize import quantize_nvfp4

SR_FP4_MAX = 6 * 16 / 17


def _nvfp4(**options):
    return lambda x, generator: quantize_nvfp4(x, generator=generator, **options).dequantize()


def _ms_eden(x, generator):
    signs = random_signs(generator=generator)
    return inverse_rht(quantize_ms_eden(x, signs, generator).dequantize(), signs)


# name -> (estimate of x, paper Table 1 relative error x 1e-3)
QUANTIZERS = {
    "RTN 1x16": (_nvfp4(), 9.0),
    "RTN 1x16 + 4/6": (_nvfp4(four_over_six=True), 7.6),
    "RTN 16x16": (_nvfp4(block="16x16"), 12.4),
    "SR (fp4_max 6*16/17)": (_nvfp4(rounding="sr", fp4_max=SR_FP4_MAX), 23.5),
    "SR + 4/6": (_nvfp4(rounding="sr", fp4_max=SR_FP4_MAX, four_over_six=True), 17.5),
    "MS-EDEN": (_ms_eden, 9.4),
}


def relative_error(estimate, x):
    return ((estimate.double() - x.double()).square().sum() / x.double().square().sum()).item()


def concentration(quantizer, x, batch_sizes, generator):
    """Relative error of the mean of B independent quantizations of x, for each B in batch_sizes (increasing)."""
    errors, total, done = {}, torch.zeros_like(x, dtype=torch.float64), 0
    for b in batch_sizes:
        while done < b:
            total += quantizer(x, generator)
            done += 1
        errors[b] = relative_error(total / b, x)
    return errors


def bench_quant(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(args.seed)
    x = torch.randn(args.size, args.size, generator=generator, device=device)
    small = torch.randn(64, 1024, generator=generator, device=device)
    rows = []
    for name, (quantizer, paper) in QUANTIZERS.items():
        ours = relative_error(quantizer(x, generator), x) * 1e3
        errors = concentration(quantizer, small, [1, args.batches], generator)
        growth = errors[args.batches] * args.batches / errors[1]  # ~1 if unbiased, ~B if biased
        rows.append(dict(quantizer=name, error_e3=ours, paper_e3=paper, diff_pct=100 * (ours / paper - 1),
                         concentration=growth, unbiased=bool(growth < 2)))
    print(f"Quantizer relative error ||x-q(x)||^2/||x||^2 on a {args.size}x{args.size} N(0,1) tensor ({device});")
    print(f"concentration = B * error(mean of B={args.batches}) / error(one), on 64x1024: ~1 unbiased, ~B biased")
    print(f"{'quantizer':<22}{'ours e-3':>10}{'paper e-3':>11}{'diff':>8}{'concentration':>15}{'unbiased':>10}")
    for r in rows:
        print(f"{r['quantizer']:<22}{r['error_e3']:>10.2f}{r['paper_e3']:>11.1f}{r['diff_pct']:>7.1f}%"
              f"{r['concentration']:>15.2f}{'yes' if r['unbiased'] else 'no':>10}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    quant = commands.add_parser("quant", help="quantizer error (paper Table 1) and unbiasedness")
    quant.add_argument("--size", type=int, default=4096, help="the test tensor is size x size")
    quant.add_argument("--batches", type=int, default=64, help="B for the concentration check")
    quant.add_argument("--seed", type=int, default=0)
    for command in (quant,):
        command.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = {"quant": bench_quant}[args.command](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=args.command, argv=sys.argv[1:], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
