"""Review of the norm pass (session 28): weights and biases kept with leading singleton dims.

Every case is compiled through the passes (dynamo + fx_passes, the graph then run as plain PyTorch, the flash
op on its CPU reference), in training (outputs and the gradients of the inputs and parameters) and in eval,
with fixed seeds and random inputs at an odd hidden size, and is either rewritten with eager's results or
left alone with eager's results (reported as a near miss where the pass sees a candidate). One case also goes
through backend="flash" (Inductor).

- norm, fixed (fx_passes/norm.py, _is_row, _row_input): a hand-written LayerNorm / RMSNorm (or F.layer_norm,
  F.rms_norm) scaled by a weight, or shifted by a bias, of shape (1, N) or (1, 1, N) (a parameter stored with
  leading singleton dims, or ``w.view(1, -1)``, ``w[None]``, ``w.unsqueeze(0)``, ``w.reshape(1, 1, -1)`` of
  an (N,) one) was left alone whole and reported ("has shape (1, N), not (N,)"); on the numerator
  (``(w * x) * rsqrt(..)``) it was not even seen as the norm's scaling. Such a row broadcasts over the
  normalised value exactly as its (N,) reshape does as long as it has no more dims than that value, so it is
  folded now: the op reads ``w.reshape(-1)``, and autograd gives the gradient back in the parameter's shape.
  Rewritten with it: Llama's RMSNorm, the RMSNorm spellings ``x * rsqrt(..)``, ``x / sqrt(..)``,
  ``x * (..).pow(-0.5)``, a LayerNorm with (1, N) weight and / or bias, ``torch.addcmul``, a pre-norm block
  with dropout and residual, a (1, N) weight in bf16 on fp32 activations, and dynamic shapes.
- norm, left alone (reported): such a row with more dims than the normalised value (a (1, N) weight on a 1-d
  x, (1, 1, N) on a 2-d one): eager's output gains its leading dims, the op's does not.
- norm, the weight not folded (the norm itself rewritten, the weight applied after it as eager applies it):
  an (M, N) weight that varies over the rows, a (B, 1, N) one, an fp32 weight on Llama's bf16 activations
  (eager rounds the normalised value to bf16 first), an fp64 weight (the op does not take fp64).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _check as _check_dynamic
from test_norm_dense_ce_review_s25 import _compile
from test_norm_pass import _rewritten  # (compiled through the passes only, its graphs)

# Fn: a module around fn(module, *inputs); _check: rewrites / near misses and eager's outputs and gradients
from test_pass_review_s26 import Fn, K, N, _check
from torch._dynamo.utils import counters

from flash_backend.ops.add_dropout_norm import add_dropout_norm
from fx_passes import collecting
from fx_passes._match import is_op

H = 97  # an awkward hidden size on purpose
EPS = 1e-6


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


class Rows(Fn):
    """Fn with a weight and a bias of the given shapes (hidden size H), e.g. (1, H) or (1, 1, H)."""

    def __init__(self, fn, weight=(H,), bias=(H,), dtype=torch.float32):
        super().__init__(fn)
        self.weight = nn.Parameter((1.0 + 0.1 * torch.randn(weight)).to(dtype))
        self.bias = nn.Parameter((0.1 * torch.randn(bias)).to(dtype))


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _llama(m, x):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return m.weight * h.to(x.dtype)


def _layer(x):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)


def _variants(model, args):
    """The descriptions of the norm rewrites of model's graph (eval)."""
    model.eval()
    torch._dynamo.reset()
    with collecting() as report:
        _compile(model)(*args)
    return [d.variant for d in report.rewrites]


# ========================================================================================================
# Fixed: rows with leading singleton dims are folded into the op
# ========================================================================================================

