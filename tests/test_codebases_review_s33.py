"""Review (session 33) of the four pass families on blocks of code bases no earlier review wrote, each written
tiny and as its authors write it: wenet / ESPnet's Conformer (relative-position attention with pos_bias_u /
pos_bias_v, the probabilities zeroed at the masked keys after the softmax, the macaron FFN, the convolution
module), Transformer-XL (kimiyoung's RelPartialLearnableMultiHeadAttn: 'ijbn' einsums, _rel_shift, a softmax
over dim 1), timm's MaxViT Attention2d (attention on (B, C, H, W) with the output as v @ attnᵀ) and LeViT
(attention biases gathered from a table, v wider than q / k, LinearNorm), black-forest-labs' Flux (double-
and single-stream blocks: joint text / image attention, fp32 QK RMSNorm, rotary as 2x2 matrices, adaLN
modulation, a tanh GELU over part of a Linear's output), lucidrains' vit-pytorch (ViT with nn.Softmax and the
norm inside Attention; NaViT's packed images, q/k RMSNorm by F.normalize, -finfo.max fills, attention
pooling; DeepViT's re-attention across heads), THUDM's ChatGLM2/3 (sequence-first multi-query attention,
interleaved partial rotary, SDPA and the baddbmm path with query-key layer scaling in fp32, the transposed
fp32 logits and their shifted loss), DINOv2's own Block (LayerScale, the stochastic depth that adds the
residual of a random batch subset with index_add), Microsoft's Graphormer (fairseq-style bmm attention, the
graph attention bias built by item assignment with -inf entries), torchtune's Llama 3 (GQA by
unsqueeze / expand / flatten, rotary, fp32 RMSNorm, the chunked output and CEWithChunkedOutputLoss) and
SigLIP as timm / open_clip write it (AttentionPoolLatent, the sigmoid loss).

Each block is compiled with the rewrite-only backend (fullgraph; the rewritten graph runs as plain PyTorch,
the flash ops on their CPU reference) and compared with eager: in training the outputs and the gradients of
every input and parameter, in eval the outputs, fp32 at 5e-5. The rewrites per family are asserted exactly,
and so are the near misses with their reasons (tests/test_codebases_review_s31.py's harness).

Findings: tests/findings/codebase_review_s33.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict

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


# ========================================================================================================
# wenet / ESPnet: Conformer (wenet/transformer/attention.py, encoder_layer.py, convolution.py)
# ========================================================================================================


class WenetMultiHeadedAttention(nn.Module):
    """wenet's MultiHeadedAttention: scores / sqrt(d_k), masked_fill(mask, -inf) (ESPnet: finfo.min), the
    softmax, then masked_fill(mask, 0.0) of the probabilities, dropout, matmul with v."""

    def __init__(self, n_head, n_feat, dropout_rate=0.0, fill=-float("inf")):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.fill = fill

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask.size(2) > 0:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            mask = mask[:, :, :, :scores.size(-1)]
            fill = self.fill if self.fill is not None else torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, fill)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask, pos_emb):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class WenetRelPositionMultiHeadedAttention(WenetMultiHeadedAttention):
    """wenet's RelPositionMultiHeadedAttention (rel_shift removed, as wenet does): q + pos_bias_u against the
    keys, q + pos_bias_v against the projected position embedding, (ac + bd) / sqrt(d_k)."""

    def __init__(self, n_head, n_feat, dropout_rate=0.0, fill=-float("inf")):
        super().__init__(n_head, n_feat, dropout_rate, fill)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(0.1 * torch.randn(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(0.1 * torch.randn(self.h, self.d_k))

    def forward(self, query, key, value, mask, pos_emb):
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)  # (batch, time1, head, d_k)
        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k)
        p = p.transpose(1, 2)  # (batch, head, time1, d_k)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class WenetPositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units, dropout_rate=0.0, activation=None):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = activation if activation is not None else nn.ReLU()
        self.dropout = nn.Dropout(dropout_rate)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, xs):
        return self.w_2(self.dropout(self.activation(self.w_1(xs))))


class WenetConvolutionModule(nn.Module):
    """wenet's ConvolutionModule: pointwise conv, GLU, depthwise conv (masked at the pads), BatchNorm, Swish,
    pointwise conv; (B, T, C) in and out through transposes."""

    def __init__(self, channels, kernel_size=5):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise_conv = nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2,
                                        groups=channels)
        self.norm = nn.BatchNorm1d(channels)
        self.pointwise_conv2 = nn.Conv1d(channels, channels, 1)
        self.activation = nn.SiLU()

    def forward(self, x, mask_pad):
        x = x.transpose(1, 2)  # (#batch, channels, time)
        x.masked_fill_(~mask_pad, 0.0)
        x = self.pointwise_conv1(x)
        x = F.glu(x, dim=1)
        x = self.depthwise_conv(x)
        x = self.activation(self.norm(x))
        x = self.pointwise_conv2(x)
        x.masked_fill_(~mask_pad, 0.0)
        return x.transpose(1, 2)


class WenetConformerEncoderLayer(nn.Module):
    """wenet's ConformerEncoderLayer (normalize_before): macaron FFN scaled 0.5, self-attention, the conv
    module, the FFN scaled 0.5, norm_final."""

    def __init__(self, size, n_head, hidden, rel_pos=True, fill=-float("inf")):
        super().__init__()
        attn = WenetRelPositionMultiHeadedAttention if rel_pos else WenetMultiHeadedAttention
        self.self_attn = attn(n_head, size, 0.0, fill)
        self.feed_forward = WenetPositionwiseFeedForward(size, hidden, activation=nn.SiLU())
        self.feed_forward_macaron = WenetPositionwiseFeedForward(size, hidden, activation=nn.SiLU())
        self.conv_module = WenetConvolutionModule(size)
        self.norm_ff = nn.LayerNorm(size, eps=1e-5)
        self.norm_mha = nn.LayerNorm(size, eps=1e-5)
        self.norm_ff_macaron = nn.LayerNorm(size, eps=1e-5)
        self.norm_conv = nn.LayerNorm(size, eps=1e-5)
        self.norm_final = nn.LayerNorm(size, eps=1e-5)
        self.dropout = nn.Dropout(0.0)
        self.ff_scale = 0.5

    def forward(self, x, mask, pos_emb, mask_pad):
        residual = x
        x = self.norm_ff_macaron(x)
        x = residual + self.ff_scale * self.dropout(self.feed_forward_macaron(x))
        residual = x
        x = self.norm_mha(x)
        x_att = self.self_attn(x, x, x, mask, pos_emb)
        x = residual + self.dropout(x_att)
        residual = x
        x = self.norm_conv(x)
        x = self.conv_module(x, mask_pad)
        x = residual + self.dropout(x)
        residual = x
        x = self.norm_ff(x)
        x = residual + self.ff_scale * self.dropout(self.feed_forward(x))
        x = self.norm_final(x)
        return x


class WenetConformer(nn.Module):
    """Two Conformer layers over padded features (lengths given), wenet's make_pad_mask masks, the
    RelPositionalEncoding's pos_emb (sinusoids, no grad) and a CTC-style Linear head (log_softmax)."""

    def __init__(self, idim=12, size=16, n_head=2, hidden=24, n_layers=2, rel_pos=True, fill=-float("inf"),
                 vocab=7):
        super().__init__()
        self.embed = nn.Linear(idim, size)
        self.encoders = nn.ModuleList(WenetConformerEncoderLayer(size, n_head, hidden, rel_pos, fill)
                                      for _ in range(n_layers))
        self.after_norm = nn.LayerNorm(size, eps=1e-5)
        self.ctc_lo = nn.Linear(size, vocab)
        self.size = size

    def pos_emb(self, t):
        pos = torch.arange(t, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, self.size, 2, dtype=torch.float32) * -(math.log(10000.0) / self.size))
        pe = torch.zeros(t, self.size)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        return pe.unsqueeze(0)

    def forward(self, xs, xs_lens):
        t = xs.size(1)
        masks = ~(torch.arange(t)[None, :] >= xs_lens[:, None])  # ~make_pad_mask
        masks = masks.unsqueeze(1)  # (B, 1, T)
        x = self.embed(xs) * math.sqrt(self.size)
        pos_emb = self.pos_emb(t)
        for layer in self.encoders:
            x = layer(x, masks, pos_emb, masks)
        x = self.after_norm(x)
        return F.log_softmax(self.ctc_lo(x), dim=2)


def _lens(*lens):
    return torch.tensor(lens)


