"""Review (session 31) of the four pass families on blocks of non-HuggingFace code bases, written tiny and
as their authors write them: torchvision (ViT, Swin-T and Swin-V2-T's shifted windows, ConvNeXt's
LayerNorm2d), Segment Anything (the ViTDet image encoder with decomposed relative positions, the two-way mask
decoder), DiT (adaLN-Zero), CompVis' latent diffusion (SpatialTransformer, CrossAttention with einsum, GEGLU),
diffusers' AttnProcessor with a mask through baddbmm, OpenFold's Evoformer MSA stack (gated attention with a
pair bias that requires grad), EVA-02 (rotary, SwiGLU, sub-LN), Perceiver (latents attend to the inputs),
flash-attn's own reference modules (SelfAttention, CrossAttention, MHA with GQA, Mlp, the prenorm Block with
the residual in fp32, GPT), Megatron-core's unfused DotProductAttention (sequence first, GQA by
repeat_interleave, baddbmm into a buffer, query-key layer scaling, the in-place -10000 fill), MAE's
norm_pix_loss and ConvNeXt-V2's GRN.

Each block is compiled with the rewrite-only backend (fullgraph; the rewritten graph runs as plain PyTorch,
the flash ops on their CPU reference) and compared with eager: in training the outputs and the gradients of
every input and parameter, in eval the outputs. The rewrites per family are asserted exactly, and so are the
near misses with their reasons. Sizes are small and odd, weights random, dropout 0 (the blocks with p > 0
check the statistics of the mask); two blocks also in bf16 (within twice eager's error).

Findings (tests/findings/codebase_review_s31.md):
- W1, FIXED (fx_passes/attention.py, _uniform_masked_rows; flash_attention(fully_masked_rows="mean")):
  flash-attn's CrossAttention (its GQA MHA path) with causal and a key padding mask leaves the first Sq - sk
  query rows of a padded sequence with no key; eager's -10000 fill averages v there, which the rewrite gave
  as 0 and gives as the mean of v now.
- M1, FIXED (fx_passes/attention.py, _split_score_bias): SAM / ViTDet's decomposed relative position bias is
  added to the scores viewed with their query and key dims split; the terms' sum, merged to (.., Sq, Sk), is
  the op's additive mask now (its gradient reaches q and the tables rel_pos_h / rel_pos_w).
- M2, FIXED (fx_passes/norm.py, _through_row_views): OpenFold's column attention normalises the transposed
  residual sum; the add was left beside a plain LayerNorm. A dropout / residual add reaching the norm through
  views that move rows whole (transpose / permute of the dims before the last, contiguous) is folded now, the
  op's output permuted as eager's input was.
- M3 (GEGLU no candidate): noted. M4, FIXED (fx_passes/attention.py, _Masks.constant_keep): an additive
  triu(-10000) band folds into causal, as a masked_fill of -10000 does.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_codebases_s30 import DiffusersCrossAttention, _relative_position_index
from test_norm_dense_ce_review_s25 import Fn, H, _run

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

FAMILIES = ("attention", "norm", "dense", "cross_entropy")
TOL = dict(atol=5e-5, rtol=5e-5)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _compile_and_compare(model, args, train, tol):
    """(report, counters["flash"]) of model compiled with the rewrite-only backend, after checking its outputs
    (and in training the gradients of every input and parameter) against eager's."""
    model.train(train)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), args, train)
    expected = _run(model, args, train)
    assert len(got) == len(expected), str(report)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.dtype == e.dtype and g.shape == e.shape, (i, str(report))
        torch.testing.assert_close(g, e, **tol, msg=lambda m, i=i: f"result {i}: {m}\n{report}")
    return report, dict(counters["flash"])


def _check_block(model, args, rewrites, near_misses=(), tol=TOL):
    """In training and in eval: eager's results, `rewrites` ({family: n}, the others 0) and exactly the near
    misses `near_misses` ((family, words of the reason) each)."""
    for train in (True, False):
        report, flash = _compile_and_compare(model, args, train, tol)
        for family in FAMILIES:
            assert flash.get(family, 0) == rewrites.get(family, 0), f"{family} ({train=}): {report}"
        assert len(report.near_misses) == len(near_misses), str(report)
        for family, words in near_misses:
            assert any(d.family == family and words in d.detail for d in report.near_misses), str(report)
    return report


# ========================================================================================================
# torchvision
# ========================================================================================================


class TVMLPBlock(nn.Sequential):
    """torchvision's vision_transformer.MLPBlock (torchvision.ops.MLP): Linear, GELU, Dropout, Linear,
    Dropout."""

    def __init__(self, in_dim, mlp_dim, dropout):
        super().__init__(nn.Linear(in_dim, mlp_dim), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(mlp_dim, in_dim), nn.Dropout(dropout))


class TVEncoderBlock(nn.Module):
    """torchvision's vision_transformer.EncoderBlock: pre-norm, nn.MultiheadAttention(batch_first=True)
    called with need_weights=False, the dropout and the residual added after it."""

    def __init__(self, num_heads, hidden_dim, mlp_dim, dropout=0.0, attention_dropout=0.0):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.ln_1 = norm_layer(hidden_dim)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, dropout=attention_dropout,
                                                    batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = norm_layer(hidden_dim)
        self.mlp = TVMLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, input):
        torch._assert(input.dim() == 3, f"Expected (batch_size, seq_length, hidden_dim) got {input.shape}")
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class TVVisionTransformer(nn.Module):
    """torchvision's VisionTransformer (conv_proj patches, class token, Encoder with a learned position
    embedding, the class token's head), with the classification loss."""

    def __init__(self, image_size=9, patch_size=3, num_layers=2, num_heads=3, hidden_dim=24, mlp_dim=40,
                 num_classes=7):
        super().__init__()
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(0.02 * torch.randn(1, 1, hidden_dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        layers = OrderedDict()
        for i in range(num_layers):
            layers[f"encoder_layer_{i}"] = TVEncoderBlock(num_heads, hidden_dim, mlp_dim)
        self.layers = nn.Sequential(layers)
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))

    def _process_input(self, x):
        n, c, h, w = x.shape
        p = self.patch_size
        torch._assert(h == self.image_size, f"Wrong image height! Expected {self.image_size} but got {h}!")
        n_h, n_w = h // p, w // p
        x = self.conv_proj(x)
        x = x.reshape(n, self.hidden_dim, n_h * n_w)
        return x.permute(0, 2, 1)

    def forward(self, x, labels):
        x = self._process_input(x)
        n = x.shape[0]
        batch_class_token = self.class_token.expand(n, -1, -1)
        x = torch.cat([batch_class_token, x], dim=1)
        x = x + self.pos_embedding
        x = self.ln(self.layers(self.dropout(x)))
        x = x[:, 0]
        logits = self.heads(x)
        return logits, F.cross_entropy(logits, labels)


def _get_relative_position_bias(relative_position_bias_table, relative_position_index, window_size):
    n = window_size[0] * window_size[1]
    relative_position_bias = relative_position_bias_table[relative_position_index]
    relative_position_bias = relative_position_bias.view(n, n, -1)
    return relative_position_bias.permute(2, 0, 1).contiguous().unsqueeze(0)


def shifted_window_attention(input, qkv_weight, proj_weight, relative_position_bias, window_size, num_heads,
                             shift_size, attention_dropout=0.0, dropout=0.0, qkv_bias=None, proj_bias=None,
                             logit_scale=None, training=True):
    """torchvision's swin_transformer.shifted_window_attention, as written (v2: logit_scale)."""
    B, H, W, C = input.shape
    # pad feature maps to multiples of window size
    pad_r = (window_size[1] - W % window_size[1]) % window_size[1]
    pad_b = (window_size[0] - H % window_size[0]) % window_size[0]
    x = F.pad(input, (0, 0, 0, pad_r, 0, pad_b))
    _, pad_H, pad_W, _ = x.shape

    shift_size = shift_size.copy()
    # If window size is larger than feature size, there is no need to shift window
    if window_size[0] >= pad_H:
        shift_size[0] = 0
    if window_size[1] >= pad_W:
        shift_size[1] = 0

    # cyclic shift
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(-shift_size[0], -shift_size[1]), dims=(1, 2))

    # partition windows
    num_windows = (pad_H // window_size[0]) * (pad_W // window_size[1])
    x = x.view(B, pad_H // window_size[0], window_size[0], pad_W // window_size[1], window_size[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * num_windows, window_size[0] * window_size[1], C)

    # multi-head attention
    if logit_scale is not None and qkv_bias is not None:
        qkv_bias = qkv_bias.clone()
        length = qkv_bias.numel() // 3
        qkv_bias[length: 2 * length].zero_()
    qkv = F.linear(x, qkv_weight, qkv_bias)
    qkv = qkv.reshape(x.size(0), x.size(1), 3, num_heads, C // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    if logit_scale is not None:
        # cosine attention
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        logit_scale = torch.clamp(logit_scale, max=math.log(100.0)).exp()
        attn = attn * logit_scale
    else:
        q = q * (C // num_heads) ** -0.5
        attn = q.matmul(k.transpose(-2, -1))
    # add relative position bias
    attn = attn + relative_position_bias

    if sum(shift_size) > 0:
        # generate attention mask
        attn_mask = x.new_zeros((pad_H, pad_W))
        h_slices = ((0, -window_size[0]), (-window_size[0], -shift_size[0]), (-shift_size[0], None))
        w_slices = ((0, -window_size[1]), (-window_size[1], -shift_size[1]), (-shift_size[1], None))
        count = 0
        for h in h_slices:
            for w in w_slices:
                attn_mask[h[0]: h[1], w[0]: w[1]] = count
                count += 1
        attn_mask = attn_mask.view(pad_H // window_size[0], window_size[0], pad_W // window_size[1],
                                   window_size[1])
        attn_mask = attn_mask.permute(0, 2, 1, 3).reshape(num_windows, window_size[0] * window_size[1])
        attn_mask = attn_mask.unsqueeze(1) - attn_mask.unsqueeze(2)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)
        attn = attn.view(x.size(0) // num_windows, num_windows, num_heads, x.size(1), x.size(1))
        attn = attn + attn_mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, x.size(1), x.size(1))

    attn = F.softmax(attn, dim=-1)
    attn = F.dropout(attn, p=attention_dropout, training=training)

    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
    x = F.linear(x, proj_weight, proj_bias)
    x = F.dropout(x, p=dropout, training=training)

    # reverse windows
    x = x.view(B, pad_H // window_size[0], pad_W // window_size[1], window_size[0], window_size[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, pad_H, pad_W, C)

    # reverse cyclic shift
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(shift_size[0], shift_size[1]), dims=(1, 2))

    # unpad features
    x = x[:, :H, :W, :].contiguous()
    return x


class TVShiftedWindowAttention(nn.Module):
    def __init__(self, dim, window_size, shift_size, num_heads):
        super().__init__()
        self.window_size, self.shift_size, self.num_heads = window_size, shift_size, num_heads
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(
            0.5 * torch.randn((2 * window_size[0] - 1) * (2 * window_size[1] - 1), num_heads))
        self.register_buffer("relative_position_index", _relative_position_index(window_size[0]).flatten())

    def forward(self, x):
        relative_position_bias = _get_relative_position_bias(self.relative_position_bias_table,
                                                             self.relative_position_index, self.window_size)
        return shifted_window_attention(x, self.qkv.weight, self.proj.weight, relative_position_bias,
                                        self.window_size, self.num_heads, shift_size=self.shift_size,
                                        qkv_bias=self.qkv.bias, proj_bias=self.proj.bias,
                                        training=self.training)


class TVSwinBlock(nn.Module):
    """torchvision's SwinTransformerBlock (stochastic depth 0)."""

    def __init__(self, dim, num_heads, window_size, shift_size):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = TVShiftedWindowAttention(dim, window_size, shift_size, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = TVMLPBlock(dim, 4 * dim, 0.0)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


def _patch_merging_pad(x):
    H, W, _ = x.shape[-3:]
    x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
    x0 = x[..., 0::2, 0::2, :]  # ... H/2 W/2 C
    x1 = x[..., 1::2, 0::2, :]
    x2 = x[..., 0::2, 1::2, :]
    x3 = x[..., 1::2, 1::2, :]
    return torch.cat([x0, x1, x2, x3], -1)  # ... H/2 W/2 4*C


class TVPatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x):
        return self.reduction(self.norm(_patch_merging_pad(x)))


class TVShiftedWindowAttentionV2(TVShiftedWindowAttention):
    """torchvision's ShiftedWindowAttentionV2: cosine attention times a learned per-head logit scale (clamped,
    exp), the relative position bias 16 * sigmoid of an MLP of log-spaced coordinates, k's bias zeroed."""

    def __init__(self, dim, window_size, shift_size, num_heads):
        super().__init__(dim, window_size, shift_size, num_heads)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))) + 0.3 * torch.randn(
            num_heads, 1, 1))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 32, bias=True), nn.ReLU(inplace=True),
                                     nn.Linear(32, num_heads, bias=False))
        relative_coords_h = torch.arange(-(window_size[0] - 1), window_size[0], dtype=torch.float32)
        relative_coords_w = torch.arange(-(window_size[1] - 1), window_size[1], dtype=torch.float32)
        relative_coords_table = torch.stack(torch.meshgrid([relative_coords_h, relative_coords_w],
                                                           indexing="ij"))
        relative_coords_table = relative_coords_table.permute(1, 2, 0).contiguous().unsqueeze(0)
        relative_coords_table[:, :, :, 0] /= window_size[0] - 1
        relative_coords_table[:, :, :, 1] /= window_size[1] - 1
        relative_coords_table *= 8  # normalize to -8, 8
        relative_coords_table = (torch.sign(relative_coords_table)
                                 * torch.log2(torch.abs(relative_coords_table) + 1.0) / 3.0)
        self.register_buffer("relative_coords_table", relative_coords_table)

    def forward(self, x):
        relative_position_bias = _get_relative_position_bias(
            self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads), self.relative_position_index,
            self.window_size)
        relative_position_bias = 16 * torch.sigmoid(relative_position_bias)
        return shifted_window_attention(x, self.qkv.weight, self.proj.weight, relative_position_bias,
                                        self.window_size, self.num_heads, shift_size=self.shift_size,
                                        qkv_bias=self.qkv.bias, proj_bias=self.proj.bias,
                                        logit_scale=self.logit_scale, training=self.training)


