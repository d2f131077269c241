"""fx_passes/attention on attention code styles that tests/test_attention_pass.py does not spell out.

Each positive case is a small function or module in one style (score matmul, scale, softmax, mask,
dropout, GQA, output layout) that must become exactly one flash_attention call, with outputs and
gradients (inputs and parameters) equal to eager's on CPU; each negative case computes another function
(or one the pass cannot prove equal) and must be left alone, with a near miss where the pass saw a
candidate. Sizes are tiny and odd (S = 7 or 13, D = 8 or 16) to keep the file fast.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_pass import _check_same, _flash_nodes, _qkv, _rewrites, _run_rewritten

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

TOL = dict(atol=2e-5, rtol=2e-5)
B, H, S, D = 2, 3, 7, 8


def _bshd(*tensors):
    """(B, H, S, D) -> (B, S, H, D), the layout projections produce before the heads are split off."""
    return tuple(t.transpose(1, 2).contiguous() for t in tensors)


def _causal_keep(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


# --------------------------------------------------------------------------------------------------------
# Functions of (q, k, v[, extra]): one style each
# --------------------------------------------------------------------------------------------------------


# Scores: matmul spellings and kᵀ spellings


def _baddbmm_empty_beta0(q, k, v):
    # HF (CodeGen / GPT-J era): beta=0 ignores the uninitialised input, alpha is the scale
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    scores = torch.baddbmm(torch.empty(b * h, s, s, dtype=q.dtype), q3, k3.transpose(1, 2), beta=0.0,
                           alpha=1.0 / math.sqrt(d))
    return torch.bmm(scores.softmax(-1), v3).view(b, h, s, d)


def _baddbmm_padding_bias(q, k, v, am):
    # Bloom / Falcon style: an additive (B·H, 1, S) mask as baddbmm's input (beta=1)
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    scores = am.repeat_interleave(h, dim=0).baddbmm(q3, k3.transpose(-1, -2), alpha=d**-0.5)
    return torch.bmm(F.softmax(scores, dim=-1), v3)


def _bmm_from_bshd(q, k, v):
    # merged heads built from (B, S, H, D) projections, the output put back to (B, S, H·D)
    qs, ks, vs = _bshd(q, k, v)
    b, s, h, d = qs.shape
    q3, k3, v3 = (t.transpose(1, 2).reshape(b * h, s, d) for t in (qs, ks, vs))
    p = torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d), dim=2)
    return torch.bmm(p, v3).view(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)


def _einsum_bshd_scores_matmul_pv(q, k, v):
    qs, ks, _ = _bshd(q, k, v)
    s = torch.einsum("bqhd,bkhd->bhqk", qs, ks) * q.shape[-1] ** -0.5
    return s.softmax(-1) @ v


def _matmul_scores_einsum_pv_bshd(q, k, v):
    # P·V by einsum straight into (B, S, H, D), then merged heads
    _, _, vs = _bshd(q, k, v)
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vs)
    return out.reshape(out.shape[0], out.shape[1], -1)


def _k_bshd_permuted_to_kt(q, k, v):
    # kᵀ in one permute of the (B, S, H, D) projection: (B, H, D, S)
    qs, ks, vs = _bshd(q, k, v)
    s = torch.matmul(qs.permute(0, 2, 1, 3), ks.permute(0, 2, 3, 1)) * 0.125
    return torch.matmul(s.softmax(dim=-1), vs.permute(0, 2, 1, 3))


def _k_transpose_positive_dims(q, k, v):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(3, 2)) / 4.0, dim=-1), v)


def _k_swapaxes(q, k, v):
    return torch.softmax(q @ k.swapaxes(-1, -2) * 0.3, -1) @ v


# Scale: spellings of a constant positive factor


def _scale_rmul_left(q, k, v):
    return torch.softmax(0.125 * (q @ k.transpose(-2, -1)), -1) @ v


def _scale_methods(q, k, v):
    d = q.size(-1)
    return torch.softmax(torch.div(q @ k.mT, math.sqrt(d)).mul(1.5), -1) @ v


def _scale_rsqrt_tensor(q, k, v):
    s = (q @ k.mT) * torch.rsqrt(torch.tensor(q.shape[-1], dtype=q.dtype))
    return torch.softmax(s, -1) @ v


def _scale_pow_half_div(q, k, v):
    return torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, -1) @ v


def _scale_q_divided(q, k, v):
    q = q / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


# Softmax: spellings of softmax over the key dim


def _softmax_dim3(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=3) @ v


def _softmax_method_positional_dim(q, k, v):
    return (q @ k.transpose(-2, -1) * 0.25).softmax(3) @ v


def _softmax_fp32_cast_back_to(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return F.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _softmax_fp32_cast_back_type_as_q(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return F.softmax(s.float(), dim=-1).type_as(q) @ v


def _softmax_dtype_kwarg(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1, dtype=torch.float32) @ v


def _softmax_row_max_subtracted(q, k, v):
    # the stabilisation softmax does itself, written out: softmax(s - c) == softmax(s) for a per-row c
    s = q @ k.transpose(-2, -1) * 0.25
    s = s - s.amax(dim=-1, keepdim=True)
    return torch.softmax(s, dim=-1) @ v


def _softmax_row_max_subtracted_detached(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    s = s - s.max(dim=-1, keepdim=True).values.detach()
    return torch.softmax(s, dim=-1) @ v


# Masks


def _mask_eq0_runtime(q, k, v, keep):
    # Annotated Transformer: masked_fill(mask == 0, -1e9) with a (B, 1, 1, S) 0/1 padding mask
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    s = s.masked_fill(keep == 0, -1e9)
    return s.softmax(dim=-1) @ v


def _mask_not_bool_finfo_min(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * 0.25
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


def _mask_bert_extended(q, k, v, am):
    # BERT's old extended attention mask from the (B, S) 0/1 attention_mask: (1 - mask) * -10000, added
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s + (1.0 - am[:, None, None, :].to(q.dtype)) * -10000.0
    return F.softmax(s, dim=-1) @ v


def _mask_ones_tril_eq0(q, k, v):
    t = q.shape[-2]
    tril = torch.ones(t, t).tril()
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(tril == 0, float("-inf"))
    return F.softmax(s, dim=-1) @ v


def _mask_triu_diagonal1_bool(q, k, v):
    t = q.shape[-2]
    future = torch.triu(torch.ones(t, t), diagonal=1).bool()
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(future, float("-inf"))
    return F.softmax(s, dim=-1) @ v


def _mask_where_python_neg_inf(q, k, v):
    s = torch.where(_causal_keep(q.shape[-2]), q @ k.transpose(-2, -1) * 0.25, float("-inf"))
    return F.softmax(s, dim=-1) @ v


def _mask_where_fill_first(q, k, v):
    # where(masked, fill, scores): the condition marks what is hidden
    future = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
    s = torch.where(future, torch.tensor(float("-inf")), q @ k.transpose(-2, -1) * 0.25)
    return F.softmax(s, dim=-1) @ v


def _mask_where_full_like(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    s = torch.where(_causal_keep(q.shape[-2]), s, torch.full_like(s, float("-inf")))
    return F.softmax(s, dim=-1) @ v


def _mask_llama_4d_sliced(q, k, v, mask):
    # Llama: an additive (B, 1, Sq, Sk_max) causal + padding mask, sliced to the key length
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    s = s + mask[:, :, :, : k.shape[-2]]
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def _mask_bool_sdpa_style_and_scale_on_k(q, k, v, keep):
    s = q @ (k * q.shape[-1] ** -0.5).transpose(-2, -1)
    s = s.masked_fill(keep.logical_not(), float("-inf"))
    return s.softmax(-1) @ v


# Scale by a runtime tensor constant along the keys: moved onto q, (q·kᵀ)·t == (q·t)·kᵀ


def _scale_by_tensor(q, k, v, t):
    return torch.softmax(q @ k.transpose(-2, -1) * t, dim=-1) @ v


def _temperature_by_tensor(q, k, v, t):
    return torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) / t, dim=-1) @ v


def _scale_by_tensor_then_causal_mask(q, k, v, t):
    s = (q @ k.transpose(-2, -1)) * t * 0.5
    return torch.softmax(s.masked_fill(~_causal_keep(q.shape[-2]), float("-inf")), dim=-1) @ v


TENSOR_SCALES = [
    (_scale_by_tensor, lambda: torch.tensor(0.3)),  # a learned temperature
    (_scale_by_tensor, lambda: torch.rand(H, 1, 1) + 0.5),  # learned per head
    (_temperature_by_tensor, lambda: torch.rand(B, 1, S, 1) + 0.5),  # per query
    (_scale_by_tensor_then_causal_mask, lambda: torch.rand(1, H, 1, 1) + 0.5),
]


# The factor's gradient is a cancelling sum, over the keys in eager and over the head dim once the factor
# is on q: equal in exact arithmetic (1e-14 apart in fp64), not in fp32 rounding.
FACTOR_GRAD_TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("fn, factor", TENSOR_SCALES, ids=["0d", "per_head", "per_query", "per_head_causal"])
def test_scale_by_a_tensor_moves_onto_q(fn, factor):
    (node,) = _check_same(fn, *_qkv(B=B, H=H, S=S, D=D), factor(), tol=FACTOR_GRAD_TOL)
    assert node.kwargs["scale"] == pytest.approx(0.5 if fn is _scale_by_tensor_then_causal_mask else 1.0)
    assert node.kwargs["is_causal"] is (fn is _scale_by_tensor_then_causal_mask)


# Dropout on the probabilities (p = 0 or not training, so numerics compare)


def _dropout_functional_positional(q, k, v):
    return F.dropout(torch.softmax(q @ k.mT * 0.25, -1), 0.0, True) @ v


def _dropout_torch_dropout_eval(q, k, v):
    return torch.dropout(torch.softmax(q @ k.mT * 0.25, -1), 0.3, train=False) @ v


def _dropout_after_cast_back(q, k, v):
    p = F.softmax((q @ k.mT).float() * 0.25, dim=-1).to(q.dtype)
    return F.dropout(p, p=0.0, training=True) @ v


HAND_WRITTEN = [
    _baddbmm_empty_beta0,
    _bmm_from_bshd,
    _einsum_bshd_scores_matmul_pv,
    _matmul_scores_einsum_pv_bshd,
    _k_bshd_permuted_to_kt,
    _k_transpose_positive_dims,
    _k_swapaxes,
    _scale_rmul_left,
    _scale_methods,
    _scale_rsqrt_tensor,
    _scale_pow_half_div,
    _scale_q_divided,
    _softmax_dim3,
    _softmax_method_positional_dim,
    _softmax_fp32_cast_back_to,
    _softmax_fp32_cast_back_type_as_q,
    _softmax_dtype_kwarg,
    _softmax_row_max_subtracted,
    _softmax_row_max_subtracted_detached,
    _mask_ones_tril_eq0,
    _mask_triu_diagonal1_bool,
    _mask_where_python_neg_inf,
    _mask_where_fill_first,
    _mask_where_full_like,
    _dropout_functional_positional,
    _dropout_torch_dropout_eval,
    _dropout_after_cast_back,
]
CAUSAL = {_mask_ones_tril_eq0, _mask_triu_diagonal1_bool, _mask_where_python_neg_inf, _mask_where_fill_first,
          _mask_where_full_like}


@pytest.mark.parametrize("fn", HAND_WRITTEN, ids=[f.__name__.strip("_") for f in HAND_WRITTEN])
def test_hand_written_styles_are_rewritten(fn):
    (node,) = _check_same(fn, *_qkv(B=B, H=H, S=S, D=D))
    assert node.kwargs["is_causal"] is (fn in CAUSAL)
    assert node.kwargs["attn_mask"] is None


def _keep_rows(b, s):
    """(B, S) bool padding keep-mask; every row keeps key 0, so no query row is fully masked."""
    keep = torch.rand(b, s) > 0.4
    keep[:, 0] = True
    return keep


def _llama_mask(b, s, s_max):
    keep = _keep_rows(b, s_max)[:, None, None, :] & torch.ones(s, s_max, dtype=torch.bool).tril()
    return torch.zeros(b, 1, s, s_max).masked_fill(~keep, torch.finfo(torch.float32).min)


MASKED = [
    (_baddbmm_padding_bias, lambda: (torch.zeros(B, 1, S).masked_fill(~_keep_rows(B, S)[:, None], -1e9),)),
    (_mask_eq0_runtime, lambda: (_keep_rows(B, S)[:, None, None, :].long(),)),
    (_mask_not_bool_finfo_min, lambda: (_keep_rows(B, S)[:, None, None, :] & _causal_keep(S),)),
    (_mask_bert_extended, lambda: (_keep_rows(B, S).long(),)),
    (_mask_llama_4d_sliced, lambda: (_llama_mask(B, S, S + 3),)),
    (_mask_bool_sdpa_style_and_scale_on_k, lambda: (torch.rand(B, 1, S, S) > 0.5) | _causal_keep(S)),
]


@pytest.mark.parametrize("fn, extra", MASKED, ids=[f.__name__.strip("_") for f, _ in MASKED])
def test_runtime_masks_are_passed_to_the_op(fn, extra):
    extra = extra()
    extra = extra if isinstance(extra, tuple) else (extra,)
    (node,) = _check_same(fn, *_qkv(B=B, H=H, S=S, D=D), *extra)
    assert node.kwargs["attn_mask"] is not None


@pytest.mark.parametrize("fn", [_mask_llama_4d_sliced, _k_bshd_permuted_to_kt, _softmax_row_max_subtracted])
def test_styles_under_dynamic_shapes_and_fullgraph(fn):
    compiled = None
    for s in (7, 13):
        extra = (_llama_mask(B, s, s + 3),) if fn is _mask_llama_4d_sliced else ()
        args = (*_qkv(B=B, H=H, S=s, D=16), *extra)
        if compiled is None:
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(fn, backend=rewrite_only_backend, dynamic=True, fullgraph=True)
        torch.testing.assert_close(compiled(*args), fn(*args), **TOL)
    assert _rewrites() == (1, 0)
    assert counters["stats"]["unique_graphs"] == 1


def test_inference_under_no_grad():
    q, k, v = _qkv(B=B, H=H, S=13, D=16)
    with torch.no_grad():
        for fn in (_k_bshd_permuted_to_kt, _mask_where_full_like, _bmm_from_bshd):
            out, _ = _run_rewritten(fn, q, k, v)
            assert _rewrites() == (1, 0), fn.__name__
            torch.testing.assert_close(out, fn(q, k, v), **TOL)


# --------------------------------------------------------------------------------------------------------
# Modules: whole attention layers in the styles of well-known code bases
# --------------------------------------------------------------------------------------------------------


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class LlamaStyleAttention(nn.Module):
    """Llama / Mistral: q/k/v projections, rotary embeddings, GQA by repeat_kv or repeat_interleave, an
    additive causal + padding mask, fp32 softmax cast back, functional dropout, heads merged back."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, dropout=0.0, gqa="repeat_kv"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.gqa, self.attention_dropout = gqa, dropout
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        n_rep = self.heads // self.kv_heads
        if self.gqa == "repeat_kv":
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        else:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        w = w + mask[:, :, :, : k.shape[-2]]
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = nn.functional.dropout(w, p=0.0 if not self.training else self.attention_dropout,
                                  training=self.training)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(b, s, -1))