# ========================================================================================================
# Transformer-XL (kimiyoung/transformer-xl, pytorch/mem_transformer.py)
# ========================================================================================================


class TXLRelPartialLearnableMultiHeadAttn(nn.Module):
    """RelPartialLearnableMultiHeadAttn, post-norm (pre_lnorm False), without memories: 'ibnd,jbnd->ijbn'
    scores, the relative term through _rel_shift, attn_score.mul_(scale), the causal mask filled with -inf
    in fp32, F.softmax(dim=1) over the keys of the (i, j, b, n) scores, 'ijbn,jbnd->ibnd'. (The original
    guards the fill with attn_mask.any().item(), a graph break; the mask here always has a masked entry.)"""

    def __init__(self, n_head, d_model, d_head, dropout=0.0, dropatt=0.0):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)

    def _rel_shift(self, x, zero_triu=False):
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded = x_padded.view(x.size(1) + 1, x.size(0), *x.size()[2:])
        x = x_padded[1:].view_as(x)
        return x

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        w_heads = self.qkv_net(w)
        r_head_k = self.r_net(r)
        w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
        klen = w_head_k.size(0)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)
        rw_head_q = w_head_q + r_w_bias
        AC = torch.einsum("ibnd,jbnd->ijbn", (rw_head_q, w_head_k))
        rr_head_q = w_head_q + r_r_bias
        BD = torch.einsum("ibnd,jnd->ijbn", (rr_head_q, r_head_k))
        BD = self._rel_shift(BD)
        attn_score = AC + BD
        attn_score.mul_(self.scale)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                attn_score = attn_score.float().masked_fill(
                    attn_mask[None, :, :, None], -float("inf")).type_as(attn_score)
            elif attn_mask.dim() == 3:
                attn_score = attn_score.float().masked_fill(
                    attn_mask[:, :, :, None], -float("inf")).type_as(attn_score)
        attn_prob = F.softmax(attn_score, dim=1)
        attn_prob = self.dropatt(attn_prob)
        attn_vec = torch.einsum("ijbn,jbnd->ibnd", (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head)
        attn_out = self.o_net(attn_vec)
        attn_out = self.drop(attn_out)
        return self.layer_norm(w + attn_out)


class TXLPositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout=0.0):
        super().__init__()
        self.CoreNet = nn.Sequential(nn.Linear(d_model, d_inner), nn.ReLU(inplace=True), nn.Dropout(dropout),
                                     nn.Linear(d_inner, d_model), nn.Dropout(dropout))
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp):
        core_out = self.CoreNet(inp)
        return self.layer_norm(inp + core_out)


class TXLMemTransformerLM(nn.Module):
    """Two RelPartialLearnableDecoderLayers over a (qlen, bsz) batch, the sinusoid PositionalEmbedding of
    pos_seq = arange(klen - 1, -1, -1), the shared r_w_bias / r_r_bias, a tied-free softmax head and loss."""

    def __init__(self, n_token=11, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=24):
        super().__init__()
        self.word_emb = nn.Embedding(n_token, d_model)
        self.layers = nn.ModuleList(
            nn.ModuleList([TXLRelPartialLearnableMultiHeadAttn(n_head, d_model, d_head),
                           TXLPositionwiseFF(d_model, d_inner)])
            for _ in range(n_layer))
        self.r_w_bias = nn.Parameter(0.1 * torch.randn(n_head, d_head))
        self.r_r_bias = nn.Parameter(0.1 * torch.randn(n_head, d_head))
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)))
        self.out = nn.Linear(d_model, n_token)
        self.d_model, self.n_token = d_model, n_token

    def forward(self, data, target):
        qlen, bsz = data.size()
        word_emb = self.word_emb(data) * self.d_model ** 0.5
        klen = qlen
        dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1).bool()[:, :, None]
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)
        sinusoid_inp = torch.ger(pos_seq, self.inv_freq)
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)[:, None, :]
        core_out = word_emb
        for attn, ff in self.layers:
            core_out = ff(attn(core_out, pos_emb, self.r_w_bias, self.r_r_bias, attn_mask=dec_attn_mask))
        logit = self.out(core_out)
        loss = -F.log_softmax(logit.view(-1, self.n_token), dim=-1).gather(1, target.view(-1, 1)).squeeze(1)
        return loss.view(qlen, bsz).mean()


# ========================================================================================================
# timm: MaxViT's Attention2d (maxxvit.py) and LeViT (levit.py)
# ========================================================================================================


class TimmRelPosBias(nn.Module):
    """timm's layers/pos_embed_rel.RelPosBias: a (2W-1)^2 x heads table gathered by a relative index."""

    def __init__(self, window_size, num_heads):
        super().__init__()
        self.window_size = window_size
        self.window_area = window_size[0] * window_size[1]
        self.bias_shape = (self.window_area,) * 2 + (num_heads,)
        num_relative_distance = (2 * window_size[0] - 1) * (2 * window_size[1] - 1)
        self.relative_position_bias_table = nn.Parameter(0.1 * torch.randn(num_relative_distance, num_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window_size[0]), torch.arange(window_size[1]),
                                            indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += window_size[0] - 1
        rel[:, :, 1] += window_size[1] - 1
        rel[:, :, 0] *= 2 * window_size[1] - 1
        self.register_buffer("relative_position_index", rel.sum(-1).view(-1), persistent=False)

    def get_bias(self):
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        relative_position_bias = relative_position_bias.view(self.bias_shape).permute(2, 0, 1)
        return relative_position_bias.unsqueeze(0).contiguous()

    def forward(self, attn, shared_rel_pos=None):
        return attn + self.get_bias()


class MaxxVitAttention2d(nn.Module):
    """timm's maxxvit.Attention2d: multi-head attention over a (B, C, H, W) map with 1x1 conv projections;
    manual: (q.transpose(-2, -1) @ k) * ..., the output v @ attn.transpose(-2, -1); fused: SDPA on the
    transposed, contiguous q / k / v with the position bias as attn_mask."""

    def __init__(self, dim, dim_head=8, window=(3, 3), fused_attn=False):
        super().__init__()
        self.num_heads = dim // dim_head
        self.dim_head = dim_head
        self.scale = dim_head ** -0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Conv2d(dim, dim * 3, 1, bias=True)
        self.rel_pos = TimmRelPosBias(window, self.num_heads)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Conv2d(dim, dim, 1, bias=True)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, shared_rel_pos=None):
        B, C, H, W = x.shape
        q, k, v = self.qkv(x).view(B, self.num_heads, self.dim_head * 3, -1).chunk(3, dim=2)
        if self.fused_attn:
            attn_bias = self.rel_pos.get_bias()
            x = F.scaled_dot_product_attention(
                q.transpose(-1, -2).contiguous(), k.transpose(-1, -2).contiguous(),
                v.transpose(-1, -2).contiguous(), attn_mask=attn_bias,
                dropout_p=self.attn_drop.p if self.training else 0.0,
            ).transpose(-1, -2).reshape(B, -1, H, W)
        else:
            q = q * self.scale
            attn = q.transpose(-2, -1) @ k
            attn = self.rel_pos(attn, shared_rel_pos=shared_rel_pos)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = (v @ attn.transpose(-2, -1)).view(B, -1, H, W)
        x = self.proj(x)
        return self.proj_drop(x)


class MaxxVitConvTransformerBlock2d(nn.Module):
    """timm's TransformerBlock2d (CoAtNet's 'cf' transformer stage): BatchNorm-free, LayerNorm2d (a
    permute + F.layer_norm + permute), attention and a 1x1-conv Mlp with GELU, LayerScale2d residuals."""

    def __init__(self, dim, fused_attn=False):
        super().__init__()
        self.norm1 = TimmLayerNorm2d(dim)
        self.attn = MaxxVitAttention2d(dim, fused_attn=fused_attn)
        self.norm2 = TimmLayerNorm2d(dim)
        self.fc1 = nn.Conv2d(dim, 2 * dim, 1)
        self.act = nn.GELU()
        self.fc2 = nn.Conv2d(2 * dim, dim, 1)
        self.gamma1 = nn.Parameter(0.5 * torch.ones(dim))
        self.gamma2 = nn.Parameter(0.5 * torch.ones(dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x)) * self.gamma1.view(1, -1, 1, 1)
        x = x + self.fc2(self.act(self.fc1(self.norm2(x)))) * self.gamma2.view(1, -1, 1, 1)
        return x


class TimmLayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class MaxxVitTiny(nn.Module):
    def __init__(self, dim=16, fused_attn=False, num_classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 3, stride=3)
        self.blocks = nn.Sequential(*(MaxxVitConvTransformerBlock2d(dim, fused_attn) for _ in range(2)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x, y):
        x = self.blocks(self.stem(x))
        x = self.norm(x.mean((2, 3)))
        logits = self.head(x)
        return logits, F.cross_entropy(logits, y)


class LeViTLinearNorm(nn.Module):
    """timm's levit.LinearNorm: a bias-free Linear and a BatchNorm1d over the flattened tokens."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim, bias=False)
        self.bn = nn.BatchNorm1d(out_dim)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class LeViTAttention(nn.Module):
    """timm's levit.Attention (use_conv False): q, k, v split from one LinearNorm with v attn_ratio times
    wider, k permuted straight to (B, H, D, N), q @ k * scale + the attention biases gathered from a
    (heads, resolution²) table (cached per device in eval), Hardswish then the projection."""

    def __init__(self, dim, key_dim, num_heads=2, attn_ratio=2.0, resolution=3):
        super().__init__()
        self.num_heads = num_heads
        self.scale = key_dim ** -0.5
        self.key_dim = key_dim
        self.key_attn_dim = key_dim * num_heads
        self.val_dim = int(attn_ratio * key_dim)
        self.val_attn_dim = int(attn_ratio * key_dim) * num_heads
        self.qkv = LeViTLinearNorm(dim, self.val_attn_dim + self.key_attn_dim * 2)
        self.proj = nn.Sequential(OrderedDict([("act", nn.Hardswish()),
                                               ("ln", LeViTLinearNorm(self.val_attn_dim, dim))]))
        self.attention_biases = nn.Parameter(0.1 * torch.randn(num_heads, resolution * resolution))
        pos = torch.stack(torch.meshgrid(torch.arange(resolution), torch.arange(resolution),
                                         indexing="ij")).flatten(1)
        rel_pos = (pos[..., :, None] - pos[..., None, :]).abs()
        rel_pos = (rel_pos[0] * resolution) + rel_pos[1]
        self.register_buffer("attention_bias_idxs", rel_pos, persistent=False)
        self.attention_bias_cache = {}

    @torch.no_grad()
    def train(self, mode=True):
        super().train(mode)
        if mode and self.attention_bias_cache:
            self.attention_bias_cache = {}
        return self

    def get_attention_biases(self, device):
        if self.training:
            return self.attention_biases[:, self.attention_bias_idxs]
        device_key = str(device)
        if device_key not in self.attention_bias_cache:
            self.attention_bias_cache[device_key] = self.attention_biases[:, self.attention_bias_idxs]
        return self.attention_bias_cache[device_key]

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, self.num_heads, -1).split(
            [self.key_dim, self.key_dim, self.val_dim], dim=3)
        q = q.permute(0, 2, 1, 3)
        k = k.permute(0, 2, 3, 1)
        v = v.permute(0, 2, 1, 3)
        attn = q @ k * self.scale + self.get_attention_biases(x.device)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, self.val_attn_dim)
        return self.proj(x)


class LeViTMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.ln1 = LeViTLinearNorm(dim, hidden)
        self.act = nn.Hardswish()
        self.ln2 = LeViTLinearNorm(hidden, dim)

    def forward(self, x):
        return self.ln2(self.act(self.ln1(x)))


class LeViTTiny(nn.Module):
    """Two LeViT blocks (residual attention and MLP, no norms: LeViT has BatchNorm only) and the
    distillation head pair (NormLinear: BatchNorm1d + Linear), the loss over the averaged heads."""

    def __init__(self, dim=16, num_classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 3, stride=3)
        self.blocks = nn.ModuleList(nn.ModuleList([LeViTAttention(dim, key_dim=8), LeViTMlp(dim, 2 * dim)])
                                    for _ in range(2))
        self.head_bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, num_classes)
        self.head_dist = nn.Linear(dim, num_classes)

    def forward(self, x, y):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for attn, mlp in self.blocks:
            x = x + attn(x)
            x = x + mlp(x)
        x = self.head_bn(x.mean(1))
        logits = (self.head(x) + self.head_dist(x)) / 2
        return logits, F.cross_entropy(logits, y)


# ========================================================================================================
# black-forest-labs/flux (src/flux/modules/layers.py, math.py)
# ========================================================================================================


def flux_rope(pos, dim, theta):
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos, omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    out = out.view(*out.shape[:-1], 2, 2)  # rearrange "b n d (i j) -> b n d i j"
    return out.float()


def flux_apply_rope(xq, xk, freqs_cis):
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def flux_attention(q, k, v, pe):
    q, k = flux_apply_rope(q, k, pe)
    x = F.scaled_dot_product_attention(q, k, v)
    B, H, L, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, L, H * D)  # rearrange "B H L D -> B L (H D)"


def _split_qkv(qkv, num_heads):
    B, L, _ = qkv.shape
    qkv = qkv.view(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4)  # "B L (K H D) -> K B H L D"
    return qkv[0], qkv[1], qkv[2]


class FluxRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        x_dtype = x.dtype
        x = x.float()
        rrms = torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + 1e-6)
        return (x * rrms).to(dtype=x_dtype) * self.scale


class FluxQKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query_norm = FluxRMSNorm(dim)
        self.key_norm = FluxRMSNorm(dim)

    def forward(self, q, k, v):
        q = self.query_norm(q)
        k = self.key_norm(k)
        return q.to(v), k.to(v)


class FluxSelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = FluxQKNorm(head_dim)
        self.proj = nn.Linear(dim, dim)


class FluxModulation(nn.Module):
    def __init__(self, dim, double):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec):
        out = self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return out[:3], (out[3:] if self.is_double else None)  # ModulationOut(shift, scale, gate)


class FluxDoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=2.0, qkv_bias=True):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_mod = FluxModulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = FluxSelfAttention(hidden_size, num_heads, qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim, bias=True),
                                     nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden_dim, hidden_size))
        self.txt_mod = FluxModulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = FluxSelfAttention(hidden_size, num_heads, qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim, bias=True),
                                     nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden_dim, hidden_size))

    def forward(self, img, txt, vec, pe):
        (img1_shift, img1_scale, img1_gate), (img2_shift, img2_scale, img2_gate) = self.img_mod(vec)
        (txt1_shift, txt1_scale, txt1_gate), (txt2_shift, txt2_scale, txt2_gate) = self.txt_mod(vec)
        img_modulated = self.img_norm1(img)
        img_modulated = (1 + img1_scale) * img_modulated + img1_shift
        img_q, img_k, img_v = _split_qkv(self.img_attn.qkv(img_modulated), self.num_heads)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)
        txt_modulated = self.txt_norm1(txt)
        txt_modulated = (1 + txt1_scale) * txt_modulated + txt1_shift
        txt_q, txt_k, txt_v = _split_qkv(self.txt_attn.qkv(txt_modulated), self.num_heads)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        attn = flux_attention(q, k, v, pe=pe)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]
        img = img + img1_gate * self.img_attn.proj(img_attn)
        img = img + img2_gate * self.img_mlp((1 + img2_scale) * self.img_norm2(img) + img2_shift)
        txt = txt + txt1_gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt2_gate * self.txt_mlp((1 + txt2_scale) * self.txt_norm2(txt) + txt2_shift)
        return img, txt


class FluxSingleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=2.0):
        super().__init__()
        self.hidden_dim = hidden_size
        self.num_heads = num_heads
        head_dim = hidden_size // num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = FluxQKNorm(head_dim)
        self.hidden_size = hidden_size
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = FluxModulation(hidden_size, double=False)

    def forward(self, x, vec, pe):
        (shift, scale, gate), _ = self.modulation(vec)
        x_mod = (1 + scale) * self.pre_norm(x) + shift
        qkv, mlp = torch.split(self.linear1(x_mod), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = _split_qkv(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        attn = flux_attention(q, k, v, pe=pe)
        output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
        return x + gate * output


class FluxTiny(nn.Module):
    """Flux's forward: img_in / txt_in Linears, the timestep MLP (SiLU), the EmbedND rotary of the ids,
    a double-stream block, a single-stream block on the concatenation, the final adaLN layer."""

    def __init__(self, in_channels=8, context_dim=12, hidden=16, heads=2, axes_dim=(4, 4), single=True):
        super().__init__()
        self.heads, self.axes_dim = heads, axes_dim
        self.img_in = nn.Linear(in_channels, hidden)
        self.txt_in = nn.Linear(context_dim, hidden)
        self.time_in = nn.Sequential(nn.Linear(8, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.double_blocks = FluxDoubleStreamBlock(hidden, heads)
        self.single_blocks = FluxSingleStreamBlock(hidden, heads) if single else None
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, in_channels)

    def pe(self, ids):
        emb = torch.cat([flux_rope(ids[..., i], self.axes_dim[i], 10000) for i in range(ids.shape[-1])],
                        dim=-3)
        return emb.unsqueeze(1)

    def forward(self, img, txt, t_emb, img_ids, txt_ids):
        img, txt = self.img_in(img), self.txt_in(txt)
        vec = self.time_in(t_emb)
        pe = self.pe(torch.cat((txt_ids, img_ids), dim=1))
        img, txt = self.double_blocks(img, txt, vec, pe)
        if self.single_blocks is not None:
            x = torch.cat((txt, img), 1)
            x = self.single_blocks(x, vec, pe)
            img = x[:, txt.shape[1]:, ...]
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        img = (1 + scale[:, None, :]) * self.norm_final(img) + shift[:, None, :]
        return self.linear(img)


def _flux_inputs(b=2, n_img=6, n_txt=3):
    img_ids = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(3.0), indexing="ij"), -1)
    img_ids = img_ids.reshape(1, n_img, 2).expand(b, -1, -1).contiguous()
    txt_ids = torch.zeros(b, n_txt, 2)
    return R(b, n_img, 8), R(b, n_txt, 12), R(b, 8), img_ids, txt_ids


# ========================================================================================================
# lucidrains/vit-pytorch: vit.py, na_vit.py, deepvit.py (einops written as view / permute: not installed)
# ========================================================================================================


class VPFeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout=0.0, norm=None):
        super().__init__()
        self.net = nn.Sequential(norm or nn.LayerNorm(dim), nn.Linear(dim, hidden_dim), nn.GELU(),
                                 nn.Dropout(dropout), nn.Linear(hidden_dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


def _heads(t, h):
    b, n, _ = t.shape
    return t.view(b, n, h, -1).permute(0, 2, 1, 3)  # 'b n (h d) -> b h n d'


def _merge_heads(t):
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)  # 'b h n d -> b n (h d)'


class VPAttention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        project_out = not (heads == 1 and dim_head == dim)
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.attend = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout)) if project_out \
            else nn.Identity()

    def forward(self, x):
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (_heads(t, self.heads) for t in qkv)
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        attn = self.attend(dots)
        attn = self.dropout(attn)
        out = torch.matmul(attn, v)
        return self.to_out(_merge_heads(out))


class VPTransformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim, dropout=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(nn.ModuleList([VPAttention(dim, heads=heads, dim_head=dim_head,
                                                               dropout=dropout),
                                                   VPFeedForward(dim, mlp_dim, dropout=dropout)])
                                    for _ in range(depth))

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)


class VPViT(nn.Module):
    """vit-pytorch's ViT: to_patch_embedding (Rearrange, LayerNorm, Linear, LayerNorm), cls token,
    `x += self.pos_embedding[:, :(n + 1)]`, the Transformer, pool 'cls' or 'mean', mlp_head."""

    def __init__(self, image_size=9, patch_size=3, num_classes=5, dim=16, depth=2, heads=2, mlp_dim=24,
                 pool="cls", channels=3, dim_head=8):
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        patch_dim = channels * patch_size * patch_size
        self.p = patch_size
        self.to_patch_embedding = nn.Sequential(nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim),
                                                nn.LayerNorm(dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.dropout = nn.Dropout(0.0)
        self.transformer = VPTransformer(dim, depth, heads, dim_head, mlp_dim)
        self.pool = pool
        self.to_latent = nn.Identity()
        self.mlp_head = nn.Linear(dim, num_classes)

    def forward(self, img, labels):
        b, c, hh, ww = img.shape
        p = self.p
        x = img.view(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1).reshape(
            b, (hh // p) * (ww // p), p * p * c)  # 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)'
        x = self.to_patch_embedding(x)
        b, n, _ = x.shape
        cls_tokens = self.cls_token.expand(b, -1, -1)  # repeat '1 1 d -> b 1 d'
        x = torch.cat((cls_tokens, x), dim=1)
        x += self.pos_embedding[:, :(n + 1)]
        x = self.dropout(x)
        x = self.transformer(x)
        x = x.mean(dim=1) if self.pool == "mean" else x[:, 0]
        logits = self.mlp_head(self.to_latent(x))
        return logits, F.cross_entropy(logits, labels)


class NaViTLayerNorm(nn.Module):
    """na_vit's LayerNorm: a learned gamma, beta a zero buffer."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class NaViTRMSNorm(nn.Module):
    """na_vit's per-head q / k RMSNorm: F.normalize(x) * sqrt(dim) * gamma (heads, 1, dim)."""

    def __init__(self, heads, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(heads, 1, dim))

    def forward(self, x):
        normed = F.normalize(x, dim=-1)
        return normed * self.scale * self.gamma


class NaViTAttention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.norm = NaViTLayerNorm(dim)
        self.q_norm = NaViTRMSNorm(heads, dim_head)
        self.k_norm = NaViTRMSNorm(heads, dim_head)
        self.attend = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim, bias=False), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None, attn_mask=None):
        x = self.norm(x)
        kv_input = context if context is not None else x
        qkv = (self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1))
        q, k, v = (_heads(t, self.heads) for t in qkv)
        q = self.q_norm(q)
        k = self.k_norm(k)
        dots = torch.matmul(q, k.transpose(-1, -2))
        if mask is not None:
            mask = mask[:, None, None, :]  # 'b j -> b 1 1 j'
            dots = dots.masked_fill(~mask, -torch.finfo(dots.dtype).max)
        if attn_mask is not None:
            dots = dots.masked_fill(~attn_mask, -torch.finfo(dots.dtype).max)
        attn = self.attend(dots)
        attn = self.dropout(attn)
        out = torch.matmul(attn, v)
        return self.to_out(_merge_heads(out))


