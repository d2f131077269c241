"""Review of the norm and cross-entropy passes (session 29): in-place writes the fused norm cannot reproduce.

Every case is compiled through the passes (dynamo + fx_passes, the graph then run as plain PyTorch, the flash
op on its CPU reference), with fixed seeds, and its outputs and gradients compared with eager's.

- norm, fixed (fx_passes/norm.py, _plan -> _check_saved_not_written): the fused op saves for its backward the
  pre-norm sum it returns (a pre-norm block's residual stream), or its input x when it stores no sum (no
  residual, no dropout), and its weight and bias. A write to one of them after the norm (``h += f(norm(h))``,
  a block updating its residual stream in place; ``x += ..`` after Llama's RMSNorm of a bf16 x) bumped its
  version and the compiled backward raised "modified by an inplace operation", where eager's hand-written
  norm, which saves only what it computes from them (``x - mean``, ``x.float()``), trains; so does
  F.rms_norm of a bf16 x (it saves an fp32 copy). Left alone now, reported, when the graph may record
  gradients; still rewritten under no_grad, where nothing is saved. F.layer_norm of ``x.float()`` keeps the
  upcast as the op's input (the copy eager saves too) instead of folding it.
- norm, fixed (fx_passes/norm.py, _dropout_p -> _memory_sharer): ``F.dropout(z, p, inplace=True)`` of a z that
  shares another tensor's memory without being a view (``a.float()`` / ``a.to(a.dtype)`` / ``a.type_as(a)`` /
  ``a.contiguous()``, which return a itself, or ``a.detach()``) was folded: eager drops a's values in place,
  which a's other readers (a returned ``a``) see; the fused op wrote nothing, and a came back undropped.
  Left alone now, reported.
- norm, kept (controls): F.layer_norm's input written after it, which eager's layer_norm saves too (its
  backward fails as the op's does); the residual input, which neither saves; a bias written after the norm
  stays after the op (not folded), the norm and weight fused. An in-place dropout of a fresh tensor read by
  nothing else is still folded (the same values as the op called directly with the same seed);
  F.dropout1d / dropout2d / alpha_dropout / feature_alpha_dropout and DropPath's per-sample mask are not
  elementwise dropout and are never folded as one (the norm of their sum is, with eager's random draws).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _compile, _run
from test_pass_review_s26 import Fn, N
from torch._dynamo.utils import counters

from flash_backend.ops.add_dropout_norm import add_dropout_norm
from fx_passes import collecting

EPS = 1e-6


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _check_mode(model, args, train, rewrites, skipped=0, reason=None, text=None, atol=1e-5, rtol=1e-5):
    """In training (train=True, grads recorded) or in eval under no_grad: `rewrites` rewrites and `skipped`
    near misses of the norm family, and the compiled model returns eager's outputs and gradients, both run
    from the same seed (an unfused dropout then draws eager's mask)."""
    model.train(train)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        compiled = _compile(model)
        torch.manual_seed(1)
        expected = _run(model, args, train)
        torch.manual_seed(1)
        got = _run(compiled, args, train)
    assert len(got) == len(expected), str(report)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, str(report)
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, equal_nan=True)
    assert counters["flash"]["norm"] == rewrites, str(report)
    assert counters["flash"]["norm_skipped"] == skipped, str(report)
    if reason is not None:
        assert any(reason in d.detail for d in report.near_misses), str(report)
    if text is not None:
        assert any(text in d.variant for d in report.rewrites), str(report)
    return report


def _hand_ln(h):
    mu = h.mean(-1, keepdim=True)
    c = h - mu
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS)


# --------------------------------------------------------------------------------------------------------
# A tensor the op saves for its backward, written in place after the norm
# --------------------------------------------------------------------------------------------------------


def _residual_stream_in_place(m, x, r):
    # a pre-norm block updating its residual stream in place: eager's norm saves x - mean, not h
    h = x + r
    y = _hand_ln(h) * m.weight + m.bias
    h += torch.tanh(y)
    return h


def _dropout_residual_stream_in_place(m, x, r):
    h = F.dropout(x, 0.0, m.training) + r
    y = _hand_ln(h) * m.weight + m.bias
    h.mul_(0.5)
    return h, y


