"""train.py: data, bits per byte, checkpoints and resume, DDP, and its errors."""

import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A few bundled documents in the bundled layout (fast to tokenize)."""
    folder = tmp_path_factory.mktemp("data")
    for split, count in (("train", 60), ("val", 12)):
        texts = train.local_texts(split)[:count]
        with gzip.open(folder / f"fineweb_edu_{split}_000.jsonl.gz", "wt", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps(dict(text=text)) + "\n")
    return str(folder)


def tiny_args(data_dir, out, *extra):
    return ["--preset", "tiny", "--depth", "2", "--seq-len", "64", "--device-batch", "2", "--batch-tokens", "256",
            "--eval-every", "5", "--eval-tokens", "1024", "--data-dir", data_dir, "--out", str(out), *extra]


def test_tokenizer_is_gpt2_offline():
    tokenizer = train.gpt2_tokenizer()
    assert tokenizer.encode("Hello world") == [15496, 995] and tokenizer.n_vocab == 50257
    lengths = train.token_bytes(tokenizer)
    assert lengths[train.EOT] == 0 and lengths[tokenizer.encode(" the")[0]] == 4


def test_bits_per_byte_on_a_hand_made_example():
    bytes_per_token = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)  # token 3 is special
    losses = torch.tensor([0.5, 1.0, 2.0, 5.0])
    targets = torch.tensor([0, 1, 2, 3])
    loss_sum, byte_sum = train.bpb_sums(losses, targets, bytes_per_token)
    assert loss_sum.item() == 3.5 and byte_sum.item() == 6.0  # the special token counts in neither sum
    assert loss_sum / (math.log(2) * byte_sum) == pytest.approx(3.5 / (6 * math.log(2)))


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


def test_validation_windows_are_fixed(small_data):
    tokenizer = train.gpt2_tokenizer()
    documents = train.tokenize(tokenizer, train.local_texts("val", small_data))
    a, b = train.validation_windows(documents, 64, 10), train.validation_windows(documents, 64, 10)
    assert a.shape == (10, 65) and torch.equal(a, b)
    assert a.flatten().tolist() == np.concatenate(documents)[:650].tolist()


def test_streaming_through_datasets_on_a_local_file(tmp_path):
    texts = [f"document number {i}." for i in range(7)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(dict(text=t)) + "\n" for t in texts))
    assert list(train.streamed_texts("json", data_files=[str(path)])) == texts
    args = train.parse_args(["--data", "hf", "--hf-dataset", "json", "--hf-config", "", "--hf-files", str(path),
                             "--val-docs", "2"])
    tokenizer = train.gpt2_tokenizer()
    documents, validation = train.data_sources(args, tokenizer)
    decode = lambda tokens: tokenizer.decode(tokens[:-1].tolist())
    assert [decode(t) for t in validation] == texts[:2]
    assert [decode(t) for t in documents(0, 1)] == texts[3:]  # training starts after the validation documents


def run(argv):
    try:
        train.main(argv)
    except SystemExit as exit_:
        return str(exit_.code)
    return None


def test_tiny_run_writes_metrics_summary_and_plot(small_data, tmp_path):
    assert run(tiny_args(small_data, tmp_path, "--steps", "5", "--recipe", "bf16,quartet2")) is None
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["recipe"] for r in records] == ["bf16"] * 5 + ["quartet2"] * 5
    summary = json.load(open(tmp_path / "summary.json"))
    assert [r["recipe"] for r in summary["rows"]] == ["bf16", "quartet2"]
    assert summary["rows"][0]["gap_pct"] == 0 and math.isfinite(summary["rows"][1]["val_bpb"])
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "loss.png").exists() == has_matplotlib


def test_separate_invocations_keep_each_others_metrics(small_data, tmp_path):
    for recipe in ("bf16", "quartet2", "bf16"):  # the second bf16 run replaces the first one's records only
        assert run(tiny_args(small_data, tmp_path, "--steps", "2", "--recipe", recipe)) is None
    recipes = [json.loads(line)["recipe"] for line in open(tmp_path / "metrics.jsonl")]
    assert sorted(recipes) == ["bf16", "bf16", "quartet2", "quartet2"]


def final_state(out, recipe):
    return torch.load(os.path.join(out, recipe, "checkpoint.pt"), weights_only=False)


@pytest.mark.parametrize("recipe", ["bf16", "quartet2"])
def test_resume_is_bit_exact(small_data, tmp_path, recipe):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--steps", "20", "--recipe", recipe, "--checkpoint-every", "7")
    assert run(tiny_args(small_data, straight, *common)) is None
    assert run(tiny_args(small_data, resumed, *common, "--stop-after", "10")) is None
    assert final_state(resumed, recipe)["step"] == 10
    assert run(tiny_args(small_data, resumed, *common, "--resume")) is None
    a, b = final_state(straight, recipe), final_state(resumed, recipe)
    assert a["step"] == b["step"] == 20
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    losses = lambda out: [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    assert losses(straight) == losses(resumed)


def test_two_processes_match_one(small_data, tmp_path):
    single, double = (tiny_args(small_data, tmp_path / name, "--steps", "3", "--recipe", "bf16", "--device", "cpu")
                      for name in ("one", "two"))
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "train.py", *single], cwd=ROOT, check=True, env=environment,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29517",
                    "train.py", *double], cwd=ROOT, check=True, env=environment, capture_output=True)
    # Weights are a poor yardstick here: Adam's first steps move every coordinate by ~lr whatever the size of its
    # gradient, so float noise in a near-zero gradient flips a whole step. The losses are sharp: step 1 sees the
    # same weights (same data split, same averaging), and later steps see the result of the averaged gradients.
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl")] for name in ("one", "two")]
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    summaries = [json.load(open(tmp_path / name / "summary.json")) for name in ("one", "two")]
    assert summaries[1]["world_size"] == 2
    assert summaries[0]["rows"][0]["val_bpb"] == pytest.approx(summaries[1]["rows"][0]["val_bpb"], rel=1e-4)


def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(small_data, tmp_path):
    # An embedding learning rate of 1e37 (Adam moves each weight by ~lr per step) overflows float32 in ~15 steps.
    message = run(tiny_args(small_data, tmp_path, "--steps", "40", "--recipe", "bf16", "--checkpoint-every", "1",
                            "--lr-embedding", "1e37"))
    assert message and "non-finite" in message and "at step" in message and "\n" not in message
    step = int(message.split("at step ")[1].split(";")[0])
    saved = final_state(tmp_path, "bf16")
    assert saved["step"] == step - 1  # the last good step, with finite weights
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


@pytest.mark.parametrize("argv,expected", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--recipe", "fp8"], "unknown recipe"),
    ([], "no GPU found"),
    (["--preset", "tiny", "--data-dir", "/nonexistent"], "no train data"),
    (["--preset", "tiny", "--batch-tokens", "1000"], "must be a multiple of seq_len x device_batch"),
    (["--preset", "tiny", "--depth", "3"], "--depth must be even"),
    (["--preset", "tiny", "--seq-len", "100", "--device-batch", "1", "--batch-tokens", "100"],
     "multiple of 128"),
])
def test_bad_settings_give_a_one_line_error(argv, expected):
    if argv == [] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if "--recipe" in argv:
        argv = argv + ["--preset", "tiny"]
    message = run(argv)
    assert message and expected in message and "\n" not in message
