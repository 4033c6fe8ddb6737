"""train.py: data, bits per byte, runs that never lose work (resume, run identity, lock, checksums, DDP), and its
one-line errors."""

import contextlib
import errno
import fcntl
import glob
import gzip
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import train
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_args(data_dir, out, *extra):
    return ["--preset", "tiny", "--depth", "2", "--seq-len", "64", "--device-batch", "2", "--batch-tokens", "256",
            "--eval-every", "5", "--eval-tokens", "1024", "--data-dir", data_dir, "--out", str(out),
            "--keep-checkpoints", "--sample-tokens", "2", *extra]


def run(argv):
    """train.main(argv): None if it finished, else its exit message."""
    try:
        train.main(argv)
    except SystemExit as exit_:
        return str(exit_.code)


def checkpoint(out, recipe):
    run_id = json.load(open(out / "run.json"))["run_id"]
    return train.load_checkpoint(os.path.join(out, recipe, "checkpoint.pt"), run_id)


def losses(out, recipe=None):
    return [r["loss"] for r in train.read_metrics(out) if recipe in (None, r["recipe"])]


def assert_one_line_error(message, *expected):
    assert message and "\n" not in message and message.startswith("train.py: error:"), message
    for text in expected:
        assert text in message, message


# --- data ----------------------------------------------------------------------------------------------------------

def test_tokenizer_is_gpt2_offline():
    tokenizer = train.gpt2_tokenizer()
    assert tokenizer.encode("Hello world") == [15496, 995] and tokenizer.n_vocab == 50257
    lengths = train.token_bytes(tokenizer)
    assert lengths[train.EOT] == 0 and lengths[tokenizer.encode(" the")[0]] == 4


def test_bits_per_byte_on_a_hand_made_example():
    bytes_per_token = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)  # token 3 is special
    loss_sum, byte_sum = train.bpb_sums(torch.tensor([0.5, 1.0, 2.0, 5.0]), torch.tensor([0, 1, 2, 3]), bytes_per_token)
    assert loss_sum.item() == 3.5 and byte_sum.item() == 6.0  # the special token counts in neither sum


def test_windows_pack_documents_exactly_and_resume_from_their_state():
    documents = [np.arange(start, start + length, dtype=np.int32) for start, length in ((0, 5), (100, 7), (200, 3))]
    epochs = train.shuffled_epochs(documents, seed=0)
    windows = train.Windows(epochs, seq_len=3)
    first = windows.next_batch(2)  # 8 tokens
    stream = np.concatenate(list(epochs(0, 0)) + list(epochs(1, 0)))
    assert first.tolist() == stream[:8].reshape(2, 4).tolist()
    state = windows.state_dict()
    rest = windows.next_batch(3)
    assert rest.flatten().tolist() == stream[8:20].tolist()  # runs into the second epoch
    assert torch.equal(train.Windows(epochs, 3, state).next_batch(3), rest)
    firsts = lambda order: [int(tokens[0]) for tokens in order]
    for epoch in (0, 1):  # every epoch is a permutation of the documents, the same one for the same seed
        assert sorted(firsts(epochs(epoch, 0))) == [0, 100, 200]
        assert firsts(epochs(epoch, 0)) == firsts(train.shuffled_epochs(documents, seed=0)(epoch, 0))
    assert firsts(epochs(0, 1)) == firsts(epochs(0, 0))[1:]  # starting mid-epoch skips what was read


def test_validation_windows_are_fixed_and_fill_whole_batches(small_data):
    documents = train.tokenize(train.gpt2_tokenizer(), train.local_texts("val", small_data))
    a = train.validation_windows(documents, 64, 15, multiple=4)
    assert a.shape == (12, 65) and torch.equal(a, train.validation_windows(documents, 64, 15, multiple=4))
    assert a.flatten().tolist() == np.concatenate(documents)[:12 * 65].tolist()


def test_streaming_through_datasets_on_a_local_file(tmp_path):
    pytest.importorskip("datasets", reason="--data hf needs Hugging Face datasets, which is not installed")
    texts = [f"document number {i}." for i in range(12)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(dict(text=t)) + "\n" for t in texts))
    flags = ["--data", "hf", "--hf-dataset", "json", "--hf-config", "", "--hf-files", str(path), "--val-docs", "2"]
    tokenizer = train.gpt2_tokenizer()
    documents, validation, fingerprint = train.data_sources(train.parse_args(flags), tokenizer)
    assert fingerprint is None  # a stream is named by its flags
    decode = lambda tokens: tokenizer.decode(tokens[:-1].tolist())
    assert [decode(t) for t in validation] == texts[:2]
    epochs = [[decode(t) for t in documents(epoch, 0)] for epoch in range(3)]
    assert all(sorted(epoch) == sorted(texts[2:]) for epoch in epochs)  # every training document, none of validation
    assert len({tuple(epoch) for epoch in epochs}) == 3  # in a new order each epoch
    again = train.data_sources(train.parse_args(flags), tokenizer)[0]  # the same order from the same seed...
    assert [decode(t) for t in again(1, 4)] == epochs[1][4:]  # ...and resumed at (epoch, document)
    other_seed = train.data_sources(train.parse_args(flags + ["--seed", "1"]), tokenizer)[0]
    assert [decode(t) for t in other_seed(0, 0)] != epochs[0]


