"""In-place writes on fresh tensors made functional before the families run (fx_passes/_functionalize.py).

``h = r.clone(); h.add_(x)`` and ``h = fc(x); h += r`` are residual sums written in place; made functional,
the norm after them fuses with them. Where the write could be observed (a view read before it), would
change a dtype, or where dropping the clone would read a value written later, the graph keeps its write
and the result is eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import flash_backend
from fx_passes._functionalize import functionalize_in_place

C = 24


def _compare(model, *inputs, atol=1e-5):
    """Outputs and gradients of model under backend="flash" against eager."""
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="flash")
    results = []
    for m, fn in ((model, model), (compiled_model, compiled)):
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        outs = fn(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        weights = [torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o).to(o.dtype) for o in outs]
        sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).float().backward()
        results.append(([o.detach() for o in outs], [t.grad for t in xs] + [p.grad for p in m.parameters()]))
    (e_outs, e_grads), (g_outs, g_grads) = results
    for e, g in zip(e_outs, g_outs, strict=True):
        assert e.dtype == g.dtype
        torch.testing.assert_close(g, e, atol=atol, rtol=atol)
    for e, g in zip(e_grads, g_grads, strict=True):
        assert (e is None) == (g is None)
        if e is not None:
            torch.testing.assert_close(g, e, atol=10 * atol, rtol=10 * atol)


class CloneAddInPlace(nn.Module):
    """A pre-norm residual written in place on a clone of the stream."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        nn.init.normal_(self.ln.weight)

    def forward(self, x, r):
        h = r.clone()
        h.add_(F.dropout(x, 0.0, self.training))
        return self.ln(h), h


class LinearThenAugmentedAdd(nn.Module):
    """``h = fc(x); h += r`` (augmented assignment on a Linear's output), then RMSNorm."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(C, C), nn.RMSNorm(C, eps=1e-6)

    def forward(self, x, r):
        h = self.fc(x)
        h += r
        return self.norm(h)


@pytest.mark.parametrize("model_cls", [CloneAddInPlace, LinearThenAugmentedAdd])
@pytest.mark.parametrize("train", [True, False])
def test_residual_written_in_place_is_fused(model_cls, train):
    torch.manual_seed(0)
    model = model_cls().train(train)
    x, r = torch.randn(3, 7, C, requires_grad=True), torch.randn(3, 7, C, requires_grad=True)
    counters.clear()
    _compare(model, x, r)
    assert counters["flash"]["norm"] == 1, dict(counters["flash"])
    report = flash_backend.explain(model, x, r, print_report=False)
    assert "residual add" in str(report) and not report.near_misses, str(report)


@pytest.mark.cuda
@pytest.mark.parametrize("model_cls", [CloneAddInPlace, LinearThenAugmentedAdd])
def test_residual_written_in_place_is_fused_cuda(model_cls):
    torch.manual_seed(0)
    model = model_cls().cuda().to(torch.bfloat16)
    x, r = (torch.randn(3, 7, C, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    counters.clear()
    _compare(model, x, r, atol=2e-2)
    assert counters["flash"]["norm"] == 1, dict(counters["flash"])


def _functionalized(fn, *inputs) -> torch.fx.Graph:
    graphs = []

    def backend(gm, example_inputs):
        functionalize_in_place(gm.graph)
        gm.graph.lint()
        gm.recompile()
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*inputs)
    return graphs[0]


def _targets(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op in ("call_method", "call_function")]


def test_clone_add_becomes_one_add():
    def fn(x, r):
        h = (r * 2).clone()
        h.add_(x)
        return h

    targets = _targets(_functionalized(fn, torch.randn(4, C), torch.randn(4, C)))
    assert "add_" not in targets and "clone" not in targets, targets


def test_view_read_before_the_write_keeps_it():
    """v = h[0] is a view: it sees the add_, so the write must stay in place."""

    def fn(x, r):
        h = (r * 2).clone()
        v = h[0]
        h.add_(x)
        return F.layer_norm(h, (C,)), v * 3

    x, r = torch.randn(4, C), torch.randn(4, C)
    assert "add_" in _targets(_functionalized(fn, x, r))
    expected = fn(x, r)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="flash")(x, r)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)


def test_source_written_after_the_clone_keeps_the_clone():
    """The clone holds r's value from before r.mul_(2): reading r at the add instead would see the write."""

    def fn(x, a):
        r = a + 1
        h = r.clone()
        r.mul_(2)
        h.add_(x)
        return F.layer_norm(h, (C,)), r

    x, a = torch.randn(4, C), torch.randn(4, C)
    assert "clone" in _targets(_functionalized(fn, x, a))
    expected = fn(x, a)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="flash")(x, a)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)


