"""bench.py's comparison commands: gradient concentration (the paper's Figure 9) and the study of recipes x seeds."""

import json
import shlex
import shutil

import pytest
import torch

import bench
import train


def test_grad_measures_the_concentration_of_every_layer_and_gradient(tmp_path):
    rows = bench.main(["grad", "--recipes", "quartet2,bwd_e_sr46", "--depth", "2", "--tokens", "256",
                       "--seq-len", "128",
                       "--batches", "8", "--png", str(tmp_path / "c.png")])
    assert {(r["recipe"], r["layer"], r["gradient"]) for r in rows} == {
        (recipe, layer, gradient) for recipe in ("quartet2", "bwd_e_sr46") for layer in ("c_q", "c_k", "c_v")
        for gradient in ("dX", "dW")}
    for row in rows:
        assert row["batches"] == [1, 2, 4, 8]
        if row["recipe"] == "quartet2":  # unbiased: the mean of 8 passes has ~1/8 of the error (1/4 is a wide band)
            assert row["errors"][-1] < row["errors"][0] / 4, row


def test_grad_measures_no_growth_where_a_gradient_is_not_quantized(monkeypatch, tmp_path):
    # On a GPU the layers are captured in BF16, and an unquantized gradient's BF16 GEMM is off by ~1e-6, the same in
    # every pass: its "growth" would read B, as if biased. It is exact by construction, so none is measured.
    captured = bench.captured_layers
    monkeypatch.setattr(bench, "captured_layers", lambda args, device: [
        (name, *(t.to(torch.bfloat16) for t in tensors)) for name, *tensors in captured(args, device)])
    rows = bench.main(["grad", "--recipes", "fwd_1x16,bwd_a_sr,nvidia", "--depth", "2", "--tokens", "256",
                       "--seq-len", "128", "--batches", "4", "--png", str(tmp_path / "c.png")])
    growth = {(r["recipe"], r["gradient"]): r["growth"] for r in rows}
    assert growth[("fwd_1x16", "dX")] is growth[("fwd_1x16", "dW")] is growth[("bwd_a_sr", "dX")] is None
    assert None not in (growth[("bwd_a_sr", "dW")], growth[("nvidia", "dX")], growth[("nvidia", "dW")])
    assert all(r["errors"][0] > 0 for r in rows if r["recipe"] == "fwd_1x16")  # the BF16 rounding, not exact


def tiny_study_flags(data_dir, steps, *extra):
    """train.py's flags for a study's seeds: a depth-2 GPT for a few steps, two-token samples (each token is a whole
    forward pass, interpreted for a quantized recipe)."""
    return ["--depth", "2", "--seq-len", "64", "--device-batch", "2", "--batch-tokens", "256", "--steps", str(steps),
            "--eval-tokens", "512", "--sample-tokens", "2", "--data-dir", data_dir, *extra]


@pytest.mark.slow
def test_study_trains_every_seed_and_keeps_its_record(small_data, tmp_path):
    flags = tiny_study_flags(small_data, 3, "--eval-every", "3")
    argv = ["study", "--preset", "tiny", "--recipes", "bf16,quartet2,nvidia", "--seeds", "0", "1", "--parallel", "2",
            "--out", str(tmp_path / "study"), "--json", str(tmp_path / "study.json"), "--png", str(tmp_path / "l.png"),
            "--", *flags]
    rows = bench.main(argv)
    study_png = json.loads(bench.png_description(str(tmp_path / "l.png")))
    assert study_png["command"] == "python bench.py " + shlex.join(argv)
    assert "train.py run" in bench.png_description(str(tmp_path / "study" / "seed0" / "loss.png"))  # the seed's own
    summaries = [json.load(open(tmp_path / "study" / f"seed{s}" / "summary.json"))["rows"] for s in (0, 1)]
    by_recipe = {r["recipe"]: r for r in rows}
    bpb = [{r["recipe"]: r["val_bpb"] for r in summary} for summary in summaries]
    assert [by_recipe["nvidia"]["runs"][str(s)]["val_bpb"] for s in (0, 1)] == [b["nvidia"] for b in bpb]
    assert by_recipe["nvidia"]["versus"]["quartet2"] == pytest.approx(
        bench.paired([b["nvidia"] - b["quartet2"] for b in bpb]) | dict(lower_in=sum(
            b["nvidia"] < b["quartet2"] for b in bpb)))
    shutil.rmtree(tmp_path / "study")  # the record alone: a finished study is read back, not trained again
    assert bench.main(argv) == rows
    record = json.load(open(tmp_path / "study.json"))
    assert list(record) == bench.RESULT_KEYS and record["fingerprint"] == bench.fingerprint()
    more = bench.main(argv[:6] + ["1", "2"] + argv[8:])  # seed 1 from the record, seed 2 trained
    assert [r["runs"]["1"] for r in more] == [r["runs"]["1"] for r in rows] and (tmp_path / "study" / "seed2").exists()
    assert not (tmp_path / "study" / "seed1").exists()