class TimmStyleAttention(nn.Module):
    """timm's ViT Attention: one qkv projection unbound into heads, q scaled first, attn_drop module."""

    def __init__(self, dim=48, heads=3, attn_drop=0.0):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        attn = self.attn_drop(attn)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class AnnotatedStyleAttention(nn.Module):
    """The Annotated Transformer's attention(): masked_fill(mask == 0, -1e9), nn.Dropout; store_probs keeps
    the probabilities on the module as the original does (self.attn), which forbids the rewrite."""

    def __init__(self, d_model=32, h=4, store_probs=False):
        super().__init__()
        self.h, self.d_k, self.store_probs = h, d_model // h, store_probs
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.dropout = nn.Dropout(p=0.0)
        self.attn = None

    def forward(self, x, mask):
        b = x.size(0)
        q, k, v = (lin(x).view(b, -1, self.h, self.d_k).transpose(1, 2) for lin in self.linears[:3])
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(mask.unsqueeze(1) == 0, -1e9)
        p_attn = self.dropout(scores.softmax(dim=-1))
        if self.store_probs:
            self.attn = p_attn
        out = torch.matmul(p_attn, v)
        return self.linears[-1](out.transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k))


class GPTStyleAttention(nn.Module):
    """A minGPT-like block: scale as an attribute, nn.Softmax module, causal tril built in forward,
    heads merged by permute + reshape."""

    def __init__(self, dim=32, heads=4, dropout=0.0):
        super().__init__()
        self.heads, self.scale = heads, 1.0 / math.sqrt(dim // heads)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).permute(0, 2, 1, 3) for y in self.c_attn(x).chunk(3, dim=-1))
        w = torch.matmul(q, k.permute(0, 1, 3, 2)) * self.scale
        w = torch.where(torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), w, float("-inf"))
        w = self.drop(self.softmax(w))
        return self.c_proj(torch.matmul(w, v).permute(0, 2, 1, 3).reshape(b, t, c))