# --- runs ------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_many_recipes_train_compiled_in_one_process(small_data, tmp_path, monkeypatch):
    # Every new model, and evaluation, makes torch.compile compile GPT.forward again; under fullgraph the eighth
    # recompilation is an error unless each model starts afresh (train.compile_model). Dynamo alone (the "eager"
    # backend) counts recompilations as Inductor does, in seconds instead of minutes on a CPU.
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: compile(model, **options, backend="eager"))
    recipes = "bf16,fwd_1x16,fwd_1x16_46,fwd_16x16,fwd_16x16_46,quartet2"  # 12 compilations (training, evaluation)
    assert run(tiny_args(small_data, tmp_path, "--recipe", recipes, "--steps", "1", "--eval-every", "1",
                         "--compile")) is None
    assert len(losses(tmp_path)) == 6


def test_tiny_run_writes_metrics_summary_samples_and_plot_and_deletes_its_checkpoints(small_data, tmp_path, capsys):
    # the tiny preset's default: a finished toy run keeps its results (~0.1 MB), not its checkpoints (~160 MB each)
    assert run(tiny_args(small_data, tmp_path, "--steps", "5", "--recipe", "bf16,quartet2", "--no-keep-checkpoints",
                         "--sample-tokens", "3")) is None
    records = train.read_metrics(tmp_path)
    assert [r["recipe"] for r in records] == ["bf16"] * 5 + ["quartet2"] * 5
    assert {r["run_id"] for r in records} == {json.load(open(tmp_path / "run.json"))["run_id"]}
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["run_id"] == records[0]["run_id"] and [r["recipe"] for r in summary["rows"]] == ["bf16", "quartet2"]
    assert all(set(row) == {"recipe", "val_bpb", "tokens", "steps", "peak_memory_gb", "tokens_per_s", "gap_pct"}
               for row in summary["rows"])
    assert summary["rows"][0]["gap_pct"] == 0 and math.isfinite(summary["rows"][1]["val_bpb"])
    assert summary["prompts"] == list(train.PROMPTS) and list(summary["samples"]) == ["bf16", "quartet2"]
    assert all(len(texts) == len(train.PROMPTS) and all(isinstance(t, str) for t in texts)
               for texts in summary["samples"].values())
    assert (tmp_path / "loss.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert not glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    output = capsys.readouterr().out
    assert "1.28K tokens per recipe, 0.017 passes over the bundled sample" in output  # 5 steps of 256 tokens
    assert "eta 0.0 min, run ~" in output and "its checkpoints deleted (--keep-checkpoints keeps them)" in output
    assert all(f"  {recipe:<14}" in output for recipe in ("bf16", "quartet2"))  # the samples, printed
    with open(tmp_path / ".lock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: free to take (BlockingIOError if held)
    for flags in (["--resume", "--steps", "6"], ["--sample", "Photosynthesis is"]):
        expected = os.path.join("bf16", "checkpoint.pt") + " not found"
        assert_one_line_error(run(tiny_args(small_data, tmp_path, *flags)), expected, "--keep-checkpoints")
    cpu = types.SimpleNamespace(device=torch.device("cpu"), distributed=False, world=1)
    kept = [train.resolve(train.parse_args(["--preset", p]), cpu).keep_checkpoints for p in train.PRESETS]
    assert kept == [p != "tiny" for p in train.PRESETS]


def test_amounts_read_at_every_size():
    assert [train.amount(n) for n in (960, 40960, 4_860_000, 18_350_080, 1.2e9)] == ["960", "41K", "4.86M",
                                                                                      "18.4M", "1.2B"]


def test_sampling_a_resumed_run_gives_what_the_finished_run_gave(small_data, tmp_path, capsys):
    # --deterministic: on a GPU two runs differ in the embedding's last bits without it (atomic additions)
    common = ("--steps", "2", "--recipe", "bf16,quartet2", "--sample-tokens", "4", "--deterministic")
    assert run(tiny_args(small_data, tmp_path / "straight", *common)) is None
    assert run(tiny_args(small_data, tmp_path / "resumed", *common, "--stop-after", "1")) is None
    assert run(tiny_args(small_data, tmp_path / "resumed", *common, "--resume")) is None
    samples = [json.load(open(tmp_path / name / "summary.json"))["samples"] for name in ("straight", "resumed")]
    assert samples[0] == samples[1] and list(samples[0]) == ["bf16", "quartet2"]
    capsys.readouterr()
    printed = []
    for name in ("straight", "resumed"):  # a one-line command, no training: the prompt of the run's end, again
        assert run(["--sample", train.PROMPTS[0], "--sample-tokens", "4", "--out", str(tmp_path / name)]) is None
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and "step" not in printed[0]
    assert all(" ".join(texts[0].split()) in printed[0] for texts in samples[0].values())
    assert_one_line_error(run(["--sample", "Hello", "--out", str(tmp_path / "nothing")]), "nothing to sample")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "quartet2"])
def test_resume_is_bit_exact(small_data, tmp_path, recipe):
    # --deterministic: on a GPU two uninterrupted runs differ in the embedding's last bits without it (atomic
    # additions in the compiled backward); on a CPU it changes nothing
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--steps", "8", "--recipe", recipe, "--checkpoint-every", "3", "--deterministic")
    assert run(tiny_args(small_data, straight, *common)) is None
    assert run(tiny_args(small_data, resumed, *common, "--stop-after", "4")) is None
    assert checkpoint(resumed, recipe)["step"] == 4
    assert run(tiny_args(small_data, resumed, *common, "--resume")) is None
    a, b = checkpoint(straight, recipe), checkpoint(resumed, recipe)
    assert a["step"] == b["step"] == 8
    assert all(torch.equal(tensor, b["model"][name]) for name, tensor in a["model"].items())
    assert losses(straight) == losses(resumed)


