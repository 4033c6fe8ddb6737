"""
The Nanochat GPT, the linear-layer recipes it can train with, and its optimizers.

A linear layer Y = X W^T (X [T, in] for T tokens, W [out, in]) costs three GEMMs: the forward Y = X W^T and, given
E = dL/dY [T, out], the backward dX = E W and dW = E^T X. A recipe says how each operand of each GEMM is quantized,
always along the GEMM's inner dimension; RECIPES below is one row per recipe:

    recipe     Y = X W^T                 dX = E W                                dW = E^T X
    bf16       X, W in BF16              E, W in BF16                            E^T, X^T in BF16
    quartet2   X, W: RTN 1x16 + 4/6      E: MS-EDEN; W^T: the forward's W,       E^T: MS-EDEN; X^T: the forward's X,
                                         re-quantized with MS-EDEN               re-quantized with MS-EDEN
    nvidia     X: RTN 1x16, W: RTN 16x16 E: SR 1x16; W^T: the forward's 16x16 W  E^T: SR of RHT16(E^T); X^T: RTN of
                                         (a tile's scale serves W and W^T)       RHT16 of the unquantized X^T
    tetrajet2  X, W: RTN 1x16            E, W^T: a 32-wide random rotation, then SR, on E and on the forward's W and
                                         X (as the Quartet II paper re-implemented TetraJet-v2's core)

(SR: stochastic rounding with fp4_max 6 * 16/17; RHT16: a 16-wide random-sign Hadamard rotation.) The paper's
ablations are rows too: quartet2_no46 and nvidia46 (four-over-six off and on), forward-only recipes (fwd_*: the
backward in BF16 on the forward's quantized operands) and backward-only ones (bwd_*: the forward in BF16; (a) only
dW quantized, (c) only dX, (e) both; with SR or MS-EDEN, rotations of 128).

Quartet II keeps the forward as accurate as possible (RTN with four-over-six is biased but has the lowest error) and
makes the backward unbiased with MS-EDEN, so that the gradient is an unbiased estimate of the gradient of the
*quantized* forward. That is why it re-quantizes the forward's quantized X and W (not the BF16 originals): only their
packed NVFP4 forms are saved for the backward (0.56 bytes per element instead of 2). The operands of a backward GEMM
share one set of random signs, so the rotations cancel inside it (eden.py); every call draws fresh signs. The NVIDIA
recipe's backward is unbiased too, for another target: its dW multiplies by the unquantized X (rotated, rounded to
nearest), so it estimates E^T X, up to the small bias that rounding leaves (`python bench.py grad` measures it).

All quantized operations go through kernels.py: PyTorch operators that run Triton kernels on CUDA and the
pure-PyTorch references of quantize.py and eden.py elsewhere, and that torch.compile traces, so a whole GPT compiles
into one graph. On GPUs without FP4 tensor cores the GEMMs run in BF16 on the dequantized values (emulated NVFP4:
same numbers, BF16 speed). Each backward is once_differentiable: its quantizers have no derivative of their own.

The model is nanochat's original (October 2025) GPT, everything set by the depth:
    width = 64 * depth, attention heads of 128 dimensions (width / 128 heads), MLP hidden = 4 * width
    token embedding -> RMSNorm -> depth x [x + Attention(RMSNorm(x)), x + MLP(RMSNorm(x))] -> RMSNorm -> lm_head
    Attention: separate q, k, v projections, rotary embeddings (base 10000, the two halves of each head rotated as
    pairs), then RMSNorm of q and k (QK-norm), causal softmax attention, output projection.
    MLP: relu(x W_fc^T)^2 W_proj^T. RMSNorm has no parameters; no linear layer has a bias.
    The embedding and lm_head are untied; the output projections (and lm_head) start at zero; the logits are
    soft-capped as 15 * tanh(logits / 15) in FP32. Vocabulary: GPT-2's 50257 tokens, padded to 50304 rows.
Optimization follows nanochat: Muon for the 2-D block weights (momentum, then the update orthogonalized by 5
Newton-Schulz iterations, which replace its singular values by ~1) and AdamW for the embedding and lm_head.

The recipe applies to the six linear layers of every block (q, k, v, attention output, MLP in, MLP out); the
embedding and lm_head stay BF16, as in the paper. The quantized recipes run q, k and v as one GEMM on their stacked
weights, so that their common input is quantized once (one tensor scale for the three weights and for their three
gradients; each gradient stays unbiased, since each is a block of rows of one unbiased estimate).
"""

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import kernels
from eden import HADAMARD
from quantize import E2M1_MAX, SR_FP4_MAX, NVFP4Tensor