class NaViTTiny(nn.Module):
    """NaViT's forward after patchify and packing (torch.compile cannot take the Python packing loop whole;
    the packed patches, image ids and key padding mask are inputs): factorised 2-d position embeddings,
    the Transformer with the block-diagonal attn_mask and the key padding mask, the attention pooling of
    one learned query per image (attn_pool_mask: query i sees the tokens of image i), the head. Every batch
    row holds the same number of images, so no pooling query is fully masked (findings)."""

    def __init__(self, patch_dim=12, dim=16, heads=2, dim_head=8, depth=2, num_classes=5, max_queries=2,
                 grid=4):
        super().__init__()
        self.to_patch_embedding = nn.Sequential(NaViTLayerNorm(patch_dim), nn.Linear(patch_dim, dim),
                                                NaViTLayerNorm(dim))
        self.pos_embed_height = nn.Parameter(torch.randn(grid, dim))
        self.pos_embed_width = nn.Parameter(torch.randn(grid, dim))
        self.layers = nn.ModuleList(nn.ModuleList([NaViTAttention(dim, heads, dim_head),
                                                   VPFeedForward(dim, 2 * dim, norm=NaViTLayerNorm(dim))])
                                    for _ in range(depth))
        self.norm = NaViTLayerNorm(dim)
        self.attn_pool_queries = nn.Parameter(torch.randn(dim))
        self.attn_pool = NaViTAttention(dim=dim, dim_head=dim_head, heads=heads)
        self.to_latent = nn.Identity()
        self.mlp_head = nn.Sequential(NaViTLayerNorm(dim), nn.Linear(dim, num_classes, bias=False))
        self.max_queries = max_queries

    def forward(self, patches, patch_positions, image_ids, key_pad_mask, labels):
        b = patches.shape[0]
        attn_mask = image_ids[:, None, :, None] == image_ids[:, None, None, :]
        attn_mask = attn_mask & key_pad_mask[:, None, None, :]
        x = self.to_patch_embedding(patches)
        h_indices, w_indices = patch_positions.unbind(dim=-1)
        x = x + self.pos_embed_height[h_indices] + self.pos_embed_width[w_indices]
        for attn, ff in self.layers:
            x = attn(x, attn_mask=attn_mask) + x
            x = ff(x) + x
        x = self.norm(x)
        queries = self.attn_pool_queries.expand(b, self.max_queries, -1)  # repeat 'd -> b n d'
        image_id_arange = torch.arange(self.max_queries)
        attn_pool_mask = image_id_arange[:, None] == image_ids[:, None, :]
        attn_pool_mask = attn_pool_mask & key_pad_mask[:, None, :]
        attn_pool_mask = attn_pool_mask[:, None]  # 'b i j -> b 1 i j'
        x = self.attn_pool(queries, context=x, attn_mask=attn_pool_mask) + queries
        x = x.reshape(b * self.max_queries, -1)
        logits = self.mlp_head(self.to_latent(x))
        return logits, F.cross_entropy(logits, labels)