class TVSwinBlockV2(TVSwinBlock):
    """torchvision's SwinTransformerBlockV2: the norms after the attention and the MLP (res-post-norm)."""

    def __init__(self, dim, num_heads, window_size, shift_size):
        super().__init__(dim, num_heads, window_size, shift_size)
        self.attn = TVShiftedWindowAttentionV2(dim, window_size, shift_size, num_heads)

    def forward(self, x):
        x = x + self.norm1(self.attn(x))
        x = x + self.norm2(self.mlp(x))
        return x


class TVPatchMergingV2(TVPatchMerging):
    def __init__(self, dim):
        super().__init__(dim)
        self.norm = nn.LayerNorm(2 * dim)

    def forward(self, x):
        return self.norm(self.reduction(_patch_merging_pad(x)))


class TVSwinT(nn.Module):
    """torchvision's SwinTransformer (swin_t; v2: swin_v2_t's blocks and patch merging), two stages: a 5 x 5
    map in windows of 3 (padded to 6 x 6, 4 windows; the second block shifted by 1, with the -100 mask), patch
    merging to 3 x 3, one block whose shift is dropped (the window covers the map), the final norm, pooling
    and head."""

    def __init__(self, embed_dim=16, num_classes=7, v2=False):
        super().__init__()
        block, merging = (TVSwinBlockV2, TVPatchMergingV2) if v2 else (TVSwinBlock, TVPatchMerging)
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, embed_dim, kernel_size=2, stride=2), Permute([0, 2, 3, 1]),
                          nn.LayerNorm(embed_dim)),
            nn.Sequential(block(embed_dim, 2, [3, 3], [0, 0]), block(embed_dim, 2, [3, 3], [1, 1])),
            merging(embed_dim),
            nn.Sequential(block(2 * embed_dim, 4, [3, 3], [1, 1])),
        )
        self.norm = nn.LayerNorm(2 * embed_dim)
        self.permute = Permute([0, 3, 1, 2])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.head = nn.Linear(2 * embed_dim, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = self.norm(x)
        x = self.permute(x)
        x = self.avgpool(x)
        x = self.flatten(x)
        return self.head(x)


class TVLayerNorm2d(nn.LayerNorm):
    """torchvision's convnext.LayerNorm2d: F.layer_norm over the channels of a permuted tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class TVCNBlock(nn.Module):
    """torchvision's convnext.CNBlock (stochastic depth 0): the block permutes to channels last around its
    LayerNorm and MLP; the input is added in place to the layer-scaled result."""

    def __init__(self, dim, layer_scale=0.5):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(in_features=dim, out_features=4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(in_features=4 * dim, out_features=dim, bias=True),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)

    def forward(self, input):
        result = self.layer_scale * self.block(input)
        result += input
        return result


class TVConvNeXt(nn.Module):
    """torchvision's ConvNeXt, two stages of one block: the stem (conv 4 x 4 + LayerNorm2d), a downsampling
    LayerNorm2d + conv, the classifier's LayerNorm2d on the pooled (B, C, 1, 1) map."""

    def __init__(self, dims=(16, 24), num_classes=7):
        super().__init__()
        norm_layer = partial(TVLayerNorm2d, eps=1e-6)
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4), norm_layer(dims[0])),
            nn.Sequential(TVCNBlock(dims[0])),
            nn.Sequential(norm_layer(dims[0]), nn.Conv2d(dims[0], dims[1], kernel_size=2, stride=2)),
            nn.Sequential(TVCNBlock(dims[1])),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(norm_layer(dims[1]), nn.Flatten(1), nn.Linear(dims[1], num_classes))

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(x)



# ========================================================================================================
# Segment Anything
# ========================================================================================================


def get_rel_pos(q_size, k_size, rel_pos):
    """segment_anything/modeling/image_encoder.py (the interpolation branch is not taken: sizes match)."""
    max_rel_dist = int(2 * max(q_size, k_size) - 1)
    if rel_pos.shape[0] != max_rel_dist:
        rel_pos_resized = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1),
                                        size=max_rel_dist, mode="linear")
        rel_pos_resized = rel_pos_resized.reshape(-1, max_rel_dist).permute(1, 0)
    else:
        rel_pos_resized = rel_pos
    # Scale the coords with short length if shapes for q and k are different.
    q_coords = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
    relative_coords = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return rel_pos_resized[relative_coords.long()]


def add_decomposed_rel_pos(attn, q, rel_pos_h, rel_pos_w, q_size, k_size):
    """MViTv2's decomposed relative positions (SAM, detectron2's ViTDet): a bias computed from q (unscaled)
    and two learned tables."""
    q_h, q_w = q_size
    k_h, k_w = k_size
    Rh = get_rel_pos(q_h, k_h, rel_pos_h)
    Rw = get_rel_pos(q_w, k_w, rel_pos_w)
    B, _, dim = q.shape
    r_q = q.reshape(B, q_h, q_w, dim)
    rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh)
    rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw)
    attn = (attn.view(B, q_h, q_w, k_h, k_w) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).view(
        B, q_h * q_w, k_h * k_w)
    return attn


class SAMAttention(nn.Module):
    """SAM's image encoder Attention: heads merged into the batch ((B·heads, H·W, C)), (q * scale) @ kᵀ, the
    decomposed relative position bias, softmax, @ v."""

    def __init__(self, dim, num_heads, input_size):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(0.3 * torch.randn(2 * input_size[0] - 1, head_dim))
        self.rel_pos_w = nn.Parameter(0.3 * torch.randn(2 * input_size[1] - 1, head_dim))

    def forward(self, x):
        B, H, W, _ = x.shape
        # qkv with shape (3, B, nHead, H * W, C)
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        # q, k, v with shape (B * nHead, H * W, C)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = add_decomposed_rel_pos(attn, q, self.rel_pos_h, self.rel_pos_w, (H, W), (H, W))
        attn = attn.softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


def window_partition(x, window_size):
    B, H, W, C = x.shape
    pad_h = (window_size - H % window_size) % window_size
    pad_w = (window_size - W % window_size) % window_size
    if pad_h > 0 or pad_w > 0:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window_size, window_size, Wp // window_size, window_size, C)
    windows = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)
    return windows, (Hp, Wp)


