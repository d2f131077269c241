"""Review (session 34) of the attention pass on blocks of code bases no earlier review wrote, each written
tiny and as its authors write it: Stable Diffusion 3's MMDiT joint attention (diffusers' JointTransformerBlock
with JointAttnProcessor2_0: context and image tokens concatenated, qk RMSNorm), x-transformers' attention with
cosine-sim qk norm (l2norm, learned per-dim scales, a constant scale of 10, masks or-reduced and filled with
-finfo.max, rotary), the Set Transformer (MAB / ISAB / PMA / SAB: heads split into the batch by
``torch.cat(Q.split(dim_split, 2), 0)``, the residual ``Q_ + A.bmm(V_)``), Slot Attention (lucidrains': the
softmax over the slots, renormalised over the inputs; and the original's form, keys·slotsᵀ softmaxed over the
slots), Point Transformer's vector attention (no dot product), pyGAT's dense graph attention (an outer sum of
two projections, the adjacency filled by torch.where), Linformer (keys and values projected along the
sequence, one_kv_head's expand, share_kv), Informer (ProbSparse attention: the top queries gathered, the
causal mask gathered with them, the lazy queries' context by cumsum / mean; FullAttention's 'blhe,bshe->bhls'
with the scale after the fill), the Decision Transformer (its trajectory GPT-2: Conv1D, a uint8 tril buffer,
torch.where with masked_bias, the (R, s, a) tokens interleaved, left padding), RETRO (lucidrains: chunked
cross-attention with the causal shift by F.pad of negative width, null key / value, rotary; the causal
decoder attention), Nyströmformer (HF: landmarks by mean, three softmaxes, the iterative pseudo-inverse,
the depth-wise conv on v), PatchTST (residual attention: each layer's raw scores added to the next's; the
scale an nn.Parameter), lucidrains' memory-efficient attention (Rabe & Staats' chunked exp-sums: no softmax)
and Flamingo (the Perceiver resampler's 5-d attention; the gated cross-attention's media mask and the rows of
text before any image zeroed after the softmax).

Each block is compiled with the rewrite-only backend (fullgraph; the rewritten graph runs as plain PyTorch,
the flash ops on their CPU reference) and compared with eager: in training the outputs and the gradients of
every input and parameter, in eval the outputs, fp32 at 5e-5. The rewrites per family are asserted exactly,
and so are the near misses with their reasons (tests/test_codebases_review_s31.py's harness).

Findings: tests/findings/codebase_review_s34.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_codebases_review_s31 import TOL, _case, _check_block, _labels
from test_codebases_review_s32 import _dynamic_check
from test_norm_dense_ce_review_s25 import _run

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

R = torch.randn


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _keep(b, n, pad, left=False):
    """A bool keep mask with `pad` padded tokens at the end (or the start) of the second row."""
    mask = torch.ones(b, n, dtype=torch.bool)
    if left:
        mask[1, :pad] = False
    else:
        mask[1, n - pad:] = False
    return mask


# ========================================================================================================
# Stable Diffusion 3 MMDiT (diffusers: JointTransformerBlock, JointAttnProcessor2_0)
# ========================================================================================================


class DiffusersRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return (hidden_states * self.weight).to(input_dtype)


class AdaLayerNormZero(nn.Module):
    def __init__(self, embedding_dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim, bias=True)
        self.norm = nn.LayerNorm(embedding_dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class SD3JointAttention(nn.Module):
    """diffusers' Attention with qk_norm="rms_norm" and added_kv_proj_dim, JointAttnProcessor2_0 inlined: the
    image and the context projections, each normed per head, concatenated along the sequence (image first),
    one SDPA, split back by the image length."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = DiffusersRMSNorm(self.head_dim), DiffusersRMSNorm(self.head_dim)
        self.norm_added_q = DiffusersRMSNorm(self.head_dim)
        self.norm_added_k = DiffusersRMSNorm(self.head_dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states):
        residual = hidden_states
        batch_size = encoder_hidden_states.shape[0]
        query, key, value = self.to_q(hidden_states), self.to_k(hidden_states), self.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // self.heads
        query = query.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        query, key = self.norm_q(query), self.norm_k(key)
        encoder_hidden_states_query_proj = self.add_q_proj(encoder_hidden_states)
        encoder_hidden_states_key_proj = self.add_k_proj(encoder_hidden_states)
        encoder_hidden_states_value_proj = self.add_v_proj(encoder_hidden_states)
        encoder_hidden_states_query_proj = encoder_hidden_states_query_proj.view(
            batch_size, -1, self.heads, head_dim).transpose(1, 2)
        encoder_hidden_states_key_proj = encoder_hidden_states_key_proj.view(
            batch_size, -1, self.heads, head_dim).transpose(1, 2)
        encoder_hidden_states_value_proj = encoder_hidden_states_value_proj.view(
            batch_size, -1, self.heads, head_dim).transpose(1, 2)
        encoder_hidden_states_query_proj = self.norm_added_q(encoder_hidden_states_query_proj)
        encoder_hidden_states_key_proj = self.norm_added_k(encoder_hidden_states_key_proj)
        query = torch.cat([query, encoder_hidden_states_query_proj], dim=2)
        key = torch.cat([key, encoder_hidden_states_key_proj], dim=2)
        value = torch.cat([value, encoder_hidden_states_value_proj], dim=2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        hidden_states, encoder_hidden_states = (hidden_states[:, : residual.shape[1]],
                                                hidden_states[:, residual.shape[1]:])
        hidden_states = self.to_out[1](self.to_out[0](hidden_states))
        return hidden_states, self.to_add_out(encoder_hidden_states)


class SD3FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.proj, self.out = nn.Linear(dim, dim * mult), nn.Linear(dim * mult, dim)

    def forward(self, x):
        return self.out(F.gelu(self.proj(x), approximate="tanh"))


class SD3JointTransformerBlock(nn.Module):
    """JointTransformerBlock (context_pre_only=False): AdaLayerNormZero on both streams, joint attention,
    gated residuals, the affine-free norm2 modulated, a tanh-GELU feed-forward per stream."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.norm1, self.norm1_context = AdaLayerNormZero(dim), AdaLayerNormZero(dim)
        self.attn = SD3JointAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = SD3FeedForward(dim)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = SD3FeedForward(dim)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb)
        attn_output, context_attn_output = self.attn(norm_hidden_states, norm_encoder_hidden_states)
        attn_output = gate_msa.unsqueeze(1) * attn_output
        hidden_states = hidden_states + attn_output
        norm_hidden_states = self.norm2(hidden_states)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        ff_output = gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
        hidden_states = hidden_states + ff_output
        context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
        encoder_hidden_states = encoder_hidden_states + context_attn_output
        norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
        norm_encoder_hidden_states = (norm_encoder_hidden_states * (1 + c_scale_mlp[:, None])
                                      + c_shift_mlp[:, None])
        context_ff_output = self.ff_context(norm_encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
        return encoder_hidden_states, hidden_states


# ========================================================================================================
# x-transformers (lucidrains): Attention with qk_norm (cosine sim), Attend, rotary
# ========================================================================================================


def l2norm(t, groups=1):
    t = t.reshape(*t.shape[:-1], groups, -1)
    t = F.normalize(t, p=2, dim=-1)
    return t.reshape(*t.shape[:-2], -1)


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], 2, -1)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs, scale=1):
    rot_dim, seq_len = freqs.shape[-1], t.shape[-2]
    freqs = freqs[-seq_len:, :]
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    return torch.cat((t, t_unrotated), dim=-1)


class XRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len):
        t = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


class XTransformersQKNormAttention(nn.Module):
    """x-transformers' Attention(qk_norm=True, qk_norm_dim_scale=True, causal=...) with Attend's non-flash
    path: l2norm on q and k, the learned per-dim scales (heads, 1, dim_head), the constant qk_norm_scale
    (10); the key mask inverted and the causal mask or-reduced into one "masked" tensor, inverted again as
    the keep mask, `sim.masked_fill(~mask, -finfo.max)`; softmax in fp32, `.type(dtype)`; rotary on part of
    the head dims (rotary_emb_dim = dim_head // 2)."""

    def __init__(self, dim=16, heads=2, dim_head=8, causal=True, qk_norm_scale=10):
        super().__init__()
        self.heads, self.causal, self.scale = heads, causal, qk_norm_scale
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_v = nn.Linear(dim, heads * dim_head, bias=False)
        # x-transformers initialises them to ones; perturbed so that a mix-up of q's and k's would show
        self.qk_norm_q_scale = nn.Parameter(1 + 0.1 * torch.randn(heads, 1, dim_head))
        self.qk_norm_k_scale = nn.Parameter(1 + 0.1 * torch.randn(heads, 1, dim_head))
        self.rotary = XRotaryEmbedding(dim_head // 2)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x, mask=None):
        b, n, h = x.shape[0], x.shape[1], self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = (t.reshape(b, n, h, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        q, k = map(l2norm, (q, k))
        q = q * self.qk_norm_q_scale
        k = k * self.qk_norm_k_scale
        freqs = self.rotary(n)
        q, k = apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
        masks = []
        final_attn_mask = None
        if mask is not None:
            masks.append(~mask[:, None, None, :])
        if self.causal:
            i, j = n, n
            masks.append(torch.ones((i, j), device=x.device, dtype=torch.bool).triu(j - i + 1))
        if len(masks) > 0:
            final_attn_mask = ~or_reduce(masks)
        # Attend
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        if final_attn_mask is not None:
            dots = dots.masked_fill(~final_attn_mask, mask_value)
        dtype = dots.dtype
        attn = F.softmax(dots, dim=-1, dtype=torch.float32).type(dtype)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out)


class XTransformersBlock(nn.Module):
    """Pre-norm (x-transformers' default): norm, attention, residual; norm, GELU feed-forward, residual."""

    def __init__(self, dim=16, causal=True):
        super().__init__()
        self.norm1, self.norm2, self.final_norm = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = XTransformersQKNormAttention(dim, causal=causal)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask=None):
        x = self.attn(self.norm1(x), mask) + x
        x = self.ff(self.norm2(x)) + x
        return self.final_norm(x)


# ========================================================================================================
# Set Transformer (juho-lee/set_transformer, modules.py / models.py)
# ========================================================================================================


class MAB(nn.Module):
    def __init__(self, dim_Q, dim_K, dim_V, num_heads, ln=False):
        super().__init__()
        self.dim_V = dim_V
        self.num_heads = num_heads
        self.fc_q = nn.Linear(dim_Q, dim_V)
        self.fc_k = nn.Linear(dim_K, dim_V)
        self.fc_v = nn.Linear(dim_K, dim_V)
        if ln:
            self.ln0 = nn.LayerNorm(dim_V)
            self.ln1 = nn.LayerNorm(dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)

    def forward(self, Q, K):
        Q = self.fc_q(Q)
        K, V = self.fc_k(K), self.fc_v(K)
        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), 0)
        K_ = torch.cat(K.split(dim_split, 2), 0)
        V_ = torch.cat(V.split(dim_split, 2), 0)
        A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V), 2)
        O = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)  # noqa: E741
        O = O if getattr(self, "ln0", None) is None else self.ln0(O)  # noqa: E741
        O = O + F.relu(self.fc_o(O))  # noqa: E741
        O = O if getattr(self, "ln1", None) is None else self.ln1(O)  # noqa: E741
        return O