def _navit_inputs(b=2, n=9):
    torch.manual_seed(1)
    patches = R(b, n, 12)
    positions = torch.randint(0, 4, (b, n, 2))
    image_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 0]])
    key_pad_mask = torch.tensor([[True] * 7 + [False] * 2, [True] * 8 + [False]])
    return patches, positions, image_ids, key_pad_mask, _labels(b * 2)


class DeepViTAttention(nn.Module):
    """deepvit.Attention: softmax, then the re-attention 'b h i j, h g -> b g i j' mixing the heads'
    probabilities and a LayerNorm over the heads: not per-head attention."""

    def __init__(self, dim, heads=2, dim_head=8, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.reattn_weights = nn.Parameter(torch.randn(heads, heads))
        self.reattn_norm = nn.LayerNorm(heads)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (_heads(t, self.heads) for t in qkv)
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = dots.softmax(dim=-1)
        attn = self.dropout(attn)
        attn = torch.einsum("b h i j, h g -> b g i j", attn, self.reattn_weights)
        attn = self.reattn_norm(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(_merge_heads(out))


class DeepViTBlock(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attn = DeepViTAttention(dim)
        self.ff = VPFeedForward(dim, 24)

    def forward(self, x):
        x = self.attn(x) + x
        return self.ff(x) + x


# ========================================================================================================
# THUDM ChatGLM2 / ChatGLM3 (modeling_chatglm.py)
# ========================================================================================================


class GLMRMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(normalized_shape))
        self.eps = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return (self.weight * hidden_states).to(input_dtype)


def glm_apply_rotary_pos_emb(x, rope_cache):
    # x: [sq, b, np, hn]
    sq, np_ = x.size(0), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np_, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                          xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
    x_out2 = x_out2.flatten(3)
    return torch.cat((x_out2, x_pass), dim=-1)


class GLMCoreAttention(nn.Module):
    """CoreAttention: torch >= 2 takes SDPA (is_causal without a mask, else the inverted bool mask); the
    older path is baddbmm into torch.empty with beta 0 and alpha 1 / norm_factor (sqrt(hn) * layer_number
    with query-key layer scaling), the scores in fp32 times coeff, an in-graph causal mask (ones.tril_(),
    inverted) filled with -inf, the softmax, type_as(v), bmm with v."""

    def __init__(self, layer_number, heads, kv_channels, sdpa=True, dropout=0.0):
        super().__init__()
        self.sdpa = sdpa
        self.attention_softmax_in_fp32 = True
        self.layer_number = max(1, layer_number)
        projection_size = kv_channels * heads
        self.hidden_size_per_partition = projection_size
        self.hidden_size_per_attention_head = projection_size // heads
        self.num_attention_heads_per_partition = heads
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        coeff = self.layer_number
        self.norm_factor *= coeff
        self.coeff = coeff
        self.attention_dropout = nn.Dropout(dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        if self.sdpa:
            query_layer, key_layer, value_layer = [k.permute(1, 2, 0, 3)
                                                   for k in [query_layer, key_layer, value_layer]]
            if attention_mask is None and query_layer.shape[2] == key_layer.shape[2]:
                context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer,
                                                               is_causal=True)
            else:
                if attention_mask is not None:
                    attention_mask = ~attention_mask
                context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer,
                                                               attention_mask)
            context_layer = context_layer.permute(2, 0, 1, 3)
            new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
            return context_layer.reshape(*new_context_layer_shape)
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.view(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)
        matmul_input_buffer = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3],
                                          dtype=query_layer.dtype, device=query_layer.device)
        matmul_result = torch.baddbmm(matmul_input_buffer, query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2), beta=0.0,
                                      alpha=(1.0 / self.norm_factor))
        attention_scores = matmul_result.view(*output_size)
        if self.attention_softmax_in_fp32:
            attention_scores = attention_scores.float()
        if self.coeff is not None:
            attention_scores = attention_scores * self.coeff
        if attention_mask is None and attention_scores.shape[2] == attention_scores.shape[3]:
            attention_mask = torch.ones(output_size[0], 1, output_size[2], output_size[3],
                                        device=attention_scores.device, dtype=torch.bool)
            attention_mask.tril_()
            attention_mask = ~attention_mask
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(attention_mask, float("-inf"))
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = attention_probs.type_as(value_layer)
        attention_probs = self.attention_dropout(attention_probs)
        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        return context_layer.view(*new_context_layer_shape)


class GLMSelfAttention(nn.Module):
    def __init__(self, hidden, heads, groups, layer_number, sdpa=True):
        super().__init__()
        self.hn = hidden // heads
        self.np, self.g = heads, groups
        self.query_key_value = nn.Linear(hidden, (heads + 2 * groups) * self.hn, bias=True)
        self.core_attention = GLMCoreAttention(layer_number, heads, self.hn, sdpa)
        self.dense = nn.Linear(heads * self.hn, hidden, bias=False)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        mixed_x_layer = self.query_key_value(hidden_states)
        query_layer, key_layer, value_layer = mixed_x_layer.split(
            [self.np * self.hn, self.g * self.hn, self.g * self.hn], dim=-1)
        query_layer = query_layer.view(query_layer.size()[:-1] + (self.np, self.hn))
        key_layer = key_layer.view(key_layer.size()[:-1] + (self.g, self.hn))
        value_layer = value_layer.view(value_layer.size()[:-1] + (self.g, self.hn))
        query_layer = glm_apply_rotary_pos_emb(query_layer, rotary_pos_emb)
        key_layer = glm_apply_rotary_pos_emb(key_layer, rotary_pos_emb)
        key_layer = key_layer.unsqueeze(-2)
        key_layer = key_layer.expand(-1, -1, -1, self.np // self.g, -1)
        key_layer = key_layer.contiguous().view(key_layer.size()[:2] + (self.np, self.hn))
        value_layer = value_layer.unsqueeze(-2)
        value_layer = value_layer.expand(-1, -1, -1, self.np // self.g, -1)
        value_layer = value_layer.contiguous().view(value_layer.size()[:2] + (self.np, self.hn))
        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context_layer)


class GLMBlock(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, layer_number, sdpa=True):
        super().__init__()
        self.input_layernorm = GLMRMSNorm(hidden)
        self.self_attention = GLMSelfAttention(hidden, heads, groups, layer_number, sdpa)
        self.hidden_dropout = 0.0
        self.post_attention_layernorm = GLMRMSNorm(hidden)
        self.dense_h_to_4h = nn.Linear(hidden, 2 * ffn, bias=False)
        self.dense_4h_to_h = nn.Linear(ffn, hidden, bias=False)

    def mlp(self, x):
        x = torch.chunk(self.dense_h_to_4h(x), 2, dim=-1)
        return self.dense_4h_to_h(F.silu(x[0]) * x[1])

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(layernorm_output, attention_mask, rotary_pos_emb)
        residual = hidden_states
        layernorm_input = F.dropout(attention_output, p=self.hidden_dropout, training=self.training)
        layernorm_input = residual + layernorm_input
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        mlp_output = self.mlp(layernorm_output)
        residual = layernorm_input
        output = F.dropout(mlp_output, p=self.hidden_dropout, training=self.training)
        return residual + output


class ChatGLMTiny(nn.Module):
    """ChatGLMForConditionalGeneration's training forward: embeddings transposed to sequence first, the
    RotaryEmbedding cache over half the head dim (original_impl, stacked cos / sin), two GLMBlocks (layer
    numbers 1 and 2, multi-query groups 1), the final RMSNorm, output_layer, the logits transposed back and
    made fp32, the shifted loss."""

    def __init__(self, vocab=11, hidden=32, heads=4, groups=1, ffn=24, layers=2, sdpa=True):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.rot_dim = hidden // heads // 2
        self.layers = nn.ModuleList(GLMBlock(hidden, heads, groups, ffn, i + 1, sdpa) for i in range(layers))
        self.final_layernorm = GLMRMSNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def rotary(self, seq_len, n_elem, base=10000):
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float) / n_elem))
        seq_idx = torch.arange(seq_len, dtype=torch.float)
        idx_theta = torch.outer(seq_idx, theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        return cache

    def forward(self, input_ids, labels):
        seq_length = input_ids.shape[1]
        inputs_embeds = self.word_embeddings(input_ids).transpose(0, 1).contiguous()
        rotary_pos_emb = self.rotary(seq_length, self.rot_dim)
        rotary_pos_emb = rotary_pos_emb[None, :seq_length].transpose(0, 1).contiguous()
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, None, rotary_pos_emb)
        hidden_states = self.final_layernorm(hidden_states)
        lm_logits = self.output_layer(hidden_states)
        lm_logits = lm_logits.transpose(0, 1).contiguous()
        lm_logits = lm_logits.to(torch.float32)
        shift_logits = lm_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = nn.CrossEntropyLoss(ignore_index=-100)(shift_logits.view(-1, shift_logits.size(-1)),
                                                      shift_labels.view(-1))
        return loss