def _input_in_place(m, x):
    x = x * 1.0
    y = _hand_ln(x) * m.weight + m.bias
    x.add_(y)
    return x


def _llama_input_in_place(m, x):
    # Llama's RMSNorm of a bf16 x saves x.float() (a copy); the op, folding the upcast, saves x
    x = x * 1.0
    h = x.float()
    y = m.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    x += torch.tanh(y)
    return x


def _rms_norm_bf16_input_in_place(m, x):
    # eager's F.rms_norm of a bf16 x computes in (and saves) an fp32 copy of x
    x = x * 1.0
    y = F.rms_norm(x, (N,), m.weight, EPS)
    x += torch.tanh(y)
    return x


def _layer_norm_of_upcast_input_in_place(m, x):
    # eager's F.layer_norm saves its input, x.float(), a copy of the bf16 x; the op, folding the upcast, x
    x = x * 1.0
    y = F.layer_norm(x.float(), (N,), m.weight.float(), m.bias.float(), EPS).to(x.dtype)
    x += torch.tanh(y)
    return x


def _bias_in_place(m, x):
    b = m.bias * 1.0
    y = _hand_ln(x) * m.weight + b
    b.mul_(2)
    return y, b


SAVED_WRITTEN = {
    # name: (fn, dtype, the near miss's words)
    "residual_stream": (_residual_stream_in_place, torch.float32, "the pre-norm sum"),
    "dropout_residual_stream": (_dropout_residual_stream_in_place, torch.float32, "the pre-norm sum"),
    "input": (_input_in_place, torch.float32, "the input"),
    "llama_bf16_input": (_llama_input_in_place, torch.bfloat16, "the input"),
    "rms_norm_bf16_input": (_rms_norm_bf16_input_in_place, torch.bfloat16, "the input"),
}


@pytest.mark.parametrize("name", SAVED_WRITTEN)
def test_saved_tensor_written_after_the_norm_is_left_alone_in_training(name):
    fn, dtype, reason = SAVED_WRITTEN[name]
    model = Fn(fn).to(dtype)
    args = (_x(3, 5, N, dtype=dtype), _x(3, 5, N, dtype=dtype))[:fn.__code__.co_argcount - 1]
    tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    # Before the fix: rewritten, and the compiled backward raised "modified by an inplace operation"
    report = _check_mode(model, args, True, rewrites=0, skipped=1, reason=reason, **tol)
    assert any("written in place" in d.detail and "after the norm" in d.detail for d in report.near_misses)
    # Under no_grad nothing is saved: the write is harmless and the norm is fused
    _check_mode(model, args, False, rewrites=1, **tol)


def test_layer_norm_of_an_upcast_input_written_after_it_keeps_the_upcast():
    # Before the fix the upcast was folded and the op saved the bf16 x, which the write changed: the backward
    # raised. Now the op reads x.float(), the copy eager's layer_norm saves too, and the write is harmless.
    model = Fn(_layer_norm_of_upcast_input_in_place).to(torch.bfloat16)
    args = (_x(3, 5, N, dtype=torch.bfloat16),)
    for train in (True, False):
        _check_mode(model, args, train, rewrites=1, text="F.layer_norm", atol=3e-2, rtol=3e-2)


def test_bias_written_after_the_norm_stays_after_the_op():
    # The op would save the bias (eager's ``+ b`` does not): the norm and weight are fused, the add stays
    model, args = Fn(_bias_in_place), (_x(3, 5, N),)
    report = _check_mode(model, args, True, rewrites=1)
    assert [d.variant for d in report.rewrites] == ["hand-written LayerNorm + weight"], str(report)
    report = _check_mode(model, args, False, rewrites=1)
    assert [d.variant for d in report.rewrites] == ["hand-written LayerNorm + weight + bias"], str(report)


def test_layer_norm_input_written_after_it_is_still_fused():
    # F.layer_norm saves h itself: eager's backward fails on the write as the op's does (the same behaviour),
    # and forward-only use under grad mode keeps the fusion (tests/test_norm_pass_styles.py too)
    def fn(m, x, r):
        h = x + r
        y = F.layer_norm(h, (N,), m.weight, m.bias, EPS)
        h.mul_(2)
        return y + h

    model, args = Fn(fn), (_x(3, 5, N), _x(3, 5, N))
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        run = _compile(model) if compiled else model
        out = run(*[a.clone().requires_grad_() for a in args])
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    assert counters["flash"]["norm"] == 1


