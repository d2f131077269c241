"""The dense pass on code styles that tests/test_dense_pass.py does not spell: Linear written as a matmul
plus a bias, GPT-2's Conv1D on 2-D inputs, more written-out GELU formulas, MLP blocks chained deep enough
that the GELU is far from the end of the graph, and look-alikes that must stay unrewritten (quick-GELU,
wrong constants, erf with the wrong scale).

Positive cases check the rewrite count and forward/gradients (input and parameters) against eager.
Helpers come from tests/test_dense_pass.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_dense_pass import (
    MLP,
    Conv1D,
    K,
    Lambda,
    N,
    _assert_same,
    _check,
    _rewritten,
    erf_gelu,
    new_gelu,
)
from torch._dynamo.utils import counters

from fx_passes import collecting


def _check_near_miss(model, reason, x=None):
    """Left alone, counted as a near miss whose reason names why; the model still runs as eager."""
    counters.clear()
    x = torch.randn(3, 5, K) if x is None else x
    with collecting() as report:
        _assert_same(model, _rewritten(model), x)
    assert counters["flash"]["dense"] == 0, str(report)
    assert counters["flash"]["dense_skipped"] >= 1, str(report)
    assert any(reason in d.detail for d in report.near_misses), str(report)


class Params(nn.Module):
    """Weight (N, K) and bias (N,) as bare parameters, for Linear written by hand; fn(m, x)."""

    def __init__(self, fn, bias=True, transposed=False):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn((K, N) if transposed else (N, K)) / K**0.5)
        self.b = nn.Parameter(torch.randn(N)) if bias else None
        self.proj = nn.Linear(N, K)

    def forward(self, x):
        return self.proj(self.fn(self, x))


# --------------------------------------------------------------------------------------------------
# Linear spellings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form,transposed,bias", [
    ("x @ w.t() + b", False, True),
    ("x @ w.T + b", False, True),
    ("b + torch.matmul(x, w.t())", False, True),
    ("x.matmul(w.transpose(0, 1)) + b", False, True),
    ("x @ w + b", True, True),
    ("x @ w.t()", False, False),
])
def test_linear_written_as_matmul_plus_bias(form, transposed, bias):
    def fn(m, x):
        if form == "x @ w.t() + b":
            h = x @ m.w.t() + m.b
        elif form == "x @ w.T + b":
            h = x @ m.w.T + m.b
        elif form == "b + torch.matmul(x, w.t())":
            h = m.b + torch.matmul(x, m.w.t())
        elif form == "x.matmul(w.transpose(0, 1)) + b":
            h = x.matmul(m.w.transpose(0, 1)) + m.b
        elif form == "x @ w + b":  # w is (K, N), as in Conv1D
            h = x @ m.w + m.b
        else:
            h = x @ m.w.t()
        return F.gelu(h)

    _check(Params(fn, bias=bias, transposed=transposed), text="F.gelu")


def test_mm_2d_without_bias():
    _check(Params(lambda m, x: F.gelu(torch.mm(x, m.w.t()), approximate="tanh"), bias=False),
           x=torch.randn(7, K), text="F.gelu(tanh)")


@pytest.mark.parametrize("form", ["addmm", "addmm_t"])
def test_addmm_on_2d_input(form):
    # Conv1D on an already-flattened (M, K) input: no view around the addmm
    def fn(m, x):
        w = m.w if form == "addmm" else m.w.t()
        return new_gelu(torch.addmm(m.b, x, w))

    _check(Params(fn, transposed=form == "addmm"), x=torch.randn(7, K), text="GELU written out (tanh)")


class TimmMlp(nn.Module):
    """timm / ViT's Mlp: fc1 -> act -> drop -> fc2 -> drop."""

    def __init__(self, act_layer=nn.GELU, bias=True):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(K, N, bias=bias), act_layer(), nn.Dropout(0.0)
        self.fc2, self.drop2 = nn.Linear(N, K, bias=bias), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


def test_module_styles():
    _check(TimmMlp(), text="F.linear + F.gelu")
    _check(TimmMlp(bias=False), x=torch.randn(6, K))
    _check(nn.Sequential(nn.Linear(K, N), nn.GELU(approximate="tanh"), nn.Linear(N, K)), text="F.gelu(tanh)")
    _check(Lambda(lambda x: F.gelu(F.linear(x, torch.ones(N, K)), approximate="none")), x=torch.randn(K))


def test_bert_intermediate_style_gelu_call():
    class BertIntermediate(nn.Module):  # transformers' GELUActivation calls nn.functional.gelu
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(K, N)
            self.intermediate_act_fn = nn.functional.gelu

        def forward(self, hidden_states):
            return self.intermediate_act_fn(self.dense(hidden_states))

    _check(BertIntermediate(), text="F.linear + F.gelu")