def window_unpartition(windows, window_size, pad_hw, hw):
    Hp, Wp = pad_hw
    H, W = hw
    B = windows.shape[0] // (Hp * Wp // window_size // window_size)
    x = windows.view(B, Hp // window_size, Wp // window_size, window_size, window_size, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, Hp, Wp, -1)
    if Hp > H or Wp > W:
        x = x[:, :H, :W, :].contiguous()
    return x


class SAMMLPBlock(nn.Module):
    def __init__(self, embedding_dim, mlp_dim, act=nn.GELU):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(embedding_dim, mlp_dim), nn.Linear(mlp_dim, embedding_dim)
        self.act = act()

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


class SAMBlock(nn.Module):
    """SAM's image encoder Block: windowed (padded) or global attention, then the MLP."""

    def __init__(self, dim, num_heads, window_size, input_size):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = SAMAttention(dim, num_heads,
                                 input_size if window_size == 0 else (window_size, window_size))
        self.mlp = SAMMLPBlock(dim, 2 * dim)
        self.window_size = window_size

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        # Window partition
        if self.window_size > 0:
            H, W = x.shape[1], x.shape[2]
            x, pad_hw = window_partition(x, self.window_size)
        x = self.attn(x)
        # Reverse window partition
        if self.window_size > 0:
            x = window_unpartition(x, self.window_size, pad_hw, (H, W))
        x = shortcut + x
        x = x + self.mlp(self.norm2(x))
        return x


class SAMLayerNorm2d(nn.Module):
    """SAM's (and detectron2's) channels-first LayerNorm2d, over dim 1."""

    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(num_channels))
        self.bias = nn.Parameter(0.1 * torch.randn(num_channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        x = self.weight[:, None, None] * x + self.bias[:, None, None]
        return x


class SAMImageEncoder(nn.Module):
    """SAM's ImageEncoderViT: patches (B, H, W, C) with an absolute position embedding, a windowed block
    (window 3 over 5 x 5: padded to 6 x 6) and a global one, the neck with two channels-first LayerNorm2d."""

    def __init__(self, img_size=20, patch_size=4, embed_dim=24, num_heads=3, out_chans=16):
        super().__init__()
        grid = img_size // patch_size
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, grid, grid, embed_dim))
        self.blocks = nn.ModuleList([SAMBlock(embed_dim, num_heads, 3, (grid, grid)),
                                     SAMBlock(embed_dim, num_heads, 0, (grid, grid))])
        self.neck = nn.Sequential(nn.Conv2d(embed_dim, out_chans, kernel_size=1, bias=False),
                                  SAMLayerNorm2d(out_chans),
                                  nn.Conv2d(out_chans, out_chans, kernel_size=3, padding=1, bias=False),
                                  SAMLayerNorm2d(out_chans))

    def forward(self, x):
        x = self.patch_embed(x).permute(0, 2, 3, 1)  # PatchEmbed: B C H W -> B H W C
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.neck(x.permute(0, 3, 1, 2))


class SAMDecoderAttention(nn.Module):
    """SAM's mask decoder Attention: q / k / v projected down (downsample_rate), heads separated with
    reshape + transpose, q @ k.permute(0, 1, 3, 2), / math.sqrt(c_per_head), torch.softmax."""

    def __init__(self, embedding_dim, num_heads, downsample_rate=1):
        super().__init__()
        self.internal_dim, self.num_heads = embedding_dim // downsample_rate, num_heads
        self.q_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.k_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.v_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.out_proj = nn.Linear(self.internal_dim, embedding_dim)

    def _separate_heads(self, x, num_heads):
        b, n, c = x.shape
        x = x.reshape(b, n, num_heads, c // num_heads)
        return x.transpose(1, 2)  # B x N_heads x N_tokens x C_per_head

    def _recombine_heads(self, x):
        b, n_heads, n_tokens, c_per_head = x.shape
        x = x.transpose(1, 2)
        return x.reshape(b, n_tokens, n_heads * c_per_head)  # B x N_tokens x C

    def forward(self, q, k, v):
        q, k, v = self.q_proj(q), self.k_proj(k), self.v_proj(v)
        q = self._separate_heads(q, self.num_heads)
        k = self._separate_heads(k, self.num_heads)
        v = self._separate_heads(v, self.num_heads)
        _, _, _, c_per_head = q.shape
        attn = q @ k.permute(0, 1, 3, 2)  # B x N_heads x N_tokens x N_tokens
        attn = attn / math.sqrt(c_per_head)
        attn = torch.softmax(attn, dim=-1)
        out = attn @ v
        out = self._recombine_heads(out)
        return self.out_proj(out)


class SAMTwoWayAttentionBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_dim, skip_first_layer_pe):
        super().__init__()
        self.self_attn = SAMDecoderAttention(dim, num_heads)
        self.norm1 = nn.LayerNorm(dim)
        self.cross_attn_token_to_image = SAMDecoderAttention(dim, num_heads, downsample_rate=2)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = SAMMLPBlock(dim, mlp_dim, nn.ReLU)
        self.norm3 = nn.LayerNorm(dim)
        self.norm4 = nn.LayerNorm(dim)
        self.cross_attn_image_to_token = SAMDecoderAttention(dim, num_heads, downsample_rate=2)
        self.skip_first_layer_pe = skip_first_layer_pe

    def forward(self, queries, keys, query_pe, key_pe):
        # Self attention block
        if self.skip_first_layer_pe:
            queries = self.self_attn(q=queries, k=queries, v=queries)
        else:
            q = queries + query_pe
            attn_out = self.self_attn(q=q, k=q, v=queries)
            queries = queries + attn_out
        queries = self.norm1(queries)
        # Cross attention block, tokens attending to image embedding
        q = queries + query_pe
        k = keys + key_pe
        attn_out = self.cross_attn_token_to_image(q=q, k=k, v=keys)
        queries = queries + attn_out
        queries = self.norm2(queries)
        # MLP block
        mlp_out = self.mlp(queries)
        queries = queries + mlp_out
        queries = self.norm3(queries)
        # Cross attention block, image embedding attending to tokens
        q = queries + query_pe
        k = keys + key_pe
        attn_out = self.cross_attn_image_to_token(q=k, k=q, v=queries)
        keys = keys + attn_out
        keys = self.norm4(keys)
        return queries, keys


class SAMTwoWayTransformer(nn.Module):
    """SAM's TwoWayTransformer (mask decoder): 5 point tokens and a 3 x 5 image embedding attend to each
    other (head_dim 16, 8 in the downsampled cross attentions); ReLU MLPs; the final token-to-image attention
    and norm."""

    def __init__(self, dim=48, num_heads=3, mlp_dim=40):
        super().__init__()
        self.layers = nn.ModuleList([SAMTwoWayAttentionBlock(dim, num_heads, mlp_dim, i == 0)
                                     for i in range(2)])
        self.final_attn_token_to_image = SAMDecoderAttention(dim, num_heads, downsample_rate=2)
        self.norm_final_attn = nn.LayerNorm(dim)

    def forward(self, image_embedding, image_pe, point_embedding):
        image_embedding = image_embedding.flatten(2).permute(0, 2, 1)
        image_pe = image_pe.flatten(2).permute(0, 2, 1)
        queries, keys = point_embedding, image_embedding
        for layer in self.layers:
            queries, keys = layer(queries=queries, keys=keys, query_pe=point_embedding, key_pe=image_pe)
        q = queries + point_embedding
        k = keys + image_pe
        attn_out = self.final_attn_token_to_image(q=q, k=k, v=keys)
        queries = queries + attn_out
        queries = self.norm_final_attn(queries)
        return queries, keys