class SAB(nn.Module):
    def __init__(self, dim_in, dim_out, num_heads, ln=False):
        super().__init__()
        self.mab = MAB(dim_in, dim_in, dim_out, num_heads, ln=ln)

    def forward(self, X):
        return self.mab(X, X)


class ISAB(nn.Module):
    def __init__(self, dim_in, dim_out, num_heads, num_inds, ln=False):
        super().__init__()
        self.I = nn.Parameter(torch.Tensor(1, num_inds, dim_out))
        nn.init.xavier_uniform_(self.I)
        self.mab0 = MAB(dim_out, dim_in, dim_out, num_heads, ln=ln)
        self.mab1 = MAB(dim_in, dim_out, dim_out, num_heads, ln=ln)

    def forward(self, X):
        H = self.mab0(self.I.repeat(X.size(0), 1, 1), X)
        return self.mab1(X, H)


class PMA(nn.Module):
    def __init__(self, dim, num_heads, num_seeds, ln=False):
        super().__init__()
        self.S = nn.Parameter(torch.Tensor(1, num_seeds, dim))
        nn.init.xavier_uniform_(self.S)
        self.mab = MAB(dim, dim, dim, num_heads, ln=ln)

    def forward(self, X):
        return self.mab(self.S.repeat(X.size(0), 1, 1), X)


class SetTransformer(nn.Module):
    def __init__(self, dim_input=3, num_outputs=1, dim_output=5, num_inds=4, dim_hidden=16, num_heads=2,
                 ln=True):
        super().__init__()
        self.enc = nn.Sequential(ISAB(dim_input, dim_hidden, num_heads, num_inds, ln=ln))
        self.dec = nn.Sequential(PMA(dim_hidden, num_heads, num_outputs, ln=ln),
                                 SAB(dim_hidden, dim_hidden, num_heads, ln=ln),
                                 nn.Linear(dim_hidden, dim_output))

    def forward(self, X, y):
        logits = self.dec(self.enc(X)).squeeze(1)
        return logits, F.cross_entropy(logits, y)


# ========================================================================================================
# Slot Attention (lucidrains/slot-attention; the original's (google-research) form)
# ========================================================================================================


class SlotAttention(nn.Module):
    """lucidrains' SlotAttention: dots 'bid,bjd->bij' (slots i, inputs j), softmax over dim=1 (the SLOTS),
    + eps, renormalised over the inputs, updates 'bjd,bij->bid'; GRUCell, residual MLP. The slots' noise
    (torch.randn in forward) comes in as an argument so that compiled and eager draw the same.
    `original=True`: the original's order, logits k·slotsᵀ (inputs, slots) softmaxed over the last dim (the
    slots again), + eps, normalised over the inputs (dim -2), updates attnᵀ·v."""

    def __init__(self, num_slots=3, dim=16, iters=2, eps=1e-8, hidden_dim=16, original=False):
        super().__init__()
        self.num_slots, self.iters, self.eps, self.scale = num_slots, iters, eps, dim**-0.5
        self.original = original
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.slots_logsigma = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.xavier_uniform_(self.slots_logsigma)
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gru = nn.GRUCell(dim, dim)
        hidden_dim = max(dim, hidden_dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True),
                                 nn.Linear(hidden_dim, dim))
        self.norm_input, self.norm_slots = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.norm_pre_ff = nn.LayerNorm(dim)

    def forward(self, inputs, noise):
        b, n, d = inputs.shape
        n_s = self.num_slots
        mu = self.slots_mu.expand(b, n_s, -1)
        sigma = self.slots_logsigma.exp().expand(b, n_s, -1)
        slots = mu + sigma * noise
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        for _ in range(self.iters):
            slots_prev = slots
            slots = self.norm_slots(slots)
            q = self.to_q(slots)
            if self.original:
                attn_logits = torch.einsum("bnd,bsd->bns", k, q) * self.scale
                attn = attn_logits.softmax(dim=-1) + self.eps
                attn = attn / attn.sum(dim=-2, keepdim=True)
                updates = torch.einsum("bns,bnd->bsd", attn, v)
            else:
                dots = torch.einsum("bid,bjd->bij", q, k) * self.scale
                attn = dots.softmax(dim=1) + self.eps
                attn = attn / attn.sum(dim=-1, keepdim=True)
                updates = torch.einsum("bjd,bij->bid", v, attn)
            slots = self.gru(updates.reshape(-1, d), slots_prev.reshape(-1, d))
            slots = slots.reshape(b, -1, d)
            slots = slots + self.mlp(self.norm_pre_ff(slots))
        return slots


class SlotAttentionNoEps(SlotAttention):
    """The softmax over the slots with nothing between it and ·v (no eps, no renormalisation: some ports
    drop them): softmax(q·kᵀ, dim=1)·v is no attention over the keys, it must stay as written."""

    def forward(self, inputs, noise):
        b, n, d = inputs.shape
        slots = self.slots_mu.expand(b, self.num_slots, -1) + self.slots_logsigma.exp() * noise
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        q = self.to_q(self.norm_slots(slots))
        dots = torch.einsum("bid,bjd->bij", q, k) * self.scale
        return torch.einsum("bij,bjd->bid", dots.softmax(dim=1), v)


# ========================================================================================================
# Point Transformer (lucidrains/point-transformer-pytorch): vector attention over k nearest neighbours
# ========================================================================================================


def batched_index_select(values, indices, dim=1):
    value_dims = values.shape[(dim + 1):]
    values_shape, indices_shape = map(lambda t: list(t.shape), (values, indices))
    indices = indices[(..., *((None,) * len(value_dims)))]
    indices = indices.expand(*((-1,) * len(indices_shape)), *value_dims)
    value_expand_len = len(indices_shape) - (dim + 1)
    values = values[(*((slice(None),) * dim), *((None,) * value_expand_len), ...)]
    value_expand_shape = [-1] * len(values.shape)
    expand_slice = slice(dim, (dim + value_expand_len))
    value_expand_shape[expand_slice] = indices.shape[expand_slice]
    values = values.expand(*value_expand_shape)
    dim += value_expand_len
    return values.gather(dim, indices)


class PointTransformerLayer(nn.Module):
    def __init__(self, dim=8, pos_mlp_hidden_dim=16, attn_mlp_hidden_mult=2, num_neighbors=4):
        super().__init__()
        self.num_neighbors = num_neighbors
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.pos_mlp = nn.Sequential(nn.Linear(3, pos_mlp_hidden_dim), nn.ReLU(),
                                     nn.Linear(pos_mlp_hidden_dim, dim))
        self.attn_mlp = nn.Sequential(nn.Linear(dim, dim * attn_mlp_hidden_mult), nn.ReLU(),
                                      nn.Linear(dim * attn_mlp_hidden_mult, dim))

    def forward(self, x, pos, mask=None):
        n, num_neighbors = x.shape[1], self.num_neighbors
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        rel_pos = pos[:, :, None, :] - pos[:, None, :, :]
        rel_pos_emb = self.pos_mlp(rel_pos)
        qk_rel = q[:, :, None, :] - k[:, None, :, :]
        if mask is not None:
            mask = mask[:, :, None] * mask[:, None, :]
        v = v[:, None].expand(-1, n, -1, -1)
        if num_neighbors is not None and num_neighbors < n:
            rel_dist = rel_pos.norm(dim=-1)
            if mask is not None:
                mask_value = torch.finfo(rel_dist.dtype).max
                rel_dist.masked_fill_(~mask, mask_value)
            dist, indices = rel_dist.topk(num_neighbors, largest=False)
            v = batched_index_select(v, indices, dim=2)
            qk_rel = batched_index_select(qk_rel, indices, dim=2)
            rel_pos_emb = batched_index_select(rel_pos_emb, indices, dim=2)
            mask = batched_index_select(mask, indices, dim=2) if mask is not None else None
        v = v + rel_pos_emb
        sim = self.attn_mlp(qk_rel + rel_pos_emb)
        if mask is not None:
            mask_value = -torch.finfo(sim.dtype).max
            sim.masked_fill_(~mask[..., None], mask_value)
        attn = sim.softmax(dim=-2)
        return torch.einsum("b i j d, b i j d -> b i d", attn, v)


