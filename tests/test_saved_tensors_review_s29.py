"""Review s29: tensors a fused op keeps for its backward that eager's unfused ops do not keep.

A write in place after the fused pattern to such a tensor bumps its version, and the op's backward fails
("one of the variables needed for gradient computation has been modified by an inplace operation") where
eager's trains. Eager's matmul keeps an operand only for the other operand's gradient, softmax its output,
an additive mask nothing; flash_attention keeps q, k, v, the mask and its output, the dense and
cross-entropy ops x and the weight, whenever anything needs a gradient. Each such case is now a near miss
(where the graph records gradients); the cases shown harmless stay fused. Values and gradients are
compared with eager in every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

B, H, S, D = 2, 2, 8, 16


def _compare(fn, make, family, rewritten, train=True):
    """Run fn eagerly and through rewrite_only_backend on fresh inputs from make(); check the family's
    counters and that outputs and input gradients match."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        args = make()
        run = torch.compile(fn, backend=rewrite_only_backend, fullgraph=True) if compiled else fn
        with torch.set_grad_enabled(train):
            outs = run(*args)
        grads = []
        if train:
            sum(o.float().sum() for o in outs if o.requires_grad).backward()
            grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        results.append(([o.detach() for o in outs], grads))
    assert counters["flash"][family] == int(rewritten)
    assert counters["flash"][family + "_skipped"] == int(not rewritten)
    (want, want_grads), (got, got_grads) = results
    for g, e in zip(got + got_grads, want + want_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------


def _qkv(rq=True, rk=True, rv=True, mask=False):
    def make():
        gen = torch.Generator().manual_seed(0)
        out = [torch.randn(B, H, S, D, generator=gen).requires_grad_(r) for r in (rq, rk, rv)]
        if mask:
            out.append(torch.randn(S, S, generator=gen))
        return out
    return make


def _attention(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2) * 0.25
    return torch.softmax(s if mask is None else s + mask, dim=-1) @ v


def _frozen_cache_q_written(qp, cache_k, cache_v):
    q = qp * 1.0
    o = _attention(q, cache_k.detach(), cache_v.detach())  # q·kᵀ keeps k only: k needs no gradient
    q.mul_(0.5)
    return o, q


def _v_written(qp, kp, vp):
    q, k, v = qp * 1.0, kp * 1.0, vp * 1.0
    o = _attention(q, k, v)
    v.add_(1.0)  # p·v keeps v only when the probabilities need a gradient: q, k frozen here
    return o, v


def _output_view_written(qp, kp, vp):
    o = _attention(qp * 1.0, kp * 1.0, vp * 1.0).transpose(1, 2)
    o.mul_(2.0)  # eager keeps no attention output
    return (o,)


def _mask_written(qp, kp, vp, m):
    m = m * 1.0
    o = _attention(qp * 1.0, kp * 1.0, vp * 1.0, m)
    m.mul_(2.0)  # an added mask is not kept
    return o, m


def _output_written(qp, kp, vp):
    o = _attention(qp * 1.0, kp * 1.0, vp * 1.0)
    o.mul_(2.0)  # a fresh tensor's write: made functional before the passes run
    return (o,)


@pytest.mark.parametrize(("fn", "make"), [
    (_frozen_cache_q_written, _qkv(True, False, False)),
    (_v_written, _qkv(False, False, True)),
    (_output_view_written, _qkv()),
    (_mask_written, _qkv(mask=True)),
])
def test_attention_kept_tensor_written_after_is_left_alone(fn, make):
    _compare(fn, make, "attention", rewritten=False)  # the compiled backward failed before


@pytest.mark.parametrize(("fn", "make", "train"), [
    (_frozen_cache_q_written, _qkv(True, False, False), False),  # no_grad: nothing is kept
    (_mask_written, _qkv(mask=True), False),
    (_output_written, _qkv(), True),
])
def test_attention_harmless_writes_stay_fused(fn, make, train):
    _compare(fn, make, "attention", rewritten=True, train=train)


def test_attention_cache_eager_keeps_too_stays_fused():
    # q needs a gradient: eager's q·kᵀ keeps the cache as the op does, and both backwards fail alike
    def fn(q, cache_k, cache_v):
        o = _attention(q, cache_k.detach(), cache_v.detach())
        cache_k.mul_(0.5)
        return o

    outs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(fn, backend=rewrite_only_backend, fullgraph=True) if compiled else fn
        outs.append(run(*_qkv(True, False, False)()))
    assert counters["flash"]["attention"] == 1
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_attention_nothing_needs_a_gradient_stays_fused():
    def fn(q, k, v):
        q = q * 1.0
        o = _attention(q, k, v)
        q.mul_(0.5)
        return o, q

    _compare(fn, _qkv(False, False, False), "attention", rewritten=True, train=False)
    torch._dynamo.reset()
    counters.clear()
    make = _qkv(False, False, False)
    with torch.enable_grad():  # grad mode on, but nothing needs a gradient: the op keeps nothing
        torch.compile(fn, backend=rewrite_only_backend, fullgraph=True)(*make())
    assert counters["flash"]["attention"] == 1


# --------------------------------------------------------------------------------------------------------
# Linear + GELU
# --------------------------------------------------------------------------------------------------------

K, N = 16, 32


def _dense_inputs(rx, rw, x_dtype=torch.float32):
    def make():
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(6, K, generator=gen).to(x_dtype).requires_grad_(rx),
                torch.randn(N, K, generator=gen).requires_grad_(rw),
                torch.randn(N, generator=gen).requires_grad_(rw)]
    return make


