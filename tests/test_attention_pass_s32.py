"""Session 32: the attention rewrite on two forms the session-31 review of non-HuggingFace code bases left
alone or kept as a mask (tests/findings/codebase_review_s31.md, M1 and M4).

M1: SAM / ViTDet / MViTv2's decomposed relative positions add a bias to the scores viewed with their query
and key dims split, ``(attn.view(B, q_h, q_w, k_h, k_w) + rel_h[..., None] + rel_w[..., None, :]).view(B,
q_h * q_w, k_h * k_w)``. The terms' sum, merged to (.., Sq, Sk), is now the op's additive mask, its gradient
reaching q and the learned tables. Checked on SAM's image-encoder Attention, a ViTDet / MViTv2 attention
whose keys are pooled (q_h != k_h), every spelling dynamo records (in place, methods, operands either way
round, unflatten / flatten in steps, heads kept apart, terms broadcast over part of the factors, one query
row), and the forms that are not provably the same (a split that is not of the query and key dims alone, a
step other than an addition, a term that changes the scores' shape or dtype, a merge to another shape, an
intermediate read elsewhere), which stay eager's and are reported.

M4: flash-attn SelfAttention's additive ``triu(full((S, S), -10000), 1)`` folds into causal, as a
masked_fill of -10000 does (the pass's finite-fill policy: -1e4 or below is masked). Bands that are not the
causal one, and values above -1e4 (Swin's -100), stay masks.

Each case runs through dynamo + the attention rewrite (the rewritten graph as plain PyTorch, the flash op on
its CPU reference), on fresh random inputs in fp32, and is compared with eager: outputs and the gradients
of every input and parameter in training, outputs under torch.no_grad, and with dynamic=True over several
batch sizes where the form allows.
"""

from __future__ import annotations

import math

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
from test_attention_pass_styles import _assert_left_alone_and_reported
from test_codebases_review_s31 import FlashAttnSelfAttention, SAMAttention, add_decomposed_rel_pos

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

TOL = dict(atol=2e-5, rtol=2e-5)
QH, QW, KH, KW, D = 3, 5, 3, 5, 16
BH = 6  # batch · heads, as SAM merges them


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _detail(report) -> str:
    (decision,) = [d for d in report.rewrites if d.family == "attention"]
    return decision.detail


def _eval_matches(fn, *args):
    """fn rewritten under torch.no_grad: eager's output, one rewrite, no near miss; returns the report."""
    with torch.no_grad():
        expected = fn(*args)
        with collecting() as report:
            got, _ = _run_rewritten(fn, *args)
    assert _rewrites() == (1, 0), str(report)
    torch.testing.assert_close(got, expected, **TOL)
    return report


def _train_matches(fn, *args, options=None):
    """fn rewritten: eager's output and the gradients of every input (and parameter); returns the report and
    the flash_attention nodes."""
    with collecting() as report:
        nodes = _check_same(fn, *args, options=options)
    return report, nodes


# --------------------------------------------------------------------------------------------------------
# M1: SAM's image-encoder Attention and a ViTDet / MViTv2 attention with pooled keys
# --------------------------------------------------------------------------------------------------------


def test_sam_attention_training_gradients_reach_the_tables():
    """segment_anything's Attention(use_rel_pos=True): get_rel_pos without interpolation, rel_h / rel_w by
    einsum, the 5-d view. The mask is the bias (6, 15, 15), which needs a gradient: the tables' gradients
    are eager's (and not zero, so a mask cut from autograd would fail here)."""
    model = SAMAttention(32, 2, (QH, QW))
    report, nodes = _train_matches(model, torch.randn(3, QH, QW, 32))
    (node,) = nodes
    assert node.kwargs["attn_mask"] is not None and not node.kwargs["is_causal"]
    assert "mask [6, 15, 15], 2 bias terms added to the scores split as [6, 3, 5, 3, 5]" in _detail(report)
    # (model holds eager's gradients, which _check_same compared with the rewritten copy's)
    assert model.rel_pos_h.grad.abs().sum() > 0 and model.rel_pos_w.grad.abs().sum() > 0


