"""Review of the norm, dense and cross-entropy passes: regressions for what the review found.

- norm: a hand-written LayerNorm / RMSNorm computed in float16 without an upcast rounds its squares (or its
  variance, or its 2-norm) to float16, which overflows past 65504 (a square once |x| > 256): eager's output
  is then 0, the fused op's (fp32 statistics) the normalised value. Another function: left alone, reported.
  F.layer_norm / F.rms_norm calls, bfloat16, and an upcast first (Llama, T5) are still rewritten.
- dense: with dynamic=True dynamo makes ``math.pi`` (and module float attributes) graph inputs, so
  transformers' NewGELU, ``0.5 * h * (1 + tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))``, computes
  its constant in the graph; it was silently missed. Such float constants are now read by their value and
  specialised (dynamo guards and retraces), as the norm pass does for eps; a constant computed from a size is
  not one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

N = 8
K = 6


def _compile(model, dynamic=None):
    def backend(gm, example_inputs):  # a backend object of its own: dynamo traces afresh
        return rewrite_only_backend(gm, example_inputs)

    return torch.compile(model, backend=backend, dynamic=dynamic)


def _leaves(args):
    return [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]


def _same(model, compiled, args, atol=1e-5, rtol=1e-5, grads=True):
    eager_args, comp_args = _leaves(args), _leaves(args)
    expected, got = model(*eager_args), compiled(*comp_args)
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, equal_nan=True)
    if grads:
        weights = torch.linspace(0.5, 1.5, expected.numel()).view(expected.shape)
        (expected.float() * weights).sum().backward()
        (got.float() * weights).sum().backward()
        for e, g in zip(eager_args, comp_args, strict=True):
            if e.grad is not None:
                torch.testing.assert_close(g.grad, e.grad, atol=10 * atol, rtol=10 * rtol, equal_nan=True)


def _decisions(model, *args, dynamic=None):
    with collecting() as report:
        compiled = _compile(model, dynamic=dynamic)
        _same(model, compiled, args, atol=1e-2 if args[0].dtype == torch.float16 else 1e-5,
              rtol=1e-2 if args[0].dtype == torch.float16 else 1e-5,
              grads=args[0].dtype != torch.float16)
    return report


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# --------------------------------------------------------------------------------------------------------
# norm: float16 statistics
# --------------------------------------------------------------------------------------------------------


def _centred(x):
    return x - x.mean(-1, keepdim=True)


FLOAT16_STATISTICS = {
    "rms_pow": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "rms_mul_div_sqrt": lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6),
    "layer_norm_mean_of_squares": lambda x: _centred(x) * torch.rsqrt(
        (_centred(x) ** 2).mean(-1, keepdim=True) + 1e-5),
    "layer_norm_var": lambda x: _centred(x) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5),
    "layer_norm_var_mean": lambda x: (lambda v, m: (x - m) * torch.rsqrt(v + 1e-5))(
        *torch.var_mean(x, -1, keepdim=True, correction=0)),
    "rms_two_norm": lambda x: x / (x.norm(2, -1, keepdim=True) * N ** -0.5),
}


@pytest.mark.parametrize("form", list(FLOAT16_STATISTICS))
def test_float16_statistic_that_overflows_in_eager_is_left_alone(form):
    # x = +-400 (> 256): x * x is inf in fp16, so eager's statistic is inf and its output 0 (the 2-norm needs
    # a larger row: sqrt(8) * 3e4 > 65504). The fused op would return the normalised row instead.
    scale = 3e4 if form == "rms_two_norm" else 400.0
    x = (torch.tensor([1.0, -1.0]).repeat(2, N // 2) * scale).half()
    model = Fn(FLOAT16_STATISTICS[form])
    assert (model(x) == 0).all()
    report = _decisions(model, x)
    assert counters["flash"]["norm"] == 0
    assert any(d.family == "norm" and "float16" in d.detail and "overflows past 65504" in d.detail
               for d in report.near_misses), report


@pytest.mark.parametrize("form", ["rms_pow", "layer_norm_var_mean"])
def test_bfloat16_statistic_has_float32_range_and_is_rewritten(form):
    x = (torch.randn(2, 3, N) * 400).bfloat16()
    with collecting():
        compiled = _compile(Fn(FLOAT16_STATISTICS[form]))
        torch.testing.assert_close(compiled(x), Fn(FLOAT16_STATISTICS[form])(x), atol=5e-2, rtol=5e-2)
    assert counters["flash"]["norm"] == 1


def test_float16_upcast_first_and_norm_calls_are_still_rewritten():
    w = torch.randn(N).half()

    def fn(x, r):
        h = x.float()
        llama = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return llama + F.layer_norm(x + r, (N,)) + F.rms_norm(r, (N,), eps=1e-6)

    x, r = (torch.randn(2, 3, N) * 400).half(), (torch.randn(2, 3, N) * 400).half()
    with collecting():
        compiled = _compile(Fn(fn))
        torch.testing.assert_close(compiled(x, r), fn(x, r), atol=2e-2, rtol=2e-2)
    assert counters["flash"]["norm"] == 3


def test_float16_std_mean_layer_norm_is_still_rewritten():
    # A standard deviation squares nothing in fp16 (ATen accumulates in fp32; std <= the input's range)
    def fn(x):
        std, mean = torch.std_mean(x, -1, keepdim=True, correction=0)
        return (x - mean) / std

    x = (torch.randn(2, 3, N) * 400).half()
    report = _decisions(Fn(fn), x)
    assert counters["flash"]["norm"] == 1, report


# --------------------------------------------------------------------------------------------------------
# dense: float constants that dynamic=True computes in the graph
# --------------------------------------------------------------------------------------------------------


class NewGELU(nn.Module):
    """transformers' NewGELUActivation (GPT-2's gelu_new) after a Linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(K, N)

    def forward(self, x):
        h = self.fc(x)
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