def test_a_failed_seed_keeps_the_seeds_that_finished(small_data, tmp_path):
    flags = tiny_study_flags(small_data, 2)
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "seed1").write_text("not a run directory")  # seed 1's train.py refuses it
    argv = ["study", "--preset", "tiny", "--recipes", "bf16", "--seeds", "1", "0", "--out", str(tmp_path / "study"),
            "--json", str(tmp_path / "study.json"), "--", *flags]
    with pytest.raises(SystemExit, match="seed 1 failed: .*run again to train the rest"):
        bench.main(argv)
    assert json.load(open(tmp_path / "study.json"))["rows"][0]["seeds"] == [0]


def test_a_seed_begun_on_other_numerics_starts_over_and_a_record_keeps_its_recipes(small_data, tmp_path):
    flags = tiny_study_flags(small_data, 2, "--keep-checkpoints")
    study = ["study", "--preset", "tiny", "--recipes", "bf16,fwd_1x16", "--seeds", "0", "--out",
             str(tmp_path / "study"), "--json", str(tmp_path / "study.json"), "--", *flags]
    bench.main(study)
    (tmp_path / "study.json").unlink()  # the record gone: the seed's finished run is there to resume
    bench.main(study)
    assert "resumed at step 2" in (tmp_path / "study" / "seed0.log").read_text()
    (tmp_path / "study.json").unlink()
    (tmp_path / "study" / "seed0.numerics").write_text("numerics 0123")  # begun on other numerics: trained again
    bench.main(study)
    assert "resumed" not in (tmp_path / "study" / "seed0.log").read_text()
    with pytest.raises(SystemExit, match="holds fwd_1x16 too"):  # rewriting the record would drop its seeds
        bench.main(study[:4] + ["bf16"] + study[5:])


def test_study_refuses_a_seed_trained_with_other_flags(small_data, tmp_path):
    flags = tiny_study_flags(small_data, 2)
    study = ["study", "--preset", "tiny", "--recipes", "bf16", "--seeds", "0", "--out", str(tmp_path)]
    bench.main(study + ["--"] + flags)
    with pytest.raises(SystemExit, match="cannot change flags that define the run: --lr-matrix"):
        bench.main(study + ["--"] + flags + ["--lr-matrix", "0.05"])