def test_channels_last_4d_input():
    # ConvNeXt's block runs its MLP on (B, H, W, C)
    _check(MLP(nn.GELU()), x=torch.randn(2, 3, 4, K))


# --------------------------------------------------------------------------------------------------
# GELU written out
# --------------------------------------------------------------------------------------------------

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
WRITTEN_OUT = {
    "erf_times_inv_sqrt2": (lambda x: 0.5 * x * (1 + torch.erf(x * 0.7071067811865476)), "erf"),
    "erf_method": (lambda x: x * 0.5 * (1.0 + (x / math.sqrt(2.0)).erf()), "erf"),
    "erf_one_over": (lambda x: x * (1.0 + torch.erf(x * (1 / math.sqrt(2)))) / 2, "erf"),
    "tanh_pow_int": (lambda x: 0.5 * x * (1 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3)))),
                     "tanh"),
    "tanh_x_x_x": (lambda x: 0.5 * x * (1 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))), "tanh"),
    "tanh_op_pow": (lambda x: x * 0.5 * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3))),
                    "tanh"),
    "tanh_method_half_last": (lambda x: x * (1 + (SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))).tanh()) * 0.5,
                              "tanh"),
    "megatron_bias_gelu": (lambda x: x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))),
                           "tanh"),
}


@pytest.mark.parametrize("name", list(WRITTEN_OUT))
def test_gelu_written_out(name):
    fn, kind = WRITTEN_OUT[name]
    _check(MLP(Lambda(fn)), text=f"GELU written out ({kind})")


def test_written_out_erf_stays_exact():
    seen = []

    def backend(gm, example_inputs):
        from fx_passes import run_passes

        run_passes(gm.graph)
        seen.extend(n.kwargs.get("approximate") for n in gm.graph.nodes if n.op == "call_function"
                    and "approximate" in n.kwargs)
        return gm.forward

    for name in ("erf_times_inv_sqrt2", "erf_method", "erf_one_over"):
        torch._dynamo.reset()
        torch.compile(MLP(Lambda(WRITTEN_OUT[name][0])), backend=backend, fullgraph=True)(torch.randn(2, K))
    assert seen == ["none"] * 3


# --------------------------------------------------------------------------------------------------
# Deep models: the GELU far from the end of the graph, and the two families together
# --------------------------------------------------------------------------------------------------


class GPT2Block(nn.Module):
    """GPT-2's MLP half-block: ln_2 -> c_fc -> gelu_new -> c_proj -> dropout, added to the residual."""

    def __init__(self):
        super().__init__()
        self.ln_2 = nn.LayerNorm(K)
        self.c_fc, self.c_proj = Conv1D(K, N), Conv1D(N, K)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return x + self.dropout(self.c_proj(new_gelu(self.c_fc(self.ln_2(x)))))


def test_deep_gpt2_stack():
    # Every GELU's formula must be found however much graph follows it.
    m = nn.Sequential(*(GPT2Block() for _ in range(6)))
    report = _check(m, rewrites=6, text="(Conv1D) + GELU written out (tanh)")
    assert counters["flash"]["norm"] == 6, str(report)


