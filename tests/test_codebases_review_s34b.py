"""Review (session 34, second batch) of the norm, dense and cross-entropy passes on code bases no earlier
review wrote, each written tiny and as its authors write it: timm's MLP-Mixer (the token-mixing MLP, Linear +
GELU over the token dim of the transposed tensor) and ResMLP (Affine, ``torch.addcmul(beta, alpha, x)``, in
place of every norm), ConvMixer (GELU after a conv, BatchNorm), EleutherAI's gpt-neox (sequence-first Megatron
layers with the GPT-J parallel residual and two LayerNorms, skip_bias_add Linears, bias_dropout_add, the
vocab-parallel cross-entropy as Megatron's autograd.Function and the loss mask), MosaicML llm-foundry's MPT
(LPLayerNorm under an autocast-disabled region, ALiBi, the targets by ``torch.roll``), AI2's OLMo
(non-parametric LayerNorm, ``qkv.clamp_``, tied logits, the loss summed and divided by the tokens, the z-loss
from ``logits.logsumexp(-1)``), transformers' mT5 (gated-gelu ``wi_0`` / ``wi_1``, T5LayerNorm), and the
loss code of MoCo v2 / v3, google-research SimCLR, timm (LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
with mixup), fairseq (label_smoothed_nll_loss, CrossEntropyCriterion) and Hinton knowledge distillation
(RepDistiller's DistillKL).

Each block is compiled with the rewrite-only backend (fullgraph; the rewritten graph runs as plain PyTorch,
the flash ops on their CPU reference) and compared with eager: in training the outputs and the gradients of
every input and parameter, in eval the outputs, fp32 at 5e-5. The rewrites per family are asserted exactly,
and so are the near misses with their reasons (tests/test_codebases_review_s31.py's harness).

Findings: tests/findings/codebase_review_s34b.md.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_codebases_review_s31 import TOL, _case, _check_block, _compile_and_compare, _labels
from test_codebases_review_s32 import _dynamic_check

R = torch.randn


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# ========================================================================================================
# timm: MLP-Mixer and ResMLP (timm/models/mlp_mixer.py, timm/layers/mlp.py)
# ========================================================================================================


class Mlp(nn.Module):
    """timm.layers.Mlp: fc1, act, drop1, norm (Identity), fc2, drop2."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class PatchEmbed(nn.Module):
    """timm.layers.PatchEmbed (flatten, NCHW -> NLC)."""

    def __init__(self, patch_size=3, in_chans=3, embed_dim=16):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)
        return x.flatten(2).transpose(1, 2)


class MixerBlock(nn.Module):
    """timm's MixerBlock: the token-mixing Mlp runs over the tokens, ``norm1(x).transpose(1, 2)``."""

    def __init__(self, dim, seq_len, mlp_ratio=(0.5, 4.0), norm_layer=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        tokens_dim, channels_dim = [int(x * dim) for x in mlp_ratio]
        self.norm1 = norm_layer(dim)
        self.mlp_tokens = Mlp(seq_len, tokens_dim, act_layer=act_layer, drop=drop)
        self.drop_path = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp_channels = Mlp(dim, channels_dim, act_layer=act_layer, drop=drop)

    def forward(self, x):
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        x = x + self.drop_path(self.mlp_channels(self.norm2(x)))
        return x


class Affine(nn.Module):
    """timm's ResMLP Affine: ``torch.addcmul(self.beta, self.alpha, x)``, no statistics (no norm)."""

    def __init__(self, dim):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones((1, 1, dim)) + 0.1 * torch.randn(1, 1, dim))
        self.beta = nn.Parameter(0.1 * torch.randn(1, 1, dim))

    def forward(self, x):
        return torch.addcmul(self.beta, self.alpha, x)


class ResBlock(nn.Module):
    """timm's ResMLP ResBlock: Affine norms, a token Linear on the transposed tensor, LayerScale ls1 / ls2."""

    def __init__(self, dim, seq_len, mlp_ratio=4, norm_layer=Affine, act_layer=nn.GELU, init_values=0.1):
        super().__init__()
        channel_dim = int(dim * mlp_ratio)
        self.norm1 = norm_layer(dim)
        self.linear_tokens = nn.Linear(seq_len, seq_len)
        self.drop_path = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp_channels = Mlp(dim, channel_dim, act_layer=act_layer)
        self.ls1 = nn.Parameter(init_values * torch.ones(dim))
        self.ls2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        x = x + self.drop_path(self.ls1 * self.linear_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        x = x + self.drop_path(self.ls2 * self.mlp_channels(self.norm2(x)))
        return x


class MlpMixer(nn.Module):
    """timm's MlpMixer (stem, blocks, norm, global average pooling over the tokens, head) with the loss;
    block_layer=ResBlock and norm_layer=Affine make it ResMLP (timm's resmlp_* configs)."""

    def __init__(self, num_classes=7, img_size=9, patch_size=3, embed_dim=16, num_blocks=2,
                 block_layer=MixerBlock, norm_layer=None):
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        self.stem = PatchEmbed(patch_size, 3, embed_dim)
        seq_len = (img_size // patch_size) ** 2
        self.blocks = nn.Sequential(*[block_layer(embed_dim, seq_len) for _ in range(num_blocks)])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x, target):
        x = self.stem(x)
        x = self.blocks(x)
        x = self.norm(x)
        x = x.mean(dim=1)
        logits = self.head(x)
        return logits, F.cross_entropy(logits, target)


# ========================================================================================================
# ConvMixer ("Patches Are All You Need?", the paper's own listing)
# ========================================================================================================


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


def ConvMixerNet(dim=16, depth=2, kernel_size=3, patch_size=3, n_classes=7):  # noqa: N802 - the paper's name
    return nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size),
        nn.GELU(),
        nn.BatchNorm2d(dim),
        *[nn.Sequential(
            Residual(nn.Sequential(
                nn.Conv2d(dim, dim, kernel_size, groups=dim, padding="same"),
                nn.GELU(),
                nn.BatchNorm2d(dim),
            )),
            nn.Conv2d(dim, dim, kernel_size=1),
            nn.GELU(),
            nn.BatchNorm2d(dim),
        ) for _ in range(depth)],
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(dim, n_classes),
    )


class ConvMixerClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = ConvMixerNet()

    def forward(self, x, target):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, target)


# ========================================================================================================
# EleutherAI/gpt-neox (megatron/model/transformer.py, megatron/mpu/layers.py, megatron/mpu/cross_entropy.py,
# megatron/model/fused_bias_dropout.py, megatron/model/activations.py); tensor parallel size 1
# ========================================================================================================


class NeoXParallelLinear(nn.Module):
    """mpu.ColumnParallelLinear / RowParallelLinear at world size 1: F.linear, and with skip_bias_add the
    bias returned for the caller to add (bias_dropout_add, bias_gelu)."""

    def __init__(self, input_size, output_size, bias=True, skip_bias_add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(output_size, input_size) * input_size**-0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(output_size)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, input_):
        bias = self.bias if not self.skip_bias_add else None
        output = F.linear(input_, self.weight, bias)
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


def bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def bias_gelu_back(g, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


class GeLUFunction(torch.autograd.Function):
    """gpt-neox's (and Megatron's) fused bias GELU (bias_gelu_fusion=True): its own backward."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return bias_gelu(bias, input)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        tmp = bias_gelu_back(grad_output, bias, input)
        return tmp, tmp


def bias_dropout_add(x, bias, residual, prob, training):
    out = torch.nn.functional.dropout(x + bias, p=prob, training=training)
    if residual is not None:
        out = residual + out
    return out


class NeoXParallelMLP(nn.Module):
    def __init__(self, hidden, bias_gelu_fusion):
        super().__init__()
        self.bias_gelu_fusion = bias_gelu_fusion
        self.activation_func = GeLUFunction.apply if bias_gelu_fusion else F.gelu
        self.dense_h_to_4h = NeoXParallelLinear(hidden, 4 * hidden, skip_bias_add=True)
        self.dense_4h_to_h = NeoXParallelLinear(4 * hidden, hidden, skip_bias_add=True)

    def forward(self, hidden_states):
        intermediate_parallel, bias_parallel = self.dense_h_to_4h(hidden_states)
        if self.bias_gelu_fusion:
            intermediate_parallel = self.activation_func(intermediate_parallel, bias_parallel)
        else:
            intermediate_parallel = self.activation_func(intermediate_parallel + bias_parallel)
        output, output_bias = self.dense_4h_to_h(intermediate_parallel)
        return output, output_bias


def gpt2_attention_mask_func(attention_scores, ltor_mask):
    attention_scores.masked_fill_(ltor_mask, -10000.0)
    return attention_scores


class NeoXParallelSelfAttention(nn.Module):
    """Sequence-first [sq, b, h]; the fused qkv viewed [sq, b, np, 3 * hn] and split; baddbmm into
    torch.empty with beta 0 and alpha 1 / norm_factor; FusedScaleMaskSoftmax's torch path (masked_fill_ of
    -10000, nn.Softmax); bmm; permute back; the dense Linear with skip_bias_add."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.np, self.hn, self.hidden = heads, hidden // heads, hidden
        self.norm_factor = math.sqrt(self.hn)
        self.query_key_value = NeoXParallelLinear(hidden, 3 * hidden)
        self.attention_dropout = nn.Dropout(0.0)
        self.dense = NeoXParallelLinear(hidden, hidden, skip_bias_add=True)

    def attention(self, query_layer, key_layer, value_layer, attention_mask):
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.view(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3],
                                    dtype=query_layer.dtype, device=query_layer.device)
        matmul_result = torch.baddbmm(matmul_result, query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2), beta=0.0,
                                      alpha=(1.0 / self.norm_factor))
        attention_scores = matmul_result.view(*output_size)
        mask_output = gpt2_attention_mask_func(attention_scores, attention_mask)
        attention_probs = torch.nn.Softmax(dim=-1)(mask_output)
        attention_probs = self.attention_dropout(attention_probs)
        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        return context_layer.view(*output_size)

    def forward(self, hidden_states, attention_mask):
        mixed_x_layer, _ = self.query_key_value(hidden_states)
        new_tensor_shape = mixed_x_layer.size()[:-1] + (self.np, 3 * self.hn)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, self.hn, dim=-1)
        context_layer = self.attention(query_layer, key_layer, value_layer, attention_mask)
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], self.hidden)
        return self.dense(context_layer)


class NeoXParallelTransformerLayer(nn.Module):
    """gpt_j_residual=True (GPT-NeoX-20B, Pythia): x + attn(ln1(x)) + mlp(ln2(x)), each through
    bias_dropout_add, under torch.enable_grad() as gpt-neox writes it; gpt_j_residual=False: sequential."""

    def __init__(self, hidden, heads, gpt_j_residual, bias_gelu_fusion=False, hidden_dropout=0.0):
        super().__init__()
        self.gpt_j_residual, self.hidden_dropout = gpt_j_residual, hidden_dropout
        self.input_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.attention = NeoXParallelSelfAttention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.mlp = NeoXParallelMLP(hidden, bias_gelu_fusion)

    def _bias_dropout_fn(self, x, bias, residual, prob):
        return bias_dropout_add(x, bias, residual, prob, self.training)

    def forward(self, x, attention_mask):
        bias_dropout_fn = self._bias_dropout_fn
        if self.gpt_j_residual:
            residual = x
            x1, x2 = self.input_layernorm(x), self.post_attention_layernorm(x)
            attention_output, attention_bias = self.attention(x1, attention_mask)
            with torch.enable_grad():
                attention_output = bias_dropout_fn(
                    attention_output, bias=attention_bias.expand_as(attention_output), residual=None,
                    prob=self.hidden_dropout)
            mlp_output, mlp_bias = self.mlp(x2)
            with torch.enable_grad():
                output = bias_dropout_fn(mlp_output, bias=mlp_bias.expand_as(mlp_output),
                                         residual=attention_output, prob=self.hidden_dropout)
            output = residual + output
        else:
            residual = x
            attention_output, attention_bias = self.attention(self.input_layernorm(x), attention_mask)
            with torch.enable_grad():
                attention_output = bias_dropout_fn(attention_output, bias=attention_bias.expand_as(residual),
                                                   residual=residual, prob=self.hidden_dropout)
            layernorm_output = self.post_attention_layernorm(attention_output)
            mlp_output, mlp_bias = self.mlp(layernorm_output)
            with torch.enable_grad():
                output = bias_dropout_fn(mlp_output, bias=mlp_bias.expand_as(attention_output),
                                         residual=attention_output, prob=self.hidden_dropout)
        return output


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """mpu/cross_entropy.py at model-parallel world size 1 (the all_reduces are identities): the logits
    shifted by their max in place, the target's logit picked by advanced indexing, exp written over the
    logits (out=), log of the sum; the softmax kept for the backward, which writes the gradient over it."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        vocab_parallel_logits.sub_(logits_max.unsqueeze(dim=-1))
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        vocab_start_index, vocab_end_index = 0, partition_vocab_size
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits_1d = predicted_logits_1d.clone().contiguous()
        predicted_logits = predicted_logits_1d.view_as(target)
        predicted_logits[target_mask] = 0.0
        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None


def neox_cross_entropy(output, labels):
    """megatron/model/gpt2_model.py's cross_entropy: per-token losses times the loss mask, over its sum."""
    labels, loss_mask = labels[0], labels[1]
    losses = _VocabParallelCrossEntropy.apply(output.float().contiguous(), labels)
    loss_mask = loss_mask.view(-1)
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()