class FalconStyleAttention(nn.Module):
    """Falcon (alibi variant) before the attention interface: `scores /= sqrt(d)` in place, an alibi bias
    viewed to (B, H, 1, S) added inside F.softmax(..., dtype=)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, alibi):
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(c, -1))
        scores = q @ k.transpose(-1, -2)
        scores /= math.sqrt(self.head_dim)
        p = F.softmax(scores + alibi.view(b, self.heads, 1, s), dim=-1, dtype=x.dtype)
        return self.dense((p @ v).transpose(1, 2).reshape(b, s, c))


class SwinV2StyleCosineAttention(nn.Module):
    """Swin V2's cosine attention: normalised q·kᵀ times a clamped, exponentiated per-head logit scale,
    plus a learned relative position bias."""

    def __init__(self, dim=48, heads=3, tokens=7):
        super().__init__()
        self.heads = heads
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads, 1, 1) + 1))
        self.bias = nn.Parameter(0.1 * torch.randn(heads, tokens, tokens))
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        attn = (attn + self.bias.unsqueeze(0)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


def _module_cases():
    x32, x48 = torch.randn(B, 13, 32), torch.randn(B, 7, 48)
    keep = _keep_rows(B, 13)[:, None, :]
    alibi = torch.randn(B * 4, 1, 13)
    return {
        "llama_repeat_kv": (LlamaStyleAttention(), (x32, _llama_mask(B, 13, 16))),
        "mistral_repeat_interleave": (
            LlamaStyleAttention(gqa="repeat_interleave"), (x32, _llama_mask(B, 13, 13))
        ),
        "timm_vit": (TimmStyleAttention(), (x48,)),
        "annotated_transformer": (AnnotatedStyleAttention(), (x32, keep.long())),
        "mingpt_nn_softmax": (GPTStyleAttention(), (x32,)),
        "falcon_alibi_inplace_div": (FalconStyleAttention(), (x32, alibi)),
        "swin_v2_logit_scale": (SwinV2StyleCosineAttention(), (x48,)),
    }


@pytest.mark.parametrize("options", [{}, {"fullgraph": True}, {"dynamic": True}], ids=["default", "fullgraph",
                                                                                          "dynamic"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(_module_cases()))
def test_attention_modules(name, training, options):
    torch.manual_seed(0)
    module, inputs = _module_cases()[name]
    tol = FACTOR_GRAD_TOL if name == "swin_v2_logit_scale" else TOL
    (node,) = _check_same(module.train(training), *inputs, options=options, tol=tol)
    if name.startswith(("llama", "mistral")):
        assert node.kwargs["enable_gqa"] is True
        assert node.args[1].meta["example_value"].shape[1] == 2  # the un-repeated k
    if name == "mingpt_nn_softmax" and options.get("dynamic"):
        # a tril of symbolic size is not evaluated at compile time: passed as a dense mask, not is_causal
        assert node.kwargs["attn_mask"] is not None
    else:
        assert node.kwargs["is_causal"] is (name == "mingpt_nn_softmax")


@pytest.mark.parametrize("name", ["llama_repeat_kv", "timm_vit", "mingpt_nn_softmax"])
def test_attention_modules_inference_no_grad(name):
    torch.manual_seed(0)
    module, inputs = _module_cases()[name]
    module.eval()
    with torch.no_grad():
        out, _ = _run_rewritten(module, *inputs, options={"fullgraph": True})
        assert _rewrites() == (1, 0)
        torch.testing.assert_close(out, module(*inputs), **TOL)


@pytest.mark.parametrize(
    "module, inputs",
    [
        (LlamaStyleAttention(dropout=0.1), lambda: (torch.randn(B, 13, 32), _llama_mask(B, 13, 13))),
        (TimmStyleAttention(attn_drop=0.1), lambda: (torch.randn(B, 7, 48),)),
        (GPTStyleAttention(dropout=0.1), lambda: (torch.randn(B, 7, 32),)),
    ],
    ids=["llama_functional", "timm_module", "mingpt_module"],
)
def test_training_dropout_reaches_the_op(module, inputs):
    _, graphs = _run_rewritten(module.train(), *inputs(), options={"fullgraph": True})
    assert _rewrites() == (1, 0)
    (node,) = _flash_nodes(graphs)
    assert node.kwargs["dropout_p"] == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------------------
# Negative cases: another function (or one not provably equal), left alone and reported
# --------------------------------------------------------------------------------------------------------


def _softmax_dim2(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=2) @ v


def _softmax_of_transposed_scores(q, k, v):
    return torch.softmax((q @ k.transpose(-2, -1)).transpose(-2, -1), dim=-1) @ v


def _k_transposed_wrong_dims(q, k, v):
    # (B, H, S, D).transpose(1, 3): (B, D, S, H), contracting over the sequence; runs since H == D == S
    return torch.softmax(q @ k.transpose(1, 3), dim=-1) @ v


def _k_bshd_permute_mixing_batch_and_heads(q, k, v):
    # (B, S, H, D).permute(2, 0, 3, 1) is (H, B, D, S): keys of another (batch, head) pair; runs as B == H
    qs, ks, vs = _bshd(q, k, v)
    return torch.softmax(qs.permute(0, 2, 1, 3) @ ks.permute(2, 0, 3, 1), -1) @ vs.permute(0, 2, 1, 3)


def _probs_used_twice(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1), -1)
    return p @ v + p @ (2 * v)


def _where_mask_enlarges_scores(q, k, v, keep):
    s = torch.where(keep, q @ k.transpose(-2, -1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _log_softmax(q, k, v):
    return torch.log_softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def _row_min_subtracted(q, k, v):
    # s - min(s) over the QUERY dim is not a per-row constant
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s - s.amin(dim=-2, keepdim=True), dim=-1) @ v


def _row_max_of_other_scores(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s - (2 * s).amax(dim=-1, keepdim=True), dim=-1) @ v


def _fill_zero(q, k, v):
    return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~_causal_keep(q.shape[-2]), 0.0), -1) @ v


def _negative_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * -0.25, -1) @ v


def _div_rounding(q, k, v):
    return torch.softmax(torch.div(q @ k.transpose(-2, -1), 0.5, rounding_mode="floor"), -1) @ v


def _scale_by_promoting_tensor(q, k, v, t):
    # fp32 scores times an fp64 factor are fp64 scores, cast back: q·t would be an fp64 q
    return torch.softmax((q @ k.transpose(-2, -1) * t).to(q.dtype), dim=-1) @ v


def _scale_after_where_mask_by_tensor(q, k, v, t):
    s = torch.where(_causal_keep(q.shape[-2]), q @ k.transpose(-2, -1), float("-inf"))
    return torch.softmax(s * t, -1) @ v


NEAR_MISSES = [
    (_softmax_dim2, (), "softmax over dim"),
    (_k_transposed_wrong_dims, (), "not its last two"),
    (_k_bshd_permute_mixing_batch_and_heads, (), "not by a swap of its last two dims"),
    (_probs_used_twice, (), "also returned or reused"),
    # a fixed mask with a kept key in every row: a fully masked row is NaN in eager and NaN != NaN
    (_where_mask_enlarges_scores, (torch.arange(24).view(3, 1, 1, 8) % 3 != 1,), "broadcasts the scores"),
    (_scale_by_tensor, (torch.rand(1, 1, 1, 8) + 0.5,), "not a compile-time constant"),  # per key
    (_scale_by_promoting_tensor, (torch.rand(8, 1, 1, dtype=torch.float64),), "not a compile-time constant"),
    (_row_min_subtracted, (), "neither a constant nor their row max"),
    (_row_max_of_other_scores, (), "neither a constant nor their row max"),
    (_div_rounding, (), "not a compile-time constant"),
    (_fill_zero, (), "not -inf or a large negative"),
    (_negative_scale, (), "not a positive finite number"),
    (_scale_after_where_mask_by_tensor, (torch.tensor(0.5),), "(sign unknown) after masking"),
]


@pytest.mark.parametrize(
    "fn, extra, reason", NEAR_MISSES, ids=[f.__name__.strip("_") for f, _, _ in NEAR_MISSES]
)
def test_other_functions_are_left_alone_and_reported(fn, extra, reason):
    q, k, v = _qkv(B=1, H=8, S=8, D=8)  # B, H, S, D alike, so that mis-laid-out operands still run
    if fn is _k_bshd_permute_mixing_batch_and_heads:
        q, k, v = _qkv(B=8, H=8, S=8, D=8)
    _assert_left_alone_and_reported(fn, (q, k, v, *extra), reason)


def _assert_left_alone_and_reported(fn, args, reason):
    """No rewrite, one attention near miss whose reason names `reason`, and eager's numbers."""
    torch._dynamo.reset()
    counters.clear()
    report = flash_backend.explain(fn, *args, print_report=False)
    assert _rewrites() == (0, 1), report
    (decision,) = [d for d in report.near_misses if d.family == "attention"]
    assert reason in decision.detail, decision.line()
    torch.testing.assert_close(torch.compile(fn, backend=rewrite_only_backend)(*args), fn(*args))


