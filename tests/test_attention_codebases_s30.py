"""Review (session 30) of fx_passes/attention: the attention modules of popular non-HuggingFace code bases,
written tiny and as their authors write them (litgpt, x-transformers, timm with qk_norm, timm's Swin, BEiT,
fairseq, diffusers' legacy CrossAttention, lucidrains' null key / value, MPT's ALiBi path), plus forms that
are another function (probabilities returned, softcapping, DeBERTa's q-dependent bias).

Each case runs through dynamo + the attention rewrite (test_attention_pass's helpers: the graph as plain
PyTorch, the flash op on its CPU reference) and is compared with eager, outputs and gradients, fp32.

Now recognised (left alone before): multi-query attention written with einsum, k and v without a head
subscript (x-transformers' one_kv_head, PaLM: "b h i d, b j d -> b h i j", "b h i j, b j d -> b h i d"):
k and v reach the op with one head. A broadcast the op cannot take (k shared over the batch, k with one head
but v per head) stays a near miss with its reason.
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

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

B = 2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------


def _rope(x, cos, sin):
    x1, x2 = x[..., : x.size(-1) // 2], x[..., x.size(-1) // 2:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


class LitGPTAttention(nn.Module):
    """lit-gpt's CausalSelfAttention: one qkv projection viewed to (B, T, groups, q_per_kv + 2, hs), permuted,
    split, k and v expanded for GQA, partial rotary (rope_n_elem) on q and k; SDPA with scale= and
    is_causal (mask None) or an explicit mask, or the manual soft-capping path (another function)."""

    def __init__(self, n_embd=32, n_head=4, n_query_groups=2, rope_n_elem=4, softcap=None):
        super().__init__()
        self.n_head, self.groups, self.hs = n_head, n_query_groups, n_embd // n_head
        self.rope_n_elem, self.softcap = rope_n_elem, softcap
        shape = (n_head + 2 * n_query_groups) * self.hs
        self.attn, self.proj = nn.Linear(n_embd, shape), nn.Linear(n_embd, n_embd)

    def forward(self, x, mask=None):
        B, T, C = x.size()
        q_per_kv = self.n_head // self.groups
        total_qkv = q_per_kv + 2
        qkv = self.attn(x).view(B, T, self.groups, total_qkv, self.hs)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, n_query_groups, total_qkv, T, hs)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, self.groups, q_per_kv, T, self.hs)
        v = v.expand(B, self.groups, q_per_kv, T, self.hs)
        q = q.reshape(B, -1, T, self.hs)
        k = k.reshape(B, -1, T, self.hs)
        v = v.reshape(B, -1, T, self.hs)
        n_elem = self.rope_n_elem
        theta = 1.0 / (10000 ** (torch.arange(0, n_elem, 2, device=x.device).float() / n_elem))
        idx_theta = torch.outer(torch.arange(T, device=x.device), theta).repeat(1, 2)
        cos, sin = torch.cos(idx_theta), torch.sin(idx_theta)
        q_roped = _rope(q[..., : self.rope_n_elem], cos, sin)
        k_roped = _rope(k[..., : self.rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., self.rope_n_elem:]), dim=-1)
        k = torch.cat((k_roped, k[..., self.rope_n_elem:]), dim=-1)
        scale = 1.0 / math.sqrt(self.hs)
        if self.softcap is not None:
            scores = q @ k.mT * scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            if mask is None:
                mask = torch.ones(T, T, dtype=q.dtype, device=q.device).triu(diagonal=1)
                mask.masked_fill_(mask.bool(), torch.finfo(q.dtype).min)
            scores = scores + mask
            y = F.softmax(scores, dim=-1, dtype=torch.float).to(dtype=q.dtype) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale,
                                               is_causal=mask is None)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class XTransformersAttention(nn.Module):
    """x-transformers' Attention: einsum 'b h i d, b h j d -> b h i j', * scale, a key mask and the causal
    triu(j - i + 1) filled with -finfo.max, F.softmax(dtype=float32).type(dtype), dropout, einsum back."""

    def __init__(self, dim=32, heads=4, causal=True, dropout=0.0):
        super().__init__()
        self.heads, self.causal, self.scale = heads, causal, (dim // heads) ** -0.5
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t.view(b, -1, h, t.shape[-1] // h).transpose(1, 2) for t in (self.to_q(x), self.to_k(x),
                                                                                  self.to_v(x)))
        dots = self._masked(torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale, mask)
        dtype = dots.dtype
        attn = F.softmax(dots, dim=-1, dtype=torch.float32).type(dtype)
        attn = self.dropout(attn)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

    def _masked(self, dots, mask):
        """x-transformers' key padding mask and causal mask, filled with -finfo.max."""
        mask_value = -torch.finfo(dots.dtype).max
        if mask is not None:
            dots = dots.masked_fill(~mask[:, None, None, :], mask_value)
        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=dots.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)
        return dots


