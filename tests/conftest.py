"""Shared test helpers. Without a GPU, Triton's kernels run in its CPU interpreter (set before triton.jit runs)."""

import gzip
import json
import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ALL_E4M3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 ... 448, no NaN


def grid_neighbours(values, grid):
    """The values of a sorted non-negative grid just below and just above each of |values| (equal if on it)."""
    magnitude = values.abs().flatten()
    lower = grid[torch.searchsorted(grid, magnitude, right=True) - 1]
    upper = grid[torch.searchsorted(grid, magnitude).clamp(max=len(grid) - 1)]
    return lower.view_as(values), upper.view_as(values)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A few bundled documents in the bundled layout (fast to tokenize)."""
    import train  # after TRITON_INTERPRET is set above
    folder = tmp_path_factory.mktemp("data")
    for split, count in (("train", 60), ("val", 12)):
        texts = train.local_texts(split)[:count]
        with gzip.open(folder / f"fineweb_edu_{split}_000.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(dict(text=text)) + "\n" for text in texts)
    return str(folder)


def random_gpt(recipe, seed=0):
    """A depth-2 GPT of the recipe with every weight random (none zero-initialized: every gradient is non-trivial),
    and a batch of 2 x 65 tokens."""
    from model import GPT
    torch.manual_seed(seed)
    gpt = GPT(2, recipe, max_seq_len=64)
    with torch.no_grad():  # no zero-initialized layers: every gradient is non-trivial
        for p in gpt.parameters():
            p.normal_(0, 0.05)
    return gpt, torch.randint(0, 50257, (2, 65), generator=torch.Generator().manual_seed(seed))


def forward_backward(gpt, runner, tokens, seed):
    """(loss, gradients) of one forward + backward through runner (gpt or a compiled gpt), from torch seed `seed`."""
    torch.manual_seed(seed)
    loss = runner(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in gpt.parameters()]
    gpt.zero_grad(set_to_none=True)
    return loss.detach(), grads


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(items):
    """Tests marked gpu need CUDA: skipped without it."""
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
