"""results/: every file has the one shape and was measured on today's numerics (a stale result fails here), and the
statistics that back the README's comparisons."""

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

import bench
import eden


def test_every_result_has_the_one_shape_and_the_current_fingerprint():
    # A change of numerics (a quantizer, a recipe, the model, the presets, the kernels' random draws) changes the
    # fingerprint: every result it affects must be measured again, with the command each file names, before it lands.
    assert bench.stale_results() == []


def test_the_fingerprint_follows_the_numerics():
    def fingerprint_after(change):  # in a CPU-only process, where a GPU machine computes it too
        code = f"import bench, eden; {change}; print(bench.fingerprint())"
        return subprocess.run([sys.executable, "-c", code], cwd=bench.ROOT, check=True, capture_output=True, text=True,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES="")).stdout.splitlines()[-1]
    assert fingerprint_after("pass") == bench.fingerprint()  # computed afresh: the same
    assert fingerprint_after("eden.EDEN_FP4_MAX *= 1.01") != bench.fingerprint()  # MS-EDEN's codes and scales move


def test_a_gpu_machine_computes_the_fingerprint_as_a_cpu_does(monkeypatch):
    # There a CPU-only process computes it: the GPU's kernels may order a sum otherwise than the interpreter.
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    assert bench.fingerprint.__wrapped__() == bench.fingerprint()


def test_the_builds_fingerprint_ignores_comments_and_docstrings(tmp_path):
    def fingerprint_of(source):
        (tmp_path / "k.py").write_text(source)
        return bench.source_fingerprint(str(tmp_path / "k.py"))
    code = 'def f(x):\n    """Doubles."""\n    return 2 * x  # why\n'
    assert fingerprint_of(code) == fingerprint_of(code.replace("  # why", "").replace("Doubles", "Twice x"))
    assert fingerprint_of(code) != fingerprint_of(code.replace("2 * x", "3 * x"))
    # The hash is of the code's text, so every Python version computes the same (a syntax tree's printed form differs)
    expected = "kernels.py " + hashlib.sha256(b"def f(x):\n    return 2 * x").hexdigest()[:16]
    assert fingerprint_of("\n" + code.replace("\n    return", "\n\n    return")) == expected


def test_stale_and_misshapen_results_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "fingerprint", lambda: "numerics 0123")
    bench.write_results(str(tmp_path / "good.json"), "python bench.py quant", [dict(a=1)])
    bench.write_results(str(tmp_path / "old.json"), "python bench.py grad", [dict(a=1)], fingerprint_of="numerics 9999")
    bench.write_results(str(tmp_path / "empty.json"), "python bench.py quant", [])  # no rows: nothing measured
    (tmp_path / "shape.json").write_text(json.dumps(dict(command="x", provenance="2026-12-01", rows=[])))
    (tmp_path / "notes.txt").write_text("a measurement log")
    curves = [dict(recipe="quartet2", layer="c_q", gradient=g, batches=[1, 2], errors=[1.0, 0.5], growth=1.0)
              for g in ("dX", "dW")]
    bench.plot_concentration(curves, str(tmp_path / "figure.png"), "python bench.py grad --png figure.png")
    stale = bench.stale_results(str(tmp_path))
    assert [line.split(":")[0] for line in stale] == ["empty.json", "notes.txt", "old.json", "shape.json"]
    assert "run again: python bench.py grad" in stale[2] and "not a results file of the one shape" in stale[0]
    assert json.loads(bench.png_description(str(tmp_path / "figure.png")))["fingerprint"] == "numerics 0123"


def git(directory, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=directory, check=True,
                   capture_output=True)


