"""The norm pass on code styles that tests/test_norm_pass.py does not spell: more RMSNorm / LayerNorm
spellings, residual-add spellings, FlashAttention / nanoGPT / Llama block chains, mixed dtypes, and the
look-alikes that must stay unrewritten.

Every positive case checks the rewrite count and that forward and gradients (inputs and parameters)
equal eager's; every negative case checks that nothing is rewritten and, where the pass saw a candidate,
that the near miss names its reason. Helpers come from tests/test_norm_pass.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_pass import (
    EPS,
    Fn,
    LlamaRMSNorm,
    N,
    T5LayerNorm,
    _assert_same,
    _check_near_miss,
    _check_rewrite,
    _rewritten,
    _x,
)
from torch._dynamo.utils import counters

import flash_backend
from fx_passes import collecting

H = 13  # a second awkward hidden size


def _check_untouched(model, args):
    """Nothing is rewritten (whether or not the pass saw a candidate), and the model still runs as eager."""
    counters.clear()
    with collecting() as report:
        compiled, _ = _rewritten(model)
        _assert_same(model, compiled, args)
    assert counters["flash"]["norm"] == 0, str(report)
    return report


# --------------------------------------------------------------------------------------------------------
# RMSNorm spellings
# --------------------------------------------------------------------------------------------------------


def _rms(form):
    def fn(m, x):
        if form == "square_div_sqrt":
            return x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS) * m.weight
        if form == "torch_mean_x_times_x":
            ms = torch.mean(x * x, dim=-1, keepdim=True)
            return m.weight * (x * torch.rsqrt(ms + EPS))
        if form == "pow_minus_half":
            return x * (x.pow(2).mean(-1, keepdim=True) + EPS) ** -0.5 * m.weight
        if form == "eps_first":
            return torch.mul(x, torch.rsqrt(EPS + x.pow(2).mean(-1, True)))
        if form == "no_eps":  # eps = 0, which the op expresses
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
        if form == "method_chain":
            return x.pow(2).mean(dim=-1, keepdim=True).add(EPS).rsqrt().mul(x).mul(m.weight)
        if form == "div_method":
            return x.div(torch.sqrt(x.square().mean(-1, keepdim=True) + EPS))
        if form == "rsqrt_then_weight":  # the brief's x * rsqrt(mean(x²) + eps) * w
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * m.weight
        raise AssertionError(form)

    return Fn(fn, bias=False)


@pytest.mark.parametrize("form", ["square_div_sqrt", "torch_mean_x_times_x", "pow_minus_half", "eps_first",
                                  "no_eps", "method_chain", "div_method", "rsqrt_then_weight"])
def test_rmsnorm_spellings(form):
    _check_rewrite(_rms(form), (_x(2, 3, N),), text="hand-written RMSNorm")


class T5LayerNormCastFirst(T5LayerNorm):
    """T5's RMSNorm, the variant that always casts to the weight's dtype before the weight multiply."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(self.weight.dtype)


def test_t5_cast_before_weight():
    _check_rewrite(T5LayerNormCastFirst(), (_x(3, 5, N),), text="hand-written RMSNorm + weight")


def test_t5_bf16_activations_fp32_weight_promote_like_eager():
    # bf16 x * fp32 rsqrt promotes to fp32 in eager, and the fp32 weight keeps it there: the op must take
    # the fp32 upcast as its input (it returns its input's dtype), never return bf16. x's gradient is
    # bf16: eager and the op round slightly different fp32 values to it (one bf16 ulp apart at most).
    m = T5LayerNormCastFirst()
    report = _check_rewrite(m, (_x(3, 5, N, dtype=torch.bfloat16),), text="RMSNorm + weight", atol=2e-3,
                            rtol=2e-3)
    assert len(report.rewrites) == 1


class GemmaOffsetRMSNorm(nn.Module):
    """Gemma's weight is an offset from one: (1 + w) is an (N,) tensor the op takes as its weight."""

    def __init__(self, n=N, eps=EPS):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(0.1 * torch.randn(n))

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1 + self.weight)


def test_gemma_one_plus_weight_without_upcast():
    _check_rewrite(GemmaOffsetRMSNorm(), (_x(2, 7, N),), text="hand-written RMSNorm + weight")