def test_deterministic_holds_for_the_run_only(small_data, tmp_path, monkeypatch):
    seen, train_recipe = [], train.train_recipe

    def spy(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return train_recipe(*args, **kwargs)
    monkeypatch.setattr(train, "train_recipe", spy)
    common = ("--steps", "1", "--recipe", "bf16")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert run(tiny_args(small_data, tmp_path / "on", *common, "--deterministic")) is None
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert run(tiny_args(small_data, tmp_path / "off", *common)) is None
    assert seen == [True, False]


def test_capture_bookkeeping_on_a_stand_in_graph(small_data, tmp_path, monkeypatch):
    # What --cuda-graph does around the graph, on the CPU: a stand-in "graph" that re-runs the captured function on
    # the static token buffer. The run must equal an uncaptured one bit for bit: the warm-up's gradients zeroed, the
    # random state put back after the warm-up and the capture, each replay's loss read before the next.
    common = ("--recipe", "bf16,quartet2", "--steps", "3", "--device", "cpu")  # on a GPU two runs differ in bits
    assert run(tiny_args(small_data, tmp_path / "uncaptured", *common)) is None

    def stand_in(fn, warmups=3):
        for _ in range(warmups):
            fn()
        output = fn()
        return (lambda: output.copy_(fn())), output
    resolve = train.resolve

    def resolve_with_graphs(args, processes):
        args = resolve(args, processes)
        args.cuda_graph = True
        return args
    monkeypatch.setattr(train, "cuda_graph", stand_in)
    monkeypatch.setattr(train, "resolve", resolve_with_graphs)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: torch.set_rng_state(state))
    assert run(tiny_args(small_data, tmp_path / "captured", *common)) is None
    assert losses(tmp_path / "captured") == losses(tmp_path / "uncaptured")
    for recipe in ("bf16", "quartet2"):
        a, b = checkpoint(tmp_path / "captured", recipe), checkpoint(tmp_path / "uncaptured", recipe)
        assert all(torch.equal(tensor, b["model"][name]) for name, tensor in a["model"].items())


@pytest.mark.gpu
def test_captured_micro_batches_train_as_uncaptured_ones(small_data, tmp_path):
    # --cuda-graph replays each micro-batch's forward + backward from a CUDA graph (two micro-batches per step here):
    # the same random draws and the same arithmetic, so the same losses bit for bit, in every kind of recipe
    # (--deterministic: else the embedding's gradient differs in its last bits between any two GPU runs).
    recipes = ("--recipe", "bf16,quartet2,nvidia", "--steps", "4", "--compile", "--deterministic")
    assert run(tiny_args(small_data, tmp_path / "captured", *recipes, "--cuda-graph")) is None
    assert run(tiny_args(small_data, tmp_path / "uncaptured", *recipes, "--no-cuda-graph")) is None
    assert losses(tmp_path / "captured") == losses(tmp_path / "uncaptured")
    assert len(losses(tmp_path / "captured")) == 12


def test_a_crash_after_a_checkpoint_is_resumed_without_repeating_metrics(small_data, tmp_path):
    common = ("--steps", "6", "--recipe", "bf16", "--checkpoint-every", "2")
    assert run(tiny_args(small_data, tmp_path, *common, "--stop-after", "3")) is None  # checkpoint at step 3
    with open(tmp_path / "metrics.jsonl", "a") as f:  # steps 4 and 5 ran, then a crash mid-line
        f.write(json.dumps(dict(recipe="bf16", step=4, loss=1.0)) + "\n" + '{"recipe": "bf16", "st')
    assert run(tiny_args(small_data, tmp_path, *common, "--resume")) is None
    assert [r["step"] for r in train.read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert all(line.strip().startswith("{") for line in open(tmp_path / "metrics.jsonl"))


def test_a_finished_run_is_extended_and_reported_at_its_new_end(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "4", "--recipe", "bf16")) is None
    assert run(tiny_args(small_data, tmp_path, "--steps", "6", "--recipe", "bf16", "--resume")) is None
    summary = json.load(open(tmp_path / "summary.json"))["rows"][0]
    last_eval = [r for r in train.read_metrics(tmp_path) if "val_bpb" in r][-1]
    assert summary["steps"] == 6 and summary["val_bpb"] == last_eval["val_bpb"] and last_eval["step"] == 6
    assert checkpoint(tmp_path, "bf16")["step"] == 6


def test_resume_refuses_to_shorten_a_run_and_keeps_its_checkpoint(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "4", "--recipe", "bf16")) is None
    before = open(tmp_path / "bf16" / "checkpoint.pt", "rb").read()
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--resume")),
                          "below its checkpoint's step 4")
    assert open(tmp_path / "bf16" / "checkpoint.pt", "rb").read() == before


def test_a_new_run_never_adopts_an_older_runs_checkpoint(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "4", "--recipe", "bf16", "--seed", "1")) is None
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "4", "--recipe", "bf16")), "holds a run",
                          "--resume", "--overwrite")
    # replaced, then killed before its own first checkpoint: --resume must not continue the old run's
    assert run(tiny_args(small_data, tmp_path, "--steps", "4", "--recipe", "bf16", "--overwrite",
                         "--stop-after", "1", "--checkpoint-every", "100")) is None
    os.remove(tmp_path / "bf16" / "checkpoint.pt")
    old = tmp_path / "old.pt"  # an old run's checkpoint put back in place
    assert run(tiny_args(small_data, tmp_path.parent / "other", "--steps", "2", "--recipe", "bf16")) is None
    os.replace(tmp_path.parent / "other" / "bf16" / "checkpoint.pt", old)
    os.replace(old, tmp_path / "bf16" / "checkpoint.pt")
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "4", "--recipe", "bf16", "--resume")),
                          "belongs to another run")


