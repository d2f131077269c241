"""A query row with every key masked by one finite fill (``masked_fill(~keep, -1e4)``, finfo.min): eager's
scores there are all the fill, its softmax uniform, its output the mean of v (and v's gradient dout / Sk from
that row, q's and k's none). The attention pass takes the fill as -inf and asks the op for the mean of v on
the rows that saw no key (flash_attention(fully_masked_rows="mean"): the op's logsumexp is +inf there); it
gave 0 (tests/findings/codebase_review_s31.md W1, the Flamingo case of codebase_review_s34.md).

Where eager's row is not uniform the rewrite is as before and says so: two fills that add (a finfo.min
bias added after a finfo.min fill overflow to -inf on some keys), a -inf fill (NaN in eager)."""

import pytest
import torch
import torch.nn as nn

import flash_backend
from flash_backend.backend import rewrite_only_backend
from flash_backend.ops.attention import flash_attention
from fx_passes._compat import counters

MEAN_NOTE = "a row with every key masked given the mean of v as in eager"
ZERO_NOTE = "a row with every key masked gives 0, where eager gives an average of v"


def _repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class GQAPadded(nn.Module):
    """Llama-style eager attention: k / v repeated over the query groups, a key padding mask filled."""

    def __init__(self, fill=-1e4):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, keep):
        n = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, n), _repeat_kv(v, n)
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        s = s.masked_fill(~keep[:, None], self.fill)  # keep (B, Sq, Sk)
        return torch.softmax(s, -1) @ v


class BSHDPadded(nn.Module):
    """(B, S, H, D) tensors, the scores by einsum and the output back to (B, S, H, D)."""

    def forward(self, q, k, v, keep):
        s = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
        s = s.masked_fill(~keep[:, None], -1e4)
        return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v)


class FillsAdd(nn.Module):
    """A causal finfo.min fill, then a padding bias of finfo.min added: on a padded row the future keys
    overflow to -inf, and eager averages v over the past ones only."""

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        sq, sk = s.shape[-2:]
        minimum = torch.finfo(s.dtype).min
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), minimum)
        bias = torch.zeros(keep.shape, dtype=s.dtype).masked_fill(~keep, minimum)  # keep (B, Sk)
        return torch.softmax(s + bias[:, None, None, :], -1) @ v


def _keep(b, sq, sk, dead):
    """A random key mask with each (batch, query) row in dead masked whole."""
    keep = torch.rand(b, sq, sk, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True
    for i, j in dead:
        keep[i, j] = False
    return keep


def _qkv(shape_q, shape_kv, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in (shape_q, shape_kv, shape_kv)]


def _compare(model, args, backend=rewrite_only_backend, dynamic=None, train=True, tol=None):
    """Outputs and the gradients of every floating input of the compiled model against eager's."""
    tol = tol or {}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (compiled, model):
        leaves = [a.detach().clone().requires_grad_(train and a.is_floating_point()) for a in args]
        out = fn(*leaves)
        grads = []
        if train:
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
            grads = torch.autograd.grad(out, [a for a in leaves if a.requires_grad], cotangent)
        results.append((out, grads))
    (got, got_grads), (want, want_grads) = results
    assert counters["flash"]["attention"] == 1, dict(counters["flash"])
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **tol)
    return got, want


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_gqa_padded_rows_with_no_key_are_the_mean_of_v(train):
    q, k, v = _qkv((2, 4, 6, 16), (2, 2, 7, 16))
    keep = _keep(2, 6, 7, dead=[(0, 2), (1, 0), (1, 5)])
    report = flash_backend.explain(GQAPadded(), q, k, v, keep, print_report=False)
    (rewrite,) = report.rewrites
    assert MEAN_NOTE in rewrite.detail and "gqa" in rewrite.detail, rewrite.detail
    got, _ = _compare(GQAPadded(), (q, k, v, keep), train=train)
    # query heads 0, 1 read k / v head 0, heads 2, 3 head 1
    torch.testing.assert_close(got[1, :, 0], v[1].mean(1).repeat_interleave(2, 0))


def test_bshd_layout_rows_with_no_key_are_the_mean_of_v():
    q, k, v = _qkv((2, 6, 3, 16), (2, 9, 3, 16))
    keep = _keep(2, 6, 9, dead=[(0, 3), (1, 1)])
    (rewrite,) = flash_backend.explain(BSHDPadded(), q, k, v, keep, print_report=False).rewrites
    assert MEAN_NOTE in rewrite.detail, rewrite.detail
    got, _ = _compare(BSHDPadded(), (q, k, v, keep))
    torch.testing.assert_close(got[0, 3], v[0].mean(0))


def test_finfo_min_fill_in_bf16():
    q, k, v = _qkv((2, 4, 8, 32), (2, 2, 8, 32), torch.bfloat16)
    keep = _keep(2, 8, 8, dead=[(0, 4), (1, 7)])
    _compare(GQAPadded(torch.finfo(torch.bfloat16).min), (q, k, v, keep), tol=dict(atol=2e-2, rtol=2e-2))