# ========================================================================================================
# DiT
# ========================================================================================================


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimmSDPAAttention(nn.Module):
    """timm's Attention with fused_attn (what DiT imports): F.scaled_dot_product_attention."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop, self.proj = nn.Dropout(attn_drop), nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


class TimmMlp(nn.Module):
    """timm's Mlp: fc1, act, drop1, norm (Identity), fc2, drop2."""

    def __init__(self, in_features, hidden_features, act_layer=nn.GELU, norm_layer=None, drop=0.0):
        super().__init__()
        self.fc1, self.act = nn.Linear(in_features, hidden_features), act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2, self.drop2 = nn.Linear(hidden_features, in_features), nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class DiTBlock(nn.Module):
    """DiT's block with adaLN-Zero conditioning (the modulation weights random here, not zero)."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = TimmSDPAAttention(hidden_size, num_heads=num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        approx_gelu = lambda: nn.GELU(approximate="tanh")  # noqa: E731  (DiT's own spelling)
        self.mlp = TimmMlp(in_features=hidden_size, hidden_features=mlp_hidden_dim, act_layer=approx_gelu,
                           drop=0)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6,
                                                                                                         dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class DiTFinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        x = modulate(self.norm_final(x), shift, scale)
        return self.linear(x)


class DiT(nn.Module):
    """DiT: timm's PatchEmbed (conv, flatten(2).transpose(1, 2)), a fixed position embedding, the timestep
    embedder (sinusoid + MLP) and the label embedder (class dropout 0), 2 blocks, the final layer and
    unpatchify (einsum 'nhwpqc->nchpwq'), learn_sigma: twice the input channels out."""

    def __init__(self, input_size=15, patch_size=3, in_channels=4, hidden_size=24, num_heads=3,
                 num_classes=5):
        super().__init__()
        self.patch_size, self.in_channels, self.out_channels = patch_size, in_channels, 2 * in_channels
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        num_patches = (input_size // patch_size) ** 2
        self.register_buffer("pos_embed", 0.1 * torch.randn(1, num_patches, hidden_size))
        self.frequency_embedding_size = 16
        self.t_mlp = nn.Sequential(nn.Linear(16, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads) for _ in range(2)])
        self.final_layer = DiTFinalLayer(hidden_size, patch_size, self.out_channels)

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
                          ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def unpatchify(self, x):
        c = self.out_channels
        p = self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        assert h * w == x.shape[1]
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y):
        x = self.proj(x).flatten(2).transpose(1, 2) + self.pos_embed  # (N, T, D)
        t = self.t_mlp(self.timestep_embedding(t, self.frequency_embedding_size))
        y = self.embedding_table(y)
        c = t + y
        for block in self.blocks:
            x = block(x, c)
        x = self.final_layer(x, c)
        return self.unpatchify(x)


# ========================================================================================================
# CompVis latent diffusion (Stable Diffusion v1), diffusers
# ========================================================================================================


def _to_batch_heads(t, h):
    # einops: rearrange(t, 'b n (h d) -> (b h) n d', h=h)
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).permute(0, 2, 1, 3).reshape(b * h, n, hd // h)


def _from_batch_heads(t, h):
    # einops: rearrange(out, '(b h) n d -> b n (h d)', h=h)
    bh, n, d = t.shape
    return t.reshape(bh // h, h, n, d).permute(0, 2, 1, 3).reshape(bh // h, n, h * d)


def _ldm_attend(q, k, v, h, scale, mask=None, dropout=None):
    """The body of ldm's (and perceiver-pytorch's) CrossAttention.forward after the projections."""
    q, k, v = (_to_batch_heads(t, h) for t in (q, k, v))
    sim = torch.einsum("b i d, b j d -> b i j", q, k) * scale
    if mask is not None:
        mask = mask.reshape(mask.shape[0], -1)  # rearrange(mask, 'b ... -> b (...)')
        max_neg_value = -torch.finfo(sim.dtype).max
        b, j = mask.shape
        mask = mask[:, None, None, :].expand(b, h, 1, j).reshape(b * h, 1, j)  # repeat 'b j -> (b h) () j'
        sim.masked_fill_(~mask, max_neg_value)
    # attention, what we cannot get enough of
    attn = sim.softmax(dim=-1)
    if dropout is not None:
        attn = dropout(attn)
    out = torch.einsum("b i j, b j d -> b i d", attn, v)
    return _from_batch_heads(out, h)


class LdmCrossAttention(nn.Module):
    """ldm/modules/attention.py CrossAttention: to_q / to_k / to_v without bias, heads merged into the batch,
    einsum('b i d, b j d -> b i j') * scale, the key mask filled in place with -finfo.max,
    sim.softmax(dim=-1), einsum('b i j, b j d -> b i d')."""

    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = context_dim if context_dim is not None else query_dim
        self.scale, self.heads = dim_head**-0.5, heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        q = self.to_q(x)
        context = context if context is not None else x
        k = self.to_k(context)
        v = self.to_v(context)
        return self.to_out(_ldm_attend(q, k, v, self.heads, self.scale, mask))


class LdmGEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class LdmFeedForward(nn.Module):
    def __init__(self, dim, mult=4, glu=False, dropout=0.0):
        super().__init__()
        inner_dim = int(dim * mult)
        project_in = (nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU()) if not glu
                      else LdmGEGLU(dim, inner_dim))
        self.net = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner_dim, dim))

    def forward(self, x):
        return self.net(x)


class LdmBasicTransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, d_head, context_dim=None, gated_ff=True):
        super().__init__()
        self.attn1 = LdmCrossAttention(query_dim=dim, heads=n_heads, dim_head=d_head)  # self-attention
        self.ff = LdmFeedForward(dim, glu=gated_ff)
        self.attn2 = LdmCrossAttention(query_dim=dim, context_dim=context_dim, heads=n_heads, dim_head=d_head)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, context=None):
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context=context) + x
        x = self.ff(self.norm3(x)) + x
        return x


class LdmSpatialTransformer(nn.Module):
    """ldm's SpatialTransformer: GroupNorm, a 1 x 1 conv in, 'b c h w -> b (h w) c', the transformer block
    (self-attention, cross-attention to the text context, GEGLU), back, a 1 x 1 conv out, the residual."""

    def __init__(self, in_channels=16, n_heads=2, d_head=8, context_dim=12, gated_ff=True):
        super().__init__()
        inner_dim = n_heads * d_head
        self.norm = nn.GroupNorm(num_groups=4, num_channels=in_channels, eps=1e-6, affine=True)
        self.proj_in = nn.Conv2d(in_channels, inner_dim, kernel_size=1, stride=1, padding=0)
        self.transformer_blocks = nn.ModuleList(
            [LdmBasicTransformerBlock(inner_dim, n_heads, d_head, context_dim=context_dim,
                                      gated_ff=gated_ff)])
        self.proj_out = nn.Conv2d(inner_dim, in_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        x = self.proj_in(x)
        x = x.permute(0, 2, 3, 1).reshape(b, h * w, -1)  # rearrange(x, 'b c h w -> b (h w) c')
        for block in self.transformer_blocks:
            x = block(x, context=context)
        x = x.reshape(b, h, w, -1).permute(0, 3, 1, 2)  # rearrange(x, 'b (h w) c -> b c h w', h=h, w=w)
        x = self.proj_out(x)
        return x + x_in


class DiffusersMaskedCrossAttention(DiffusersCrossAttention):
    """diffusers' cross-attention with an encoder_attention_mask as the UNet prepares it: the keep mask turned
    into a bias, (1 - mask) * -10000.0, unsqueeze(1), then Attention.prepare_attention_mask repeats it over
    the heads (repeat_interleave on dim 0, output_size given) for baddbmm(mask, q, kᵀ, beta=1,
    alpha=scale)."""

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask):
        encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
        encoder_attention_mask = encoder_attention_mask.unsqueeze(1)
        attention_mask = encoder_attention_mask.repeat_interleave(
            self.heads, dim=0, output_size=encoder_attention_mask.shape[0] * self.heads)
        return super().forward(hidden_states, encoder_hidden_states, attention_mask)


# ========================================================================================================
# OpenFold (AlphaFold 2)
# ========================================================================================================


def permute_final_dims(tensor, inds):
    zero_index = -1 * len(inds)
    first_inds = list(range(len(tensor.shape[:zero_index])))
    return tensor.permute(first_inds + [zero_index + i for i in inds])


def flatten_final_dims(t, no_dims):
    return t.reshape(t.shape[:-no_dims] + (-1,))


def _openfold_attention(query, key, value, biases):
    # [*, H, C_hidden, K]
    key = permute_final_dims(key, (1, 0))
    # [*, H, Q, K]
    a = torch.matmul(query, key)
    for b in biases:
        a += b
    a = F.softmax(a, dim=-1)  # softmax_no_cast
    # [*, H, Q, C_hidden]
    return torch.matmul(a, value)


class OpenFoldAttention(nn.Module):
    """openfold/model/primitives.py Attention: q, k, v viewed to heads and transposed, q /= sqrt(c) in place,
    the biases added in place to the scores, the output gated by sigmoid(linear_g(q_x))."""

    def __init__(self, c_q, c_k, c_v, c_hidden, no_heads, gating=True):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        self.linear_q = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_k, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_v, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_q)
        self.linear_g = nn.Linear(c_q, c_hidden * no_heads) if gating else None
        self.sigmoid = nn.Sigmoid()

    def _prep_qkv(self, q_x, kv_x):
        q, k, v = self.linear_q(q_x), self.linear_k(kv_x), self.linear_v(kv_x)
        # [*, Q/K, H, C_hidden]
        q = q.view(q.shape[:-1] + (self.no_heads, -1))
        k = k.view(k.shape[:-1] + (self.no_heads, -1))
        v = v.view(v.shape[:-1] + (self.no_heads, -1))
        # [*, H, Q/K, C_hidden]
        q, k, v = q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3)
        q /= math.sqrt(self.c_hidden)
        return q, k, v

    def _wrap_up(self, o, q_x):
        if self.linear_g is not None:
            g = self.sigmoid(self.linear_g(q_x))
            # [*, Q, H, C_hidden]
            g = g.view(g.shape[:-1] + (self.no_heads, -1))
            o = o * g
        # [*, Q, H * C_hidden]
        o = flatten_final_dims(o, 2)
        return self.linear_o(o)

    def forward(self, q_x, kv_x, biases):
        q, k, v = self._prep_qkv(q_x, kv_x)
        o = _openfold_attention(q, k, v, biases)
        o = o.transpose(-2, -3)
        return self._wrap_up(o, q_x)


class OpenFoldMSAAttention(nn.Module):
    """openfold/model/msa.py MSAAttention: the MSA mask as a -1e9 bias over keys ([*, N_seq, 1, 1, N_res]);
    with a pair representation z (row attention with pair bias) z's LayerNorm and Linear give one bias per
    head, permuted to [*, 1, H, R, R]: a bias that requires grad. m: [*, S, R, C_m]; without a batch dim the
    scores are 4-d ([S, H, R, R]), with one 5-d."""

    def __init__(self, c_m=16, c_z=None, c_hidden=8, no_heads=2, inf=1e9):
        super().__init__()
        self.no_heads, self.inf, self.pair_bias = no_heads, inf, c_z is not None
        self.layer_norm_m = nn.LayerNorm(c_m)
        if self.pair_bias:
            self.layer_norm_z = nn.LayerNorm(c_z)
            self.linear_z = nn.Linear(c_z, no_heads, bias=False)
        self.mha = OpenFoldAttention(c_m, c_m, c_m, c_hidden, no_heads)

    def forward(self, m, z=None, mask=None):
        # [*, N_seq, 1, 1, N_res]
        mask_bias = (self.inf * (mask - 1))[..., :, None, None, :]
        biases = [mask_bias]
        if self.pair_bias:
            z = self.layer_norm_z(z)
            # [*, N_res, N_res, no_heads]
            z = self.linear_z(z)
            # [*, 1, no_heads, N_res, N_res]
            z = permute_final_dims(z, (2, 0, 1)).unsqueeze(-4)
            biases.append(z)
        m = self.layer_norm_m(m)
        return self.mha(q_x=m, kv_x=m, biases=biases)


class OpenFoldMSAColumnAttention(nn.Module):
    def __init__(self, c_m=16, c_hidden=8, no_heads=2):
        super().__init__()
        self._msa_att = OpenFoldMSAAttention(c_m, None, c_hidden, no_heads)

    def forward(self, m, mask):
        # [*, N_res, N_seq, C_in]
        m = m.transpose(-2, -3)
        mask = mask.transpose(-1, -2)
        m = self._msa_att(m, mask=mask)
        # [*, N_seq, N_res, C_in]
        return m.transpose(-2, -3)


class OpenFoldDropoutRowwise(nn.Module):
    """openfold/model/dropout.py: one dropout mask shared along dim -3, multiplied in place."""

    def __init__(self, r, batch_dim=-3):
        super().__init__()
        self.batch_dim, self.dropout = [batch_dim], nn.Dropout(p=r)

    def forward(self, x):
        shape = list(x.shape)
        for bd in self.batch_dim:
            shape[bd] = 1
        mask = x.new_ones(shape)
        mask = self.dropout(mask)
        x *= mask
        return x


class OpenFoldMSATransition(nn.Module):
    def __init__(self, c_m=16, n=2):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_1, self.relu, self.linear_2 = nn.Linear(c_m, n * c_m), nn.ReLU(), nn.Linear(n * c_m, c_m)

    def forward(self, m, mask):
        mask = mask.unsqueeze(-1)
        m = self.layer_norm(m)
        m = self.relu(self.linear_1(m))
        return self.linear_2(m) * mask


class OpenFoldEvoformerMSA(nn.Module):
    """The MSA half of OpenFold's EvoformerBlock: row attention with the pair bias (behind a row-wise
    dropout, p = 0 here), column attention, the transition, each added to m."""

    def __init__(self, c_m=16, c_z=12):
        super().__init__()
        self.msa_att_row = OpenFoldMSAAttention(c_m, c_z)
        self.msa_dropout_layer = OpenFoldDropoutRowwise(0.0)
        self.msa_att_col = OpenFoldMSAColumnAttention(c_m)
        self.msa_transition = OpenFoldMSATransition(c_m)

    def forward(self, m, z, msa_mask):
        msa_mask = msa_mask.to(m.dtype)  # a float mask in OpenFold: given as bool, it gets no gradient here
        m = m + self.msa_dropout_layer(self.msa_att_row(m, z=z, mask=msa_mask))
        m = m + self.msa_att_col(m, mask=msa_mask)
        m = m + self.msa_transition(m, mask=msa_mask)
        return m



# ========================================================================================================
# EVA-02 (timm), Perceiver (lucidrains)
# ========================================================================================================


def rot(x):
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def apply_rot_embed_cat(x, emb):
    sin_emb, cos_emb = emb.tensor_split(2, -1)
    if emb.ndim == 3:
        return x * cos_emb.unsqueeze(1).expand_as(x) + rot(x) * sin_emb.unsqueeze(1).expand_as(x)
    return x * cos_emb + rot(x) * sin_emb


def _eva_rope(n, dim):
    """What timm's RotaryEmbeddingCat.get_embed returns for n positions: cat([sin, cos], -1), interleaved."""
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(n).float(), freqs).repeat_interleave(2, -1)
    return torch.cat([angles.sin(), angles.cos()], -1)