# name: (fn, weight shape, bias shape, x shape, the rewrite's description)
ROWS = {
    "llama_weight_1_h": (_llama, (1, H), (H,), (3, 7, H), "hand-written RMSNorm + weight"),
    "llama_weight_1_1_h": (_llama, (1, 1, H), (H,), (3, 7, H), "hand-written RMSNorm + weight"),
    "llama_weight_1_h_on_2d": (_llama, (1, H), (H,), (37, H), "hand-written RMSNorm + weight"),
    "llama_weight_1_1_h_same_rank": (_llama, (1, 1, H), (H,), (1, 37, H), "hand-written RMSNorm + weight"),
    "rms_weight_after": (lambda m, x: _rms(x) * m.weight, (1, H), (H,), (37, H),
                         "hand-written RMSNorm + weight"),
    "rms_div_sqrt": (lambda m, x: m.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)),
                     (1, H), (H,), (37, H), "hand-written RMSNorm + weight"),
    "rms_pow_minus_half": (lambda m, x: m.weight * (x * (x.pow(2).mean(-1, keepdim=True) + EPS).pow(-0.5)),
                           (1, 1, H), (H,), (3, 7, H), "hand-written RMSNorm + weight"),
    "rms_weight_on_numerator": (
        lambda m, x: (m.weight * x) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS),
        (1, H), (H,), (37, H), "hand-written RMSNorm + weight"),
    "rms_view_of_1d": (lambda m, x: _rms(x) * m.weight.view(1, -1), (H,), (H,), (37, H),
                       "hand-written RMSNorm + weight"),
    "rms_none_index_of_1d": (lambda m, x: m.weight[None] * _rms(x), (H,), (H,), (3, 7, H),
                             "hand-written RMSNorm + weight"),
    "rms_unsqueeze_of_1d": (lambda m, x: _rms(x) * m.weight.unsqueeze(0), (H,), (H,), (37, H),
                            "hand-written RMSNorm + weight"),
    "rms_reshape_1_1_h_of_1d": (lambda m, x: _rms(x) * m.weight.reshape(1, 1, -1), (H,), (H,), (3, 7, H),
                                "hand-written RMSNorm + weight"),
    "gemma_one_plus_weight": (lambda m, x: _rms(x.float()) * (1.0 + m.weight.float()), (1, H), (H,), (37, H),
                              "hand-written RMSNorm + weight"),
    "layer_weight_and_bias_1_h": (lambda m, x: _layer(x) * m.weight + m.bias, (1, H), (1, H), (37, H),
                                  "hand-written LayerNorm + weight + bias"),
    "layer_bias_1_h": (lambda m, x: m.weight * _layer(x) + m.bias, (H,), (1, H), (37, H),
                       "hand-written LayerNorm + weight + bias"),
    "layer_weight_1_h_bias_h": (lambda m, x: m.bias + _layer(x) * m.weight, (1, H), (H,), (37, H),
                                "hand-written LayerNorm + weight + bias"),
    "layer_1_1_h_on_3d": (lambda m, x: _layer(x) * m.weight + m.bias, (1, 1, H), (1, 1, H), (3, 7, H),
                          "hand-written LayerNorm + weight + bias"),
    "layer_bias_view_of_1d": (lambda m, x: _layer(x) + m.bias.view(1, 1, H), (H,), (H,), (3, 7, H),
                              "hand-written LayerNorm + bias"),
    "layer_addcmul": (lambda m, x: torch.addcmul(m.bias, _layer(x), m.weight), (1, H), (1, H), (37, H),
                      "hand-written LayerNorm + weight + bias"),
    "layer_weight_on_numerator": (
        lambda m, x: m.weight * (x - x.mean(-1, keepdim=True)) / torch.sqrt(
            x.var(-1, keepdim=True, unbiased=False) + 1e-5) + m.bias, (1, H), (1, H), (37, H),
        "hand-written LayerNorm + weight + bias"),
    "f_layer_norm": (lambda m, x: F.layer_norm(x, (H,)) * m.weight + m.bias, (1, H), (1, H), (37, H),
                     "F.layer_norm + weight + bias"),
    "f_rms_norm": (lambda m, x: F.rms_norm(x, (H,), eps=EPS) * m.weight, (1, 1, H), (H,), (3, 7, H),
                   "F.rms_norm + weight"),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_row_with_leading_singleton_dims_is_folded(name):
    fn, weight, bias, shape, text = ROWS[name]
    model = Rows(fn, weight, bias)
    _check(model, (_x(*shape),), "norm", rewrites=1, text=text)
    assert text in _variants(model, (_x(*shape),))  # the whole affine tail folded, not a shorter one