def test_training_through_inductor_with_dynamic_shapes():
    """backend="flash" (Inductor), dynamic=True: one graph for several sequence lengths, each with rows
    that see no key; outputs and every gradient are eager's."""
    model = GQAPadded()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="flash", dynamic=True)
    for sq, sk in ((5, 7), (8, 11), (6, 13)):
        q, k, v = _qkv((2, 4, sq, 16), (2, 2, sk, 16))
        keep = _keep(2, sq, sk, dead=[(0, 1), (1, sq - 1)])
        results = []
        for fn in (compiled, model):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, keep)
            results.append((out, torch.autograd.grad(out, leaves, torch.ones_like(out))))
        (got, got_grads), (want, want_grads) = results
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert counters["flash"]["attention"] >= 1 and counters["flash"]["attention_skipped"] == 0


def test_fills_that_add_keep_the_zero_and_the_note():
    """Eager's padded row is the average of v over the keys up to the query, not over all: left as before
    (no mean of v asked for; the note stays). The op adds the finfo.min bias: the CPU reference gives
    eager's average there, the bf16 / fp16 kernels 0 (ops/attention.py)."""
    q, k, v = _qkv((2, 2, 6, 16), (2, 2, 6, 16))
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1] = False  # the second sequence: no key at all
    (rewrite,) = flash_backend.explain(FillsAdd(), q, k, v, keep, print_report=False).rewrites
    assert ZERO_NOTE in rewrite.detail and MEAN_NOTE not in rewrite.detail, rewrite.detail
    torch._dynamo.reset()
    got = torch.compile(FillsAdd(), backend=rewrite_only_backend, fullgraph=True)(q, k, v, keep)
    want = FillsAdd()(q, k, v, keep)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(want[1, :, 2], v[1, :, :3].mean(1))  # eager: the keys up to query 2
    assert not torch.allclose(got[1, :, 2], v[1].mean(1))  # not the mean over all keys


def test_op_mean_on_rows_with_no_key_and_gradients():
    """flash_attention(fully_masked_rows="mean") against eager's softmax over a -1e4 fill, GQA heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 16, generator=gen, requires_grad=True) for _ in range(2))
    keep = torch.rand(2, 1, 6, 5, generator=gen) > 0.4
    keep[0, :, 2] = False
    keep[1, :, :3] = False
    out = flash_attention(q, k, v, attn_mask=keep, fully_masked_rows="mean")
    s = (q @ k.repeat_interleave(2, 1).mT * 0.25).masked_fill(~keep, -1e4)
    want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, want)
    grad = torch.randn(out.shape, generator=gen)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad),
                    strict=True):
        torch.testing.assert_close(g, w)
    assert torch.equal(flash_attention(q, k, v, attn_mask=keep)[0, :, 2], torch.zeros(4, 16))
    with pytest.raises(ValueError, match="fully_masked_rows"):
        flash_attention(q, k, v, fully_masked_rows="nan")


class BiasAfterFill(nn.Module):
    """A bias added after the fill (ALiBi-like, a runtime tensor): eager's masked row is softmax(bias)."""

    def forward(self, q, k, v, keep, bias):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        return torch.softmax(s.masked_fill(~keep[:, None], -1e4) + bias, -1) @ v


def test_bias_added_after_the_fill_keeps_the_note():
    q, k, v = _qkv((2, 2, 6, 16), (2, 2, 6, 16))
    keep = _keep(2, 6, 6, dead=[(1, 3)])
    bias = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    (rewrite,) = flash_backend.explain(BiasAfterFill(), q, k, v, keep, bias, print_report=False).rewrites
    assert ZERO_NOTE in rewrite.detail and MEAN_NOTE not in rewrite.detail, rewrite.detail



class BiasInsideFill(nn.Module):
    """A padding bias, then a -1e4 fill over it (flash-attn's order; transformers' bias is finfo.min)."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, q, k, v, pad_keep, keep):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        value = torch.finfo(s.dtype).min if self.value is None else self.value
        bias = torch.zeros(pad_keep.shape, dtype=s.dtype).masked_fill(~pad_keep, value)
        return torch.softmax((s + bias[:, None, None, :]).masked_fill(~keep[:, None], -1e4), -1) @ v


@pytest.mark.parametrize("value", [None, -1e4], ids=["finfo.min", "-1e4"])
def test_bias_inside_the_fill_is_taken_when_far_from_overflow(value):
    """The fill overwrites the bias on the keys it masks; a bias of finfo.min overflows in the kernels
    (scaled by log2(e)), which would mask keys eager does not fill: the mean is asked for with -1e4 only."""
    q, k, v = _qkv((2, 2, 6, 16), (2, 2, 6, 16))
    pad_keep = torch.ones(2, 6, dtype=torch.bool)
    pad_keep[0, 5] = False
    args = (q, k, v, pad_keep, _keep(2, 6, 6, dead=[(1, 3)]))
    (rewrite,) = flash_backend.explain(BiasInsideFill(value), *args, print_report=False).rewrites
    assert (ZERO_NOTE if value is None else MEAN_NOTE) in rewrite.detail, rewrite.detail
    if value is not None:
        _compare(BiasInsideFill(value), args)
