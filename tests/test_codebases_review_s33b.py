"""Review (session 33, second batch) of the four pass families on blocks of code bases no earlier review
wrote, each written tiny and as its authors write it: HF diffusers' Attention with its processors (the VAE's
group-normed spatial attention with residual_connection and rescale_output_factor, AttnProcessor2_0 and the
classic baddbmm AttnProcessor with upcast_attention / upcast_softmax; the UNet's Transformer2DModel with
BasicTransformerBlock, GEGLU and an encoder_attention_mask through prepare_attention_mask; PixArt-α's
ada_norm_single block with the scale_shift_table, caption projection and the final layer), Mask2Former's
masked-attention decoder (the fully masked rows reset by item assignment at torch.where's indices), BLIP-2's
Q-Former layer (BERT-style self-attention over queries and text, cross-attention of the queries to the image
features), LLaVA's mlp2x_gelu projector over a CLIP vision tower with the image tokens spliced into the text
and the shifted loss, OWL-ViT (HF CLIP's bmm attention with the causal mask built by fill_ + triu_ and the
padding mask, the class and box heads), TimeSformer's divided space-time attention, MobileViT (unfolding /
folding of patches around a transformer) and MobileViTv2's separable linear attention, Twins (locally
grouped and global sub-sampled attention, the PEG) and PVTv2's linear spatial-reduction attention, CrossViT's
cross-attention of the CLS token across branches, AudioCraft / MusicGen's streaming transformer layer (the
custom causal mask with past keys, einsum attention, cross-attention to the conditions, LayerScale), SAM 2's
memory attention (axial RoPE on q and on the repeated keys, the object-pointer keys excluded from RoPE by
item assignment) and SpeechT5's encoder layer (relative position bias from an Embedding, q·posᵀ).

Each block is compiled with the rewrite-only backend (fullgraph where dynamo allows; the rewritten graph runs
as plain PyTorch, the flash ops on their CPU reference) and compared with eager: in training the outputs and
the gradients of every input and parameter, in eval the outputs, fp32 at 5e-5. The rewrites per family are
asserted exactly, and so are the near misses with their reasons (tests/test_codebases_review_s31.py's
harness).

Findings: tests/findings/codebase_review_s33b.md.
"""

from __future__ import annotations

import math

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
# HF diffusers: Attention + AttnProcessor2_0 / AttnProcessor (models/attention_processor.py)
# ========================================================================================================


class DiffusersAttention(nn.Module):
    """diffusers' Attention with the processor's code inlined: AttnProcessor2_0 (SDPA) or the classic
    AttnProcessor (head_to_batch_dim, get_attention_scores by baddbmm into torch.empty with beta 0 or the
    mask with beta 1, upcast_attention / upcast_softmax, bmm, batch_to_head_dim). 4-d inputs (B, C, H, W)
    go through view + transpose; group_norm over the channels, residual_connection, rescale_output_factor."""

    def __init__(self, query_dim, cross_attention_dim=None, heads=2, dim_head=8, norm_num_groups=None,
                 residual_connection=False, rescale_output_factor=1.0, upcast_attention=False,
                 upcast_softmax=False, processor="2_0", bias=False, out_bias=True, eps=1e-5):
        super().__init__()
        self.inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head**-0.5
        self.upcast_attention, self.upcast_softmax = upcast_attention, upcast_softmax
        self.residual_connection, self.rescale_output_factor = residual_connection, rescale_output_factor
        self.processor = processor
        cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.group_norm = (
            nn.GroupNorm(num_channels=query_dim, num_groups=norm_num_groups, eps=eps, affine=True)
            if norm_num_groups is not None else None)
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(cross_attention_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(cross_attention_dim, self.inner_dim, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, query_dim, bias=out_bias), nn.Dropout(0.0)])

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        head_size = self.heads
        if attention_mask is None:
            return attention_mask
        current_length = attention_mask.shape[-1]
        if current_length != target_length:
            attention_mask = F.pad(attention_mask, (0, target_length), value=0.0)
        if out_dim == 3:
            if attention_mask.shape[0] < batch_size * head_size:
                attention_mask = attention_mask.repeat_interleave(
                    head_size, dim=0, output_size=attention_mask.shape[0] * head_size)
        elif out_dim == 4:
            attention_mask = attention_mask.unsqueeze(1)
            attention_mask = attention_mask.repeat_interleave(head_size, dim=1)
        return attention_mask

    def head_to_batch_dim(self, tensor, out_dim=3):
        head_size = self.heads
        if tensor.ndim == 3:
            batch_size, seq_len, dim = tensor.shape
            extra_dim = 1
        else:
            batch_size, extra_dim, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len * extra_dim, head_size, dim // head_size)
        tensor = tensor.permute(0, 2, 1, 3)
        if out_dim == 3:
            tensor = tensor.reshape(batch_size * head_size, seq_len * extra_dim, dim // head_size)
        return tensor

    def batch_to_head_dim(self, tensor):
        head_size = self.heads
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // head_size, head_size, seq_len, dim)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size // head_size, seq_len, dim * head_size)

    def get_attention_scores(self, query, key, attention_mask=None):
        dtype = query.dtype
        if self.upcast_attention:
            query = query.float()
            key = key.float()
        if attention_mask is None:
            baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype,
                                        device=query.device)
            beta = 0
        else:
            baddbmm_input = attention_mask
            beta = 1
        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta,
                                         alpha=self.scale)
        del baddbmm_input
        if self.upcast_softmax:
            attention_scores = attention_scores.float()
        attention_probs = attention_scores.softmax(dim=-1)
        del attention_scores
        return attention_probs.to(dtype)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (hidden_states.shape if encoder_hidden_states is None
                                          else encoder_hidden_states.shape)
        if self.processor == "2_0":
            if attention_mask is not None:
                attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
                attention_mask = attention_mask.view(batch_size, self.heads, -1, attention_mask.shape[-1])
        else:
            attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if self.group_norm is not None:
            hidden_states = self.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = self.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)
        if self.processor == "2_0":
            inner_dim = key.shape[-1]
            head_dim = inner_dim // self.heads
            query = query.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
            key = key.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
            value = value.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
            hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=0.0, is_causal=False)
            hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
            hidden_states = hidden_states.to(query.dtype)
        else:
            query = self.head_to_batch_dim(query)
            key = self.head_to_batch_dim(key)
            value = self.head_to_batch_dim(value)
            attention_probs = self.get_attention_scores(query, key, attention_mask)
            hidden_states = torch.bmm(attention_probs, value)
            hidden_states = self.batch_to_head_dim(hidden_states)
        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if self.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / self.rescale_output_factor


class DiffusersResnetBlock2D(nn.Module):
    """diffusers' ResnetBlock2D (no time embedding, as in the VAE): GroupNorm, SiLU, conv, twice, the
    shortcut added and divided by output_scale_factor."""

    def __init__(self, channels, groups=4, output_scale_factor=1.0):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels, eps=1e-6)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels, eps=1e-6)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.output_scale_factor = output_scale_factor

    def forward(self, input_tensor):
        h = self.conv1(F.silu(self.norm1(input_tensor)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (input_tensor + h) / self.output_scale_factor


class DiffusersVAEMidBlock(nn.Module):
    """UNetMidBlock2D as the VAE's encoder / decoder use it: resnet, Attention(heads = C / head_dim,
    norm_num_groups, residual_connection=True, bias=True, upcast_softmax=True), resnet."""

    def __init__(self, channels=16, groups=4, processor="2_0", rescale=1.0, upcast_attention=False):
        super().__init__()
        self.resnets = nn.ModuleList([DiffusersResnetBlock2D(channels, groups, rescale),
                                      DiffusersResnetBlock2D(channels, groups, rescale)])
        self.attention = DiffusersAttention(channels, heads=channels // 8, dim_head=8, norm_num_groups=groups,
                                            residual_connection=True, rescale_output_factor=rescale,
                                            upcast_softmax=True, upcast_attention=upcast_attention,
                                            processor=processor, bias=True, eps=1e-6)

    def forward(self, hidden_states):
        hidden_states = self.resnets[0](hidden_states)
        hidden_states = self.attention(hidden_states)
        return self.resnets[1](hidden_states)


class DiffusersGEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, hidden_states):
        hidden_states, gate = self.proj(hidden_states).chunk(2, dim=-1)
        return hidden_states * F.gelu(gate)


class DiffusersGELU(nn.Module):
    """diffusers' activations.GELU: a Linear then F.gelu (approximate 'none' or 'tanh')."""

    def __init__(self, dim_in, dim_out, approximate="none"):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, hidden_states):
        return F.gelu(self.proj(hidden_states), approximate=self.approximate)


class DiffusersFeedForward(nn.Module):
    def __init__(self, dim, mult=4, activation_fn="geglu"):
        super().__init__()
        inner_dim = int(dim * mult)
        if activation_fn == "geglu":
            act_fn = DiffusersGEGLU(dim, inner_dim)
        else:
            act_fn = DiffusersGELU(dim, inner_dim, approximate="tanh")
        self.net = nn.ModuleList([act_fn, nn.Dropout(0.0), nn.Linear(inner_dim, dim)])

    def forward(self, hidden_states):
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


class DiffusersBasicTransformerBlock(nn.Module):
    """BasicTransformerBlock, norm_type 'layer_norm' (the SD UNet's) or 'ada_norm_single' (PixArt-α: the
    scale_shift_table plus the timestep's 6·dim, no norm before attn2, norm2 before the feed-forward)."""

    def __init__(self, dim, heads, dim_head, cross_attention_dim, norm_type="layer_norm",
                 activation_fn="geglu"):
        super().__init__()
        self.norm_type = norm_type
        affine = norm_type != "ada_norm_single"
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=affine, eps=1e-5 if affine else 1e-6)
        self.attn1 = DiffusersAttention(dim, heads=heads, dim_head=dim_head)
        if norm_type == "layer_norm":
            self.norm2 = nn.LayerNorm(dim)
        self.attn2 = DiffusersAttention(dim, cross_attention_dim=cross_attention_dim, heads=heads,
                                        dim_head=dim_head)
        if norm_type == "layer_norm":
            self.norm3 = nn.LayerNorm(dim)
        else:
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)
        self.ff = DiffusersFeedForward(dim, activation_fn=activation_fn)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, timestep=None):
        batch_size = hidden_states.shape[0]
        if self.norm_type == "ada_norm_single":
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
                self.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)).chunk(6, dim=1)
            norm_hidden_states = self.norm1(hidden_states)
            norm_hidden_states = norm_hidden_states * (1 + scale_msa) + shift_msa
            norm_hidden_states = norm_hidden_states.squeeze(1)
        else:
            norm_hidden_states = self.norm1(hidden_states)
        attn_output = self.attn1(norm_hidden_states, attention_mask=attention_mask)
        if self.norm_type == "ada_norm_single":
            attn_output = gate_msa * attn_output
        hidden_states = attn_output + hidden_states
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        if self.norm_type == "layer_norm":
            norm_hidden_states = self.norm2(hidden_states)
        else:  # For PixArt norm2 isn't applied here
            norm_hidden_states = hidden_states
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 attention_mask=encoder_attention_mask)
        hidden_states = attn_output + hidden_states
        if self.norm_type == "ada_norm_single":
            norm_hidden_states = self.norm2(hidden_states)
            norm_hidden_states = norm_hidden_states * (1 + scale_mlp) + shift_mlp
        else:
            norm_hidden_states = self.norm3(hidden_states)
        ff_output = self.ff(norm_hidden_states)
        if self.norm_type == "ada_norm_single":
            ff_output = gate_mlp * ff_output
        hidden_states = ff_output + hidden_states
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        return hidden_states