class EvaAttention(nn.Module):
    """timm's EvaAttention (EVA-02): q / v biases concatenated with k's zeros into F.linear, rotary on every
    token but the class token (cat, type_as(v)), SDPA or the manual path with a key mask filled with -inf,
    and the sub-LN (scale_norm) before the output projection."""

    def __init__(self, dim, num_heads=3, num_prefix_tokens=1, fused_attn=True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale, self.num_prefix_tokens = self.head_dim**-0.5, num_prefix_tokens
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(0.1 * torch.randn(dim)), nn.Parameter(0.1 * torch.randn(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.proj, self.proj_drop = nn.Linear(dim, dim), nn.Dropout(0.0)

    def forward(self, x, rope=None, attn_mask=None):
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # B, num_heads, N, head_dim
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            npt = self.num_prefix_tokens
            q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope)], dim=2).type_as(v)
            k = torch.cat([k[:, :, :npt, :], apply_rot_embed_cat(k[:, :, npt:, :], rope)], dim=2).type_as(v)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if attn_mask is not None:
                attn_mask = attn_mask.to(torch.bool)
                attn = attn.masked_fill(~attn_mask[:, None, None, :], float("-inf"))
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        return self.proj_drop(x)


class TimmSwiGLU(nn.Module):
    """timm's SwiGLU with its sub-LN (EVA-02's scale_mlp: norm_layer over the hidden features)."""

    def __init__(self, in_features, hidden_features, norm_layer=None):
        super().__init__()
        self.fc1_g = nn.Linear(in_features, hidden_features)
        self.fc1_x = nn.Linear(in_features, hidden_features)
        self.act, self.drop1 = nn.SiLU(), nn.Dropout(0.0)
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2, self.drop2 = nn.Linear(hidden_features, in_features), nn.Dropout(0.0)

    def forward(self, x):
        x_gate = self.fc1_g(x)
        x = self.fc1_x(x)
        x = self.act(x_gate) * x
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


class EvaBlock(nn.Module):
    def __init__(self, dim, num_heads, fused_attn):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = EvaAttention(dim, num_heads, fused_attn=fused_attn)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = TimmSwiGLU(dim, 2 * dim + 3, norm_layer=partial(nn.LayerNorm, eps=1e-6))

    def forward(self, x, rope=None, attn_mask=None):
        x = x + self.attn(self.norm1(x), rope=rope, attn_mask=attn_mask)
        x = x + self.mlp(self.norm2(x))
        return x


class Eva02(nn.Module):
    """EVA-02: a class token and 8 patch tokens (given as embeddings), rotary for the patches, 2 blocks, the
    final norm, the class token's head and the loss."""

    def __init__(self, dim=24, num_heads=3, fused_attn=True, num_classes=5):
        super().__init__()
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList([EvaBlock(dim, num_heads, fused_attn) for _ in range(2)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        self.head_dim = dim // num_heads

    def forward(self, x, labels, attn_mask=None):
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        rope = _eva_rope(x.shape[1] - 1, self.head_dim)
        for blk in self.blocks:
            x = blk(x, rope=rope, attn_mask=attn_mask)
        logits = self.head(self.norm(x)[:, 0])
        return logits, F.cross_entropy(logits, labels)


class PerceiverAttention(nn.Module):
    """perceiver-pytorch's Attention: ldm's, with k and v from one to_kv projection (chunk) and dropout on the
    probabilities."""

    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = context_dim if context_dim is not None else query_dim
        self.scale, self.heads = dim_head**-0.5, heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(context_dim, inner_dim * 2, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, query_dim)

    def forward(self, x, context=None, mask=None):
        q = self.to_q(x)
        context = context if context is not None else x
        k, v = self.to_kv(context).chunk(2, dim=-1)
        return self.to_out(_ldm_attend(q, k, v, self.heads, self.scale, mask, self.dropout))


class PerceiverPreNorm(nn.Module):
    def __init__(self, dim, fn, context_dim=None):
        super().__init__()
        self.fn, self.norm = fn, nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if context_dim is not None else None

    def forward(self, x, **kwargs):
        x = self.norm(x)
        if self.norm_context is not None:
            kwargs.update(context=self.norm_context(kwargs["context"]))
        return self.fn(x, **kwargs)


class PerceiverGEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class PerceiverFeedForward(nn.Module):
    def __init__(self, dim, mult=2, dropout=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult * 2), PerceiverGEGLU(), nn.Linear(dim * mult, dim),
                                 nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Perceiver(nn.Module):
    """perceiver-pytorch's Perceiver, one layer: 5 learned latents attend to 11 inputs (key mask), a latent
    self-attention, GEGLU feed-forwards, the mean-pooled logits and the loss."""

    def __init__(self, input_dim=12, latent_dim=16, num_latents=5, heads=2, dim_head=8, num_classes=5):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim))
        self.cross_attn = PerceiverPreNorm(latent_dim, PerceiverAttention(latent_dim, input_dim, heads=1,
                                                                          dim_head=16), context_dim=input_dim)
        self.cross_ff = PerceiverPreNorm(latent_dim, PerceiverFeedForward(latent_dim))
        self.self_attn = PerceiverPreNorm(latent_dim, PerceiverAttention(latent_dim, heads=heads,
                                                                         dim_head=dim_head))
        self.self_ff = PerceiverPreNorm(latent_dim, PerceiverFeedForward(latent_dim))
        self.to_logits = nn.Sequential(nn.LayerNorm(latent_dim), nn.Linear(latent_dim, num_classes))

    def forward(self, data, labels, mask=None):
        b = data.shape[0]
        x = self.latents.unsqueeze(0).expand(b, -1, -1)  # repeat(self.latents, 'n d -> b n d', b=b)
        x = self.cross_attn(x, context=data, mask=mask) + x
        x = self.cross_ff(x) + x
        x = self.self_attn(x) + x
        x = self.self_ff(x) + x
        logits = self.to_logits(x.mean(dim=-2))  # Reduce('b n d -> b d', 'mean')
        return logits, F.cross_entropy(logits, labels)



# ========================================================================================================
# flash-attn's reference modules (flash_attn/modules/mha.py, mlp.py, block.py; models/gpt.py)
# ========================================================================================================


def _add_key_padding_bias(scores, key_padding_mask):
    """flash-attn's reference modules: the (B, Sk) keep mask as a -10000 bias (adding is faster than
    masked_fill_, their comment says)."""
    batch_size, seqlen = key_padding_mask.shape
    padding_mask = torch.full((batch_size, seqlen), -10000.0, dtype=scores.dtype, device=scores.device)
    padding_mask.masked_fill_(key_padding_mask, 0.0)
    return scores + padding_mask.reshape(batch_size, 1, 1, seqlen)  # rearrange "b s -> b 1 1 s"


class FlashAttnSelfAttention(nn.Module):
    """flash_attn.modules.mha.SelfAttention: qkv (B, S, 3, H, D), k pre-scaled inside the einsum, the key
    padding mask as a -10000 bias (torch.full + masked_fill_), the causal mask a triu of -10000 added,
    softmax(dtype=v.dtype), einsum back to (B, S, H, D)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal, self.softmax_scale = causal, softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        seqlen = qkv.shape[1]
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if key_padding_mask is not None:
            scores = _add_key_padding_bias(scores, key_padding_mask)
        if causal:
            causal_mask = torch.triu(torch.full((seqlen, seqlen), -10000.0, device=scores.device), 1)
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        attention_drop = self.drop(attention)
        return torch.einsum("bhts,bshd->bthd", attention_drop, v)


class FlashAttnCrossAttention(nn.Module):
    """flash_attn.modules.mha.CrossAttention: kv (B, Sk, 2, Hkv, D) repeated over the query groups (einops
    '... hkv d -> ... (hkv g) d'), a causal mask aligned bottom-right per sequence from the key padding mask
    (col > row + sk - seqlen_q, sk = key_padding_mask.sum(-1)), filled with -10000."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal, self.softmax_scale = causal, softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        batch_size, seqlen_q = q.shape[0], q.shape[1]
        causal = self.causal if causal is None else causal
        seqlen_k = kv.shape[1]
        if kv.shape[3] != q.shape[2]:  # MQA/GQA
            g = q.shape[2] // kv.shape[3]
            b, s, two, hkv, d = kv.shape
            kv = kv[..., None, :].expand(b, s, two, hkv, g, d).reshape(b, s, two, hkv * g, d)
        k, v = kv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if key_padding_mask is not None:
            scores = _add_key_padding_bias(scores, key_padding_mask)
        if causal:
            row_idx = torch.arange(seqlen_q, device=q.device, dtype=torch.long).reshape(seqlen_q, 1)
            col_idx = torch.arange(seqlen_k, device=kv.device, dtype=torch.long)
            sk = (seqlen_k if key_padding_mask is None
                  else key_padding_mask.sum(-1).reshape(batch_size, 1, 1, 1))  # "b -> b 1 1 1"
            causal_mask = col_idx > row_idx + sk - seqlen_q
            scores = scores.masked_fill(causal_mask, -10000.0)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        attention_drop = self.drop(attention)
        return torch.einsum("bhts,bshd->bthd", attention_drop, v)


class FlashAttnMHA(nn.Module):
    """flash_attn.modules.mha.MHA without the fused kernels (use_flash_attn=False): Wqkv, then either the
    '... (three h d) -> ... three h d' rearrange into SelfAttention or, with fewer k / v heads (GQA), q and kv
    sliced from Wqkv's output into CrossAttention; the key padding mask passed through; out_proj."""

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, causal=True, dropout=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.Wqkv = nn.Linear(embed_dim, qkv_dim)
        self.inner_attn = FlashAttnSelfAttention(causal=causal, attention_dropout=dropout)
        self.inner_cross_attn = FlashAttnCrossAttention(causal=causal, attention_dropout=dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, key_padding_mask=None):
        kwargs = {"key_padding_mask": key_padding_mask}
        qkv = self.Wqkv(x)
        if self.num_heads_kv == self.num_heads:
            qkv = qkv.reshape(*qkv.shape[:-1], 3, self.num_heads, self.head_dim)
            context = self.inner_attn(qkv, **kwargs)
        else:
            q = qkv[..., : self.num_heads * self.head_dim]
            kv = qkv[..., self.num_heads * self.head_dim:]
            q = q.reshape(*q.shape[:-1], self.num_heads, self.head_dim)  # "... (h d) -> ... h d"
            kv = kv.reshape(*kv.shape[:-1], 2, self.num_heads_kv, self.head_dim)  # "... (two hkv d) -> ..."
            context = self.inner_cross_attn(q, kv, **kwargs)
        return self.out_proj(context.reshape(*context.shape[:-2], -1))  # "... h d -> ... (h d)"