class GPTNeoX(nn.Module):
    """GPT2ModelPipe as a plain module: EmbeddingPipe (word + learned positions), [b, s, h] -> [s, b, h],
    the layers, back to [b, s, h], the final norm, the untied output Linear, the masked loss. The causal
    mask as get_ltor_masks_and_position_ids builds it, ``tril(ones) < 0.5``."""

    def __init__(self, vocab=37, hidden=16, heads=2, layers=2, seq=9, gpt_j_residual=True,
                 bias_gelu_fusion=False, megatron_loss=True):
        super().__init__()
        self.megatron_loss = megatron_loss
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.embedding_dropout = nn.Dropout(0.0)
        layer = partial(NeoXParallelTransformerLayer, hidden, heads, gpt_j_residual, bias_gelu_fusion)
        self.layers = nn.ModuleList(layer() for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden, eps=1e-5)
        self.final_linear = NeoXParallelLinear(hidden, vocab, bias=False)

    def forward(self, tokens, labels, loss_mask):
        seq_length = tokens.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=tokens.device).unsqueeze(0)
        attention_mask = torch.tril(torch.ones((1, seq_length, seq_length), device=tokens.device)).view(
            1, 1, seq_length, seq_length)
        attention_mask = attention_mask < 0.5
        embeddings = self.word_embeddings(tokens) + self.position_embeddings(position_ids)
        x = self.embedding_dropout(embeddings)
        x = x.transpose(0, 1).contiguous()
        for layer in self.layers:
            x = layer(x, attention_mask)
        x = x.transpose(0, 1).contiguous()
        x = self.final_norm(x)
        logits, _ = self.final_linear(x)
        if self.megatron_loss:
            return neox_cross_entropy(logits, (labels, loss_mask))
        losses = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), reduction="none")
        loss_mask = loss_mask.view(-1)
        return torch.sum(losses * loss_mask) / loss_mask.sum()


def _neox_inputs(b=2, s=9, vocab=37):
    tokens = torch.randint(0, vocab, (b, s + 1))
    loss_mask = torch.ones(b, s)
    loss_mask[1, -3:] = 0.0
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), loss_mask


# ========================================================================================================
# mosaicml/llm-foundry MPT (llmfoundry/models/layers/: norm.py, attention.py, ffn.py, blocks.py; mpt/)
# ========================================================================================================


def _cast_if_autocast_enabled(tensor):
    if torch.is_autocast_enabled():
        if tensor.device.type == "cuda":
            dtype = torch.get_autocast_gpu_dtype()
        elif tensor.device.type == "cpu":
            dtype = torch.get_autocast_cpu_dtype()
        else:
            raise NotImplementedError()
        return tensor.to(dtype=dtype)
    return tensor


class LPLayerNorm(torch.nn.LayerNorm):
    """llm-foundry's low-precision LayerNorm: x, weight and bias cast to the autocast dtype, then F.layer_norm
    with autocast disabled (so it runs in that dtype instead of fp32)."""

    def forward(self, x):
        module_device = x.device
        downcast_x = _cast_if_autocast_enabled(x)
        downcast_weight = _cast_if_autocast_enabled(self.weight) if self.weight is not None else self.weight
        downcast_bias = _cast_if_autocast_enabled(self.bias) if self.bias is not None else self.bias
        with torch.autocast(enabled=False, device_type=module_device.type):
            return torch.nn.functional.layer_norm(
                downcast_x, self.normalized_shape, downcast_weight, downcast_bias, self.eps)


def gen_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, alibi_bias_max=8, device=None, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, 1, seq_len)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(query, key, value, n_heads, softmax_scale=None, attn_bias=None,
                                           is_causal=False):
    b, s_q = query.shape[:2]
    q = query.view(b, s_q, n_heads, -1).permute(0, 2, 1, 3)  # rearrange 'b s (h d) -> b h s d'
    k = key.view(b, key.shape[1], n_heads, -1).permute(0, 2, 3, 1)  # 'b s (h d) -> b h d s'
    v = value.view(b, value.shape[1], n_heads, -1).permute(0, 2, 1, 3)
    s_k = k.size(-1)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(q.size(-1))
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        attn_weight = attn_weight + attn_bias
    min_val = torch.finfo(q.dtype).min
    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float16)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.to(v.dtype).matmul(v)
    return out.permute(0, 2, 1, 3).reshape(b, s_q, -1)  # 'b h s d -> b s (h d)'


class MPTAttention(nn.Module):
    """GroupedQueryAttention with n_heads == kv_n_heads, attn_impl='torch', clip_qkv, no qk_ln."""

    def __init__(self, d_model, n_heads, clip_qkv=None):
        super().__init__()
        self.d_model, self.n_heads, self.clip_qkv = d_model, n_heads, clip_qkv
        self.Wqkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, attn_bias=None, is_causal=True):
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = qkv.split([self.d_model, self.d_model, self.d_model], dim=2)
        context = scaled_multihead_dot_product_attention(query, key, value, self.n_heads, attn_bias=attn_bias,
                                                         is_causal=is_causal)
        return self.out_proj(context)


class MPTMLP(nn.Module):
    def __init__(self, d_model, expansion_ratio=4):
        super().__init__()
        ffn_hidden_size = int(expansion_ratio * d_model)
        self.up_proj = nn.Linear(d_model, ffn_hidden_size)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(ffn_hidden_size, d_model)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, d_model, n_heads, norm_class, clip_qkv=None, resid_pdrop=0.0):
        super().__init__()
        self.norm_1 = norm_class(d_model)
        self.attn = MPTAttention(d_model, n_heads, clip_qkv)
        self.norm_2 = norm_class(d_model)
        self.ffn = MPTMLP(d_model)
        self.resid_attn_dropout = nn.Dropout(resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(resid_pdrop)

    def forward(self, x, attn_bias=None, is_causal=True):
        a = self.norm_1(x)
        b = self.attn(a, attn_bias=attn_bias, is_causal=is_causal)
        x = x + self.resid_attn_dropout(b)
        m = x
        if self.norm_2 is not None:
            m = self.norm_2(x)
        n = self.ffn(m)
        x = x + self.resid_ffn_dropout(n)
        return x


class MPTForCausalLM(nn.Module):
    """MPTModel (wte, emb_drop, blocks with the ALiBi bias built once, norm_f, the tied unembedding by
    F.linear, logit_scale) and ComposerMPTCausalLM's loss: the targets ``torch.roll(labels, shifts=-1)`` with
    the last set to -100, CrossEntropyLoss(ignore_index=-100) over ``logits.view(-1, V)``."""

    def __init__(self, vocab=37, d_model=16, n_heads=2, n_layers=2, max_seq_len=9, norm_class=LPLayerNorm,
                 clip_qkv=None, logit_scale=None):
        super().__init__()
        self.n_heads = n_heads
        self.logit_scale = logit_scale
        self.wte = nn.Embedding(vocab, d_model)
        self.emb_drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(MPTBlock(d_model, n_heads, norm_class, clip_qkv) for _ in range(n_layers))
        self.norm_f = norm_class(d_model)
        self.register_buffer("attn_bias", build_alibi_bias(n_heads, max_seq_len, dtype=torch.float32),
                             persistent=False)
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, input_ids, labels):
        x = self.wte(input_ids)
        x = self.emb_drop(x)
        attn_bias = self.attn_bias[:, :, :, -input_ids.size(1):]
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias, is_causal=True)
        x = self.norm_f(x)
        logits = F.linear(x, self.wte.weight, None)
        if self.logit_scale is not None:
            logits *= self.logit_scale
        targets = torch.roll(labels, shifts=-1)
        targets[:, -1] = -100
        loss = self.loss_fn(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def _ids(s=9, b=2, vocab=37):
    return torch.randint(0, vocab, (b, s))


# ========================================================================================================
# allenai/OLMo (olmo/model.py, olmo/train.py: v0.x), layer_norm_type="default" without affine (OLMo-7B)
# ========================================================================================================


class OLMoLayerNorm(nn.Module):
    """olmo.model.LayerNorm: no weight or bias when elementwise_affine is off; the low_precision variant is
    llm-foundry's LPLayerNorm (above)."""

    def __init__(self, size, elementwise_affine=False, eps=1e-5):
        super().__init__()
        self.normalized_shape = (size,)
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        else:
            self.register_parameter("bias", None)
            self.register_parameter("weight", None)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, weight=self.weight, bias=self.bias, eps=self.eps)


class OLMoRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_len=16):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        seq = torch.arange(max_len, dtype=torch.float)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("pos_sin", positions.sin()[None, None, :, :], persistent=False)
        self.register_buffer("pos_cos", positions.cos()[None, None, :, :], persistent=False)

    def rotate_half(self, x):
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        pos_sin, pos_cos = self.pos_sin[:, :, :key_len, :], self.pos_cos[:, :, :key_len, :]
        q_ = self.apply_rotary_pos_emb(pos_sin[:, :, key_len - query_len:key_len, :],
                                       pos_cos[:, :, key_len - query_len:key_len, :], q)
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k)
        return q_.type_as(q), k_.type_as(k)


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class OLMoSequentialBlock(nn.Module):
    def __init__(self, d_model, n_heads, mlp_hidden, clip_qkv=None):
        super().__init__()
        self.d_model, self.n_heads, self.clip_qkv = d_model, n_heads, clip_qkv
        self.fused_dims = (d_model, d_model, d_model)
        self.attn_norm = OLMoLayerNorm(d_model)
        self.ff_norm = OLMoLayerNorm(d_model)
        self.att_proj = nn.Linear(d_model, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)
        self.ff_proj = nn.Linear(d_model, mlp_hidden, bias=False)
        self.act = SwiGLU()
        self.ff_out = nn.Linear(mlp_hidden // 2, d_model, bias=False)
        self.dropout = nn.Dropout(0.0)
        self.rotary_emb = OLMoRotaryEmbedding(d_model // n_heads)

    def attention(self, q, k, v):
        B, T, C = q.size()
        dtype = k.dtype
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        att = att.to(dtype)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)

    def forward(self, x):
        h = self.attn_norm(x)
        qkv = self.att_proj(h)
        if self.clip_qkv is not None:
            qkv.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        att = self.attention(q, k, v)
        x = x + self.dropout(att)
        og_x = x
        x = self.ff_norm(x)
        x = self.ff_proj(x)
        x = self.act(x)
        x = self.ff_out(x)
        x = self.dropout(x)
        x = og_x + x
        return x


def olmo_cross_entropy_loss(logits, labels, ignore_index: int = -100, reduction: str = "mean",
                            compute_z_loss: bool = False):
    """olmo/train.py's cross_entropy_loss: the z-loss from the logits' logsumexp, masked by the labels."""
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    if not compute_z_loss:
        return loss, None
    z_squared = logits.logsumexp(-1).pow(2)
    if reduction == "mean":
        z_squared = (z_squared * (labels != ignore_index)).mean()
    elif reduction == "sum":
        z_squared = (z_squared * (labels != ignore_index)).sum()
    z_loss = 1e-4 * z_squared
    return loss, z_loss


class OLMo(nn.Module):
    """OLMo (wte, emb_drop, the blocks, ln_f, the tied logits by F.linear, scale_logits by ``mul_``) and the
    trainer's loss: ``logits[..., :-1, :].contiguous().view(-1, V)``, labels ``[..., 1:]`` with padding at
    -100, reduction "sum" divided by the tokens in the batch, plus the z-loss."""

    def __init__(self, vocab=37, d_model=16, n_heads=2, n_layers=2, clip_qkv=None, scale_logits=False):
        super().__init__()
        self.d_model, self.scale_logits = d_model, scale_logits
        self.wte = nn.Embedding(vocab, d_model)
        self.emb_drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(OLMoSequentialBlock(d_model, n_heads, 4 * d_model, clip_qkv)
                                    for _ in range(n_layers))
        self.ln_f = OLMoLayerNorm(d_model)

    def forward(self, input_ids, labels):
        x = self.wte(input_ids)
        x = self.emb_drop(x)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight, None)
        if self.scale_logits:
            logits.mul_(1 / math.sqrt(self.d_model))
        logits_for_loss = logits[..., :-1, :].contiguous()
        logits_for_loss = logits_for_loss.view(-1, logits_for_loss.size(-1))
        labels = labels[..., 1:].contiguous().view(-1)
        batch_size_in_tokens = labels.numel()
        ce_loss, z_loss = olmo_cross_entropy_loss(logits_for_loss, labels, ignore_index=-100, reduction="sum",
                                                  compute_z_loss=True)
        ce_loss = ce_loss / batch_size_in_tokens
        z_loss = z_loss / batch_size_in_tokens
        loss = ce_loss + z_loss
        return loss, ce_loss, logits


def _olmo_inputs(b=2, s=9, vocab=37):
    ids = torch.randint(0, vocab, (b, s))
    labels = ids.clone()
    labels[1, -3:] = -100
    return ids, labels


# ========================================================================================================
# transformers' mT5 / T5 v1.1 (models/t5/modeling_t5.py): feed_forward_proj="gated-gelu", untied head
# ========================================================================================================


class MT5(nn.Module):
    """transformers.MT5ForConditionalGeneration (T5DenseGatedActDense: ``act(wi_0(h)) * wi_1(h)`` with
    gelu_new and bias-free Linears; T5LayerNorm, the variance of ``h.to(float32)``; relative position
    buckets; the untied lm_head; the labels' loss), called with keywords as its users do."""

    def __init__(self, tie_word_embeddings=False):
        super().__init__()
        import transformers

        cfg = transformers.MT5Config(vocab_size=37, d_model=16, d_kv=8, d_ff=24, num_layers=1,
                                     num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                     feed_forward_proj="gated-gelu", tie_word_embeddings=tie_word_embeddings,
                                     decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
        self.model = transformers.MT5ForConditionalGeneration(cfg)

    def forward(self, input_ids, attention_mask, labels):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return out.loss, out.logits


def _mt5_inputs(b=2, s=7, t=5, vocab=37):
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, -2:] = 0
    labels = torch.randint(1, vocab, (b, t))
    labels[1, -1] = -100
    return torch.randint(1, vocab, (b, s)), mask, labels