def test_sam_attention_eval():
    model = SAMAttention(32, 2, (QH, QW)).eval()
    _eval_matches(model, torch.randn(3, QH, QW, 32))


def test_sam_attention_dynamic_batch():
    """dynamic=True: the batch (and so B·heads) is symbolic, the window sizes are fixed by the tables' sizes
    (get_rel_pos compares them): one graph, rewritten, eager's outputs and parameter gradients at each
    batch size."""
    model = SAMAttention(32, 2, (QH, QW))
    twin = SAMAttention(32, 2, (QH, QW))
    twin.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        compiled = torch.compile(twin, backend=rewrite_only_backend, dynamic=True)
        for batch in (2, 3, 5):
            x = torch.randn(batch, QH, QW, 32)
            model.zero_grad()
            twin.zero_grad()
            expected, got = model(x), compiled(x)
            torch.testing.assert_close(got, expected, **TOL)
            grad = torch.randn_like(expected)
            expected.backward(grad)
            got.backward(grad)
            for (name, p), q in zip(twin.named_parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert _rewrites() == (1, 0), str(report)
    assert counters["stats"]["unique_graphs"] == 1, str(report)


def _attention_pool(x, pool, norm):
    """detectron2's mvit.attention_pool: (B, H, W, C) pooled by a conv over (H, W), then normed."""
    x = pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    return norm(x)


class MViTv2Attention(nn.Module):
    """detectron2's MViTv2 MultiScaleAttention (ViTDet's backbone family): q, k, v pooled by depthwise
    convolutions, k / v with stride 2 (q_h x q_w = 4 x 4 queries over k_h x k_w = 2 x 2 keys), heads merged
    into the batch, the decomposed relative positions of the pooled sizes (get_rel_pos scales the
    coordinates), residual pooling."""

    def __init__(self, dim=32, num_heads=2, input_size=4, stride_kv=2):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

        def pool(stride):
            return nn.Conv2d(head_dim, head_dim, 3, stride=stride, padding=1, groups=head_dim, bias=False)

        self.pool_q, self.pool_k, self.pool_v = pool(1), pool(stride_kv), pool(stride_kv)
        self.norm_q, self.norm_k, self.norm_v = (nn.LayerNorm(head_dim) for _ in range(3))
        rel_dim = 2 * max(input_size, input_size // stride_kv) - 1
        self.rel_pos_h = nn.Parameter(0.3 * torch.randn(rel_dim, head_dim))
        self.rel_pos_w = nn.Parameter(0.3 * torch.randn(rel_dim, head_dim))

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H, W, 3, self.num_heads, -1).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.reshape(3, B * self.num_heads, H, W, -1).unbind(0)
        q = _attention_pool(q, self.pool_q, self.norm_q)
        k = _attention_pool(k, self.pool_k, self.norm_k)
        v = _attention_pool(v, self.pool_v, self.norm_v)
        ori_q = q
        q_hw, k_hw = q.shape[1:3], k.shape[1:3]
        q = q.view(q.shape[0], math.prod(q_hw), -1)
        k = k.view(k.shape[0], math.prod(k_hw), -1)
        v = v.view(v.shape[0], math.prod(k_hw), -1)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = add_decomposed_rel_pos(attn, q, self.rel_pos_h, self.rel_pos_w, q_hw, k_hw)
        attn = attn.softmax(dim=-1)
        x = attn @ v
        x = x.view(x.shape[0], q_hw[0], q_hw[1], -1) + ori_q
        H, W = x.shape[1], x.shape[2]
        x = x.view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


def test_mvitv2_pooled_keys_training_and_eval():
    model = MViTv2Attention()
    report, _ = _train_matches(model, torch.randn(2, 4, 4, 32))
    assert "mask [4, 16, 4], 2 bias terms added to the scores split as [4, 4, 4, 2, 2]" in _detail(report)
    _eval_matches(model.eval(), torch.randn(2, 4, 4, 32))


# --------------------------------------------------------------------------------------------------------
# M1: the spellings
# --------------------------------------------------------------------------------------------------------


def _split(s):
    # (-1, not s.shape[0]: a size read of the scores under dynamic shapes is another reader of them)
    return s.view(-1, QH, QW, KH, KW)


def _merge(s):
    return s.view(-1, QH * QW, KH * KW)


def _scores(q, k):
    return (q * D**-0.5) @ k.transpose(-2, -1)


def _sam_form(q, k, v, rel_h, rel_w):
    return _merge(_split(_scores(q, k)) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).softmax(-1) @ v


def _in_place(q, k, v, rel_h, rel_w):
    s5 = _split(_scores(q, k))
    s5 += rel_h[:, :, :, :, None]
    s5 += rel_w[:, :, :, None, :]
    return torch.softmax(_merge(s5), dim=-1) @ v


def _in_place_methods(q, k, v, rel_h, rel_w):
    s = _split(_scores(q, k)).add_(rel_h.unsqueeze(-1)).add_(rel_w.unsqueeze(-2))
    return F.softmax(_merge(s), dim=-1) @ v


def _bias_first_reshape(q, k, v, rel_h, rel_w):
    s = _scores(q, k).reshape(BH, QH, QW, KH, KW)
    s = torch.add(rel_w[..., None, :], s.add(rel_h[..., None])).reshape(BH, QH * QW, KH * KW)
    return torch.matmul(s.softmax(-1), v)


def _unflatten_flatten_in_steps(q, k, v, rel_h, rel_w):
    s = _scores(q, k).unflatten(-1, (KH, KW)).unflatten(1, (QH, QW))
    s = (s + rel_h[..., None] + rel_w[..., None, :]).flatten(3).flatten(1, 2)
    return s.softmax(-1) @ v


def _with_key_padding(q, k, v, rel_h, rel_w, keep):
    s = _merge(_split(_scores(q, k)) + rel_h[..., None] + rel_w[..., None, :])
    return s.masked_fill(~keep[:, None, :], float("-inf")).softmax(-1) @ v


def _qkv_merged_heads(bh=BH, sq=QH * QW, sk=KH * KW):
    return torch.randn(bh, sq, D), torch.randn(bh, sk, D), torch.randn(bh, sk, D)


def _rel(bh=BH):
    return torch.randn(bh, QH, QW, KH), torch.randn(bh, QH, QW, KW)


def _key_keep(bh=BH):
    keep = torch.ones(bh, KH * KW, dtype=torch.bool)
    keep[-1, -4:] = False
    return keep


def _qkv_rel(bh=BH):
    return *_qkv_merged_heads(bh), *_rel(bh)


FORMS = {
    "sam_view_getitem": (_sam_form, _qkv_rel),
    "in_place_iadd": (_in_place, _qkv_rel),
    "in_place_add_methods_unsqueeze": (_in_place_methods, _qkv_rel),
    "torch_add_bias_first_reshape": (_bias_first_reshape, _qkv_rel),
    "unflatten_flatten_in_steps": (_unflatten_flatten_in_steps, _qkv_rel),
    "with_key_padding": (_with_key_padding, lambda bh=BH: (*_qkv_rel(bh), _key_keep(bh))),
}


@pytest.mark.parametrize("name", list(FORMS))
def test_split_bias_forms(name):
    fn, make = FORMS[name]
    report, (node,) = _train_matches(fn, *make())
    assert node.kwargs["attn_mask"] is not None
    assert "2 bias terms added to the scores split as [6, 3, 5, 3, 5]" in _detail(report), str(report)
    _eval_matches(fn, *make())


@pytest.mark.parametrize("name", ["sam_view_getitem", "in_place_iadd", "unflatten_flatten_in_steps",
                                  "with_key_padding"])
def test_split_bias_forms_dynamic(name):
    """dynamic=True, B·heads symbolic (the split reads it from the scores): one graph for three sizes,
    eager's outputs and gradients at each."""
    fn, make = FORMS[name]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=rewrite_only_backend, dynamic=True)
    with collecting() as report:
        for bh in (4, 6, 7):  # (not 3 or 5: duck sizing would tie B·heads to a factor, specialising it)
            args = [a.requires_grad_() if a.is_floating_point() else a for a in make(bh)]
            args_e = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
            got, expected = compiled(*args), fn(*args_e)
            torch.testing.assert_close(got, expected, **TOL)
            grad = torch.randn_like(expected)
            got.backward(grad)
            expected.backward(grad)
            for a, b in zip(args, args_e, strict=True):
                if a.is_floating_point():
                    torch.testing.assert_close(a.grad, b.grad, **TOL)
    assert _rewrites() == (1, 0) and counters["stats"]["unique_graphs"] == 1, str(report)