def _glm_labels(b=2, s=7):
    y = torch.randint(0, 11, (b, s))
    y[0, -2:] = -100
    return y


# ========================================================================================================
# facebookresearch/dinov2 (dinov2/layers/block.py, attention.py, layer_scale.py)
# ========================================================================================================


class Dinov2Attention(nn.Module):
    """dinov2's Attention (MemEffAttention falls back to it without xFormers)."""

    def __init__(self, dim, num_heads=2, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


class Dinov2LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim) + 0.1)

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


def drop_add_residual_stochastic_depth(x, residual_func, sample_drop_ratio=0.0):
    b, n, d = x.shape
    sample_subset_size = max(int(b * (1 - sample_drop_ratio)), 1)
    brange = (torch.randperm(b, device=x.device))[:sample_subset_size]
    x_subset = x[brange]
    residual = residual_func(x_subset)
    x_flat = x.flatten(1)
    residual = residual.flatten(1)
    residual_scale_factor = b / sample_subset_size
    x_plus_residual = torch.index_add(x_flat, 0, brange, residual.to(dtype=x.dtype),
                                      alpha=residual_scale_factor)
    return x_plus_residual.view_as(x)


class Dinov2Block(nn.Module):
    def __init__(self, dim, num_heads=2, mlp_ratio=2.0, drop_path=0.0, init_values=1e-5, ls_inplace=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Dinov2Attention(dim, num_heads)
        self.ls1 = Dinov2LayerScale(dim, init_values, ls_inplace)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, int(dim * mlp_ratio)), act=nn.GELU(),
                                             fc2=nn.Linear(int(dim * mlp_ratio), dim)))
        self.ls2 = Dinov2LayerScale(dim, init_values, ls_inplace)
        self.sample_drop_ratio = drop_path

    def forward(self, x):
        def attn_residual_func(x):
            return self.ls1(self.attn(self.norm1(x)))

        def ffn_residual_func(x):
            return self.ls2(self.mlp(self.norm2(x)))

        if self.training and self.sample_drop_ratio > 0.1:
            x = drop_add_residual_stochastic_depth(x, residual_func=attn_residual_func,
                                                   sample_drop_ratio=self.sample_drop_ratio)
            x = drop_add_residual_stochastic_depth(x, residual_func=ffn_residual_func,
                                                   sample_drop_ratio=self.sample_drop_ratio)
        else:
            x = x + attn_residual_func(x)
            x = x + ffn_residual_func(x)
        return x


class Dinov2Tiny(nn.Module):
    def __init__(self, dim=16, drop_path=0.0, ls_inplace=False):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 3, stride=3)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.register_tokens = nn.Parameter(torch.randn(1, 2, dim))
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, 10, dim))
        self.blocks = nn.ModuleList(Dinov2Block(dim, drop_path=drop_path, ls_inplace=ls_inplace)
                                    for _ in range(2))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(2 * dim, 5)

    def forward(self, x, labels):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        x = torch.cat((x[:, :1], self.register_tokens.expand(x.shape[0], -1, -1), x[:, 1:]), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x_norm = self.norm(x)
        feats = torch.cat([x_norm[:, 0], x_norm[:, 3:].mean(dim=1)], dim=1)
        logits = self.head(feats)
        return logits, F.cross_entropy(logits, labels)


# ========================================================================================================
# microsoft/Graphormer (graphormer/modules: multihead_attention.py, graphormer_layers.py,
# graphormer_graph_encoder_layer.py)
# ========================================================================================================


class GraphormerMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, query, attn_bias, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        q *= self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_bias is not None:
            attn_weights += attn_bias.view(bsz * self.num_heads, tgt_len, src_len)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                                                    float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)  # fairseq utils.softmax
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class GraphormerGraphAttnBias(nn.Module):
    """GraphAttnBias (multi_hop off): the input attn_bias (-inf at the padded nodes' columns, as the
    collator pads it) repeated over the heads, the spatial-position bias added to [1:, 1:] and the virtual
    graph token's distance to row 0 and column 0 by item assignment, the input bias added again."""

    def __init__(self, num_heads, num_spatial):
        super().__init__()
        self.num_heads = num_heads
        self.spatial_pos_encoder = nn.Embedding(num_spatial, num_heads, padding_idx=0)
        self.graph_token_virtual_distance = nn.Embedding(1, num_heads)

    def forward(self, attn_bias, spatial_pos):
        n_graph, n_node = spatial_pos.size()[:2]
        graph_attn_bias = attn_bias.clone()
        graph_attn_bias = graph_attn_bias.unsqueeze(1).repeat(1, self.num_heads, 1, 1)
        spatial_pos_bias = self.spatial_pos_encoder(spatial_pos).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + spatial_pos_bias
        t = self.graph_token_virtual_distance.weight.view(1, self.num_heads, 1)
        graph_attn_bias[:, :, 1:, 0] = graph_attn_bias[:, :, 1:, 0] + t
        graph_attn_bias[:, :, 0, :] = graph_attn_bias[:, :, 0, :] + t
        graph_attn_bias = graph_attn_bias + attn_bias.unsqueeze(1)
        return graph_attn_bias


class GraphormerEncoderLayer(nn.Module):
    """GraphormerGraphEncoderLayer, post-norm (pre_layernorm False), fairseq's gelu."""

    def __init__(self, dim, ffn, heads):
        super().__init__()
        self.self_attn = GraphormerMultiheadAttention(dim, heads)
        self.dropout_module = nn.Dropout(0.0)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x, self_attn_bias, self_attn_padding_mask):
        residual = x
        x = self.self_attn(x, self_attn_bias, self_attn_padding_mask)
        x = self.dropout_module(x)
        x = residual + x
        x = self.self_attn_layer_norm(x)
        residual = x
        x = F.gelu(self.fc1(x).float()).type_as(x)
        x = self.fc2(x)
        x = residual + x
        return self.final_layer_norm(x)


class GraphormerTiny(nn.Module):
    def __init__(self, num_atoms=9, dim=16, ffn=24, heads=2, num_spatial=6, layers=2):
        super().__init__()
        self.atom_encoder = nn.Embedding(num_atoms, dim, padding_idx=0)
        self.graph_token = nn.Embedding(1, dim)
        self.attn_bias = GraphormerGraphAttnBias(heads, num_spatial)
        self.emb_layer_norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(GraphormerEncoderLayer(dim, ffn, heads) for _ in range(layers))
        self.lm_head_transform_weight = nn.Linear(dim, dim)
        self.layer_norm = nn.LayerNorm(dim)
        self.embed_out = nn.Linear(dim, 1, bias=False)

    def forward(self, x, attn_bias, spatial_pos, y):
        n_graph, n_node = x.size()[:2]
        padding_mask = x[:, :, 0].eq(0)  # B x T x 1
        padding_mask_cls = torch.zeros(n_graph, 1, device=padding_mask.device, dtype=padding_mask.dtype)
        padding_mask = torch.cat((padding_mask_cls, padding_mask), dim=1)
        node_feature = self.atom_encoder(x).sum(dim=-2)
        graph_token_feature = self.graph_token.weight.unsqueeze(0).repeat(n_graph, 1, 1)
        h = torch.cat([graph_token_feature, node_feature], dim=1)
        bias = self.attn_bias(attn_bias, spatial_pos)
        h = self.emb_layer_norm(h)
        h = h.transpose(0, 1)
        for layer in self.layers:
            h = layer(h, self_attn_bias=bias, self_attn_padding_mask=padding_mask)
        h = h.transpose(0, 1)
        h = self.layer_norm(F.gelu(self.lm_head_transform_weight(h)))
        out = self.embed_out(h)[:, 0, :]
        return out, F.l1_loss(out, y)


