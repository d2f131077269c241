"""Review of the dense pass (fx_passes/dense.py): regressions for what the review found.

- A written-out GELU is recognised by evaluating it on a grid; a term with a pole or a spike between the
  grid's points passed unseen and the GELU was rewritten:
  ``h * 0.5 * (1 + erf(h / sqrt 2) + 1e-13 / (h - c))`` is within 1e-9 of the erf GELU at every sample and
  infinite at h = c, where a Linear's output lands (a zero row with bias c). Eager returned inf there, the
  fused op the GELU. A division by a value computed from the pre-activation, or a negative or
  pre-activation-dependent power, is now a reported near miss.
- ``F.gelu(lin(x).float()).type_as(x)`` on a bf16 / fp16 Linear is ``.to(x.dtype)``, the op's function: it
  was reported as used in fp32; it is rewritten.
- The torch.ops.aten spellings of gelu, linear, addmm, mm and matmul (packet or .default) are the same
  functions as F.gelu / F.linear / torch.addmm / torch.mm / torch.matmul and are rewritten like them; addmm
  with beta is still a near miss, and the erf GELU stays erf.

Outputs and gradients are compared with eager on CPU (fp32 at 1e-5, bf16 / fp16 at 2e-2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_ce_dense_more_forms_s23 import _same_with_params
from test_dense_pass import _assert_same, _rewritten
from test_dense_pass_more_forms import Parts
from test_norm_dense_ce_review_s23 import Fn, _compile, _same
from torch._dynamo.utils import counters

from fx_passes import collecting, run_passes

K, N = 13, 19  # odd on purpose
S2 = math.sqrt(2.0)
POLE = 0.0045  # between the grid's samples 0.00398 and 0.00501 (and 0 and 0.008)

# --------------------------------------------------------------------------------------------------------
# A written-out GELU with a pole or a spike between the samples
# --------------------------------------------------------------------------------------------------------

POLES = {
    "reciprocal_term": lambda h: h * 0.5 * (1.0 + torch.erf(h / S2) + 1e-13 / (h - POLE)),
    "reciprocal_in_erf": lambda h: h * 0.5 * (1.0 + torch.erf(h / S2 + 1e-13 / (h - POLE))),
    "negative_power": lambda h: h * 0.5 * (1.0 + torch.erf(h / S2) + 1e-13 * (h - POLE) ** -1),
    "power_of_pre_activation": lambda h: h * 0.5 * (1.0 + torch.erf(h / S2)
                                                    + 1e20 ** (-1e10 * (h - POLE) ** 2)),  # a spike at POLE
    "tanh_reciprocal_term": lambda h: 0.5 * h * (1.0 + torch.tanh(
        math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)) + 1e-13 / (h - POLE)),
}


@pytest.mark.parametrize("name", list(POLES))
def test_gelu_with_a_pole_between_the_samples_is_a_near_miss(name):
    torch.manual_seed(0)
    m = Parts(lambda m, x: POLES[name](F.linear(x, m.w, m.b)), "w b")
    with torch.no_grad():
        m.b.fill_(POLE)  # a zero row of x gives h = POLE exactly, where eager's formula is not the GELU
    x = torch.randn(4, K)
    x[1] = 0.0
    counters.clear()
    with torch.no_grad(), collecting() as report:
        got, expected = _rewritten(m)(x), m(x)
    assert counters["flash"]["dense"] == 0, str(report)
    assert any("not provably the GELU between the samples" in d.detail for d in report.near_misses), report
    assert not torch.allclose(expected[1], F.gelu(torch.full((N,), POLE)))  # the formula is no GELU there
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_gelu_with_a_pole_keeps_gradients_as_eager():
    torch.manual_seed(0)
    m = Parts(lambda m, x: POLES["reciprocal_term"](F.linear(x, m.w, m.b)), "w b")
    counters.clear()
    with collecting() as report:
        _assert_same(m, _rewritten(m), torch.randn(3, 5, K))
    assert counters["flash"]["dense"] == 0 and counters["flash"]["dense_skipped"] == 1, str(report)


class ConstantGELU(nn.Module):
    """An erf GELU dividing by, and a tanh GELU raising to, module float attributes (graph inputs under
    dynamic=True): constants, not values of the pre-activation."""

    def __init__(self, tanh):
        super().__init__()
        self.fc = nn.Linear(K, N)
        self.tanh, self.sqrt2, self.three = tanh, S2, 3.0

    def forward(self, x):
        h = self.fc(x)
        if self.tanh:
            cubic = 0.044715 * torch.pow(h, self.three)
            return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (h + cubic)))
        return h * 0.5 * (1.0 + torch.erf(h / self.sqrt2))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("tanh", [False, True])
def test_division_and_power_by_constants_are_still_rewritten(tanh, dynamic):
    torch.manual_seed(0)
    model = ConstantGELU(tanh)
    counters.clear()
    with collecting() as report:
        compiled = _compile(model, dynamic=dynamic)
        for shape in [(2, 3, K), (4, 5, K)][:2 if dynamic else 1]:  # dynamic: one graph for both
            _same(model, compiled, [torch.randn(*shape)])
    assert counters["flash"]["dense"] == 1, report
    kind = "tanh" if tanh else "erf"
    assert [d.variant for d in report.rewrites] == [f"F.linear + GELU written out ({kind})"]


# --------------------------------------------------------------------------------------------------------
# GELU in fp32 cast back with type_as
# --------------------------------------------------------------------------------------------------------


def _dense(fn, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(K, N).to(dtype)
    return Fn(lambda x: fn(lin, x)), lin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_fp32_cast_back_with_type_as_is_rewritten(dtype, approximate):
    model, lin = _dense(lambda lin, x: F.gelu(lin(x).float(), approximate=approximate).type_as(x), dtype)
    x = torch.randn(2, 3, K, dtype=dtype)
    counters.clear()
    with collecting() as report:
        _same_with_params(model, _compile(model), lin, x, tol=2e-2)
    assert counters["flash"]["dense"] == 1, report
    name = str(dtype).removeprefix("torch.")
    assert f"(in fp32, cast back to {name})" in report.rewrites[0].variant, report


def test_gelu_in_fp32_type_as_an_fp32_tensor_is_left_alone():
    # type_as an fp32 tensor keeps the fp32 GELU: the op would round it to bf16
    model, lin = _dense(lambda lin, x: F.gelu(lin(x).float()).type_as(x.float()), torch.bfloat16)
    counters.clear()
    with collecting() as report:
        _same_with_params(model, _compile(model), lin, torch.randn(2, 3, K, dtype=torch.bfloat16), tol=2e-2)
    assert counters["flash"]["dense"] == 0, report
    assert any("used in fp32" in d.detail for d in report.near_misses), report


# --------------------------------------------------------------------------------------------------------
# torch.ops.aten spellings
# --------------------------------------------------------------------------------------------------------

aten = torch.ops.aten
ATEN = {
    "aten_gelu": (lambda m, x: aten.gelu(m.lin(x)), "lin", "none"),
    "aten_gelu_default_tanh": (lambda m, x: aten.gelu.default(m.lin(x), approximate="tanh"), "lin", "tanh"),
    "aten_linear": (lambda m, x: F.gelu(aten.linear(x, m.w, m.b)), "w b", "none"),
    "aten_linear_default_no_bias": (lambda m, x: aten.gelu(aten.linear.default(x, m.w) + m.b), "w b", "none"),
    "aten_addmm_conv1d": (lambda m, x: F.gelu(aten.addmm(m.b, x.view(-1, K), m.wt).view(*x.shape[:-1], N)),
                          "wt b", "none"),
    "aten_mm": (lambda m, x: F.gelu(aten.mm(x.view(-1, K), m.w.t()), approximate="tanh"), "w", "tanh"),
    "aten_matmul_plus_b": (lambda m, x: F.gelu(aten.matmul(x, m.w.t()) + m.b), "w b", "none"),
}


def _approximations(model, x):
    """The approximate= of every fused call the pass leaves in model's graph."""
    seen = []

    def backend(gm, example_inputs):
        run_passes(gm.graph)
        seen.extend(n.kwargs["approximate"] for n in gm.graph.nodes
                    if n.op == "call_function" and "approximate" in n.kwargs and "gelu" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    return seen


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", list(ATEN))
def test_aten_spellings_are_rewritten(name, train):
    torch.manual_seed(0)
    fn, parts, approximate = ATEN[name]
    m = Parts(fn, parts)
    x = torch.randn(3, 5, K)
    counters.clear()
    with collecting() as report:
        _assert_same(m, _rewritten(m), x, train=train)
    assert counters["flash"]["dense"] == 1 and counters["flash"]["dense_skipped"] == 0, str(report)
    with collecting():
        assert _approximations(m, x) == [approximate]  # an erf GELU stays erf


def test_aten_addmm_with_beta_is_a_near_miss():
    torch.manual_seed(0)
    m = Parts(lambda m, x: F.gelu(aten.addmm(m.b, x, m.wt, beta=0.5)), "wt b")
    counters.clear()
    with collecting() as report:
        _assert_same(m, _rewritten(m), torch.randn(4, K))
    assert counters["flash"]["dense"] == 0, str(report)
    assert any("alpha/beta" in d.detail for d in report.near_misses), str(report)


def test_aten_quick_gelu_is_left_alone():
    # x * sigmoid(1.702 x) after an aten.linear: not a GELU, whichever way the Linear is spelled
    torch.manual_seed(0)
    m = Parts(lambda m, x: (lambda h: h * torch.sigmoid(1.702 * h))(aten.linear(x, m.w, m.b)), "w b")
    counters.clear()
    with collecting() as report:
        _assert_same(m, _rewritten(m), torch.randn(3, 5, K))
    assert counters["flash"]["dense"] == 0 and counters["flash"]["dense_skipped"] == 0, str(report)