class FlashAttnMlp(nn.Module):
    """flash_attn.modules.mlp.Mlp (GPT-2's activation: partial(F.gelu, approximate='tanh'))."""

    def __init__(self, in_features, hidden_features=None, activation=F.gelu, return_residual=False):
        super().__init__()
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.return_residual = return_residual
        self.fc1, self.activation = nn.Linear(in_features, hidden_features), activation
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        y = self.fc1(x)
        y = self.activation(y)
        y = self.fc2(y)
        return y if not self.return_residual else (y, x)


class FlashAttnBlock(nn.Module):
    """flash_attn.modules.block.Block, prenorm without the fused dropout-add-LN: the block takes and returns
    (hidden_states, residual); dropout + residual add, the norm of residual.to(norm1.weight.dtype), the
    residual kept in fp32 when residual_in_fp32."""

    def __init__(self, dim, num_heads, resid_dropout=0.0, residual_in_fp32=False):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.mixer = FlashAttnMHA(dim, num_heads)
        self.dropout1, self.norm1 = nn.Dropout(resid_dropout), nn.LayerNorm(dim)
        self.mlp = FlashAttnMlp(dim, 4 * dim + 3, activation=partial(F.gelu, approximate="tanh"))
        self.dropout2, self.norm2 = nn.Dropout(resid_dropout), nn.LayerNorm(dim)

    def forward(self, hidden_states, residual=None, key_padding_mask=None):
        dropped = self.dropout1(hidden_states)
        residual = (dropped + residual) if residual is not None else dropped
        hidden_states = self.norm1(residual.to(dtype=self.norm1.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        hidden_states = self.mixer(hidden_states, key_padding_mask=key_padding_mask)
        dropped = self.dropout2(hidden_states)
        residual = (dropped + residual) if residual is not None else dropped
        hidden_states = self.norm2(residual.to(dtype=self.norm2.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class FlashAttnGPT(nn.Module):
    """flash_attn.models.gpt.GPTLMHeadModel (prenorm, word + position embeddings, the embeddings' dropout
    folded into the first block's, drop_f + ln_f on the last residual, a tied head) with the loss over the
    shifted labels."""

    def __init__(self, vocab=37, dim=24, num_heads=3, max_len=16, resid_dropout=0.0, residual_in_fp32=False):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList([FlashAttnBlock(dim, num_heads, resid_dropout, residual_in_fp32)
                                     for _ in range(2)])
        self.drop_f, self.ln_f = nn.Dropout(resid_dropout), nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.word_embeddings.weight
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, input_ids, labels):
        position_ids = torch.arange(input_ids.shape[1], dtype=torch.long)
        hidden_states = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual)
        dropped = self.drop_f(hidden_states)
        residual = (dropped + residual) if residual is not None else dropped
        hidden_states = self.ln_f(residual.to(dtype=self.ln_f.weight.dtype))
        lm_logits = self.lm_head(hidden_states)
        shift_logits = lm_logits[:, :-1].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), labels[:, 1:].reshape(-1))
        return lm_logits, loss


# ========================================================================================================
# Megatron-core (megatron/core/transformer/dot_product_attention.py, fused_softmax.py)
# ========================================================================================================


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class MegatronDotProductAttention(nn.Module):
    """Megatron-core's DotProductAttention (unfused) after SelfAttention's linear_qkv and split: inputs
    [sq, b, heads, hn], k / v per query group repeated with repeat_interleave on dim 2, baddbmm into a
    buffer with beta=0 and alpha=1/norm_factor, FusedScaleMaskSoftmax's torch path (the softmax in fp32 for
    half inputs, the layer-scaling coefficient re-applied, the -10000 masked_fill_ in place, nn.Softmax),
    bmm with v, permute back to [sq, b, hidden]. apply_query_key_layer_scaling: norm_factor = sqrt(hn) *
    layer_number, the softmax's scale = layer_number."""

    def __init__(self, hidden=32, heads=4, groups=2, layer_number=3, attention_dropout=0.0):
        super().__init__()
        self.heads, self.groups, self.hn = heads, groups, hidden // heads
        self.hidden_size_per_partition = hidden
        coeff = layer_number
        self.norm_factor = math.sqrt(self.hn) * coeff
        self.softmax_scale = coeff
        self.linear_qkv = nn.Linear(hidden, (heads + 2 * groups) * self.hn)
        self.attention_dropout = nn.Dropout(attention_dropout)
        self.linear_proj = nn.Linear(hidden, hidden)

    def _scale_mask_softmax(self, input, mask):
        input_in_fp16, input_in_bf16 = input.dtype == torch.float16, input.dtype == torch.bfloat16
        input_in_float16 = input_in_fp16 or input_in_bf16
        if input_in_float16:  # softmax_in_fp32
            input = input.float()
        if self.softmax_scale is not None:
            input = input * self.softmax_scale
        mask_output = attention_mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        if input_in_float16:
            probs = probs.half() if input_in_fp16 else probs.bfloat16()
        return probs

    def forward(self, hidden_states, attention_mask):
        mixed_qkv = self.linear_qkv(hidden_states)
        # [sq, b, hp] --> [sq, b, ng, (np/ng + 2) * hn]
        new_tensor_shape = mixed_qkv.size()[:-1] + (self.groups, (self.heads // self.groups + 2) * self.hn)
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)
        split_arg_list = [self.heads // self.groups * self.hn, self.hn, self.hn]
        query, key, value = torch.split(mixed_qkv, split_arg_list, dim=3)
        # [sq, b, ng, np/ng * hn] -> [sq, b, np, hn]
        query = query.reshape(query.size(0), query.size(1), -1, self.hn)
        key = key.repeat_interleave(self.heads // self.groups, dim=2)
        value = value.repeat_interleave(self.heads // self.groups, dim=2)

        # [b, np, sq, sk]
        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))
        # [sq, b, np, hn] -> [sq, b * np, hn]
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key = key.view(output_size[3], output_size[0] * output_size[1], -1)
        # preallocting input tensor: [b * np, sq, sk] (get_global_memory_buffer().get_tensor)
        matmul_input_buffer = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3],
                                          dtype=query.dtype, device=query.device)
        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.baddbmm(matmul_input_buffer, query.transpose(0, 1),
                                      key.transpose(0, 1).transpose(1, 2), beta=0.0,
                                      alpha=(1.0 / self.norm_factor))
        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)
        attention_probs = self._scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = self.attention_dropout(attention_probs)

        # [sk, b, np, hn] --> [b, np, sq, hn]
        output_size = (value.size(1), value.size(2), query.size(0), value.size(3))
        # change view [sk, b * np, hn]
        value = value.view(value.size(0), output_size[0] * output_size[1], -1)
        # change view [b * np, sq, sk]
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        # matmul: [b * np, sq, hn]
        context = torch.bmm(attention_probs, value.transpose(0, 1))
        # change view [b, np, sq, hn]
        context = context.view(*output_size)
        # [b, np, sq, hn] --> [sq, b, np, hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_shape = context.size()[:-2] + (self.hidden_size_per_partition,)
        context = context.view(*new_context_shape)
        return self.linear_proj(context)


def _ltor_mask(s):
    """Megatron's get_ltor_masks_and_position_ids: (1, 1, s, s), True where masked."""
    attention_mask = torch.tril(torch.ones((1, s, s))).view(1, 1, s, s)
    return attention_mask < 0.5




# ========================================================================================================
# MAE (norm_pix_loss), ConvNeXt-V2 (GRN): normalisations that are not a LayerNorm
# ========================================================================================================


class MAELoss(nn.Module):
    """MAE's forward_loss with norm_pix_loss: the target patches standardised with the unbiased variance
    (target.var's default), (var + 1e-6) ** .5: not a LayerNorm; the loss on the masked patches. The decoder
    is its last norm and the prediction head here."""

    def __init__(self, dim=24, patch_dim=27):
        super().__init__()
        self.decoder_norm, self.decoder_pred = nn.LayerNorm(dim), nn.Linear(dim, patch_dim)
        self.norm_pix_loss = True

    def forward(self, x, target, mask):
        pred = self.decoder_pred(self.decoder_norm(x))
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = (pred - target) ** 2
        loss = loss.mean(dim=-1)  # [N, L], mean loss per patch
        return (loss * mask).sum() / mask.sum()  # mean loss on removed patches


class GRN(nn.Module):
    """ConvNeXt-V2's Global Response Normalization: the 2-norm over the spatial dims, divided by its mean
    over the channels (not an RMSNorm: the norm is over other dims than the division's)."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(0.5 * torch.randn(1, 1, 1, dim))
        self.beta = nn.Parameter(0.5 * torch.randn(1, 1, 1, dim))

    def forward(self, x):
        Gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        Nx = Gx / (Gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * Nx) + self.beta + x


class ConvNeXtV2LayerNorm(nn.Module):
    """ConvNeXt-V2's LayerNorm: F.layer_norm channels last, written out over dim 1 channels first."""

    def __init__(self, normalized_shape, eps=1e-6, data_format="channels_last"):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(normalized_shape))
        self.bias = nn.Parameter(0.1 * torch.randn(normalized_shape))
        self.eps, self.data_format, self.normalized_shape = eps, data_format, (normalized_shape,)

    def forward(self, x):
        if self.data_format == "channels_last":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtV2Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = ConvNeXtV2LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.grn = GRN(4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        input = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
        x = self.norm(x)
        x = self.pwconv1(x)
        x = self.act(x)
        x = self.grn(x)
        x = self.pwconv2(x)
        x = x.permute(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
        return input + x


class ConvNeXtV2(nn.Module):
    """ConvNeXt-V2: the stem (conv + channels-first LayerNorm), a block, a downsampling layer (channels-first
    LayerNorm + conv), a block, the pooled channels-last LayerNorm and head."""

    def __init__(self, dims=(16, 24), num_classes=7):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4),
                                  ConvNeXtV2LayerNorm(dims[0], eps=1e-6, data_format="channels_first"))
        self.stage1 = ConvNeXtV2Block(dims[0])
        self.downsample = nn.Sequential(ConvNeXtV2LayerNorm(dims[0], eps=1e-6, data_format="channels_first"),
                                        nn.Conv2d(dims[0], dims[1], kernel_size=2, stride=2))
        self.stage2 = ConvNeXtV2Block(dims[1])
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        x = self.stage2(self.downsample(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean([-2, -1])))  # global average pooling, (N, C, H, W) -> (N, C)



# ========================================================================================================
# The blocks, compiled against eager
# ========================================================================================================