# ========================================================================================================
# pyGAT (Diego999/pyGAT, layers.py / models.py): dense graph attention
# ========================================================================================================


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout, alpha, concat=True):
        super().__init__()
        self.dropout, self.in_features, self.out_features = dropout, in_features, out_features
        self.alpha, self.concat = alpha, concat
        self.W = nn.Parameter(torch.empty(size=(in_features, out_features)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.empty(size=(2 * out_features, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(self.alpha)

    def forward(self, h, adj):
        Wh = torch.mm(h, self.W)
        e = self._prepare_attentional_mechanism_input(Wh)
        zero_vec = -9e15 * torch.ones_like(e)
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime

    def _prepare_attentional_mechanism_input(self, Wh):
        Wh1 = torch.matmul(Wh, self.a[:self.out_features, :])
        Wh2 = torch.matmul(Wh, self.a[self.out_features:, :])
        e = Wh1 + Wh2.T
        return self.leakyrelu(e)


class GAT(nn.Module):
    def __init__(self, nfeat=6, nhid=4, nclass=3, dropout=0.0, alpha=0.2, nheads=2):
        super().__init__()
        self.dropout = dropout
        self.attentions = [GraphAttentionLayer(nfeat, nhid, dropout=dropout, alpha=alpha, concat=True)
                           for _ in range(nheads)]
        for i, attention in enumerate(self.attentions):
            self.add_module(f"attention_{i}", attention)
        self.out_att = GraphAttentionLayer(nhid * nheads, nclass, dropout=dropout, alpha=alpha, concat=False)

    def forward(self, x, adj, labels, idx_train):
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=1)
        x = F.dropout(x, self.dropout, training=self.training)
        x = F.elu(self.out_att(x, adj))
        output = F.log_softmax(x, dim=1)
        return output, F.nll_loss(output[idx_train], labels[idx_train])


def _graph(n=7):
    adj = (torch.rand(n, n) > 0.6).float()
    adj = ((adj + adj.T + torch.eye(n)) > 0).float()  # symmetric, self loops (pyGAT's normalize_adj input)
    return R(n, 6), adj, _labels(n, classes=3), torch.arange(4)


# ========================================================================================================
# Linformer (lucidrains/linformer)
# ========================================================================================================


class LinformerSelfAttention(nn.Module):
    def __init__(self, dim, seq_len, k=4, heads=2, dim_head=None, one_kv_head=False, share_kv=False,
                 dropout=0.0):
        super().__init__()
        self.seq_len, self.k, self.heads = seq_len, k, heads
        dim_head = dim_head if dim_head is not None else dim // heads
        self.dim_head = dim_head
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        kv_dim = dim_head if one_kv_head else (dim_head * heads)
        self.to_k = nn.Linear(dim, kv_dim, bias=False)
        self.proj_k = nn.Parameter(self._init(torch.zeros(seq_len, k)))
        self.share_kv = share_kv
        if not share_kv:
            self.to_v = nn.Linear(dim, kv_dim, bias=False)
            self.proj_v = nn.Parameter(self._init(torch.zeros(seq_len, k)))
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(dim_head * heads, dim)

    @staticmethod
    def _init(tensor):
        dim = tensor.shape[-1]
        std = 1 / math.sqrt(dim)
        tensor.uniform_(-std, std)
        return tensor

    def forward(self, x, context=None):
        b, n, _, d_h, h, k = *x.shape, self.dim_head, self.heads, self.k
        kv_len = n if context is None else context.shape[1]
        queries = self.to_q(x)
        proj_seq_len = lambda args: torch.einsum("bnd,nk->bkd", *args)  # noqa: E731
        kv_input = x if context is None else context
        keys = self.to_k(kv_input)
        values = self.to_v(kv_input) if not self.share_kv else keys
        kv_projs = (self.proj_k, self.proj_v if not self.share_kv else self.proj_k)
        if kv_len < self.seq_len:
            kv_projs = map(lambda t: t[:kv_len], kv_projs)
        keys, values = map(proj_seq_len, zip((keys, values), kv_projs, strict=True))
        queries = queries.reshape(b, n, h, -1).transpose(1, 2)
        merge_key_values = lambda t: t.reshape(b, k, -1, d_h).transpose(1, 2).expand(-1, h, -1, -1)  # noqa: E731
        keys, values = map(merge_key_values, (keys, values))
        dots = torch.einsum("bhnd,bhkd->bhnk", queries, keys) * (d_h**-0.5)
        attn = dots.softmax(dim=-1)
        attn = self.dropout(attn)
        out = torch.einsum("bhnk,bhkd->bhnd", attn, values)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class LinformerBlock(nn.Module):
    """Linformer's SequentialSequence of PreNorm(attention) and PreNorm(FeedForward(GELU)) residuals."""

    def __init__(self, dim=16, seq_len=10, **kwargs):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = LinformerSelfAttention(dim, seq_len, **kwargs)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = self.attn(self.norm1(x)) + x
        return self.ff(self.norm2(x)) + x


# ========================================================================================================
# Informer (zhouhaoyi/Informer2020, models/attn.py, encoder.py, decoder.py, utils/masking.py)
# ========================================================================================================


class TriangularCausalMask:
    def __init__(self, B, L, device="cpu"):
        mask_shape = [B, 1, L, L]
        with torch.no_grad():
            self._mask = torch.triu(torch.ones(mask_shape, dtype=torch.bool), diagonal=1).to(device)

    @property
    def mask(self):
        return self._mask


class ProbMask:
    def __init__(self, B, H, L, index, scores, device="cpu"):
        _mask = torch.ones(L, scores.shape[-1], dtype=torch.bool).to(device).triu(1)
        _mask_ex = _mask[None, None, :].expand(B, H, L, scores.shape[-1])
        indicator = _mask_ex[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :].to(
            device)
        self._mask = indicator.view(scores.shape).to(device)

    @property
    def mask(self):
        return self._mask


class FullAttention(nn.Module):
    def __init__(self, mask_flag=True, factor=5, scale=None, attention_dropout=0.0, output_attention=False):
        super().__init__()
        self.scale, self.mask_flag = scale, mask_flag
        self.output_attention = output_attention
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        _, S, _, D = values.shape
        scale = self.scale or 1.0 / math.sqrt(E)
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        if self.mask_flag:
            if attn_mask is None:
                attn_mask = TriangularCausalMask(B, L, device=queries.device)
            scores.masked_fill_(attn_mask.mask, -np.inf)
        A = self.dropout(torch.softmax(scale * scores, dim=-1))
        V = torch.einsum("bhls,bshd->blhd", A, values)
        return V.contiguous(), None


class ProbAttention(nn.Module):
    """ProbSparse self-attention. Informer draws the sampled keys by torch.randint in _prob_QK on every call;
    here they are drawn once (a buffer of the same shape) so that compiled and eager sample the same keys.
    U_part / u use math.ceil(math.log(L)) where Informer writes np.ceil(np.log(L)).astype('int').item()."""

    def __init__(self, mask_flag=True, factor=1, scale=None, attention_dropout=0.0, output_attention=False,
                 max_len=16):
        super().__init__()
        self.factor, self.scale, self.mask_flag = factor, scale, mask_flag
        self.output_attention = output_attention
        self.dropout = nn.Dropout(attention_dropout)
        u = factor * math.ceil(math.log(max_len))
        self.register_buffer("index_sample", torch.randint(max_len, (max_len, u)), persistent=False)

    def _prob_QK(self, Q, K, sample_k, n_top):
        B, H, L_K, E = K.shape
        _, _, L_Q, _ = Q.shape
        K_expand = K.unsqueeze(-3).expand(B, H, L_Q, L_K, E)
        index_sample = self.index_sample[:L_Q, :sample_k] % L_K
        K_sample = K_expand[:, :, torch.arange(L_Q).unsqueeze(1), index_sample, :]
        Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)
        M = Q_K_sample.max(-1)[0] - torch.div(Q_K_sample.sum(-1), L_K)
        M_top = M.topk(n_top, sorted=False)[1]
        Q_reduce = Q[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], M_top, :]
        Q_K = torch.matmul(Q_reduce, K.transpose(-2, -1))
        return Q_K, M_top

    def _get_initial_context(self, V, L_Q):
        B, H, L_V, D = V.shape
        if not self.mask_flag:
            V_sum = V.mean(dim=-2)
            contex = V_sum.unsqueeze(-2).expand(B, H, L_Q, V_sum.shape[-1]).clone()
        else:
            assert L_Q == L_V
            contex = V.cumsum(dim=-2)
        return contex

    def _update_context(self, context_in, V, scores, index, L_Q, attn_mask):
        B, H, L_V, D = V.shape
        if self.mask_flag:
            attn_mask = ProbMask(B, H, L_Q, index, scores, device=V.device)
            scores.masked_fill_(attn_mask.mask, -np.inf)
        attn = torch.softmax(scores, dim=-1)
        context_in[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :] = torch.matmul(
            attn, V).type_as(context_in)
        return context_in, None

    def forward(self, queries, keys, values, attn_mask):
        B, L_Q, H, D = queries.shape
        _, L_K, _, _ = keys.shape
        queries = queries.transpose(2, 1)
        keys = keys.transpose(2, 1)
        values = values.transpose(2, 1)
        U_part = self.factor * math.ceil(math.log(L_K))
        u = self.factor * math.ceil(math.log(L_Q))
        U_part = U_part if U_part < L_K else L_K
        u = u if u < L_Q else L_Q
        scores_top, index = self._prob_QK(queries, keys, sample_k=U_part, n_top=u)
        scale = self.scale or 1.0 / math.sqrt(D)
        if scale is not None:
            scores_top = scores_top * scale
        context = self._get_initial_context(values, L_Q)
        context, attn = self._update_context(context, values, scores_top, index, L_Q, attn_mask)
        return context.transpose(2, 1).contiguous(), attn


class InformerAttentionLayer(nn.Module):
    def __init__(self, attention, d_model, n_heads, mix=False):
        super().__init__()
        d_keys = d_values = d_model // n_heads
        self.inner_attention = attention
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_values * n_heads)
        self.out_projection = nn.Linear(d_values * n_heads, d_model)
        self.n_heads, self.mix = n_heads, mix

    def forward(self, queries, keys, values, attn_mask):
        B, L, _ = queries.shape
        _, S, _ = keys.shape
        H = self.n_heads
        queries = self.query_projection(queries).view(B, L, H, -1)
        keys = self.key_projection(keys).view(B, S, H, -1)
        values = self.value_projection(values).view(B, S, H, -1)
        out, attn = self.inner_attention(queries, keys, values, attn_mask)
        if self.mix:
            out = out.transpose(2, 1).contiguous()
        out = out.view(B, L, -1)
        return self.out_projection(out), attn


class InformerEncoderLayer(nn.Module):
    def __init__(self, attention, d_model, d_ff=32):
        super().__init__()
        self.attention = attention
        self.conv1 = nn.Conv1d(in_channels=d_model, out_channels=d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(in_channels=d_ff, out_channels=d_model, kernel_size=1)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x, attn_mask=None):
        new_x, attn = self.attention(x, x, x, attn_mask=attn_mask)
        x = x + self.dropout(new_x)
        y = x = self.norm1(x)
        y = self.dropout(F.gelu(self.conv1(y.transpose(-1, 1))))
        y = self.dropout(self.conv2(y).transpose(-1, 1))
        return self.norm2(x + y), attn