def _pre_norm(m, x, r):
    # dropout + residual + LayerNorm, the sum also returned (read from the op's residual output)
    h = F.dropout(x, m.p, m.training) + r
    mu = h.mean(-1, keepdim=True)
    var = h.var(-1, keepdim=True, unbiased=False)
    return (h - mu) * torch.rsqrt(var + 1e-5) * m.weight + m.bias, h


def test_pre_norm_block_with_1_1_h_weight_and_bias():
    text = "dropout + residual add + hand-written LayerNorm + weight + bias (pre-norm, returns the residual)"
    args = (_x(3, 7, H), _x(3, 7, H))
    model = Rows(_pre_norm, (1, 1, H), (1, 1, H))
    model.p = 0.0  # eager's outputs and gradients, in training and eval
    _check(model, args, "norm", rewrites=1, text=text)
    # p > 0 draws another mask than eager: the output is the op's norm of the sum the graph returns
    model.p = 0.1
    model.train()
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        out, h = _compile(model)(*args)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0, str(report)
    assert (h != args[1]).any() and ((h - args[1]) == 0).any()  # some elements dropped, others kept
    w, b = model.weight.reshape(-1), model.bias.reshape(-1)
    torch.testing.assert_close(out, add_dropout_norm(h, None, w, b))


def test_row_weight_in_bf16_on_fp32_activations_is_folded():
    # eager promotes the bf16 row to fp32 exactly; the op multiplies in fp32 too. dW comes back in bf16.
    model = Rows(lambda m, x: _rms(x) * m.weight, (1, H), (H,), dtype=torch.bfloat16)
    _check(model, (_x(37, H),), "norm", rewrites=1, text="hand-written RMSNorm + weight", atol=1e-2,
           rtol=1e-2)
    assert "hand-written RMSNorm + weight" in _variants(model, (_x(37, H),))


def test_row_weight_under_dynamic_shapes():
    model = Rows(_llama, (1, 1, H), (H,))
    _check_dynamic(model, None, "norm", 1, dynamic=True, argsets=[(_x(2, 5, H),), (_x(3, 7, H),)],
                   text="hand-written RMSNorm + weight")


def test_graph_reads_the_row_reshaped():
    # the graph after the pass: one fused call reading w.reshape(-1), no multiply by the weight left
    model = Rows(_llama, (1, H), (H,)).eval()
    torch._dynamo.reset()
    compiled, graphs = _rewritten(model)
    compiled(_x(3, 7, H))
    nodes = list(graphs[0].graph.nodes)
    fused = [n for n in nodes if getattr(n.target, "__name__", "") == "add_dropout_norm"]
    assert len(fused) == 1
    weight = fused[0].args[2]
    assert weight.target is torch.reshape and weight.args[1] == (-1,)
    assert weight.args[0].op == "placeholder"
    assert not any(is_op(n, "mul") for n in nodes)


def test_row_weight_through_backend_flash():
    """End to end with Inductor: Llama's RMSNorm with a (1, 1, H) weight, in training."""
    model = Rows(_llama, (1, 1, H), (H,))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="flash", fullgraph=True)
    x = _x(3, 7, H)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = compiled(x1), model(x2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, [x1, model.weight], g)
    want = torch.autograd.grad(ref, [x2, model.weight], g)
    assert got[1].shape == (1, 1, H)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0


# ========================================================================================================
# Left alone: a row whose broadcast adds dims to eager's output
# ========================================================================================================

# name: (fn, weight shape, bias shape, x shape)
HIGHER_RANK = {
    "rms_weight_1_h_on_1d": (lambda m, x: m.weight * _rms(x), (1, H), (H,), (H,)),
    "llama_weight_1_1_h_on_2d": (_llama, (1, 1, H), (H,), (37, H)),
    "rms_view_of_1d_on_1d": (lambda m, x: _rms(x) * m.weight.view(1, -1), (H,), (H,), (H,)),
    "layer_bias_1_h_on_1d": (lambda m, x: _layer(x) * m.weight + m.bias, (H,), (1, H), (H,)),
    "f_layer_norm_weight_1_1_h_on_2d": (lambda m, x: F.layer_norm(x, (H,)) * m.weight, (1, 1, H), (H,),
                                        (37, H)),
}