def test_bad_study_and_output_flags_are_refused_before_any_work(tmp_path, capsys):
    for argv, expected in ((["study", "--recipes", "quartet2,nvidia"], "include it"),
                           (["quant", "--json", str(tmp_path / "missing" / "q.json")], "cannot write"),
                           (["grad", "--png", str(tmp_path / "missing" / "c.png")], "cannot write"),
                           (["quant", "--json", str(tmp_path)], "cannot write"),
                           (["grad", "--png", str(tmp_path / "c.xyz")], "cannot write"),
                           (["study", "--png", str(tmp_path / "missing" / "l.png")], "cannot write"),
                           (["quant", "--batches", "1"], "--batches at least 2"),
                           (["quant", "--size", "100"], "positive multiple of 128"),
                           (["grad", "--batches", "3"], "power of two"),
                           (["quant", "--seed", "100000000000000000000"], "--seed must be in"),
                           (["study", "--", "--seed", "7"], "study sets"),
                           (["study", "--parallel", "0"], "--parallel must be at least 1"),
                           (["study", "--seeds", "1", "1"], "--seeds distinct"),
                           (["study", "--json", str(tmp_path / "s.txt")], "cannot write")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert expected in capsys.readouterr().err


@pytest.mark.parametrize("command", ["grad", "study", "train"])
def test_an_unknown_recipe_is_a_one_line_error_naming_it(command, capsys):
    with pytest.raises(SystemExit):
        bench.main([command, "--recipes", "quartet2,quartet9"])
    assert "unknown recipe(s) ['quartet9']" in capsys.readouterr().err


def test_grad_takes_the_weights_of_a_train_py_checkpoint(small_data, tmp_path):
    flags = ["--depth", "2", "--seq-len", "128", "--device-batch", "2", "--batch-tokens", "256", "--steps", "2",
             "--eval-tokens", "256", "--recipe", "bf16", "--data-dir", small_data, "--out", str(tmp_path / "run"),
             "--keep-checkpoints"]
    assert train.main(["--preset", "tiny"] + flags) is None
    checkpoint = str(tmp_path / "run" / "bf16" / "checkpoint.pt")
    grad = ["grad", "--recipes", "quartet2", "--depth", "2", "--seq-len", "128", "--tokens", "256", "--batches", "2",
            "--png", str(tmp_path / "c.png")]
    trained, initialized = bench.main(grad + ["--checkpoint", checkpoint]), bench.main(grad)
    assert [r["errors"] for r in trained] != [r["errors"] for r in initialized]  # other weights, other gradients
    with pytest.raises(SystemExit, match="another model size than --depth 4"):
        bench.main(grad[:4] + ["4"] + grad[5:] + ["--checkpoint", checkpoint])
    weightless = str(tmp_path / "weightless.pt")  # a checkpoint of train.py's format without the model's weights
    train.save_checkpoint(weightless, dict(run_id="x", recipe="bf16", step=2))
    for path, expected in ((weightless, "unreadable (KeyError)"), (str(tmp_path / "missing.pt"), "not found")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(grad + ["--checkpoint", path])
        assert str(exit_.value).startswith("bench.py: error: checkpoint") and expected in str(exit_.value)
        assert "\n" not in str(exit_.value) and "delete" not in str(exit_.value)


def test_train_needs_at_least_one_timed_call(capsys):
    with pytest.raises(SystemExit):
        bench.main(["train", "--calls", "0"])
    assert "--calls must be at least 1" in capsys.readouterr().err


@pytest.mark.gpu
def test_linear_times_captured_layers():
    rows = bench.main(["linear", "--only", "d12", "--tokens", "4096", "--cuda-graph"])
    assert [row["layer"] for row in rows] == ["d12 fc", "d12 proj"]
    assert all(row["cuda_graph"] and row["bf16_ms"] > 0 and 0 < row["quartet2_ratio"] < 100 for row in rows)


CPU_OUT_OF_MEMORY = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes")


@pytest.mark.parametrize("error", [MemoryError(), torch.cuda.OutOfMemoryError("CUDA out of memory"), CPU_OUT_OF_MEMORY])
def test_out_of_memory_is_a_one_line_error_pointing_at_the_size_flags(error, monkeypatch):
    def allocate(args):
        raise error
    monkeypatch.setattr(bench, "bench_quant", allocate)
    with pytest.raises(SystemExit, match=r"out of memory \(.+\); lower the sizes `bench.py quant --help` lists"):
        bench.main(["quant", "--size", "65536"])


def test_other_runtime_errors_keep_their_traceback(monkeypatch):
    def fail(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(bench, "bench_quant", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        bench.main(["quant"])