def _heads_apart_partial_terms(q, k, v, head_table, col):
    """Heads kept apart ((B, H, Sq, Sk) scores split to 6-d), and terms whose sum is broadcast over some
    factors of a group only: head_table (H, q_h, 1, k_h, 1), col (k_w,), no batch dim. The mask is their sum
    expanded over q_w and merged: (H, Sq, Sk)."""
    b, h = q.shape[:2]
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).view(b, h, QH, QW, KH, KW)
    s = s + head_table + col
    return s.view(b, h, QH * QW, KH * KW).softmax(-1) @ v


def _one_query_row(q, k, v, row, col):
    """One query (a pooled token) over a k_h x k_w grid: the split (B·H, 1, k_h, k_w) has no query factor."""
    s = _scores(q, k).view(BH, 1, KH, KW) + row[:, None] + col
    return s.view(BH, 1, KH * KW).softmax(-1) @ v


def test_split_bias_heads_apart_terms_broadcast_over_part_of_a_group():
    args = (torch.randn(2, 3, QH * QW, D), torch.randn(2, 3, KH * KW, D), torch.randn(2, 3, KH * KW, D),
            torch.randn(3, QH, 1, KH, 1), torch.randn(KW))
    report, _ = _train_matches(_heads_apart_partial_terms, *args)
    assert "mask [3, 15, 15], 2 bias terms added to the scores split as [2, 3, 3, 5, 3, 5]" in _detail(report)
    _eval_matches(_heads_apart_partial_terms, *args)


