"""fx_passes/attention: a constant bottom-right causal mask (KV-cache decoding, chunked prefill,
cross-attention with Sq < Sk: key j visible to query i when j <= i + Sk - Sq) becomes flash_attention's
bottom-right causal form (is_causal=True, causal_alignment="bottom_right"; with a runtime mask beside it, the
(-1, 0) window anchored bottom-right), as a top-left one becomes is_causal=True, in the three paths: softmax
written by hand, SDPA with attn_mask and nn.MultiheadAttention. Sq == Sk stays top-left, Sq > Sk (rows
without a key) is left as before, a mask off by one diagonal stays a runtime mask, and under dynamic shapes
a mask built from the sizes stays a runtime mask (nothing proves it is the band at other sizes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_pass import (  # noqa: F401  (_cold_inductor_cache: an autouse fixture)
    _check_same,
    _cold_inductor_cache,
    _flash_nodes,
    _rewrites,
    _run_rewritten,
)

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

B, H, D = 2, 3, 16
SQ, SK = 5, 12
MIN = torch.finfo(torch.float32).min
NEG_INF = float("-inf")
SCALE = 0.3
TOL = dict(atol=2e-5, rtol=2e-5)
MAX_POS = 32  # GPT-2's n_positions, for the constant tril it slices


def _qkv(sq=SQ, sk=SK, seed=0):
    torch.manual_seed(seed)
    return torch.randn(B, H, sq, D), torch.randn(B, H, sk, D), torch.randn(B, H, sk, D)


def _s(q, k):
    return q @ k.transpose(-2, -1) * SCALE


def _sizes(q, k):
    return q.shape[-2], k.shape[-2]


def _bottom_right(nodes, with_mask=False):
    """The single flash node runs the bottom-right causal band: is_causal=True and no mask, or (with_mask)
    a runtime mask and the (-1, 0) window, both anchored bottom-right."""
    assert len(nodes) == 1, nodes
    kw = nodes[0].kwargs
    assert kw.get("causal_alignment") == "bottom_right", kw
    if with_mask:
        assert kw["attn_mask"] is not None and kw["is_causal"] is False and kw["window_size"] == (-1, 0), kw
    else:
        assert kw["is_causal"] is True and kw["attn_mask"] is None, kw


def _top_left(nodes):
    assert len(nodes) == 1, nodes
    kw = nodes[0].kwargs
    assert kw["is_causal"] is True and kw["attn_mask"] is None, kw
    assert kw.get("causal_alignment", "top_left") == "top_left", kw


def _runtime_mask(nodes):
    assert len(nodes) == 1, nodes
    kw = nodes[0].kwargs
    assert kw["attn_mask"] is not None and kw["is_causal"] is False, kw
    assert "window_size" not in kw and "causal_alignment" not in kw, kw


# --------------------------------------------------------------------------------------------------------
# The forms of the bottom-right band
# --------------------------------------------------------------------------------------------------------


def _bool_tril(q, k, v):
    sq, sk = _sizes(q, k)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return torch.softmax(_s(q, k).masked_fill(~keep, NEG_INF), -1) @ v


def _bool_tril_where_min(q, k, v):
    sq, sk = _sizes(q, k)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return torch.softmax(torch.where(keep, _s(q, k), MIN), -1) @ v


def _additive_inf_triu(q, k, v):
    sq, sk = _sizes(q, k)
    return torch.softmax(_s(q, k) + torch.full((sq, sk), NEG_INF).triu(sk - sq + 1), -1) @ v


def _additive_min_triu(q, k, v):
    sq, sk = _sizes(q, k)
    return torch.softmax(_s(q, k) + torch.full((sq, sk), MIN).triu(sk - sq + 1), -1) @ v


def _gpt2_constant_slice(q, k, v):
    """GPT-2's ``bias[:, :, Sk - Sq : Sk, :Sk]`` of a tril built in forward (a constant, not a buffer)."""
    sq, sk = _sizes(q, k)
    bias = torch.tril(torch.ones(MAX_POS, MAX_POS, dtype=torch.bool)).view(1, 1, MAX_POS, MAX_POS)
    causal = bias[:, :, sk - sq: sk, :sk]
    w = torch.where(causal, _s(q, k), torch.full([], MIN))
    return torch.softmax(w, -1) @ v