class KeywordCall(nn.Module):
    """module(*args, **{name: tensor}) with the named tensors taken as trailing positional inputs (graph
    inputs, not constants): for a module whose mask is a keyword after one left at its default."""

    def __init__(self, module, *names):
        super().__init__()
        self.module, self.names = module, names

    def forward(self, *args):
        n = len(args) - len(self.names)
        return self.module(*args[:n], **dict(zip(self.names, args[n:], strict=True)))


def _keep(b, n, pad=3):
    """(b, n) key keep-mask, the last sequence padded by `pad` at the end."""
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[-1, n - pad:] = False
    return keep


def _labels(*shape, classes=5):
    return torch.randint(0, classes, shape)


def _msa_mask(*shape):
    mask = torch.rand(*shape) > 0.3
    mask[..., 0, :] = True  # every column keeps a sequence, every row a residue: no fully masked rows
    mask[..., :, 0] = True
    return mask


def _ids():
    return torch.randint(0, 37, (2, 11))


LEFT_ALONE_5D = ("attention", "operands are 5-d")  # tests/findings/zoo_review_s31.md F4 (Hiera)
CHANNELS_FIRST = ("norm", "reduces over dim 1 of a 4-d tensor")  # by design (session 25)
ROWS_PERMUTED_ADD = "residual add (rows permuted) + F.layer_norm (pre-norm, returns the residual)"
R = torch.randn


def _case(make, rewrites, near_misses=(), words=()):
    return make, rewrites, near_misses, words


