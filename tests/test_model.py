"""model.py: the recipes' GEMM wiring, the Quartet II forward and backward, and the GPT."""

from dataclasses import dataclass

import pytest
import torch

import model
import train
from model import GPT, Linear, Quartet2Linear
from quantize import quantize_nvfp4


@dataclass
class Plain:
    """A stand-in for an NVFP4 tensor that holds its input unchanged."""
    value: torch.Tensor

    def packed(self):
        return self

    def t(self):
        return Plain(self.value.t())


class NoQuantization:
    """The ops of kernels.py with quantization (and rotation) switched off: every quantizer returns its input,
    transposed where asked, and the GEMM is a plain a @ b^T."""

    @staticmethod
    def quantize(x, transpose=False, **_):
        return Plain(x.t() if transpose else x)

    @staticmethod
    def ms_eden_pair(x, signs):
        return Plain(x), Plain(x.t())

    @staticmethod
    def requantize_ms_eden(q, signs, out_dtype):
        return Plain(q.value.t())

    @staticmethod
    def nvfp4_mm(a, b, out_dtype):
        return a.value @ b.value.t()

    @staticmethod
    def save_for_backward(ctx, *items):
        ctx.items = items

    @staticmethod
    def saved_tensors(ctx):
        return ctx.items


@pytest.mark.parametrize("recipe", ["quartet2", "nvidia"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recipes_without_quantization_are_exactly_bf16(recipe, dtype, monkeypatch):
    monkeypatch.setattr(model, "ops", NoQuantization)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, 256, generator=g).to(dtype)
    e = torch.randn(2, 128, 384, generator=g).to(dtype)
    results = []
    for name in ("bf16", recipe):
        torch.manual_seed(1)
        layer = Linear(256, 384, name)
        torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(2))
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(e)
        results.append((out, inputs.grad, layer.weight.grad))
    for reference, ours in zip(*results):
        assert torch.equal(reference, ours)


def test_quartet2_forward_is_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 384, generator=g), torch.randn(128, 384, generator=g)
    out = Quartet2Linear.apply(x, w)
    exact = (quantize_nvfp4(x, four_over_six=True).dequantize().double()
             @ quantize_nvfp4(w, four_over_six=True).dequantize().double().t())
    assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-6  # FP32 round-off


def test_quartet2_backward_is_unbiased_for_the_quantized_forward():
    # The exact gradient of the quantized forward Y = Xq Wq^T is dX = E Wq and dW = E^T Xq. Averaging B backward
    # passes (fresh signs and coins each) gives error variance/B + bias^2: B * error(B) must stay flat (+-15%:
    # the relative error of the estimate is ~sqrt(2/number of independent groups) ~ 3% here).
    g = torch.Generator().manual_seed(4)
    x, w, e = torch.randn(128, 256, generator=g), torch.randn(384, 256, generator=g) / 16, torch.randn(128, 384,
                                                                                                     generator=g)
    xq = quantize_nvfp4(x, four_over_six=True).dequantize().double()
    wq = quantize_nvfp4(w, four_over_six=True).dequantize().double()
    exact = (e.double() @ wq, e.double().t() @ xq)
    torch.manual_seed(5)
    sums = [torch.zeros_like(t) for t in exact]
    growth = []
    for b in range(1, 257):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        Quartet2Linear.apply(xr, wr).backward(e)
        for total, grad in zip(sums, (xr.grad, wr.grad)):
            total += grad.double()
        if b in (1, 4, 16, 64, 256):
            growth.append([b * ((total / b - ref).norm() ** 2 / ref.norm() ** 2).item()
                           for total, ref in zip(sums, exact)])
    for per_gradient in zip(*growth):
        assert all(0.85 < r / per_gradient[0] < 1.15 for r in per_gradient), growth


def test_nvidia_recipe_gradients_are_close_to_exact():
    g = torch.Generator().manual_seed(6)
    x, w, e = torch.randn(128, 256, generator=g), torch.randn(128, 256, generator=g), torch.randn(128, 128,
                                                                                                 generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    model.NvidiaLinear.apply(xr, wr).backward(e)
    for grad, exact in ((xr.grad, e @ w), (wr.grad, e.t() @ x)):
        error = ((grad - exact).norm() ** 2 / exact.norm() ** 2).item()
        assert 0.005 < error < 0.1  # NVFP4 noise: present, but at the level of a few quantizations


def overfit(recipe, steps=40):
    torch.manual_seed(0)
    gpt = GPT(2, recipe, max_seq_len=64)
    optimizers = train.make_optimizers(gpt, train.parse_args([]))
    batch = torch.randint(0, 50257, (2, 65), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = gpt(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        gpt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["bf16", "quartet2", "nvidia"])
def test_tiny_model_overfits_a_batch(recipe):
    losses = overfit(recipe)
    assert losses[0] == pytest.approx(10.825, abs=0.01)  # ln(50257): the zero-initialized head
    assert losses[-1] < 0.5 * losses[0]


def test_model_shapes_and_bad_sizes():
    gpt = GPT(2)
    assert gpt.width == 128 and len(gpt.blocks) == 2 and gpt.embedding.weight.shape == (50304, 128)
    assert gpt(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 50257)
    with pytest.raises(ValueError, match="multiple of 128"):
        GPT(3)
    with pytest.raises(ValueError, match="multiples of 128"):
        Linear(100, 128, "quartet2")
    with pytest.raises(ValueError, match="recipe must be one of"):
        Linear(128, 128, "fp8")
    with pytest.raises(ValueError, match="tokens per micro-batch"):
        Linear(128, 128, "quartet2")(torch.randn(3, 20, 128))
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        GPT(2, max_seq_len=16)(torch.zeros(1, 32, dtype=torch.long))