def test_rmsnorm_then_bias_keeps_the_bias_after_the_op():
    # RMSNorm has no bias in the op: the + b runs after it, as in eager.
    def fn(m, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * m.weight + m.bias

    _check_rewrite(Fn(fn), (_x(4, N),), text="hand-written RMSNorm + weight")


# --------------------------------------------------------------------------------------------------------
# LayerNorm spellings
# --------------------------------------------------------------------------------------------------------


def _ln(form):
    def fn(m, x):
        mu = x.mean(-1, keepdim=True)
        if form == "torch_var_sub_method_div_method":
            var = torch.var(x, dim=-1, keepdim=True, unbiased=False)
            return x.sub(mu).div(torch.sqrt(var + 1e-5)) * m.weight + m.bias
        if form == "torch_sub_mul_add_methods":
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return torch.sub(x, mu).mul(torch.rsqrt(var + 1e-5)).mul(m.weight).add(m.bias)
        if form == "var_method_correction_addcmul_weight_first":
            var = x.var(dim=-1, keepdim=True, correction=0)
            return torch.addcmul(m.bias, m.weight, (x - mu) * (var + 1e-5).rsqrt())
        if form == "no_eps":  # eps = 0, which the op expresses
            return (x - mu) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False)) * m.weight + m.bias
        if form == "centred_once_mean_of_product":
            d = x - mu
            return m.bias + m.weight * (d / torch.sqrt(torch.mean(d * d, dim=-1, keepdim=True) + 1e-6))
        raise AssertionError(form)

    return Fn(fn)


@pytest.mark.parametrize("form", ["torch_var_sub_method_div_method", "torch_sub_mul_add_methods",
                                  "var_method_correction_addcmul_weight_first", "no_eps",
                                  "centred_once_mean_of_product"])
def test_layernorm_spellings(form):
    _check_rewrite(_ln(form), (_x(2, 3, N),), text="hand-written LayerNorm + weight + bias", atol=1e-4,
                   rtol=1e-4)


def test_bias_before_weight_folds_only_the_bias():
    # (y + b) * w is not y * w + b: the bias folds into the op, the weight multiply stays after it.
    def fn(m, x):
        return (F.layer_norm(x, (N,)) + m.bias) * m.weight

    report = _check_rewrite(Fn(fn), (_x(3, N),))
    assert "weight" not in report.rewrites[0].variant, str(report)


def test_weight_of_another_shape_stays_after_the_op():
    # an (S, N) scale is not LayerNorm's (N,) weight: the norm is rewritten, the multiply is not folded
    def fn(m, x):
        return F.layer_norm(x, (N,)) * m.weight

    _check_rewrite(Fn(fn, weight_shape=(5, N), bias=False), (_x(2, 5, N),))


class Fp32LayerNorm(nn.LayerNorm):
    """fairseq's Fp32LayerNorm: the norm runs in fp32 on half-precision activations and parameters."""

    def forward(self, input):
        output = F.layer_norm(input.float(), self.normalized_shape,
                              self.weight.float() if self.weight is not None else None,
                              self.bias.float() if self.bias is not None else None, self.eps)
        return output.type_as(input)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_layernorm(dtype):
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    _check_rewrite(Fp32LayerNorm(N).to(dtype), (_x(3, 4, N, dtype=dtype),), text="F.layer_norm", **tol)


def test_layernorm_of_a_transposed_input():
    # the last dim of a non-contiguous view (channels of a (B, C, L) tensor moved last)
    ln = nn.LayerNorm(H)
    _check_rewrite(Fn(lambda m, x: ln(x.transpose(1, 2)), bias=False), (_x(2, H, 7),))


def test_layernorm_under_a_lossy_cast_is_not_folded():
    # bf16 -> fp16 keeps the width but not the range: eager normalises the fp16 value (inf past 65504,
    # so those rows are NaN), which the op must see too. Folding the cast would normalise the bf16 x.
    def fn(m, x):
        return F.layer_norm(x.half(), (N,)).to(torch.bfloat16)

    x = _x(4, N, dtype=torch.bfloat16)
    x[0, 0] = 1e5
    counters.clear()
    model = Fn(fn)
    compiled, _ = _rewritten(model)
    torch.testing.assert_close(compiled(x), model(x), equal_nan=True, atol=2e-2, rtol=2e-2)
    assert counters["flash"]["norm"] == 1
    assert compiled(x)[0].isnan().all()