def _arange_le(q, k, v):
    sq, sk = _sizes(q, k)
    q_idx = torch.arange(sq)[:, None]
    k_idx = torch.arange(sk)[None, :]
    return torch.softmax(_s(q, k).masked_fill(~(k_idx <= q_idx + (sk - sq)), NEG_INF), -1) @ v


def _arange_gt_min(q, k, v):
    sq, sk = _sizes(q, k)
    i = torch.arange(sq).view(-1, 1) + (sk - sq)
    j = torch.arange(sk).view(1, -1)
    return torch.softmax(_s(q, k).masked_fill(j > i, MIN), -1) @ v


def _sdpa_bool(q, k, v):
    sq, sk = _sizes(q, k)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=SCALE)


def _sdpa_inf(q, k, v):
    sq, sk = _sizes(q, k)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((sq, sk), NEG_INF).triu(sk - sq + 1))


def _sdpa_min(q, k, v):
    sq, sk = _sizes(q, k)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((sq, sk), MIN).triu(sk - sq + 1),
                                          scale=SCALE)


FORMS = {
    "bool_tril": _bool_tril,
    "bool_tril_where_finfo_min": _bool_tril_where_min,
    "additive_inf_triu": _additive_inf_triu,
    "additive_finfo_min_triu": _additive_min_triu,
    "gpt2_constant_slice": _gpt2_constant_slice,
    "arange_le": _arange_le,
    "arange_gt_finfo_min": _arange_gt_min,
    "sdpa_bool": _sdpa_bool,
    "sdpa_inf": _sdpa_inf,
    "sdpa_finfo_min": _sdpa_min,
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sq,sk", [(SQ, SK), (2, 7), (7, 9)])
def test_bottom_right_mask_becomes_bottom_right_causal(form, sq, sk):
    fn = FORMS[form]
    nodes = _check_same(fn, *_qkv(sq, sk), tol=TOL)
    _bottom_right(nodes)


@pytest.mark.parametrize("form", ["bool_tril", "additive_inf_triu", "sdpa_bool"])
def test_bottom_right_is_reported_in_the_rewrite(form):
    with collecting() as report:
        _run_rewritten(FORMS[form], *_qkv())
    assert _rewrites() == (1, 0), str(report)
    details = [d.detail for d in report.rewrites if d.family == "attention"]
    assert len(details) == 1 and "causal bottom-right" in details[0], details


def _bottom_right_and_padding(q, k, v, pad):
    """The band and-ed with a runtime key padding mask: the padding stays a mask, the band the window."""
    sq, sk = _sizes(q, k)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) & pad[:, None, None, :]
    return torch.softmax(torch.where(keep, _s(q, k), NEG_INF), -1) @ v


def test_bottom_right_and_a_padding_mask_is_a_bottom_right_window():
    pad = torch.ones(B, SK, dtype=torch.bool)
    pad[0, :3] = False  # left padding: every query still sees its own key
    nodes = _check_same(_bottom_right_and_padding, *_qkv(), pad, tol=TOL)
    _bottom_right(nodes, with_mask=True)


# --------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: cross-attention with a bottom-right attn_mask (True / -inf = masked)
# --------------------------------------------------------------------------------------------------------


class _CrossMHA(nn.Module):
    def __init__(self, kind, need_weights):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4)
        self.kind, self.need_weights = kind, need_weights

    def forward(self, x, mem):
        lq, lk = x.shape[0], mem.shape[0]
        if self.kind == "bool":
            mask = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)
        else:
            mask = torch.full((lq, lk), NEG_INF if self.kind == "inf" else MIN).triu(lk - lq + 1)
        return self.mha(x, mem, mem, attn_mask=mask, need_weights=self.need_weights)[0]


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kind", ["bool", "inf", "finfo_min"])
def test_multihead_attention_bottom_right_mask(kind, need_weights):
    torch.manual_seed(0)
    m = _CrossMHA(kind, need_weights)
    x, mem = torch.randn(SQ, B, 32), torch.randn(SK, B, 32)
    nodes = _check_same(m, x, mem, tol=dict(atol=1e-5, rtol=1e-5))
    _bottom_right(nodes)