@pytest.mark.parametrize("fn", [_log_softmax, _softmax_of_transposed_scores])
def test_not_softmax_over_the_scores_key_dim_is_not_a_candidate(fn):
    # no softmax sits on the q·kᵀ scores' key dim: nothing to rewrite, nothing to report
    q, k, v = _qkv(B=B, H=H, S=S, D=D)
    report = flash_backend.explain(fn, q, k, v, print_report=False)
    assert _rewrites() == (0, 0) and not [d for d in report.decisions if d.family == "attention"]


def test_probabilities_kept_on_the_module_are_left_alone():
    module, inputs = _module_cases()["annotated_transformer"]
    module.store_probs = True
    report = flash_backend.explain(module.eval(), *inputs, print_report=False)
    assert _rewrites() == (0, 1)
    assert "also returned" in report.near_misses[0].detail


# --------------------------------------------------------------------------------------------------------
# Review (session 22): spellings that were rewritten into another function, and a few more of the same one
# --------------------------------------------------------------------------------------------------------


def _add_with_alpha_mask(q, k, v, m):
    # torch.add(s, m, alpha=-1e4) is s - 1e4·m: the 0/1 mask scaled, not m as it is
    return torch.softmax(torch.add(q @ k.transpose(-2, -1) * 0.25, m, alpha=-1e4), -1) @ v


