"""Adversarial review of the dense pass (session 28): fx_passes/dense.py.

Every case is compiled through the passes (dynamo + fx_passes, the graph run as plain PyTorch, the flash op
on its CPU reference) in training (outputs and the gradients of inputs and parameters) and in eval, at odd
sizes with random inputs, and asserts the rewrite / near-miss counts and eager's results
(tests/test_pass_review_s26.py's harness).

- BUG fixed: an addmm or a GELU that also writes its result into an ``out=`` tensor
  (``torch.addmm(b, x, w.t(), out=buf)``, ``torch._C._nn.gelu(h, out=buf)``) was rewritten and the write to
  buf dropped: the caller's buf stayed as it was (1.7 off here). Now a reported near miss.
- BUG fixed: a GELU written out with a fractional power of the pre-activation,
  ``0.5 * h * (1 + erf(h / sqrt 2) + 1e-20 * (h * h) ** 0.1)``, is within 1e-9 of the erf GELU at every
  sample of the grid, but its gradient is infinite at h = 0 (eager's gradients are NaN for a zero row through
  a bias-free Linear); it was rewritten and returned finite gradients. A non-integer power
  of a value computed from the pre-activation is now reported like a negative one (_unsampled_pole); so is
  the GELU written with ``sqrt(h * h)`` as |h|, whose eager gradient is NaN at 0 too.
- Rewritten, as eager: 5-d inputs, an empty batch, a non-contiguous x, K = 0, N = 0, fp64, ``x @ W + b``
  with W a (K, N) parameter (K != N), Conv1D's addmm, addmm with beta=1.0, alpha=1.0, einsum, the bias on
  the left, ``h.add_(b)``, erfc / torch.special.erf / Tensor.erf spellings,
  ``F.gelu(input=.., approximate=..)``, ``torch.ops.aten.gelu(.., approximate=..)``, a computed weight, a
  tied weight, autocast addmm / einsum.
- Left alone: GELU constants slightly off (0.0447, 0.50001, 0.7978), x * sigmoid(1.702 x) (x * ndtr(x), the
  erf GELU, is rewritten since s29: tests/test_dense_review_s29.py), the tanh GELU written with sigmoid,
  baddbmm, a pre-activation also returned (reported), a (1,), 0-d or (1, N) bias (reported: the op takes
  (N,)), addmm with beta (reported), x written in place between the Linear and the GELU (reported), a GELU
  in a no_grad block inside a training graph (reported).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _compile
from test_pass_review_s26 import ROWS, Fn, K, N, _check, _x
from torch._dynamo.utils import counters

from fx_passes import collecting

S2 = math.sqrt(2.0)
C = math.sqrt(2.0 / math.pi)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


class Wide(Fn):
    """Fn with a (K, N) weight, as Conv1D and ``x @ W`` keep it."""

    def __init__(self, fn):
        super().__init__(fn)
        self.wkn = nn.Parameter(torch.randn(K, N) / K**0.5)


def _new_gelu(h, a=0.044715, c=C, half=0.5):
    return half * h * (1.0 + torch.tanh(c * (h + a * torch.pow(h, 3.0))))


def _erf_gelu(h):
    return 0.5 * h * (1.0 + torch.erf(h / S2))


def _autocast(fn):
    def run(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(m, x)

    return run


# --------------------------------------------------------------------------------------------------------
# out=: the write into buf must survive
# --------------------------------------------------------------------------------------------------------


def _addmm_out(m, x, buf):
    return F.gelu(torch.addmm(m.lin.bias, x, m.lin.weight.t(), out=buf)), buf


def _gelu_out(m, x, buf):
    return torch._C._nn.gelu(m.lin(x), out=buf) * 2.0, buf


@pytest.mark.parametrize("fn", [_addmm_out, _gelu_out], ids=["addmm_out", "gelu_out"])
def test_out_tensor_is_still_written(fn):
    """out= does not support autograd: run without gradients, the module in train and eval mode."""
    model = Fn(fn)
    x = _x(ROWS, K)
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad(), collecting() as report:
            expected = model(x, torch.zeros(ROWS, N))
            got = _compile(model)(x, torch.zeros(ROWS, N))
        assert counters["flash"]["dense"] == 0 and counters["flash"]["dense_skipped"] == 1, str(report)
        assert any("out=" in d.detail for d in report.near_misses), str(report)
        assert not torch.equal(expected[1], torch.zeros(ROWS, N))
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------
# A fractional power of the pre-activation: invisible on the grid, infinite gradient at 0
# --------------------------------------------------------------------------------------------------------


def _zero_row():
    x = _x(ROWS, K)
    x[3] = 0.0  # h = 0 exactly through the bias-free Linear
    x[5] *= 1e-30
    return (x,)


FRACTIONAL = {
    "tiny_root_term": lambda h: 0.5 * h * (1.0 + torch.erf(h / S2) + 1e-20 * (h * h) ** 0.1),
    "abs_as_sqrt_of_square": lambda h: 0.5 * (h + (h * h) ** 0.5 * torch.erf((h * h) ** 0.5 / S2)),
}


@pytest.mark.parametrize("name", list(FRACTIONAL))
def test_fractional_power_of_pre_activation_is_a_near_miss(name):
    form = FRACTIONAL[name]
    model = Fn(lambda m, x: form(m.lin_nb(x)))
    _check(model, _zero_row(), "dense", 0, 1, reason="to the power 0.")


def test_fractional_power_had_nan_gradients_in_eager():
    """Why it is another function: eager's bias gradient at the zero row is NaN, the GELU's is finite."""
    h = torch.zeros(3, requires_grad=True)
    (g,) = torch.autograd.grad(FRACTIONAL["tiny_root_term"](h).sum(), h)
    assert g.isnan().all()
    (g,) = torch.autograd.grad(F.gelu(h).sum(), h)
    assert g.isfinite().all()


def test_integer_float_power_is_still_rewritten():
    _check(Fn(lambda m, x: _new_gelu(m.lin_nb(x))), _zero_row(), "dense", 1, text="GELU written out (tanh)")


# --------------------------------------------------------------------------------------------------------
# Same function: rewritten
# --------------------------------------------------------------------------------------------------------

SAME = {
    # name: (fn, inputs, text in the rewrite)
    "five_dims": (lambda m, x: F.gelu(m.lin(x)), lambda: (_x(2, 3, 1, 5, K),), "F.linear + F.gelu"),
    "empty_batch": (lambda m, x: F.gelu(m.lin(x)), lambda: (_x(0, K),), "F.linear + F.gelu"),
    "non_contiguous_x": (lambda m, x: F.gelu(m.lin(x.transpose(0, 1))), lambda: (_x(K, 7),), "F.linear"),
    "k_zero": (lambda m, x: F.gelu(F.linear(x, m.lin.weight[:, :0], m.lin.bias)), lambda: (_x(ROWS, 0),),
               "F.linear"),
    "n_zero": (lambda m, x: F.gelu(F.linear(x, m.lin.weight[:0], m.lin.bias[:0])), lambda: (_x(ROWS, K),),
               "F.linear"),
    "x_w_kn_plus_b": (lambda m, x: F.gelu(x @ m.wkn + m.bias), lambda: (_x(3, 5, K),), "x @ w + b + F.gelu"),
    "conv1d": (lambda m, x: F.gelu(torch.addmm(m.bias, x.view(-1, K), m.wkn).view(3, 5, N)),
               lambda: (_x(3, 5, K),), "(Conv1D)"),
    "addmm_beta_alpha_one": (
        lambda m, x: F.gelu(torch.addmm(m.bias, x, m.wkn, beta=1.0, alpha=1.0)), lambda: (_x(ROWS, K),),
        "(Conv1D)"),
    "einsum": (lambda m, x: F.gelu(torch.einsum("bsk,nk->bsn", x, m.lin_nb.weight) + m.bias),
               lambda: (_x(3, 5, K),), "torch.einsum"),
    "bias_on_the_left": (lambda m, x: F.gelu(m.bias + m.lin_nb(x)), lambda: (_x(ROWS, K),), "F.linear + b"),
    "bias_added_in_place": (lambda m, x: F.gelu(m.lin_nb(x).add_(m.bias)), lambda: (_x(ROWS, K),),
                            "F.linear + b"),
    "erfc": (lambda m, x: (lambda h: 0.5 * h * torch.erfc(-h / S2))(m.lin(x)), lambda: (_x(ROWS, K),),
             "GELU written out (erf)"),
    "special_erf": (lambda m, x: (lambda h: 0.5 * h * (1 + torch.special.erf(h / S2)))(m.lin(x)),
                    lambda: (_x(ROWS, K),), "GELU written out (erf)"),
    "method_erf": (lambda m, x: (lambda h: h * (0.5 + 0.5 * (h * (1 / S2)).erf()))(m.lin(x)),
                   lambda: (_x(ROWS, K),), "GELU written out (erf)"),
    "gelu_keywords": (lambda m, x: F.gelu(input=m.lin(x), approximate="tanh"), lambda: (_x(ROWS, K),),
                      "F.gelu(tanh)"),
    "aten_gelu_keyword": (lambda m, x: torch.ops.aten.gelu(m.lin(x), approximate="tanh"),
                          lambda: (_x(ROWS, K),), "F.gelu(tanh)"),
    "computed_weight": (lambda m, x: F.gelu(F.linear(x, m.lin.weight * 2.0, m.lin.bias)),
                        lambda: (_x(ROWS, K),), "F.linear"),
    "autocast_addmm": (_autocast(lambda m, x: F.gelu(torch.addmm(m.bias, x, m.wkn))), lambda: (_x(ROWS, K),),
                       "(autocast to bfloat16)"),
    "autocast_einsum": (_autocast(lambda m, x: F.gelu(torch.einsum("bk,nk->bn", x, m.lin.weight))),
                        lambda: (_x(ROWS, K),), "(autocast to bfloat16)"),
}


@pytest.mark.parametrize("name", list(SAME))
def test_same_function_is_rewritten(name):
    fn, args, text = SAME[name]
    tol = 2e-2 if name.startswith("autocast") else 1e-5
    _check(Wide(fn), args(), "dense", 1, text=text, atol=tol, rtol=tol)


def test_fp64_is_rewritten():
    _check(Fn(lambda m, x: _erf_gelu(m.lin(x))).double(), (_x(ROWS, K, dtype=torch.float64),), "dense", 1,
           text="GELU written out (erf)", atol=1e-12, rtol=1e-12)


def test_tied_weight_is_rewritten_twice():
    fn = lambda m, x: F.gelu(m.lin(x)) + F.gelu(F.linear(x, m.lin.weight), approximate="tanh")  # noqa: E731
    _check(Fn(fn), (_x(ROWS, K),), "dense", 2)


# --------------------------------------------------------------------------------------------------------
# Another function, or not provably the same: left alone
# --------------------------------------------------------------------------------------------------------

OTHER = {
    # name: (fn, inputs, near misses)
    "tanh_constant_0_0447": (lambda m, x: _new_gelu(m.lin(x), a=0.0447), 0),
    "half_0_50001": (lambda m, x: _new_gelu(m.lin(x), half=0.50001), 0),
    "sqrt_2_over_pi_0_7978": (lambda m, x: _new_gelu(m.lin(x), c=0.7978), 0),
    "sigmoid_1_702": (lambda m, x: (lambda h: h * torch.sigmoid(1.702 * h))(m.lin(x)), 0),
    "tanh_gelu_as_sigmoid": (
        lambda m, x: (lambda h: h * torch.sigmoid(2 * C * (h + 0.044715 * h**3)))(m.lin(x)), 0),
    "baddbmm": (lambda m, x: F.gelu(torch.baddbmm(m.bias, x, m.lin_nb.weight.t().expand(3, K, N))), 0),
    "also_returned": (lambda m, x: (lambda h: (F.gelu(h), h))(m.lin(x)), 1),
    "bias_of_one": (lambda m, x: F.gelu(F.linear(x, m.lin.weight, m.bias[:1])), 1),
    "bias_0d": (lambda m, x: F.gelu(F.linear(x, m.lin.weight, m.bias[0])), 1),
    "bias_1_by_n": (lambda m, x: F.gelu(F.linear(x, m.lin.weight, m.bias[None])), 1),
    "addmm_bias_of_one": (lambda m, x: F.gelu(torch.addmm(m.bias[:1], x, m.lin.weight.t())), 1),
    "addmm_beta": (lambda m, x: F.gelu(torch.addmm(m.bias, x, m.lin.weight.t(), beta=0.5)), 1),
}


@pytest.mark.parametrize("name", list(OTHER))
def test_other_function_is_left_alone(name):
    fn, skipped = OTHER[name]
    x = _x(3, 5, K) if name == "baddbmm" else _x(ROWS, K)
    _check(Fn(fn), (x,), "dense", 0, skipped)


def test_gelu_in_a_no_grad_block_is_reported_in_training():
    def fn(m, x):
        h = m.lin(x)
        with torch.no_grad():
            return F.gelu(h)

    model = Fn(fn)
    model.train()
    torch._dynamo.reset()
    counters.clear()
    x = _x(ROWS, K)
    with collecting() as report:
        got = _compile(model)(x)
    assert counters["flash"]["dense"] == 0 and counters["flash"]["dense_skipped"] == 1, str(report)
    assert any("no_grad" in d.detail for d in report.near_misses), str(report)
    torch.testing.assert_close(got, model(x))
    assert not got.requires_grad


def test_input_written_between_linear_and_gelu_is_reported():
    def fn(m, x):
        h = m.lin(x)
        x.mul_(2.0)
        return F.gelu(h)

    model = Fn(fn)
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        x = _x(ROWS, K)
        with torch.no_grad(), collecting() as report:
            expected = model(x.clone())
            got = _compile(model)(x.clone())
        assert counters["flash"]["dense"] == 0 and counters["flash"]["dense_skipped"] == 1, str(report)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