# --------------------------------------------------------------------------------------------------------
# What stays as before: Sq == Sk top-left, Sq > Sk dead rows, masks off by one diagonal
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_square_stays_top_left(form):
    nodes = _check_same(FORMS[form], *_qkv(9, 9), tol=TOL)
    _top_left(nodes)


@pytest.mark.parametrize("form", ["bool_tril", "bool_tril_where_finfo_min", "additive_inf_triu",
                                  "additive_finfo_min_triu", "arange_le", "arange_gt_finfo_min",
                                  "sdpa_inf", "sdpa_finfo_min"])
def test_sq_greater_than_sk_with_dead_rows_is_left_alone(form):
    """The bottom-right band with Sq > Sk leaves the first Sq - Sk rows without a key: eager gives NaN or the
    average of v there, the op 0; refused (a near miss) as before, eager's values."""
    fn = FORMS[form]
    args = _qkv(9, 5)
    ref = fn(*args)
    with collecting() as report:
        out, graphs = _run_rewritten(fn, *args)
    assert _rewrites() == (0, 1), str(report)
    assert any("no visible key" in d.detail for d in report.near_misses), str(report)
    assert not _flash_nodes(graphs)
    torch.testing.assert_close(out, ref, equal_nan=True)


def test_sdpa_bool_sq_greater_than_sk_stays_a_runtime_mask():
    """A bool attn_mask's dead rows are 0 in eager SDPA as in the op: rewritten as before, with the mask."""
    nodes = _check_same(_sdpa_bool, *_qkv(9, 5), tol=TOL)
    _runtime_mask(nodes)


def _off_by(delta, fill):
    def fn(q, k, v):
        sq, sk = _sizes(q, k)
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq + delta)
        return torch.softmax(_s(q, k).masked_fill(~keep, fill), -1) @ v

    return fn


def _sdpa_off_by(delta):
    def fn(q, k, v):
        sq, sk = _sizes(q, k)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((sq, sk), NEG_INF).triu(
            sk - sq + 1 + delta), scale=SCALE)

    return fn


@pytest.mark.parametrize("fn", [_off_by(-1, NEG_INF), _off_by(1, NEG_INF), _off_by(-1, MIN), _off_by(1, MIN),
                                _sdpa_off_by(-1), _sdpa_off_by(1)],
                         ids=["below_inf", "above_inf", "below_min", "above_min", "sdpa_below", "sdpa_above"])
def test_near_bottom_right_off_by_one_diagonal_stays_a_runtime_mask(fn):
    nodes = _check_same(fn, *_qkv(), tol=TOL)
    _runtime_mask(nodes)


# --------------------------------------------------------------------------------------------------------
# Dynamic shapes: a mask that is the band at the example's sizes is not taken as the band for others
# --------------------------------------------------------------------------------------------------------


def _literal_diagonal(q, k, v):
    """Bottom-right at (5, 12) only: the diagonal 7 is a literal, not Sk - Sq."""
    sq, sk = _sizes(q, k)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(SK - SQ)
    return torch.softmax(_s(q, k).masked_fill(~keep, NEG_INF), -1) @ v


@pytest.mark.parametrize("fn", [_literal_diagonal, _bool_tril, _additive_min_triu, _arange_le, _sdpa_min],
                         ids=["literal_diagonal", "bool_tril", "additive_finfo_min", "arange_le",
                              "sdpa_finfo_min"])
def test_dynamic_shapes_other_sizes_get_eager_values(fn):
    """Compiled with dynamic=True at (5, 12), where the mask is the bottom-right band, then called at other
    sizes (where the literal diagonal is not the band): each call gives eager's values, and a graph reused
    across sizes does not carry a band folded at the example's sizes."""
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def backend(gm, example_inputs):
        compiled = rewrite_only_backend(gm, example_inputs)
        graphs.append(gm.graph)
        return compiled

    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for sq, sk in ((SQ, SK), (6, 20), (3, 4), (8, 11)):
        args = _qkv(sq, sk, seed=sq)
        torch.testing.assert_close(compiled(*args), fn(*args), **TOL)
    nodes = _flash_nodes(graphs)
    assert nodes and counters["flash"]["attention_skipped"] == 0
    for node in nodes:
        if len(graphs) < 4:  # one graph served several sizes: it must not hold the band as is_causal
            assert node.kwargs.get("causal_alignment") != "bottom_right", node.kwargs