def test_resume_refuses_changed_run_flags_and_allows_harmless_ones(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16")) is None
    for flag, value in (("--seed", "3"), ("--lr-matrix", "0.03"), ("--batch-tokens", "512"), ("--depth", "4")):
        assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--resume",
                                            flag, value)), "cannot change", flag)
    assert run(tiny_args(small_data, tmp_path, "--steps", "3", "--recipe", "bf16", "--resume", "--eval-every",
                         "3", "--checkpoint-every", "7")) is None
    assert_one_line_error(run(tiny_args(small_data, tmp_path / "empty", "--resume")), "nothing to resume")


def test_a_second_run_into_the_same_directory_is_locked_out(small_data, tmp_path):
    with open(tmp_path / ".lock", "a") as held:  # another run's lock (flock: per open file, even in one process)
        fcntl.flock(held, fcntl.LOCK_EX)
        assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "1")), "in use by another run")
    # the lock file of a run that ended (or crashed) holds no lock
    assert run(tiny_args(small_data, tmp_path, "--steps", "1", "--recipe", "bf16")) is None


def test_a_damaged_checkpoint_is_refused(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16")) is None
    path = tmp_path / "bf16" / "checkpoint.pt"
    original = bytearray(path.read_bytes())
    flipped = original.copy()
    flipped[len(flipped) // 2] ^= 0xFF  # a flipped byte inside the weights
    for content, expected in ((bytes(flipped), "corrupt"), (b"", "unreadable"), (bytes(original[:1000]), "unreadable"),
                              (os.urandom(4096), "unreadable")):
        path.write_bytes(content)
        assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "3", "--recipe", "bf16", "--resume")),
                              expected, str(path))


def test_a_checkpoint_from_the_other_kind_of_device_is_refused(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16")) is None
    state = checkpoint(tmp_path, "bf16")
    rng = state["rng"][0]  # made to look written on the other kind: a GPU's random state cannot be set on a CPU
    rng["cuda"] = torch.zeros(16, dtype=torch.uint8) if rng["cuda"] is None else None
    train.save_checkpoint(str(tmp_path / "bf16" / "checkpoint.pt"), state)
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "3", "--recipe", "bf16", "--resume")),
                          "its checkpoint was written on", "resume it there")


@pytest.mark.slow
def test_two_processes_match_one_and_resume_exactly(small_data, tmp_path):
    def launch(out, *extra, processes=1):
        argv = tiny_args(small_data, out, "--recipe", "quartet2", "--device", "cpu", "--steps", "4", *extra)
        command = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                    f"--master_port={free_port()}", "train.py"] if processes > 1 else [sys.executable, "train.py"])
        subprocess.run(command + argv, cwd=ROOT, check=True, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    launch(tmp_path / "one")
    launch(tmp_path / "two", processes=2)
    launch(tmp_path / "resumed", "--stop-after", "2", processes=2)
    launch(tmp_path / "resumed", "--resume", processes=2)
    one, two, resumed = losses(tmp_path / "one"), losses(tmp_path / "two"), losses(tmp_path / "resumed")
    # Step 1 sees the same weights and data split on one or two processes (the quantization noise differs: each
    # rank draws its own); later steps agree to the noise of 4-bit training. A resumed run repeats every bit,
    # which needs every rank's random state back.
    assert one[0] == pytest.approx(two[0], rel=1e-3) and one == pytest.approx(two, rel=0.02)
    assert resumed == two
    assert json.load(open(tmp_path / "two" / "summary.json"))["world_size"] == 2



@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_stops_every_process(small_data, tmp_path):
    argv = ["train.py", *tiny_args(small_data, tmp_path, "--recipe", "bf16", "--device", "cpu", "--steps", "4")]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    f"--master_port={free_port()}", *argv, "--stop-after", "1"],
                   cwd=ROOT, check=True, capture_output=True, env=environment)
    (tmp_path / "bf16" / "checkpoint.pt.tmp").mkdir()  # where rank 0 writes the next checkpoint
    # The two ranks started by hand, as torchrun would: torchrun stops the other rank as soon as one fails, so
    # under it whether rank 1 printed its own error would be a race.
    environment.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [subprocess.Popen([sys.executable, *argv, "--resume"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=dict(environment, RANK=rank, LOCAL_RANK=rank))
             for rank in ("0", "1")]
    try:
        errors = [rank.communicate(timeout=600)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    # Rank 0 alone writes it; both ranks must stop with its error, not rank 1 go on as if it had been written
    for rank, error in zip(ranks, errors):
        assert rank.returncode != 0 and "train.py: error: could not write" in error, error


# --- errors ----------------------------------------------------------------------------------------------------------

def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(small_data, tmp_path):
    # An embedding learning rate of 1e37 (Adam moves each weight by ~lr per step) overflows float32 in ~15 steps.
    # On the CPU: a GPU's fused AdamW was seen to stay finite at this learning rate.
    message = run(tiny_args(small_data, tmp_path, "--steps", "40", "--recipe", "bf16", "--checkpoint-every", "1",
                            "--lr-embedding", "1e37", "--device", "cpu"))
    assert_one_line_error(message, "non-finite", "at step")
    step = int(message.split("at step ")[1].split(";")[0])
    saved = checkpoint(tmp_path, "bf16")
    assert saved["step"] == step - 1 and all(torch.isfinite(t).all() for t in saved["model"].values())


def test_a_model_that_does_not_learn_is_not_reported_as_a_result(small_data, tmp_path):
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "25", "--recipe", "bf16", "--eval-every",
                                        "25", "--lr-matrix", "1e30")), "did not learn")


def bad_data(tmp_path, name, content):
    folder = tmp_path / name
    folder.mkdir()
    for split in ("train", "val"):
        (folder / f"fineweb_edu_{split}_000.jsonl.gz").write_bytes(content)
    return str(folder)