def _add_with_alpha_scores(q, k, v, m):
    # torch.add(m, s, alpha=0.25) is m + 0.25·s: the scores scaled, not the bias
    return torch.softmax(torch.add(m, q @ k.transpose(-2, -1), alpha=0.25), -1) @ v


def _baddbmm_bias_then_scaled(q, k, v, bias):
    # a scale outside baddbmm scales its input too: (bias + q·kᵀ) / √d
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    scores = torch.baddbmm(bias, q3, k3.transpose(1, 2)) / math.sqrt(d)
    return torch.bmm(scores.softmax(-1), v3)


def _baddbmm_bias_then_tensor_scale(q, k, v, bias, t):
    b, h, s, d = q.shape
    q3, k3, v3 = (t_.reshape(b * h, s, d) for t_ in (q, k, v))
    return torch.bmm((bias.baddbmm(q3, k3.transpose(1, 2)) * t).softmax(-1), v3)


def _k_dot_T(q, k, v):
    # k.T reverses every dim of the 4-d k (runs since B == H == S == D): not kᵀ
    return torch.softmax(q @ k.T * 0.25, -1) @ v


def _v_transposed_times_probs(q, k, v):
    # vᵀ·p contracts the probabilities over the queries, not the keys
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return v.transpose(-2, -1) @ p


