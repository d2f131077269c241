"""The dense family pass (fx_passes/dense.py): Linear / addmm + GELU -> flash linear_bias_gelu.

A traced graph whose node targets are checked after the pass; the pattern variants through the
rewrite-only backend (dynamo + the pass, the result run as plain PyTorch, forward and backward); and
`torch.compile(backend="flash")` end to end on a small MLP, in training and in inference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from flash_backend.ops.dense import linear_bias_gelu
from fx_passes import collecting, dense, run_passes

K, N = 24, 40


def _rewritten(model):
    def backend(gm, example_inputs):
        run_passes(gm.graph)
        return gm.forward

    return torch.compile(model, backend=backend, fullgraph=True)


def _assert_same(model, compiled, x, train=True, atol=1e-5, rtol=1e-5):
    xe, xc = (x.detach().clone().requires_grad_(train) for _ in range(2))
    with torch.set_grad_enabled(train):
        expected, got = model(xe), compiled(xc)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    if not train:
        return
    grad = torch.randn_like(expected)
    params = list(model.parameters())
    e_grads = torch.autograd.grad(expected, [xe, *params], grad)
    g_grads = torch.autograd.grad(got, [xc, *params], grad)
    for e, g in zip(e_grads, g_grads, strict=True):
        torch.testing.assert_close(g, e, atol=10 * atol, rtol=10 * rtol)


def _check(model, rewrites=1, text=None, train=True, x=None):
    counters.clear()
    x = torch.randn(3, 5, K) if x is None else x
    with collecting() as report:
        _assert_same(model, _rewritten(model), x, train=train)
    assert counters["flash"]["dense"] == rewrites, str(report)
    assert counters["flash"]["dense_skipped"] == 0, str(report)
    if text is not None:
        assert text in str(report), str(report)
    return report


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def new_gelu(x):  # transformers' NewGELUActivation / gelu_new
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def fast_gelu(x):  # transformers' FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def erf_gelu(x):  # transformers' _gelu_python
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class MLP(nn.Module):
    def __init__(self, act, bias=True):
        super().__init__()
        self.fc = nn.Linear(K, N, bias=bias)
        self.act = act
        self.proj = nn.Linear(N, K)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Conv1D(nn.Module):  # GPT-2's: weight is (K, N), y = addmm(b, x, w)
    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class GPT2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(K, N)
        self.c_proj = Conv1D(N, K)

    def forward(self, x):
        return self.c_proj(new_gelu(self.c_fc(x)))


# --------------------------------------------------------------------------------------------------
# Hand-built graph
# --------------------------------------------------------------------------------------------------


def _traced(fn, *args):
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*args)
    return gm


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_graph_linear_gelu_becomes_one_call(approximate):
    def f(x, w, b):
        return F.gelu(F.linear(x, w, b), approximate=approximate)

    args = (torch.randn(4, K), torch.randn(N, K), torch.randn(N))
    gm = _traced(f, *args)
    dense.rewrite(gm.graph)
    gm.graph.lint()
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [linear_bias_gelu], gm.code
    assert [a.name for a in calls[0].args] == ["x", "w", "b"]
    assert calls[0].kwargs == {"approximate": approximate}
    torch.testing.assert_close(gm(*args), f(*args))
    assert counters["flash"]["dense"] == 1


def test_graph_near_miss_when_linear_output_has_another_user():
    def f(x, w, b):
        h = F.linear(x, w, b)
        return F.gelu(h) + h

    args = (torch.randn(4, K), torch.randn(N, K), torch.randn(N))
    gm = _traced(f, *args)
    dense.rewrite(gm.graph)
    assert linear_bias_gelu not in [n.target for n in gm.graph.nodes]
    assert counters["flash"]["dense"] == 0
    assert counters["flash"]["dense_skipped"] == 1


# --------------------------------------------------------------------------------------------------
# Variants through dynamo (rewrite-only backend)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act,text", [
    (nn.GELU(), "F.linear + F.gelu"),
    (nn.GELU(approximate="tanh"), "F.gelu(tanh)"),
    (Lambda(F.gelu), "F.gelu"),
    (Lambda(new_gelu), "GELU written out (tanh)"),
    (Lambda(fast_gelu), "GELU written out (tanh)"),
    (Lambda(erf_gelu), "GELU written out (erf)"),
])
def test_linear_gelu_variants(act, text):
    _check(MLP(act), text=text)


def test_no_bias_and_inference():
    _check(MLP(nn.GELU(), bias=False))
    _check(MLP(nn.GELU(approximate="tanh")).eval(), train=False)


def test_gpt2_conv1d_addmm_new_gelu():
    _check(GPT2MLP(), text="torch.addmm(b, x, w) (Conv1D) + GELU written out (tanh)")


def test_exact_gelu_stays_exact():
    """The erf GELU is rewritten with approximate='none', never the tanh epilogue."""
    counters.clear()
    seen = []

    def backend(gm, example_inputs):
        run_passes(gm.graph)
        seen.extend(n.kwargs.get("approximate") for n in gm.graph.nodes if n.target is linear_bias_gelu)
        return gm.forward

    for act in (nn.GELU(), Lambda(erf_gelu)):
        torch._dynamo.reset()
        torch.compile(MLP(act), backend=backend, fullgraph=True)(torch.randn(2, K))
    assert seen == ["none", "none"]


def test_near_misses_other_user_and_not_gelu():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(K, N)

        def forward(self, x):
            h = self.fc(x)
            return F.gelu(h) * h.sum()

    counters.clear()
    model = Both()
    with collecting() as report:
        _assert_same(model, _rewritten(model), torch.randn(3, K))
    assert counters["flash"]["dense"] == 0, str(report)
    assert counters["flash"]["dense_skipped"] == 1, str(report)
    assert "also feeds" in str(report), str(report)

    counters.clear()
    _check(MLP(nn.SiLU()), rewrites=0)  # not a GELU: nothing to rewrite, nothing to report
    _check(MLP(Lambda(lambda x: 0.5 * x * (1.0 + torch.tanh(0.79 * (x + 0.044715 * x**3))))), rewrites=0)


# --------------------------------------------------------------------------------------------------
# End to end: backend="flash"
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
def test_backend_flash_end_to_end(train):
    model = MLP(nn.GELU(approximate="tanh"))
    counters.clear()
    try:
        lookup_backend("flash")
        backend = "flash"
    except Exception:  # noqa: BLE001 - a checkout that is not pip-installed has no entry point
        from flash_backend.backend import flash_backend as backend
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _assert_same(model, compiled, torch.randn(4, 7, K), train=train, atol=1e-4, rtol=1e-4)
    assert counters["flash"]["dense"] == 1


def _linear_gelu_graph_on_fake_cuda(requires_grad: bool):
    """x, w, b -> F.gelu(F.linear(x, w, b)), with fake CUDA tensors as the example values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
        w = torch.empty(128, 32, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
        b = torch.empty(128, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
        h = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
    graph = torch.fx.Graph()
    inputs = []
    for name, value in (("x", x), ("w", w), ("b", b)):
        node = graph.placeholder(name)
        node.meta["example_value"] = value
        inputs.append(node)
    linear = graph.call_function(F.linear, tuple(inputs))
    linear.meta["example_value"] = h
    gelu = graph.call_function(F.gelu, (linear,), {"approximate": "tanh"})
    gelu.meta["example_value"] = h
    graph.output(gelu)
    return graph, gelu


# Fusing needs the real CUDA autograd machinery even on fake tensors (a CPU-only torch aborts there).
@pytest.mark.parametrize("switch", [pytest.param(True, marks=pytest.mark.cuda), False],
                         ids=["switch_on", "switch_off"])
def test_dense_training_graph_on_cuda_follows_the_switch(monkeypatch, switch):
    """A CUDA training graph is fused while dense_training_on_cuda is on (the default, config.py says why);
    switched off, it is a reported near miss that names the switch."""
    from flash_backend import config as flash_config
    from fx_passes import dense as dense_pass
    from fx_passes._report import collecting

    default = flash_config._env_flag("FLASH_BACKEND_DENSE_TRAINING", True)
    assert flash_config.dense_training_on_cuda == default
    monkeypatch.setattr(flash_config, "dense_training_on_cuda", switch)
    graph, gelu = _linear_gelu_graph_on_fake_cuda(requires_grad=True)
    with collecting() as report:
        dense_pass.rewrite(graph)
    if switch:
        assert gelu not in graph.nodes
        assert counters["flash"]["dense"] == 1 and counters["flash"]["dense_skipped"] == 0, str(report)
        return
    assert gelu in graph.nodes
    assert counters["flash"]["dense"] == 0 and counters["flash"]["dense_skipped"] == 1
    assert "dense_training_on_cuda" in report.near_misses[0].detail