def diffusers_encoder_attention_mask(encoder_attention_mask, dtype):
    """UNet2DConditionModel.forward (and the Transformer2DModel): a keep mask (1 keep, 0 discard) turned into
    a bias, (1 - mask) * -10000.0, with a singleton query dim."""
    encoder_attention_mask = (1 - encoder_attention_mask.to(dtype)) * -10000.0
    return encoder_attention_mask.unsqueeze(1)


class DiffusersTransformer2DModel(nn.Module):
    """Transformer2DModel (continuous input, use_linear_projection=True as SD 2.x): GroupNorm(eps 1e-6),
    the (B, C, H, W) -> (B, HW, C) permute, proj_in, one BasicTransformerBlock (GEGLU), proj_out, back, the
    residual; the encoder_attention_mask prepared as the UNet does."""

    def __init__(self, in_channels=16, heads=2, dim_head=8, cross_attention_dim=12, groups=4):
        super().__init__()
        inner_dim = heads * dim_head
        self.norm = nn.GroupNorm(num_groups=groups, num_channels=in_channels, eps=1e-6, affine=True)
        self.proj_in = nn.Linear(in_channels, inner_dim)
        self.transformer_blocks = nn.ModuleList([
            DiffusersBasicTransformerBlock(inner_dim, heads, dim_head, cross_attention_dim)])
        self.proj_out = nn.Linear(inner_dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask):
        encoder_attention_mask = diffusers_encoder_attention_mask(encoder_attention_mask, hidden_states.dtype)
        batch, _, height, width = hidden_states.shape
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        inner_dim = hidden_states.shape[1]
        hidden_states = hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
        hidden_states = self.proj_in(hidden_states)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask)
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch, height, width, inner_dim).permute(0, 3, 1, 2)
        hidden_states = hidden_states.contiguous()
        return hidden_states + residual


def diffusers_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0,
                                 max_period=10000):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    return emb


class PixArtTiny(nn.Module):
    """PixArtTransformer2DModel, tiny: PatchEmbed (conv, flatten, transpose, + sincos pos), AdaLayerNormSingle
    (Timesteps, TimestepEmbedding Linear-SiLU-Linear, SiLU, Linear to 6·dim), the caption projection
    (Linear, tanh GELU, Linear), one ada_norm_single block with the caption's mask, the final layer
    (scale_shift_table + embedded_timestep, norm_out, modulation, proj_out) and unpatchify."""

    def __init__(self, in_channels=4, patch=2, heads=2, dim_head=8, caption_channels=12):
        super().__init__()
        dim = heads * dim_head
        self.dim, self.patch, self.out_channels = dim, patch, in_channels
        self.proj = nn.Conv2d(in_channels, dim, patch, patch)
        self.register_buffer("pos_embed", torch.randn(1, 16, dim) * 0.1, persistent=False)
        self.t_linear_1, self.t_linear_2 = nn.Linear(32, dim), nn.Linear(dim, dim)
        self.adaln_linear = nn.Linear(dim, 6 * dim)
        self.caption_linear_1 = nn.Linear(caption_channels, dim)
        self.caption_linear_2 = nn.Linear(dim, dim)
        self.transformer_blocks = nn.ModuleList([
            DiffusersBasicTransformerBlock(dim, heads, dim_head, dim, norm_type="ada_norm_single",
                                           activation_fn="gelu-approximate")])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.proj_out = nn.Linear(dim, patch * patch * in_channels)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask):
        encoder_attention_mask = diffusers_encoder_attention_mask(encoder_attention_mask, hidden_states.dtype)
        batch_size = hidden_states.shape[0]
        height, width = hidden_states.shape[-2] // self.patch, hidden_states.shape[-1] // self.patch
        hidden_states = self.proj(hidden_states).flatten(2).transpose(1, 2) + self.pos_embed
        t_emb = diffusers_timestep_embedding(timestep, 32)
        embedded_timestep = self.t_linear_2(F.silu(self.t_linear_1(t_emb)))
        timestep = self.adaln_linear(F.silu(embedded_timestep))
        encoder_hidden_states = self.caption_linear_2(
            F.gelu(self.caption_linear_1(encoder_hidden_states), approximate="tanh"))
        encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.shape[-1])
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, timestep=timestep)
        shift, scale = (self.scale_shift_table[None] + embedded_timestep[:, None].to(
            self.scale_shift_table.device)).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states)
        hidden_states = hidden_states * (1 + scale.to(hidden_states.device)) + shift.to(hidden_states.device)
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.squeeze(1)
        hidden_states = hidden_states.reshape(-1, height, width, self.patch, self.patch, self.out_channels)
        hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
        return hidden_states.reshape(-1, self.out_channels, height * self.patch, width * self.patch)


def _keep(b, n, pad):
    """A keep mask (1 keep, 0 pad) with `pad` padded tokens at the end of the second row."""
    mask = torch.ones(b, n)
    mask[1, n - pad:] = 0
    return mask


# ========================================================================================================
# Mask2Former (mask2former/modeling/transformer_decoder/mask2former_transformer_decoder.py)
# ========================================================================================================


class M2FSelfAttentionLayer(nn.Module):
    """Post-norm (normalize_before=False): nn.MultiheadAttention (sequence first, need_weights left True),
    query_pos added to q and k."""

    def __init__(self, d_model, nhead):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(0.0)

    def forward(self, tgt, tgt_mask=None, tgt_key_padding_mask=None, query_pos=None):
        q = k = tgt if query_pos is None else tgt + query_pos
        tgt2 = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        tgt = tgt + self.dropout(tgt2)
        return self.norm(tgt)


class M2FCrossAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead):
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(0.0)

    def forward(self, tgt, memory, memory_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        tgt2 = self.multihead_attn(query=tgt + query_pos, key=memory + pos, value=memory,
                                   attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask)[0]
        tgt = tgt + self.dropout(tgt2)
        return self.norm(tgt)


class M2FFFNLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward):
        super().__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(0.0)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt):
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        tgt = tgt + self.dropout(tgt2)
        return self.norm(tgt)


class M2FMLP(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k)
                                    for n, k in zip([input_dim] + h, h + [output_dim], strict=True))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class Mask2FormerDecoderTiny(nn.Module):
    """MultiScaleMaskedTransformerDecoder, one level and one layer: the prediction heads on the normed
    queries give the mask logits (einsum with the mask features), interpolated to the level's size,
    thresholded (sigmoid < 0.5), repeated over the heads; rows with every key masked are reset by
    `attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False` (`reset="all"` writes it
    `attn_mask & ~attn_mask.all(-1, keepdim=True)`, the same values, no data-dependent shape); then masked
    cross-attention, self-attention, FFN; the final prediction heads."""

    def __init__(self, hidden_dim=16, num_queries=5, nheads=2, num_classes=4, reset="where"):
        super().__init__()
        self.num_heads, self.reset = nheads, reset
        self.query_feat = nn.Embedding(num_queries, hidden_dim)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.level_embed = nn.Embedding(1, hidden_dim)
        self.cross = M2FCrossAttentionLayer(hidden_dim, nheads)
        self.self_attn = M2FSelfAttentionLayer(hidden_dim, nheads)
        self.ffn = M2FFFNLayer(hidden_dim, 32)
        self.decoder_norm = nn.LayerNorm(hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.mask_embed = M2FMLP(hidden_dim, hidden_dim, hidden_dim, 3)

    def forward_prediction_heads(self, output, mask_features, attn_mask_target_size):
        decoder_output = self.decoder_norm(output)
        decoder_output = decoder_output.transpose(0, 1)
        outputs_class = self.class_embed(decoder_output)
        mask_embed = self.mask_embed(decoder_output)
        outputs_mask = torch.einsum("bqc,bchw->bqhw", mask_embed, mask_features)
        attn_mask = F.interpolate(outputs_mask, size=attn_mask_target_size, mode="bilinear",
                                  align_corners=False)
        attn_mask = (attn_mask.sigmoid().flatten(2).unsqueeze(1).repeat(1, self.num_heads, 1, 1).flatten(0, 1)
                     < 0.5).bool()
        attn_mask = attn_mask.detach()
        return outputs_class, outputs_mask, attn_mask

    def forward(self, x, mask_features, pos):
        size = x.shape[-2:]
        bs = x.shape[0]
        src = x.flatten(2) + self.level_embed.weight[0][None, :, None]
        src = src.permute(2, 0, 1)  # HW x B x C
        pos = pos.flatten(2).permute(2, 0, 1)
        query_embed = self.query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
        output = self.query_feat.weight.unsqueeze(1).repeat(1, bs, 1)
        outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(output, mask_features, size)
        if self.reset == "where":
            attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
        else:
            attn_mask = attn_mask & ~attn_mask.all(-1, keepdim=True)
        output = self.cross(output, src, memory_mask=attn_mask, memory_key_padding_mask=None, pos=pos,
                            query_pos=query_embed)
        output = self.self_attn(output, tgt_mask=None, tgt_key_padding_mask=None, query_pos=query_embed)
        output = self.ffn(output)
        outputs_class2, outputs_mask2, _ = self.forward_prediction_heads(output, mask_features, size)
        return outputs_class, outputs_mask, outputs_class2, outputs_mask2


def _m2f_inputs(b=2):
    # mask features nearly constant over the map: a query's mask logits then have one sign almost
    # everywhere, so some queries mask every key (the rows Mask2Former resets) and others keep some
    return R(b, 16, 3, 3), 3 * R(b, 16, 1, 1) + 0.3 * R(b, 16, 6, 6), R(b, 16, 3, 3)


# ========================================================================================================
# BLIP-2 Q-Former (LAVIS lavis/models/blip2_models/Qformer.py, BERT-style)
# ========================================================================================================


class QFormerSelfAttention(nn.Module):
    """BertSelfAttention of the Q-Former: transpose_for_scores, matmul, / sqrt(head size), + the extended
    mask, nn.Softmax(dim=-1), dropout, matmul; cross-attention takes key / value from the image features
    (encoder_width wide)."""

    def __init__(self, hidden_size, heads, is_cross_attention=False, encoder_width=None):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden_size // heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        kv_width = encoder_width if is_cross_attention else hidden_size
        self.key = nn.Linear(kv_width, hidden_size)
        self.value = nn.Linear(kv_width, hidden_size)
        self.dropout = nn.Dropout(0.0)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None):
        is_cross_attention = encoder_hidden_states is not None
        if is_cross_attention:
            key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
            value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
            attention_mask = encoder_attention_mask
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs_dropped = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs_dropped, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class QFormerSelfOutput(nn.Module):
    """BertSelfOutput / BertOutput: dense, dropout, LayerNorm(hidden + input_tensor)."""

    def __init__(self, in_size, hidden_size):
        super().__init__()
        self.dense = nn.Linear(in_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class QFormerAttention(nn.Module):
    def __init__(self, hidden_size, heads, is_cross_attention=False, encoder_width=None):
        super().__init__()
        self.self = QFormerSelfAttention(hidden_size, heads, is_cross_attention, encoder_width)
        self.output = QFormerSelfOutput(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask)
        return self.output(self_outputs, hidden_states)


class QFormerIntermediate(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.dense = nn.Linear(hidden_size, intermediate_size)

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))