class AttributeGELU(nn.Module):
    """An erf GELU whose constant is a module float attribute (a graph input under dynamic=True)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(K, N)
        self.inv_sqrt2 = 1 / math.sqrt(2.0)

    def forward(self, x):
        h = self.fc(x)
        return h * 0.5 * (1.0 + torch.erf(h * self.inv_sqrt2))


@pytest.mark.parametrize("model_cls", [NewGELU, AttributeGELU])
def test_dynamic_written_out_gelu_with_float_input_constant_is_rewritten(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    with collecting() as report:
        compiled = _compile(model, dynamic=True)
        for shape in [(2, 3, K), (4, 5, K)]:
            _same(model, compiled, [torch.randn(*shape)])
    assert counters["flash"]["dense"] == 1, report
    assert [d.variant for d in report.rewrites] == [
        "F.linear + GELU written out (" + ("tanh" if model_cls is NewGELU else "erf") + ")"]


def test_dynamic_gelu_constant_attribute_changed_after_compile_is_followed():
    torch.manual_seed(0)
    model = AttributeGELU()
    compiled = _compile(model, dynamic=True)
    x = torch.randn(2, 3, K)
    torch.testing.assert_close(compiled(x), model(x))
    model.inv_sqrt2 = 0.5  # no longer a GELU: the guard on the specialised constant recompiles
    torch.testing.assert_close(compiled(x), model(x))


def test_dynamic_constant_computed_from_a_size_is_not_baked_in():
    # sqrt(batch) is sqrt(2), an erf GELU, only for batch 2: a size is never read as a constant
    fc = nn.Linear(K, N)

    def fn(x):
        h = fc(x)
        return 0.5 * h * (1 + torch.erf(h / math.sqrt(x.shape[0])))

    with collecting():
        compiled = _compile(fn, dynamic=True)
        for batch in (2, 3):
            x = torch.randn(batch, 3, K)
            torch.testing.assert_close(compiled(x), fn(x))
    assert counters["flash"]["dense"] == 0
