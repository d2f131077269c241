"""fx_passes/attention on a form real code writes that was neither rewritten nor reported: softmax written
out by hand (``exp(s - max) / sum``).

The written-out softmax is taken where it is F.softmax step for step: exp of the scores shifted by their
row max over the key dim (keepdim), over its sum along the same dim (keepdim). The unshifted
``exp(s) / exp(s).sum(-1, keepdim=True)`` is softmax in exact arithmetic only: eager's exp overflows past
88.7 in float32 (NaN) where the op is finite, so it is left alone, reported; so is every look-alike that
computes another function (a max over another dim, of another tensor, without keepdim; a sum over another
dim, without keepdim, of another tensor, plus eps).

Outputs and gradients are compared with eager in fp32; sizes are tiny.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_pass import _check_same, _qkv, _run_rewritten
from test_attention_pass_styles import _assert_left_alone_and_reported

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters
from fx_passes._match import op_name

TOL = dict(atol=2e-5, rtol=2e-5)
B, H, S, D = 2, 3, 7, 8


def _scores(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5


# --------------------------------------------------------------------------------------------------------
# Softmax written out: rewritten
# --------------------------------------------------------------------------------------------------------


def _amax(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def _max_values(q, k, v):
    s = _scores(q, k)
    e = (s - s.max(-1, keepdim=True).values).exp()
    return torch.matmul(e / e.sum(dim=-1, keepdim=True), v)


def _torch_max_getitem(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - torch.max(s, dim=-1, keepdim=True)[0])
    return torch.div(e, torch.sum(e, -1, True)) @ v


def _detached_max_numpy_names(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(axis=-1, keepdims=True).detach())
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def _expression_repeated(q, k, v):
    # each expression written twice: dynamo records two exps, two shifts, two row maxes
    s = _scores(q, k)
    return (torch.exp(s - s.amax(-1, keepdim=True))
            / torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True)) @ v


def _max_shared(q, k, v):
    s = _scores(q, k)
    m = s.amax(-1, keepdim=True)
    return (torch.exp(s - m) / torch.exp(s - m).sum(-1, keepdim=True)) @ v


def _causal_masked(q, k, v):
    n = q.shape[-2]
    s = _scores(q, k).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def _padding_mask(q, k, v, am):
    s = _scores(q, k) + am
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def _bmm_3d(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    s = torch.bmm(q3, k3.transpose(1, 2)) / d**0.5
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.bmm(e / e.sum(-1, keepdim=True), v3).view(b, h, n, d)


def _written_out_einsum(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.einsum("bhqk,bhkd->bhqd", e / e.sum(-1, keepdim=True), v)


def _padding_am():
    am = torch.zeros(B, 1, 1, S)
    am[0, ..., 5:] = float("-inf")
    return am


WRITTEN_OUT = [
    (_amax, ()),
    (_max_values, ()),
    (_torch_max_getitem, ()),
    (_detached_max_numpy_names, ()),
    (_expression_repeated, ()),
    (_max_shared, ()),
    (_causal_masked, ()),
    (_padding_mask, (_padding_am(),)),
    (_bmm_3d, ()),
    (_written_out_einsum, ()),
]


@pytest.mark.parametrize("fn, extra", WRITTEN_OUT, ids=[f.__name__.strip("_") for f, _ in WRITTEN_OUT])
def test_written_out_softmax_is_rewritten(fn, extra):
    torch.manual_seed(0)
    (node,) = _check_same(fn, *_qkv(B=B, H=H, S=S, D=D), *extra)
    if fn is _causal_masked:
        assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    if fn is _padding_mask:
        assert node.kwargs["attn_mask"] is not None
    report = flash_backend.explain(fn, *_qkv(B=B, H=H, S=S, D=D), *extra, print_report=False)
    (decision,) = report.rewrites
    assert decision.variant.startswith("exp/sum softmax"), decision.line()


def test_written_out_softmax_leaves_no_exp_behind():
    # every copy of the repeated expression goes with the rewrite
    _, graphs = _run_rewritten(_expression_repeated, *_qkv(B=B, H=H, S=S, D=D))
    left = [n.name for g in graphs for n in g.nodes if op_name(n) in ("exp", "amax", "sum", "sub", "matmul")]
    assert not left, left


def test_written_out_softmax_under_dynamic_shapes():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 0.3  # a SymFloat input under dynamic=True

        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) * self.scale
            e = torch.exp(s - s.max(-1, keepdim=True).values)
            return (e / e.sum(-1, keepdim=True)) @ v

    m = Attn()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend=rewrite_only_backend, dynamic=True)
    for n in (5, 11):
        q, k, v = (t.requires_grad_() for t in _qkv(B=B, H=H, S=n, D=D))
        qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, ref = compiled(q, k, v), m(qe, ke, ve)
        torch.testing.assert_close(out, ref, **TOL)
        grad = torch.randn_like(ref)
        out.backward(grad)
        ref.backward(grad)
        for a, b in ((q, qe), (k, ke), (v, ve)):
            torch.testing.assert_close(a.grad, b.grad, **TOL)
    assert counters["flash"]["attention"] >= 1 and counters["flash"]["attention_skipped"] == 0


# --------------------------------------------------------------------------------------------------------
# Look-alikes: left alone, reported
# --------------------------------------------------------------------------------------------------------


def _no_max(q, k, v):
    s = _scores(q, k)
    return (torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)) @ v


def _max_over_queries(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-2, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def _max_of_other_tensor(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - (2 * s).amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def _max_without_keepdim(q, k, v):
    # (B, H, Sq) broadcasts against the key dim (runs since Sq == Sk)
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1))
    return (e / e.sum(-1, keepdim=True)) @ v


def _sum_without_keepdim(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1)) @ v


def _sum_over_queries(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-2, keepdim=True)) @ v


def _sum_plus_eps(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / (e.sum(-1, keepdim=True) + 1e-6)) @ v


def _sum_of_other_exp(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / torch.exp(s).sum(-1, keepdim=True)) @ v


def _exp_of_other_tensor(q, k, v):
    s = _scores(q, k)
    return (torch.exp(s - s.amax(-1, keepdim=True))
            / torch.exp(2 * s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True)) @ v


def _sum_also_returned(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    z = e.sum(-1, keepdim=True)
    return (e / z) @ v, z


LOOK_ALIKES = [
    (_no_max, "without subtracting its row max"),
    (_max_over_queries, "not the row max"),
    (_max_of_other_tensor, "not the row max"),
    (_max_without_keepdim, "not the row max"),
    (_sum_without_keepdim, "not a sum over the last (key) dim with keepdim=True"),
    (_sum_over_queries, "not a sum over the last (key) dim with keepdim=True"),
    (_sum_plus_eps, "not by its sum"),
    (_sum_of_other_exp, "not the numerator"),
    (_exp_of_other_tensor, "not the numerator"),
    (_sum_also_returned, "has other users"),
]


@pytest.mark.parametrize("fn, reason", LOOK_ALIKES, ids=[f.__name__.strip("_") for f, _ in LOOK_ALIKES])
def test_written_out_softmax_look_alikes_are_left_alone(fn, reason):
    torch.manual_seed(0)
    # heads, queries and keys alike, so that what broadcasts along the wrong dim still runs
    _assert_left_alone_and_reported(fn, _qkv(B=1, H=8, S=8, D=8), reason)


def test_unshifted_exp_overflows_in_eager_where_the_op_would_not():
    # why the unshifted form is left alone: a score of 100 is NaN in eager; the op would give a finite row
    torch.manual_seed(0)
    q, k, v = _qkv(B=1, H=1, S=S, D=D)
    q[..., 0, :] = k[..., 0, :] * (100 / k[..., 0, :].pow(2).sum() * D**0.5)  # q0·k0 / √D = 100
    eager = _no_max(q, k, v)
    assert eager[..., 0, :].isnan().all() and not eager[..., 1:, :].isnan().any()
    compiled = torch.compile(_no_max, backend=rewrite_only_backend)(q, k, v)
    torch.testing.assert_close(compiled, eager, equal_nan=True)
    assert _amax(q, k, v).isfinite().all()