class QFormerLayer(nn.Module):
    """The Q-Former's BertLayer with cross-attention (cross_attention_freq 2, layer 0): self-attention over
    cat(query tokens, text), the query part cross-attends to the image, the query and the text parts each
    through their own feed-forward (intermediate_query / output_query), concatenated back."""

    def __init__(self, hidden_size, heads, encoder_width, intermediate_size):
        super().__init__()
        self.attention = QFormerAttention(hidden_size, heads)
        self.crossattention = QFormerAttention(hidden_size, heads, is_cross_attention=True,
                                               encoder_width=encoder_width)
        self.intermediate = QFormerIntermediate(hidden_size, intermediate_size)
        self.output = QFormerSelfOutput(intermediate_size, hidden_size)
        self.intermediate_query = QFormerIntermediate(hidden_size, intermediate_size)
        self.output_query = QFormerSelfOutput(intermediate_size, hidden_size)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                query_length):
        attention_output = self.attention(hidden_states, attention_mask)
        query_attention_output = attention_output[:, :query_length, :]
        query_attention_output = self.crossattention(query_attention_output, attention_mask,
                                                     encoder_hidden_states, encoder_attention_mask)
        layer_output = self.output_query(self.intermediate_query(query_attention_output),
                                         query_attention_output)
        if attention_output.shape[1] > query_length:
            text = attention_output[:, query_length:, :]
            layer_output_text = self.output(self.intermediate(text), text)
            layer_output = torch.cat([layer_output, layer_output_text], dim=1)
        return layer_output


def get_extended_attention_mask(attention_mask, dtype):
    """BertModel.get_extended_attention_mask of a (B, S) keep mask: (1 - m) * -10000 with two singleton
    dims."""
    extended_attention_mask = attention_mask[:, None, None, :].to(dtype=dtype)
    return (1.0 - extended_attention_mask) * -10000.0


class Blip2QFormerTiny(nn.Module):
    """Blip2's Q-Former path: the vision features through ln_vision, the learned query tokens expanded over
    the batch and concatenated with the text embeddings (BertEmbeddings' LayerNorm of the concatenation),
    one Q-Former layer with cross-attention, the query outputs projected (vision_proj) and normalised."""

    def __init__(self, hidden_size=16, heads=2, vision_width=12, num_query_token=4, vocab=11):
        super().__init__()
        self.ln_vision = nn.LayerNorm(vision_width)
        self.query_tokens = nn.Parameter(torch.randn(1, num_query_token, hidden_size) * 0.02)
        self.word_embeddings = nn.Embedding(vocab, hidden_size)
        self.position_embeddings = nn.Embedding(16, hidden_size)
        self.emb_layernorm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.layer = QFormerLayer(hidden_size, heads, vision_width, 32)
        self.vision_proj = nn.Linear(hidden_size, 8)

    def forward(self, image_embeds, input_ids, text_attention_mask):
        image_embeds = self.ln_vision(image_embeds)
        image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long, device=image_embeds.device)
        query_tokens = self.query_tokens.expand(image_embeds.shape[0], -1, -1)
        query_length = query_tokens.shape[1]
        seq_length = input_ids.size(1)
        position_ids = torch.arange(seq_length, device=input_ids.device)[None]
        text = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        embeddings = self.emb_layernorm(torch.cat((query_tokens, text), dim=1))
        query_atts = torch.ones(query_tokens.size()[:-1], dtype=torch.long, device=image_embeds.device)
        attention_mask = torch.cat([query_atts, text_attention_mask], dim=1)
        extended = get_extended_attention_mask(attention_mask, embeddings.dtype)
        encoder_extended = get_extended_attention_mask(image_atts, embeddings.dtype)
        out = self.layer(embeddings, extended, image_embeds, encoder_extended, query_length)
        return F.normalize(self.vision_proj(out[:, :query_length, :]), dim=-1), out[:, query_length:]


# ========================================================================================================
# HF CLIP (the bmm CLIPAttention of transformers 4.x) for LLaVA's vision tower and OWL-ViT
# ========================================================================================================


class HFCLIPAttention(nn.Module):
    """transformers 4.3x CLIPAttention: q scaled after the projection, _shape, the (B·H, T, d) views, bmm,
    the causal mask and the attention mask each added through a 4-d view and viewed back, softmax, dropout,
    bmm, the view / transpose / reshape back."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.dropout = 0.0
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if causal_attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + causal_attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_probs = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


class HFCLIPEncoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, intermediate_size, act=quick_gelu):
        super().__init__()
        self.self_attn = HFCLIPAttention(embed_dim, num_heads)
        self.layer_norm1 = nn.LayerNorm(embed_dim, eps=1e-5)
        self.fc1 = nn.Linear(embed_dim, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, embed_dim)
        self.act = act
        self.layer_norm2 = nn.LayerNorm(embed_dim, eps=1e-5)

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None):
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask, causal_attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        hidden_states = self.fc2(self.act(self.fc1(hidden_states)))
        return residual + hidden_states


class HFCLIPVisionTiny(nn.Module):
    """CLIPVisionTransformer: patch conv, class embedding, positions, pre_layrnorm (sic), the encoder layers;
    returns the hidden states of every layer (LLaVA reads the penultimate one)."""

    def __init__(self, dim=16, heads=2, layers=2, patch=3, image=9, act=quick_gelu):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, dim, patch, patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(dim))
        self.position_embedding = nn.Embedding((image // patch) ** 2 + 1, dim)
        self.pre_layrnorm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(HFCLIPEncoderLayer(dim, heads, 2 * dim, act) for _ in range(layers))
        self.post_layernorm = nn.LayerNorm(dim)

    def forward(self, pixel_values):
        b = pixel_values.shape[0]
        patch_embeds = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        class_embeds = self.class_embedding.expand(b, 1, -1)
        embeddings = torch.cat([class_embeds, patch_embeds], dim=1)
        embeddings = embeddings + self.position_embedding.weight[None]
        hidden_states = self.pre_layrnorm(embeddings)
        all_hidden = [hidden_states]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
            all_hidden.append(hidden_states)
        return all_hidden


class LlavaTiny(nn.Module):
    """LLaVA-1.5: the vision tower's penultimate hidden states without the CLS token (select_feature
    'patch'), mm_projector 'mlp2x_gelu' (Linear, GELU, Linear), spliced after the BOS of the text
    embeddings (prepare_inputs_labels_for_multimodal: the image positions labelled IGNORE_INDEX), a stand-in
    language model (one RMSNorm, lm_head) and the shifted loss."""

    def __init__(self, vis_dim=16, hidden=24, vocab=13, select_layer=-2):
        super().__init__()
        self.select_layer = select_layer
        self.vision_tower = HFCLIPVisionTiny(vis_dim)
        self.mm_projector = nn.Sequential(nn.Linear(vis_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, images, input_ids, labels):
        image_features = self.vision_tower(images)[self.select_layer][:, 1:]
        image_features = self.mm_projector(image_features)
        text = self.embed_tokens(input_ids)
        inputs_embeds = torch.cat([text[:, :1], image_features, text[:, 1:]], dim=1)
        ignore = torch.full((labels.shape[0], image_features.shape[1]), -100, dtype=labels.dtype)
        labels = torch.cat([labels[:, :1], ignore, labels[:, 1:]], dim=1)
        h = inputs_embeds.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        h = self.norm_weight * (h * torch.rsqrt(variance + 1e-6)).to(inputs_embeds.dtype)
        logits = self.lm_head(h)
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return loss, logits


def owlvit_causal_mask(bsz, seq_len, dtype):
    """CLIPTextTransformer._build_causal_attention_mask (transformers 4.2x): empty, fill_(-inf) (later
    finfo.min), triu_(1), unsqueeze(1)."""
    mask = torch.empty(bsz, seq_len, seq_len, dtype=dtype)
    mask.fill_(float("-inf"))
    mask.triu_(1)
    return mask.unsqueeze(1)


def expand_mask(mask, dtype, tgt_len=None):
    """transformers' _expand_mask: [bsz, src] -> [bsz, 1, tgt, src], 1 - mask, masked_fill(finfo.min)."""
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class OwlViTTiny(nn.Module):
    """OwlViTForObjectDetection.image_text_embedder + the heads: the text tower (causal mask by fill_ +
    triu_, the padding mask, argmax pooling, text_projection), the vision tower's post_layernorm, the class
    token multiplied into the patch tokens and layer_norm, the class head (dense0, L2 norms with + 1e-6, the
    einsum, logit_shift, elu logit_scale + 1, the query mask by where(finfo.min)) and the box head (Linear,
    GELU, Linear, GELU, Linear, + box bias, sigmoid)."""

    def __init__(self, dim=16, heads=2, vocab=11, text_len=6):
        super().__init__()
        self.vision = HFCLIPVisionTiny(dim, heads, layers=1)
        self.token_embedding = nn.Embedding(vocab, dim)
        self.text_position_embedding = nn.Embedding(text_len, dim)
        self.text_layer = HFCLIPEncoderLayer(dim, heads, 2 * dim)
        self.text_final_layer_norm = nn.LayerNorm(dim)
        self.text_projection = nn.Linear(dim, dim, bias=False)
        self.layer_norm = nn.LayerNorm(dim)
        self.dense0 = nn.Linear(dim, dim)
        self.logit_shift = nn.Linear(dim, 1)
        self.logit_scale = nn.Linear(dim, 1)
        self.box_dense0, self.box_dense1 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.box_dense2 = nn.Linear(dim, 4)
        self.register_buffer("box_bias", torch.randn(9, 4) * 0.1)

    def forward(self, pixel_values, input_ids, attention_mask):
        bsz, seq_len = input_ids.shape
        hidden = self.token_embedding(input_ids) + self.text_position_embedding.weight[:seq_len][None]
        causal = owlvit_causal_mask(bsz, seq_len, hidden.dtype)
        hidden = self.text_layer(hidden, expand_mask(attention_mask, hidden.dtype), causal)
        hidden = self.text_final_layer_norm(hidden)
        pooled = hidden[torch.arange(bsz), input_ids.to(torch.int).argmax(dim=-1)]
        query_embeds = self.text_projection(pooled)[None]  # one query per text, over the whole batch
        image_embeds = self.vision(pixel_values)[-1]
        image_embeds = self.vision.post_layernorm(image_embeds)
        class_token_out = torch.broadcast_to(image_embeds[:, :1, :], image_embeds[:, :-1].shape)
        image_embeds = image_embeds[:, 1:, :] * class_token_out
        image_embeds = self.layer_norm(image_embeds)
        image_class_embeds = self.dense0(image_embeds)
        image_class_embeds = image_class_embeds / (torch.linalg.norm(image_class_embeds, dim=-1, keepdim=True)
                                                   + 1e-6)
        query_embeds = query_embeds / (torch.linalg.norm(query_embeds, dim=-1, keepdim=True) + 1e-6)
        pred_logits = torch.einsum("...pd,...qd->...pq", image_class_embeds, query_embeds)
        logit_shift = self.logit_shift(image_embeds)
        logit_scale = F.elu(self.logit_scale(image_embeds)) + 1
        pred_logits = (pred_logits + logit_shift) * logit_scale
        query_mask = torch.ones(1, bsz, dtype=torch.bool)
        query_mask[:, -1] = False
        pred_logits = torch.where(query_mask[:, None] == 0, torch.finfo(pred_logits.dtype).min, pred_logits)
        pred_boxes = self.box_dense2(F.gelu(self.box_dense1(F.gelu(self.box_dense0(image_embeds)))))
        pred_boxes = (pred_boxes + self.box_bias).sigmoid()
        return pred_logits, pred_boxes