GPT2_VOCAB = 50257
HEAD_DIM = 128
SOFTCAP = 15.0
IGNORED = -100  # a target the loss leaves out (PyTorch's ignore_index)

# -----------------------------------------------------------------------------
# The recipes: one row each, a quantizer for every operand of the three GEMMs


@dataclass(frozen=True)
class Q:
    """How a GEMM operand is quantized, along the GEMM's inner dimension: round to nearest ("rtn", fp4_max 6),
    stochastically ("sr", fp4_max 6*16/17, so that nothing clips) or with MS-EDEN ("eden", eden.py: always a
    128-wide rotation); optionally with four-over-six, 16x16 tiles, or a random-sign Hadamard rotation of `rotation`
    elements, which the GEMM's two operands share so that it cancels."""
    rounding: str = "rtn"
    four_over_six: bool = False
    block: str = "1x16"
    rotation: int = 0


RTN, RTN46, TILES, TILES46 = Q(), Q(four_over_six=True), Q(block="16x16"), Q(block="16x16", four_over_six=True)
SR, SR16, SR32, SR128 = Q("sr"), Q("sr", rotation=16), Q("sr", rotation=32), Q("sr", rotation=HADAMARD)
EDEN = Q("eden", rotation=HADAMARD)


@dataclass(frozen=True)
class Recipe:
    """A quantizer (None: BF16) for each operand of the three GEMMs. The backward's W and X are the ones the
    forward used (quantized, if it quantized them), re-quantized by w_dx and x_dw, or taken as they are where those
    are None; with x_dw_bf16 the weight gradient quantizes the unquantized X instead (the NVIDIA recipe saves it)."""
    x: Optional[Q] = None  # Y = X W^T: X [T, in] along in
    w: Optional[Q] = None  # W [out, in] along in
    e_dx: Optional[Q] = None  # dX = E W: E [T, out] along out
    w_dx: Optional[Q] = None  # W^T [in, out] along out
    e_dw: Optional[Q] = None  # dW = E^T X: E^T [out, T] along T
    x_dw: Optional[Q] = None  # X^T [in, T] along T
    x_dw_bf16: bool = False

    def __post_init__(self):
        rotation = lambda q: q.rotation if q else 0
        if rotation(self.x) or rotation(self.w) or rotation(self.e_dx) != rotation(self.w_dx) or \
                rotation(self.e_dw) != rotation(self.x_dw):
            raise ValueError(f"a rotation must be shared by both operands of a backward GEMM: {self}")

    def rotated(self):
        return any(q and q.rotation for q in (self.e_dx, self.w_dx, self.e_dw, self.x_dw))


RECIPES = {
    #                            Y = X W^T        dX = E W            dW = E^T X
    #                            X      W         E      W^T          E^T    X^T
    "bf16": Recipe(),
    "quartet2": Recipe(RTN46, RTN46, EDEN, EDEN, EDEN, EDEN),
    "quartet2_no46": Recipe(RTN, RTN, EDEN, EDEN, EDEN, EDEN),
    "nvidia": Recipe(RTN, TILES, SR, None, SR16, Q(rotation=16), x_dw_bf16=True),
    "nvidia46": Recipe(RTN46, TILES46, SR, None, SR16, Q(rotation=16), x_dw_bf16=True),
    "tetrajet2": Recipe(RTN, RTN, SR32, SR32, SR32, SR32),
    # ablations, forward only: the backward is BF16 on the forward's quantized X and W
    "fwd_1x16": Recipe(RTN, RTN),
    "fwd_1x16_46": Recipe(RTN46, RTN46),
    "fwd_16x16": Recipe(RTN, TILES),
    "fwd_16x16_46": Recipe(RTN46, TILES46),
    # ablations, backward only: (a) dW quantized, (c) dX quantized, (e) both
    "bwd_a_sr": Recipe(e_dw=SR128, x_dw=SR128),
    "bwd_a_eden": Recipe(e_dw=EDEN, x_dw=EDEN),
    "bwd_c_sr": Recipe(e_dx=SR128, w_dx=SR128),
    "bwd_c_eden": Recipe(e_dx=EDEN, w_dx=EDEN),
    "bwd_e_sr": Recipe(None, None, SR128, SR128, SR128, SR128),
    "bwd_e_eden": Recipe(None, None, EDEN, EDEN, EDEN, EDEN),
    # a biased backward for contrast (the paper's Figure 9): four-over-six picks each group's branch by its error
    "bwd_e_sr46": Recipe(None, None, *[Q("sr", four_over_six=True, rotation=HADAMARD)] * 4),
}