# name: (model and inputs, rewrites per family (the others 0), near misses (family, words of the reason),
# words the report must hold). Every count was checked by reading the module.
CASES = {
    # per layer: MultiheadAttention(need_weights=False); ln_1 (the first on the dropout of x + pos, then the
    # previous block's residual sum) and ln_2 fused with the sum; the MLP's Linear + GELU; ln; head + loss
    "torchvision_vit": _case(
        lambda: (TVVisionTransformer(), (R(2, 3, 9, 9), _labels(2, classes=7))),
        dict(attention=2, norm=5, dense=2, cross_entropy=1),
        words=["nn.MultiheadAttention (F.multi_head_attention_forward) -> flash_attention"]),
    # 3 window attentions: the relative position bias (1, H, N, N), with the shifted block's -100 mask per
    # window (B·nW, H, N, N); the third block's shift is dropped. Norms: stem, 2 per block, merging, final
    "torchvision_swin_t": _case(lambda: (TVSwinT(), (R(2, 3, 10, 10),)), dict(attention=3, norm=9, dense=3),
                                words=["mask [8, 2, 9, 9]"]),
    # cosine attention: the per-head logit scale (H, 1, 1) goes on q; res-post-norm blocks (norm, then add)
    "torchvision_swin_v2_t": _case(lambda: (TVSwinT(v2=True), (R(2, 3, 10, 10),)),
                                   dict(attention=3, norm=9, dense=3), words=["logit_scale (on q)"]),
    # LayerNorm2d x 3 (stem, downsampling, classifier) + the blocks' channels-last LayerNorm x 2
    "torchvision_convnext": _case(lambda: (TVConvNeXt(), (R(2, 3, 20, 20),)), dict(norm=5, dense=2)),
    # windowed (4 windows of 3 x 3 per image) and global (5 x 5) attention, the decomposed relative
    # positions added to the scores split (B·heads, q_h, q_w, k_h, k_w) as the op's mask (finding M1,
    # fixed); the neck's channels-first LayerNorm2d: reported, by design
    "sam_image_encoder": _case(
        lambda: (SAMImageEncoder(), (R(2, 3, 20, 20),)), dict(attention=2, norm=4, dense=2),
        (CHANNELS_FIRST, CHANNELS_FIRST),
        ["mask [24, 9, 9], 2 bias terms added to the scores split as [24, 3, 3, 3, 3]",
         "mask [6, 25, 25], 2 bias terms added to the scores split as [6, 5, 5, 5, 5]"]),
    # 3 attentions per layer (the cross ones downsampled to head_dim 8) + the final one; 4 add + norm per
    # layer + the final one; ReLU MLPs
    "sam_two_way_transformer": _case(
        lambda: (SAMTwoWayTransformer(), (R(2, 48, 3, 5), R(2, 48, 3, 5), R(2, 5, 48))),
        dict(attention=7, norm=9)),
    # SDPA; parameter-free LayerNorms (2 per block + the final one) with the gated residual sums
    "dit": _case(lambda: (DiT(), (R(2, 4, 15, 15), torch.tensor([3.0, 500.0]), torch.tensor([1, 4]))),
                 dict(attention=2, norm=5, dense=2), words=["F.gelu(tanh)"]),
    # self- and cross-attention (3-d, heads in the batch); GEGLU is no Linear + GELU (finding M3)
    "ldm_spatial_transformer": _case(lambda: (LdmSpatialTransformer(), (R(2, 16, 3, 5), R(2, 7, 12))),
                                     dict(attention=2, norm=3), words=["softmax(einsum+einsum)"]),
    "ldm_spatial_transformer_gelu_ff": _case(
        lambda: (LdmSpatialTransformer(gated_ff=False), (R(2, 16, 3, 5), R(2, 7, 12))),
        dict(attention=2, norm=3, dense=1)),
    "ldm_cross_attention_key_mask": _case(
        lambda: (LdmCrossAttention(16, 12, 2, 8), (R(2, 9, 16), R(2, 7, 12), _keep(2, 7))), dict(attention=1),
        words=["mask [4, 1, 7], fill -3.4e+38 taken as -inf"]),
    "diffusers_encoder_attention_mask": _case(
        lambda: (DiffusersMaskedCrossAttention(), (R(2, 9, 32), R(2, 5, 24), _keep(2, 5, pad=2).long())),
        dict(attention=1), words=["softmax(baddbmm) -> flash_attention(scale=0.3536, mask [8, 1, 5])"]),
    # unbatched (as AlphaFold runs): 4-d scores; row attention with the -1e9 mask bias and the pair bias
    # (its gradient reaches z), column attention; the column attention's LayerNorm of the transposed sum
    # m + row takes the add (finding M2, fixed)
    "openfold_evoformer_msa": _case(
        lambda: (OpenFoldEvoformerMSA(), (R(3, 7, 16), R(7, 7, 12), _msa_mask(3, 7))),
        dict(attention=2, norm=4), words=["mask [3, 2, 7, 7]", ROWS_PERMUTED_ADD]),
    "openfold_evoformer_msa_batched": _case(
        lambda: (OpenFoldEvoformerMSA(), (R(2, 3, 7, 16), R(2, 7, 7, 12), _msa_mask(2, 3, 7))),
        dict(norm=4), (LEFT_ALONE_5D, LEFT_ALONE_5D), [ROWS_PERMUTED_ADD]),
    # per block: norm1, the sub-LN before proj, norm2 with the sum, the SwiGLU's sub-LN; the final norm
    "eva02": _case(lambda: (Eva02(), (R(2, 8, 24), _labels(2))), dict(attention=2, norm=9, cross_entropy=1)),
    "eva02_manual_key_mask": _case(
        lambda: (Eva02(fused_attn=False), (R(2, 8, 24), _labels(2), _keep(2, 9))),
        dict(attention=2, norm=9, cross_entropy=1), words=["mask [2, 1, 1, 9], -inf fill"]),
    # latents (5) attend to the inputs (11, key mask), then to themselves; PreNorm on latents and context
    "perceiver": _case(lambda: (Perceiver(), (R(2, 11, 12), _labels(2), _keep(2, 11))),
                       dict(attention=2, norm=6, cross_entropy=1), words=["scale=0.25, mask [2, 1, 11]"]),
    # the additive causal triu(-10000) folds into causal, as a -10000 fill does (finding M4, fixed)
    "flash_attn_gpt": _case(lambda: (FlashAttnGPT(), (_ids(), _ids())),
                            dict(attention=2, norm=5, dense=2, cross_entropy=1),
                            words=["causal, additive -1e+04 taken as -inf)"]),
    "flash_attn_gpt_residual_in_fp32": _case(lambda: (FlashAttnGPT(residual_in_fp32=True), (_ids(), _ids())),
                                             dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    "flash_attn_mha_key_padding": _case(lambda: (FlashAttnMHA(24, 3), (R(2, 9, 24), _keep(2, 9))),
                                        dict(attention=1), words=["mask [2, 1, 9, 9]"]),
    # GQA through CrossAttention: kv repeated over the groups, causal from col > row + Sk - Sq
    "flash_attn_mha_gqa_causal": _case(lambda: (FlashAttnMHA(32, 4, 2), (R(2, 9, 32),)), dict(attention=1),
                                       words=["causal"]),
    # 5 queries over 9 keys (the last sequence 6 long): bottom-right per sequence, no row fully masked
    "flash_attn_cross_attention_gqa_padding": _case(
        lambda: (KeywordCall(FlashAttnCrossAttention(causal=True), "key_padding_mask"),
                 (R(2, 5, 4, 8), R(2, 9, 2, 2, 8), _keep(2, 9))),
        dict(attention=1)),
    "flash_attn_mlp_return_residual": _case(
        lambda: (FlashAttnMlp(24, 40, partial(F.gelu, approximate="tanh"), return_residual=True),
                 (R(2, 5, 24),)),
        dict(dense=1)),
    # [sq, b, np, hn], baddbmm(empty, beta=0), alpha = 1/(sqrt(hn)·3) then * 3, the in-place -10000 fill of
    # get_ltor_masks' (1, 1, s, s) mask (a graph input)
    "megatron_core_dot_product_attention": _case(
        lambda: (MegatronDotProductAttention(), (R(9, 2, 32), _ltor_mask(9))), dict(attention=1),
        words=["softmax(baddbmm) -> flash_attention(scale=0.3536, mask [1, 1, 9, 9], fill -1e+04 taken as"]),
    # the target standardised with the unbiased variance: not a LayerNorm, reported
    "mae_norm_pix_loss": _case(
        lambda: (MAELoss(), (R(2, 7, 24), R(2, 7, 27), (torch.rand(2, 7) > 0.4).float())), dict(norm=1),
        (("norm", "the variance is unbiased"),)),
    # GRN is no norm the pass knows (and no candidate); the channels-first LayerNorms: reported
    "convnext_v2_grn": _case(lambda: (ConvNeXtV2(), (R(2, 3, 20, 20),)), dict(norm=3, dense=2),
                             (CHANNELS_FIRST, CHANNELS_FIRST)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_codebase_block(name):
    make, rewrites, near_misses, words = CASES[name]
    model, args = make()
    report = _check_block(model, args, rewrites, near_misses)
    for w in words:
        assert w in str(report), str(report)


# ========================================================================================================
# Norm: a residual add folded through a view that moves rows whole (fixed in session 31, see M2)
# ========================================================================================================


def _column_attention_norm(m, a, b):
    # OpenFold's column attention: the residual sum, transposed, normalised; the sum read on as the residual
    h = a + b
    return F.layer_norm(h.transpose(-2, -3), (H,), m.weight, m.bias), h


def _permuted_dropout_add(m, x, r):
    h = r + F.dropout(x, 0.0, m.training)
    return F.layer_norm(h.permute(1, 0, 2), (H,), m.weight, m.bias, 1e-6)


def _swapaxes_contiguous_rms(m, a, b):
    h = torch.swapaxes(a + b, 0, 1).contiguous()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * m.weight


def _transpose_by_keyword(m, a, b):
    return F.layer_norm(torch.transpose(input=a + b, dim0=0, dim1=1), (H,), m.weight, m.bias)


def _two_views(m, a, b):
    # (B, S, R, C): two views, composed into one permutation of the rows
    h = a + b
    return F.layer_norm(h.transpose(1, 2).permute(2, 0, 1, 3), (H,), m.weight, m.bias), h


def _upcast_after_the_view(m, a, b):
    h = a + b
    y = F.layer_norm(h.transpose(0, 1).float(), (H,), m.weight.float(), m.bias.float())
    return y.to(a.dtype), h


def _layer_norm_then_view(m, a, b):
    # F.layer_norm returns a contiguous tensor whatever its input's layout: a .view after it works in eager,
    # so the op's output, permuted back, is made contiguous too (it failed before)
    h = a + b
    return F.layer_norm(h.transpose(0, 1), (H,), m.weight, m.bias).view(-1, H), h


def _x4():
    return torch.randn(3, 5, 7, H)


ROWS_PERMUTED = {
    "openfold_column_transpose": (_column_attention_norm, lambda: (_x4(), _x4())),
    "permute_of_dropout_add": (_permuted_dropout_add, lambda: (torch.randn(5, 7, H), torch.randn(5, 7, H))),
    "swapaxes_contiguous_rmsnorm": (_swapaxes_contiguous_rms, lambda: (torch.randn(5, 7, H),
                                                                       torch.randn(5, 7, H))),
    "torch_transpose_by_keyword": (_transpose_by_keyword, lambda: (torch.randn(5, 7, H),
                                                                   torch.randn(5, 7, H))),
    "two_views_composed": (_two_views, lambda: (torch.randn(2, 3, 5, H), torch.randn(2, 3, 5, H))),
    "layer_norm_then_view": (_layer_norm_then_view, lambda: (torch.randn(5, 7, H), torch.randn(5, 7, H))),
}


@pytest.mark.parametrize("name", list(ROWS_PERMUTED))
def test_residual_add_folded_through_a_row_permutation(name):
    fn, make = ROWS_PERMUTED[name]
    report = _check_block(Fn(fn), make(), dict(norm=1))
    assert "residual add (rows permuted)" in report.rewrites[0].variant, str(report)


@pytest.mark.parametrize("name", ["openfold_column_transpose", "swapaxes_contiguous_rmsnorm",
                                  "layer_norm_then_view"])
def test_row_permuted_output_has_eager_layout(name):
    """F.layer_norm's output is contiguous whatever its input's layout, a norm written out keeps its input's
    strides: the op's output, permuted back, has eager's strides either way."""
    fn, make = ROWS_PERMUTED[name]
    model, args = Fn(fn), make()
    torch._dynamo.reset()
    got = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(*args)
    want = model(*args)
    got, want = (r if isinstance(r, tuple) else (r,) for r in (got, want))
    assert [g.stride() for g in got] == [w.stride() for w in want]


def test_residual_add_folded_through_a_row_permutation_bf16():
    a, b = (torch.randn(5, 7, H, dtype=torch.bfloat16) for _ in range(2))
    report = _check_block(Fn(_upcast_after_the_view).to(torch.bfloat16), (a, b), dict(norm=1),
                          tol=dict(atol=3e-2, rtol=3e-2))  # bf16: a ulp at 4..8
    assert "residual add (rows permuted)" in report.rewrites[0].variant, str(report)


def test_dropout_folded_through_a_row_permutation_draws_one_mask():
    """p > 0 in training: the normalised output is the norm of the permuted residual output (one mask for
    both), and the dropped fraction is about p."""
    p = 0.25

    def fn(m, x, r):
        h = r + F.dropout(x, p, m.training)
        return F.layer_norm(h.transpose(0, 1), (H,), m.weight, m.bias), h

    model, x, r = Fn(fn), torch.randn(9, 7, H), torch.randn(9, 7, H)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        out, h = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x, r)
    assert "dropout + residual add (rows permuted)" in report.rewrites[0].variant, str(report)
    torch.testing.assert_close(out, F.layer_norm(h.transpose(0, 1), (H,), model.weight, model.bias), **TOL)
    dropped = (h - r) == 0
    assert abs(dropped.float().mean().item() - p) < 0.03
    torch.testing.assert_close((h - r)[~dropped], (x / (1 - p))[~dropped])


def _last_dim_moved(m, a, b):
    # the transpose moves the normalised dim: the sum's rows are not the norm's
    return F.layer_norm((a + b).transpose(-1, -2), (H,), m.weight, m.bias)


def _view_read_elsewhere(m, a, b):
    t = (a + b).transpose(0, 1)
    return F.layer_norm(t, (H,), m.weight, m.bias), t * 2


@pytest.mark.parametrize("fn, shape", [(_last_dim_moved, (3, H, H)), (_view_read_elsewhere, (5, 7, H))],
                         ids=["last_dim_moved", "view_read_elsewhere"])
def test_norm_of_a_view_that_cannot_fold_the_sum_stays_plain(fn, shape):
    report = _check_block(Fn(fn), (torch.randn(*shape), torch.randn(*shape)), dict(norm=1))
    assert report.rewrites[0].variant == "F.layer_norm", str(report)


# ========================================================================================================
# Findings pinned, dropout, bf16
# ========================================================================================================


def test_sam_decomposed_rel_pos_attention_is_rewritten():
    """tests/findings/codebase_review_s31.md M1 (fixed): the bias added to the scores viewed (B, q_h, q_w,
    k_h, k_w) is the op's mask; the gradients of the qkv projection and of rel_pos_h / rel_pos_w are eager's.
    More forms and the refusals: tests/test_attention_pass_s32.py."""
    report = _check_block(SAMAttention(24, 3, (3, 5)), (R(2, 3, 5, 24),), dict(attention=1))
    assert "mask [6, 15, 15], 2 bias terms added to the scores split as [6, 3, 5, 3, 5]" in str(report)


def _rows_with_no_key(keep, seqlen_q):
    """flash-attn's CrossAttention causal mask with a key padding mask: query i sees keys j <= i + sk - Sq,
    sk the sequence's length; rows where that is below 0 see no key."""
    sk = keep.sum(-1, keepdim=True)
    return torch.arange(seqlen_q)[None, :] + sk - seqlen_q < 0  # (B, Sq)


def test_flash_attn_gqa_self_attention_with_key_padding_matches_eager():
    """tests/findings/codebase_review_s31.md W1 (fixed): flash-attn's GQA MHA (CrossAttention) with a key
    padding mask and causal: the first Sq - sk query rows of a padded sequence see no key, where eager's
    -10000 fill averages v; the op gives them the mean of v (fully_masked_rows="mean"), gradients too."""
    report = _check_block(FlashAttnMHA(32, 4, 2), (R(2, 9, 32), _keep(2, 9)), dict(attention=1))
    assert "a row with every key masked given the mean of v as in eager" in str(report), str(report)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_flash_attn_gqa_self_attention_with_key_padding_rows_with_no_key(training):
    """W1's rows that see no key are eager's mean of v (they were 0); every other row is eager's too."""
    model, x, keep = FlashAttnMHA(32, 4, 2).train(training), R(2, 9, 32), _keep(2, 9)
    no_key = _rows_with_no_key(keep, 9)
    assert no_key.sum() == 3  # the last sequence, 6 long: its first 3 rows
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        got = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)(x, keep)
    want = model(x, keep)
    torch.testing.assert_close(got[no_key], want[no_key], **TOL)
    torch.testing.assert_close(got[~no_key], want[~no_key], **TOL)
    assert "fill -1e+04 taken as -inf, a row with every key masked given the mean of v" in str(report), \
        str(report)


def test_flash_attn_block_residual_dropout_draws_one_mask_forward_and_backward():
    """flash-attn's prenorm Block with resid_dropout 0.25 in training: both dropout + add + LayerNorm are
    fused (the masks are the op's, not eager's draws). hidden_states reaches the loss only through dropout1
    and the sum with residual, so its gradient is residual's times the mask / (1 - p): zero where dropped
    (about p of it), residual's / (1 - p) elsewhere."""
    p = 0.25
    block = FlashAttnBlock(24, 3, resid_dropout=p).train()
    h, r = R(4, 9, 24, requires_grad=True), R(4, 9, 24, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        out, residual = torch.compile(block, backend=rewrite_only_backend, fullgraph=True)(h, r)
    assert [d.variant for d in report.rewrites if d.family == "norm"] == [
        "dropout + residual add + F.layer_norm (pre-norm, returns the residual)"] * 2, str(report)
    ((out * R(*out.shape)).sum() + (residual * R(*residual.shape)).sum()).backward()
    dropped = h.grad == 0
    assert abs(dropped.float().mean().item() - p) < 0.06
    assert (r.grad != 0).all()
    torch.testing.assert_close(h.grad[~dropped], r.grad[~dropped] / (1 - p))
    # in eval the dropouts are off: eager's results
    _, flash = _compile_and_compare(block, (h.detach(), r.detach()), False, TOL)
    assert flash["norm"] == 2


def _errors_within_twice_eagers(model, args, rewrites):
    """model in bf16 through the passes: each result's error against the fp32 model at most twice eager
    bf16's, plus 2% of the result's scale (DESIGN.md's rule), in training and in eval."""
    model32 = copy.deepcopy(model)
    model.to(torch.bfloat16)
    args16 = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in args]
    for train in (True, False):
        model.train(train)
        model32.train(train)
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), args16, train)
        want, ref = _run(model, args16, train), _run(model32, args, train)
        for g, w, f in zip(got, want, ref, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, str(report)
            err, eager_err = (g.float() - f).abs().max(), (w.float() - f).abs().max()
            assert err <= 2 * eager_err + 2e-2 * f.abs().max(), (err, eager_err, str(report))
        assert {k: v for k, v in counters["flash"].items() if k in FAMILIES} == rewrites, str(report)


@pytest.mark.parametrize("name", ["flash_attn_gpt_residual_in_fp32", "megatron_core_dot_product_attention"])
def test_codebase_block_bf16(name):
    make, rewrites, _, _ = CASES[name]
    _errors_within_twice_eagers(*make(), rewrites)