def test_bert_layer_both_families_inference_and_dynamic():
    class BertLayerTail(nn.Module):
        def __init__(self):
            super().__init__()
            self.intermediate = nn.Linear(K, N)
            self.output, self.dropout, self.LayerNorm = nn.Linear(N, K), nn.Dropout(0.1), nn.LayerNorm(K)

        def forward(self, attention_output):
            h = F.gelu(self.intermediate(attention_output))
            return self.LayerNorm(self.dropout(self.output(h)) + attention_output)

    m = BertLayerTail().eval()
    compiled = _rewritten(m)
    with torch.no_grad():
        _assert_same(m, compiled, torch.randn(2, 9, K), train=False)
    assert counters["flash"]["dense"] == 1 and counters["flash"]["norm"] == 1

    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="flash", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for b, s in ((2, 5), (3, 7)):
            _assert_same(m, compiled, torch.randn(b, s, K), train=False, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["flash"]["dense"] == 1 and counters["flash"]["norm"] == 1


@pytest.mark.parametrize("train", [True, False])
def test_e2e_matmul_linear(train):
    m = Params(lambda m, x: erf_gelu(x @ m.w.t() + m.b))
    compiled = torch.compile(m, backend="flash", fullgraph=True)
    _assert_same(m, compiled, torch.randn(4, 3, K), train=train, atol=1e-4, rtol=1e-4)
    assert counters["flash"]["dense"] == 1


def test_pre_activation_spelled_twice_is_not_one_gelu():
    # two spellings of x @ w.t() + b are two Linears, each feeding part of the formula: not a GELU of one
    m = Params(lambda m, x: 0.5 * (x @ m.w.t() + m.b) * (1 + torch.erf((x @ m.w.t() + m.b) / math.sqrt(2))))
    _check(m, rewrites=0)


# --------------------------------------------------------------------------------------------------
# Look-alikes: other functions, left alone
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fn", [
    ("quick_gelu", lambda x: x * torch.sigmoid(1.702 * x)),
    ("relu", F.relu),
    ("tanh_wrong_cubic_constant", lambda x: 0.5 * x * (1 + torch.tanh(SQRT_2_OVER_PI * (x + 0.0447 * x**3)))),
    ("tanh_of_x", lambda x: 0.5 * x * (1 + torch.tanh(x))),
    ("erf_over_sqrt3", lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(3.0)))),
    ("erf_without_half", lambda x: x * (1.0 + torch.erf(x / math.sqrt(2.0)))),
    ("quick_gelu_as_tanh", lambda x: x * 0.5 * (1 + torch.tanh(0.851 * x))),
    # equal to the erf GELU to 2e-11 on [-8, 8], yet 5e4 away at x = 1e4
    ("erf_plus_tiny_quintic", lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)) + 1e-15 * x**4)),
])
def test_not_a_gelu(name, fn):
    _check(MLP(Lambda(fn)), rewrites=0)


def test_not_a_gelu_only_at_zero():
    # 0.5 * (h * h / h) * (1 + erf(h / sqrt 2)) is the erf GELU everywhere but at h = 0, where eager's 0 / 0
    # is NaN (a row of zeros, padding, through a bias-free Linear): another function, left alone. The
    # formula is compared with F.gelu on a grid that holds 0 itself.
    m = MLP(Lambda(lambda h: 0.5 * (h * h / h) * (1 + torch.erf(h / math.sqrt(2.0)))), bias=False)
    x = torch.randn(3, 5, K)
    x[0, 0] = 0.0
    counters.clear()
    with torch.no_grad(), collecting() as report:
        got, expected = _rewritten(m)(x), m(x)
    assert counters["flash"]["dense"] == 0, str(report)
    assert expected[0, 0].isnan().all()
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_not_a_gelu_when_a_term_reads_the_pre_activation_outside_it():
    # erf_gelu(h) + 1e-15 * h**5: the GELU part is found, but h feeds the extra term too: a near miss
    _check_near_miss(MLP(Lambda(lambda x: erf_gelu(x) + 1e-15 * x**5)), "also feeds")


def test_near_miss_written_out_gelu_whose_input_is_read_elsewhere():
    _check_near_miss(Params(lambda m, x: (lambda h: new_gelu(h) + h)(F.linear(x, m.w, m.b))), "also feeds")


def test_near_miss_input_written_in_place_before_the_linear():
    # the Linear reads x after x.mul_(2), by the node that held x before it: the fused op, placed after its
    # inputs, would read it before the write
    def fn(m, x):
        x = x * 1
        s = x.sum()
        x.mul_(2)
        return F.gelu(F.linear(x, m.w, m.b)) * s

    _check_near_miss(Params(fn), "written in place")


def test_near_miss_addmm_with_beta():
    _check_near_miss(Params(lambda m, x: F.gelu(torch.addmm(m.b, x, m.w.t(), beta=0.5))), "alpha/beta",
                     x=torch.randn(4, K))


@pytest.mark.parametrize("form", ["broadcast_bias", "matmul_output_read_elsewhere", "batched_weight"])
def test_matmul_that_is_not_a_linear_plus_bias(form):
    # a (5, N) addend is no Linear bias; a matmul whose output is also read elsewhere cannot take the add;
    # a batched (3, K, N) right operand is a bmm, not a Linear. Nothing is rewritten, the result is eager's.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            w_shape = (3, K, N) if form == "batched_weight" else (N, K)
            self.w = nn.Parameter(torch.randn(w_shape) / K**0.5)
            self.b = nn.Parameter(torch.randn(5, N) if form == "broadcast_bias" else torch.randn(N))

        def forward(self, x):
            if form == "broadcast_bias":
                return F.gelu(x @ self.w.t() + self.b)
            if form == "matmul_output_read_elsewhere":
                mm = x @ self.w.t()
                return F.gelu(mm + self.b) + mm
            return F.gelu(x @ self.w + self.b)

    counters.clear()
    m = M()
    with collecting() as report:
        _assert_same(m, _rewritten(m), torch.randn(3, 5, K))
    assert counters["flash"]["dense"] == 0, str(report)