class InformerDecoderLayer(nn.Module):
    def __init__(self, self_attention, cross_attention, d_model, d_ff=32):
        super().__init__()
        self.self_attention, self.cross_attention = self_attention, cross_attention
        self.conv1 = nn.Conv1d(in_channels=d_model, out_channels=d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(in_channels=d_ff, out_channels=d_model, kernel_size=1)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x, cross, x_mask=None, cross_mask=None):
        x = x + self.dropout(self.self_attention(x, x, x, attn_mask=x_mask)[0])
        x = self.norm1(x)
        x = x + self.dropout(self.cross_attention(x, cross, cross, attn_mask=cross_mask)[0])
        y = x = self.norm2(x)
        y = self.dropout(F.gelu(self.conv1(y.transpose(-1, 1))))
        y = self.dropout(self.conv2(y).transpose(-1, 1))
        return self.norm3(x + y)


class InformerTiny(nn.Module):
    """An encoder layer (ProbSparse, unmasked) and a decoder layer (masked ProbSparse with mix=True, then
    FullAttention cross-attention), d_model 16, 2 heads, the projection to the output."""

    def __init__(self, d_model=16, heads=2, c_out=3, full_decoder_self_attention=False):
        super().__init__()
        self.enc = InformerEncoderLayer(InformerAttentionLayer(ProbAttention(False), d_model, heads), d_model)
        self_attn = FullAttention(True) if full_decoder_self_attention else ProbAttention(True)
        self.dec = InformerDecoderLayer(InformerAttentionLayer(self_attn, d_model, heads, mix=True),
                                        InformerAttentionLayer(FullAttention(False), d_model, heads),
                                        d_model)
        self.projection = nn.Linear(d_model, c_out)

    def forward(self, x_enc, x_dec):
        enc_out, _ = self.enc(x_enc)
        return self.projection(self.dec(x_dec, enc_out))


# ========================================================================================================
# Decision Transformer (kzl/decision-transformer: decision_transformer.py, trajectory_gpt2.py)
# ========================================================================================================


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        w = torch.empty(nx, nf)
        nn.init.normal_(w, std=0.02)
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(*size_out)


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class TrajectoryGPT2Attention(nn.Module):
    def __init__(self, nx, n_ctx, n_head, scale=True):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n_ctx, n_ctx), dtype=torch.uint8)).view(
            1, 1, n_ctx, n_ctx))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.n_head, self.split_size, self.scale = n_head, nx, scale
        self.c_attn, self.c_proj = Conv1D(3 * nx, nx), Conv1D(nx, nx)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)

    def _attn(self, q, k, v, attention_mask=None):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / (float(v.size(-1)) ** 0.5)
        nd, ns = w.size(-2), w.size(-1)
        mask = self.bias[:, :, ns - nd: ns, :ns]
        w = torch.where(mask.bool(), w, self.masked_bias.to(w.dtype))
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.Softmax(dim=-1)(w)
        w = self.attn_dropout(w)
        return [torch.matmul(w, v)]

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        new_x_shape = x.size()[:-2] + (x.size(-2) * x.size(-1),)
        return x.view(*new_x_shape)

    def split_heads(self, x, k=False):
        new_x_shape = x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query, key, value = self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value)
        a = self._attn(query, key, value, attention_mask)[0]
        return self.resid_dropout(self.c_proj(self.merge_heads(a)))


class TrajectoryGPT2Block(nn.Module):
    def __init__(self, nx, n_ctx, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(nx, eps=1e-5), nn.LayerNorm(nx, eps=1e-5)
        self.attn = TrajectoryGPT2Attention(nx, n_ctx, n_head)
        self.c_fc, self.c_proj = Conv1D(4 * nx, nx), Conv1D(nx, 4 * nx)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.attn(self.ln_1(hidden_states), attention_mask) + hidden_states
        return hidden_states + self.c_proj(gelu_new(self.c_fc(self.ln_2(hidden_states))))


class DecisionTransformer(nn.Module):
    """The model's forward over its GPT2Model (wpe removed, as the DT's trajectory_gpt2 does): returns, states
    and actions embedded with the timestep, stacked and interleaved (R1, s1, a1, R2, ...), embed_ln, the
    stacked keep mask turned (1 - m) * -10000 through [:, None, None, :], blocks, ln_f, the heads on the
    state and action tokens."""

    def __init__(self, state_dim=5, act_dim=3, hidden_size=16, max_length=4, max_ep_len=20, n_head=2):
        super().__init__()
        self.state_dim, self.act_dim, self.hidden_size = state_dim, act_dim, hidden_size
        self.embed_timestep = nn.Embedding(max_ep_len, hidden_size)
        self.embed_return = nn.Linear(1, hidden_size)
        self.embed_state = nn.Linear(state_dim, hidden_size)
        self.embed_action = nn.Linear(act_dim, hidden_size)
        self.embed_ln = nn.LayerNorm(hidden_size)
        self.h = nn.ModuleList([TrajectoryGPT2Block(hidden_size, 3 * max_length, n_head)])
        self.ln_f = nn.LayerNorm(hidden_size)
        self.predict_state = nn.Linear(hidden_size, state_dim)
        self.predict_action = nn.Sequential(nn.Linear(hidden_size, act_dim), nn.Tanh())
        self.predict_return = nn.Linear(hidden_size, 1)

    def forward(self, states, actions, returns_to_go, timesteps, attention_mask):
        batch_size, seq_length = states.shape[0], states.shape[1]
        time_embeddings = self.embed_timestep(timesteps)
        state_embeddings = self.embed_state(states) + time_embeddings
        action_embeddings = self.embed_action(actions) + time_embeddings
        returns_embeddings = self.embed_return(returns_to_go) + time_embeddings
        stacked_inputs = torch.stack((returns_embeddings, state_embeddings, action_embeddings),
                                     dim=1).permute(0, 2, 1, 3).reshape(batch_size, 3 * seq_length,
                                                                        self.hidden_size)
        stacked_inputs = self.embed_ln(stacked_inputs)
        stacked_attention_mask = torch.stack((attention_mask, attention_mask, attention_mask), dim=1).permute(
            0, 2, 1).reshape(batch_size, 3 * seq_length)
        # GPT2Model.forward
        mask = stacked_attention_mask.view(batch_size, -1)[:, None, None, :].to(dtype=stacked_inputs.dtype)
        mask = (1.0 - mask) * -10000.0
        hidden_states = stacked_inputs
        for block in self.h:
            hidden_states = block(hidden_states, mask)
        x = self.ln_f(hidden_states)
        x = x.reshape(batch_size, seq_length, 3, self.hidden_size).permute(0, 2, 1, 3)
        return_preds = self.predict_return(x[:, 2])
        state_preds = self.predict_state(x[:, 2])
        action_preds = self.predict_action(x[:, 1])
        return state_preds, action_preds, return_preds


def _dt_inputs(b=2, t=4, left_pad=1):
    """DT's get_batch: trajectories left-padded with zeros, attention_mask 0 on the padded steps (long)."""
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :left_pad] = 0
    return (R(b, t, 5), R(b, t, 3), R(b, t, 1), torch.randint(0, 20, (b, t)), mask)


# ========================================================================================================
# RETRO (lucidrains/RETRO-pytorch, retro_pytorch.py)
# ========================================================================================================


class RetroRotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len, *, device, offset=0):
        seq = torch.arange(max_seq_len, device=device) + offset
        freqs = torch.einsum("i , j -> i j", seq.type_as(self.inv_freq), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[None, None]


def retro_rotate_half(x):
    x = x.reshape(*x.shape[:-1], 2, -1)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def retro_apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos()) + (retro_rotate_half(t) * freqs.sin())
    return torch.cat((t, t_pass), dim=-1)


class RetroAttention(nn.Module):
    def __init__(self, dim, *, context_dim=None, dim_head=8, heads=2, causal=False, dropout=0.0,
                 null_kv=False):
        super().__init__()
        context_dim = context_dim if context_dim is not None else dim
        self.heads, self.scale, self.causal = heads, dim_head**-0.5, causal
        inner_dim = dim_head * heads
        self.dropout = nn.Dropout(dropout)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)
        self.null_k = nn.Parameter(torch.randn(inner_dim)) if null_kv else None
        self.null_v = nn.Parameter(torch.randn(inner_dim)) if null_kv else None

    def forward(self, x, mask=None, context=None, pos_emb=None):
        b, device, h, scale = x.shape[0], x.device, self.heads, self.scale
        kv_input = context if context is not None else x
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        q = q * scale
        if pos_emb is not None:
            q_pos_emb, k_pos_emb = pos_emb if isinstance(pos_emb, tuple) else (pos_emb, pos_emb)
            q = retro_apply_rotary_pos_emb(q, q_pos_emb)
            k = retro_apply_rotary_pos_emb(k, k_pos_emb)
        if self.null_k is not None:
            nk, nv = self.null_k, self.null_v
            nk, nv = (t.reshape(h, -1)[None, :, None, :].expand(b, -1, -1, -1) for t in (nk, nv))
            k = torch.cat((nk, k), dim=-2)
            v = torch.cat((nv, v), dim=-2)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        mask_value = -torch.finfo(sim.dtype).max
        if mask is not None:
            if self.null_k is not None:
                mask = F.pad(mask, (1, 0), value=True)
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, mask_value)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones(i, j, device=device, dtype=torch.bool).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, mask_value)
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, -1, h * out.shape[-1])
        return self.to_out(out)