def recipe_names(text):
    """The recipes of a comma-separated list ("bf16,quartet2"), each a key of RECIPES (else a ValueError)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in RECIPES]
    if unknown or not names:
        raise ValueError(f"unknown recipe(s) {unknown or text!r}; choose from {','.join(RECIPES)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"recipe(s) {','.join(repeated)} named more than once")
    return names


def saved(t, requantizer):
    """What the backward keeps of a forward operand: of an NVFP4Tensor it re-quantizes, the packed form only (0.56
    bytes per element); one it uses as it is keeps its values (code * group scale) too."""
    return replace(t, gemm_operand=None) if isinstance(t, NVFP4Tensor) and requantizer is not None else t


def quantize_operand(t, q, signs, transpose=False):
    """t (t^T with transpose) quantized by q along its last dimension, as an NVFP4Tensor; t itself if q is None. A
    rotation of n elements takes the first n of the 128 signs."""
    if q is None:
        return t.t() if transpose else t
    if q.rounding == "eden":  # the kernel makes both orientations from one read of t
        return kernels.ms_eden_pair_op(t, signs)[1 if transpose else 0]
    fp4_max = SR_FP4_MAX if q.rounding == "sr" else E2M1_MAX
    return kernels.quantize_op(t, q.rounding, q.four_over_six, q.block, fp4_max, transpose,
                               signs=signs[:q.rotation] if q.rotation else None)


def quantize_gradient(e, e_dx, e_dw, signs):
    """(E for dX along out, E^T for dW along T): for MS-EDEN both from one read of E."""
    if e_dx == e_dw == EDEN:
        return kernels.ms_eden_pair_op(e, signs)
    return quantize_operand(e, e_dx, signs), quantize_operand(e, e_dw, signs, transpose=True)


def requantize_transposed(t, q, signs):
    """The transpose of a saved forward operand t (an NVFP4Tensor, or BF16 if the forward did not quantize it),
    quantized by q; as it is if q is None (a 16x16 tensor transposes exactly, others as their values)."""
    if not isinstance(t, NVFP4Tensor):
        return quantize_operand(t, q, signs, transpose=True)
    if q is None:
        return t.t() if t.block == "16x16" else dequantized_fp32(t).t()
    if q == EDEN:
        return kernels.requantize_ms_eden_op(t, signs)
    # code * group_scale, exact in BF16, re-quantized; the saved tensor scale goes to the result's (as MS-EDEN's does)
    operand = kernels.dequantize_op(t, torch.bfloat16, tensor_scale=False)
    requantized = quantize_operand(operand, q, signs, transpose=True)
    return replace(requantized, tensor_scale=requantized.tensor_scale * t.tensor_scale)


def matmul(a, b, dtype):
    """a @ b^T: two NVFP4Tensors through nvfp4_mm (native on Blackwell), anything else on its values in dtype."""
    if isinstance(a, NVFP4Tensor) and isinstance(b, NVFP4Tensor):
        return kernels.nvfp4_mm(a, b, dtype)
    a, b = (dequantized_fp32(t).to(dtype) if isinstance(t, NVFP4Tensor) else t.to(dtype) for t in (a, b))
    return a @ b.t()


def dequantized_fp32(q):
    """An NVFP4Tensor's values, code * group_scale * tensor_scale, in FP32."""
    operand = kernels.dequantize_op(q, tensor_scale=False) if q.gemm_operand is None else q.gemm_operand.float()
    return operand * q.tensor_scale