# ========================================================================================================
# Contrastive losses: facebookresearch/moco (v2: moco/builder.py), moco-v3 (moco/builder.py),
# google-research/simclr (objective.py's add_contrastive_loss, as its PyTorch ports write it)
# ========================================================================================================


class MoCoV2(nn.Module):
    """MoCo v2's forward without the distributed shuffle: q from the encoder, k from the key encoder under
    no_grad (its momentum update left out), l_pos by einsum 'nc,nc->n', l_neg against the queue,
    ``logits /= self.T`` in place, zeros as labels; the queue enqueued after (a buffer written in place)."""

    def __init__(self, dim=8, K=12, T=0.07, mlp=True):
        super().__init__()
        self.K, self.T = K, T
        self.encoder_q = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, dim))
        self.encoder_k = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, dim))
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, im_q, im_k):
        q = self.encoder_q(im_q)
        q = nn.functional.normalize(q, dim=1)
        with torch.no_grad():
            k = self.encoder_k(im_k)
            k = nn.functional.normalize(k, dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1)
        logits /= self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return logits, nn.CrossEntropyLoss()(logits, labels)


class MoCoV3(nn.Module):
    """MoCo v3: base and momentum encoders with the BatchNorm projector / predictor MLPs (_build_mlp), the
    symmetric contrastive_loss (einsum 'nc,mc->nm' / T, labels arange, CrossEntropyLoss * 2T); the momentum
    update and concat_all_gather (world size 1) left out."""

    def __init__(self, dim=8, mlp_dim=16, T=1.0):
        super().__init__()
        self.T = T

        def _build_mlp(num_layers, input_dim, mlp_dim, output_dim, last_bn=True):
            mlp = []
            for layer in range(num_layers):
                dim1 = input_dim if layer == 0 else mlp_dim
                dim2 = output_dim if layer == num_layers - 1 else mlp_dim
                mlp.append(nn.Linear(dim1, dim2, bias=False))
                if layer < num_layers - 1:
                    mlp.append(nn.BatchNorm1d(dim2))
                    mlp.append(nn.ReLU(inplace=True))
                elif last_bn:
                    mlp.append(nn.BatchNorm1d(dim2, affine=False))
            return nn.Sequential(*mlp)

        self.base_encoder = nn.Sequential(nn.Linear(12, 16), nn.GELU(), _build_mlp(3, 16, mlp_dim, dim))
        self.momentum_encoder = nn.Sequential(nn.Linear(12, 16), nn.GELU(), _build_mlp(3, 16, mlp_dim, dim))
        self.predictor = _build_mlp(2, dim, mlp_dim, dim, False)
        for param_m in self.momentum_encoder.parameters():
            param_m.requires_grad = False

    def contrastive_loss(self, q, k):
        q = nn.functional.normalize(q, dim=1)
        k = nn.functional.normalize(k, dim=1)
        logits = torch.einsum("nc,mc->nm", [q, k]) / self.T
        N = logits.shape[0]
        labels = torch.arange(N, dtype=torch.long, device=logits.device)
        return nn.CrossEntropyLoss()(logits, labels) * (2 * self.T)

    def forward(self, x1, x2):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            k1 = self.momentum_encoder(x1)
            k2 = self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


LARGE_NUM = 1e9


class SimCLR(nn.Module):
    """SimCLR's NT-Xent (add_contrastive_loss): the projection head, hidden normalised and split in two,
    the self-similarities' diagonal masked by ``- masks * LARGE_NUM``, the logits concatenated [ab, aa] and
    [ba, bb], labels arange, the two cross-entropies summed."""

    def __init__(self, temperature=0.5):
        super().__init__()
        self.temperature = temperature
        self.encoder = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16))
        self.projection_head = nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                                             nn.Linear(16, 8))

    def forward(self, x1, x2):
        hidden = self.projection_head(self.encoder(torch.cat([x1, x2], 0)))
        hidden = F.normalize(hidden, dim=-1)
        hidden1, hidden2 = torch.split(hidden, hidden.shape[0] // 2, 0)
        batch_size = hidden1.shape[0]
        labels = torch.arange(batch_size)
        masks = F.one_hot(torch.arange(batch_size), batch_size)
        logits_aa = torch.matmul(hidden1, hidden1.T) / self.temperature
        logits_aa = logits_aa - masks * LARGE_NUM
        logits_bb = torch.matmul(hidden2, hidden2.T) / self.temperature
        logits_bb = logits_bb - masks * LARGE_NUM
        logits_ab = torch.matmul(hidden1, hidden2.T) / self.temperature
        logits_ba = torch.matmul(hidden2, hidden1.T) / self.temperature
        loss_a = F.cross_entropy(torch.cat([logits_ab, logits_aa], 1), labels)
        loss_b = F.cross_entropy(torch.cat([logits_ba, logits_bb], 1), labels)
        return loss_a + loss_b, logits_ab


# ========================================================================================================
# Classification losses: timm (timm/loss/cross_entropy.py, timm/data/mixup.py), fairseq
# (fairseq/criterions/label_smoothed_cross_entropy.py, cross_entropy.py), knowledge distillation
# (HobbitLong/RepDistiller's DistillKL)
# ========================================================================================================


class LabelSmoothingCrossEntropy(nn.Module):
    """timm's NLL loss with label smoothing, by hand."""

    def __init__(self, smoothing=0.1):
        super().__init__()
        assert smoothing < 1.0
        self.smoothing = smoothing
        self.confidence = 1.0 - smoothing

    def forward(self, x, target):
        logprobs = F.log_softmax(x, dim=-1)
        nll_loss = -logprobs.gather(dim=-1, index=target.unsqueeze(1))
        nll_loss = nll_loss.squeeze(1)
        smooth_loss = -logprobs.mean(dim=-1)
        loss = self.confidence * nll_loss + self.smoothing * smooth_loss
        return loss.mean()


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


def one_hot(x, num_classes, on_value=1.0, off_value=0.0):
    x = x.long().view(-1, 1)
    return torch.full((x.size()[0], num_classes), off_value, device=x.device).scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1.0, smoothing=0.0):
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value)
    y2 = one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value)
    return y1 * lam + y2 * (1.0 - lam)


