"""Adversarial cases for the widened dense pass (second biases, erf/erfc GELUs, einsum Linears): what is
rewritten must be eager's function in the graph's own dtype, and the near look-alikes must stay alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_dense_pass import _assert_same, _rewritten
from test_dense_pass_more_forms import Parts
from torch._dynamo.utils import counters

from fx_passes import collecting

K, N = 13, 19
S2 = math.sqrt(2.0)


def _erf_gelu_scaled(up, down):
    """The erf GELU with h * up * down in front: the same function in fp64, 0 / inf / nan where the
    constants under- or overflow in the graph's dtype."""
    return lambda m, x: (lambda h: 0.5 * (h * up * down) * (1.0 + torch.erf(h / S2)))(m.lin(x))


@pytest.mark.parametrize("dtype,up,down", [
    (torch.float32, 1e-50, 1e50),  # h * 1e-50 is 0 in fp32, and 0 * 1e50 (inf in fp32) nan
    (torch.float16, 1e5, 1e-5),  # h * 1e5 overflows fp16
    (torch.float16, 1e-8, 1e8),  # h * 1e-8 underflows fp16
])
def test_gelu_exact_only_in_fp64_is_left_alone(dtype, up, down):
    torch.manual_seed(0)
    m = Parts(_erf_gelu_scaled(up, down), "lin").to(dtype)
    x = torch.randn(3, 5, K, dtype=dtype)
    counters.clear()
    with torch.no_grad(), collecting() as report:
        got, expected = _rewritten(m)(x), m(x)
    assert counters["flash"]["dense"] == 0, str(report)
    torch.testing.assert_close(got, expected, equal_nan=True)


# name: (fn(m, x), parameters, x shape): the same function, rewritten once, equal to eager with gradients
SAME = {
    "einsum_uppercase": (lambda m, x: F.gelu(torch.einsum("bsK,NK->bsN", x, m.w)), "w", (3, 5, K)),
    "einsum_x_second_2d": (lambda m, x: F.gelu(torch.einsum("nk,bk->bn", m.w, x)), "w", (7, K)),
    "einsum_1d_x": (lambda m, x: F.gelu(torch.einsum("k,nk->n", x, m.w) + m.b), "w b", (K,)),
    "einsum_ellipsis_1d_x": (lambda m, x: F.gelu(torch.einsum("...k,nk->...n", x, m.w)), "w", (K,)),
    "second_bias_on_1d_x": (lambda m, x: F.gelu(m.lin(x) + m.b2), "lin b2", (K,)),
    "bias_computed_after_the_linear": (lambda m, x: (lambda h: F.gelu(h + m.b.sin()))(F.linear(x, m.w)),
                                       "w b", (3, 5, K)),
    "erf_gelu_sub_alpha": (lambda m, x: (lambda h: 0.5 * h * torch.sub(1, torch.erf(-h / S2), alpha=1))(
        m.lin(x)), "lin", (3, 5, K)),
}


def _check(case, rewrites):
    """Outputs and gradients equal to eager's, with the given number of dense rewrites."""
    torch.manual_seed(0)
    fn, parts, shape = case
    m = Parts(fn, parts)
    counters.clear()
    with collecting() as report:
        _assert_same(m, _rewritten(m), torch.randn(shape))
    assert counters["flash"]["dense"] == rewrites, str(report)


@pytest.mark.parametrize("name", list(SAME))
def test_same_function_is_rewritten(name):
    _check(SAME[name], 1)


# name: (fn(m, x), parameters, x shape): another function (or not provably one); nothing rewritten
OTHER = {
    "einsum_ellipsis_after_k": (lambda m, x: F.gelu(torch.einsum("k...,nk->...n", x, m.w)), "w", (K, 3, 5)),
    "einsum_ellipsis_output_last": (lambda m, x: F.gelu(torch.einsum("...k,nk->n...", x, m.w)), "w", (3, K)),
    "einsum_ellipsis_in_the_middle": (lambda m, x: F.gelu(torch.einsum("b...k,nk->b...n", x, m.w)), "w",
                                      (3, 5, K)),
    "einsum_implicit_output": (lambda m, x: F.gelu(torch.einsum("bk,nk", x, m.w)), "w", (7, K)),
    "bias_0d": (lambda m, x: F.gelu(F.linear(x, m.w) + m.b.sum()), "w b", (3, 5, K)),
    "bias_n_by_1": (lambda m, x: F.gelu(F.linear(x, m.w) + m.b[:, None]), "w b", (N, K)),
    "bias_scalar": (lambda m, x: F.gelu(m.lin(x) + 0.3), "lin", (3, 5, K)),
    "add_alpha_1_keyword": (lambda m, x: F.gelu(torch.add(m.lin(x), m.b2, alpha=1)), "lin b2", (3, 5, K)),
    "erfc_sign_flipped": (lambda m, x: (lambda h: -0.5 * h * torch.erfc(h / S2))(m.lin(x)), "lin", (3, 5, K)),
    "erf_constant_0_7071": (lambda m, x: (lambda h: 0.5 * h * (1 + torch.erf(h * 0.7071)))(m.lin(x)), "lin",
                            (3, 5, K)),
}


@pytest.mark.parametrize("name", list(OTHER))
def test_other_function_is_left_alone(name):
    _check(OTHER[name], 0)