class ChunkedCrossAttention(nn.Module):
    def __init__(self, chunk_size, **kwargs):
        super().__init__()
        self.chunk_size = chunk_size
        self.cross_attn = RetroAttention(null_kv=True, **kwargs)

    def forward(self, x, *, context_mask=None, context, pos_emb=None):
        chunk_size = self.chunk_size
        b, n, num_chunks, num_retrieved = x.shape[0], x.shape[-2], *context.shape[-4:-2]
        if n < self.chunk_size:
            return torch.zeros_like(x)
        causal_padding = chunk_size - 1
        x = F.pad(x, (0, 0, -causal_padding, causal_padding), value=0.0)
        seq_index = (n // chunk_size) * chunk_size
        x, x_remainder = x[:, :seq_index], x[:, seq_index:]
        seq_remain_len = x_remainder.shape[-2]
        q_pos_emb, k_pos_emb = pos_emb
        q_pos_emb = F.pad(q_pos_emb, (0, 0, -causal_padding, causal_padding), value=0.0)
        k_pos_emb = k_pos_emb.repeat(1, 1, num_retrieved, 1)
        pos_emb = (q_pos_emb, k_pos_emb)
        x = x.reshape(b * num_chunks, -1, x.shape[-1])
        context = context.reshape(b * num_chunks, -1, context.shape[-1])
        if context_mask is not None:
            context_mask = context_mask.reshape(b * num_chunks, -1)
        out = self.cross_attn(x, context=context, mask=context_mask, pos_emb=pos_emb)
        out = out.reshape(b, -1, out.shape[-1])
        return F.pad(out, (0, 0, causal_padding, -causal_padding + seq_remain_len), value=0.0)


class RetroDecoderTiny(nn.Module):
    """RETRO's Decoder layer: pre-norm causal self-attention with rotary, then (the layer being a CCA layer)
    the chunked cross-attention to the retrieved neighbours' encodings (b, chunks, neighbours, chunk·2, d)
    with their mask, then the feed-forward (GELU); each a residual."""

    def __init__(self, dim=16, chunk_size=3, dim_head=8):
        super().__init__()
        self.chunk_size = chunk_size
        self.rotary_pos_emb = RetroRotaryEmbedding(dim_head)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = RetroAttention(dim, dim_head=dim_head, causal=True)
        self.cca = ChunkedCrossAttention(chunk_size, dim=dim, dim_head=dim_head)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, retrieved, context_mask):
        n, device = x.shape[1], x.device
        num_neighbor_chunk_size = retrieved.shape[-2]
        self_attn_pos_emb = self.rotary_pos_emb(n, device=device)
        cross_attn_q_pos_emb = self.rotary_pos_emb(self.chunk_size, device=device, offset=self.chunk_size - 1)
        cross_attn_k_pos_emb = self.rotary_pos_emb(num_neighbor_chunk_size, device=device)
        x = self.attn(self.norm1(x), pos_emb=self_attn_pos_emb) + x
        x = self.cca(self.norm2(x), context=retrieved, context_mask=context_mask,
                     pos_emb=(cross_attn_q_pos_emb, cross_attn_k_pos_emb)) + x
        return self.ff(self.norm3(x)) + x


def _retro_inputs(b=2, n=7, chunk=3, neighbours=2, dim=16):
    chunks = n // chunk
    mask = torch.ones(b, chunks, neighbours, 2 * chunk, dtype=torch.bool)
    mask[1, 0, 1, 3:] = False  # a neighbour shorter than its chunk + continuation
    return R(b, n, dim), R(b, chunks, neighbours, 2 * chunk, dim), mask


# ========================================================================================================
# Nyströmformer (transformers modeling_nystromformer.py)
# ========================================================================================================


class NystromformerSelfAttention(nn.Module):
    def __init__(self, hidden_size=16, num_attention_heads=2, num_landmarks=4, segment_means_seq_len=8,
                 conv_kernel_size=3, init_option="original"):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.num_landmarks, self.seq_len = num_landmarks, segment_means_seq_len
        self.conv_kernel_size, self.init_option = conv_kernel_size, init_option
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(hidden_size, self.all_head_size)
        self.value = nn.Linear(hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(0.0)
        if self.conv_kernel_size is not None:
            self.conv = nn.Conv2d(in_channels=self.num_attention_heads, out_channels=self.num_attention_heads,
                                  kernel_size=(self.conv_kernel_size, 1),
                                  padding=(self.conv_kernel_size // 2, 0), bias=False,
                                  groups=self.num_attention_heads)

    def iterative_inv(self, mat, n_iter=6):
        identity = torch.eye(mat.size(-1), device=mat.device)
        key = mat
        if self.init_option == "original":
            value = 1 / torch.max(torch.sum(key, dim=-2)) * key.transpose(-1, -2)
        else:
            value = (1 / torch.max(torch.sum(key, dim=-2), dim=-1).values[:, :, None, None]
                     * key.transpose(-1, -2))
        for _ in range(n_iter):
            key_value = torch.matmul(key, value)
            value = torch.matmul(0.25 * value, 13 * identity - torch.matmul(
                key_value, 15 * identity - torch.matmul(key_value, 7 * identity - key_value)))
        return value

    def transpose_for_scores(self, layer):
        new_layer_shape = layer.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        layer = layer.view(*new_layer_shape)
        return layer.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        mixed_query_layer = self.query(hidden_states)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(mixed_query_layer)
        query_layer = query_layer / math.sqrt(math.sqrt(self.attention_head_size))
        key_layer = key_layer / math.sqrt(math.sqrt(self.attention_head_size))
        if self.num_landmarks == self.seq_len:
            attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
            if attention_mask is not None:
                attention_scores = attention_scores + attention_mask
            attention_probs = nn.functional.softmax(attention_scores, dim=-1)
            context_layer = torch.matmul(attention_probs, value_layer)
        else:
            q_landmarks = query_layer.reshape(-1, self.num_attention_heads, self.num_landmarks,
                                              self.seq_len // self.num_landmarks,
                                              self.attention_head_size).mean(dim=-2)
            k_landmarks = key_layer.reshape(-1, self.num_attention_heads, self.num_landmarks,
                                            self.seq_len // self.num_landmarks,
                                            self.attention_head_size).mean(dim=-2)
            kernel_1 = torch.nn.functional.softmax(torch.matmul(query_layer, k_landmarks.transpose(-1, -2)),
                                                   dim=-1)
            kernel_2 = torch.nn.functional.softmax(torch.matmul(q_landmarks, k_landmarks.transpose(-1, -2)),
                                                   dim=-1)
            attention_scores = torch.matmul(q_landmarks, key_layer.transpose(-1, -2))
            if attention_mask is not None:
                attention_scores = attention_scores + attention_mask
            kernel_3 = nn.functional.softmax(attention_scores, dim=-1)
            attention_probs = torch.matmul(kernel_1, self.iterative_inv(kernel_2))
            new_value_layer = torch.matmul(kernel_3, value_layer)
            context_layer = torch.matmul(attention_probs, new_value_layer)
        if self.conv_kernel_size is not None:
            context_layer += self.conv(value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class NystromformerLayerTiny(nn.Module):
    """NystromformerLayer: self-attention, BertSelfOutput-style dense + LayerNorm(h + input), the GELU
    intermediate and the output LayerNorm; the extended mask (1 - m) * finfo.min."""

    def __init__(self, hidden_size=16, **kwargs):
        super().__init__()
        self.self = NystromformerSelfAttention(hidden_size, **kwargs)
        self.attn_dense, self.attn_norm = nn.Linear(hidden_size, hidden_size), nn.LayerNorm(hidden_size)
        self.intermediate, self.output = nn.Linear(hidden_size, 32), nn.Linear(32, hidden_size)
        self.out_norm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, keep):
        mask = keep[:, None, None, :].to(hidden_states.dtype)
        mask = (1.0 - mask) * torch.finfo(hidden_states.dtype).min
        h = self.attn_norm(self.attn_dense(self.self(hidden_states, mask)) + hidden_states)
        return self.out_norm(self.output(F.gelu(self.intermediate(h))) + h)


# ========================================================================================================
# PatchTST (yuqinie98/PatchTST, PatchTST_backbone.py, RevIN.py)
# ========================================================================================================


class RevIN(nn.Module):
    def __init__(self, num_features, eps=1e-5, affine=True):
        super().__init__()
        self.num_features, self.eps, self.affine = num_features, eps, affine
        self.affine_weight = nn.Parameter(torch.ones(self.num_features))
        self.affine_bias = nn.Parameter(torch.zeros(self.num_features))

    def forward(self, x, mode):
        if mode == "norm":
            dim2reduce = tuple(range(1, x.ndim - 1))
            self.mean = torch.mean(x, dim=dim2reduce, keepdim=True).detach()
            self.stdev = torch.sqrt(torch.var(x, dim=dim2reduce, keepdim=True, unbiased=False)
                                    + self.eps).detach()
            x = (x - self.mean) / self.stdev
            return x * self.affine_weight + self.affine_bias
        x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class _ScaledDotProductAttention(nn.Module):
    """PatchTST's attention: k comes pre-transposed (permute(0, 2, 3, 1)), the scale is an nn.Parameter
    (requires_grad=lsa: a learnable scale with lsa, a frozen one without), the previous layer's raw scores
    added (res_attention: Realformer's residual attention), and the scores returned to the next layer."""

    def __init__(self, d_model, n_heads, attn_dropout=0.0, res_attention=False, lsa=False):
        super().__init__()
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.res_attention = res_attention
        head_dim = d_model // n_heads
        self.scale = nn.Parameter(torch.tensor(head_dim**-0.5), requires_grad=lsa)
        self.lsa = lsa

    def forward(self, q, k, v, prev=None, key_padding_mask=None, attn_mask=None):
        attn_scores = torch.matmul(q, k) * self.scale
        if prev is not None:
            attn_scores = attn_scores + prev
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_scores.masked_fill_(attn_mask, -np.inf)
            else:
                attn_scores += attn_mask
        if key_padding_mask is not None:
            attn_scores.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2), -np.inf)
        attn_weights = F.softmax(attn_scores, dim=-1)
        attn_weights = self.attn_dropout(attn_weights)
        output = torch.matmul(attn_weights, v)
        if self.res_attention:
            return output, attn_weights, attn_scores
        return output, attn_weights


class _MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads, res_attention=False, lsa=False):
        super().__init__()
        d_k = d_v = d_model // n_heads
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.W_Q = nn.Linear(d_model, d_k * n_heads)
        self.W_K = nn.Linear(d_model, d_k * n_heads)
        self.W_V = nn.Linear(d_model, d_v * n_heads)
        self.res_attention = res_attention
        self.sdp_attn = _ScaledDotProductAttention(d_model, n_heads, res_attention=res_attention, lsa=lsa)
        self.to_out = nn.Sequential(nn.Linear(n_heads * d_v, d_model), nn.Dropout(0.0))

    def forward(self, Q, K=None, V=None, prev=None, key_padding_mask=None, attn_mask=None):
        bs = Q.size(0)
        K = Q if K is None else K
        V = Q if V is None else V
        q_s = self.W_Q(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        k_s = self.W_K(K).view(bs, -1, self.n_heads, self.d_k).permute(0, 2, 3, 1)
        v_s = self.W_V(V).view(bs, -1, self.n_heads, self.d_v).transpose(1, 2)
        if self.res_attention:
            output, attn_weights, attn_scores = self.sdp_attn(q_s, k_s, v_s, prev=prev,
                                                              key_padding_mask=key_padding_mask,
                                                              attn_mask=attn_mask)
        else:
            output, attn_weights = self.sdp_attn(q_s, k_s, v_s, key_padding_mask=key_padding_mask,
                                                 attn_mask=attn_mask)
        output = output.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * self.d_v)
        output = self.to_out(output)
        if self.res_attention:
            return output, attn_weights, attn_scores
        return output, attn_weights