class TimmClassifier(nn.Module):
    """A timm-style classifier (the Mlp, a LayerNorm'd pooled feature, the head) trained as timm's train.py
    sets it up: mixup (``x.mul_(lam).add_(x_flipped)`` and mixup_target) with SoftTargetCrossEntropy, or
    LabelSmoothingCrossEntropy without mixup."""

    def __init__(self, num_classes=7, mixup=True, smoothing=0.1, lam=0.7):
        super().__init__()
        self.num_classes, self.mixup, self.smoothing, self.lam = num_classes, mixup, smoothing, lam
        self.mlp = Mlp(12, 24, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, num_classes)
        self.loss_fn = SoftTargetCrossEntropy() if mixup else LabelSmoothingCrossEntropy(smoothing)

    def forward(self, x, target):
        if self.mixup:
            x_flipped = x.flip(0).mul_(1.0 - self.lam)
            x = x.mul(self.lam).add_(x_flipped)
            target = mixup_target(target, self.num_classes, self.lam, self.smoothing)
        logits = self.head(self.norm(self.mlp(x)))
        return logits, self.loss_fn(logits, target)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None, reduce=True):
    """fairseq's: epsilon spread over the V - 1 other classes (eps_i = epsilon / (V - 1)), not over all V as
    F.cross_entropy's label_smoothing does: another function."""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


class FairseqLM(nn.Module):
    """A fairseq decoder's output layer (embed_tokens shared, ``F.linear(x, embed_tokens.weight)``) after a
    post-norm FFN with fairseq's utils.gelu, and the criterion: get_normalized_probs (``utils.log_softmax``
    = ``F.log_softmax(x.float(), dim)``) viewed (-1, V), then label_smoothed_nll_loss (padding_idx 1) or
    CrossEntropyCriterion's ``F.nll_loss(lprobs, target, ignore_index=padding_idx, reduction="sum")``."""

    def __init__(self, vocab=37, dim=16, label_smoothing=0.1, padding_idx=1):
        super().__init__()
        self.eps, self.padding_idx = label_smoothing, padding_idx
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.fc1 = nn.Linear(dim, 32)
        self.fc2 = nn.Linear(32, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, prev_output_tokens, target):
        x = self.embed_tokens(prev_output_tokens)
        residual = x
        x = F.gelu(self.fc1(x).float()).type_as(x)
        x = self.fc2(x)
        x = residual + F.dropout(x, p=0.0, training=self.training)
        x = self.final_layer_norm(x)
        logits = F.linear(x, self.embed_tokens.weight)
        lprobs = F.log_softmax(logits.float(), dim=-1)
        lprobs = lprobs.view(-1, lprobs.size(-1))
        target = target.view(-1)
        if self.eps > 0:
            loss, nll_loss = label_smoothed_nll_loss(lprobs, target, self.eps, ignore_index=self.padding_idx,
                                                     reduce=True)
            return loss, nll_loss
        return F.nll_loss(lprobs, target, ignore_index=self.padding_idx, reduction="sum")


def _fairseq_inputs(b=2, s=7, vocab=37):
    target = torch.randint(2, vocab, (b, s))
    target[1, -2:] = 1
    return torch.randint(2, vocab, (b, s)), target


class DistillKL(nn.Module):
    """RepDistiller's DistillKL (Hinton et al.): KL of the softened distributions, times T^2, per sample."""

    def __init__(self, T):
        super().__init__()
        self.T = T

    def forward(self, y_s, y_t):
        p_s = F.log_softmax(y_s / self.T, dim=1)
        p_t = F.softmax(y_t / self.T, dim=1)
        return F.kl_div(p_s, p_t, reduction="sum") * (self.T**2) / y_s.shape[0]


class Distillation(nn.Module):
    """RepDistiller's train_distill step with kd: gamma * CE(logit_s, target) + alpha * DistillKL(logit_s,
    logit_t), the teacher in eval under no_grad."""

    def __init__(self, T=4.0, gamma=0.5, alpha=0.5):
        super().__init__()
        self.gamma, self.alpha = gamma, alpha
        self.student = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 7))
        self.teacher = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 7))
        self.teacher.requires_grad_(False)
        self.criterion_cls = nn.CrossEntropyLoss()
        self.criterion_div = DistillKL(T)

    def forward(self, x, target):
        logit_s = self.student(x)
        with torch.no_grad():
            logit_t = self.teacher(x)
        loss_cls = self.criterion_cls(logit_s, target)
        loss_div = self.criterion_div(logit_s, logit_t)
        return self.gamma * loss_cls + self.alpha * loss_div, logit_s


# ========================================================================================================
# The table
# ========================================================================================================


def _mixer_inputs():
    return R(2, 3, 9, 9), _labels(2, classes=7)


NOT_A_POWER_OF_TWO = ("cross_entropy", "divided by 0.2, not a power of two")