def _sub_mask_then_scaled(q, k, v, masked):
    # (s - 1e4·m) · 0.1 leaves -1e3 on masked keys: not masked out (not taken for any scale after a sub)
    return torch.softmax((q @ k.transpose(-2, -1) - 1e4 * masked) * 0.1, -1) @ v


def _mask_added_and_subtracted(q, k, v, m):
    # the same function as no mask at all, but not one mask node the op could take
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + m - m, -1) @ v


REVIEW_NEAR_MISSES = [
    (_add_with_alpha_mask, lambda: ((torch.rand(1, 1, 1, 8) > 0.5).float(),), "adds with alpha"),
    (_add_with_alpha_scores, lambda: (torch.randn(1, 1, 1, 8),), "adds with alpha"),
    (_baddbmm_bias_then_scaled, lambda: (torch.randn(64, 1, 8),), "scaled after an additive mask"),
    (_baddbmm_bias_then_tensor_scale, lambda: (torch.randn(64, 1, 8), torch.tensor(0.3)),
     "(sign unknown) after masking"),
    (_k_dot_T, tuple, "permuted by [3, 2, 1, 0]"),
    (_sub_mask_then_scaled, lambda: ((torch.rand(1, 1, 1, 8) > 0.5).float(),), "after a mask was subtracted"),
    (_mask_added_and_subtracted, lambda: (torch.randn(1, 1, 1, 8),), "both added to and subtracted from"),
    (_v_transposed_times_probs, tuple, "not the left operand of the ·v matmul"),
]