def save_for_backward(ctx, *items):
    """ctx.save_for_backward for tensors and NVFP4Tensors. torch.compile traces an autograd Function only if what
    its backward needs is saved as plain tensors, and PyTorch then frees them after the backward."""
    tensors, layout = [], []
    for item in items:
        if isinstance(item, NVFP4Tensor):
            tensors.extend((item.codes, item.group_scale, item.tensor_scale, item.gemm_operand))
            layout.append((item.shape, item.block))
        else:
            tensors.append(item)
            layout.append(None)
    ctx.save_for_backward(*tensors)
    ctx.layout = layout


def saved_tensors(ctx):
    """What save_for_backward saved, NVFP4Tensors rebuilt."""
    tensors, items = list(ctx.saved_tensors), []
    for entry in ctx.layout:
        if entry is None:
            items.append(tensors.pop(0))
        else:
            codes, group_scale, tensor_scale, operand = (tensors.pop(0) for _ in range(4))
            items.append(NVFP4Tensor(codes, group_scale, tensor_scale, entry[0], entry[1], operand))
    return items


class RecipeLinear(torch.autograd.Function):
    """The three GEMMs of a linear layer, each operand quantized as the recipe says."""

    @staticmethod
    def forward(ctx, x, w, name):  # x [T, in], w [out, in]; name: a key of RECIPES
        recipe = RECIPES[recipe_names(name)[0]]
        check_tokens(name, x.shape[0])
        xq, wq = quantize_operand(x, recipe.x, None), quantize_operand(w, recipe.w, None)  # along in
        ctx.recipe = recipe
        save_for_backward(ctx, saved(x if recipe.x_dw_bf16 else xq, recipe.x_dw), saved(wq, recipe.w_dx))
        return matmul(xq, wq, x.dtype)  # [T, out]

    @staticmethod
    @once_differentiable
    def backward(ctx, e):  # e [T, out]
        recipe = ctx.recipe
        x, w = saved_tensors(ctx)
        signs = kernels.draw_signs(e) if recipe.rotated() else None  # fresh per call, shared by the four operands
        e_dx, e_dw = quantize_gradient(e, recipe.e_dx, recipe.e_dw, signs)  # [T, out] along out, [out, T] along T
        dx = matmul(e_dx, requantize_transposed(w, recipe.w_dx, signs), e.dtype)  # [T, in]
        dw = matmul(e_dw, requantize_transposed(x, recipe.x_dw, signs), e.dtype)  # [out, in]
        return dx, dw, None


class Linear(nn.Module):
    """A bias-free linear layer whose three GEMMs follow a recipe."""

    def __init__(self, in_features, out_features, recipe="bf16"):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}")
        if recipe != "bf16" and (in_features % HADAMARD or out_features % HADAMARD):
            raise ValueError(f"the {recipe} recipe needs layer sizes that are multiples of {HADAMARD}, "
                             f"got {in_features} -> {out_features}")
        self.recipe = recipe
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x):
        return linear(x, self.weight, self.recipe)


def check_tokens(recipe, tokens):
    """The quantized recipes rotate and quantize along the tokens too (dW = E^T X): T must be a multiple of 128."""
    if recipe != "bf16" and tokens % HADAMARD:
        raise ValueError(f"the {recipe} recipe needs the tokens per micro-batch (batch x sequence) to be a multiple "
                         f"of {HADAMARD}, got {tokens}")


def linear(x, weight, recipe):
    """x [..., in] @ weight^T through the recipe's three GEMMs, in the autocast dtype if autocast is on."""
    if not (x.is_floating_point() and x.dim()):
        raise ValueError(f"a linear layer needs floating-point input of at least 1 dimension, got {x.dtype} "
                         f"{tuple(x.shape)}")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    tokens = x.reshape(-1, x.shape[-1]).to(dtype)  # [T, in]
    return RecipeLinear.apply(tokens, weight.to(dtype), recipe).view(*x.shape[:-1], -1)