def test_split_bias_one_query_row():
    args = (torch.randn(BH, 1, D), torch.randn(BH, KH * KW, D), torch.randn(BH, KH * KW, D),
            torch.randn(KH), torch.randn(KW))
    report, _ = _train_matches(_one_query_row, *args)
    assert "mask [1, 15]" in _detail(report)
    _eval_matches(_one_query_row, *args)


# --------------------------------------------------------------------------------------------------------
# M1: what is not provably the same stays eager's, reported
# --------------------------------------------------------------------------------------------------------


def _split_with_the_leading_dims(q, k, v, rel_h, rel_w):
    s = _scores(q, k).view(2, 3, QH, QW, KH, KW) + rel_h.view(2, 3, QH, QW, KH, 1)
    return s.view(BH, QH * QW, KH * KW).softmax(-1) @ v


def _split_mixing_query_and_key(q, k, v, rel_h, rel_w):
    s = _scores(q, k).view(BH, QH, QW * KH, KW) + rel_w[:, :, 0, None, :]
    return s.view(BH, QH * QW, KH * KW).softmax(-1) @ v


def _scaled_between(q, k, v, rel_h, rel_w):
    return _merge(_split(_scores(q, k)) * 0.5 + rel_h[..., None] + rel_w[..., None, :]).softmax(-1) @ v


