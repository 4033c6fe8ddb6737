"""model.py: the recipes' GEMM wiring, the Quartet II forward and backward, the GPT, and the GPT under torch.compile."""

import pytest
import torch
import torch._dynamo

import bench
import kernels
import model
import train
from conftest import forward_backward, random_gpt
from eden import random_signs
from model import GPT, RECIPES, Linear, RecipeLinear
from quantize import SR_FP4_MAX, quantize_nvfp4


def identity_quantizers(monkeypatch):
    """Every quantizer of model.py replaced by the identity (transposed where asked)."""
    monkeypatch.setattr(model, "quantize_operand", lambda t, q, signs, transpose=False: t.t() if transpose else t)
    monkeypatch.setattr(model, "quantize_gradient", lambda e, e_dx, e_dw, signs: (e, e.t()))


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_recipe_without_quantization_is_exactly_bf16(recipe, dtype, monkeypatch):
    identity_quantizers(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, w, e = (torch.randn(*shape, generator=g).to(dtype) for shape in ((256, 256), (384, 256), (256, 384)))
    results = []
    for name in ("bf16", recipe):
        inputs, weight = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = RecipeLinear.apply(inputs, weight, name)
        out.backward(e)
        results.append((out, inputs.grad, weight.grad))
    for reference, ours in zip(*results):
        assert torch.equal(reference, ours)


def test_a_rotation_must_be_shared_by_both_operands_of_a_gemm():
    with pytest.raises(ValueError, match="shared by both operands"):
        model.Recipe(e_dx=model.SR128, w_dx=model.SR)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "bf16"])
def test_the_forward_is_the_product_of_the_dequantized_operands(recipe):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 384, generator=g), torch.randn(128, 384, generator=g)
    out = RecipeLinear.apply(x, w, recipe)
    exact = bench.forward_operand(x, RECIPES[recipe].x) @ bench.forward_operand(w, RECIPES[recipe].w).t()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-6  # FP32 round-off
    if RECIPES[recipe].x is None:  # backward-only ablations: the forward is exactly BF16's
        assert torch.equal(out, x @ w.t())