# -----------------------------------------------------------------------------
# The GPT


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(seq_len, head_dim=HEAD_DIM, base=10000.0, device=None):
    """cos, sin [1, seq_len, 1, head_dim/2]: position t rotates pair (i, i + head_dim/2) by t / base^(2i/head_dim)."""
    inverse_frequency = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inverse_frequency)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x, cos, sin):  # x [B, T, heads, head_dim]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, width, recipe):
        super().__init__()
        self.heads = width // HEAD_DIM
        self.c_q, self.c_k, self.c_v = (Linear(width, width, recipe) for _ in range(3))
        self.c_proj = Linear(width, width, recipe)

    def forward(self, x, cos, sin):  # x [B, T, width]
        batch, seq, width = x.shape
        recipe = self.c_q.recipe
        if recipe == "bf16":  # three GEMMs: as fast as one on an H200, and with less memory
            q, k, v = (layer(x) for layer in (self.c_q, self.c_k, self.c_v))
        else:  # q, k and v read the same x: one GEMM on the stacked weights quantizes x once, not three times
            qkv_weight = torch.cat([self.c_q.weight, self.c_k.weight, self.c_v.weight])  # [3 width, width]
            q, k, v = linear(x, qkv_weight, recipe).split(width, dim=-1)  # parameters and Muon stay per matrix
        q, k, v = (t.view(batch, seq, self.heads, HEAD_DIM) for t in (q, k, v))
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, width, recipe):
        super().__init__()
        self.c_fc = Linear(width, 4 * width, recipe)
        self.c_proj = Linear(4 * width, width, recipe)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, width, recipe):
        super().__init__()
        self.attn = Attention(width, recipe)
        self.mlp = MLP(width, recipe)

    def forward(self, x, cos, sin):
        x = x + self.attn(norm(x), cos, sin)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, depth, recipe="bf16", max_seq_len=2048, vocab_size=GPT2_VOCAB):
        super().__init__()
        width = 64 * depth
        if depth < 1 or width % HEAD_DIM:
            raise ValueError(f"depth must be a positive even number (width = 64 * depth must be a multiple of "
                             f"{HEAD_DIM}, the head size), got depth {depth}")
        if vocab_size < 1 or max_seq_len < 1:
            raise ValueError(f"the GPT needs a vocabulary and a context of at least 1, got vocab_size {vocab_size}, "
                             f"max_seq_len {max_seq_len}")
        self.depth, self.width, self.recipe, self.vocab_size = depth, width, recipe, vocab_size
        padded_vocab = -(-vocab_size // 128) * 128
        self.embedding = nn.Embedding(padded_vocab, width)
        self.blocks = nn.ModuleList(Block(width, recipe) for _ in range(depth))
        self.lm_head = nn.Linear(width, padded_vocab, bias=False)
        cos, sin = rotary_tables(max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        for module in self.modules():
            if isinstance(module, (Linear, nn.Linear)):  # std 1/sqrt(in) * min(1, sqrt(out/in)), arXiv 2310.17813
                out_features, in_features = module.weight.shape
                std = min(1.0, math.sqrt(out_features / in_features)) / math.sqrt(in_features)
                nn.init.normal_(module.weight, std=std)
        nn.init.normal_(self.embedding.weight, std=1.0)
        nn.init.zeros_(self.lm_head.weight)
        for block in self.blocks:
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)

    def matrix_parameters(self):
        """The 2-D weights of the blocks (for Muon)."""
        return [p for p in self.blocks.parameters()]

    def forward(self, idx, targets=None, reduction="mean"):  # idx, targets [B, T]
        batch, seq = idx.shape if idx.dim() == 2 else (0, 0)
        if idx.dtype not in (torch.int32, torch.int64) or not (batch and 0 < seq <= self.cos.shape[1]) or (
                targets is not None and targets.shape != idx.shape):
            raise ValueError(f"the GPT takes token ids [batch >= 1, 1 <= sequence <= {self.cos.shape[1]}] (int64), "
                             f"and targets of their shape; got {idx.dtype} {tuple(idx.shape)}")
        cos, sin = self.cos[:, :seq], self.sin[:, :seq]
        x = norm(self.embedding(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(norm(x))[..., :self.vocab_size].float()
        logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
        if targets is None:
            return logits
        # The mean over no targets is NaN: refused where checking costs no synchronization (eager, uncaptured)
        checked = not torch.compiler.is_compiling() and not (idx.is_cuda and torch.cuda.is_current_stream_capturing())
        if checked and reduction == "mean" and not targets.ne(IGNORED).any():
            raise ValueError(f"every target is {IGNORED} (ignored): the mean loss over no tokens is undefined")
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED, reduction=reduction)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """idx [B, T] followed by max_new_tokens tokens, each drawn (with `generator`) from the model's own forward
        pass, so that a quantized recipe writes with its NVFP4 forward: from softmax(logits / temperature) over the
        top_k most likely tokens (all if None), the context cropped to its last max_seq_len tokens. The quantized
        recipes take a multiple of 128 tokens per forward: the context is padded on the right (with rows too if
        max_seq_len is shorter), and the logits read at its last real token. Attention is causal, so the padding
        cannot reach the real positions; it enters only each quantized activation's FP32 tensor scale, as the
        other windows of a training batch do. Autocast, if wanted, is the caller's, as for forward."""
        if max_new_tokens < 0 or not temperature > 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"generate needs max_new_tokens >= 0, temperature > 0 and top_k >= 1 (or None), got "
                             f"{max_new_tokens}, {temperature}, {top_k}")
        multiple = 1 if self.recipe == "bf16" else HADAMARD
        for _ in range(max_new_tokens):
            context = idx[:, -self.cos.shape[1]:]
            batch, length = context.shape
            window = min(-(-length // multiple) * multiple, self.cos.shape[1])  # tokens per row, padded
            rows_multiple = multiple // math.gcd(window, multiple)  # > 1 only if max_seq_len cut the window
            rows = -(-batch // rows_multiple) * rows_multiple
            logits = self(F.pad(context, (0, window - length, 0, rows - batch)))[:batch, length - 1] / temperature
            if top_k is not None:
                smallest_kept = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < smallest_kept, -math.inf)
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, token], dim=1)
        return idx


# -----------------------------------------------------------------------------
# The optimizers (nanochat's): Muon for the block matrices, AdamW for the embedding and lm_head


def newton_schulz(g, steps=5):
    """Approximately orthogonalize each matrix of g [..., rows, cols] (replace its singular values by ~1) with a
    quintic Newton-Schulz iteration, in BF16 (Keller Jordan's coefficients, chosen to push singular values into
    [0.7, 1.2] quickly)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz, for 2-D weight matrices (nesterov momentum). The matrices of one
    shape are orthogonalized together, as one batch: a few large launches instead of many small ones (the d12 model
    has 72 matrices of 2 shapes). torch.optim.Muon computes the same update one matrix at a time."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                by_shape.setdefault(p.shape, []).append(p)
            for (rows, cols), params in by_shape.items():
                grads = [p.grad for p in params]
                buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
                torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
                nesterov = torch.stack(grads).lerp_(torch.stack(buffers), group["momentum"])  # [n, rows, cols]
                updates = newton_schulz(nesterov).to(params[0].dtype).unbind(0)
                torch._foreach_add_(params, updates, alpha=-group["lr"] * max(1, rows / cols) ** 0.5)


def make_optimizers(model, lr_matrix, lr_embedding, lr_head):
    """(AdamW for the embedding and lm_head, Muon for the block matrices), with nanochat's learning rates; each
    group remembers its initial_lr for the schedule."""
    scale = (model.width / 768) ** -0.5  # nanochat's AdamW learning rates are tuned at width 768
    adamw = torch.optim.AdamW([dict(params=[model.embedding.weight], lr=lr_embedding * scale),
                               dict(params=[model.lm_head.weight], lr=lr_head * scale)],
                              betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=model.embedding.weight.is_cuda)
    muon = Muon(model.matrix_parameters(), lr=lr_matrix)
    for optimizer in (adamw, muon):
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
    return adamw, muon