# --------------------------------------------------------------------------------------------------------
# NumPy-style keywords: torch's argument parser takes axis= for dim and keepdims= for keepdim (code ported
# from NumPy / JAX writes them), the same call as dim= / keepdim=
# --------------------------------------------------------------------------------------------------------


def _numpy_kw(form):
    def fn(m, x):
        if form == "mean_var":
            mu = x.mean(axis=-1, keepdims=True)
            return (x - mu) / torch.sqrt(x.var(axis=-1, keepdims=True, correction=0) + 1e-5) * m.weight
        if form == "mean_of_centred_square":
            mu = torch.mean(x, axis=-1, keepdims=True)
            return (x - mu) * torch.rsqrt(torch.mean((x - mu) ** 2, axis=-1, keepdims=True) + 1e-5)
        if form == "var_mean":
            var, mu = torch.var_mean(x, axis=-1, keepdims=True, correction=0)
            return (x - mu) * torch.rsqrt(var + 1e-5) * m.weight
        if form == "rms_mean":
            return x * torch.rsqrt(x.pow(2).mean(axis=-1, keepdims=True) + EPS) * m.weight
        if form == "rms_sum_over_n":
            return x * torch.rsqrt(torch.sum(x * x, axis=-1, keepdims=True) / N + EPS)
        if form == "rms_unsqueezed_dim_keyword":
            return x * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(dim=-1)
        if form == "rms_2_norm":
            return x / (torch.linalg.vector_norm(x, axis=-1, keepdims=True) * N ** -0.5)
        raise AssertionError(form)

    return Fn(fn, bias=False)


@pytest.mark.parametrize("form", ["mean_var", "mean_of_centred_square", "var_mean", "rms_mean",
                                  "rms_sum_over_n", "rms_unsqueezed_dim_keyword", "rms_2_norm"])
def test_numpy_style_axis_and_keepdims(form):
    _check_rewrite(_numpy_kw(form), (_x(2, 3, N),), text="hand-written", atol=1e-4, rtol=1e-4)


def test_near_miss_numpy_style_axis_over_another_dim():
    def fn(m, x):
        return x * torch.rsqrt(x.pow(2).mean(axis=-2, keepdims=True) + EPS)

    _check_near_miss(Fn(fn), (_x(2, 5, N),), "reduces over dim -2")


# --------------------------------------------------------------------------------------------------------
# Dropout and residual spellings
# --------------------------------------------------------------------------------------------------------


class PostNorm(nn.Module):
    def __init__(self, form, n=N, p=0.0):
        super().__init__()
        self.form, self.p = form, p
        self.drop, self.ln = nn.Dropout(p), nn.LayerNorm(n)

    def forward(self, x, residual):
        if self.form == "add_method":
            h = x.add(residual)
        elif self.form == "torch_add_dropout":
            h = torch.add(self.drop(x), residual)
        elif self.form == "residual_add_method_functional_dropout":
            h = residual.add(F.dropout(x, self.p, self.training))
        elif self.form == "torch_dropout":
            h = residual + torch.dropout(x, self.p, self.training)
        else:
            raise AssertionError(self.form)
        return self.ln(h)


@pytest.mark.parametrize("form,text", [
    ("add_method", "residual add + F.layer_norm"),
    ("torch_add_dropout", "dropout + residual add + F.layer_norm"),
    ("residual_add_method_functional_dropout", "dropout + residual add"),
    ("torch_dropout", "dropout + residual add"),
])
def test_residual_and_dropout_spellings(form, text):
    _check_rewrite(PostNorm(form), (_x(2, 5, N), _x(2, 5, N)), text=text)


def test_eval_mode_functional_dropout_with_p():
    m = PostNorm("residual_add_method_functional_dropout", p=0.3).eval()
    with collecting() as report:
        compiled, _ = _rewritten(m)
        _assert_same(m, compiled, (_x(2, 5, N), _x(2, 5, N)), grads=False)
    assert counters["flash"]["norm"] == 1, str(report)
    assert "dropout + residual add" in str(report)