@pytest.mark.parametrize(
    "fn, extra, reason", REVIEW_NEAR_MISSES, ids=[f.__name__.strip("_") for f, _, _ in REVIEW_NEAR_MISSES]
)
def test_review_other_functions_are_left_alone(fn, extra, reason):
    # each was rewritten into another function before: the alpha, the outer scale of baddbmm's input, the
    # reversed dims of .T, the operand order of ·v were not read
    torch.manual_seed(0)
    q, k, v = _qkv(B=8, H=8, S=8, D=8)
    _assert_left_alone_and_reported(fn, (q, k, v, *extra()), reason)


def _baddbmm_where_mask_then_scaled(q, k, v, keep):
    # baddbmm's input is a 0 / -inf mask: still masked once scaled, so the outer scale may skip it
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    mask = torch.where(keep, 0.0, float("-inf")).repeat_interleave(h, dim=0)
    return torch.bmm((mask.baddbmm(q3, k3.transpose(1, 2)) * d**-0.5).softmax(-1), v3)


def _bmm_k_dot_T_3d(q, k, v):
    # k held as (S, D, B·H): its .T (every dim reversed) is (B·H, D, S), kᵀ of k.permute(2, 0, 1)
    b, h, s, d = q.shape
    q3, v3 = q.reshape(b * h, s, d), v.reshape(b * h, s, d)
    k3 = k.reshape(b * h, s, d).permute(1, 2, 0).contiguous()
    return torch.bmm(torch.softmax(torch.bmm(q3, k3.T) * 0.25, -1), v3)


