"""The dense pass on more same-function spellings: a bias added to a bias-free Linear, a second bias on a
biased one, GELU spelled with torch.special.erf / erfc / torch.square / F.tanh, F.linear by keyword, and
Linear written as an einsum, Linear + GELU under autocast; and the look-alikes next to them that must stay
unrewritten.

Every positive case checks the exact rewrite count, the variant in the report, and outputs and gradients
(x, the weight and every bias) against eager on CPU fp32 (bf16 autocast for the autocast cases, at bf16's
tolerance), with odd sizes, in training and in eval.
Helpers come from tests/test_dense_pass.py and tests/test_dense_pass_styles.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_dense_pass import _assert_same, _check, _rewritten, _traced, erf_gelu, new_gelu
from test_dense_pass_styles import _check_near_miss
from torch._dynamo.utils import counters

from flash_backend.ops.dense import linear_bias_gelu
from fx_passes import collecting, dense, run_passes

K, N = 13, 19  # odd on purpose
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


class Parts(nn.Module):
    """Those of w (n, k), wt (k, n), b, b2 (bare parameters), lin (nn.Linear) and lin0 (nn.Linear without
    bias) that fn(m, x) reads, named in `parts`, so that every parameter gets a gradient."""

    def __init__(self, fn, parts, k=K, n=N):
        super().__init__()
        self.fn, parts = fn, parts.split()
        if "w" in parts:
            self.w = nn.Parameter(torch.randn(n, k) / k**0.5)
        if "wt" in parts:
            self.wt = nn.Parameter(torch.randn(k, n) / k**0.5)
        for name in ("b", "b2"):
            if name in parts:
                setattr(self, name, nn.Parameter(torch.randn(n)))
        if "lin" in parts:
            self.lin = nn.Linear(k, n)
        if "lin0" in parts:
            self.lin0 = nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.fn(self, x)


def _in_place_second_bias(m, x):
    h = m.lin(x)
    h += m.b2  # dynamo records operator.iadd; the passes read it as h + b2 on a fresh tensor
    return F.gelu(h)


def _conv1d_view_plus_b2(m, x):
    h = torch.addmm(m.b, x.view(-1, K), m.wt).view(*x.shape[:-1], N)
    return new_gelu(h + m.b2)


def _special_erf_gelu(h):
    return h * 0.5 * (1.0 + torch.special.erf(h / math.sqrt(2.0)))


def _on_lin(gelu):
    """fn(m, x) applying a written-out GELU to m.lin(x)."""
    return lambda m, x: gelu(m.lin(x))


# name: (fn(m, x), parameters, x shape, text in the report)
SAME = {
    # 1. a bias added to a bias-free Linear
    "flinear_plus_b": (lambda m, x: F.gelu(F.linear(x, m.w) + m.b), "w b", (3, 5, K),
                       "F.linear + b + F.gelu"),
    "b_plus_flinear": (lambda m, x: F.gelu(m.b + F.linear(x, m.w)), "w b", (3, 5, K),
                       "F.linear + b + F.gelu"),
    "linear_bias_false_plus_b": (lambda m, x: F.gelu(m.lin0(x) + m.b), "lin0 b", (3, 5, K),
                                 "F.linear + b + F.gelu"),
    "linear_bias_false_add_method_tanh": (lambda m, x: F.gelu(m.lin0(x).add(m.b), approximate="tanh"),
                                         "lin0 b", (7, K), "F.linear + b + F.gelu(tanh)"),
    "torch_add_b_first_written_out_erf": (lambda m, x: erf_gelu(torch.add(m.b, F.linear(x, m.w))), "w b",
                                          (3, 5, K), "F.linear + b + GELU written out (erf)"),
    "flinear_bias_none_by_keyword": (lambda m, x: F.gelu(F.linear(input=x, weight=m.w, bias=None) + m.b),
                                     "w b", (3, 5, K), "F.linear + b + F.gelu"),
    # 2. a second bias on a biased Linear: linear(x, w, b) + b2 is linear(x, w, b + b2)
    "linear_plus_b2": (lambda m, x: F.gelu(m.lin(x) + m.b2), "lin b2", (3, 5, K), "F.linear + b2 + F.gelu"),
    "b2_plus_linear_tanh": (lambda m, x: F.gelu(m.b2 + m.lin(x), approximate="tanh"), "lin b2", (3, 5, K),
                            "F.linear + b2 + F.gelu(tanh)"),
    "linear_plus_b2_in_place": (_in_place_second_bias, "lin b2", (3, 5, K), "F.linear + b2 + F.gelu"),
    "linear_plus_b2_new_gelu": (lambda m, x: new_gelu(m.lin(x) + m.b2), "lin b2", (3, 5, K),
                                "F.linear + b2 + GELU written out (tanh)"),
    "flinear_plus_b_plus_b2": (lambda m, x: F.gelu(F.linear(x, m.w) + m.b + m.b2), "w b b2", (3, 5, K),
                               "F.linear + b + b2 + F.gelu"),
    "matmul_plus_b_plus_b2": (lambda m, x: F.gelu(x @ m.w.t() + m.b + m.b2), "w b b2", (3, 5, K),
                              "x @ w.t() + b + b2 + F.gelu"),
    "addmm_plus_b2": (lambda m, x: F.gelu(torch.addmm(m.b, x, m.w.t()) + m.b2), "w b b2", (7, K),
                      "torch.addmm(b, x, w.t()) + b2 + F.gelu"),
    "conv1d_view_plus_b2": (_conv1d_view_plus_b2, "wt b b2", (3, 5, K),
                            "torch.addmm(b, x, w) (Conv1D) + b2 + GELU written out (tanh)"),
    # 3. GELU spellings
    "special_erf": (_on_lin(_special_erf_gelu), "lin", (3, 5, K), "GELU written out (erf)"),
    "special_erf_on_bias_free_plus_b": (lambda m, x: _special_erf_gelu(m.lin0(x) + m.b), "lin0 b", (3, 5, K),
                                        "F.linear + b + GELU written out (erf)"),
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
    # 4. Linear spellings
    "flinear_all_keywords": (lambda m, x: F.gelu(F.linear(input=x, weight=m.w, bias=m.b)), "w b", (3, 5, K),
                             "F.linear + F.gelu"),
    "flinear_mixed_keywords": (lambda m, x: F.gelu(torch.nn.functional.linear(x, weight=m.w, bias=m.b)),
                               "w b", (3, 5, K), "F.linear + F.gelu"),
    "matmul_method_wT_plus_b": (lambda m, x: F.gelu(x.matmul(m.w.T) + m.b), "w b", (3, 5, K),
                                "x @ w.t() + b + F.gelu"),
    "matmul_wmT_plus_b": (lambda m, x: F.gelu(x @ m.w.mT + m.b), "w b", (3, 5, K), "x @ w.t() + b + F.gelu"),
    "torch_matmul_3d_plus_b": (lambda m, x: F.gelu(torch.matmul(x, m.w.t()) + m.b), "w b", (3, 5, K),
                               "x @ w.t() + b + F.gelu"),
    "einsum_bsk_nk_plus_b": (lambda m, x: F.gelu(torch.einsum("bsk,nk->bsn", x, m.w) + m.b), "w b", (3, 5, K),
                             "torch.einsum('bsk,nk->bsn') + b + F.gelu"),
    "einsum_ellipsis_plus_b_tanh": (
        lambda m, x: F.gelu(m.b + torch.einsum("...k,nk->...n", x, m.w), approximate="tanh"), "w b",
        (3, 5, K), "torch.einsum('...k,nk->...n') + b + F.gelu(tanh)"),
    "einsum_kn_layout_plus_b": (lambda m, x: new_gelu(torch.einsum("bsk,kn->bsn", x, m.wt) + m.b), "wt b",
                                (3, 5, K), "torch.einsum('bsk,kn->bsn') + b + GELU written out (tanh)"),
    "einsum_weight_first_spaces": (lambda m, x: F.gelu(torch.einsum("n k, b s k -> b s n", m.w, x) + m.b),
                                   "w b", (3, 5, K), "+ b + F.gelu"),
    "einsum_2d_no_bias": (lambda m, x: erf_gelu(torch.einsum("ik,jk->ij", x, m.w)), "w", (7, K),
                          "torch.einsum('ik,jk->ij') + GELU written out (erf)"),
    "einsum_list_operands_plus_b_plus_b2": (
        lambda m, x: F.gelu(torch.einsum("bsk,nk->bsn", [x, m.w]) + m.b + m.b2), "w b b2", (3, 5, K),
        "+ b + b2 + F.gelu"),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(SAME))
def test_same_function_is_rewritten(name, train):
    torch.manual_seed(0)
    fn, parts, shape, text = SAME[name]
    m = Parts(fn, parts).train(train)
    _check(m, rewrites=1, text=text, train=train, x=torch.randn(shape))


def test_graph_second_bias_is_one_op_on_the_bias_sum():
    """F.gelu(F.linear(x, w, b) + b2) -> linear_bias_gelu(x, w, b + b2): the sum is computed in the graph (its
    gradient reaches b and b2 through autograd), the Linear and the add are gone."""

    def f(x, w, b, b2):
        return F.gelu(F.linear(x, w, b) + b2, approximate="tanh")

    args = (torch.randn(5, K), torch.randn(N, K), torch.randn(N), torch.randn(N))
    gm = _traced(f, *args)
    dense.rewrite(gm.graph)
    gm.graph.lint()
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.add, linear_bias_gelu], gm.code
    assert [a.name for a in calls[0].args] == ["b", "b2"]
    assert calls[1].args[:2] == (gm.graph.find_nodes(op="placeholder")[0],
                                 gm.graph.find_nodes(op="placeholder")[1])
    assert calls[1].args[2] is calls[0] and calls[1].kwargs == {"approximate": "tanh"}
    torch.testing.assert_close(gm(*args), f(*args))
    assert counters["flash"]["dense"] == 1


def test_graph_bias_free_linear_plus_b_takes_b_as_the_bias():
    def f(x, w, b):
        return F.gelu(b + F.linear(x, w))

    args = (torch.randn(5, K), torch.randn(N, K), torch.randn(N))
    gm = _traced(f, *args)
    dense.rewrite(gm.graph)
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [linear_bias_gelu], gm.code
    assert [a.name for a in calls[0].args] == ["x", "w", "b"]
    torch.testing.assert_close(gm(*args), f(*args))


def test_second_bias_in_bf16_is_as_close_to_the_exact_function_as_eager():
    """Eager rounds linear(x, w, b) to bf16 and then rounds again after + b2; the rewrite rounds b + b2 to
    bf16 and then runs one Linear. Neither is bitwise the other; both are one bf16 rounding of an
    intermediate away from the exact function (measured here against fp64), which is the tolerance every
    dense rewrite already takes (x @ w.t() + b moves the bias add into the GEMM's epilogue)."""
    torch.manual_seed(0)
    m = Parts(lambda m, x: F.gelu(m.lin(x) + m.b2), "lin b2")
    x = torch.randn(64, 48, K)
    exact = m.double()(x.double())
    m = m.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    counters.clear()
    with torch.no_grad():
        eager, got = m(xb), _rewritten(m)(xb)
    assert counters["flash"]["dense"] == 1
    assert got.dtype == eager.dtype == torch.bfloat16
    eager_err = (eager.double() - exact).abs()
    got_err = (got.double() - exact).abs()
    assert got_err.max() <= 2 * eager_err.max(), (got_err.max(), eager_err.max())
    assert got_err.mean() <= 1.5 * eager_err.mean(), (got_err.mean(), eager_err.mean())
    torch.testing.assert_close(got, eager, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("train", [True, False])
def test_end_to_end_backend_flash(train):
    for fn, parts in ((lambda m, x: F.gelu(m.lin(x) + m.b2, approximate="tanh"), "lin b2"),
                      (lambda m, x: _special_erf_gelu(torch.einsum("bsk,nk->bsn", x, m.w) + m.b), "w b")):
        torch._dynamo.reset()
        counters.clear()
        m = Parts(fn, parts).train(train)
        _assert_same(m, torch.compile(m, backend="flash", fullgraph=True), torch.randn(2, 7, K), train=train,
                     atol=1e-4, rtol=1e-4)
        assert counters["flash"]["dense"] == 1


# --------------------------------------------------------------------------------------------------
# Left alone
# --------------------------------------------------------------------------------------------------

_FULL_ADDEND = torch.randn(3, 5, N)


def _second_bias_pre_activation_read_elsewhere(m, x):
    h = m.lin(x)
    return F.gelu(h + m.b2) + h


# name: (fn(m, x), parameters[, x shape]): another function, or not a Linear + bias the pass can take; nothing
# rewritten and nothing reported
NOT_A_CANDIDATE = {
    "bias_free_plus_full_addend": (lambda m, x: F.gelu(F.linear(x, m.w) + _FULL_ADDEND), "w"),
    "bias_free_plus_row_bias_1xn": (lambda m, x: F.gelu(F.linear(x, m.w) + m.b[None]), "w b"),
    "bias_free_minus_b": (lambda m, x: F.gelu(F.linear(x, m.w) - m.b), "w b"),
    "bias_free_plus_scaled_b": (lambda m, x: F.gelu(torch.add(F.linear(x, m.w), m.b, alpha=2)), "w b"),
    "linear_plus_itself": (lambda m, x: F.gelu(m.lin(x) + m.lin(x)), "lin"),
    "second_bias_and_pre_activation_read_elsewhere": (_second_bias_pre_activation_read_elsewhere, "lin b2"),
    "einsum_permuted_output": (lambda m, x: F.gelu(torch.einsum("bsk,nk->bns", x, m.w)), "w"),
    "einsum_contracts_a_middle_dim": (lambda m, x: F.gelu(torch.einsum("bks,nk->bsn", x, m.w)), "w",
                                      (3, K, 5)),
    "einsum_sums_an_extra_dim": (lambda m, x: F.gelu(torch.einsum("bsk,nk->bn", x, m.w)), "w"),
    "einsum_outer_product_then_sum": (lambda m, x: F.gelu(torch.einsum("bsk,nj->bsn", x, m.w)), "w"),
    "einsum_three_operands": (lambda m, x: F.gelu(torch.einsum("bsk,nk,n->bsn", x, m.w, m.b)), "w b"),
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
    "quick_gelu_after_second_bias": (lambda m, x: (lambda h: h * torch.sigmoid(1.702 * h))(m.lin(x) + m.b2),
                                     "lin b2"),
    "gelu_of_2h_after_bias_free_plus_b": (lambda m, x: F.gelu(2 * (F.linear(x, m.w) + m.b)), "w b"),
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


def _bias_free_plus_b_read_elsewhere(m, x):
    h = F.linear(x, m.w) + m.b
    return F.gelu(h) * h.sum()


class _WiderSecondBias(nn.Module):
    """An fp64 second bias on an fp32 Linear: eager promotes the GELU's input to fp64."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(K, N)
        self.b2 = nn.Parameter(torch.randn(N, dtype=torch.float64))

    def forward(self, x):
        return F.gelu(self.lin(x) + self.b2)


@pytest.mark.parametrize("make,reason", [
    (lambda: Parts(_bias_free_plus_b_read_elsewhere, "w b"), "also feeds"),
    (lambda: Parts(lambda m, x: (lambda h: new_gelu(h) + h)(m.lin(x) + m.b2), "lin b2"), "also feeds"),
    (_WiderSecondBias, "bias dtype torch.float64 differs from x dtype torch.float32"),
])
def test_near_miss_with_reason(make, reason):
    torch.manual_seed(0)
    _check_near_miss(make(), reason, x=torch.randn(3, 5, K))


def test_autocast_linear_is_a_near_miss():
    """Under autocast the matmul runs in bf16 and an fp32 bias added after it promotes its result, so the
    GELU runs in fp32; the fused op would return bf16: reported, not rewritten."""
    m = Parts(lambda m, x: F.gelu(x @ m.w.t() + m.b), "w b")
    x = torch.randn(3, 5, K)
    counters.clear()
    with collecting() as report, torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got, expected = _rewritten(m)(x), m(x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected)
    assert counters["flash"]["dense"] == 0, str(report)
    assert any("autocast" in d.detail and "promotes" in d.detail for d in report.near_misses), str(report)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("make", [
    lambda: Parts(lambda m, x: F.gelu(m.lin(x)), "lin"),
    lambda: Parts(lambda m, x: F.gelu(F.linear(x, m.w, m.b), approximate="tanh"), "w b"),
    lambda: Parts(lambda m, x: F.gelu(torch.addmm(m.b, x.view(-1, K), m.wt).view(*x.shape[:-1], N)), "wt b"),
], ids=["nn.Linear", "F.linear tanh", "Conv1D addmm"])
def test_autocast_linear_gelu_is_rewritten(make, train):
    """Under autocast (mixed-precision training as most models run) the Linear casts x, its weight and its
    bias to bf16 and the GELU runs on its bf16 output: the rewrite casts the same operands in the graph, so
    the op computes the same function and the fp32 parameters get their gradients through the casts."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(3, 5, K)
    counters.clear()
    with collecting() as report, torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(model, _rewritten(model), x, train=train, atol=2e-2, rtol=2e-2)
    assert counters["flash"]["dense"] == 1, str(report)
    assert "autocast to bfloat16" in str(report), str(report)


def test_autocast_end_to_end_with_the_flash_backend():
    """backend="flash" (the passes, then Inductor) on an MLP block trained under autocast: the Linear + GELU
    is fused, and outputs and fp32 gradients match eager's autocast run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, N), nn.GELU(), nn.Linear(N, K))
    counters.clear()
    with collecting() as report, torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(model, torch.compile(model, backend="flash", fullgraph=True), torch.randn(3, 5, K),
                     atol=2e-2, rtol=2e-2)
    assert counters["flash"]["dense"] == 1, str(report)


def test_autocast_pre_norm_block_fuses_norms_and_dense():
    """A GPT-2 style pre-norm block trained under autocast: the bf16 MLP output (dropout p=0) joins the fp32
    residual stream before the second LayerNorm. Both norms and the Linear + GELU are fused, and outputs and
    fp32 gradients match eager's autocast run."""

    class Block(nn.Module):
        def __init__(self, d=K):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.fc, self.proj, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.0)

        def forward(self, x):
            h = x + self.drop(self.proj(F.gelu(self.fc(self.ln1(x)))))
            return self.ln2(h)

    torch.manual_seed(0)
    model = Block()
    counters.clear()
    with collecting() as report, torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(model, torch.compile(model, backend="flash", fullgraph=True), torch.randn(3, 5, K),
                     atol=2e-2, rtol=2e-2)
    assert (counters["flash"]["dense"], counters["flash"]["norm"]) == (1, 2), str(report)


def test_autocast_entered_inside_the_model():
    """autocast entered inside forward (dynamo records its enter and exit in the graph): the same rewrite, and
    the Linear outside the region stays fp32 and is not touched by the casts."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = nn.Linear(K, N), nn.Linear(N, N)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = F.gelu(self.inner(x))
            return F.gelu(self.outer(h.float()))

    torch.manual_seed(0)
    model = Mixed()
    counters.clear()
    with collecting() as report:
        _assert_same(model, _rewritten(model), torch.randn(3, 5, K), atol=2e-2, rtol=2e-2)
    assert counters["flash"]["dense"] == 2, str(report)
    assert str(report).count("autocast to bfloat16") == 1, str(report)


# CUDA autocast: K and N multiples of 8, so the fused op runs its GPU path (cuBLASLt / Triton), not the
# reference; M = 15 odd. CUDA's autocast policy differs from the CPU's (torch.pow runs in fp32 there).
CK, CN = 24, 40


def _cuda_parts(fn, parts):
    return Parts(fn, parts, k=CK, n=CN).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("make", [
    lambda: _cuda_parts(lambda m, x: F.gelu(m.lin(x)), "lin"),
    lambda: _cuda_parts(lambda m, x: F.gelu(F.linear(x, m.w, m.b), approximate="tanh"), "w b"),
    lambda: _cuda_parts(
        lambda m, x: F.gelu(torch.addmm(m.b, x.view(-1, CK), m.wt).view(*x.shape[:-1], CN)), "wt b"),
], ids=["nn.Linear", "F.linear tanh", "Conv1D addmm"])
def test_cuda_autocast_linear_gelu_is_rewritten(make, train, dtype):
    """test_autocast_linear_gelu_is_rewritten under CUDA autocast, on the GPU kernels: outputs and the fp32
    parameters' gradients match eager's autocast run."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(3, 5, CK, device="cuda")
    counters.clear()
    with collecting() as report, torch.autocast("cuda", dtype=dtype):
        _assert_same(model, _rewritten(model), x, train=train, atol=2e-2, rtol=2e-2)
    assert counters["flash"]["dense"] == 1, str(report)
    assert f"autocast to {str(dtype).split('.')[-1]}" in str(report), str(report)


@pytest.mark.cuda
def test_cuda_autocast_gelu_new_with_pow_is_a_near_miss():
    """GPT-2's gelu_new under CUDA autocast: torch.pow runs in fp32 there, so eager's GELU returns fp32 where
    the fused op would return bf16. Left alone and reported; the compiled result is eager's."""
    torch.manual_seed(0)
    model = _cuda_parts(lambda m, x: new_gelu(m.lin(x)), "lin")
    x = torch.randn(3, 5, CK, device="cuda")
    counters.clear()
    with collecting() as report, torch.autocast("cuda", dtype=torch.bfloat16):
        _assert_same(model, _rewritten(model), x, atol=1e-5, rtol=1e-5)
        assert model(x).dtype == torch.float32
    assert counters["flash"]["dense"] == 0, str(report)
    assert any("float32" in d.detail for d in report.near_misses), str(report)


@pytest.mark.cuda
def test_cuda_autocast_pre_norm_block_with_the_flash_backend():
    """test_autocast_pre_norm_block_fuses_norms_and_dense under CUDA autocast with backend="flash": both
    norms and the Linear + GELU fused, outputs and fp32 gradients as eager's autocast run."""

    class Block(nn.Module):
        def __init__(self, d=CK):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.fc, self.proj, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.0)

        def forward(self, x):
            h = x + self.drop(self.proj(F.gelu(self.fc(self.ln1(x)))))
            return self.ln2(h)

    torch.manual_seed(0)
    model = Block().cuda()
    counters.clear()
    with collecting() as report, torch.autocast("cuda", dtype=torch.bfloat16):
        _assert_same(model, torch.compile(model, backend="flash", fullgraph=True),
                     torch.randn(3, 5, CK, device="cuda"), atol=2e-2, rtol=2e-2)
    assert (counters["flash"]["dense"], counters["flash"]["norm"]) == (1, 2), str(report)


def test_second_bias_rewrite_keeps_the_other_families():
    """run_passes on a block with a norm and a biased Linear + b2: both families fire once."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.lin, self.b2 = nn.LayerNorm(K), nn.Linear(K, N), nn.Parameter(torch.randn(N))
            self.proj = nn.Linear(N, K)

        def forward(self, x):
            return x + self.proj(F.gelu(self.lin(self.ln(x)) + self.b2))

    counters.clear()
    m = Block()

    def backend(gm, example_inputs):
        run_passes(gm.graph)
        return gm.forward

    _assert_same(m, torch.compile(m, backend=backend, fullgraph=True), torch.randn(3, 5, K))
    assert counters["flash"]["dense"] == 1 and counters["flash"]["norm"] == 1