def test_add_with_alpha_is_not_folded():
    # torch.add(x, r, alpha=2) is x + 2r: the op normalises the sum rather than folding the add.
    def fn(m, x, r):
        return F.layer_norm(torch.add(x, r, alpha=2.0), (N,), m.weight, m.bias)

    report = _check_rewrite(Fn(fn), (_x(3, N), _x(3, N)))
    assert "residual add" not in report.rewrites[0].variant, str(report)


def test_broadcast_addend_is_not_a_residual():
    # BERT embeddings: words + (1, S, N) positions. A broadcast addend is not the op's residual (same
    # shape as x); the sum is normalised as it is.
    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(1, 6, N))
            self.ln, self.drop = nn.LayerNorm(N, eps=1e-12), nn.Dropout(0.0)

        def forward(self, words):
            return self.drop(self.ln(words + self.pos))

    report = _check_rewrite(Embeddings(), (_x(2, 6, N),))
    assert "residual add" not in report.rewrites[0].variant, str(report)


def test_residual_is_dropout_input():
    # x + dropout(x): the residual is x itself
    _check_rewrite(Fn(lambda m, x: F.layer_norm(x + F.dropout(x, 0.0), (N,), m.weight, m.bias)), (_x(3, N),),
                   text="dropout + residual add")


# --------------------------------------------------------------------------------------------------------
# Blocks as libraries write them, chained: the sum of one block feeds the next
# --------------------------------------------------------------------------------------------------------