@pytest.mark.parametrize("recipe", ["fwd_1x16", "fwd_1x16_46", "fwd_16x16", "fwd_16x16_46"])
def test_forward_only_recipes_have_an_exact_backward_of_the_quantized_forward(recipe):
    g = torch.Generator().manual_seed(4)
    x, w, e = torch.randn(128, 256, generator=g), torch.randn(384, 256, generator=g), torch.randn(128, 384, generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    RecipeLinear.apply(xr, wr, recipe).backward(e)
    r = RECIPES[recipe]
    xq = quantize_nvfp4(x, r.x.rounding, r.x.four_over_six, r.x.block).dequantize()
    wq = quantize_nvfp4(w, r.w.rounding, r.w.four_over_six, r.w.block).dequantize()
    for ours, exact in ((xr.grad, e.double() @ wq.double()), (wr.grad, e.double().t() @ xq.double())):
        assert ((ours.double() - exact).norm() / exact.norm()).item() < 1e-6


# Unbiased for the quantized forward: every recipe whose backward rounds stochastically or with MS-EDEN and
# re-quantizes the forward's operands. Not the NVIDIA recipe: its dW rounds the rotated, unquantized X to nearest, a
# small bias (bench.py grad measures it) on top of an unbiased estimate of E^T X.
UNBIASED = ["quartet2", "quartet2_no46", "tetrajet2", "bwd_a_sr", "bwd_c_eden", "bwd_e_sr", "bwd_e_eden"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", UNBIASED)
def test_backward_is_unbiased_for_the_quantized_forward(recipe):
    # Averaging B backward passes (fresh signs and coins each) gives error variance/B + bias^2: B * error(B) must
    # stay flat. The relative error of the estimate is ~sqrt(2/number of independent groups) ~ 3% here, so +-15%
    # is a 5-sigma band. dW by blocks of 128 rows: W stacks three weights, as the fused q, k, v GEMM does, and each
    # block (one weight's gradient) must be unbiased on its own although all share one set of signs.
    g = torch.Generator().manual_seed(4)
    x, w, e = torch.randn(128, 256, generator=g), torch.randn(384, 256, generator=g) / 16, torch.randn(128, 384,
                                                                                                     generator=g)
    exact = bench.exact_gradients(RECIPES[recipe], x, w, e)
    torch.manual_seed(5)
    sums = [torch.zeros_like(t) for t in exact]
    growth = []
    for b in range(1, 257):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        RecipeLinear.apply(xr, wr, recipe).backward(e)
        for total, grad in zip(sums, (xr.grad, wr.grad)):
            total += grad.double()
        if b in (1, 4, 16, 64, 256):
            parts = [(sums[0], exact[0])] + [(sums[1][i:i + 128], exact[1][i:i + 128]) for i in (0, 128, 256)]
            growth.append([b * ((total / b - ref).norm() ** 2 / ref.norm() ** 2).item() for total, ref in parts])
    for per_gradient in zip(*growth):
        quantized = per_gradient[0] > 1e-12  # a pass the recipe leaves exact has no error to average
        assert not quantized or all(0.85 < r / per_gradient[0] < 1.15 for r in per_gradient), growth


def test_the_backward_draws_one_rotation_for_its_four_operands(monkeypatch):
    drawn = []
    draw_signs = kernels.draw_signs
    monkeypatch.setattr(kernels, "draw_signs", lambda e: drawn.append(e.shape) or draw_signs(e))
    used = []
    quantize_op = kernels.quantize_op
    monkeypatch.setattr(kernels, "quantize_op", lambda *a, signs=None, **k: used.append(signs) or quantize_op(
        *a, signs=signs, **k))
    x, w = torch.randn(128, 256, requires_grad=True), torch.randn(256, 256, requires_grad=True)
    RecipeLinear.apply(x, w, "tetrajet2").sum().backward()  # a 32-wide rotation of E, W^T, E^T and X^T
    assert drawn == [(128, 256)] and len(used) == 6 and used[:2] == [None, None]  # one draw, in the backward
    assert all(torch.equal(signs, used[2]) and len(signs) == 32 for signs in used[2:])


def test_nvidia_recipe_gradient_error_is_the_sum_of_its_operands_errors():
    # For independent Gaussian operands, ||dA B + A dB||^2 / ||AB||^2 ~ e(A) + e(B) (relative squared errors):
    # dX = SR(E) W16x16: 23.5e-3 + 12.4e-3; dW = SR(RHT16 E^T) RTN(RHT16 X^T): 23.5e-3 + 9.0e-3 (paper Table 1).
    # The estimate of each from one 256x256 product has a spread of a few percent: +-20% is a safe band.
    g = torch.Generator().manual_seed(6)
    x, w, e = (torch.randn(256, 256, generator=g) for _ in range(3))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    RecipeLinear.apply(xr, wr, "nvidia").backward(e)
    for grad, exact, expected in ((xr.grad, e @ w, 0.0359), (wr.grad, e.t() @ x, 0.0325)):
        error = ((grad - exact).norm() ** 2 / exact.norm() ** 2).item()
        assert 0.8 * expected < error < 1.2 * expected, (error, expected)


def overfit(recipe, steps=40):
    torch.manual_seed(0)
    gpt = GPT(2, recipe, max_seq_len=64)
    flags = train.parse_args([])
    optimizers = model.make_optimizers(gpt, flags.lr_matrix, flags.lr_embedding, flags.lr_head)
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


@pytest.mark.slow
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
    with pytest.raises(ValueError, match="tokens per micro-batch"):  # the autograd Function itself checks
        RecipeLinear.apply(torch.randn(16, 128, requires_grad=True), torch.randn(128, 128), "quartet2")
    with pytest.raises(ValueError, match="unknown recipe"):
        RecipeLinear.apply(torch.randn(128, 128), torch.randn(128, 128), "quartet9")
    for bad in (torch.ones(2, 128, dtype=torch.long), torch.tensor(1.0)):
        with pytest.raises(ValueError, match="floating-point input"):
            Linear(128, 128)(bad)
    for tokens in (torch.zeros(1, 32, dtype=torch.long), torch.zeros(16, dtype=torch.long), torch.zeros(1, 16)):
        with pytest.raises(ValueError, match="takes token ids"):
            GPT(2, max_seq_len=16)(tokens)


def test_the_gpt_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="vocabulary and a context of at least 1"):
        GPT(2, vocab_size=0)
    gpt, tokens = GPT(2, max_seq_len=16), torch.zeros(1, 8, dtype=torch.long)
    for empty in (torch.zeros(0, 8, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="takes token ids"):
            gpt(empty)
    with pytest.raises(ValueError, match="targets of their shape"):
        gpt(tokens, tokens[:, 1:])
    with pytest.raises(ValueError, match="every target is -100"):  # a mean over no targets would be NaN
        gpt(tokens, torch.full_like(tokens, -100))
    assert gpt(tokens, torch.tensor([[-100] * 7 + [3]])).isfinite()  # some ignored: the mean over the others
    for bad in (dict(max_new_tokens=-1), dict(max_new_tokens=1, temperature=0), dict(max_new_tokens=1, top_k=0)):
        with pytest.raises(ValueError, match="generate needs"):
            gpt.generate(tokens, **bad)


@pytest.mark.parametrize("recipe", ["bf16", "quartet2"])
def test_generation_is_deterministic_for_a_seed_and_stops_at_the_requested_length(recipe):
    gpt = random_gpt(recipe)[0]  # max_seq_len 64: a quantized forward pads the context to 2 rows of 64 tokens
    prompt = torch.tensor([[464, 3616, 286]])
    length = 70 if recipe == "bf16" else 3  # bf16 goes past max_seq_len: the context is cropped to its last 64

    def draw(seed, new_tokens=length, top_k=50):
        return gpt.generate(prompt, new_tokens, 0.8, top_k, generator=torch.Generator().manual_seed(seed))
    state = torch.get_rng_state()
    first = draw(0)
    assert torch.equal(torch.get_rng_state(), state)  # the generator's draws only: training's randomness untouched
    assert first.shape == (1, 3 + length) and torch.equal(first[:, :3], prompt) and torch.equal(first, draw(0))
    assert not torch.equal(first, draw(1)) and torch.equal(draw(0, 0), prompt)
    greedy = draw(0, 1, top_k=1)[0, -1]  # the most likely token after the prompt's last
    if recipe == "bf16":
        assert greedy == gpt(prompt)[0, -1].argmax()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_double_backward_and_a_second_backward_raise(recipe):
    x, w = torch.randn(128, 128, requires_grad=True), torch.randn(128, 128, requires_grad=True)
    y = RecipeLinear.apply(x, w, recipe)
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dx.sum().backward()  # the quantizers have no derivative: refused, not silently wrong
    y = RecipeLinear.apply(x, w, recipe)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()  # saved tensors were freed: no doubled gradients


def test_stacked_qkv_weights_stay_separate_parameters():
    gpt = GPT(2, "quartet2")
    attention = gpt.blocks[0].attn
    assert all(layer.weight.shape == (128, 128) for layer in (attention.c_q, attention.c_k, attention.c_v))
    assert len(gpt.matrix_parameters()) == 2 * 6  # Muon updates every matrix on its own


# --- torch.compile -------------------------------------------------------------------------------------------------

MAIN_RECIPES = ("bf16", "quartet2", "nvidia")  # every recipe is checked; the others among the slow tests


@pytest.mark.parametrize("recipe", [r if r in MAIN_RECIPES else pytest.param(r, marks=pytest.mark.slow)
                                    for r in RECIPES])
def test_the_whole_gpt_compiles_as_one_graph_and_matches_eager(recipe):
    gpt, tokens = random_gpt(recipe)
    explanation = torch._dynamo.explain(gpt)(tokens[:, :-1], tokens[:, 1:])
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    # aot_eager traces exactly what inductor compiles (dynamo + the autograd graph, through the operators' fake
    # versions) but runs the same aten operations as eager: the results must be bit-identical, the quantized
    # backward included (its randomness is drawn from the same generator in the same order).
    compiled = torch.compile(gpt, fullgraph=True, backend="aot_eager")
    eager_loss, eager_grads = forward_backward(gpt, gpt, tokens, seed=1)
    loss, grads = forward_backward(gpt, compiled, tokens, seed=1)
    assert torch.equal(loss, eager_loss) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    _, fresh = forward_backward(gpt, compiled, tokens, seed=2)  # another draw of the randomness
    r = RECIPES[recipe]
    random = any(q is not None and q.rounding != "rtn" for q in (r.e_dx, r.w_dx, r.e_dw, r.x_dw))
    assert any(not torch.equal(a, b) for a, b in zip(grads, fresh)) == random


@pytest.mark.slow
def test_inductor_compiled_quartet2_step_draws_fresh_randomness():
    gpt, tokens = random_gpt("quartet2")
    compiled = torch.compile(gpt, fullgraph=True)
    eager_loss, eager_grads = forward_backward(gpt, gpt, tokens, seed=1)
    (loss, grads), (_, again), (_, fresh) = (forward_backward(gpt, compiled, tokens, seed) for seed in (1, 1, 2))
    assert abs(loss.item() - eager_loss.item()) < 1e-4  # the forward is deterministic; inductor fuses its float ops
    assert all(torch.equal(a, b) for a, b in zip(grads, again))  # seeded: reproducible
    assert all(not torch.equal(a, b) for a, b in zip(grads[:-1], fresh[:-1]))  # all but lm_head (its gradient is
    # the forward's) depend on the quantized backward, which redraws its signs and coins
    for ours, reference in zip(grads, eager_grads):  # the same estimator: errors at the noise level of one draw
        assert ours.isfinite().all() and ((ours - reference).norm() <= reference.norm()).item()


@pytest.mark.parametrize("case", ["quantize", "quantize_sr_rotated", "ms_eden_pair", "requantize_ms_eden"])
def test_operators_pass_opcheck(case):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 128, generator=g)
    signs, seed = random_signs(128, generator=g), torch.tensor([1234])
    q = kernels.quantize_op(x, four_over_six=True)
    args = dict(
        quantize=(torch.ops.nanoquartet.quantize, (x, None, None, "rtn", True, "1x16", 6.0, False, True)),
        quantize_sr_rotated=(torch.ops.nanoquartet.quantize, (x, signs[:16], seed, "sr", False, "1x16", SR_FP4_MAX,
                                                              True, False)),
        ms_eden_pair=(torch.ops.nanoquartet.ms_eden_pair, (x, signs, seed, True)),
        requantize_ms_eden=(torch.ops.nanoquartet.requantize_ms_eden, (q.codes, q.group_scale.view(torch.uint8),
                                                                       q.tensor_scale, signs, seed, False)))[case]
    torch.library.opcheck(*args)