# ========================================================================================================
# TimeSformer (facebookresearch/TimeSformer timesformer/models/vit.py, attention_type 'divided_space_time')
# ========================================================================================================


class TimeSformerAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.0)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class TimeSformerMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class TimeSformerBlock(nn.Module):
    """Divided space-time Block: temporal attention over (b h w) t m (temporal_norm1, temporal_fc, added
    to the tokens), spatial attention over (b t) (h w) m with the CLS token repeated per frame and averaged
    back, the two concatenations added, norm2 + Mlp. einops' rearranges written as the reshapes / permutes
    they stand for."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = TimeSformerAttention(dim, num_heads)
        self.temporal_norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.temporal_attn = TimeSformerAttention(dim, num_heads)
        self.temporal_fc = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = TimeSformerMlp(dim, 4 * dim)

    def forward(self, x, B, T, W):
        num_spatial_tokens = (x.size(1) - 1) // T
        H = num_spatial_tokens // W
        M = x.size(2)
        # Temporal: 'b (h w t) m -> (b h w) t m'
        xt = x[:, 1:, :]
        xt = xt.reshape(B, H, W, T, M).reshape(B * H * W, T, M)
        res_temporal = self.temporal_attn(self.temporal_norm1(xt))
        # '(b h w) t m -> b (h w t) m'
        res_temporal = res_temporal.reshape(B, H, W, T, M).reshape(B, H * W * T, M)
        res_temporal = self.temporal_fc(res_temporal)
        xt = x[:, 1:, :] + res_temporal
        # Spatial
        init_cls_token = x[:, 0, :].unsqueeze(1)
        cls_token = init_cls_token.repeat(1, T, 1)
        cls_token = cls_token.reshape(B * T, M).unsqueeze(1)  # 'b t m -> (b t) m'
        xs = xt
        # 'b (h w t) m -> (b t) (h w) m'
        xs = xs.reshape(B, H, W, T, M).permute(0, 3, 1, 2, 4).reshape(B * T, H * W, M)
        xs = torch.cat((cls_token, xs), 1)
        res_spatial = self.attn(self.norm1(xs))
        # Taking care of CLS token
        cls_token = res_spatial[:, 0, :]
        cls_token = cls_token.reshape(B, T, M)  # '(b t) m -> b t m'
        cls_token = torch.mean(cls_token, 1, True)  # averaging for every frame
        res_spatial = res_spatial[:, 1:, :]
        # '(b t) (h w) m -> b (h w t) m'
        res_spatial = res_spatial.reshape(B, T, H, W, M).permute(0, 2, 3, 1, 4).reshape(B, H * W * T, M)
        res = res_spatial
        x = xt
        # Mlp
        x = torch.cat((init_cls_token, x), 1) + torch.cat((cls_token, res), 1)
        return x + self.mlp(self.norm2(x))


class TimeSformerTiny(nn.Module):
    """VisionTransformer with divided space-time attention: PatchEmbed per frame ('b c t h w -> (b t) c h w'),
    the CLS token and positions, the time embedding added per patch ('(b t) n m -> (b n) t m'), one Block,
    the norm, the head on the CLS token and the loss."""

    def __init__(self, dim=16, heads=2, frames=3, patch=3, image=6, classes=5):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        n = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.time_embed = nn.Parameter(torch.randn(1, frames, dim) * 0.02)
        self.block = TimeSformerBlock(dim, heads)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, labels):
        B, C, T, Hi, Wi = x.shape
        x = x.permute(0, 2, 1, 3, 4).reshape(B * T, C, Hi, Wi)
        x = self.patch_embed(x)
        W = x.size(-1)
        x = x.flatten(2).transpose(1, 2)
        cls_tokens = self.cls_token.expand(x.size(0), -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        x = x + self.pos_embed
        # Time Embeddings
        cls_tokens = x[:B, 0, :].unsqueeze(1)
        x = x[:, 1:]
        n, m = x.size(1), x.size(2)
        x = x.reshape(B, T, n, m).permute(0, 2, 1, 3).reshape(B * n, T, m)  # '(b t) n m -> (b n) t m'
        x = x + self.time_embed
        x = x.reshape(B, n * T, m)  # '(b n) t m -> b (n t) m'
        x = torch.cat((cls_tokens, x), dim=1)
        x = self.block(x, B, T, W)
        x = self.norm(x)
        logits = self.head(x[:, 0])
        return logits, F.cross_entropy(logits, labels)


# ========================================================================================================
# MobileViT (HF modeling_mobilevit.py after apple/ml-cvnets) and MobileViTv2's separable attention
# ========================================================================================================


class MobileViTConvLayer(nn.Module):
    def __init__(self, cin, cout, k, act=True, norm=True):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, k, padding=(k - 1) // 2, bias=not norm)
        self.normalization = nn.BatchNorm2d(cout) if norm else None
        self.act = act

    def forward(self, x):
        x = self.convolution(x)
        if self.normalization is not None:
            x = self.normalization(x)
        return F.silu(x) if self.act else x


class MobileViTSelfAttention(nn.Module):
    def __init__(self, hidden_size, heads):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden_size // heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(0.0)

    def transpose_for_scores(self, x):
        x = x.view(*x.size()[:-1], self.num_attention_heads, self.attention_head_size)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*context_layer.size()[:-2], self.all_head_size)


class MobileViTTransformerLayer(nn.Module):
    """layernorm_before, attention (+ output dense), residual; layernorm_after, intermediate (Linear +
    SiLU), output (Linear, dropout, + the residual)."""

    def __init__(self, hidden_size, heads, intermediate_size):
        super().__init__()
        self.attention = MobileViTSelfAttention(hidden_size, heads)
        self.attention_output = nn.Linear(hidden_size, hidden_size)
        self.intermediate = nn.Linear(hidden_size, intermediate_size)
        self.output = nn.Linear(intermediate_size, hidden_size)
        self.layernorm_before = nn.LayerNorm(hidden_size, eps=1e-5)
        self.layernorm_after = nn.LayerNorm(hidden_size, eps=1e-5)

    def forward(self, hidden_states):
        attention_output = self.attention_output(self.attention(self.layernorm_before(hidden_states)))
        hidden_states = hidden_states + attention_output
        layer_output = self.layernorm_after(hidden_states)
        layer_output = F.silu(self.intermediate(layer_output))
        return hidden_states + self.output(layer_output)


class MobileViTLayer(nn.Module):
    """MobileViTLayer (stride 1): local representation (conv_kxk, conv_1x1), unfolding into (B·P, N, C)
    patches, the transformer, layernorm, folding back, conv_projection, fusion of cat(residual, features)."""

    def __init__(self, in_channels=8, hidden_size=16, heads=2, patch_size=2, layers=1):
        super().__init__()
        self.patch_width = self.patch_height = patch_size
        self.conv_kxk = MobileViTConvLayer(in_channels, in_channels, 3)
        self.conv_1x1 = MobileViTConvLayer(in_channels, hidden_size, 1, act=False, norm=False)
        self.transformer = nn.ModuleList(MobileViTTransformerLayer(hidden_size, heads, 2 * hidden_size)
                                         for _ in range(layers))
        self.layernorm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.conv_projection = MobileViTConvLayer(hidden_size, in_channels, 1)
        self.fusion = MobileViTConvLayer(2 * in_channels, in_channels, 3)

    def unfolding(self, features):
        patch_width, patch_height = self.patch_width, self.patch_height
        patch_area = int(patch_width * patch_height)
        batch_size, channels, orig_height, orig_width = features.shape
        num_patch_width = orig_width // patch_width
        num_patch_height = orig_height // patch_height
        num_patches = num_patch_height * num_patch_width
        patches = features.reshape(batch_size * channels * num_patch_height, patch_height, num_patch_width,
                                   patch_width)
        patches = patches.transpose(1, 2)
        patches = patches.reshape(batch_size, channels, num_patches, patch_area)
        patches = patches.transpose(1, 3)
        patches = patches.reshape(batch_size * patch_area, num_patches, -1)
        info_dict = {"batch_size": batch_size, "channels": channels, "num_patches_width": num_patch_width,
                     "num_patches_height": num_patch_height}
        return patches, info_dict

    def folding(self, patches, info_dict):
        patch_width, patch_height = self.patch_width, self.patch_height
        patch_area = int(patch_width * patch_height)
        batch_size, channels = info_dict["batch_size"], info_dict["channels"]
        num_patch_height, num_patch_width = info_dict["num_patches_height"], info_dict["num_patches_width"]
        num_patches = num_patch_height * num_patch_width
        features = patches.contiguous().view(batch_size, patch_area, num_patches, -1)
        features = features.transpose(1, 3)
        features = features.reshape(batch_size * channels * num_patch_height, num_patch_width, patch_height,
                                    patch_width)
        features = features.transpose(1, 2)
        return features.reshape(batch_size, channels, num_patch_height * patch_height,
                                num_patch_width * patch_width)

    def forward(self, features):
        residual = features
        features = self.conv_1x1(self.conv_kxk(features))
        patches, info_dict = self.unfolding(features)
        for layer in self.transformer:
            patches = layer(patches)
        patches = self.layernorm(patches)
        features = self.folding(patches, info_dict)
        features = self.conv_projection(features)
        return self.fusion(torch.cat((residual, features), dim=1))


class MobileViTV2LinearSelfAttention(nn.Module):
    """MobileViTv2's separable self-attention on (B, C, P, N): a 1-channel query softmaxed over the N
    patches gives context scores, the keys weighted by them and summed into one context vector, times
    relu(value); no q·kᵀ."""

    def __init__(self, embed_dim):
        super().__init__()
        self.qkv_proj = nn.Conv2d(embed_dim, 1 + 2 * embed_dim, 1)
        self.attn_dropout = nn.Dropout(0.0)
        self.out_proj = nn.Conv2d(embed_dim, embed_dim, 1)
        self.embed_dim = embed_dim

    def forward(self, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        query, key, value = torch.split(qkv, split_size_or_sections=[1, self.embed_dim, self.embed_dim],
                                        dim=1)
        context_scores = F.softmax(query, dim=-1)
        context_scores = self.attn_dropout(context_scores)
        context_vector = key * context_scores
        context_vector = torch.sum(context_vector, dim=-1, keepdim=True)
        out = F.relu(value) * context_vector.expand_as(value)
        return self.out_proj(out)


class MobileViTV2TransformerLayer(nn.Module):
    """GroupNorm(1, C) before the separable attention and the 1x1-conv FFN (SiLU), residuals."""

    def __init__(self, embed_dim):
        super().__init__()
        self.layernorm_before = nn.GroupNorm(1, embed_dim, eps=1e-5)
        self.attention = MobileViTV2LinearSelfAttention(embed_dim)
        self.layernorm_after = nn.GroupNorm(1, embed_dim, eps=1e-5)
        self.conv1 = nn.Conv2d(embed_dim, 2 * embed_dim, 1)
        self.conv2 = nn.Conv2d(2 * embed_dim, embed_dim, 1)

    def forward(self, hidden_states):
        hidden_states = self.attention(self.layernorm_before(hidden_states)) + hidden_states
        return hidden_states + self.conv2(F.silu(self.conv1(self.layernorm_after(hidden_states))))


class MobileViTV2Tiny(nn.Module):
    """The v2 layer: unfold by F.unfold into (B, C, P, N), one transformer layer, GroupNorm, F.fold back."""

    def __init__(self, channels=16, patch=2):
        super().__init__()
        self.patch = patch
        self.layer = MobileViTV2TransformerLayer(channels)
        self.layernorm = nn.GroupNorm(1, channels)

    def forward(self, feature_map):
        batch_size, in_channels, img_height, img_width = feature_map.shape
        patches = F.unfold(feature_map, kernel_size=(self.patch, self.patch), stride=(self.patch, self.patch))
        patches = patches.reshape(batch_size, in_channels, self.patch * self.patch, -1)
        patches = self.layernorm(self.layer(patches))
        patches = patches.reshape(batch_size, in_channels * self.patch * self.patch, -1)
        return F.fold(patches, output_size=(img_height, img_width), kernel_size=(self.patch, self.patch),
                      stride=(self.patch, self.patch))


# ========================================================================================================
# Twins (timm twins.py: LocallyGroupedAttn, GlobalSubSampleAttn, PosConv) and PVTv2 (timm pvt_v2.py)
# ========================================================================================================


class TwinsLocallyGroupedAttn(nn.Module):
    """Attention inside ws x ws windows: the (B, H, W, C) map padded by F.pad to whole windows (the padded
    tokens are keys too, as in timm), q / k / v 5-d (B, windows, heads, ws², d), manual or SDPA, the
    windows back and the padding sliced off."""

    def __init__(self, dim, num_heads=2, ws=2, fused_attn=False):
        super().__init__()
        self.dim, self.num_heads, self.ws, self.fused_attn = dim, num_heads, ws, fused_attn
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, size):
        B, N, C = x.shape
        H, W = size
        x = x.view(B, H, W, C)
        pad_l = pad_t = 0
        pad_r = (self.ws - W % self.ws) % self.ws
        pad_b = (self.ws - H % self.ws) % self.ws
        x = F.pad(x, (0, 0, pad_l, pad_r, pad_t, pad_b))
        _, Hp, Wp, _ = x.shape
        _h, _w = Hp // self.ws, Wp // self.ws
        x = x.reshape(B, _h, self.ws, _w, self.ws, C).transpose(2, 3)
        qkv = self.qkv(x).reshape(B, _h * _w, self.ws * self.ws, 3, self.num_heads, C // self.num_heads)
        qkv = qkv.permute(3, 0, 1, 4, 2, 5)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(2, 3).reshape(B, _h, _w, self.ws, self.ws, C)
        x = x.transpose(2, 3).reshape(B, _h * self.ws, _w * self.ws, C)
        if pad_r > 0 or pad_b > 0:
            x = x[:, :H, :W, :].contiguous()
        x = x.reshape(B, N, C)
        return self.proj(x)


class SpatialReductionAttention(nn.Module):
    """Twins' GlobalSubSampleAttn and PVTv2's Attention: q from every token, k / v from the map reduced by
    a strided conv (sr_ratio) + LayerNorm, or with `linear` (PVTv2-Li) by AdaptiveAvgPool2d(7 -> here 2),
    a 1x1 conv, LayerNorm and GELU."""

    def __init__(self, dim, num_heads=2, sr_ratio=2, linear=False, fused_attn=False):
        super().__init__()
        self.num_heads, self.linear, self.fused_attn, self.sr_ratio = num_heads, linear, fused_attn, sr_ratio
        self.scale = (dim // num_heads) ** -0.5
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.proj = nn.Linear(dim, dim)
        if not linear:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
        else:
            self.pool = nn.AdaptiveAvgPool2d(2)
            self.sr = nn.Conv2d(dim, dim, kernel_size=1, stride=1)
            self.act = nn.GELU()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, size):
        B, N, C = x.shape
        H, W = size
        q = self.q(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)
        x = x.permute(0, 2, 1).reshape(B, C, H, W)
        if not self.linear:
            x = self.sr(x).reshape(B, C, -1).permute(0, 2, 1)
            x = self.norm(x)
        else:
            x = self.sr(self.pool(x)).reshape(B, C, -1).permute(0, 2, 1)
            x = self.norm(x)
            x = self.act(x)
        kv = self.kv(x).reshape(B, -1, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class TwinsPosConv(nn.Module):
    """PEG: a depth-wise 3x3 conv of the tokens as a map, added in place (stride 1)."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(dim, dim, 3, 1, 1, bias=True, groups=dim))

    def forward(self, x, size):
        B, N, C = x.shape
        cnn_feat_token = x.transpose(1, 2).view(B, C, *size)
        x = self.proj(cnn_feat_token)
        x += cnn_feat_token
        return x.flatten(2).transpose(1, 2)


class TwinsMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TwinsBlock(nn.Module):
    def __init__(self, dim, num_heads, ws=None, sr_ratio=2, fused_attn=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        if ws is None:
            self.attn = SpatialReductionAttention(dim, num_heads, sr_ratio, fused_attn=fused_attn)
        else:
            self.attn = TwinsLocallyGroupedAttn(dim, num_heads, ws, fused_attn=fused_attn)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = TwinsMlp(dim, 4 * dim)

    def forward(self, x, size):
        x = x + self.attn(self.norm1(x), size)
        return x + self.mlp(self.norm2(x))


class TwinsSVTStage(nn.Module):
    """Twins-SVT's stage: patch embedding (conv + LayerNorm), a locally grouped block (5 x 5 tokens in 2 x 2
    windows: padded), the PEG, a global sub-sampled block, the final norm, mean pooling, head and loss."""

    def __init__(self, dim=16, heads=2, fused_attn=False, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, 2)
        self.patch_norm = nn.LayerNorm(dim)
        self.block_local = TwinsBlock(dim, heads, ws=2, fused_attn=fused_attn)
        self.pos_block = TwinsPosConv(dim)
        self.block_global = TwinsBlock(dim, heads, sr_ratio=2, fused_attn=fused_attn)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, labels):
        x = self.patch(x)
        size = x.shape[-2:]
        x = self.patch_norm(x.flatten(2).transpose(1, 2))
        x = self.block_local(x, size)
        x = self.pos_block(x, size)
        x = self.block_global(x, size)
        logits = self.head(self.norm(x).mean(dim=1))
        return logits, F.cross_entropy(logits, labels)


class PVTv2DWConv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, 1, 1, bias=True, groups=dim)

    def forward(self, x, size):
        B, N, C = x.shape
        x = x.transpose(1, 2).view(B, C, size[0], size[1])
        return self.dwconv(x).flatten(2).transpose(1, 2)


class PVTv2MlpWithDepthwiseConv(nn.Module):
    """fc1, ReLU (linear only), the depth-wise conv, GELU, fc2."""

    def __init__(self, dim, hidden, linear):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU() if linear else nn.Identity()
        self.dwconv = PVTv2DWConv(hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, size):
        x = self.fc1(x)
        x = self.relu(x)
        x = self.dwconv(x, size)
        x = self.act(x)
        return self.fc2(x)


class PVTv2Block(nn.Module):
    def __init__(self, dim=16, num_heads=2, sr_ratio=2, linear=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SpatialReductionAttention(dim, num_heads, sr_ratio, linear=linear)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = PVTv2MlpWithDepthwiseConv(dim, 4 * dim, linear)

    def forward(self, x, size):
        x = x + self.attn(self.norm1(x), size)
        return x + self.mlp(self.norm2(x), size)


class PVTv2Stage(nn.Module):
    """OverlapPatchEmbed (7x7 stride-4 conv -> here 3x3 stride 2, LayerNorm), one block, the stage norm, the
    tokens back to a map."""

    def __init__(self, dim=16, linear=True):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, 3, 2, 1)
        self.patch_norm = nn.LayerNorm(dim)
        self.block = PVTv2Block(dim, linear=linear)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = self.proj(x)
        B, C, H, W = x.shape
        x = self.patch_norm(x.flatten(2).transpose(1, 2))
        x = self.block(x, (H, W))
        x = self.norm(x)
        return x.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous()


# ========================================================================================================
# CrossViT (timm crossvit.py)
# ========================================================================================================