@pytest.mark.parametrize("argv,expected", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--recipe", "fp8"], "unknown recipe"),
    ([], "no GPU found"),
    (["--data-dir", "/nonexistent"], "no train documents"),
    (["--batch-tokens", "1000"], "must be a multiple of seq_len x device_batch"),
    (["--batch-tokens", "0"], "--batch-tokens must be at least 1"),
    (["--batch-tokens", "-1024"], "--batch-tokens must be at least 1"),
    (["--device-batch", "0"], "--device-batch must be at least 1"),
    (["--seq-len", "0"], "--seq-len must be at least 1"),
    (["--seq-len", "-128"], "--seq-len must be at least 1"),
    (["--val-docs", "-1"], "--val-docs must be at least 0"),
    (["--warmdown", "nan"], "--warmdown must be a fraction"),
    (["--lr-head", "-0.1"], "--lr-head must be a positive number"),
    (["--lr-matrix", "inf"], "--lr-matrix must be a positive number"),
    (["--device", "foo"], "is not a device"),
    (["--device", "meta"], "runs on cpu or cuda"),
    (["--device", "cuda:7"], "CUDA GPU(s)"),
    (["--overwrite"], "replaces the run in a given --out"),
    (["--out", " "], "--out is empty"),
    (["--seed", "18446744073709551615"], "--seed must be in [0, 2^31)"),
    (["--lr-matrix", "1e300"], "--lr-matrix must be a positive number"),
    (["--data", "hf", "--hf-dataset", "json", "--hf-config", ""], "--hf-dataset json reads --hf-files"),
    (["--device", "cuda"], "sees 0 CUDA GPU(s)"),
    (["--cuda-graph", "--device", "cpu"], "--cuda-graph runs on one GPU"),
    (["--depth", "3"], "depth must be a positive even number"),
    (["--seq-len", "100", "--device-batch", "1", "--batch-tokens", "100", "--recipe", "quartet2"], "multiple of 128"),
    (["--data", "hf", "--hf-dataset", "json", "--hf-config", "", "--hf-files", "/nonexistent.jsonl"],
     "could not stream"),
])
def test_bad_settings_give_a_one_line_error(argv, expected, tmp_path):
    gpus = torch.cuda.device_count()
    if (argv == [] or "cuda" in argv) and gpus or "cuda:7" in argv and gpus > 7:
        pytest.skip("this machine has that GPU")
    if expected == "could not stream" and importlib.util.find_spec("datasets") is None:
        expected = "pip install datasets"  # without the package, that is the one line
    out = [] if "--overwrite" in argv or "--out" in argv else ["--out", str(tmp_path)]
    assert_one_line_error(run(argv + ([] if argv == [] else ["--preset", "tiny"]) + out), expected)