def _kt_contiguous(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1).contiguous() * 0.25, -1) @ v


def _einsum_pv_v_first(q, k, v):
    p = torch.softmax(torch.einsum("bhid,bhjd->bhij", q, k) * 0.25, -1)
    return torch.einsum("bhjd,bhij->bhid", v, p)


def _einsum_pv_v_first_bshd(q, k, v):
    # v in (B, S, H, D) and the output too
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return torch.einsum("bjhd,bhij->bihd", *_bshd(v), p)


def _sub_mask_xlnet(q, k, v, masked):
    # XLNet: s - 1e30·m with m = 1 on masked keys, i.e. s + (-1e30·m)
    return F.softmax(q @ k.transpose(-2, -1) * 0.25 - 1e30 * masked, dim=-1) @ v


def _sub_mask_bmm_rows(q, k, v, bias):
    # a (B·H, 1, S) mask subtracted from bmm's scores, softmax on their (B, H, S, S) view
    b, h, s, d = q.shape
    scores = torch.bmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2)) * 0.25
    return (scores - bias).view(b, h, s, s).softmax(-1) @ v


def _sub_causal_constant(q, k, v):
    s = q.shape[-2]
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 - 1e30 * torch.ones(s, s).triu(1), -1) @ v


REVIEW_SAME = [
    (_baddbmm_where_mask_then_scaled, lambda: (_keep_rows(B, S)[:, None, :],)),
    (_sub_mask_xlnet, lambda: ((~_keep_rows(B, S))[:, None, None, :].float(),)),
    (_sub_mask_bmm_rows, lambda: (torch.randn(B * H, 1, S),)),
    (_bmm_k_dot_T_3d, tuple),
    (_kt_contiguous, tuple),
    (_einsum_pv_v_first, tuple),
    (_einsum_pv_v_first_bshd, tuple),
]


@pytest.mark.parametrize("fn, extra", REVIEW_SAME, ids=[f.__name__.strip("_") for f, _ in REVIEW_SAME])
def test_review_same_function_is_rewritten(fn, extra):
    torch.manual_seed(0)
    (node,) = _check_same(fn, *_qkv(B=B, H=H, S=S, D=D), *extra())
    assert node.kwargs["is_causal"] is False


def test_review_subtracted_constant_causal_mask_becomes_is_causal():
    (node,) = _check_same(_sub_causal_constant, *_qkv(B=B, H=H, S=S, D=D))
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