def _subtracted_between(q, k, v, rel_h, rel_w):
    return _merge(_split(_scores(q, k)) - rel_h[..., None] + rel_w[..., None, :]).softmax(-1) @ v


def _term_with_a_leading_dim(q, k, v, rel_h, rel_w):
    return _merge(_split(_scores(q, k)) + rel_h[None, ..., None] + rel_w[..., None, :]).softmax(-1) @ v


def _term_in_float64(q, k, v, rel_h, rel_w):
    s = _merge(_split(_scores(q, k)) + rel_h.double()[..., None] + rel_w.double()[..., None, :])
    return s.softmax(-1, dtype=torch.float32) @ v


def _merged_to_another_shape(q, k, v, rel_h, rel_w):
    s = (q @ k.transpose(-2, -1)).view(BH, 2, 3, 2, 3) + rel_h[:, :2, :3, :2, None]
    return s.view(BH, 4, 9).softmax(-1) @ v


def _split_sum_read_elsewhere(q, k, v, rel_h, rel_w):
    s5 = _split(_scores(q, k)) + rel_h[..., None] + rel_w[..., None, :]
    return _merge(s5).softmax(-1) @ v, s5.mean()


def _scaled_after_the_merge(q, k, v, rel_h, rel_w):
    return (_merge(_split(_scores(q, k)) + rel_h[..., None] + rel_w[..., None, :]) * 0.5).softmax(-1) @ v