def _graphormer_inputs():
    n_graph, n_node = 2, 5
    x = torch.randint(1, 9, (n_graph, n_node, 2))
    x[0, 3:] = 0  # the first graph has 3 nodes
    spatial_pos = torch.randint(1, 6, (n_graph, n_node, n_node))
    spatial_pos[0, 3:] = 0
    spatial_pos[0, :, 3:] = 0
    attn_bias = torch.zeros(n_graph, n_node + 1, n_node + 1)
    attn_bias[0, :4, 4:] = float("-inf")  # the collator: -inf at the pad columns of the real rows
    return x, attn_bias, spatial_pos, R(n_graph, 1)


# ========================================================================================================
# pytorch/torchtune: Llama 3 (modules/attention.py, position_embeddings.py, rms_norm.py,
# transformer.py; modules/loss/ce_chunked_output_loss.py)
# ========================================================================================================


class TTRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return x_normed * self.scale


class TTRotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim, max_seq_len=16, base=10_000):
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        seq_idx = torch.arange(max_seq_len, dtype=theta.dtype)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
        self.register_buffer("cache", torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1),
                             persistent=False)

    def forward(self, x, *, input_pos=None):
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                             xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
        x_out = x_out.flatten(3)
        return x_out.type_as(x)


class TTMultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.is_causal = True
        self.attn_dropout = 0.0
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_embeddings = TTRotaryPositionalEmbeddings(head_dim)

    def forward(self, x, y, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        s_y = y.shape[1]
        q = self.q_proj(x)
        q_per_kv = self.num_heads // self.num_kv_heads
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.pos_embeddings(q, input_pos=input_pos)
        q = q.transpose(1, 2)
        k = self.k_proj(y)
        v = self.v_proj(y)
        k = k.view(b, s_y, -1, self.head_dim)
        v = v.view(b, s_y, -1, self.head_dim)
        k = self.pos_embeddings(k, input_pos=input_pos)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                dropout_p=self.attn_dropout if self.training else 0.0,
                                                is_causal=mask is None and self.is_causal)
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class TTTransformerSelfAttentionLayer(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.sa_norm = TTRMSNorm(dim, eps=1e-5)
        self.attn = TTMultiHeadAttention(dim, heads, kv_heads, dim // heads)
        self.mlp_norm = TTRMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.sa_scale = nn.Identity()
        self.mlp_scale = nn.Identity()

    def forward(self, x, *, mask=None, input_pos=None):
        h = self.sa_norm(x)
        attn_out = self.attn(h, h, mask=mask, input_pos=input_pos)
        h = self.sa_scale(attn_out) + x
        mlp_out = self.w2(F.silu(self.w1(self.mlp_norm(h))) * self.w3(self.mlp_norm(h)))
        return h + self.mlp_scale(mlp_out)


class TTCEWithChunkedOutputLoss(nn.Module):
    def __init__(self, num_output_chunks=4, ignore_index=-100):
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def compute_cross_entropy(self, logits, labels):
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")

    def forward(self, logits, labels):
        mask = labels != self.ignore_index
        total_elements = mask.sum()
        labels = [target_chunk.reshape(-1) for target_chunk in labels.chunk(self.num_output_chunks, dim=1)]
        logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels, strict=True):
            total_loss += self.compute_cross_entropy(logits_chunk, labels_chunk)
        return total_loss / total_elements


class TTLlama3(nn.Module):
    """torchtune's TransformerDecoder with num_output_chunks (the output Linear applied per chunk of the
    sequence, a list of logits), and the recipe's loss: the labels shifted by hstack with the ignore cache,
    CEWithChunkedOutputLoss."""

    def __init__(self, vocab=11, dim=32, heads=4, kv_heads=2, hidden=24, layers=2, chunks=4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TTTransformerSelfAttentionLayer(dim, heads, kv_heads, hidden)
                                    for _ in range(layers))
        self.norm = TTRMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.num_output_chunks = chunks
        self.loss_fn = TTCEWithChunkedOutputLoss(chunks)

    def forward(self, tokens, labels):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        output = [self.output(chunk) for chunk in h.chunk(self.num_output_chunks, dim=1)]
        ignore = torch.full((labels.shape[0], 1), -100, dtype=labels.dtype)
        labels = torch.hstack((labels[..., 1:], ignore))
        return self.loss_fn(output, labels)


# ========================================================================================================
# SigLIP as timm / open_clip write it: timm's Block + AttentionPoolLatent (the MAP head), open_clip's
# SigLipLoss
# ========================================================================================================


class TimmAttention(nn.Module):
    def __init__(self, dim, num_heads=2, qkv_bias=True, fused_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class TimmBlock(nn.Module):
    def __init__(self, dim, num_heads=2, fused_attn=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = TimmAttention(dim, num_heads, fused_attn=fused_attn)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, 2 * dim), act=nn.GELU(approximate="tanh"),
                                             fc2=nn.Linear(2 * dim, dim)))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmAttentionPoolLatent(nn.Module):
    """timm's layers/attention_pool.AttentionPoolLatent (SigLIP's MAP head): one learned latent query over
    every token, q and kv Linears, SDPA or manual, the projection, x + mlp(norm(x)), pool 'token'."""

    def __init__(self, in_features, num_heads=2, mlp_ratio=2.0, latent_len=1, fused_attn=True):
        super().__init__()
        embed_dim = in_features
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn
        self.latent_len = latent_len
        self.latent = nn.Parameter(torch.randn(1, latent_len, embed_dim) * embed_dim ** -0.5)
        self.q = nn.Linear(embed_dim, embed_dim, bias=True)
        self.kv = nn.Linear(embed_dim, embed_dim * 2, bias=True)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(embed_dim, int(embed_dim * mlp_ratio)),
                                             act=nn.GELU(approximate="tanh"),
                                             fc2=nn.Linear(int(embed_dim * mlp_ratio), embed_dim)))

    def forward(self, x):
        B, N, C = x.shape
        q_latent = self.latent.expand(B, -1, -1)
        q = self.q(q_latent).reshape(B, self.latent_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, self.latent_len, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class SigLIPTiny(nn.Module):
    """A SigLIP pair: the image tower (patch conv, one timm Block, the final norm, the MAP head), the text
    tower (one Block, the final norm, the last token, a Linear head), F.normalize'd features and open_clip's
    SigLipLoss: -logsigmoid(labels * (logit_scale.exp() * img @ txt.T + logit_bias)).sum() / n, labels
    2 * eye - 1 (no cross-entropy: the loss must stay as written)."""

    def __init__(self, dim=16, vocab=11, fused_attn=True):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 3, stride=3)
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, 9, dim))
        self.visual = TimmBlock(dim, fused_attn=fused_attn)
        self.visual_norm = nn.LayerNorm(dim, eps=1e-6)
        self.attn_pool = TimmAttentionPoolLatent(dim, fused_attn=fused_attn)
        self.token_embedding = nn.Embedding(vocab, dim)
        self.text = TimmBlock(dim, fused_attn=fused_attn)
        self.text_norm = nn.LayerNorm(dim, eps=1e-6)
        self.text_proj = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(10))
        self.logit_bias = nn.Parameter(torch.ones([]) * -10)

    def forward(self, image, text):
        x = self.patch_embed(image).flatten(2).transpose(1, 2) + self.pos_embed
        image_features = self.attn_pool(self.visual_norm(self.visual(x)))
        t = self.text_norm(self.text(self.token_embedding(text)))
        text_features = self.text_proj(t[:, -1])
        image_features = F.normalize(image_features, dim=-1)
        text_features = F.normalize(text_features, dim=-1)
        logits = self.logit_scale.exp() * image_features @ text_features.T + self.logit_bias
        n = logits.shape[0]
        labels = 2 * torch.eye(n, dtype=logits.dtype) - torch.ones(n, n, dtype=logits.dtype)
        loss = -F.logsigmoid(labels * logits).sum() / image_features.shape[0]
        return logits, loss


# ========================================================================================================
# The table
# ========================================================================================================


def _ids(b=2, s=7, vocab=11):
    return torch.randint(0, vocab, (b, s))


_ZEROED = "probabilities zeroed at the masked keys after the softmax"

