"""Blocks of non-HuggingFace codebases, written as their authors write them, through the norm, dense and
cross-entropy passes (session 30): only idioms no other suite spells.

Every case is compiled through the passes (tests/test_norm_dense_ce_review_s25.py's harness: dynamo +
fx_passes, the graph run as plain PyTorch, the flash ops on their CPU reference) in training (outputs and the
gradients of the inputs and parameters) and in eval, and compared with eager at fp32 tolerances.

- dense, GAP fixed (fx_passes/dense.py, _dtype_references / _cast_back_by_reference): fairseq's
  ``utils.gelu``, ``F.gelu(x.float()).type_as(x)`` with x the pre-activation (every fairseq model with
  ``activation_fn="gelu"``: RoBERTa, BART, wav2vec 2.0, ...), was no candidate at all: the ``type_as`` reads
  the pre-activation for its dtype, and counted as a second user that needed it. It is the GELU computed in
  fp32 and cast back to the Linear's dtype (the identity in fp32), which the op computes: rewritten now, in
  fp32 and bf16. A pre-activation also read for its values, or a fp32 GELU also used in fp32, is still
  refused (reported).
- pinned (already rewritten, spelled by no other suite): timm's Block with LayerScale (``x * gamma``, also
  in place) and a DropPath with p > 0 in training (its per-sample mask stays, drawn from eager's seed);
  lit-gpt's RMSNorm (``dim=self.dim``, ``add_unit_offset``, ``.to(dtype=dtype)``); Megatron's
  ``bias_dropout_add`` with the bias ``expand_as`` the residual and its ``bias_gelu`` after a bias-free
  Linear.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _check, _compile

from fx_passes import collecting
from fx_passes._compat import counters

C = 24


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# --------------------------------------------------------------------------------------------------------
# fairseq
# --------------------------------------------------------------------------------------------------------


def fairseq_gelu(x):
    # fairseq/utils.py: gelu
    return F.gelu(x.float()).type_as(x)


class FairseqEncoderLayer(nn.Module):
    """fairseq's TransformerEncoderLayer, post-norm, its attention reduced to a Linear."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.Linear(C, C)
        self.self_attn_layer_norm = nn.LayerNorm(C)
        self.dropout_module, self.activation_dropout_module = nn.Dropout(0.0), nn.Dropout(0.0)
        self.activation_fn = fairseq_gelu
        self.fc1, self.fc2 = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.final_layer_norm = nn.LayerNorm(C)

    def forward(self, x):
        residual = x
        x = self.dropout_module(self.self_attn(x))
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.dropout_module(self.fc2(x))
        return self.final_layer_norm(residual + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fairseq_encoder_layer_utils_gelu_is_fused(dtype):
    text = ".type_as the pre-activation" if dtype == torch.float32 else "cast back to bfloat16"
    tol = 1e-5 if dtype == torch.float32 else 8e-2  # bf16: the GEMMs round differently, a bf16 ulp at 8..16
    model = FairseqEncoderLayer().to(dtype)
    _check(model, (torch.randn(5, 2, C, dtype=dtype),), "dense", rewrites=1, text=text, atol=tol, rtol=tol)


class TypeAsElsewhere(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.fc1, self.form = nn.Linear(C, 2 * C), form

    def forward(self, x):
        h = self.fc1(x)
        g = F.gelu(h.float())
        if self.form == "fp32_gelu_returned":
            return g.type_as(h), g
        if self.form == "second_type_as":
            return g.type_as(h), (g * 2).type_as(h)
        return g.type_as(h), h.sum()  # the pre-activation read for its values


@pytest.mark.parametrize("form, skipped", [("fp32_gelu_returned", 1), ("second_type_as", 1), ("values", 0)])
def test_type_as_pre_activation_with_other_readers_is_left_alone(form, skipped):
    reason = "pre-activation is needed" if skipped else None
    _check(TypeAsElsewhere(form), (torch.randn(5, C),), "dense", rewrites=0, skipped=skipped, reason=reason,
           atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------------------
# timm
# --------------------------------------------------------------------------------------------------------


def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    # timm/layers/drop.py
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class LayerScale(nn.Module):
    def __init__(self, dim, init_values, inplace):
        super().__init__()
        self.inplace, self.gamma = inplace, nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(C, 2 * C), nn.GELU(), nn.Dropout(0.0)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(2 * C, C), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class TimmBlock(nn.Module):
    def __init__(self, inplace, drop_path_p):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(C, eps=1e-6), nn.Linear(C, C)
        self.ls1, self.drop_path1 = LayerScale(C, 0.5, inplace), DropPath(drop_path_p)
        self.norm2, self.mlp = nn.LayerNorm(C, eps=1e-6), Mlp()
        self.ls2, self.drop_path2 = LayerScale(C, 0.5, inplace), DropPath(drop_path_p)

    def forward(self, x):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class TimmTwoBlocks(nn.Module):
    def __init__(self, inplace, drop_path_p):
        super().__init__()
        self.blocks = nn.Sequential(TimmBlock(inplace, drop_path_p), TimmBlock(inplace, drop_path_p))
        self.norm = nn.LayerNorm(C, eps=1e-6)

    def forward(self, x):
        return self.norm(self.blocks(x))


def _seeded_run(model, x, train):
    leaf = x.detach().clone().requires_grad_(train)
    torch.manual_seed(7)  # DropPath's masks: the same draws in eager and compiled
    with torch.set_grad_enabled(train):
        out = model(leaf)
    if not train:
        return [out]
    params = list(model.parameters())
    return [out, *torch.autograd.grad(out, [leaf, *params], torch.ones_like(out))]


@pytest.mark.parametrize("inplace", [False, True], ids=["ls", "ls_inplace"])
def test_timm_blocks_with_layer_scale_and_drop_path(inplace):
    model, x = TimmTwoBlocks(inplace, drop_path_p=0.3), torch.randn(4, 5, C)
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            got = _seeded_run(_compile(copy.deepcopy(model)), x, train)
        want = _seeded_run(model, x, train)
        # the DropPath (a mask per sample) is never folded as elementwise dropout: the sums stay residual adds
        assert counters["flash"]["norm"] == 5 and counters["flash"]["dense"] == 2, str(report)
        assert not any(d.variant.startswith("dropout") for d in report.rewrites), str(report)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------
# lit-gpt
# --------------------------------------------------------------------------------------------------------


class LitRMSNorm(nn.Module):
    """lit-gpt's RMSNorm (litgpt/model.py)."""

    def __init__(self, size, dim=-1, eps=1e-6, add_unit_offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size) + 0.1 * torch.randn(size))
        self.eps, self.dim, self.add_unit_offset = eps, dim, add_unit_offset

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


class LitBlock(nn.Module):
    def __init__(self, **norm):
        super().__init__()
        self.norm_1, self.norm_2 = LitRMSNorm(C, **norm), LitRMSNorm(C, **norm)
        self.attn, self.mlp = nn.Linear(C, C, bias=False), nn.Linear(C, C, bias=False)

    def forward(self, x):
        x = self.attn(self.norm_1(x)) + x
        return self.mlp(self.norm_2(x)) + x


@pytest.mark.parametrize("add_unit_offset", [False, True], ids=["weight", "unit_offset"])
def test_lit_gpt_rmsnorm(add_unit_offset):
    _check(LitBlock(add_unit_offset=add_unit_offset), (torch.randn(2, 5, C),), "norm", rewrites=2,
           text="hand-written RMSNorm + weight", atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------
# Megatron-LM
# --------------------------------------------------------------------------------------------------------


def bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def bias_dropout_add(x, bias, residual, prob, training):
    out = torch.nn.functional.dropout(x + bias, p=prob, training=training)
    return residual + out


class MegatronLayer(nn.Module):
    """Linear layers with skip_bias_add=True return (output, bias); the caller adds the bias."""

    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(C), nn.LayerNorm(C)
        self.dense = nn.Linear(C, C, bias=False)
        self.dense_bias = nn.Parameter(0.1 * torch.randn(C))
        self.fc1 = nn.Linear(C, 2 * C, bias=False)
        self.fc1_bias = nn.Parameter(0.1 * torch.randn(2 * C))
        self.fc2 = nn.Linear(2 * C, C)

    def forward(self, hidden_states):
        ln = self.input_layernorm(hidden_states)
        attn_out = self.dense(ln)
        ln_in = bias_dropout_add(attn_out, self.dense_bias.expand_as(hidden_states), hidden_states, 0.0,
                                 self.training)
        ln_out = self.post_attention_layernorm(ln_in)
        return self.fc2(bias_gelu(self.fc1_bias, self.fc1(ln_out))) + ln_in


def test_megatron_bias_dropout_add_and_bias_gelu():
    model, x = MegatronLayer(), torch.randn(5, 2, C)
    _check(model, (x,), "norm", rewrites=2, text="dropout + residual add + F.layer_norm", atol=1e-5,
           rtol=1e-5)
    _check(model, (x,), "dense", rewrites=1, text="F.linear + b + GELU written out (tanh)", atol=1e-5,
           rtol=1e-5)
