"""Review (session 23) of fx_passes/attention: in-place writes around the attention, a scale that
broadcasts the scores, torch.special.softmax.

The fused op used to be inserted right after its last input. When an input is written in place after it is
defined and before the attention reads it (a static KV cache updated by item assignment or index_copy_,
a mask built by item assignment), the op then ran before the write and read stale values: silently wrong
outputs, for hand-written attention and for F.scaled_dot_product_attention alike. The op now runs where
the pattern ended (the ·v matmul, the SDPA call), and a write between a read of the pattern and its end
(which the op would see and the pattern did not) leaves the pattern alone, reported.

Sizes are tiny; every case compares outputs, gradients and the written tensors with eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_pass import _check_same, _flash_nodes, _qkv, _rewrites, _run_rewritten

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

TOL = dict(atol=2e-5, rtol=2e-5)
B, H, S, D = 2, 3, 9, 8  # cache length S; 2 new positions at 3:5


def _cache_inputs():
    torch.manual_seed(0)
    q, k_new, v_new = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
    k_cache, v_cache = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    return q, k_new, v_new, k_cache, v_cache


def _check_cache_fn(fn, rewrites=1):
    """fn(q, k_new, v_new, k_cache, v_cache) writes into the caches: compiled (attention rewrite only) and
    eager give the same output, caches and gradients of q, k_new, v_new (where eager has them: a cache the
    attention saved for backward and that is written afterwards has none). Returns the flash nodes."""
    def fresh():
        q, kn, vn, kc, vc = _cache_inputs()
        return [t.requires_grad_() for t in (q, kn, vn)] + [kc, vc]

    args_e, args_r = fresh(), fresh()
    ref = fn(*args_e)
    out, graphs = _run_rewritten(fn, *args_r)
    assert _rewrites() == (rewrites, 1 - rewrites), flash_backend.explain(fn, *fresh(), print_report=False)
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(args_r[3:], args_e[3:], strict=True):  # the caches as written
        torch.testing.assert_close(a, b, **TOL)
    if fn is _cache_written_after_the_attention:
        return _flash_nodes(graphs)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    for a, b in zip(args_r[:3], args_e[:3], strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    return _flash_nodes(graphs)


# --------------------------------------------------------------------------------------------------------
# Inputs written before the attention reads them: rewritten, reading the written values
# --------------------------------------------------------------------------------------------------------


def _cache_setitem(q, k_new, v_new, k_cache, v_cache):
    # Meta's Llama reference: cache[:, :, pos] = k, then attention over the cache
    k_cache[:, :, 3:5] = k_new
    v_cache[:, :, 3:5] = v_new
    return torch.softmax(q @ k_cache.transpose(-2, -1) * D**-0.5, dim=-1) @ v_cache


def _cache_index_copy(q, k_new, v_new, k_cache, v_cache):
    # transformers' StaticCache: index_copy_ along the sequence dim
    pos = torch.arange(3, 5)
    k_cache.index_copy_(2, pos, k_new)
    v_cache.index_copy_(2, pos, v_new)
    return torch.matmul(F.softmax(torch.matmul(q, k_cache.transpose(2, 3)) / D**0.5, dim=-1), v_cache)


def _cache_view_taken_before_write(q, k_new, v_new, k_cache, v_cache):
    # the views of the filled prefix are taken first: they see the write
    keys, values = k_cache[:, :, :5], v_cache[:, :, :5]
    k_cache[:, :, 3:5].copy_(k_new)
    v_cache.narrow(2, 3, 2).copy_(v_new)
    return torch.softmax(q @ keys.mT * 0.3, -1) @ values


def _cache_bmm_layout(q, k_new, v_new, k_cache, v_cache):
    k_cache[:, :, 3:5] = k_new
    v_cache[:, :, 3:5] = v_new
    b, h, s, d = q.shape
    scores = torch.bmm(q.reshape(b * h, s, d), k_cache.reshape(b * h, S, d).transpose(1, 2)) * 0.3
    return torch.bmm(scores.softmax(-1), v_cache.reshape(b * h, S, d)).view(b, h, s, d)


def _cache_sdpa(q, k_new, v_new, k_cache, v_cache):
    k_cache[:, :, 3:5] = k_new
    v_cache[:, :, 3:5] = v_new
    return F.scaled_dot_product_attention(q, k_cache, v_cache)


def _mask_item_assignment(q, k_new, v_new, k_cache, v_cache):
    # an additive mask built by item assignment (keys 5.. not filled yet)
    mask = torch.zeros(1, 1, 2, S)
    mask[..., 5:] = float("-inf")
    return torch.softmax(q @ k_cache.mT * 0.3 + mask, -1) @ v_cache


def _mask_item_assignment_sdpa(q, k_new, v_new, k_cache, v_cache):
    keep = torch.ones(2, S, dtype=torch.bool)
    keep[:, 5:] = False
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=keep)


def _v_written_before_pv(q, k_new, v_new, k_cache, v_cache):
    # p @ v reads v after the write, as the op at its place does
    p = torch.softmax(q @ k_cache.mT * 0.3, -1)
    v_cache.mul_(2.0)
    return p @ v_cache


def _cache_written_after_the_attention(q, k_new, v_new, k_cache, v_cache):
    out = torch.softmax(q @ k_cache.mT * 0.3, -1) @ v_cache
    k_cache[:, :, 3:5] = k_new
    v_cache[:, :, 3:5] = v_new
    return out


WRITTEN_BEFORE = [
    _cache_setitem,
    _cache_index_copy,
    _cache_view_taken_before_write,
    _cache_bmm_layout,
    _cache_sdpa,
    _mask_item_assignment,
    _mask_item_assignment_sdpa,
    _v_written_before_pv,
    _cache_written_after_the_attention,
]


@pytest.mark.parametrize("fn", WRITTEN_BEFORE, ids=[f.__name__.strip("_") for f in WRITTEN_BEFORE])
def test_inputs_written_in_place_before_the_attention(fn):
    # each was rewritten before with the op ahead of the write, reading the stale cache / mask
    assert len(_check_cache_fn(fn)) == 1


# --------------------------------------------------------------------------------------------------------
# Inputs written between a read of the pattern and its end: left alone, reported. (The op placed after its
# inputs happened to read these before the write; at the end of the pattern it would read them after it.)
# --------------------------------------------------------------------------------------------------------


def _q_written_after_scores(q, k_new, v_new, k_cache, v_cache):
    q2 = q * 1.0  # a non-leaf to write into
    scores = q2 @ k_cache.mT * 0.3
    q2.mul_(2.0)
    return torch.softmax(scores, -1) @ v_cache


def _mask_written_after_it_is_added(q, k_new, v_new, k_cache, v_cache):
    mask = torch.zeros(1, 1, 2, S)
    scores = q @ k_cache.mT * 0.3 + mask
    mask.fill_(-1e9)
    return torch.softmax(scores, -1) @ v_cache


def _mask_factor_written_after_the_and(q, k_new, v_new, k_cache, v_cache):
    # the op would rebuild keep from its factors: a is written after keep was computed
    a = (k_cache[:, 0, :, 1] > -5)[:, None, None, :]
    b = (k_cache[:, 0, :, 0] > -5)[:, None, None, :]
    keep = a & b
    a[..., :4] = False
    return torch.softmax(torch.where(keep, q @ k_cache.mT * 0.3, float("-inf")), -1) @ v_cache


WRITTEN_BETWEEN = [
    _q_written_after_scores,
    _mask_written_after_it_is_added,
    _mask_factor_written_after_the_and,
]


@pytest.mark.parametrize("fn", WRITTEN_BETWEEN, ids=[f.__name__.strip("_") for f in WRITTEN_BETWEEN])
def test_inputs_written_in_place_inside_the_pattern_are_left_alone(fn):
    _check_cache_fn(fn, rewrites=0)
    report = flash_backend.explain(fn, *_cache_inputs(), print_report=False)
    (decision,) = [d for d in report.near_misses if d.family == "attention"]
    assert "is written in place by" in decision.detail, decision.line()


# --------------------------------------------------------------------------------------------------------
# A constant scale that broadcasts the scores to more dims
# --------------------------------------------------------------------------------------------------------


def _scale_adds_a_leading_dim(q, k, v):
    # bmm's (B·H, S, S) scores times a one-element 4-d constant are (1, B·H, S, S): the output keeps that dim
    b, h, s, d = q.shape
    scores = torch.bmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2))
    scores = scores * torch.tensor([[[[0.3]]]])
    return torch.softmax(scores, -1) @ v.reshape(1, b * h, s, d)


def test_scale_that_broadcasts_the_scores_is_left_alone():
    # was rewritten with the output squeezed to (B·H, S, D) where eager gives (1, B·H, S, D)
    torch.manual_seed(0)
    args = (torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8))
    torch._dynamo.reset()
    counters.clear()
    report = flash_backend.explain(_scale_adds_a_leading_dim, *args, print_report=False)
    assert _rewrites() == (0, 1), report
    (decision,) = [d for d in report.near_misses if d.family == "attention"]
    assert "broadcasts the scores" in decision.detail, decision.line()
    out = torch.compile(_scale_adds_a_leading_dim, backend=rewrite_only_backend)(*args)
    torch.testing.assert_close(out, _scale_adds_a_leading_dim(*args), **TOL)


# --------------------------------------------------------------------------------------------------------
# torch.special.softmax: the same function as torch.softmax, was not seen at all
# --------------------------------------------------------------------------------------------------------


def _special_softmax(q, k, v):
    return torch.special.softmax(q @ k.transpose(-2, -1) * 0.3, -1) @ v


def _special_softmax_fp64(q, k, v):
    return torch.special.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1, dtype=torch.float64).to(q.dtype) @ v


@pytest.mark.parametrize("fn", [_special_softmax, _special_softmax_fp64])
def test_special_softmax_is_rewritten(fn):
    torch.manual_seed(0)
    (node,) = _check_same(fn, *_qkv(B=2, H=3, S=7, D=8))
    assert node.kwargs["scale"] == pytest.approx(0.3)


def _special_softmax_over_queries(q, k, v):
    return torch.special.softmax(q @ k.transpose(-2, -1) * 0.3, 2) @ v


def test_special_softmax_over_another_dim_is_left_alone():
    torch.manual_seed(0)
    args = _qkv(B=2, H=3, S=8, D=8)
    torch._dynamo.reset()
    counters.clear()
    report = flash_backend.explain(_special_softmax_over_queries, *args, print_report=False)
    assert _rewrites() == (0, 1), report
    assert "softmax over dim 2" in report.near_misses[0].detail
    out = torch.compile(_special_softmax_over_queries, backend=rewrite_only_backend)(*args)
    torch.testing.assert_close(out, _special_softmax_over_queries(*args), **TOL)