# name: (model and inputs, rewrites per family (the others 0), near misses (family, words of the reason),
# words the report must hold). Every count was checked by reading the module.
CASES = {
    # per layer 5 LayerNorms (the macaron FFN's plain, then 4 with the residual sums), after_norm plain;
    # SiLU FFNs (no GELU), the CTC head's log_softmax (no loss). The rel-pos scores (ac + bd) / sqrt(d)
    # are two matmuls: a near miss each (findings Z2)
    "wenet_conformer_rel_pos": _case(lambda: (WenetConformer(), (R(2, 7, 12), _lens(7, 5))),
                                     dict(norm=11),
                                     (("attention", "cannot tell the scores from the mask"),) * 2),
    # ESPnet's finfo.min fill (wenet's -inf: tests/test_attention_pass_s33.py), the probabilities zeroed
    # after the softmax (Z1, FIXED)
    "espnet_conformer_abs_pos": _case(
        lambda: (WenetConformer(rel_pos=False, fill=None), (R(2, 7, 12), _lens(7, 5))),
        dict(attention=2, norm=11), words=[_ZEROED, "mask [2, 1, 1, 7]"]),
    # 'ijbn' scores, softmax over dim 1: a near miss per layer; 2 post-norms per layer; ReLU FFN; the
    # loss by gather of log_softmax (no candidate)
    "transformer_xl": _case(lambda: (TXLMemTransformerLM(), (_ids(7, 2), _ids(7, 2))), dict(norm=4),
                            (("attention", "softmax over dim 1 of the 4-d scores"),) * 2),
    # channels-first attention (T1, FIXED: no candidate before); norms: 2 LayerNorm2d per block (the
    # residual sums are NCHW: not folded, s32's N2), the head's LayerNorm; 1x1-conv MLP: no Linear
    "maxvit_attention2d": _case(lambda: (MaxxVitTiny(), (R(2, 3, 9, 9), _labels(2))),
                                dict(attention=2, norm=5, cross_entropy=1), words=["mask [1, 2, 9, 9]"]),
    "maxvit_attention2d_fused": _case(lambda: (MaxxVitTiny(fused_attn=True), (R(2, 3, 9, 9), _labels(2))),
                                      dict(attention=2, norm=5, cross_entropy=1)),
    # v wider than q / k, the bias table gathered (cached per device in eval); BatchNorm only; the loss over
    # the average of two heads: reported
    "levit": _case(lambda: (LeViTTiny(), (R(2, 3, 9, 9), _labels(2))), dict(attention=2),
                   (("cross_entropy", "the logits pass through div"),), words=["mask [2, 9, 9]"]),
    # joint attention (SDPA) in each block; norms: 4 LayerNorms and 4 QK RMSNorms in the double block, the
    # single block's pre_norm and 2 QK norms, norm_final; tanh GELU MLPs of the double block (the single
    # block's GELU takes part of linear1's output: no candidate)
    "flux": _case(lambda: (FluxTiny(), _flux_inputs()), dict(attention=2, norm=12, dense=2)),
    # per layer the Attention's own LayerNorm (the first plain) and the FeedForward's with the sum; the
    # patch embedding's two norms and the final norm
    "vit_pytorch_vit": _case(lambda: (VPViT(), (R(2, 3, 9, 9), _labels(2))),
                             dict(attention=2, norm=7, dense=2, cross_entropy=1),
                             words=["softmax(matmul) -> flash_attention(scale=0.3536)"]),
    # the block-diagonal image mask and the pooling mask (-finfo.max fills); norms: 2 patch embedding, 2
    # per layer, the final, the pool's Attention norm, the head's (q / k F.normalize RMSNorms: no candidate)
    "vit_pytorch_navit": _case(lambda: (NaViTTiny(), _navit_inputs()),
                               dict(attention=3, norm=9, dense=2, cross_entropy=1),
                               words=["mask [2, 1, 2, 9]"]),
    # re-attention mixes the heads' probabilities: refused; the LayerNorm over the heads is a norm
    "vit_pytorch_deepvit": _case(lambda: (DeepViTBlock(), (R(2, 7, 16),)), dict(norm=3, dense=1),
                                 (("attention", "is not probabilities·v"),)),
    # SDPA is_causal; RMSNorms: 2 per block (the second with the sum), the final; SwiGLU: no candidate;
    # the loss over the transposed fp32 logits, shifted (findings C1, FIXED: the rows' permutation replayed)
    "chatglm": _case(lambda: (ChatGLMTiny(), (_ids(), _glm_labels())),
                     dict(attention=2, norm=5, cross_entropy=1),
                     words=["F.linear -> transpose -> contiguous -> to -> getitem"]),
    # baddbmm beta 0 with alpha 1 / (sqrt(hn) * layer), the fp32 scores times the layer number, the
    # in-graph ones().tril_() mask inverted: causal at scale 1 / sqrt(hn)
    "chatglm_baddbmm": _case(lambda: (ChatGLMTiny(sdpa=False), (_ids(), _glm_labels())),
                             dict(attention=2, norm=5, cross_entropy=1),
                             words=["softmax(baddbmm) -> flash_attention(scale=0.3536, causal)"]),
    # norms: norm1 (the first on the token concatenation), norm2 and the next norm1 with the sums, the
    # final norm with the last sum
    "dinov2": _case(lambda: (Dinov2Tiny(), (R(2, 3, 9, 9), _labels(2))),
                    dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    "dinov2_layerscale_inplace": _case(lambda: (Dinov2Tiny(ls_inplace=True), (R(2, 3, 9, 9), _labels(2))),
                                       dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    # the graph bias (item assignments, -inf columns) requires grad; the key padding mask; post-norm:
    # emb_layer_norm, 2 per layer with the sums, the head's; fairseq's gelu(x.float()).type_as(x) and the
    # head's GELU
    "graphormer": _case(lambda: (GraphormerTiny(), _graphormer_inputs()), dict(attention=2, norm=6, dense=3),
                        words=["mask [2, 2, 6, 6]"]),
    # GQA by unsqueeze / expand / flatten: un-repeated; RMSNorms: sa_norm, mlp_norm (read twice: one
    # norm), the final; the output Linear per chunk, each chunk's loss
    "torchtune_llama3_chunked_ce": _case(lambda: (TTLlama3(), (_ids(2, 8), _ids(2, 8))),
                                         dict(attention=2, norm=7, cross_entropy=4),
                                         words=["gqa: k/v un-repeated"]),
    # the sigmoid loss is no cross-entropy; 3 attentions (2 towers, the MAP head), norms: 2 per Block, the
    # 2 final norms, the MAP head's; tanh GELU MLPs
    "siglip": _case(lambda: (SigLIPTiny(), (R(2, 3, 9, 9), _ids(2, 5))), dict(attention=3, norm=7, dense=3)),
    "siglip_manual": _case(lambda: (SigLIPTiny(fused_attn=False), (R(2, 3, 9, 9), _ids(2, 5))),
                           dict(attention=3, norm=7, dense=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_codebase_block(name):
    make, rewrites, near_misses, words = CASES[name]
    model, args = make()
    report = _check_block(model, args, rewrites, near_misses)
    for w in words:
        assert w in str(report), str(report)


# ========================================================================================================
# Beyond the table: randomness, dynamic shapes
# ========================================================================================================


def test_dinov2_stochastic_depth_adds_a_random_subset_with_index_add():
    """DINOv2 with drop_path 0.4 in training: drop_add_residual_stochastic_depth draws a randperm of the
    batch, runs the branch on that subset and index_adds it (scaled) into x. The norms read x[brange] (no
    residual add to fold); the index_add is no residual add either. Same draws from the same seed."""
    model = Dinov2Tiny(drop_path=0.4).train()
    args = (R(4, 3, 9, 9), _labels(4))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)
    with collecting() as report:
        torch.manual_seed(5)
        got = _run(compiled, args, True)
    torch.manual_seed(5)
    want = _run(model, args, True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{m}\n{report}")
    flash = counters["flash"]
    assert (flash["attention"], flash["norm"], flash["dense"], flash["cross_entropy"]) == (2, 5, 2, 1), \
        str(report)
    assert not report.near_misses, str(report)


def test_espnet_conformer_under_dynamic_shapes():
    argsets = [(R(2, t, 12), _lens(t, t - 2)) for t in (5, 7, 9)]
    report = _dynamic_check(WenetConformer(rel_pos=False, fill=None), argsets, True)
    assert _ZEROED in str(report) and not report.near_misses, str(report)
    assert counters["flash"]["attention"] >= 2, str(report)


def test_maxvit_attention2d_under_dynamic_shapes():
    """The window is fixed by the position bias table (3 x 3): the batch varies."""
    argsets = [(R(b, 3, 9, 9), _labels(b)) for b in (2, 3, 5)]
    report = _dynamic_check(MaxxVitTiny(), argsets, True)
    assert counters["flash"]["attention"] >= 2, str(report)