class Transpose(nn.Module):
    def __init__(self, *dims, contiguous=False):
        super().__init__()
        self.dims, self.contiguous = dims, contiguous

    def forward(self, x):
        return x.transpose(*self.dims).contiguous() if self.contiguous else x.transpose(*self.dims)


class TSTEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff=32, norm="BatchNorm", res_attention=False, pre_norm=False,
                 lsa=False):
        super().__init__()
        self.res_attention = res_attention
        self.self_attn = _MultiheadAttention(d_model, n_heads, res_attention=res_attention, lsa=lsa)
        self.dropout_attn = nn.Dropout(0.0)
        if "batch" in norm.lower():
            self.norm_attn = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))
            self.norm_ffn = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))
        else:
            self.norm_attn, self.norm_ffn = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(0.0),
                                nn.Linear(d_ff, d_model))
        self.dropout_ffn = nn.Dropout(0.0)
        self.pre_norm = pre_norm

    def forward(self, src, prev=None, key_padding_mask=None, attn_mask=None):
        if self.pre_norm:
            src = self.norm_attn(src)
        if self.res_attention:
            src2, attn, scores = self.self_attn(src, src, src, prev, key_padding_mask=key_padding_mask,
                                                attn_mask=attn_mask)
        else:
            src2, attn = self.self_attn(src, src, src, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        src = src + self.dropout_attn(src2)
        if not self.pre_norm:
            src = self.norm_attn(src)
        if self.pre_norm:
            src = self.norm_ffn(src)
        src2 = self.ff(src)
        src = src + self.dropout_ffn(src2)
        if not self.pre_norm:
            src = self.norm_ffn(src)
        if self.res_attention:
            return src, scores
        return src


class PatchTSTTiny(nn.Module):
    """PatchTST_backbone: RevIN, ReplicationPad1d at the end, unfold into patches, W_P, the channel-
    independent (bs·nvars, patch_num, d_model) tokens + W_pos, TSTEncoder (res_attention: each layer's
    scores go to the next), the flatten head, RevIN's denorm."""

    def __init__(self, c_in=3, context_window=16, target_window=4, patch_len=4, stride=2, n_layers=2,
                 d_model=16, n_heads=2, norm="BatchNorm", res_attention=True, pre_norm=False, lsa=False):
        super().__init__()
        self.revin_layer = RevIN(c_in)
        self.patch_len, self.stride = patch_len, stride
        patch_num = int((context_window - patch_len) / stride + 1) + 1
        self.padding_patch_layer = nn.ReplicationPad1d((0, stride))
        self.W_P = nn.Linear(patch_len, d_model)
        self.W_pos = nn.Parameter(torch.empty((patch_num, d_model)).uniform_(-0.02, 0.02))
        self.dropout = nn.Dropout(0.0)
        self.res_attention = res_attention
        self.layers = nn.ModuleList([TSTEncoderLayer(d_model, n_heads, norm=norm, res_attention=res_attention,
                                                     pre_norm=pre_norm, lsa=lsa) for _ in range(n_layers)])
        self.head = nn.Sequential(nn.Flatten(start_dim=-2), nn.Linear(d_model * patch_num, target_window))

    def forward(self, z):
        z = z.permute(0, 2, 1)
        z = self.revin_layer(z, "norm")
        z = z.permute(0, 2, 1)
        z = self.padding_patch_layer(z)
        z = z.unfold(dimension=-1, size=self.patch_len, step=self.stride)
        z = z.permute(0, 1, 3, 2)
        # TSTiEncoder
        n_vars = z.shape[1]
        x = self.W_P(z.permute(0, 1, 3, 2))
        u = torch.reshape(x, (x.shape[0] * x.shape[1], x.shape[2], x.shape[3]))
        output = self.dropout(u + self.W_pos)
        scores = None
        for mod in self.layers:
            if self.res_attention:
                output, scores = mod(output, prev=scores)
            else:
                output = mod(output)
        z = torch.reshape(output, (-1, n_vars, output.shape[-2], output.shape[-1])).permute(0, 1, 3, 2)
        z = self.head(z)
        z = z.permute(0, 2, 1)
        z = self.revin_layer(z, "denorm")
        return z.permute(0, 2, 1)


# ========================================================================================================
# memory-efficient-attention-pytorch (lucidrains): the chunked softmax of Rabe & Staats
# ========================================================================================================


def lucidrains_attention(q, k, v, mask=None, causal=False):
    scale = q.shape[-1] ** -0.5
    q = q * scale
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
    mask_value = -torch.finfo(sim.dtype).max
    if mask is not None:
        sim = sim.masked_fill(~mask[:, None, None, :], mask_value)
    if causal:
        i, j = sim.shape[-2:]
        sim = sim.masked_fill(torch.ones(i, j, device=q.device, dtype=torch.bool).triu(j - i + 1), mask_value)
    sim = sim - sim.amax(dim=-1, keepdim=True).detach()
    attn = sim.softmax(dim=-1)
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def summarize_qkv_chunk(q, k, v, mask, causal, qk_start_indices):
    q_start_index, k_start_index, q_chunk_size, k_chunk_size = *qk_start_indices, q.shape[-2], k.shape[-2]
    weight = torch.einsum("b h i d, b h j d -> b h i j", q, k)
    mask_value = -torch.finfo(weight.dtype).max
    if mask is not None:
        weight = weight.masked_fill(~mask[:, None, None, :], mask_value)
    if causal and q_start_index < (k_start_index + k_chunk_size - 1):
        causal_mask = torch.ones((q_chunk_size, k_chunk_size), dtype=torch.bool, device=q.device).triu(
            q_start_index - k_start_index + 1)
        weight = weight.masked_fill(causal_mask, mask_value)
    weight_max = weight.amax(dim=-1, keepdim=True).detach()
    weight = weight - weight_max
    exp_weight = weight.exp()
    weighted_value = torch.einsum("b h i j, b h j d -> b h i d", exp_weight, v)
    return exp_weight.sum(dim=-1), weighted_value, weight_max.squeeze(-1)


def memory_efficient_attention(q, k, v, mask=None, causal=False, q_bucket_size=4, k_bucket_size=4, eps=1e-8):
    """As the library writes it but for the checkpoint of each chunk's summary (torch.utils.checkpoint when
    any input requires grad: left out here, it hides the chunk from the passes in a higher-order op)."""
    scale = q.shape[-1] ** -0.5
    q = q * scale
    q_chunks = q.split(q_bucket_size, dim=-2)
    k_chunks = k.split(k_bucket_size, dim=-2)
    v_chunks = v.split(k_bucket_size, dim=-2)
    mask_chunks = mask.split(k_bucket_size, dim=-1) if mask is not None else ((None,) * len(k_chunks))
    out = []
    for q_index, q_chunk in enumerate(q_chunks):
        exp_weights, weighted_values, weight_maxes = [], [], []
        chunks = zip(k_chunks, v_chunks, mask_chunks, strict=True)
        for k_index, (k_chunk, v_chunk, mask_chunk) in enumerate(chunks):
            q_start_index, k_start_index = q_index * q_bucket_size, k_index * k_bucket_size
            if causal and k_start_index > (q_start_index + q_chunk.shape[-2] - 1):
                continue
            exp_weight_chunk, weighted_value_chunk, weight_max_chunk = summarize_qkv_chunk(
                q_chunk, k_chunk, v_chunk, mask_chunk, causal, (q_start_index, k_start_index))
            exp_weights.append(exp_weight_chunk)
            weighted_values.append(weighted_value_chunk)
            weight_maxes.append(weight_max_chunk)
        weight_maxes = torch.stack(weight_maxes, dim=-1)
        weighted_values = torch.stack(weighted_values, dim=-1)
        exp_weights = torch.stack(exp_weights, dim=-1)
        global_max = weight_maxes.amax(dim=-1, keepdim=True)
        renorm_factor = (weight_maxes - global_max).exp().detach()
        exp_weights = exp_weights * renorm_factor
        weighted_values = weighted_values * renorm_factor[..., None, :]
        all_values = weighted_values.sum(dim=-1)
        all_weights = exp_weights.sum(dim=-1)
        out.append(all_values / (all_weights[..., None] + eps))
    return torch.cat(out, dim=-2)


class MemoryEfficientAttention(nn.Module):
    def __init__(self, dim=16, heads=2, dim_head=8, causal=False, memory_efficient=True, q_bucket_size=4,
                 k_bucket_size=4):
        super().__init__()
        self.heads, self.causal, self.memory_efficient = heads, causal, memory_efficient
        self.q_bucket_size, self.k_bucket_size = q_bucket_size, k_bucket_size
        inner_dim = heads * dim_head
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, mask=None):
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        if self.memory_efficient:
            out = memory_efficient_attention(q, k, v, mask=mask, causal=self.causal,
                                             q_bucket_size=self.q_bucket_size,
                                             k_bucket_size=self.k_bucket_size)
        else:
            out = lucidrains_attention(q, k, v, mask=mask, causal=self.causal)
        return self.to_out(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


# ========================================================================================================
# Flamingo (lucidrains/flamingo-pytorch, flamingo_pytorch.py)
# ========================================================================================================


def FlamingoFeedForward(dim, mult=2):
    inner_dim = int(dim * mult)
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, inner_dim, bias=False), nn.GELU(),
                         nn.Linear(inner_dim, dim, bias=False))


class PerceiverAttention(nn.Module):
    """The resampler's attention: the latents' queries over the media and the latents concatenated, 5-d
    'b h t n d' (one more batch dim: the media time), q scaled, the row max subtracted (detached)."""

    def __init__(self, *, dim, dim_head=8, heads=2):
        super().__init__()
        self.scale, self.heads = dim_head**-0.5, heads
        inner_dim = dim_head * heads
        self.norm_media, self.norm_latents = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, latents):
        x = self.norm_media(x)
        latents = self.norm_latents(latents)
        h = self.heads
        q = self.to_q(latents)
        kv_input = torch.cat((x, latents), dim=-2)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        q, k, v = (t.reshape(*t.shape[:3], h, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v))
        q = q * self.scale
        sim = torch.einsum("... i d, ... j d  -> ... i j", q, k)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum("... i j, ... j d -> ... i d", attn, v)
        out = out.permute(0, 2, 3, 1, 4).reshape(*out.shape[:1], out.shape[2], out.shape[3], -1)
        return self.to_out(out)