class CrossViTCrossAttention(nn.Module):
    """The CLS token's query (Sq = 1) over all the tokens of the other branch plus itself."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.wq, self.wk, self.wv = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q = self.wq(x[:, 0:1, ...]).reshape(B, 1, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        k = self.wk(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        v = self.wv(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, 1, C)
        return self.proj(x)


class CrossViTCrossAttentionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = CrossViTCrossAttention(dim, num_heads)

    def forward(self, x):
        return x[:, 0:1, ...] + self.attn(self.norm1(x))


class CrossViTMultiScaleBlock(nn.Module):
    """Two branches (dims 16 and 24): a timm Block each (TimeSformer's Attention / Mlp, the same code), the
    CLS tokens projected to the other branch (LayerNorm, GELU, Linear), the cross-attention fusion, the CLS
    token reverted (LayerNorm, GELU, Linear) and concatenated back."""

    def __init__(self, dims=(16, 24), heads=(2, 3)):
        super().__init__()
        self.num_branches = len(dims)
        self.blocks = nn.ModuleList(CrossViTBlock(d, h) for d, h in zip(dims, heads, strict=True))
        self.projs = nn.ModuleList(nn.Sequential(nn.LayerNorm(dims[d], eps=1e-6), nn.GELU(),
                                                 nn.Linear(dims[d], dims[(d + 1) % 2])) for d in range(2))
        self.fusion = nn.ModuleList(CrossViTCrossAttentionBlock(dims[(d + 1) % 2], heads[(d + 1) % 2])
                                    for d in range(2))
        self.revert_projs = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dims[(d + 1) % 2], eps=1e-6), nn.GELU(),
                          nn.Linear(dims[(d + 1) % 2], dims[d])) for d in range(2))

    def forward(self, x):
        outs_b = [block(x_) for x_, block in zip(x, self.blocks, strict=True)]
        proj_cls_token = [proj(outs_b[i][:, 0:1, ...]) for i, proj in enumerate(self.projs)]
        outs = []
        for i, (fusion, revert_proj) in enumerate(zip(self.fusion, self.revert_projs, strict=True)):
            tmp = torch.cat((proj_cls_token[i], outs_b[(i + 1) % self.num_branches][:, 1:, ...]), dim=1)
            tmp = fusion(tmp)
            reverted_proj_cls_token = revert_proj(tmp[:, 0:1, ...])
            tmp = torch.cat((reverted_proj_cls_token, outs_b[i][:, 1:, ...]), dim=1)
            outs.append(tmp)
        return outs


class CrossViTBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = TimeSformerAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = TimeSformerMlp(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CrossViTTiny(nn.Module):
    """Two patch sizes over one image, CLS tokens and positions per branch, one MultiScaleBlock, the norms,
    a head per branch on its CLS token, the logits averaged over the branches (torch.stack + mean)."""

    def __init__(self, dims=(16, 24), classes=5):
        super().__init__()
        self.patch_embed = nn.ModuleList([nn.Conv2d(3, dims[0], 3, 3), nn.Conv2d(3, dims[1], 2, 2)])
        self.cls_token = nn.ParameterList([nn.Parameter(torch.randn(1, 1, d) * 0.02) for d in dims])
        self.pos_embed = nn.ParameterList([nn.Parameter(torch.randn(1, 1 + n, d) * 0.02)
                                           for n, d in zip((4, 9), dims, strict=True)])
        self.block = CrossViTMultiScaleBlock(dims)
        self.norm = nn.ModuleList(nn.LayerNorm(d, eps=1e-6) for d in dims)
        self.head = nn.ModuleList(nn.Linear(d, classes) for d in dims)

    def forward(self, x, labels):
        xs = []
        for i, patch_embed in enumerate(self.patch_embed):
            x_ = patch_embed(x[..., :6, :6]).flatten(2).transpose(1, 2)
            x_ = torch.cat((self.cls_token[i].expand(x_.shape[0], -1, -1), x_), dim=1)
            xs.append(x_ + self.pos_embed[i])
        xs = self.block(xs)
        xs = [self.norm[i](x_) for i, x_ in enumerate(xs)]
        logits = torch.mean(torch.stack([head(x_[:, 0]) for x_, head in zip(xs, self.head, strict=True)]),
                            dim=0)
        return logits, F.cross_entropy(logits, labels)


# ========================================================================================================
# AudioCraft / MusicGen (audiocraft/modules/transformer.py: StreamingMultiheadAttention, custom path)
# ========================================================================================================


class AudioCraftStreamingMHA(nn.Module):
    """StreamingMultiheadAttention with custom=True, memory_efficient=False (layout 'b t h d'): the packed
    in_proj by F.linear, rearranged 'b t (p h d) -> b t p h d' and unbound; in streaming the past keys /
    values concatenated in front (_complete_kv); the causal mask of _get_mask (arange from the past steps,
    delta >= 0, past_context, torch.where(valid, 0, -inf)); q / sqrt(d), einsum 'b t h d,b k h d-> b h t k',
    the mask added, softmax, dropout .to(v), einsum back to 'b t h d'; cross-attention splits the packed
    weight into q, k, v projections."""

    def __init__(self, embed_dim, num_heads, causal=False, cross_attention=False, past_context=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        self.cross_attention, self.past_context = cross_attention, past_context
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) / embed_dim**0.5)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = 0.0

    def _get_mask(self, current_steps, past_steps, device, dtype):
        queries_pos = torch.arange(past_steps, current_steps + past_steps, device=device).view(-1, 1)
        keys_pos = torch.arange(past_steps + current_steps, device=device).view(1, -1)
        delta = queries_pos - keys_pos
        valid = delta >= 0
        if self.past_context is not None:
            valid &= (delta <= self.past_context)
        return torch.where(valid, torch.zeros([], device=device, dtype=dtype),
                           torch.full([], float("-inf"), device=device, dtype=dtype))

    def forward(self, query, key, value, past_keys=None, past_values=None):
        layout = "b t h d"
        dtype = query.dtype
        attn_mask = None
        if self.causal:
            past_steps = 0 if past_keys is None else past_keys.shape[1]
            attn_mask = self._get_mask(query.shape[1], past_steps, query.device, query.dtype)
        if self.cross_attention:
            dim = self.in_proj_weight.shape[0] // 3
            bias_q, bias_k, bias_v = self.in_proj_bias[:dim], self.in_proj_bias[dim: 2 * dim], \
                self.in_proj_bias[2 * dim:]
            q = F.linear(query, self.in_proj_weight[:dim], bias_q)
            k = F.linear(key, self.in_proj_weight[dim: 2 * dim], bias_k)
            v = F.linear(value, self.in_proj_weight[2 * dim:], bias_v)
            b, t = q.shape[:2]
            q, k, v = [x.reshape(x.shape[0], x.shape[1], self.num_heads, -1) for x in (q, k, v)]
        else:
            projected = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            b, t = projected.shape[:2]
            packed = projected.reshape(b, t, 3, self.num_heads, -1)  # 'b t (p h d) -> b t p h d'
            q, k, v = torch.unbind(packed, dim=2)
            if past_keys is not None:
                k = torch.cat([past_keys, k], dim=1)
                v = torch.cat([past_values, v], dim=1)
        q = q / q.shape[-1] ** 0.5
        key_layout = layout.replace("t", "k")
        pre_w = torch.einsum(f"{layout},{key_layout}-> b h t k", q, k)
        if attn_mask is not None:
            pre_w = pre_w + attn_mask
        w = torch.softmax(pre_w, dim=-1)
        w = F.dropout(w, self.dropout, training=self.training).to(v)
        x = torch.einsum(f"b h t k, {key_layout} -> {layout}", w, v)
        x = x.to(dtype)
        x = x.reshape(b, t, -1)  # 'b t h d -> b t (h d)'
        return self.out_proj(x), k, v


class AudioCraftLayerScale(nn.Module):
    def __init__(self, channels, init=1e-1):
        super().__init__()
        self.scale = nn.Parameter(torch.full((channels,), init))

    def forward(self, x):
        return self.scale * x


class AudioCraftTransformerLayer(nn.Module):
    """StreamingTransformerLayer (norm_first, causal, cross_attention, layer_scale): self-attention over the
    past keys, cross-attention to the conditions (norm_cross), the GELU feed-forward; LayerScale residuals."""

    def __init__(self, d_model=16, num_heads=2, dim_feedforward=32, past_context=None):
        super().__init__()
        self.self_attn = AudioCraftStreamingMHA(d_model, num_heads, causal=True, past_context=past_context)
        self.cross_attention = AudioCraftStreamingMHA(d_model, num_heads, cross_attention=True)
        self.linear1, self.linear2 = nn.Linear(d_model, dim_feedforward), nn.Linear(dim_feedforward, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model, eps=1e-5), nn.LayerNorm(d_model, eps=1e-5)
        self.norm_cross = nn.LayerNorm(d_model, eps=1e-5)
        self.layer_scale_1, self.layer_scale_2 = AudioCraftLayerScale(d_model), AudioCraftLayerScale(d_model)
        self.layer_scale_cross = AudioCraftLayerScale(d_model)

    def forward(self, x, cross_attention_src, past_keys=None, past_values=None):
        sa, k, v = self.self_attn(self.norm1(x), None, None, past_keys, past_values)
        x = x + self.layer_scale_1(sa)
        ca = self.cross_attention(self.norm_cross(x), cross_attention_src, cross_attention_src)[0]
        x = x + self.layer_scale_cross(ca)
        ff = self.linear2(F.gelu(self.linear1(self.norm2(x))))
        x = x + self.layer_scale_2(ff)
        return x, k, v


class MusicGenLMTiny(nn.Module):
    """LMModel: the K codebooks' embeddings summed, the sinusoidal positions (offset by the past steps)
    added, one layer, out_norm, a Linear per codebook stacked on dim 1."""

    def __init__(self, K=2, card=9, dim=16, past_context=None):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(card + 1, dim) for _ in range(K))
        self.layer = AudioCraftTransformerLayer(dim, past_context=past_context)
        self.out_norm = nn.LayerNorm(dim)
        self.linears = nn.ModuleList(nn.Linear(dim, card) for _ in range(K))
        self.K, self.dim = K, dim

    def forward(self, sequence, condition, past_keys=None, past_values=None):
        B, K, S = sequence.shape
        x = sum(self.emb[k](sequence[:, k]) for k in range(K))
        offset = 0 if past_keys is None else past_keys.shape[1]
        positions = torch.arange(S, dtype=x.dtype).view(1, -1, 1) + offset
        half = self.dim // 2
        adim = torch.arange(half, dtype=x.dtype).view(1, 1, -1)
        phase = positions / (10000 ** (adim / (half - 1)))
        x = x + torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)
        x, k, v = self.layer(x, condition, past_keys, past_values)
        out = self.out_norm(x)
        logits = torch.stack([self.linears[k](out) for k in range(self.K)], dim=1)
        return logits, k, v


# ========================================================================================================
# SAM 2 memory attention (sam2/modeling/memory_attention.py, sam2/modeling/sam/transformer.py)
# ========================================================================================================


def sam2_init_t_xy(end_x, end_y):
    t = torch.arange(end_x * end_y, dtype=torch.float32)
    t_x = (t % end_x).float()
    t_y = torch.div(t, end_x, rounding_mode="floor").float()
    return t_x, t_y


def sam2_compute_axial_cis(dim, end_x, end_y, theta=10000.0):
    freqs_x = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    freqs_y = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    t_x, t_y = sam2_init_t_xy(end_x, end_y)
    freqs_x = torch.outer(t_x, freqs_x)
    freqs_y = torch.outer(t_y, freqs_y)
    freqs_cis_x = torch.polar(torch.ones_like(freqs_x), freqs_x)
    freqs_cis_y = torch.polar(torch.ones_like(freqs_y), freqs_y)
    return torch.cat([freqs_cis_x, freqs_cis_y], dim=-1)


def sam2_reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i >= ndim - 2 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def sam2_apply_rotary_enc(xq, xk, freqs_cis, repeat_freqs_k=False):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2)) if xk.shape[-2] != 0 else None
    freqs_cis = sam2_reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    if xk_ is None:
        return xq_out.type_as(xq).to(xq.device), xk
    if repeat_freqs_k:
        r = xk_.shape[-2] // xq_.shape[-2]
        freqs_cis = freqs_cis.repeat(*([1] * (freqs_cis.ndim - 2)), r, 1)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq).to(xq.device), xk_out.type_as(xk).to(xk.device)


class SAM2RoPEAttention(nn.Module):
    """Attention with axial RoPE on q and k (k's frequencies repeated over the memory frames with
    rope_k_repeat), the last num_k_exclude_rope keys (object pointers) left without: written into k by item
    assignment `k[:, :, :num_k_rope] = ...`; SDPA."""

    def __init__(self, embedding_dim, num_heads, downsample_rate=1, kv_in_dim=None, rope_k_repeat=False,
                 feat_sizes=(3, 3)):
        super().__init__()
        self.internal_dim = embedding_dim // downsample_rate
        self.num_heads = num_heads
        kv_in_dim = kv_in_dim if kv_in_dim is not None else embedding_dim
        self.q_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.k_proj = nn.Linear(kv_in_dim, self.internal_dim)
        self.v_proj = nn.Linear(kv_in_dim, self.internal_dim)
        self.out_proj = nn.Linear(self.internal_dim, embedding_dim)
        self.rope_k_repeat = rope_k_repeat
        self.freqs_cis = sam2_compute_axial_cis(self.internal_dim // num_heads, *feat_sizes)

    def _separate_heads(self, x, num_heads):
        b, n, c = x.shape
        return x.reshape(b, n, num_heads, c // num_heads).transpose(1, 2)

    def _recombine_heads(self, x):
        b, n_heads, n_tokens, c_per_head = x.shape
        return x.transpose(1, 2).reshape(b, n_tokens, n_heads * c_per_head)

    def forward(self, q, k, v, num_k_exclude_rope=0):
        q, k, v = self.q_proj(q), self.k_proj(k), self.v_proj(v)
        q = self._separate_heads(q, self.num_heads)
        k = self._separate_heads(k, self.num_heads)
        v = self._separate_heads(v, self.num_heads)
        num_k_rope = k.size(-2) - num_k_exclude_rope
        q, k[:, :, :num_k_rope] = sam2_apply_rotary_enc(q, k[:, :, :num_k_rope], freqs_cis=self.freqs_cis,
                                                        repeat_freqs_k=self.rope_k_repeat)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        return self.out_proj(self._recombine_heads(out))


class SAM2MemoryAttentionLayer(nn.Module):
    """Self-attention with RoPE (no positions added), cross-attention to the memories (positions added to
    the keys, kv_in_dim 8, rope_k_repeat, the object pointers excluded from RoPE), the ReLU FFN; pre-norm."""

    def __init__(self, d_model=16, heads=1, mem_dim=8):
        super().__init__()
        self.self_attn = SAM2RoPEAttention(d_model, heads)
        self.cross_attn_image = SAM2RoPEAttention(d_model, heads, kv_in_dim=mem_dim, rope_k_repeat=True)
        self.linear1, self.linear2 = nn.Linear(d_model, 32), nn.Linear(32, d_model)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))

    def forward(self, tgt, memory, pos, query_pos, num_k_exclude_rope=0):
        tgt2 = self.norm1(tgt)
        q = k = tgt2
        tgt = tgt + self.self_attn(q, k, v=tgt2)
        tgt2 = self.norm2(tgt)
        tgt2 = self.cross_attn_image(q=tgt2, k=memory + pos, v=memory, num_k_exclude_rope=num_k_exclude_rope)
        tgt = tgt + tgt2
        tgt2 = self.norm3(tgt)
        tgt2 = self.linear2(F.relu(self.linear1(tgt2)))
        return tgt + tgt2


class SAM2MemoryAttention(nn.Module):
    """MemoryAttention: seq-first inputs transposed to batch first, 0.1 * curr_pos added, the layer, norm,
    transposed back."""

    def __init__(self, d_model=16, num_obj_ptr_tokens=2):
        super().__init__()
        self.layer = SAM2MemoryAttentionLayer(d_model)
        self.norm = nn.LayerNorm(d_model)
        self.num_obj_ptr_tokens = num_obj_ptr_tokens

    def forward(self, curr, curr_pos, memory, memory_pos):
        num_obj_ptr_tokens = self.num_obj_ptr_tokens
        output = curr + 0.1 * curr_pos
        output, curr_pos = output.transpose(0, 1), curr_pos.transpose(0, 1)
        memory, memory_pos = memory.transpose(0, 1), memory_pos.transpose(0, 1)
        output = self.layer(output, memory, memory_pos, curr_pos, num_k_exclude_rope=num_obj_ptr_tokens)
        return self.norm(output).transpose(0, 1)


def _sam2_inputs(b=2, frames=2, ptrs=2):
    return R(9, b, 16), R(9, b, 16), R(9 * frames + ptrs, b, 8), R(9 * frames + ptrs, b, 8)


# ========================================================================================================
# SpeechT5 encoder layer (transformers modeling_speecht5.py)
# ========================================================================================================


class SpeechT5RelativePositionalEncoding(nn.Module):
    def __init__(self, dim, max_length=4):
        super().__init__()
        self.dim, self.max_length = dim, max_length
        self.pe_k = nn.Embedding(2 * max_length, dim)

    def forward(self, hidden_states):
        seq_len = hidden_states.shape[1]
        pos_seq = torch.arange(0, seq_len).long().to(hidden_states.device)
        pos_seq = pos_seq[:, None] - pos_seq[None, :]
        pos_seq[pos_seq < -self.max_length] = -self.max_length
        pos_seq[pos_seq >= self.max_length] = self.max_length - 1
        pos_seq = pos_seq + self.max_length
        return self.pe_k(pos_seq)


class SpeechT5Attention(nn.Module):
    """BART-style bmm attention (q scaled after the projection) with the relative position bias
    q·posᵀ (reshape_q transposed to (T, B·H, d) times pos (T, d, T)) added in place, the attention mask
    through a 4-d view."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj, self.v_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.q_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if position_bias is not None:
            reshape_q = query_states.contiguous().view(bsz * self.num_heads, -1, self.head_dim)
            reshape_q = reshape_q.transpose(0, 1)
            rel_pos_bias = torch.matmul(reshape_q, position_bias.transpose(-2, -1))
            rel_pos_bias = rel_pos_bias.transpose(0, 1).view(bsz * self.num_heads, position_bias.size(0),
                                                             position_bias.size(1))
            attn_weights += rel_pos_bias
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_probs = F.dropout(attn_weights, p=0.0, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output)


class SpeechT5EncoderTiny(nn.Module):
    """SpeechT5Encoder (post-norm): the input layer_norm, the relative positions of the head size, one
    SpeechT5EncoderLayer (attention, residual, layer_norm, the GELU feed-forward added, final_layer_norm)."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.layer_norm = nn.LayerNorm(dim, eps=1e-5)
        self.embed_positions = SpeechT5RelativePositionalEncoding(dim // heads)
        self.attention = SpeechT5Attention(dim, heads)
        self.attn_layer_norm = nn.LayerNorm(dim, eps=1e-5)
        self.intermediate_dense, self.output_dense = nn.Linear(dim, 32), nn.Linear(32, dim)
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, hidden_states, attention_mask):
        attention_mask = expand_mask(attention_mask, hidden_states.dtype)
        hidden_states = self.layer_norm(hidden_states)
        position_bias = self.embed_positions(hidden_states)
        residual = hidden_states
        hidden_states = self.attention(hidden_states, attention_mask, position_bias)
        hidden_states = residual + hidden_states
        hidden_states = self.attn_layer_norm(hidden_states)
        ff = self.output_dense(F.gelu(self.intermediate_dense(hidden_states)))
        hidden_states = hidden_states + ff
        return self.final_layer_norm(hidden_states)


# ========================================================================================================
# The table
# ========================================================================================================


def _ids(b=2, s=7, vocab=11):
    return torch.randint(1, vocab, (b, s))


def _keep_long(b, n, pad):
    return _keep(b, n, pad).long()


# name: (model and inputs, rewrites per family (the others 0), near misses (family, words of the reason),
# words the report must hold). Every count was checked by reading the module.
CASES = {
    # the VAE's mid-block: GroupNorm before attention (no candidate), SDPA on the 4-d input viewed (B, HW,
    # C), the residual and the division by rescale_output_factor after the out-projection
    "diffusers_vae_mid_block_sdpa": _case(lambda: (DiffusersVAEMidBlock(rescale=2.0), (R(2, 16, 3, 3),)),
                                          dict(attention=1)),
    # the classic processor: baddbmm into torch.empty with beta 0, upcast_attention / upcast_softmax
    "diffusers_vae_mid_block_baddbmm": _case(
        lambda: (DiffusersVAEMidBlock(processor="classic", upcast_attention=True), (R(2, 16, 3, 3),)),
        dict(attention=1), words=["softmax(baddbmm) -> flash_attention(scale=0.3536)"]),
    # Transformer2DModel: GroupNorm, proj_in, norm1 (plain), norm2 / norm3 with the sums; the cross
    # attention's mask (1 - m) * -10000 repeat_interleave'd over the heads and viewed (B, H, 1, Sk); GEGLU
    # (no candidate: a GELU of half a Linear's output)
    "diffusers_unet_transformer2d": _case(
        lambda: (DiffusersTransformer2DModel(), (R(2, 16, 3, 3), R(2, 5, 12), _keep(2, 5, 2))),
        dict(attention=2, norm=3)),
    # PixArt-α: norm1 (plain, affine-free), norm2 and norm_out with the sums; attn2 reads the sum itself (no
    # norm); the caption projection's and the feed-forward's tanh GELUs
    "diffusers_pixart_alpha": _case(
        lambda: (PixArtTiny(), (R(2, 4, 8, 8), R(2, 5, 12), torch.tensor([3.0, 700.0]), _keep(2, 5, 2))),
        dict(attention=2, norm=3, dense=2)),
    # fullgraph with the reset written as `& ~all(-1)`; post-norm layers (3 sums + norms), decoder_norm
    # twice; ReLU FFN and MLP. The data-dependent form: test_mask2former_reset_by_torch_where
    "mask2former_reset_all": _case(lambda: (Mask2FormerDecoderTiny(reset="all"), _m2f_inputs()),
                                   dict(attention=2, norm=5)),
    # ln_vision, the embeddings' norm (plain); 4 BertOutput-style LayerNorm(h + input); the Q-Former's
    # self- and cross-attention with the -10000 extended masks; 2 intermediates (Linear + GELU)
    "blip2_qformer": _case(lambda: (Blip2QFormerTiny(), (R(2, 10, 12), _ids(2, 5), _keep_long(2, 5, 2))),
                           dict(attention=2, norm=6, dense=2)),
    # LLaVA with every vision layer used (select_layer -1; LLaVA's -2: test_llava_penultimate_layer...):
    # pre_layrnorm, layer_norm1 / layer_norm2 (with the sums) x 2; the RMSNorm of the spliced embeddings;
    # quick_gelu (no candidate); the projector's GELU; the shifted loss with the image labels ignored
    "llava_projector_and_loss": _case(
        lambda: (LlavaTiny(select_layer=-1), (R(2, 3, 9, 9), _ids(2, 5, 13), _ids(2, 5, 13))),
        dict(attention=2, norm=6, dense=1, cross_entropy=1),
        words=["softmax(bmm) -> flash_attention(scale=1)"]),
    # the text causal mask (fill_(-inf), triu_(1)) and the padding mask (finfo.min) both through 4-d views;
    # norms: the text layer's 2 and final, the vision's pre, 2 in the layer, post (with the sum), the
    # class-token layer_norm; the box head's 2 GELUs
    "owlvit": _case(lambda: (OwlViTTiny(), (R(2, 3, 9, 9), _ids(2, 6), _keep_long(2, 6, 2))),
                    dict(attention=2, norm=8, dense=2)),
    # temporal and spatial attention over their own reshapes; norms: temporal_norm1, norm1 (of the cat),
    # norm2 with the sum of the two cats, the final norm with the MLP's sum
    "timesformer_divided_space_time": _case(
        lambda: (TimeSformerTiny(), (R(2, 3, 3, 6, 6), _labels(2))),
        dict(attention=2, norm=4, dense=1, cross_entropy=1)),
    # attention over (B·P, N, C) patches unfolded by reshapes / transposes; norms: before (plain), after and
    # the final (with the sums); SiLU
    "mobilevit": _case(lambda: (MobileViTLayer(), (R(2, 8, 4, 6),)), dict(attention=1, norm=3)),
    # separable attention: a softmax over the patches with no q·kᵀ, GroupNorm(1, C): nothing to rewrite
    "mobilevitv2_separable": _case(lambda: (MobileViTV2Tiny(), (R(2, 16, 4, 6),)), {}),
    # locally grouped (5-d, padded windows) and global sub-sampled attention; norms: the patch norm, 2 per
    # block (the second with the sum), the sr norm, the final one with the last sum
    "twins_svt": _case(lambda: (TwinsSVTStage(), (R(2, 3, 10, 10), _labels(2))),
                       dict(attention=2, norm=7, dense=2, cross_entropy=1)),
    # SDPA on 5-d windows (finding S1, FIXED: was "5-d inputs; the flash op takes (B, H, S, D)")
    "twins_svt_fused": _case(lambda: (TwinsSVTStage(fused_attn=True), (R(2, 3, 10, 10), _labels(2))),
                             dict(attention=2, norm=7, dense=2, cross_entropy=1),
                             words=["flash_attention(5-d inputs merged to (B, H))"]),
    # linear SRA: pool, 1x1 conv, LayerNorm, GELU (a GELU of a norm: no candidate); norms: patch, norm1,
    # sr norm, norm2 with the sum, the stage norm with the sum; the MLP's GELU follows a depth-wise conv
    "pvt_v2_linear_sra": _case(lambda: (PVTv2Stage(), (R(2, 3, 8, 8),)), dict(attention=1, norm=5)),
    # per branch: 2 block attentions + a CLS cross-attention; norms: 2 per block, the projs' and
    # revert_projs' (LayerNorm, GELU, Linear: no dense), the fusion's norm1 of the cat, the 2 final ones;
    # the loss over the mean of the stacked heads: reported
    "crossvit": _case(lambda: (CrossViTTiny(), (R(2, 3, 6, 6), _labels(2))),
                      dict(attention=4, norm=12, dense=2),
                      (("cross_entropy", "the logits pass through mean"),)),
    # einsum 'b t h d,b k h d-> b h t k' with the where(valid, 0, -inf) mask; cross-attention (packed weight
    # sliced); norms: norm1 (plain), norm_cross, norm2 and out_norm with the LayerScale sums; GELU FFN
    "musicgen_streaming_layer": _case(
        lambda: (MusicGenLMTiny(), (torch.randint(0, 9, (2, 2, 5)), R(2, 4, 16))),
        dict(attention=2, norm=4, dense=1)),
    # streaming: 3 new steps over 5 past keys (bottom-right causal from the arange offset) within
    # past_context 3 (a band)
    "musicgen_streaming_with_past": _case(
        lambda: (MusicGenLMTiny(past_context=3),
                 (torch.randint(0, 9, (2, 2, 3)), R(2, 4, 16), R(2, 5, 2, 8), R(2, 5, 2, 8))),
        dict(attention=2, norm=4, dense=1)),
    # RoPE (complex, k's frequencies repeated over 2 memory frames) written into k by item assignment,
    # the 2 object-pointer keys left out; pre-norm: norm1 plain, norm2 / norm3 / the final norm with sums
    "sam2_memory_attention": _case(lambda: (SAM2MemoryAttention(), _sam2_inputs()),
                                   dict(attention=2, norm=4)),
    # q·posᵀ over the relative position embeddings added in place to the bmm scores, then the padding
    # mask: one additive mask that requires grad; post-norm
    "speecht5_encoder": _case(lambda: (SpeechT5EncoderTiny(), (R(2, 7, 16), _keep_long(2, 7, 2))),
                              dict(attention=1, norm=3, dense=1), words=["mask [2, 2, 7, 7]"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_codebase_block(name):
    make, rewrites, near_misses, words = CASES[name]
    model, args = make()
    report = _check_block(model, args, rewrites, near_misses)
    for w in words:
        assert w in str(report), str(report)


# ========================================================================================================
# Beyond the table: a graph break, unused gradients, dynamic shapes
# ========================================================================================================


def test_mask2former_reset_by_torch_where():
    """Mask2Former's own reset, `attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False`:
    torch.where(cond) is nonzero, whose shape depends on the data: dynamo breaks the graph there (fullgraph
    would fail), the mask reaches the second graph as an input. Some rows are fully masked before the reset
    (checked); the same rewrites across the two graphs, eager's results."""
    model, args = Mask2FormerDecoderTiny(), _m2f_inputs()
    with torch.no_grad():
        _, _, attn_mask = model.forward_prediction_heads(
            model.query_feat.weight.unsqueeze(1).repeat(1, 2, 1), args[1], args[0].shape[-2:])
    assert attn_mask.all(-1).any() and not attn_mask.all(-1).all()
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            got = _run(torch.compile(model, backend=rewrite_only_backend), args, train)
        want = _run(model, args, train)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{m}\n{report}")
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
        flash = counters["flash"]
        assert (flash["attention"], flash["norm"]) == (2, 5) and not report.near_misses, str(report)


def test_llava_penultimate_layer_leaves_the_last_layer_without_gradients():
    """LLaVA reads the vision tower's hidden_states[-2]: the last layer runs (its attention's dropout is kept
    in the graph: random ops are never erased as dead) but reaches no output. Its layer_norm1 is fused with
    the previous layer's residual sum, which does reach the loss: eager leaves that norm's weight and bias
    grads None, and so does the compiled step since U1's fix (it gave zeros: AdamW then decayed the weight,
    DDP's unused-parameter detection differed)."""
    model = LlavaTiny().train()
    args = (R(2, 3, 9, 9), _ids(2, 5, 13), _ids(2, 5, 13))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)
    grads = []
    for f in (compiled, model):
        model.zero_grad(set_to_none=True)
        f(*args)[0].backward()
        grads.append([p.grad is None for p in model.parameters()])
    assert grads[0] == grads[1]