def test_provenance_names_the_commit_only_of_this_checkout(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", str(tmp_path))
    assert bench.provenance()["commit"] == "no git checkout"
    git(tmp_path, "init", "-q")
    (tmp_path / "inner").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.json").write_text("{}")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "one")
    monkeypatch.setattr(bench, "ROOT", str(tmp_path / "inner"))  # inside another checkout: not its commit
    assert bench.provenance()["commit"] == "no git checkout"
    monkeypatch.setattr(bench, "ROOT", str(tmp_path))
    commit = bench.provenance()["commit"]
    assert len(commit) >= 7 and "+" not in commit
    (tmp_path / "results" / "a.json").write_text("{\"rows\": []}")  # a rewritten result is not a code change
    assert bench.provenance()["commit"] == commit
    (tmp_path / "code.py").write_text("x = 2\n")
    assert bench.provenance()["commit"] == commit + " + uncommitted changes"
    git(tmp_path, "checkout", "-q", "code.py")
    (tmp_path / "new.py").write_text("y = 1\n")  # new code, not yet committed
    assert bench.provenance()["commit"] == commit + " + uncommitted changes"
    assert list(bench.provenance()) == bench.PROVENANCE_KEYS


def test_a_study_refuses_to_overwrite_another_commands_results(tmp_path):
    path = str(tmp_path / "quant.json")
    bench.write_results(path, "python bench.py quant", [dict(a=1)], fingerprint_of="numerics 0123")
    args = bench.parse_args(["study", "--preset", "tiny", "--seeds", "0", "--json", path, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="not a study"):
        bench.finished_seeds(args, path)


@pytest.mark.parametrize("df,quantile", [(1, 12.706), (2, 4.303), (4, 2.776), (7, 2.365), (9, 2.262), (30, 2.042)])
def test_student_t_quantiles_match_the_tables(df, quantile):
    assert bench.t_quantile_975(df) == pytest.approx(quantile, abs=1e-3)


def test_paired_differences_and_their_interval():
    # mean 2, sample standard deviation sqrt(2/3) over 4 seeds: half-width t(3) * sqrt(2/3) / sqrt(4)
    comparison = bench.paired([1.0, 2.0, 3.0, 2.0])
    assert comparison["mean"] == pytest.approx(2.0) and comparison["std"] == pytest.approx((2 / 3) ** 0.5)
    half = bench.t_quantile_975(3) * (2 / 3) ** 0.5 / 2
    assert comparison["interval"] == pytest.approx([2 - half, 2 + half]) and comparison["resolved"]
    assert not bench.paired([1.0, -1.0, 0.5])["resolved"]  # the interval holds 0
    assert bench.paired([0.3]) == dict(mean=0.3, std=None, interval=None, resolved=False)


def test_the_study_compares_recipes_seed_by_seed():
    # nvidia is 0.002 above quartet2 in every seed while both move together with the seed: paired, resolved.
    runs = {seed: dict(bf16=dict(val_bpb=1.0 + shift), quartet2=dict(val_bpb=1.003 + shift),
                       nvidia=dict(val_bpb=1.005 + shift), fwd_1x16=dict(val_bpb=1.002 + shift))
            for seed, shift in ((0, 0.0), (1, 0.01), (2, -0.02))}
    rows = {row["recipe"]: row for row in bench.study_rows(runs, list(runs[0]))}
    versus = rows["nvidia"]["versus"]["quartet2"]
    assert versus["mean"] == pytest.approx(0.002) and versus["resolved"] and versus["lower_in"] == 0
    assert rows["quartet2"]["versus"]["nvidia"]["lower_in"] == 3
    gaps = [100 * (1.005 + s) / (1.0 + s) - 100 for s in (0.0, 0.01, -0.02)]
    assert rows["nvidia"]["gap_pct"]["mean"] == pytest.approx(sum(gaps) / 3)
    reduction = 100 * (1 - rows["quartet2"]["gap_pct"]["mean"] / rows["nvidia"]["gap_pct"]["mean"])
    assert rows["nvidia"]["quartet2_gap_reduction_pct"] == pytest.approx(reduction)
    assert "quartet2_gap_reduction_pct" not in rows["fwd_1x16"] and "gap_pct" not in rows["bf16"]
    assert rows["nvidia"]["runs"]["1"]["val_bpb"] == pytest.approx(1.015)


def numbers_in(data):
    """Every number in a results file's rows (booleans aside), as floats."""
    if isinstance(data, dict):
        return [v for value in data.values() for v in numbers_in(value)]
    if isinstance(data, list):
        return [v for value in data for v in numbers_in(value)]
    return [float(data)] if isinstance(data, (int, float)) and not isinstance(data, bool) else []


def tables_with_their_files(path):
    """(results file, [table lines]) for each table of a markdown file: the results file that the paragraph just above
    names last, or None."""
    pairs, source, table, previous = [], None, [], ""
    for line in open(path).read().splitlines() + [""]:
        if line.startswith("|") and line.rstrip().endswith("|"):
            table.append(line)
            continue
        if table:
            pairs.append((source, table))
        if line.strip() and not previous.strip():  # a paragraph begins
            source = None
        table, previous = [], line
        source = (re.findall(r"results/[\w.]+\.json", line) or [source])[-1]
    return pairs


EXACT_TABLES = {"results/quant.json", "results/grad.json", "results/study.json", "results/d12.json",
                "results/ablations.json"}


def test_every_number_in_a_results_table_is_in_its_file():
    # A table re-typed by hand, or left behind when its file is measured again, fails here: each number in its cells
    # must be a value, at the precision and with the sign shown (or that value in percent), of the file's rows
    # that the line's first cell names (a recipe, say), or of any row if it names none. The tables of the files in
    # EXACT_TABLES are compared cell by cell by the tests below.
    checked = 0
    for document in ("README.md", "dev/PERFORMANCE.md"):
        for source, table in tables_with_their_files(os.path.join(bench.ROOT, document)):
            if source is None:  # then it holds no measured number: only estimates (~6.6) and names (Table 1, 1x16)
                assert not re.findall(r"[^~\d.]\d+\.\d", "\n".join(table)), f"{document}: a table names no results file"
                continue
            if source in EXACT_TABLES:
                continue
            rows = json.load(open(os.path.join(bench.ROOT, source)))["rows"]
            for line in table[2:]:  # the header and its rule name the columns
                first, *cells = (cell.strip() for cell in line.strip().strip("|").split("|"))
                named = [row for row in rows if first.replace("**", "").strip("`") in row.values()]
                values = numbers_in(named or rows)
                for number in re.findall(r"[+-]?\d[\d,]*(?:\.\d+)?", " | ".join(cells)):
                    digits, shown = len(number.partition(".")[2]), number.replace(",", "")
                    form = (lambda v: f"{v:+.{digits}f}") if shown[0] in "+-" else (lambda v: f"{abs(v):.{digits}f}")
                    assert any(form(v * scale) == shown for v in values for scale in (1, 100)), \
                        f"{document}: {number} in '{line}' is not in {source}"
                    checked += 1
    assert checked > 0


def results_rows(name):
    return json.load(open(os.path.join(bench.ROOT, "results", name)))["rows"]


def readme_text():
    return open(os.path.join(bench.ROOT, "README.md")).read()


def missing_from_readme(lines):
    """The lines of a table that the README does not hold, each whole."""
    readme = readme_text().splitlines()
    return [line for line in lines if line not in readme]


def is_measured(name, pending, command):
    """Whether results/<name> exists. The README names the command that writes it either way, and says `pending`
    (that it is still to be measured) exactly while it does not."""
    readme, exists = readme_text(), os.path.exists(os.path.join(bench.ROOT, "results", name))
    assert command in " ".join(readme.split()) and (pending in readme) != exists
    return exists


def test_the_readme_quantizer_and_gradient_tables_are_their_files():
    # Exactly, cell by cell: the lenient check above cannot tell which row or column a number came from.
    quant = {row["quantizer"]: row for row in results_rows("quant.json")}
    cells = [f"{q['error_e3']:.2f} ({q['concentration']:.{0 if q['concentration'] > 10 else 2}f})"
             for q in quant.values()]
    expected = ["| ours | " + " | ".join(cells[:-1]) + f" | **{cells[-1]}** |"]
    grad = {(row["recipe"], row["gradient"]): row for row in results_rows("grad.json") if row["layer"] == "c_q"}
    for recipe in dict.fromkeys(recipe for recipe, _ in grad):
        cells = [f"{100 * grad[recipe, g]['errors'][0]:.2f} | {grad[recipe, g]['growth']:.2f}" for g in ("dX", "dW")]
        expected.append(f"| {recipe} | {' | '.join(cells)} |")
    assert missing_from_readme(expected) == []


def headline(rows):
    """The README's headline table rows and its samples, as the d12 study's record gives them: per recipe the mean
    over seeds of bpb and tokens/s, Quartet II's gap as mean ± std [95% interval], and the first seed's samples (the
    seed the loss plot shows)."""
    by_recipe = {row["recipe"]: row for row in rows}
    mean = {(r, key): statistics.fmean(run[key] for run in by_recipe[r]["runs"].values())
            for r in ("bf16", "quartet2") for key in ("val_bpb", "tokens_per_s")}
    gap = by_recipe["quartet2"]["gap_pct"]
    table = [f"| bf16 | {mean['bf16', 'val_bpb']:.4f} | | {mean['bf16', 'tokens_per_s']:,.0f} | |",
             f"| **quartet2** | {mean['quartet2', 'val_bpb']:.4f} | {gap['mean']:+.2f}% ± {gap['std']:.2f}% "
             f"[{gap['interval'][0]:+.2f}, {gap['interval'][1]:+.2f}] | {mean['quartet2', 'tokens_per_s']:,.0f} | "
             f"{mean['quartet2', 'tokens_per_s'] / mean['bf16', 'tokens_per_s']:.2f}x |"]
    first = str(by_recipe["bf16"]["seeds"][0])
    return table, [" ".join(by_recipe[r]["runs"][first]["samples"][0].split()) for r in ("bf16", "quartet2")]


def test_the_readme_headline_is_its_file():
    command = "python bench.py study --preset d12 --recipes bf16,quartet2 --seeds 0 1 2"
    if not is_measured("d12.json", "is still to be measured", command):
        return
    table, samples = headline(results_rows("d12.json"))
    readme = readme_text()
    assert missing_from_readme(table) == [] and "results/d12_loss.png" in readme
    assert all(sample in " ".join(readme.split()) for sample in samples)


def test_the_readme_comparison_table_is_its_file():
    rows = {row["recipe"]: row for row in results_rows("study.json")}
    seeds = len(rows["quartet2"]["seeds"])

    def gap(recipe):
        mean, (low, high) = rows[recipe]["gap_pct"]["mean"], rows[recipe]["gap_pct"]["interval"]
        return f"{mean:+.2f}% [{low:+.2f}, {high:+.2f}]"
    expected = [f"| **quartet2** | {gap('quartet2')} | | | |"]
    for recipe in ("quartet2_no46", "nvidia", "nvidia46", "tetrajet2"):
        difference = rows[recipe]["versus"]["quartet2"]  # the baseline's bpb minus Quartet II's
        low, high = (1e3 * end for end in difference["interval"])
        reduction = (f" {rows[recipe]['quartet2_gap_reduction_pct']:.0f}% ({rows[recipe]['paper_gap_reduction_pct']}%) "
                     if "paper_gap_reduction_pct" in rows[recipe] else " ")
        expected.append(f"| {recipe} | {gap(recipe)} | {1e3 * difference['mean']:+.2f} [{low:+.2f}, {high:+.2f}] | "
                        f"{rows['quartet2']['versus'][recipe]['lower_in']} of {seeds} |{reduction}|")
    assert missing_from_readme(expected) == []


ABLATION_PAIRS = (("fwd_1x16", "fwd_1x16_46"), ("fwd_16x16", "fwd_16x16_46"), ("fwd_16x16", "fwd_1x16"),
                  ("bwd_a_sr", "bwd_a_eden"), ("bwd_c_sr", "bwd_c_eden"), ("bwd_e_sr", "bwd_e_eden"))
ABLATIONS = "bf16," + ",".join(dict.fromkeys(r for pair in ABLATION_PAIRS for r in pair))


def ablation_tables(rows):
    """The README's ablation rows, as the study's record gives them: per recipe its gap to BF16 (mean [95% interval]),
    and per pair the first's bpb minus the second's, x 10^-3, paired by seed, with how often the second is lower."""
    by_recipe, seeds = {row["recipe"]: row for row in rows}, len(rows[0]["seeds"])
    gaps = []
    for recipe in ABLATIONS.split(",")[1:]:
        gap = by_recipe[recipe]["gap_pct"]
        gaps.append(f"| {recipe} | {gap['mean']:+.2f}% [{gap['interval'][0]:+.2f}, {gap['interval'][1]:+.2f}] |")
    pairs = []
    for first, second in ABLATION_PAIRS:
        difference = by_recipe[first]["versus"][second]
        low, high = (1e3 * end for end in difference["interval"])
        pairs.append(f"| {first} - {second} | {1e3 * difference['mean']:+.2f} [{low:+.2f}, {high:+.2f}] | "
                     f"{'yes' if difference['resolved'] else 'no'} | {by_recipe[second]['versus'][first]['lower_in']} "
                     f"of {seeds} |")
    return gaps, pairs


def test_the_ablation_tables_read_a_study():
    # 4/6 lowers bpb by 0.001 in every seed, while the seed moves every recipe together: resolved, lower in 3 of 3
    recipes = ABLATIONS.split(",")
    runs = {seed: {r: dict(val_bpb=1.0 + shift + 0.002 * (r != "bf16") - 0.001 * r.endswith("_46")) for r in recipes}
            for seed, shift in ((0, 0.0), (1, 0.01), (2, -0.02))}
    gaps, pairs = ablation_tables(bench.study_rows(runs, recipes))
    assert len(gaps) == 10 and gaps[1].startswith("| fwd_1x16_46 | +0.10% [")
    assert pairs[0] == "| fwd_1x16 - fwd_1x16_46 | +1.00 [+1.00, +1.00] | yes | 3 of 3 |"
    assert pairs[2] == "| fwd_16x16 - fwd_1x16 | +0.00 [+0.00, +0.00] | no | 0 of 3 |"


def test_the_readme_ablation_tables_are_their_file():
    command = f"python bench.py study --recipes {ABLATIONS} --seeds 0 1 2 3 4"
    if not is_measured("ablations.json", "they are still to be measured", command):
        return
    gaps, pairs = ablation_tables(results_rows("ablations.json"))
    assert missing_from_readme(gaps + pairs) == []