def test_in_place_add_that_would_promote_stays():
    """bf16 h += fp32 x stays bf16; h + x would be fp32: not the same function, left in place."""

    def fn(x, r):
        h = (r * 2).clone()
        h += x
        return F.layer_norm(h, (C,))

    x, r = torch.randn(4, C), torch.randn(4, C, dtype=torch.bfloat16)
    assert "iadd" in " ".join(_targets(_functionalized(fn, x, r)))
    expected = fn(x, r)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="flash")(x, r)
    assert got.dtype == expected.dtype == torch.bfloat16  # fp32 if the sum had been made functional
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # bf16 rounding of the normalised rows


def test_result_of_an_out_variant_is_not_fresh():
    """``r = torch.add(a, b, out=buf)`` returns buf itself: a write to r writes buf, which the function
    returns. Made functional, buf kept a + b (review s30: the compiled function returned a + b, not
    a + b + 1)."""

    def fn(a, b, buf):
        r = torch.add(a, b, out=buf)
        r.add_(1)
        return F.layer_norm(buf, (C,)), buf * 1

    a, b = torch.randn(4, C), torch.randn(4, C)
    assert "add_" in _targets(_functionalized(fn, a, b, torch.empty(4, C)))
    expected = fn(a, b, torch.empty(4, C))
    torch._dynamo.reset()
    got = torch.compile(fn, backend="flash")(a, b, torch.empty(4, C))
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)


_TRIU = torch.ones(6, 6, dtype=torch.bool).triu(1)


def _megatron_scores(q, k, v):
    """Megatron-LM / gpt-neox attention_mask_func: masked_fill_ on a view of fresh bmm scores."""
    s = torch.bmm(q, k.transpose(1, 2)).view(2, 4, 6, 6)
    s.masked_fill_(_TRIU, -10000.0)
    return torch.bmm(torch.softmax(s, -1).view(8, 6, 6), v)


def _scores_read_elsewhere(q, k, v):
    r = torch.bmm(q, k.transpose(1, 2))
    s = r.view(2, 4, 6, 6)
    s.masked_fill_(_TRIU, -10000.0)  # r sees the write too
    return torch.bmm(torch.softmax(s, -1).view(8, 6, 6), v) + r.sum()


@pytest.mark.parametrize(("fn", "functional"), [(_megatron_scores, True), (_scores_read_elsewhere, False)],
                         ids=["view_of_fresh_scores", "fresh_scores_read_elsewhere"])
def test_write_through_the_only_view_of_a_fresh_tensor(fn, functional):
    """A write through a view that is a fresh tensor's only reader reaches nothing else: made functional
    (review s30: Megatron's and gpt-neox's masked attention was left alone, 'intermediate s has other
    users'), then the attention rewrite takes it. When the fresh tensor is read elsewhere, the write stays."""
    class Module(nn.Module):
        def forward(self, q, k, v):
            return fn(q, k, v)

    q, k, v = (torch.randn(8, 6, 8) for _ in range(3))
    assert ("masked_fill_" not in _targets(_functionalized(fn, q, k, v))) is functional
    counters.clear()
    torch._dynamo.reset()
    _compare(Module(), q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    assert counters["flash"]["attention"] == (1 if functional else 0)