def test_written_residual_input_is_no_saved_tensor():
    # The op does not save its residual input (nor eager's add): a write to r after the norm keeps the fusion
    def fn(m, x, r):
        r = r * 1.0
        y = _hand_ln(x + r) * m.weight + m.bias
        r.mul_(2)
        return y, r

    _check_mode(Fn(fn), (_x(3, 5, N), _x(3, 5, N)), True, rewrites=1, text="residual add")


# --------------------------------------------------------------------------------------------------------
# In-place dropout of a tensor whose memory another one shares
# --------------------------------------------------------------------------------------------------------


ALIASES = {
    "float": lambda a: a.float(),
    "to_same_dtype": lambda a: a.to(torch.float32),
    "type_as": lambda a: a.type_as(a),
    "contiguous": lambda a: a.contiguous(),
    "detach": lambda a: a.detach(),
}


@pytest.mark.parametrize("name", ALIASES)
def test_inplace_dropout_of_an_alias_is_left_alone(name):
    alias = ALIASES[name]

    def fn(m, x, r):
        a = x * 2
        d = F.dropout(alias(a), 0.5, m.training, inplace=True)  # drops a's values too
        return F.layer_norm(d + r, (N,), m.weight, m.bias, EPS), a

    model, args = Fn(fn), (_x(3, 5, N), _x(3, 5, N))
    # Before the fix: folded, and a came back undropped
    _check_mode(model, args, True, rewrites=0, skipped=1, reason="whose memory a shares")
    _check_mode(model, args, False, rewrites=1)  # eval: nothing is dropped, nothing written


def test_inplace_dropout_of_a_fresh_tensor_is_still_folded():
    def fn(m, x, r):
        return F.layer_norm(F.dropout(x * 2, 0.5, m.training, inplace=True) + r, (N,), m.weight, m.bias, EPS)

    model, x, r = Fn(fn).train(), _x(3, 5, N), _x(3, 5, N)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        compiled = _compile(model)
        torch.manual_seed(1)
        got = compiled(x, r)
    assert counters["flash"]["norm"] == 1 and counters["flash"]["norm_skipped"] == 0, str(report)
    assert any(d.variant.startswith("dropout + residual add") for d in report.rewrites), str(report)
    torch.manual_seed(1)
    want = add_dropout_norm(x * 2, r, model.weight, model.bias, eps=EPS, dropout_p=0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------
# Other dropouts are not elementwise dropout
# --------------------------------------------------------------------------------------------------------


def _droppath(x, training):
    # timm's drop_path: one Bernoulli draw per sample, not per element
    if not training:
        return x
    keep = x.new_empty((x.shape[0], 1, 1)).bernoulli_(0.7)
    return x.div(0.7) * keep


OTHER_DROPOUTS = {
    "dropout1d": lambda t, training: F.dropout1d(t, 0.5, training),
    "dropout2d": lambda t, training: F.dropout2d(t.unsqueeze(0), 0.5, training).squeeze(0),
    "alpha_dropout": lambda t, training: F.alpha_dropout(t, 0.5, training),
    "feature_alpha_dropout": lambda t, training: F.feature_alpha_dropout(t, 0.5, training),
    "droppath": _droppath,
}


@pytest.mark.parametrize("name", OTHER_DROPOUTS)
def test_other_dropouts_are_not_folded_as_dropout(name):
    drop = OTHER_DROPOUTS[name]

    def fn(m, x, r):
        return F.layer_norm(r + drop(x, m.training), (N,), m.weight, m.bias, EPS)

    model, args = Fn(fn), (_x(3, 5, N), _x(3, 5, N))
    for train in (True, False):
        # the norm of the sum is fused; the dropout stays, drawing eager's mask from the same seed
        report = _check_mode(model, args, train, rewrites=1, text="residual add + F.layer_norm")
        assert not any(d.variant.startswith("dropout") for d in report.rewrites), str(report)
