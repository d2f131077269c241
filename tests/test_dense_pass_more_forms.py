"""The dense pass on more same-function spellings: GELU spelled with torch.special.erf / erfc /
torch.square / F.tanh; and the look-alikes next to them that must stay unrewritten.

Every positive case checks the exact rewrite count, the variant in the report, and outputs and gradients
(x, the weight and every bias) against eager on CPU fp32, with odd sizes, in training and in eval.
Helpers come from tests/test_dense_pass.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_dense_pass import _assert_same, _check, _rewritten
from torch._dynamo.utils import counters

from fx_passes import collecting

K, N = 13, 19  # odd on purpose
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


class Parts(nn.Module):
    """Those of w (N, K), wt (K, N), b, b2 (bare parameters), lin (nn.Linear) and lin0 (nn.Linear without
    bias) that fn(m, x) reads, named in `parts`, so that every parameter gets a gradient."""

    def __init__(self, fn, parts):
        super().__init__()
        self.fn, parts = fn, parts.split()
        if "w" in parts:
            self.w = nn.Parameter(torch.randn(N, K) / K**0.5)
        if "wt" in parts:
            self.wt = nn.Parameter(torch.randn(K, N) / K**0.5)
        for name in ("b", "b2"):
            if name in parts:
                setattr(self, name, nn.Parameter(torch.randn(N)))
        if "lin" in parts:
            self.lin = nn.Linear(K, N)
        if "lin0" in parts:
            self.lin0 = nn.Linear(K, N, bias=False)

    def forward(self, x):
        return self.fn(self, x)


def _special_erf_gelu(h):
    return h * 0.5 * (1.0 + torch.special.erf(h / math.sqrt(2.0)))


def _on_lin(gelu):
    """fn(m, x) applying a written-out GELU to m.lin(x)."""
    return lambda m, x: gelu(m.lin(x))


# name: (fn(m, x), parameters, x shape, text in the report)
SAME = {
    "special_erf": (_on_lin(_special_erf_gelu), "lin", (3, 5, K), "GELU written out (erf)"),
    "special_erfc": (_on_lin(lambda h: 0.5 * h * torch.special.erfc(-h / math.sqrt(2.0))), "lin", (3, 5, K),
                     "GELU written out (erf)"),
    "torch_erfc": (_on_lin(lambda h: h * torch.erfc(h * -0.7071067811865476) / 2), "lin", (3, 5, K),
                   "GELU written out (erf)"),
    "erfc_method": (_on_lin(lambda h: 0.5 * h * (-h / math.sqrt(2.0)).erfc()), "lin", (3, 5, K),
                    "GELU written out (erf)"),
    "tanh_sqrt_2_over_pi": (
        _on_lin(lambda h: h * 0.5 * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))),
        "lin", (3, 5, K), "GELU written out (tanh)"),
    "tanh_torch_square": (
        _on_lin(lambda h: 0.5 * h * (1 + torch.tanh(SQRT_2_OVER_PI * h * (1 + 0.044715 * torch.square(h))))),
        "lin", (3, 5, K), "GELU written out (tanh)"),
    "tanh_square_method_F_tanh": (
        _on_lin(lambda h: h * (1.0 + F.tanh(SQRT_2_OVER_PI * (h + 0.044715 * h * h.square()))) * 0.5),
        "lin", (3, 5, K), "GELU written out (tanh)"),
    "tanh_torch_mul_add": (
        _on_lin(lambda h: torch.mul(torch.mul(h, 0.5), torch.add(torch.tanh(
            torch.mul(SQRT_2_OVER_PI, torch.add(h, torch.mul(0.044715, torch.pow(h, 3))))), 1.0))),
        "lin", (3, 5, K), "GELU written out (tanh)"),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(SAME))
def test_same_function_is_rewritten(name, train):
    torch.manual_seed(0)
    fn, parts, shape, text = SAME[name]
    m = Parts(fn, parts).train(train)
    _check(m, rewrites=1, text=text, train=train, x=torch.randn(shape))


# --------------------------------------------------------------------------------------------------
# Left alone
# --------------------------------------------------------------------------------------------------


# name: (fn(m, x), parameters[, x shape]): another function, or not a Linear + bias the pass can take; nothing
# rewritten and nothing reported
NOT_A_CANDIDATE = {
    "erfc_wrong_sign": (_on_lin(lambda h: 0.5 * h * torch.erfc(h / math.sqrt(2.0))), "lin"),
    "erfc_without_half": (_on_lin(lambda h: h * torch.special.erfc(-h / math.sqrt(2.0))), "lin"),
    "special_erf_over_sqrt3": (_on_lin(lambda h: h * 0.5 * (1.0 + torch.special.erf(h / math.sqrt(3.0)))),
                               "lin"),
    # the erf GELU, but spelled with two transcendental calls: the checker takes exactly one (conservative)
    "erf_and_erfc_averaged": (
        _on_lin(lambda h: 0.25 * h * (1.0 + torch.erf(h / math.sqrt(2.0)) + torch.erfc(-h / math.sqrt(2.0)))),
        "lin"),
    "tanh_square_wrong_constant": (
        _on_lin(lambda h: 0.5 * h * (1 + torch.tanh(SQRT_2_OVER_PI * h * (1 + 0.04 * torch.square(h))))),
        "lin"),
}


@pytest.mark.parametrize("name", list(NOT_A_CANDIDATE))
def test_other_function_is_left_alone(name):
    torch.manual_seed(0)
    fn, parts, *shape = NOT_A_CANDIDATE[name]
    m, x = Parts(fn, parts), torch.randn(*shape[0]) if shape else torch.randn(3, 5, K)
    counters.clear()
    with collecting() as report:
        _assert_same(m, _rewritten(m), x)
    assert counters["flash"]["dense"] == 0, str(report)
    assert counters["flash"]["dense_skipped"] == 0, str(report)