def _dense_weight_updated_after(x, w, b):
    w = w * 1.0
    y = F.gelu(F.linear(x, w, b))
    with torch.no_grad():
        w.mul_(0.5)  # x needs no gradient: eager's linear keeps x alone
    return y, w


def _dense_autocast_input_written_after(x, w, b):
    h = x * 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.gelu(F.linear(h, w, b))  # h is bf16 already: the op keeps h itself, not a cast copy
    h.mul_(2.0)
    return y, h


def _dense_output_written_after(x, w, b):
    y = F.gelu(F.linear(x, w, b)).view(-1)
    y.mul_(2.0)  # the op keeps the pre-activation, as eager's gelu keeps its input
    return (y,)


def _dense_bias_written_after(x, w, b):
    b = b * 1.0
    y = F.gelu(F.linear(x, w, b))
    b.mul_(2.0)  # neither keeps the bias
    return y, b


@pytest.mark.parametrize(("fn", "make", "rewritten"), [
    (_dense_weight_updated_after, _dense_inputs(False, True), False),  # failed before
    (_dense_autocast_input_written_after, _dense_inputs(True, False, torch.bfloat16), False),  # failed before
    (_dense_autocast_input_written_after, _dense_inputs(True, False), True),  # fp32 h: the op keeps a copy
    (_dense_output_written_after, _dense_inputs(True, True), True),
    (_dense_bias_written_after, _dense_inputs(True, True), True),
])
def test_dense_written_after(fn, make, rewritten):
    _compare(fn, make, "dense", rewritten)


def test_dense_weight_updated_after_under_no_grad_is_fused():
    _compare(_dense_weight_updated_after, _dense_inputs(False, True), "dense", True, train=False)


# --------------------------------------------------------------------------------------------------------
# Linear + cross-entropy
# --------------------------------------------------------------------------------------------------------

V, M = 11, 6


def _ce_inputs(rx, rw):
    def make():
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(M, K, generator=gen).requires_grad_(rx),
                torch.randn(V, K, generator=gen).requires_grad_(rw), torch.randint(0, V, (M,), generator=gen)]
    return make


def _probe_head_updated_after(features, w, y):
    w = w * 1.0
    loss = F.cross_entropy(features.detach() @ w.t(), y, label_smoothing=0.1)
    with torch.no_grad():
        w.mul_(0.5)  # a linear probe: the features need no gradient, eager's matmul keeps them alone
    return loss, w


@pytest.mark.parametrize(("make", "train", "rewritten"), [
    (_ce_inputs(False, True), True, False),  # failed before
    (_ce_inputs(False, True), False, True),  # no_grad: nothing is kept
])
def test_cross_entropy_head_weight_written_after(make, train, rewritten):
    _compare(_probe_head_updated_after, make, "cross_entropy", rewritten, train=train)


# --------------------------------------------------------------------------------------------------------
# Norm: the inputs of a residual add written after the norm (the op keeps their sum, as F.layer_norm does)
# --------------------------------------------------------------------------------------------------------


def test_norm_residual_operand_written_after_stays_fused():
    def fn(x, r, w, b):
        x = x * 1.0
        y = F.layer_norm(x + r, (K,), w, b)
        x.mul_(2.0)
        return y, x

    def make():
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(6, K, generator=gen).requires_grad_(), torch.randn(6, K, generator=gen),
                torch.randn(K, generator=gen), torch.randn(K, generator=gen)]

    _compare(fn, make, "norm", rewritten=True)