@pytest.mark.parametrize("name", list(HIGHER_RANK))
def test_row_with_more_dims_than_the_value_is_left_alone(name):
    fn, weight, bias, shape = HIGHER_RANK[name]
    _check(Rows(fn, weight, bias), (_x(*shape),), "norm", rewrites=0, skipped=1,
           reason="more dims than the normalised value")


def test_weight_on_numerator_with_more_dims_than_the_value_is_left_alone():
    # (w * x) * rsqrt(..) with a (1, H) w and a 1-d x: the product is (1, H), not the value's (H,)
    fn = ROWS["rms_weight_on_numerator"][0]
    _check(Rows(fn, (1, H), (H,)), (_x(H),), "norm", rewrites=0, skipped=1, reason="does not scale")


# ========================================================================================================
# Not folded: weights that are no row (the norm is rewritten, the weight runs after it)
# ========================================================================================================

# name: (fn, weight shape, weight dtype, x shape, x dtype)
NOT_ROWS = {
    "weight_varies_over_rows": (lambda m, x: _rms(x) * m.weight, (37, H), torch.float32, (37, H),
                                torch.float32),
    "weight_per_batch": (lambda m, x: m.weight * _rms(x), (3, 1, H), torch.float32, (3, 7, H),
                         torch.float32),
    "layer_weight_varies_over_rows": (lambda m, x: _layer(x) * m.weight, (7, H), torch.float32, (3, 7, H),
                                      torch.float32),
    # Llama in bf16 with an fp32 weight: eager rounds the normalised value to bf16, then promotes
    "llama_fp32_weight_bf16_x": (_llama, (1, H), torch.float32, (37, H), torch.bfloat16),
    "fp64_weight": (lambda m, x: _rms(x) * m.weight, (1, H), torch.float64, (37, H), torch.float32),
}


@pytest.mark.parametrize("name", list(NOT_ROWS))
def test_weight_that_is_no_row_is_not_folded(name):
    fn, weight, dtype, shape, x_dtype = NOT_ROWS[name]
    model = Rows(fn, weight, (H,), dtype=dtype)
    tol = 1e-2 if torch.bfloat16 in (dtype, x_dtype) else 1e-5
    _check(model, (_x(*shape, dtype=x_dtype),), "norm", rewrites=1, atol=tol, rtol=tol)
    assert not any("weight" in v for v in _variants(model, (_x(*shape, dtype=x_dtype),)))


# --------------------------------------------------------------------------------------------------------
# Operands given by keyword, read by the shared matcher (fx_passes/_match.binary_operands) for every family
# --------------------------------------------------------------------------------------------------------


def _rms_keyword_weight(m, x):
    hs = x.float()
    hs = torch.mul(hs, other=torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6))
    return torch.mul(m.weight, other=hs.to(x.dtype))


def _layer_norm_method_keyword(m, x):
    c = x - x.mean(-1, keepdim=True)
    normed = c.div(other=torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5))
    return normed.mul(other=m.weight).add(other=m.bias)


def _gelu_keyword(m, x):
    h = m.lin(x)
    return torch.mul(torch.mul(h, other=0.5), other=1.0 + torch.erf(h / math.sqrt(2.0)))


@pytest.mark.parametrize(("fn", "family"), [(_rms_keyword_weight, "norm"),
                                            (_layer_norm_method_keyword, "norm"),
                                            (_gelu_keyword, "dense")],
                         ids=["rms_torch_mul_other", "layer_norm_method_other", "gelu_torch_mul_other"])
def test_keyword_operands_are_read_by_every_family(fn, family):
    """torch.mul(a, other=b), a.mul(other=b) and the like are a * b: binary_operands read only positional
    operands until session 28, so these norms and this GELU were not seen at all (no rewrite, no report)."""
    x = torch.randn(5, K) if family == "dense" else torch.randn(5, N)
    _check(Fn(fn), (x,), family, rewrites=1)