def test_the_readmes_eight_gpu_command_fits_the_d12_step():
    # torchrun --nproc_per_node=8 train.py --device-batch 16: 131,072 tokens a step, 16 x 1024 on each of 8 GPUs;
    # its validation set is cut to a multiple of 16 x 8 windows (the README says: 128 of the sample's 235, not 224)
    eight_gpus = types.SimpleNamespace(device=torch.device("cuda"), distributed=True, world=8)
    args = train.resolve(train.parse_args(["--device-batch", "16"]), eight_gpus)
    assert (args.preset, args.batch_tokens, args.cuda_graph) == ("d12", 2**17, False)
    with pytest.raises(train.TrainingError, match="must be a multiple of seq_len x device_batch x GPUs"):
        train.resolve(train.parse_args([]), eight_gpus)  # 32 x 1024 x 8 is two steps' worth
    documents = train.tokenize(train.gpt2_tokenizer(), train.local_texts("val"))
    windows = [len(train.validation_windows(documents, 1024, 2**18 // 1024, multiple)) for multiple in (32, 128)]
    assert windows == [224, 128]  # one GPU's d12 run, and this command's


def test_bad_files_give_a_one_line_error(small_data, tmp_path):
    (tmp_path / "a_file").write_text("")
    assert_one_line_error(run(tiny_args(small_data, tmp_path / "a_file")), "not a writable directory")
    assert_one_line_error(run(tiny_args(small_data, tmp_path / "a_file" / "out")), "not a writable directory")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    if not os.access(read_only, os.W_OK):  # root can write anywhere
        assert_one_line_error(run(tiny_args(small_data, read_only / "out")), "not a writable directory")
    for name, content in (("truncated", gzip.compress(b'{"text": "a"}\n' * 50)[:40]), ("plain", b'{"text": "a"}\n'),
                          ("no_text", gzip.compress(b'{"body": "a"}\n'))):
        assert_one_line_error(run(tiny_args(bad_data(tmp_path, name, content), tmp_path / f"out_{name}")),
                              "not gzipped JSON lines")


def test_out_of_gpu_memory_says_which_flag_to_lower(small_data, tmp_path, monkeypatch):
    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(train, "train_recipe", out_of_memory)
    assert_one_line_error(run(tiny_args(small_data, tmp_path)), "out of memory", "halve --device-batch")


def test_evaluation_batches_are_whole_multiples_of_128_tokens(small_data, tmp_path):
    # 960 evaluation tokens at seq_len 64 are 15 windows: cut to 14, so every batch of 2 holds 128 tokens
    assert run(tiny_args(small_data, tmp_path, "--recipe", "quartet2", "--steps", "2", "--eval-every", "2",
                         "--eval-tokens", "960")) is None


# --- nothing lost, nothing silently wrong -----------------------------------------------------------------------------

def test_the_default_run_directory_is_new_each_time_and_resume_takes_the_latest(small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = ["--preset", "tiny", "--depth", "2", "--seq-len", "64", "--device-batch", "2", "--batch-tokens", "256",
              "--eval-tokens", "1024", "--data-dir", small_data, "--recipe", "bf16", "--keep-checkpoints"]
    assert run(common + ["--steps", "2"]) is None
    assert run(common + ["--steps", "2"]) is None  # the same command again: a second run, not an error
    runs = sorted(p for p in os.listdir("runs") if p != "latest")
    assert len(runs) == 2 and os.readlink("runs/latest") == runs[1]
    assert run(common + ["--steps", "3", "--resume"]) is None  # extends the newest
    assert [r["step"] for r in train.read_metrics(tmp_path / "runs" / runs[1])] == [1, 2, 3]
    assert [r["step"] for r in train.read_metrics(tmp_path / "runs" / runs[0])] == [1, 2]


def test_a_new_run_deletes_only_its_own_files(small_data, tmp_path):
    # --out goes into no glob: runs named like glob patterns keep their files
    for seed in ("0", "1"):
        assert run(tiny_args(small_data, tmp_path / f"seed{seed}", "--steps", "1", "--recipe", "bf16")) is None
    assert run(tiny_args(small_data, tmp_path / "seed[01]", "--steps", "1", "--recipe", "bf16")) is None
    assert all((tmp_path / f"seed{seed}" / "bf16" / "checkpoint.pt").exists() for seed in "01")
    # a directory that holds no run is not taken, even with --overwrite; its files stay
    other = tmp_path / "other"
    (other / "bf16").mkdir(parents=True)
    (other / "bf16" / "checkpoint.pt").write_bytes(b"not ours")
    (other / "metrics.jsonl").write_text("not ours\n")
    for flags in ((), ("--overwrite",)):
        assert_one_line_error(run(tiny_args(small_data, other, "--steps", "1", *flags)), "not a run of train.py")
    assert (other / "bf16" / "checkpoint.pt").read_bytes() == b"not ours"
    assert (other / "metrics.jsonl").read_text() == "not ours\n"


def test_overwrite_removes_the_previous_runs_summary_and_plot(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16")) is None
    first = json.load(open(tmp_path / "run.json"))["run_id"]
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--overwrite",
                         "--stop-after", "1")) is None
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "loss.png").exists()
    assert json.load(open(tmp_path / "run.json"))["run_id"] != first


def full_disk(monkeypatch, when):
    """os.fsync failing as on a full disk for files whose path contains `when`."""
    fsync, paths = os.fsync, {}
    opened = open

    def recording_open(path, *args, **kwargs):
        f = opened(path, *args, **kwargs)
        with contextlib.suppress(Exception):
            paths[f.fileno()] = str(path)
        return f

    def failing_fsync(fd):
        if when in paths.get(fd, ""):
            raise OSError(errno.ENOSPC, "No space left on device")
        return fsync(fd)
    monkeypatch.setattr("builtins.open", recording_open)
    monkeypatch.setattr(os, "fsync", failing_fsync)


@pytest.mark.parametrize("when", ["checkpoint.pt", "metrics.jsonl", "run.json"])
def test_a_write_error_stops_the_run_and_keeps_the_previous_file(small_data, tmp_path, monkeypatch, when):
    common = ("--steps", "4", "--recipe", "bf16", "--checkpoint-every", "2")
    assert run(tiny_args(small_data, tmp_path, *common, "--stop-after", "2")) is None
    before = {name: (tmp_path / name).read_bytes() for name in ("run.json", "metrics.jsonl", "bf16/checkpoint.pt")}
    with monkeypatch.context() as patch:
        full_disk(patch, when)
        flags = ("--overwrite",) if when == "run.json" else ("--resume",)
        message = run(tiny_args(small_data, tmp_path, *common, *flags))
    assert_one_line_error(message, "could not write", when, "No space left on device")
    failed = next(name for name in before if when in name)  # at the resume's first metrics rewrite, its checkpoint
    assert (tmp_path / failed).read_bytes() == before[failed]  # at step 4, the overwrite's new run.json
    assert not glob.glob(str(tmp_path / "**" / "*.tmp"), recursive=True)


def test_a_killed_runs_temporary_files_are_removed_and_nothing_else(small_data, tmp_path):
    # A run writes FILE.tmp and renames it over FILE (its lock keeps a second writer out): a kill leaves FILE.tmp
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--stop-after", "1")) is None
    left = [tmp_path / "bf16" / "checkpoint.pt.tmp", tmp_path / "metrics.jsonl.tmp", tmp_path / "summary.json.tmp"]
    kept = [tmp_path / "notes.tmp", tmp_path / "bf16" / "checkpoint.pt.4242.tmp"]
    for path in left + kept:
        path.write_bytes(b"x" * 1000)
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--resume")) is None
    assert not any(path.exists() for path in left) and all(path.exists() for path in kept)


def test_resume_refuses_other_data(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path / "run", "--steps", "2", "--recipe", "bf16", "--stop-after",
                         "1")) is None
    copy = tmp_path / "copy"
    shutil.copytree(small_data, copy)
    assert run(tiny_args(str(copy), tmp_path / "run", "--steps", "2", "--recipe", "bf16", "--resume",
                         "--stop-after", "0")) is None  # the same files elsewhere: the same data
    with gzip.open(copy / "fineweb_edu_train_000.jsonl.gz", "at") as f:
        f.write(json.dumps(dict(text="one more document")) + "\n")
    assert_one_line_error(run(tiny_args(str(copy), tmp_path / "run", "--steps", "3", "--recipe", "bf16",
                                        "--resume")), "training data is not the run's")


def test_the_collapse_guard_holds_for_short_and_resumed_runs(small_data, tmp_path):
    # A Muon learning rate of 1e30 leaves the loss at ln(vocabulary): 4 steps are enough to say so, and stopping
    # after 2 and resuming must not hide it
    collapsed = ("--recipe", "bf16", "--lr-matrix", "1e30", "--steps", "4", "--eval-every", "4")
    assert_one_line_error(run(tiny_args(small_data, tmp_path / "short", *collapsed)), "did not learn")
    assert run(tiny_args(small_data, tmp_path / "resumed", *collapsed, "--stop-after", "2")) is None
    assert_one_line_error(run(tiny_args(small_data, tmp_path / "resumed", *collapsed, "--resume")), "did not learn")


def test_a_checkpoint_names_its_recipe_and_recipes_are_not_repeated(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "1", "--recipe", "bf16,quartet2")) is None
    shutil.copy(tmp_path / "bf16" / "checkpoint.pt", tmp_path / "quartet2" / "checkpoint.pt")
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16,quartet2",
                                        "--resume")), "bf16 recipe's, not quartet2's")
    assert_one_line_error(run(tiny_args(small_data, tmp_path / "twice", "--recipe", "bf16,quartet2,bf16")),
                          "more than once")