# name: (model and inputs, rewrites per family (the others 0), near misses (family, words of the reason),
# words the report must hold). Every count was checked by reading the module.
CASES = {
    # per block: norm1 (the first on the stem's output, then the previous block's residual sum) and norm2,
    # each fused with its sum; the token MLP's fc1 on the transposed (B, C, S) tensor is a Linear over S +
    # GELU; the channel MLP's; the final norm; the head's loss over the pooled tokens
    "timm_mlp_mixer": _case(lambda: (MlpMixer(), _mixer_inputs()), dict(norm=5, dense=4, cross_entropy=1),
                            words=["dropout + residual add + F.layer_norm (pre-norm, returns the residual)"]),
    # Affine (torch.addcmul(beta, alpha, x)) is no norm: nothing of the norm family, no report; the token
    # Linear has no GELU; the channel MLPs' fc1 + GELU
    "timm_resmlp": _case(lambda: (MlpMixer(block_layer=ResBlock, norm_layer=Affine), _mixer_inputs()),
                         dict(dense=2, cross_entropy=1)),
    # GELU after a Conv2d (the patch embedding, the depth-wise and the 1x1 convs) and BatchNorm2d: no Linear
    # and no LayerNorm, no report; the head's loss
    "convmixer": _case(lambda: (ConvMixerClassifier(), _mixer_inputs()), dict(cross_entropy=1)),
    # parallel residual: both norms read x (layer 0: the embeddings, not folded through the broadcast
    # position add; layer 1: one fused with layer 0's residual + output sum, the other reads its residual
    # output); the final norm through the [s, b, h] -> [b, s, h] transpose; F.linear (skip_bias_add) + b +
    # F.gelu; the Megatron loss is an autograd.Function (its forward and backward by hand): no candidate
    "gpt_neox_parallel_residual": _case(lambda: (GPTNeoX(), _neox_inputs()),
                                        dict(attention=2, norm=5, dense=2),
                                        words=["residual add (rows permuted) + F.layer_norm"]),
    # the same with F.cross_entropy(reduction='none') times the loss mask
    "gpt_neox_plain_loss": _case(lambda: (GPTNeoX(megatron_loss=False), _neox_inputs()),
                                 dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    # LPLayerNorm: F.layer_norm in an autocast(enabled=False) block, outside autocast (finding L1, fixed):
    # norm_1 with the embedding dropout, norm_2 and the next norm_1 with their residual sums, norm_f; the
    # targets by torch.roll + item assignment: a plain target
    "llm_foundry_mpt": _case(lambda: (MPTForCausalLM(), (_ids(), _ids())),
                             dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    # clip_qkv (out of place here), logit_scale 1/4 by ``logits *= ...``: a power of two, into the weight
    "llm_foundry_mpt_clip_scale": _case(lambda: (MPTForCausalLM(clip_qkv=0.5, logit_scale=0.25),
                                                 (_ids(), _ids())),
                                        dict(attention=2, norm=5, dense=2, cross_entropy=1),
                                        words=["F.linear -> mul -> view -> F.cross_entropy"]),
    # weightless LayerNorms x 5; SwiGLU (no candidate); the shifted logits' loss with reduction='sum', the
    # z-loss reading the same logits (the op returns them)
    "olmo": _case(lambda: (OLMo(), _olmo_inputs()), dict(attention=2, norm=5, cross_entropy=1),
                  words=["F.linear -> getitem -> contiguous -> view -> F.cross_entropy"]),
    # qkv.clamp_ in place; scale_logits: logits.mul_(1 / sqrt(16)), a power of two
    "olmo_clip_scale_logits": _case(lambda: (OLMo(clip_qkv=0.5, scale_logits=True), _olmo_inputs()),
                                    dict(attention=2, norm=5, cross_entropy=1),
                                    words=["F.linear -> mul -> getitem"]),
    # encoder self, decoder self and cross attention (position bias as the mask); T5LayerNorm: 2 + final
    # per stack side (encoder 3, decoder 4 with the cross-attention's); wi_0 (bias-free) + gelu_new per FFN,
    # the gating product with wi_1 after it; the untied lm_head's loss
    "mt5_gated_gelu": _case(lambda: (MT5(), _mt5_inputs()),
                            dict(attention=3, norm=7, dense=2, cross_entropy=1),
                            words=["F.linear + GELU written out (tanh)"]),
    # the logits are cat([l_pos, l_neg]) / T: no Linear; the reason names the in-place division it meets first
    "moco_v2": _case(lambda: (MoCoV2(), (R(6, 12), R(6, 12))), {},
                     (("cross_entropy", "the logits pass through <built-in function itruediv>"),)),
    # einsum('nc,mc->nm', q, k) / T is a Linear of q with the weight k (from the momentum encoder, no grad);
    # T = 1.0 (ResNet) is a power of two; the encoders' first Linear + GELU (x 2 encoders x 2 views)
    "moco_v3": _case(lambda: (MoCoV3(), (R(6, 12), R(6, 12))), dict(dense=4, cross_entropy=2),
                     words=["einsum -> div -> F.cross_entropy"]),
    # T = 0.2 (ViT): not a power of two, reported
    "moco_v3_vit_temperature": _case(lambda: (MoCoV3(T=0.2), (R(6, 12), R(6, 12))), dict(dense=4),
                                     (NOT_A_POWER_OF_TWO, NOT_A_POWER_OF_TWO)),
    # the logits are torch.cat([ab, aa - masks * 1e9]): not one Linear, reported
    "simclr_nt_xent": _case(lambda: (SimCLR(), (R(4, 12), R(4, 12))), {},
                            (("cross_entropy", "the logits come from cat"),) * 2),
    # mixup + SoftTargetCrossEntropy (probability targets by hand): no candidate, no report
    "timm_mixup_soft_target": _case(lambda: (TimmClassifier(), (R(4, 12), _labels(4, classes=7))),
                                    dict(norm=1, dense=1)),
    # LabelSmoothingCrossEntropy by hand: F.cross_entropy(label_smoothing=0.1) (finding L2, fixed)
    "timm_label_smoothing": _case(lambda: (TimmClassifier(mixup=False), (R(4, 12), _labels(4, classes=7))),
                                  dict(norm=1, dense=1, cross_entropy=1),
                                  words=["F.linear -> (1 - s) * nll + s * smooth by hand"]),
    # fairseq's label smoothing is another function than F.cross_entropy's: left alone, no report
    "fairseq_label_smoothed_nll_loss": _case(lambda: (FairseqLM(), _fairseq_inputs()), dict(norm=1, dense=1)),
    # CrossEntropyCriterion: F.nll_loss of utils.log_softmax's fp32 log-probabilities, viewed (-1, V)
    "fairseq_cross_entropy": _case(lambda: (FairseqLM(label_smoothing=0.0), _fairseq_inputs()),
                                   dict(norm=1, dense=1, cross_entropy=1),
                                   words=["F.linear -> float -> log_softmax -> view -> F.nll_loss"]),
    # the student's loss is rewritten, its logits returned by the op for the KL term; the teacher's Linear +
    # GELU too (under no_grad)
    "hinton_distillation": _case(lambda: (Distillation(), (R(4, 12), _labels(4, classes=7))),
                                 dict(dense=2, cross_entropy=1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_codebase_block(name):
    make, rewrites, near_misses, words = CASES[name]
    model, args = make()
    report = _check_block(model, args, rewrites, near_misses)
    for w in words:
        assert w in str(report), str(report)


# ========================================================================================================
# Beyond the table: states that differ between training and eval (gpt-neox), dynamic shapes
# ========================================================================================================


def test_gpt_neox_sequential_layer_in_eval_keeps_its_enable_grad_regions():
    """gpt_j_residual=False: the residual sums are computed in ``with torch.enable_grad():``
    (bias_dropout_add), the norms outside. Trained, grad mode is on throughout (no region): 5 norms. Called
    under no_grad (eval), the sums run with grad enabled and the norms without: a fused sum + norm would run
    both in one state, so the three norms that read a layer's sum are reported and left alone (the norm
    alone is not taken instead: finding N1); the first norm (on the embeddings) and the final one (a plain
    norm of the last sum, read through the transpose) are fused."""
    model, args = GPTNeoX(gpt_j_residual=False, megatron_loss=False), _neox_inputs()
    for train, norms, refused in ((True, 5, 0), (False, 2, 3)):
        report, flash = _compile_and_compare(model, args, train, TOL)
        assert (flash.get("norm", 0), flash.get("norm_skipped", 0)) == (norms, refused), str(report)
        assert sum("enable_grad() / set_grad_enabled / autocast region" in d.detail
                   for d in report.near_misses) == refused, str(report)
        others = flash.get("attention"), flash.get("dense"), flash.get("cross_entropy")
        assert others == (2, 2, 1), str(report)


def test_gpt_neox_bias_gelu_fusion():
    """bias_gelu_fusion=True: GeLUFunction, an autograd.Function with its own backward. Trained, dynamo keeps
    it whole (its forward and backward in a higher-order op): no dense candidate, eager's backward runs. In
    eval (no_grad) dynamo inlines its forward, and bias_gelu (``0.79788456``: sqrt(2 / pi) to 8 digits, the
    tanh GELU in fp32) after the bias-free Linear + b is rewritten."""
    model, args = GPTNeoX(bias_gelu_fusion=True, megatron_loss=False), _neox_inputs()
    for train, dense in ((True, 0), (False, 2)):
        report, flash = _compile_and_compare(model, args, train, TOL)
        assert flash.get("dense", 0) == dense and not report.near_misses, str(report)
        others = flash.get("attention"), flash.get("norm"), flash.get("cross_entropy")
        assert others == (2, 5, 1), str(report)


def test_olmo_under_dynamic_shapes():
    """The sequence length varies: the z-loss and ``/ labels.numel()`` symbolic, one compile."""
    report = _dynamic_check(OLMo(), [_olmo_inputs(s=9), _olmo_inputs(s=6), _olmo_inputs(b=3, s=5)])
    assert sum(d.family == "cross_entropy" for d in report.rewrites) >= 1, str(report)
    assert not report.near_misses, str(report)


# ========================================================================================================
# L1 (FIXED, fx_passes/_match.py state_regions): an autocast(enabled=False) block outside autocast was taken
# for a change of state, and every LPLayerNorm (MPT, OLMo's low_precision) with its residual sum left alone
# ========================================================================================================


class _LowPrecisionPreNorm(nn.Module):
    """A residual sum read by llm-foundry's LPLayerNorm and returned (a pre-norm block)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = LPLayerNorm(16)

    def forward(self, x, r):
        h = r + F.dropout(self.fc(x), 0.0, self.training)
        return self.norm(h), h


class _NormInAutocastOffInsideAutocast(nn.Module):
    """The sum computed under autocast(bf16) and normalised in an autocast(enabled=False) block nested in
    it: a real change of state (the Linear runs in bf16, the norm in fp32)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x, r):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc(x).float() + r
            with torch.autocast("cpu", enabled=False):
                return self.norm(h), h


def test_lp_layer_norm_outside_autocast_is_fused():
    """Outside autocast the block changes nothing: the residual add + norm is fused (it was reported, "a ...
    autocast region begins or ends inside the pattern")."""
    _check_block(_LowPrecisionPreNorm(), (R(2, 5, 16), R(2, 5, 16)), dict(norm=1))


def test_lp_layer_norm_under_autocast_is_still_a_change_of_state():
    """Under autocast(bf16) LPLayerNorm casts x, weight and bias down and runs F.layer_norm in bf16 with
    autocast off: the block is a change of state, and the pattern across it is still refused."""
    model, args = _LowPrecisionPreNorm(), (R(2, 5, 16), R(2, 5, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report, flash = _compile_and_compare(model, args, True, dict(atol=1e-2, rtol=1e-2))
    assert flash.get("norm", 0) == 0 and flash.get("norm_skipped") == 1, str(report)
    assert "autocast region begins or ends inside the pattern" in report.near_misses[0].detail, str(report)


def test_autocast_off_block_nested_in_an_autocast_block_is_a_change_of_state():
    report, flash = _compile_and_compare(_NormInAutocastOffInsideAutocast(), (R(2, 5, 16), R(2, 5, 16)), True,
                                         dict(atol=1e-2, rtol=1e-2))
    assert flash.get("norm", 0) == 0 and flash.get("norm_skipped") == 1, str(report)
    assert "autocast region begins or ends inside the pattern" in report.near_misses[0].detail, str(report)


def test_mpt_under_dynamic_shapes():
    """The fused LPLayerNorms and the rolled targets with the sequence length varying."""
    report = _dynamic_check(MPTForCausalLM(), [(_ids(s=9), _ids(s=9)), (_ids(s=6), _ids(s=6))])
    assert sum(d.family == "norm" for d in report.rewrites) >= 5, str(report)
    assert not report.near_misses, str(report)


# ========================================================================================================
# L2 (FIXED, fx_passes/cross_entropy.py _hand_written_label_smoothing): timm's LabelSmoothingCrossEntropy
# ========================================================================================================


class _SmoothedHead(nn.Module):
    """A Linear head and label smoothing written out in one of its spellings."""

    def __init__(self, spelling, smoothing=0.2):
        super().__init__()
        self.spelling, self.smoothing, self.confidence = spelling, smoothing, 1.0 - smoothing
        self.head = nn.Linear(12, 7)

    def forward(self, x, target):
        logits = self.head(x)
        if self.spelling == "cat":  # not a Linear's logits: reported, eager's nodes put back
            logits = torch.cat([logits[:, :3], logits[:, 3:]], 1)
        s, c = self.smoothing, self.confidence
        lp = torch.log_softmax(logits, 1)
        if self.spelling in ("neg_after_squeeze", "cat"):
            nll = -(lp.gather(1, target.unsqueeze(-1)).squeeze(-1))
            return torch.mean(nll * c + (-lp.mean(1)) * s), logits
        if self.spelling == "weights_not_summing_to_1":  # another function: no candidate
            return (c * -lp.gather(-1, target.unsqueeze(1)).squeeze(1) + 2 * s * -lp.mean(-1)).mean(), logits
        if self.spelling == "log_probs_returned":  # the op does not return them: no candidate
            return (c * -lp.gather(-1, target.unsqueeze(1)).squeeze(1) + s * -lp.mean(-1)).mean(), lp
        raise AssertionError(self.spelling)


@pytest.mark.parametrize("spelling, rewrites, near_misses", [
    ("neg_after_squeeze", dict(cross_entropy=1), ()),
    ("cat", {}, (("cross_entropy", "the logits come from logits_1, not from an F.linear"),)),
    ("weights_not_summing_to_1", {}, ()),
    ("log_probs_returned", {}, ()),
])
def test_label_smoothing_by_hand(spelling, rewrites, near_misses):
    _check_block(_SmoothedHead(spelling), (R(5, 12), _labels(5, classes=7)), rewrites, near_misses)


def test_label_smoothing_by_hand_under_dynamic_shapes():
    report = _dynamic_check(TimmClassifier(mixup=False), [(R(4, 12), _labels(4, classes=7)),
                                                          (R(6, 12), _labels(6, classes=7))])
    assert any("smooth by hand" in d.variant for d in report.rewrites), str(report)


class _SmoothedLM(nn.Module):
    """An LM head with the causal shift and the upcast before timm's loss: the row selection, reshape and cast
    are taken as for F.cross_entropy (the logits also returned)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(37, 16), nn.Linear(16, 37)
        self.loss_fn = LabelSmoothingCrossEntropy(0.1)

    def forward(self, ids):
        logits = self.head(self.emb(ids))
        return self.loss_fn(logits[:, :-1].reshape(-1, 37).float(), ids[:, 1:].reshape(-1)), logits


def test_label_smoothing_by_hand_over_shifted_lm_logits():
    report = _check_block(_SmoothedLM(), (_ids(),), dict(cross_entropy=1))
    assert "F.linear -> getitem -> reshape -> float -> (1 - s) * nll + s * smooth by hand" in str(report)