class PerceiverResampler(nn.Module):
    def __init__(self, *, dim=16, depth=1, dim_head=8, heads=2, num_latents=3, num_media_embeds=4):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, dim))
        self.media_pos_emb = nn.Parameter(torch.randn(num_media_embeds, 1, dim))
        self.layers = nn.ModuleList([
            nn.ModuleList([PerceiverAttention(dim=dim, dim_head=dim_head, heads=heads),
                           FlamingoFeedForward(dim)])
            for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        if x.ndim == 3:
            x = x[:, None]
        times = x.shape[1]
        x = x + self.media_pos_emb[:times]
        latents = self.latents[None, None].expand(x.shape[0], x.shape[1], -1, -1)
        for attn, ff in self.layers:
            latents = attn(x, latents) + latents
            latents = ff(latents) + latents
        return self.norm(latents)


class MaskedCrossAttention(nn.Module):
    """Text attends to the media's latents: text_time = media_locations.cumsum(-1); only the latest media
    (torch.eq) or every earlier one (torch.ge) is visible, the rest filled with -finfo.max; the row max
    subtracted; with only_attend_immediate_media the rows of text before any media zeroed after the softmax
    by a row mask of their own (text_time == 0)."""

    def __init__(self, *, dim, dim_head=8, heads=2, only_attend_immediate_media=True):
        super().__init__()
        self.scale, self.heads = dim_head**-0.5, heads
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        self.only_attend_immediate_media = only_attend_immediate_media

    def forward(self, x, media, media_locations=None):
        b, t, m = media.shape[:3]
        h = self.heads
        x = self.norm(x)
        q = self.to_q(x)
        media = media.reshape(b, t * m, -1)
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = (u.reshape(u.shape[0], u.shape[1], h, -1).transpose(1, 2) for u in (q, k, v))
        q = q * self.scale
        sim = torch.einsum("... i d, ... j d -> ... i j", q, k)
        if media_locations is not None:
            text_time = media_locations.cumsum(dim=-1)
            media_time = torch.arange(t, device=x.device) + 1
            mask_op = torch.eq if self.only_attend_immediate_media else torch.ge
            text_to_media_mask = mask_op(text_time[:, None, :, None],
                                         media_time.repeat_interleave(m)[None, None, None, :])
            sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        if media_locations is not None and self.only_attend_immediate_media:
            text_without_media_mask = text_time == 0
            text_without_media_mask = text_without_media_mask[:, None, :, None]
            attn = attn.masked_fill(text_without_media_mask, 0.0)
        out = torch.einsum("... i j, ... j d -> ... i d", attn, v)
        out = out.transpose(1, 2).reshape(b, -1, h * out.shape[-1])
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, *, dim, dim_head=8, heads=2, only_attend_immediate_media=True):
        super().__init__()
        self.attn = MaskedCrossAttention(dim=dim, dim_head=dim_head, heads=heads,
                                         only_attend_immediate_media=only_attend_immediate_media)
        self.attn_gate = nn.Parameter(torch.tensor([0.0]))
        self.ff = FlamingoFeedForward(dim)
        self.ff_gate = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x, media, media_locations=None):
        x = self.attn(x, media, media_locations=media_locations) * self.attn_gate.tanh() + x
        return self.ff(x) * self.ff_gate.tanh() + x


class FlamingoTiny(nn.Module):
    """The resampler over the images' features, then a gated cross-attention block on the text (the gates
    set to 0.5: at Flamingo's 0 no gradient reaches the attention)."""

    def __init__(self, dim=16, only_attend_immediate_media=True):
        super().__init__()
        self.resampler = PerceiverResampler(dim=dim)
        self.xattn = GatedCrossAttentionBlock(dim=dim,
                                              only_attend_immediate_media=only_attend_immediate_media)
        with torch.no_grad():
            self.xattn.attn_gate.fill_(0.5)
            self.xattn.ff_gate.fill_(0.5)

    def forward(self, text, images, media_locations):
        return self.xattn(text, self.resampler(images), media_locations)


def _flamingo_inputs(b=2, n=7, t=2, patches=5, dim=16):
    media_locations = torch.zeros(b, n, dtype=torch.bool)
    media_locations[0, [0, 4]] = True
    media_locations[1, [2, 5]] = True  # the second sample's first two tokens come before any image
    return R(b, n, dim), R(b, t, patches, dim), media_locations


# ========================================================================================================
# The table
# ========================================================================================================


# name: (model and inputs, rewrites per family (the others 0), near misses (family, words of the reason),
# words the report must hold). Every count was checked by reading the module.
CASES = {
    # one SDPA over the image and context tokens concatenated (q / k RMSNorm'd per head first); norms: the
    # two AdaLayerNormZero's, the 4 per-head RMSNorms, norm2 / norm2_context with the gated sums; 2 tanh GELUs
    "sd3_mmdit_joint_block": _case(
        lambda: (SD3JointTransformerBlock(), (R(2, 9, 16), R(2, 5, 16), R(2, 16))),
        dict(attention=1, norm=8, dense=2), words=["scaled_dot_product_attention"]),
    # cosine-sim attention: l2norm'd q / k times learned per-dim scales, the constant scale 10; the or-reduced
    # key + causal masks filled with -finfo.max; rotary on half the head dims; norm1, norm2 and the final
    # one with the sums; the GELU feed-forward
    "x_transformers_qk_norm_causal_key_mask": _case(
        lambda: (XTransformersBlock(), (R(2, 7, 16), _keep(2, 7, 2))), dict(attention=1, norm=3, dense=1),
        words=["scale=10, causal, mask [2, 1, 1, 7]"]),
    "x_transformers_qk_norm_left_padded": _case(
        lambda: (XTransformersBlock(causal=False), (R(2, 7, 16), _keep(2, 7, 2, left=True))),
        dict(attention=1, norm=3, dense=1)),
    # MAB: heads into the batch by cat(split), softmax(bmm / sqrt(dim_V), 2), the residual Q_ + A·V_: 4
    # (ISAB's two, PMA, SAB); ln0 (of the residual sum, split / cat between: plain) and ln1 with the ReLU
    # sum, per MAB; the loss reads logits.squeeze(1): reported
    "set_transformer_isab_pma_sab": _case(
        lambda: (SetTransformer(), (R(2, 7, 3), _labels(2))), dict(attention=4, norm=8),
        (("cross_entropy", "the logits pass through squeeze"),), words=["flash_attention(scale=0.25)"]),
    # the softmax over the slots (dim 1), per iteration: no attention over the keys; norm_input, and per
    # iteration norm_slots / norm_pre_ff
    "slot_attention": _case(lambda: (SlotAttention(), (R(2, 9, 16), R(2, 3, 16))), dict(norm=5),
                            (("attention", "softmax over dim 1 of the 3-d scores"),) * 2),
    # keys·slotsᵀ softmaxed over the slots, + eps: no ·v of the probabilities
    "slot_attention_original_order": _case(
        lambda: (SlotAttention(original=True), (R(2, 9, 16), R(2, 3, 16))), dict(norm=5),
        (("attention", "(add), not to a matmul with v"),) * 2),
    # softmax(q·kᵀ, dim=1)·v straight: refused by its dim
    "slot_attention_no_eps": _case(lambda: (SlotAttentionNoEps(), (R(2, 9, 16), R(2, 3, 16))), dict(norm=2),
                                   (("attention", "softmax over dim 1 of the 3-d scores"),)),
    # vector attention: an MLP of q_i - k_j + pos, softmax over the neighbours (dim -2), a weighted sum: no
    # dot product, no candidate
    "point_transformer_vector_attention": _case(
        lambda: (PointTransformerLayer(), (R(2, 7, 8), R(2, 7, 3))), {}),
    "point_transformer_masked": _case(
        lambda: (PointTransformerLayer(), (R(2, 7, 8), R(2, 7, 3), _keep(2, 7, 2))), {}),
    # e = leakyrelu(Wh·a1 + (Wh·a2)ᵀ): no q·kᵀ, no candidate; nll_loss of log_softmax rows indexed: reported
    "gat_dense": _case(lambda: (GAT(), _graph()), {},
                       (("cross_entropy", "the log-probabilities pass through getitem"),)),
    # keys / values projected along the sequence ('bnd,nk->bkd'); norm1, norm2 with the sum; GELU
    "linformer": _case(lambda: (LinformerBlock(), (R(2, 10, 16),)), dict(attention=1, norm=2, dense=1)),
    # one kv head expanded to the heads (un-repeated: gqa), keys = values, the projections sliced to
    # n < seq_len
    "linformer_one_kv_head_share_kv_short": _case(
        lambda: (LinformerBlock(one_kv_head=True, share_kv=True), (R(2, 8, 16),)),
        dict(attention=1, norm=2, dense=1), words=["gqa"]),
    # ProbSparse: the top queries gathered, their rows of triu(1) gathered as the mask (decoder), the
    # context by index_put into the cumsum / mean; FullAttention cross-attention (scale after the fill);
    # norms: 2 (encoder) + 3 (decoder) with the sums
    "informer_probsparse": _case(lambda: (InformerTiny(), (R(2, 12, 16), R(2, 12, 16))),
                                 dict(attention=3, norm=5), words=["mask [2, 2, 3, 12]"]),
    # FullAttention(mask_flag=True) in the decoder: TriangularCausalMask filled in place, then * scale
    "informer_full_attention_decoder": _case(
        lambda: (InformerTiny(full_decoder_self_attention=True), (R(2, 12, 16), R(2, 12, 16))),
        dict(attention=3, norm=5), words=["causal"]),
    # torch.where(bias.bool(), w, self.masked_bias.to(w.dtype)): the fill is a buffer, a graph input whose
    # value is not read (finding M2); embed_ln, ln_1, ln_2 with the sum, ln_f with the last sum; gelu_new
    "decision_transformer": _case(
        lambda: (DecisionTransformer(), _dt_inputs(left_pad=1)), dict(norm=4, dense=1),
        (("attention", "read from the graph input"),)),
    # causal self-attention with rotary; CCA: chunks of the shifted sequence over their neighbours (null key
    # first, mask padded with True); norm1..3 (2 with sums), GELU
    "retro_decoder_cca": _case(lambda: (RetroDecoderTiny(), _retro_inputs()),
                               dict(attention=2, norm=3, dense=1), words=["mask [4, 1, 1, 13]"]),
    # res_attention: layer 1's scores are read by layer 2 (refused: another user); layer 2's s + prev is
    # rewritten with prev as its mask (finding M1, FIXED); BatchNorm (no candidate); 2 GELUs
    "patchtst": _case(lambda: (PatchTSTTiny(), (R(2, 3, 16),)), dict(attention=1, dense=2),
                      (("attention", "intermediate 'attn_scores' has other users"),),
                      words=["mask [6, 2, 8, 8]"]),
    # lsa: the scale a learnable nn.Parameter (put on q); LayerNorm pre-norm (norm_attn, norm_ffn per layer)
    "patchtst_lsa_layernorm_pre_norm": _case(
        lambda: (PatchTSTTiny(norm="LayerNorm", pre_norm=True, lsa=True), (R(2, 3, 16),)),
        dict(attention=1, norm=4, dense=2), (("attention", "intermediate 'attn_scores' has other users"),),
        words=["(on q)"]),
    "patchtst_no_res_attention": _case(lambda: (PatchTSTTiny(res_attention=False), (R(2, 3, 16),)),
                                       dict(attention=2, dense=2)),
    # Rabe & Staats' chunks: exp(s - max)·v summed over key chunks, divided by the summed exps + eps: no
    # softmax, no candidate (one key chunk included)
    "memory_efficient_attention_chunked": _case(
        lambda: (MemoryEfficientAttention(), (R(2, 10, 16), _keep(2, 10, 3))), {}),
    "memory_efficient_attention_causal_one_key_chunk": _case(
        lambda: (MemoryEfficientAttention(causal=True, k_bucket_size=16), (R(2, 10, 16), _keep(2, 10, 3))),
        {}),
    "memory_efficient_attention_plain": _case(
        lambda: (MemoryEfficientAttention(causal=True, memory_efficient=False),
                 (R(2, 10, 16), _keep(2, 10, 3))),
        dict(attention=1), words=["causal, mask [2, 1, 1, 10]"]),
    # HF's default init: kernel_3·v (the landmarks over the keys, the padding mask) is attention; kernel_1·
    # pinv(kernel_2) too, but for 4 landmarks its "v" is 4 wide; kernel_2 feeds the iterative inverse;
    # attn_norm / out_norm with the sums, the GELU intermediate
    "nystromformer": _case(lambda: (NystromformerLayerTiny(), (R(2, 8, 16), _keep(2, 8, 2))),
                           dict(attention=1, norm=2, dense=1),
                           (("attention", "head_dim of v is 4"),
                            ("attention", "'kernel_2' are also returned"))),
    # 8 landmarks: kernel_1·pinv(kernel_2) is attention with v = the pseudo-inverse (grads through it)
    "nystromformer_landmarks_8": _case(
        lambda: (NystromformerLayerTiny(num_landmarks=8, segment_means_seq_len=16),
                 (R(2, 16, 16), _keep(2, 16, 3))),
        dict(attention=2, norm=2, dense=1), (("attention", "'kernel_2' are also returned"),)),
    # landmarks == seq_len: plain attention, the depth-wise conv of v added in place to its output
    "nystromformer_landmarks_eq_seq_len": _case(
        lambda: (NystromformerLayerTiny(num_landmarks=8, segment_means_seq_len=8),
                 (R(2, 8, 16), _keep(2, 8, 3))),
        dict(attention=1, norm=2, dense=1)),
    # the resampler's 5-d attention (b h t n d) over media + latents; the cross-attention's text-to-media
    # mask (eq) and the rows of text before any image zeroed after the softmax: moved after the op (finding
    # M3, FIXED). Norms: media / latents (plain), the FF's with the sums, the final one, the xattn's
    "flamingo_immediate_media": _case(lambda: (FlamingoTiny(), _flamingo_inputs()),
                                      dict(attention=2, norm=6, dense=2),
                                      words=["rows zeroed after the softmax: the output's rows zeroed"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_codebase_block(name):
    make, rewrites, near_misses, words = CASES[name]
    model, args = make()
    report = _check_block(model, args, rewrites, near_misses)
    for w in words:
        assert w in str(report), str(report)


# ========================================================================================================
# Beyond the table
# ========================================================================================================


def _flamingo_ge(train):
    model = FlamingoTiny(only_attend_immediate_media=False).train(train)
    args = _flamingo_inputs()
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), args, train)
    return got, _run(model, args, train), report


def test_flamingo_all_previous_media_text_before_any_image_matches_eager():
    """W1 (tests/findings/codebase_review_s31.md, fixed): only_attend_immediate_media=False: text before the
    first image sees no media (every key filled with -finfo.max) and nothing zeroes it after the softmax;
    eager gives those tokens the average of the media's values, and so does the op now (it gave 0)."""
    got, want, report = _flamingo_ge(False)
    assert "a row with every key masked given the mean of v as in eager" in str(report), str(report)
    torch.testing.assert_close(got[0], want[0], **TOL)


def test_flamingo_all_previous_media_every_token_and_gradient():
    """The same block in training and eval: every token is eager's, the two of W1 (the second sample's text
    before its first image) included, and so are the gradients (_run's)."""
    for train in (True, False):
        got, want, report = _flamingo_ge(train)
        assert counters["flash"]["attention"] == 2, str(report)
        assert len(got) == len(want) > (2 if train else 0)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **TOL)


