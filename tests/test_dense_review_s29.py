"""Adversarial review of the dense pass (session 29): fx_passes/dense.py.

Every case is compiled through the passes (dynamo + fx_passes, the graph run as plain PyTorch, the flash op
on its CPU reference) in training (outputs and the gradients of inputs and parameters) and in eval, at odd
sizes with random inputs, and asserts the rewrite / near-miss counts and eager's results
(tests/test_pass_review_s26.py's harness, session 28's (K, N)-weight module).

- GAP fixed: a GELU written with the normal CDF, ``h * torch.special.ndtr(h)`` (ndtr = Phi, so that is the
  erf GELU exactly), was not recognised: ndtr had no canonical name (fx_passes/_match.py _FUNCTIONS) and was
  not one of dense.py's transcendentals. It is now, and the written-out GELU's proof (fp64 grid, then h's
  own dtype) decides: rewritten as approximate="none" (also ``h * (1 - ndtr(-h))``, fp64, bf16);
  ``ndtr(1.702 h)``, ``ndtr(h / sqrt 2)``, ``0.5 * ndtr(h)`` and a tanh-GELU argument inside ndtr are other
  functions, left alone.
- GAP fixed: the Tensor-method addmm ``b.addmm(x, w.t())`` / ``b.addmm(x2d, w).view(..)`` (Conv1D), also
  ``torch.Tensor.addmm(b, ..)``, mat1= / mat2= keywords, beta=1 / alpha=1, under autocast, with a second
  bias, was never matched (the addmm branch took call_function only). It is matched like torch.addmm now,
  with the same refusals: beta / alpha (reported), a 2-d "bias" (``residual.addmm(x, w)``, reported), and
  the deprecated positional overloads ``b.addmm(0.5, x, w)``, ``b.addmm(0.5, 2.0, x, w)``,
  ``torch.addmm(0.5, b, x, w)`` (reported: before, the function form was refused only because args[3] happened
  to be a node and the method form was not looked at). The method has no out=.
- BUG fixed (a crash): ``x @ torch.t(input=w)`` (the transposed weight by keyword) raised IndexError out of
  the backend (dense._is_transpose_2d said "transpose" and its caller read args[0]), failing the whole
  compile. Now read as ``x @ m`` with m (K, N), the same function: rewritten.
- Checked, already right: ``x.matmul(w.t())``, ``x.mm(w.t())``, ``(x @ w.t()).add(b)``, ``h.add(b)`` are
  rewritten; quick_gelu ``h * sigmoid(1.702 h)``, GEGLU (the GELU of a chunk of the Linear output), a GELU of
  a slice, a (1, N) or (M, N) addend, a GELU of the transposed output are left alone; an fp64 or fp16 bias on
  a bias-free fp32 Linear is reported (eager promotes; as a second bias the fp32 sum b + b16 is eager's
  function and is rewritten); F.gelu's approximate is kept; ``h.add_(b)`` then nn.GELU,
  ``h += b`` then nn.GELU('tanh'), a 3-d Linear + GELU + dropout(p=0), a weight transposed twice,
  F.linear under autocast are rewritten with eager's results.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_dense_review_s28 import Wide, _autocast
from test_norm_dense_ce_review_s25 import _check as _check_argsets
from test_norm_dense_ce_review_s25 import _compile
from test_pass_review_s26 import ROWS, K, N, _check, _x
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend

S2 = math.sqrt(2.0)
C = math.sqrt(2.0 / math.pi)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _quiet_deprecated_addmm():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This overload of addmm is deprecated")
        yield


def _ndtr(h):
    return torch.special.ndtr(h)


# --------------------------------------------------------------------------------------------------------
# h * ndtr(h): the erf GELU
# --------------------------------------------------------------------------------------------------------

NDTR_SAME = {
    # name: fn(m, x)
    "h_ndtr_h": lambda m, x: (lambda h: h * _ndtr(h))(m.lin(x)),
    "ndtr_h_times_h": lambda m, x: (lambda h: _ndtr(h) * h)(m.lin(x)),
    "bias_free_plus_b": lambda m, x: (lambda h: h * _ndtr(h))(m.lin_nb(x) + m.bias),
    "one_minus_ndtr_neg": lambda m, x: (lambda h: h * (1.0 - _ndtr(-h)))(m.lin(x)),
    "addmm_conv1d": lambda m, x: (lambda h: torch.mul(h, _ndtr(h)))(
        torch.addmm(m.bias, x.view(-1, K), m.wkn).view(3, 5, N)),
}


@pytest.mark.parametrize("name", list(NDTR_SAME))
def test_ndtr_gelu_is_rewritten_as_the_erf_gelu(name):
    _check(Wide(NDTR_SAME[name]), (_x(3, 5, K),), "dense", 1, text="GELU written out (erf)")


def test_ndtr_gelu_fp64_is_rewritten():
    model = Wide(NDTR_SAME["h_ndtr_h"]).double()
    _check(model, (_x(ROWS, K, dtype=torch.float64),), "dense", 1, text="GELU written out (erf)", atol=1e-12,
           rtol=1e-12)


def test_ndtr_gelu_bf16_is_rewritten():
    """Eager rounds ndtr and the product in bf16, the op the GELU once: a few bf16 steps apart."""
    model = Wide(NDTR_SAME["bias_free_plus_b"]).bfloat16()
    _check(model, (_x(ROWS, K, dtype=torch.bfloat16),), "dense", 1, text="GELU written out (erf)", atol=0.1,
           rtol=0.05)


def test_ndtr_gelu_is_the_erf_gelu_not_the_tanh_one():
    """What the rewrite computes: F.gelu(approximate='none'), which h * ndtr(h) is to fp64 rounding, and
    the tanh GELU is not."""
    h = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    torch.testing.assert_close(h * _ndtr(h), F.gelu(h), atol=1e-15, rtol=1e-14)
    assert (h * _ndtr(h) - F.gelu(h, approximate="tanh")).abs().max() > 1e-4
    model = Wide(NDTR_SAME["h_ndtr_h"])
    x = _x(ROWS, K)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        got = _compile(model)(x)
        want = F.gelu(model.lin(x), approximate="none")
    assert counters["flash"]["dense"] == 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


NDTR_OTHER = {
    # name: fn(m, x); none is the GELU
    "ndtr_of_1_702_h": lambda m, x: (lambda h: h * _ndtr(1.702 * h))(m.lin(x)),
    "ndtr_of_h_over_sqrt2": lambda m, x: (lambda h: h * _ndtr(h / S2))(m.lin(x)),
    "half_ndtr": lambda m, x: (lambda h: 0.5 * _ndtr(h))(m.lin(x)),
    "ndtr_of_tanh_argument": lambda m, x: (lambda h: h * _ndtr(C * (h + 0.044715 * h**3)))(m.lin(x)),
    "h_ndtr_h_plus_tiny": lambda m, x: (lambda h: h * _ndtr(h + 1e-3))(m.lin(x)),
    "quick_gelu": lambda m, x: (lambda h: h * torch.sigmoid(1.702 * h))(m.lin(x)),
}


@pytest.mark.parametrize("name", list(NDTR_OTHER))
def test_ndtr_forms_that_are_not_the_gelu_are_left_alone(name):
    _check(Wide(NDTR_OTHER[name]), (_x(ROWS, K),), "dense", 0, 0)


# --------------------------------------------------------------------------------------------------------
# b.addmm(x, w): the Tensor-method addmm
# --------------------------------------------------------------------------------------------------------

ADDMM_METHOD = {
    # name: (fn(m, x), input shape, text in the rewrite)
    "addmm_method_wt": (lambda m, x: F.gelu(m.lin.bias.addmm(x, m.lin.weight.t())), (ROWS, K),
                        "b.addmm(x, w.t()) + F.gelu"),
    "addmm_method_conv1d_view": (
        lambda m, x: (lambda h: 0.5 * h * (1.0 + torch.tanh(C * (h + 0.044715 * torch.pow(h, 3.0)))))(
            m.bias.addmm(x.view(-1, K), m.wkn).view(3, 5, N)),
        (3, 5, K), "b.addmm(x, w) (Conv1D) + GELU written out (tanh)"),
    "tensor_addmm_function": (lambda m, x: F.gelu(torch.Tensor.addmm(m.bias, x, m.wkn), approximate="tanh"),
                              (ROWS, K), "b.addmm(x, w) (Conv1D) + F.gelu(tanh)"),
    "addmm_method_keywords": (lambda m, x: F.gelu(m.lin.bias.addmm(mat1=x, mat2=m.lin.weight.T)), (ROWS, K),
                              "b.addmm(x, w.t())"),
    "addmm_method_beta_alpha_one": (
        lambda m, x: F.gelu(m.lin.bias.addmm(x, m.lin.weight.t(), beta=1, alpha=1.0)), (ROWS, K),
        "b.addmm(x, w.t())"),
    "addmm_method_plus_b2": (lambda m, x: F.gelu(m.lin.bias.addmm(x, m.lin.weight.t()) + m.bias), (ROWS, K),
                             "b.addmm(x, w.t()) + b2 + F.gelu"),
    "addmm_method_autocast": (_autocast(lambda m, x: F.gelu(m.bias.addmm(x, m.wkn))), (ROWS, K),
                              "(autocast to bfloat16)"),
}


@pytest.mark.parametrize("name", list(ADDMM_METHOD))
def test_addmm_method_is_rewritten(name):
    fn, shape, text = ADDMM_METHOD[name]
    tol = 2e-2 if "autocast" in name else 1e-5
    _check(Wide(fn), (_x(*shape),), "dense", 1, text=text, atol=tol, rtol=tol)


ADDMM_METHOD_REFUSED = {
    # name: (fn(m, x), reason)
    "beta": (lambda m, x: F.gelu(m.lin.bias.addmm(x, m.lin.weight.t(), beta=0.5)), "alpha/beta"),
    "alpha": (lambda m, x: F.gelu(m.lin.bias.addmm(x, m.lin.weight.t(), alpha=2)), "alpha/beta"),
    "deprecated_method_beta": (lambda m, x: F.gelu(m.lin.bias.addmm(0.5, x, m.lin.weight.t())), "deprecated"),
    "deprecated_method_beta_alpha": (lambda m, x: F.gelu(m.lin.bias.addmm(0.5, 2.0, x, m.lin.weight.t())),
                                     "deprecated"),
    "deprecated_function_beta": (lambda m, x: F.gelu(torch.addmm(0.5, m.lin.bias, x, m.lin.weight.t())),
                                 "deprecated"),
    "residual_addmm": (lambda m, x: F.gelu(m.lin(x).addmm(x, m.lin_nb.weight.t())), "1-d (N,)"),
}


@pytest.mark.parametrize("name", list(ADDMM_METHOD_REFUSED))
def test_addmm_method_with_scaling_or_a_2d_input_is_a_near_miss(name):
    fn, reason = ADDMM_METHOD_REFUSED[name]
    _check(Wide(fn), (_x(ROWS, K),), "dense", 0, 1, reason=reason)


def test_addmm_method_ndtr_gelu_dynamic_shapes():
    """Conv1D as a method with an ndtr GELU, dynamic=True: one graph for three batch shapes, eager's
    values and gradients on each."""
    def fn(m, x):
        h = m.bias.addmm(x.view(-1, K), m.wkn).view(*x.shape[:-1], N)
        return h * _ndtr(h)

    _check_argsets(Wide(fn), None, "dense", 1, text="b.addmm(x, w) (Conv1D) + GELU written out (erf)",
                   dynamic=True, argsets=[(_x(3, 5, K),), (_x(2, 7, K),), (_x(4, 3, K),)])


# --------------------------------------------------------------------------------------------------------
# torch.t(input=w): crashed the compile
# --------------------------------------------------------------------------------------------------------


def test_transpose_by_keyword_is_rewritten_not_a_crash():
    _check(Wide(lambda m, x: F.gelu(x @ torch.t(input=m.lin.weight) + m.bias)), (_x(3, 5, K),), "dense", 1,
           text="x @ w + b + F.gelu")


# --------------------------------------------------------------------------------------------------------
# Checked, already right
# --------------------------------------------------------------------------------------------------------


class Extra(Wide):
    """Wide with addends that are not a bias row: (1, N), (M, N), and (N,) biases in other dtypes."""

    def __init__(self, fn):
        super().__init__(fn)
        self.b_row = nn.Parameter(0.1 * torch.randn(1, N))
        self.b_full = nn.Parameter(0.1 * torch.randn(ROWS, N))
        self.b64 = nn.Parameter(0.1 * torch.randn(N, dtype=torch.float64))
        self.b16 = nn.Parameter(0.1 * torch.randn(N, dtype=torch.float16))


def _add_in_place_then_gelu_module(m, x):
    h = m.lin_nb(x)
    h.add_(m.bias)
    return nn.GELU()(h)


def _iadd_then_gelu_module(m, x):
    h = x @ m.lin.weight.t()
    h += m.bias
    return nn.GELU(approximate="tanh")(h)


SAME = {
    # name: (fn(m, x), input shape, text in the rewrite)
    "matmul_method": (lambda m, x: F.gelu(x.matmul(m.lin.weight.t())), (3, 5, K), "x @ w.t() + F.gelu"),
    "mm_method": (lambda m, x: F.gelu(x.mm(m.lin.weight.t()), approximate="tanh"), (ROWS, K),
                  "x @ w.t() + F.gelu(tanh)"),
    "matmul_add_method": (lambda m, x: F.gelu((x @ m.lin.weight.t()).add(m.bias)), (ROWS, K),
                          "x @ w.t() + b + F.gelu"),
    "linear_add_method": (lambda m, x: F.gelu(m.lin_nb(x).add(m.bias)), (ROWS, K), "F.linear + b + F.gelu"),
    "add_in_place_then_nn_gelu": (_add_in_place_then_gelu_module, (ROWS, K), "F.linear + b + F.gelu"),
    "iadd_then_nn_gelu_tanh": (_iadd_then_gelu_module, (ROWS, K), "x @ w.t() + b + F.gelu(tanh)"),
    "weight_transposed_twice": (lambda m, x: F.gelu(x @ m.wkn.t().t() + m.bias), (ROWS, K), "x @ w.t() + b"),
    "3d_gelu_dropout_p0": (lambda m, x: F.dropout(F.gelu(m.lin(x)), 0.0, True), (3, 5, K),
                           "F.linear + F.gelu"),
    "autocast_functional_linear": (_autocast(lambda m, x: F.gelu(F.linear(x, m.lin.weight, m.lin.bias))),
                                   (ROWS, K), "F.linear + F.gelu (autocast to bfloat16)"),
    # the fp32 bias sum b + b16 is fp32, as eager's promoted output: the same function
    "fp16_second_bias_on_fp32_linear": (lambda m, x: F.gelu(m.lin(x) + m.b16), (ROWS, K), "F.linear + b2"),
}


@pytest.mark.parametrize("name", list(SAME))
def test_same_function_is_rewritten(name):
    fn, shape, text = SAME[name]
    tol = 2e-2 if "autocast" in name else 1e-5
    _check(Extra(fn), (_x(*shape),), "dense", 1, text=text, atol=tol, rtol=tol)


def _geglu(m, x):
    a, g = m.lin(x).chunk(2, -1)
    return a * F.gelu(g)


OTHER = {
    # name: (fn(m, x), near misses)
    "geglu_chunk": (_geglu, 0),
    "gelu_of_a_slice": (lambda m, x: F.gelu(m.lin(x)[..., : N // 2]), 0),
    "gelu_of_transposed_output": (lambda m, x: F.gelu(m.lin(x).transpose(0, 1)), 0),
    "addend_1_by_n": (lambda m, x: F.gelu(m.lin_nb(x) + m.b_row), 0),
    "addend_m_by_n": (lambda m, x: F.gelu(m.lin_nb(x) + m.b_full), 0),
    "fp64_bias_promotes": (lambda m, x: F.gelu(m.lin_nb(x) + m.b64), 1),
    "fp16_bias_promotes": (lambda m, x: F.gelu(m.lin_nb(x) + m.b16), 1),
    "pre_activation_used_twice": (lambda m, x: (lambda h: F.gelu(h) * h.sum())(m.lin(x)), 1),
}


@pytest.mark.parametrize("name", list(OTHER))
def test_other_function_is_left_alone(name):
    fn, skipped = OTHER[name]
    _check(Extra(fn), (_x(ROWS, K),), "dense", 0, skipped)


# --------------------------------------------------------------------------------------------------------
# The Linear's input written in place after it, under a frozen weight (review s29, with the cross-entropy
# pass's same case: tests/test_cross_entropy_review_s29.py). The op keeps x for its backward; eager's linear
# keeps only the weight when the weight needs no gradient, so ``h.add_(..)`` after the GELU trained in eager
# and failed the compiled backward ("modified by an inplace operation").
# --------------------------------------------------------------------------------------------------------


def _frozen_input_written_after(x, w, b):
    h = x * 1.0
    y = F.gelu(F.linear(h, w, b))
    h.add_(1.0)
    return y, h


def _frozen_input_not_written(x, w, b):
    h = x * 1.0
    return F.gelu(F.linear(h, w, b)), h


def _run_frozen(fn, compiled, train):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, K, generator=gen).requires_grad_(train)
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)  # frozen: no grad
    run = torch.compile(fn, backend=rewrite_only_backend, fullgraph=True) if compiled else fn
    with torch.set_grad_enabled(train):
        y, h = run(x, w, b)
    if train:
        (y.sum() + h.sum()).backward()
    return y, h, x.grad


@pytest.mark.parametrize(("fn", "train", "rewritten"), [
    (_frozen_input_written_after, True, False),  # the fix: left alone (the backward failed before)
    (_frozen_input_written_after, False, True),  # under no_grad nothing is kept
    (_frozen_input_not_written, True, True),
])
def test_frozen_linear_input_written_after_it(fn, train, rewritten):
    expected = _run_frozen(fn, compiled=False, train=train)
    torch._dynamo.reset()
    counters.clear()
    got = _run_frozen(fn, compiled=True, train=train)
    assert counters["flash"]["dense"] == int(rewritten)
    assert counters["flash"]["dense_skipped"] == int(not rewritten)
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e)