class _SumUsedNormDead(nn.Module):
    """The smallest form of U1: the residual sum reaches the loss, the norm of it only a dropout nobody
    reads (kept: random)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, x, y):
        s = x + y
        dead = F.dropout(self.ln(s), 0.1, self.training)  # noqa: F841
        return s.sum()


def test_fused_norm_weight_grad_is_none_when_only_the_residual_reaches_the_loss():
    model = _SumUsedNormDead().train()
    x, y = R(2, 3, 8, requires_grad=True), R(2, 3, 8)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x, y).backward()
    assert counters["flash"]["norm"] == 1
    assert model.ln.weight.grad is None and model.ln.bias.grad is None  # eager: None (zeros before U1's fix)


def test_musicgen_streaming_under_dynamic_shapes():
    """The new steps and the past vary: the arange-built mask is symbolic (bottom-right causal, the band)."""
    model = MusicGenLMTiny(past_context=3)
    argsets = [(torch.randint(0, 9, (2, 2, s)), R(2, 4, 16), R(2, p, 2, 8), R(2, p, 2, 8))
               for s, p in ((3, 5), (4, 6), (6, 9))]
    report = _dynamic_check(model, argsets, True)
    assert counters["flash"]["attention"] >= 2 and not report.near_misses, str(report)


def test_diffusers_transformer2d_under_dynamic_shapes():
    """The text length varies (the encoder_attention_mask with it); eval."""
    model = DiffusersTransformer2DModel()
    argsets = [(R(2, 16, 3, 3), R(2, n, 12), _keep(2, n, 2)) for n in (5, 7, 10)]
    report = _dynamic_check(model, argsets, False)
    assert counters["flash"]["attention"] >= 2 and not report.near_misses, str(report)