def test_the_tokenizer_is_read_from_its_file_and_checked(tmp_path, monkeypatch):
    import tiktoken.load
    monkeypatch.setattr(tiktoken.load, "read_file_cached", lambda *a, **k: pytest.fail("tiktoken's cache was read"))
    assert train.gpt2_tokenizer().encode("Hello world") == [15496, 995]
    damaged = tmp_path / "gpt2.tiktoken"
    content = bytearray(open(os.path.join(train.DATA_DIR, "gpt2.tiktoken"), "rb").read())
    content[1000] ^= 1
    damaged.write_bytes(content)
    with pytest.raises(train.TrainingError, match="not GPT-2's vocabulary"):
        train.gpt2_tokenizer(str(damaged))


def test_bad_run_files_give_a_one_line_error(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--stop-after", "1")) is None
    original = (tmp_path / "run.json").read_text()
    for content in ("[1, 2]", '{"run_id": 7, "flags": {}}', '"a string"', "{"):
        (tmp_path / "run.json").write_text(content)
        assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--resume")),
                              "not a run.json of train.py")
    (tmp_path / "run.json").write_text(original)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # lines that are not records: skipped, as a partial line is
        f.write('[1, 2]\n{"recipe": 3, "step": "x"}\n"text"\n')
    assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16", "--resume")) is None
    assert [r["step"] for r in train.read_metrics(tmp_path)] == [1, 2]


def test_bad_documents_give_a_one_line_error(tmp_path):
    null_text = bad_data(tmp_path, "null_text", gzip.compress(b'{"text": null}\n'))
    assert_one_line_error(run(tiny_args(null_text, tmp_path / "a")), "not gzipped JSON lines with a \"text\" string")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "fineweb_edu_train_000.jsonl.gz").write_bytes(gzip.compress(b'{"text": "some words"}\n' * 200))
    (empty / "fineweb_edu_val_000.jsonl.gz").write_bytes(gzip.compress(b'{"text": ""}\n' * 2000))
    assert_one_line_error(run(tiny_args(str(empty), tmp_path / "b")), "validation documents hold no text")


@pytest.mark.parametrize("environment", [dict(WORLD_SIZE="2"), dict(RANK="0"), dict(RANK="3", WORLD_SIZE="2"),
                                         dict(RANK="x", WORLD_SIZE="2"), dict(RANK="0", WORLD_SIZE="0")])
def test_a_process_environment_that_is_not_a_group_is_refused(small_data, tmp_path, monkeypatch, environment):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert_one_line_error(run(tiny_args(small_data, tmp_path, "--steps", "1")), "start several processes with torchrun")