class TimmAttention(nn.Module):
    """timm's vision Attention with qk_norm=True (a LayerNorm over head_dim on q and k), fused_attn off,
    an optional additive attn_mask (timm >= 1.0)."""

    def __init__(self, dim=32, num_heads=4, qk_norm=True, attn_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop, self.proj = nn.Dropout(attn_drop), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


def _relative_position_index(ws):
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    rel = (coords_flatten[:, :, None] - coords_flatten[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += ws - 1
    rel[:, :, 1] += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


class SwinWindowAttention(nn.Module):
    """timm's Swin WindowAttention: a relative position bias gathered from a learned table by a buffer
    index, added to the scores (broadcast over windows), the shifted-window mask through a 5-d view."""

    def __init__(self, dim=24, window=3, num_heads=3):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(0.5 * torch.randn((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", _relative_position_index(window), persistent=False)
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.0)
        self.softmax = nn.Softmax(dim=-1)

    def _get_rel_pos_bias(self):
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B_, N, -1)
        return self.proj(x)


class BeitAttention(nn.Module):
    """BEiT (timm): q_bias / v_bias concatenated with zeros for k into F.linear's bias, a relative position
    bias of the block and a shared one passed in, both added to the scores."""

    def __init__(self, dim=24, num_heads=3, window=3):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(dim)), nn.Parameter(torch.randn(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        n = window * window
        self.relative_position_bias_table = nn.Parameter(0.5 * torch.randn((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", _relative_position_index(window), persistent=False)
        self.n = n
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, shared_rel_pos_bias=None):
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        index = self.relative_position_index.view(-1)
        rel = self.relative_position_bias_table[index].view(self.n, self.n, -1)
        attn = attn + rel.permute(2, 0, 1).contiguous().unsqueeze(0)
        if shared_rel_pos_bias is not None:
            attn = attn + shared_rel_pos_bias
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, -1)
        return self.proj(x)


class T5StyleAttention(nn.Module):
    """Mesh-TF / T5 (non-HF reimplementations): no scaling at all, a bucketed relative position bias from
    an Embedding added in place, fp32 softmax type_as back."""

    def __init__(self, dim=32, heads=4, buckets=8):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.rel = nn.Embedding(buckets, heads)
        self.buckets = buckets

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t(x).view(b, n, self.h, self.d).transpose(1, 2) for t in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(3, 2))
        pos = torch.arange(n, device=x.device)
        half = self.buckets // 2
        rel = (pos[None, :] - pos[:, None]).clamp(-half, half - 1) + half
        position_bias = self.rel(rel).permute(2, 0, 1).unsqueeze(0)
        scores += position_bias
        attn = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn = F.dropout(attn, p=0.0, training=self.training)
        out = torch.matmul(attn, v)
        return self.o(out.transpose(1, 2).contiguous().view(b, -1, self.h * self.d))


class FairseqMHA(nn.Module):
    """fairseq's MultiheadAttention manual path in full: (T, B, C), `q *= self.scaling`, (B·H, T, D) bmm,
    `attn_weights += attn_mask.unsqueeze(0)`, the key padding mask via masked_fill on a (B, H, T, S) view,
    utils.softmax(x, dim=-1, onnx_trace=False) = F.softmax(x.float()), type_as, dropout module, and the head
    average of the probabilities returned when need_weights (which forbids the rewrite)."""

    def __init__(self, embed_dim=32, num_heads=4, dropout=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (
            nn.Linear(embed_dim, embed_dim) for _ in range(4))
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, query, key, key_padding_mask=None, attn_mask=None, need_weights=False):
        tgt_len, bsz, embed_dim = query.size()
        src_len = key.size(0)
        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(key)
        q *= self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights.float(), dim=-1)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        if need_weights:
            w = attn_weights_float.view(bsz, self.num_heads, tgt_len, src_len).transpose(1, 0)
            return attn, w.mean(dim=0)
        return attn


class DiffusersCrossAttention(nn.Module):
    """diffusers' legacy CrossAttention (AttnProcessor): head_to_batch_dim, get_attention_scores with
    baddbmm(torch.empty(...), q, kᵀ, beta=0, alpha=scale), upcast_softmax, bmm, batch_to_head_dim; the
    queries (image tokens) and keys (text context) of different lengths."""

    def __init__(self, query_dim=32, context_dim=24, heads=4, dim_head=8, upcast_softmax=True):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale, self.upcast_softmax = heads, dim_head**-0.5, upcast_softmax
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])

    def head_to_batch_dim(self, tensor):
        b, s, dim = tensor.shape
        tensor = tensor.reshape(b, s, self.heads, dim // self.heads)
        return tensor.permute(0, 2, 1, 3).reshape(b * self.heads, s, dim // self.heads)

    def batch_to_head_dim(self, tensor):
        b, s, dim = tensor.shape
        tensor = tensor.reshape(b // self.heads, self.heads, s, dim)
        return tensor.permute(0, 2, 1, 3).reshape(b // self.heads, s, dim * self.heads)

    def get_attention_scores(self, query, key, attention_mask=None):
        dtype = query.dtype
        if self.upcast_softmax:
            query, key = query.float(), key.float()
        if attention_mask is None:
            baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype,
                                        device=query.device)
            beta = 0
        else:
            baddbmm_input = attention_mask
            beta = 1
        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta,
                                         alpha=self.scale)
        if self.upcast_softmax:
            attention_scores = attention_scores.float()
        attention_probs = attention_scores.softmax(dim=-1)
        return attention_probs.to(dtype)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        query = self.head_to_batch_dim(self.to_q(hidden_states))
        key = self.head_to_batch_dim(self.to_k(encoder_hidden_states))
        value = self.head_to_batch_dim(self.to_v(encoder_hidden_states))
        probs = self.get_attention_scores(query, key, attention_mask)
        hidden_states = self.batch_to_head_dim(torch.bmm(probs, value))
        return self.to_out[1](self.to_out[0](hidden_states))


class NullKVAttention(nn.Module):
    """lucidrains' vanilla Attention with a learned null key / value: concatenated in front of k and v,
    the key mask padded with True for it, the causal mask triu(j - i + 1) (Sk = Sq + 1: bottom-right)."""

    def __init__(self, dim=32, heads=4, causal=True):
        super().__init__()
        self.heads, self.dim_head, self.causal = heads, dim // heads, causal
        self.scale = self.dim_head**-0.5
        self.null_kv = nn.Parameter(torch.randn(2, heads, 1, self.dim_head))
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q = self.to_q(x).view(b, n, h, -1).transpose(1, 2)
        k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in self.to_kv(x).chunk(2, dim=-1))
        nk, nv = (t.expand(b, -1, -1, -1) for t in self.null_kv.unbind(dim=0))
        k, v = torch.cat((nk, k), dim=-2), torch.cat((nv, v), dim=-2)
        q = q * self.scale
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        if mask is not None:
            mask = F.pad(mask, (1, 0), value=True)
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def _alibi_bias(n_heads, seq_len, alibi_bias_max=8):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.float32).view(1, 1, 1, seq_len)
    m = torch.arange(1, n_heads + 1, dtype=torch.float32) * (alibi_bias_max / n_heads)
    slopes = (1.0 / torch.pow(2, m)).view(1, n_heads, 1, 1)
    return alibi_bias * slopes


class MPTAttention(nn.Module):
    """MPT's scaled_multihead_dot_product_attention (torch path): k rearranged to (b, h, d, s) directly,
    q.matmul(k) * softmax_scale, the alibi attn_bias (a buffer) added, a causal mask built with
    new_ones(s, s, dtype=float16).tril().to(bool), inverted and sliced [-s_q:, -s_k:], filled with
    finfo.min, softmax, dropout with training=, attn_weight.to(v.dtype).matmul(v)."""

    def __init__(self, d_model=32, n_heads=4, max_seq_len=16, attn_pdrop=0.0):
        super().__init__()
        self.n_heads, self.attn_pdrop = n_heads, attn_pdrop
        self.Wqkv, self.out_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.register_buffer("attn_bias", _alibi_bias(n_heads, max_seq_len), persistent=False)

    def forward(self, x):
        b, s, c = x.shape
        query, key, value = self.Wqkv(x).chunk(3, dim=2)
        h = self.n_heads
        q = query.view(b, s, h, -1).permute(0, 2, 1, 3)  # 'b s (h d) -> b h s d'
        k = key.view(b, s, h, -1).permute(0, 2, 3, 1)  # 'b s (h d) -> b h d s'
        v = value.view(b, s, h, -1).permute(0, 2, 1, 3)
        softmax_scale = 1 / math.sqrt(q.size(-1))
        attn_weight = q.matmul(k) * softmax_scale
        s_q, s_k = attn_weight.size(-2), attn_weight.size(-1)
        attn_weight = attn_weight + self.attn_bias[:, :, :, -s_k:]
        n = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(n, n, dtype=torch.float16)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        min_val = torch.finfo(q.dtype).min
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
        attn_weight = torch.softmax(attn_weight, dim=-1)
        if self.attn_pdrop:
            attn_weight = F.dropout(attn_weight, p=self.attn_pdrop, training=self.training, inplace=True)
        out = attn_weight.to(v.dtype).matmul(v)
        return self.out_proj(out.permute(0, 2, 1, 3).reshape(b, s, c))


def _key_keep(b, n, pad=2):
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[-1, n - pad:] = False
    return keep


def _cases():
    x32 = torch.randn(B, 7, 32)
    return {
        "litgpt_gqa_expand_partial_rope_causal": (LitGPTAttention(), (x32,)),
        "x_transformers_causal_key_mask": (XTransformersAttention(), (x32, _key_keep(B, 7))),
        "timm_qk_norm": (TimmAttention(), (torch.randn(B, 9, 32),)),
        "timm_qk_norm_attn_mask": (TimmAttention(), (torch.randn(B, 9, 32), torch.randn(B, 1, 9, 9))),
        "timm_swin_window_shift_mask": (
            SwinWindowAttention(),
            (torch.randn(4, 9, 24), torch.where(torch.rand(2, 9, 9) < 0.3, -100.0, 0.0)),
        ),
        "timm_beit_shared_rel_pos": (BeitAttention(), (torch.randn(B, 9, 24), torch.randn(1, 3, 9, 9))),
        "t5_rel_bias_no_scale": (T5StyleAttention(), (x32,)),
        "fairseq_attn_mask_and_key_padding": (
            FairseqMHA(),
            (torch.randn(7, B, 32), torch.randn(5, B, 32), ~_key_keep(B, 5),
             torch.triu(torch.full((7, 5), float("-inf")), 3)),
        ),
        "diffusers_cross_attention": (
            DiffusersCrossAttention(), (torch.randn(B, 9, 32), torch.randn(B, 5, 24))
        ),
        "lucidrains_null_kv_causal_mask": (NullKVAttention(), (x32, _key_keep(B, 7))),
        "mpt_alibi_causal": (MPTAttention(), (x32,)),
    }


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(_cases()))
def test_codebase_attention_modules(name, training):
    module, inputs = _cases()[name]
    _check_same(module.train(training), *inputs)


# --------------------------------------------------------------------------------------------------------
# Multi-query attention written with einsum (x-transformers' one shared kv head, PaLM): k and v carry no
# head subscript, einsum broadcasts them over q's heads. Left alone before ("einsum 'b h i d, b j d -> b h
# i j' is not q·kᵀ with the scores' key dim last"); now k and v reach the op with one head.
# --------------------------------------------------------------------------------------------------------


class XTransformersOneKVHead(XTransformersAttention):
    """x-transformers' Attention with one_kv_head (kv_heads=1): 'b h i d, b j d -> b h i j' and
    'b h i j, b j d -> b h i d'."""

    def __init__(self, dim=32, heads=4, causal=True, dropout=0.0):
        super().__init__(dim, heads, causal, dropout)
        self.to_k, self.to_v = (nn.Linear(dim, dim // heads, bias=False) for _ in range(2))

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_k(x), self.to_v(x)
        dots = self._masked(torch.einsum("b h i d, b j d -> b h i j", q, k) * self.scale, mask)
        attn = self.dropout(F.softmax(dots, dim=-1, dtype=torch.float32).type(dots.dtype))
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_x_transformers_one_kv_head_einsum_is_multi_query(training):
    x = torch.randn(B, 7, 32)
    (node,) = _check_same(XTransformersOneKVHead().train(training), x, _key_keep(B, 7))
    k, v = (a.meta["example_value"] for a in node.args[1:3])
    assert k.shape == v.shape == (B, 1, 7, 8)


def _palm_k_first(q, k, v):
    # the operands listed the other way round, the output laid out (b, i, h, d)
    sim = torch.einsum("bjd,bhid->bhij", k, q) * 0.3
    return torch.einsum("bjd,bhij->bihd", v, sim.softmax(-1))


def test_multi_query_einsum_operands_swapped():
    q, k, v = torch.randn(B, 4, 6, 8), torch.randn(B, 6, 8), torch.randn(B, 6, 8)
    _check_same(_palm_k_first, q, k, v)


def _k_shared_v_per_head(q, k, v):
    sim = torch.einsum("bhid,bjd->bhij", q, k) * 0.3
    return torch.einsum("bhij,bhjd->bhid", sim.softmax(-1), v)


def _k_shared_over_batch(q, k, v):
    sim = torch.einsum("bhid,hjd->bhij", q, k) * 0.3
    return torch.einsum("bhij,hjd->bhid", sim.softmax(-1), v)


@pytest.mark.parametrize(
    "fn, kv_shape, reason",
    [
        (_k_shared_v_per_head, None, "do not pair up"),
        (_k_shared_over_batch, (4, 6, 8), "broadcasting batch is not taken"),
    ],
    ids=["k_one_head_v_all_heads", "k_shared_over_batch"],
)
def test_einsum_broadcast_k_the_op_cannot_take_is_left_alone(fn, kv_shape, reason):
    q = torch.randn(B, 4, 6, 8)
    k = torch.randn(kv_shape or (B, 6, 8))
    v = torch.randn(kv_shape or (B, 4, 6, 8))
    torch._dynamo.reset()
    counters.clear()
    report = flash_backend.explain(fn, q, k, v, print_report=False)
    assert _rewrites() == (0, 1), report
    assert reason in report.near_misses[0].detail
    torch.testing.assert_close(torch.compile(fn, backend=rewrite_only_backend)(q, k, v), fn(q, k, v))