def test_set_transformer_under_dynamic_shapes():
    """The set size varies (ISAB's inducing points and PMA's seeds do not)."""
    model = SetTransformer()
    report = _dynamic_check(model, [(R(2, n, 3), _labels(2)) for n in (7, 9, 12)], True)
    assert counters["flash"]["attention"] == 4, str(report)


def test_flamingo_row_zeroing_under_dynamic_shapes():
    """The text length varies: the row mask (text_time == 0) is symbolic in Sq."""
    report = _dynamic_check(FlamingoTiny(), [_flamingo_inputs(n=n) for n in (7, 9, 11)], True)
    assert counters["flash"]["attention"] == 2 and "rows zeroed" in str(report), str(report)


# ========================================================================================================
# The fixes' edges: residual scores (M1), rows zeroed after the softmax (M3)
# ========================================================================================================


class _TwoScores(nn.Module):
    """softmax(a + b)·v with a and b two q·kᵀ products: `shared` makes b also the scores of a second,
    independent softmax·v (b read elsewhere, as PatchTST's prev is); `own` adds the attention's own scores
    to a multiple of them (s·2 + s: the scores read twice)."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, q2, k2):
        a = q @ k.transpose(-2, -1) * 0.25
        if self.form == "own":
            return torch.softmax(a * 2 + a, dim=-1) @ v
        b = q2 @ k2.transpose(-2, -1)
        if self.form == "shared":
            return torch.softmax(a + b, dim=-1) @ v, torch.softmax(b, dim=-1) @ v
        return torch.softmax(a + b, dim=-1) @ v  # "both single": no way to tell


@pytest.mark.parametrize("form, rewrites, reason", [
    ("shared", 1, "intermediate 'b' has other users"),
    ("both_single", 0, "cannot tell the scores from the mask"),
    ("own", 0, "has other users"),
])
def test_residual_scores_edges(form, rewrites, reason):
    args = (R(2, 2, 5, 8), R(2, 2, 6, 8), R(2, 2, 6, 8), R(2, 2, 5, 8), R(2, 2, 6, 8))
    report = _check_block(_TwoScores(form), args, dict(attention=rewrites), (("attention", reason),))
    assert form != "shared" or "mask [2, 2, 5, 6]" in str(report)


class _RowsZeroed(nn.Module):
    """softmax(q·kᵀ)·v with the probabilities masked_fill'ed by `rows` (then cast / dropout 0, or viewed)
    before ·v."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, rows):
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
        if self.form == "fill_one":
            return p.masked_fill(rows, 1.0) @ v
        if self.form == "bmm_view":  # (B·H, Sq, Sk) probabilities zeroed, then viewed to the 4-d v
            b, h, i, j = p.shape
            p = p.reshape(b * h, i, j).masked_fill(rows.expand(b, h, i, 1).reshape(b * h, i, 1), 0.0)
            return p.view(b, h, i, j) @ v
        if self.form == "per_key":  # a mask along the keys the scores were not filled with
            return p.masked_fill(rows.transpose(-2, -1), 0.0) @ v
        return F.dropout(p.masked_fill(rows, 0.0).float(), 0.0, self.training) @ v


@pytest.mark.parametrize("form, rewrites, reason", [
    ("zeroed", 1, None),
    ("fill_one", 0, "(masked_fill), not to a matmul with v"),
    ("bmm_view", 0, "are not rows of the output as ·v lays it out"),
    ("per_key", 0, "(masked_fill), not to a matmul with v"),
])
def test_rows_zeroed_after_the_softmax_edges(form, rewrites, reason):
    rows = torch.tensor([True, False, False, True, False])[None, None, :, None].expand(2, 1, 5, 1).clone()
    rows[1, 0, 1] = True
    args = (R(2, 2, 5, 8), R(2, 2, 5, 8), R(2, 2, 5, 8), rows)
    near_misses = (("attention", reason),) if reason else ()
    _check_block(_RowsZeroed(form), args, dict(attention=rewrites), near_misses)


class _RowsZeroedLayouts(nn.Module):
    """Rows zeroed in other layouts: 3-d bmm probabilities (B·H, Sq, Sk) with a (B·H, Sq, 1) mask; GQA (k, v
    repeated by expand + reshape, reaching the op un-repeated); a one-element mask (every row or none)."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, rows):
        if self.form == "bmm":
            p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.3, dim=-1).masked_fill(rows, 0.0)
            return torch.bmm(p, v)
        if self.form == "gqa":
            b, g, s, d = k.shape
            k = k[:, :, None].expand(-1, -1, 2, -1, -1).reshape(b, 2 * g, s, d)
            v = v[:, :, None].expand(-1, -1, 2, -1, -1).reshape(b, 2 * g, s, d)
        return torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1).masked_fill(rows, 0) @ v


@pytest.mark.parametrize("form, shapes, rows_shape, words", [
    ("bmm", ((4, 5, 8), (4, 6, 8), (4, 6, 8)), (4, 5, 1), "rows zeroed"),
    ("gqa", ((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)), (2, 1, 5, 1), "gqa, rows zeroed"),
    ("one_element", ((2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)), (1,), "rows zeroed"),
])
def test_rows_zeroed_after_the_softmax_layouts(form, shapes, rows_shape, words):
    rows = torch.rand(rows_shape) > 0.5 if form != "one_element" else torch.tensor([True])
    report = _check_block(_RowsZeroedLayouts(form), (*(R(*s) for s in shapes), rows), dict(attention=1))
    assert words in str(report), str(report)