def test_odd_run_directories_and_files_are_handled(small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = [a for a in tiny_args(small_data, "-", "--steps", "1", "--recipe", "bf16") if a != "-"]
    common.remove("--out")  # the default run directory
    assert run(common) is None
    newest = os.path.realpath("runs/latest")
    # --out naming the newest run through its link, with a trailing slash: the run itself, and the link survives
    assert run(common + ["--out", "runs/latest/", "--overwrite"]) is None
    assert os.path.realpath("runs/latest") == newest and (tmp_path / "runs" / "latest" / "summary.json").exists()
    # a damaged run.json can be replaced with --overwrite
    (tmp_path / "runs" / "latest" / "run.json").write_text("junk")
    assert run(common + ["--out", "runs/latest", "--overwrite"]) is None
    # lines of metrics.jsonl that are not records (a missing loss, bytes that are not UTF-8) are skipped
    with open(tmp_path / "runs" / "latest" / "metrics.jsonl", "ab") as f:
        f.write(b'{"recipe": "bf16", "step": 1}\n\xff\xfe\n')
    assert run(common + ["--resume", "--steps", "2"]) is None
    assert [r["step"] for r in train.read_metrics(tmp_path / "runs" / "latest")] == [1, 2]
    # flags of streaming do not define a run of the bundled sample
    assert run(common + ["--resume", "--steps", "2", "--val-docs", "7"]) is None
    # a recipe's directory replaced by a file is found before any training
    shutil.rmtree(tmp_path / "runs" / "latest" / "bf16")
    (tmp_path / "runs" / "latest" / "bf16").write_text("not a directory")
    message = run(common + ["--resume", "--steps", "3"])
    assert "bf16 is not a directory" in message and "move it away" in message, message
    os.remove(tmp_path / "runs" / "latest" / "bf16")
    os.symlink("nowhere", tmp_path / "runs" / "latest" / "bf16")  # a broken link
    assert "bf16 is not a directory" in run(common + ["--resume", "--steps", "3"])
    assert [r["step"] for r in train.read_metrics(tmp_path / "runs" / "latest")] == [1, 2]


def test_an_interrupted_run_says_how_to_continue(small_data, tmp_path, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "evaluate", interrupt)
    message = run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", "bf16"))
    assert message == "train.py: interrupted; --resume continues from the last checkpoint"


# --- what an adversarial probe found ---------------------------------------------------------------------------------

def test_resume_refuses_a_recipe_whose_checkpoint_is_gone_and_starts_one_that_never_began(small_data, tmp_path):
    both = ("--steps", "2", "--recipe", "bf16,quartet2")
    assert run(tiny_args(small_data, tmp_path, *both, "--stop-after", "1")) is None
    with open(tmp_path / "metrics.jsonl", "a") as f:  # quartet2 killed before its first checkpoint: it starts over
        f.write(json.dumps(dict(recipe="quartet2", step=1, loss=10.0)) + "\n")
    saved = (tmp_path / "bf16" / "checkpoint.pt").read_bytes()
    os.remove(tmp_path / "bf16" / "checkpoint.pt")
    assert_one_line_error(run(tiny_args(small_data, tmp_path, *both, "--resume")),
                          os.path.join("bf16", "checkpoint.pt") + " not found", "restore it")
    (tmp_path / "bf16" / "checkpoint.pt").write_bytes(saved)
    assert run(tiny_args(small_data, tmp_path, *both, "--resume")) is None
    assert [(r["recipe"], r["step"]) for r in train.read_metrics(tmp_path)] == [
        ("bf16", 1), ("bf16", 2), ("quartet2", 1), ("quartet2", 2)]


def test_a_directory_that_holds_no_run_is_refused_untouched(small_data, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    names = {"notes.txt": b"mine", "metrics.jsonl.tmp": b"mine too", "checkpoint.pt.17.tmp": b"and this"}
    for name, content in names.items():
        (other / name).write_bytes(content)
    assert_one_line_error(run(tiny_args(small_data, other, "--steps", "1")), "not a run of train.py")
    assert {p.name: p.read_bytes() for p in other.iterdir()} == names  # no file removed, no .lock left


def test_a_planted_lock_link_is_refused_not_followed(small_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(tmp_path / "elsewhere", out / ".lock")
    assert_one_line_error(run(tiny_args(small_data, out, "--steps", "1")), "its .lock is not a file")
    assert not os.path.lexists(tmp_path / "elsewhere")


def test_runs_started_together_do_not_collide_on_runs_latest(tmp_path, monkeypatch):
    # Between one run's link and its rename, another run points runs/latest at itself: each uses a name of its own
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        os.makedirs(os.path.join("runs", name))
    replace = os.replace

    def interleaved(source, target):
        monkeypatch.setattr(os, "replace", replace)
        with monkeypatch.context() as other:
            other.setattr(os, "getpid", lambda: 999999)
            train.make_latest(os.path.join("runs", "b"))
        replace(source, target)
    monkeypatch.setattr(os, "replace", interleaved)
    train.make_latest(os.path.join("runs", "a"))
    assert os.readlink(os.path.join("runs", "latest")) == "a" and sorted(os.listdir("runs")) == ["a", "b", "latest"]


def test_a_run_that_fails_before_its_first_step_does_not_become_the_latest(small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = [a for a in tiny_args(small_data, "-", "--steps", "1", "--recipe", "bf16") if a not in ("-", "--out")]
    assert run(common) is None
    finished = os.path.realpath("runs/latest")
    with monkeypatch.context() as patch:
        patch.setattr(train, "train_step", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
        assert "interrupted" in run(common)
    assert len(os.listdir("runs")) == 3 and os.path.realpath("runs/latest") == finished
    assert run(common + ["--resume", "--steps", "2"]) is None  # a plain --resume continues the run that trained
    assert [r["step"] for r in train.read_metrics(finished)] == [1, 2]


def test_a_failed_write_says_that_a_previous_version_is_kept_only_if_there_is_one(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    (tmp_path / "old.json").write_text("{}")
    for name, kept in (("new.json", False), ("old.json", True)):
        with pytest.raises(train.TrainingError) as error:
            train.write_atomically(str(tmp_path / name), b"[]")
        assert ("its previous version is kept" in str(error.value)) == kept
    assert (tmp_path / "old.json").read_text() == "{}" and sorted(os.listdir(tmp_path)) == ["old.json"]


def test_empty_training_data_is_a_one_line_error(small_data, tmp_path):
    empty = tmp_path / "empty"
    shutil.copytree(small_data, empty)
    (empty / "fineweb_edu_train_000.jsonl.gz").write_bytes(gzip.compress(b""))
    assert_one_line_error(run(tiny_args(str(empty), tmp_path / "out")), "no train documents")


def test_a_gpu_refuses_float32_quantized_training():
    one_gpu = types.SimpleNamespace(device=torch.device("cuda"), distributed=False, world=1)
    with pytest.raises(train.TrainingError, match="the NVFP4 kernels take bfloat16 on a GPU: use --dtype bfloat16"):
        train.resolve(train.parse_args(["--preset", "tiny", "--dtype", "float32", "--recipe", "quartet2"]), one_gpu)
    assert train.resolve(train.parse_args(["--preset", "tiny", "--dtype", "float32", "--recipe", "bf16"]), one_gpu)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), distributed=False, world=1)
    assert train.resolve(train.parse_args(["--preset", "tiny", "--recipe", "quartet2"]), cpu).dtype == "float32"