class FlashAttnBlock(nn.Module):
    """flash-attention's Block (prenorm): returns (hidden_states, residual); the residual is kept in fp32
    when residual_in_fp32, and the first block's residual is the dropout output alone."""

    def __init__(self, n=N, p=0.0, residual_in_fp32=True):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.dropout1, self.dropout2 = nn.Dropout(p), nn.Dropout(p)
        self.norm1, self.norm2 = nn.LayerNorm(n), nn.LayerNorm(n)
        self.mixer = nn.Linear(n, n)
        self.mlp = nn.Sequential(nn.Linear(n, 2 * n), nn.GELU(approximate="tanh"), nn.Linear(2 * n, n))

    def forward(self, hidden_states, residual=None):
        dropped = self.dropout1(hidden_states)
        residual = (dropped + residual) if residual is not None else dropped
        hidden_states = self.norm1(residual.to(dtype=self.norm1.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        hidden_states = self.mixer(hidden_states)
        dropped = self.dropout2(hidden_states)
        residual = dropped + residual
        hidden_states = self.norm2(residual.to(dtype=self.norm2.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return self.mlp(hidden_states), residual


class FlashAttnStack(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(FlashAttnBlock() for _ in range(depth))
        self.drop_f, self.ln_f = nn.Dropout(0.0), nn.LayerNorm(N)

    def forward(self, x):
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.ln_f((self.drop_f(x) + residual).to(self.ln_f.weight.dtype))


def test_flash_attention_block_chain():
    # 2 norms per block + the final one; the first block's norm1 takes dropout(x) with no residual
    report = _check_rewrite(FlashAttnStack(), (_x(2, 5, N),), rewrites=5, atol=1e-4, rtol=1e-4)
    assert sum("pre-norm" in d.variant for d in report.rewrites) == 4, str(report)


class NanoGPTLayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim) + 0.1 * torch.randn(ndim))
        self.bias = nn.Parameter(0.1 * torch.randn(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoGPTBlock(nn.Module):
    def __init__(self, n=N, bias=True):
        super().__init__()
        self.ln_1, self.ln_2 = NanoGPTLayerNorm(n, bias), NanoGPTLayerNorm(n, bias)
        self.attn = nn.Sequential(nn.Linear(n, n, bias=bias), nn.Dropout(0.0))
        self.mlp = nn.Sequential(nn.Linear(n, 4 * n, bias=bias), nn.GELU(), nn.Linear(4 * n, n, bias=bias),
                                 nn.Dropout(0.0))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, depth=3, bias=True):
        super().__init__()
        self.h = nn.ModuleList(NanoGPTBlock(H, bias) for _ in range(depth))
        self.ln_f = NanoGPTLayerNorm(H, bias)

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_block_chain(bias):
    _check_rewrite(NanoGPT(bias=bias), (_x(2, 5, H),), rewrites=7, atol=1e-4, rtol=1e-4)


class LlamaDecoderLayer(nn.Module):
    """HF Llama's decoder layer: residual adds written as `residual + hidden_states`."""

    def __init__(self, n=N):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(n), LlamaRMSNorm(n)
        self.self_attn = nn.Linear(n, n, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(n, 2 * n, bias=False), nn.Linear(n, 2 * n, bias=False)
        self.down_proj = nn.Linear(2 * n, n, bias=False)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(depth))
        self.norm = LlamaRMSNorm()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_llama_decoder_chain():
    # the first norm reads the input; the final norm's sum has no other reader
    report = _check_rewrite(LlamaModel(), (_x(2, 5, N),), rewrites=7, atol=1e-4, rtol=1e-4)
    assert sum("pre-norm" in d.variant for d in report.rewrites) == 5, str(report)


def test_llama_decoder_chain_inference_dynamic():
    m = LlamaModel(depth=2)
    compiled, graphs = _rewritten(m, dynamic=True)
    with torch.no_grad():
        for b, s in ((2, 5), (3, 9)):
            x = _x(b, s, N)
            torch.testing.assert_close(compiled(x), m(x), atol=1e-4, rtol=1e-4)
    assert len(graphs) == 1
    assert counters["flash"]["norm"] == 5


# --------------------------------------------------------------------------------------------------------
# End to end with backend="flash" (Inductor compiles the rest)
# --------------------------------------------------------------------------------------------------------


def test_e2e_t5_and_rms_spellings_training_and_inference():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.t5 = T5LayerNormCastFirst(H)
            self.lin = nn.Linear(H, H)
            self.w = nn.Parameter(torch.randn(H))

        def forward(self, x):
            h = self.lin(self.t5(x))
            return h / torch.sqrt(h.square().mean(-1, keepdim=True) + EPS) * self.w

    m = Model()
    compiled = torch.compile(m, backend="flash", fullgraph=True)
    _assert_same(m, compiled, (_x(3, 7, H),), atol=1e-4, rtol=1e-4)
    assert counters["flash"]["norm"] == 2
    with torch.no_grad():
        _assert_same(m, compiled, (_x(3, 7, H),), atol=1e-4, rtol=1e-4, grads=False)
    assert counters["flash"]["norm"] == 4  # the no_grad graph is a second compile, rewritten too


def test_e2e_nanogpt_chain_dynamic():
    # dynamic=True makes the dropouts' p graph inputs; the norm pass specialises them and restarts
    # dynamo's analysis, which must not count the dense rewrites of the abandoned run.
    m = NanoGPT(depth=2)
    compiled = torch.compile(m, backend="flash", fullgraph=True, dynamic=True)
    for b, s in ((2, 5), (3, 6)):
        _assert_same(m, compiled, (_x(b, s, H),), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["flash"]["norm"] == 5 and counters["flash"]["dense"] == 2, dict(counters["flash"])


# --------------------------------------------------------------------------------------------------------
# Look-alikes: other functions, left alone
# --------------------------------------------------------------------------------------------------------


def test_near_miss_biased_std_plus_eps():
    # std + eps is not sqrt(var + eps), even with the biased standard deviation
    def fn(m, x):
        mu = x.mean(-1, keepdim=True)
        return m.weight * (x - mu) / (x.std(-1, keepdim=True, unbiased=False) + 1e-6) + m.bias

    _check_near_miss(Fn(fn), (_x(3, N),), "eps is added after the square root")


def test_near_miss_unbiased_torch_var():
    def fn(m, x):
        mu = torch.mean(x, -1, keepdim=True)
        return (x - mu) * torch.rsqrt(torch.var(x, -1, keepdim=True) + 1e-5)

    _check_near_miss(Fn(fn), (_x(3, N),), "unbiased")


@pytest.mark.parametrize("dims", [1, (-2, -1)])
def test_near_miss_hand_written_layernorm_over_other_dims(dims):
    def fn(m, x):
        mu = x.mean(dims, keepdim=True)
        var = ((x - mu) ** 2).mean(dims, keepdim=True)
        return (x - mu) * torch.rsqrt(var + 1e-5)

    _check_near_miss(Fn(fn), (_x(2, 5, N),), "not only the last dim")


def test_near_miss_rmsnorm_over_two_dims():
    def fn(m, x):
        return x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + EPS)

    _check_near_miss(Fn(fn), (_x(2, 5, N),), "not only the last dim")


def test_near_miss_mean_and_variance_over_different_dims():
    def fn(m, x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5)

    _check_near_miss(Fn(fn), (_x(2, 5, N),), "not only the last dim")


def test_near_miss_scaled_value_is_not_the_squared_one():
    # the statistics of z scale x: not RMSNorm of anything
    def fn(m, x, z):
        return x * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + EPS)

    _check_near_miss(Fn(fn), (_x(3, N), _x(3, N)), "does not scale the normalised value")


def test_untouched_variance_of_another_tensor():
    def fn(m, x, z):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(z.var(-1, keepdim=True, unbiased=False) + 1e-5)

    _check_untouched(Fn(fn), (_x(3, N), _x(3, N)))


def test_untouched_eps_multiplied_or_a_tensor():
    def times_eps(m, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) * 1.001)

    def tensor_eps(m, x):  # eps is a parameter that could change: not a constant (squared: a random bias
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.bias[0] ** 2)  # may be < 0, rsqrt NaN)

    _check_untouched(Fn(times_eps), (_x(3, N),))
    _check_untouched(Fn(tensor_eps), (_x(3, N),))


def test_dropout_output_read_before_the_add_is_not_folded():
    # the dropout is read elsewhere too: it stays (one mask for both readers) and is the add's residual
    def fn(m, x, r, p=0.0):
        d = F.dropout(x, p, True)
        scale = d.sum(-1, keepdim=True)
        return F.layer_norm(d + r, (N,)) * scale

    _check_rewrite(Fn(fn), (_x(3, N), _x(3, N)), text="residual add + F.layer_norm")
    report = flash_backend.explain(Fn(lambda m, x, r: fn(m, x, r, 0.1)), _x(3, N), _x(3, N),
                                   print_report=False)
    assert [d.variant for d in report.decisions] == ["residual add + F.layer_norm"], str(report)


def test_near_miss_unbiased_std_in_an_annotated_transformer_block():
    # the Annotated Transformer's SublayerConnection: x + dropout(sublayer(norm(x))) with its own
    # LayerNorm (unbiased std + eps): the add is a residual of the next norm, but the norm is not LayerNorm
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.a_2, self.b_2 = nn.Parameter(torch.ones(N)), nn.Parameter(torch.zeros(N))

        def forward(self, x):
            mean, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
            return self.a_2 * (x - mean) / (std + 1e-6) + self.b_2

    class Sublayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin, self.drop = Norm(), nn.Linear(N, N), nn.Dropout(0.0)

        def forward(self, x):
            return self.norm(x + self.drop(self.lin(self.norm(x))))

    report = _check_near_miss(Sublayer(), (_x(2, 3, N),), "unbiased")
    assert counters["flash"]["norm_skipped"] == 2, str(report)


def test_near_miss_input_written_in_place_between_its_reads():
    # dynamo reads x by one node before and after x.mul_(3): the mean of squares saw x, the scaled value 3x
    def fn(m, x):
        x = x * 1
        ms = x.pow(2).mean(-1, keepdim=True)
        x.mul_(3)
        return x * torch.rsqrt(ms + EPS)

    _check_near_miss(Fn(fn), (_x(3, N),), "written in place")


def test_pre_norm_sum_written_in_place_after_the_norm():
    # the write comes after the norm has read h: it now writes the op's residual output, as eager wrote h
    def fn(m, x, r):
        h = x + r
        y = F.layer_norm(h, (N,))
        h.mul_(2)
        return y + h

    # forward only: eager's own backward refuses the write (layer_norm saved h)
    model = Fn(fn, bias=False)
    with collecting() as report:
        compiled, _ = _rewritten(model)
        _assert_same(model, compiled, (_x(3, N), _x(3, N)), grads=False)
    assert counters["flash"]["norm"] == 1 and "pre-norm" in str(report), str(report)


def test_explain_names_the_location_of_a_near_miss():
    def fn(m, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + EPS)

    report = flash_backend.explain(Fn(fn), _x(2, 5, N), print_report=False)
    assert "test_norm_pass_styles.py" in report.near_misses[0].location, str(report)