NOT_A_SPLIT = "not a split of the query and of the key dim each into factors of its own"
REFUSED = {
    "split_with_the_leading_dims": (_split_with_the_leading_dims, None, NOT_A_SPLIT),
    "split_mixing_query_and_key": (_split_mixing_query_and_key, None, NOT_A_SPLIT),
    "scaled_between": (_scaled_between, None, "(mul): between the split and the merge only additions of "
                       "bias terms are seen through"),
    "subtracted_between": (_subtracted_between, None, "(sub): between the split and the merge only"),
    "term_with_a_leading_dim": (_term_with_a_leading_dim, None,
                                "does not broadcast to the split scores [6, 3, 5, 3, 5] without enlarging"),
    "term_in_float64": (_term_in_float64, None, "(torch.float64) of 'add' is not in the split scores' dtype "
                        "(torch.float32)"),
    "merged_to_another_shape": (_merged_to_another_shape, (BH, 6, 9),
                                "a shape they do not have under the split"),
    "split_sum_read_elsewhere": (_split_sum_read_elsewhere, None, "has other users"),
    "scaled_after_the_merge": (_scaled_after_the_merge, None, "the scores are scaled after an additive mask"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_split_bias_not_provably_the_same_is_left_alone(name):
    fn, sizes, reason = REFUSED[name]
    if sizes is None:
        q, k, v = _qkv_merged_heads()
    else:  # 6 queries over 6 keys, the probabilities merged to (6, 4, 9) before ·v
        q, k, v = torch.randn(BH, 6, D), torch.randn(BH, 6, D), torch.randn(*sizes[:1], 9, D)
    _assert_left_alone_and_reported(fn, (q, k, v, *_rel()), reason)


def test_refused_after_the_mask_was_built_leaves_no_node_behind():
    """SAM's Attention with head_dim 4, which the op does not take: refused after the walk inserted the
    bias's mask, which the attempt erases (every node of the graph is read by another or is the output)."""
    model = SAMAttention(12, 3, (QH, QW))
    with collecting() as report:
        out, graphs = _run_rewritten(model, torch.randn(2, QH, QW, 12))
    assert _rewrites() == (0, 1), str(report)
    assert "head_dim of q/k is 4" in report.near_misses[0].detail, str(report)
    (graph,) = graphs
    assert [n.name for n in graph.nodes if not n.users and n.op not in ("output", "placeholder")] == []


# --------------------------------------------------------------------------------------------------------
# M4: an additive -1e4 band folds into causal, as a -1e4 fill does
# --------------------------------------------------------------------------------------------------------


def test_flash_attn_self_attention_additive_triu_is_causal():
    model = FlashAttnSelfAttention(causal=True)
    report, (node,) = _train_matches(model, torch.randn(2, 11, 3, 3, D))
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    assert "causal, additive -1e+04 taken as -inf" in _detail(report) and "mask [" not in _detail(report)
    _eval_matches(model, torch.randn(2, 11, 3, 3, D))


def _banded(band):
    def attend(q, k, v):
        return (q @ k.transpose(-2, -1) / math.sqrt(D) + band(q.shape[-2], k.shape[-2])).softmax(-1) @ v

    return attend


BANDS = {
    # (band, Sq, Sk, words of the rewrite)
    "triu_1_minus_1e4": (lambda sq, sk: torch.triu(torch.full((sq, sk), -10000.0), 1), 9, 9,
                         "causal, additive -1e+04 taken as -inf"),
    "triu_1_minus_1e9": (lambda sq, sk: torch.full((sq, sk), -1e9).triu(1), 9, 9,
                         "causal, additive -1e+09 taken as -inf"),
    "bottom_right_kv_cache": (lambda sq, sk: torch.triu(torch.full((sq, sk), -10000.0), sk - sq + 1), 4, 9,
                              "causal bottom-right (Sk - Sq keys ahead), additive -1e+04 taken as -inf"),
    # not the causal band: kept as the mask eager adds
    "triu_2_wrong_offset": (lambda sq, sk: torch.triu(torch.full((sq, sk), -10000.0), 2), 9, 9,
                            "mask [9, 9]"),
    "tril_instead_of_triu": (lambda sq, sk: torch.tril(torch.full((sq, sk), -10000.0), -1), 9, 9,
                             "mask [9, 9]"),
    "triu_0_masks_the_diagonal": (lambda sq, sk: torch.triu(torch.full((sq, sk), -10000.0)), 9, 9,
                                  "mask [9, 9]"),
    # above -1e4: a bias softmax does not send to 0 (Swin's -100), kept
    "triu_1_minus_100": (lambda sq, sk: torch.triu(torch.full((sq, sk), -100.0), 1), 9, 9, "mask [9, 9]"),
    "triu_1_minus_1": (lambda sq, sk: torch.triu(torch.full((sq, sk), -1.0), 1), 9, 9, "mask [9, 9]"),
}


@pytest.mark.parametrize("name", list(BANDS))
def test_additive_band(name):
    band, sq, sk, words = BANDS[name]
    fn = _banded(band)

    def qkv():
        return torch.randn(2, 3, sq, D), torch.randn(2, 3, sk, D), torch.randn(2, 3, sk, D)

    report, (node,) = _train_matches(fn, *qkv())
    assert words in _detail(report), str(report)
    assert (node.kwargs["attn_mask"] is None) == ("causal" in words)
    _eval_matches(fn, *qkv())


def test_sdpa_additive_triu_attn_mask_is_causal():
    def fn(q, k, v):
        s = q.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((s, s), -10000.0).triu(1))

    report, (node,) = _train_matches(fn, *(torch.randn(2, 3, 9, D) for _ in range(3)))
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    assert "causal from attn_mask, -1e+04 taken as -inf" in _detail(report)


def test_additive_triu_dynamic_matches_eager():
    """dynamic=True: the band is built from the symbolic S, no compile-time constant, so it stays the mask
    eager adds (as a -inf band does); eager's results at every length, one graph."""
    model = FlashAttnSelfAttention(causal=True)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        compiled = torch.compile(model, backend=rewrite_only_backend, dynamic=True)
        for s in (7, 9, 12):
            qkv = torch.randn(2, s, 3, 3, D)
            torch.testing.assert_close(compiled(qkv), model(qkv), **TOL)
    assert _rewrites() == (1, 0) and counters["stats"]["unique_graphs"] == 1, str(report)
