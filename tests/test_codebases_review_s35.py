"""Review (session 35) of the four pass families on code bases and code styles no earlier review wrote:
facebookresearch/XLM (and transformers' XLM / Flaubert port: the mask brought to the scores' shape by
``expand_as(scores)`` and written in place by ``scores.masked_fill_``), transformers' SqueezeBERT (attention
on the (B, C, S) layout of its Conv1d projections, k kept (B, H, D, S), the LayerNorm through permutes),
LongT5's local attention (blocks of keys, a learned bias, no scale), openai/whisper's attention over cached
keys / values, torch's ``nn.RMSNorm`` with its default eps (None: finfo.eps), the Annotated Transformer's
LayerNorm (unbiased std, eps outside the root), LayerNorm over the last two dims, the softmax of 3-d
(B·H, S, S) scores over the query dim, ``nn.Sequential(Linear, GELU(approximate='tanh'), Dropout)`` trained
with dropout drawn as eager draws it, and F.cross_entropy's reduction / ignore_index / label_smoothing
combinations with every target ignored.

Each block is compiled with the rewrite-only backend (fullgraph; the rewritten graph runs as plain PyTorch,
the flash ops on their CPU reference) and compared with eager: in training the outputs and the gradients of
every input and parameter, in eval the outputs, fp32 at 5e-5. The rewrites per family are asserted exactly,
and so are the near misses with their reasons (tests/test_codebases_review_s31.py's harness).

Findings: tests/findings/codebase_review_s35.md.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_codebases_review_s31 import TOL, _case, _check_block, _labels
from test_codebases_review_s32 import _dynamic_check
from test_norm_dense_ce_review_s25 import _run

from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

R = torch.randn


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# ========================================================================================================
# facebookresearch/XLM (src/model/transformer.py) and transformers' XLM / Flaubert port (modeling_xlm.py)
# ========================================================================================================


def get_masks(slen, lengths, causal):
    """XLM's get_masks: the padding mask from the lengths, the causal one by ``arange`` comparisons."""
    alen = torch.arange(slen, dtype=torch.long, device=lengths.device)
    mask = alen < lengths[:, None]
    bs = lengths.size(0)
    if causal:
        attn_mask = alen[None, None, :].repeat(bs, slen, 1) <= alen[None, :, None]
    else:
        attn_mask = mask
    return mask, attn_mask


class XLMMultiHeadAttention(nn.Module):
    """XLM's MultiHeadAttention: q divided by sqrt(d), ``mask = (mask == 0).view(mask_reshape)
    .expand_as(scores)``, ``scores.masked_fill_(mask, fill)`` (the original writes -inf, the transformers
    port finfo.min), ``F.softmax(scores.float(), dim=-1).type_as(scores)``."""

    def __init__(self, n_heads, dim, fill=-float("inf")):
        super().__init__()
        self.n_heads, self.dim, self.fill = n_heads, dim, fill
        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, input, mask):
        bs, qlen, dim = input.size()
        klen = qlen
        n_heads = self.n_heads
        dim_per_head = dim // n_heads
        mask_reshape = (bs, 1, qlen, klen) if mask.dim() == 3 else (bs, 1, 1, klen)

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(input))
        k = shape(self.k_lin(input))
        v = shape(self.v_lin(input))
        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (mask == 0).view(mask_reshape).expand_as(scores)
        fill = torch.finfo(scores.dtype).min if self.fill is None else self.fill
        scores.masked_fill_(mask, fill)
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=0.0, training=self.training)
        context = torch.matmul(weights, v)
        context = unshape(context)
        return self.out_lin(context)


class XLMTransformerFFN(nn.Module):
    def __init__(self, in_dim, dim_hidden, out_dim):
        super().__init__()
        self.lin1 = nn.Linear(in_dim, dim_hidden)
        self.lin2 = nn.Linear(dim_hidden, out_dim)

    def forward(self, input):
        x = self.lin1(input)
        x = F.gelu(x)
        x = self.lin2(x)
        return F.dropout(x, p=0.0, training=self.training)


class XLMModel(nn.Module):
    """XLM's TransformerModel (encoder, post-norm, sinusoidal-free learned positions, language embeddings,
    ``tensor *= mask.unsqueeze(-1)`` after each layer) with its PredLayer's loss over every position."""

    def __init__(self, n_words=29, dim=32, n_heads=4, n_layers=2, causal=False, fill=-float("inf")):
        super().__init__()
        self.causal = causal
        self.position_embeddings = nn.Embedding(32, dim)
        self.lang_embeddings = nn.Embedding(2, dim)
        self.embeddings = nn.Embedding(n_words, dim, padding_idx=2)
        self.layer_norm_emb = nn.LayerNorm(dim, eps=1e-12)
        self.attentions = nn.ModuleList([XLMMultiHeadAttention(n_heads, dim, fill) for _ in range(n_layers)])
        self.layer_norm1 = nn.ModuleList([nn.LayerNorm(dim, eps=1e-12) for _ in range(n_layers)])
        self.ffns = nn.ModuleList([XLMTransformerFFN(dim, 4 * dim, dim) for _ in range(n_layers)])
        self.layer_norm2 = nn.ModuleList([nn.LayerNorm(dim, eps=1e-12) for _ in range(n_layers)])
        self.proj = nn.Linear(dim, n_words)
        self.n_words = n_words

    def forward(self, x, lengths, langs, y):
        bs, slen = x.size()
        mask, attn_mask = get_masks(slen, lengths, self.causal)
        positions = torch.arange(slen, device=x.device).unsqueeze(0)
        tensor = self.embeddings(x)
        tensor = tensor + self.position_embeddings(positions).expand_as(tensor)
        tensor = tensor + self.lang_embeddings(langs)
        tensor = self.layer_norm_emb(tensor)
        tensor = F.dropout(tensor, p=0.0, training=self.training)
        tensor *= mask.unsqueeze(-1).to(tensor.dtype)
        for i in range(len(self.attentions)):
            attn = self.attentions[i](tensor, attn_mask)
            attn = F.dropout(attn, p=0.0, training=self.training)
            tensor = tensor + attn
            tensor = self.layer_norm1[i](tensor)
            tensor = tensor + self.ffns[i](tensor)
            tensor = self.layer_norm2[i](tensor)
            tensor *= mask.unsqueeze(-1).to(tensor.dtype)
        scores = self.proj(tensor).view(-1, self.n_words)
        return F.cross_entropy(scores, y.view(-1), reduction="mean"), tensor


def _xlm_inputs(bs=2, slen=9, n_words=29):
    lengths = torch.tensor([slen] + [slen - 3] * (bs - 1))
    return (torch.randint(3, n_words, (bs, slen)), lengths, torch.randint(0, 2, (bs, slen)),
            _labels(bs, slen, classes=n_words))


class XLMStyleMask(nn.Module):
    """The scores masked through ``m.expand_as(scores)`` in the other forms a port writes: an additive
    ``(1 - m) * -10000`` mask (``+`` or ``-`` 1e9 · (1 - m)), torch.where, out-of-place masked_fill; and
    the forms that must stay as they are: the expanded mask read again (returned), a view of the scores
    (``scores.expand_as(scores)``) read after the in-place write."""

    def __init__(self, form, d=32, h=4):
        super().__init__()
        self.form, self.h = form, h
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        bs, qlen, dim = x.shape
        hd = dim // self.h
        q, k, v = (lin(x).view(bs, -1, self.h, hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd)
        extra = None
        if self.form == "add":
            scores = scores + ((1.0 - mask) * -10000.0).view(bs, 1, 1, -1).expand_as(scores)
        elif self.form == "sub":
            scores = scores - ((1.0 - mask) * 1e9).view(bs, 1, 1, -1).expand_as(scores)
        elif self.form == "where":
            scores = torch.where(mask.bool().view(bs, 1, 1, -1).expand_as(scores), scores, float("-inf"))
        elif self.form == "masked_fill":
            scores = scores.masked_fill((mask == 0).view(bs, 1, 1, -1).expand_as(scores), -1e9)
        elif self.form == "mask_read_again":
            m = (mask == 0).view(bs, 1, 1, -1).expand_as(scores)
            scores = scores.masked_fill(m, -1e9)
            extra = m.float().sum()
        elif self.form == "view_of_scores_read_after_the_write":
            m = (mask == 0).view(bs, 1, 1, -1).expand_as(scores)
            alias = scores.expand_as(scores)
            scores.masked_fill_(m, -1e9)
            extra = alias.sum()
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(w, v).transpose(1, 2).contiguous().view(bs, -1, dim)
        return out if extra is None else (out, extra)


def _padding_mask(b=2, s=9):
    m = torch.ones(b, s)
    m[1, 5:] = 0
    return m


# ========================================================================================================
# openai/whisper: attention over cached keys / values (the decoder's cross-attention, kv_cache hooks)
# ========================================================================================================


class WhisperCachedAttention(nn.Module):
    """whisper/model.py MultiHeadAttention.qkv_attention (the manual path) with k / v read from the cache
    (graph inputs), q and k each scaled by d^-1/4, the -inf triu mask sliced to n_ctx, ``qk.float()``."""

    def __init__(self, n_state=32, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x, k, v, mask=None):
        q = self.query(x)
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


# ========================================================================================================
# Norms: torch's nn.RMSNorm (eps=None), the Annotated Transformer's LayerNorm, LayerNorm over two dims
# ========================================================================================================


class TinyResidualNorm(nn.Module):
    """``norm(x + fc(x))`` on activations ~3e-4 (a small fc), where eps decides the result: nn.RMSNorm's
    default eps is None, finfo(x.dtype).eps (1.19e-7 in fp32), in all three spellings."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.fc = nn.Linear(16, 16)
        self.norm = nn.RMSNorm(16)
        with torch.no_grad():
            self.fc.weight.mul_(1e-4)
            self.fc.bias.mul_(1e-4)
            self.norm.weight.add_(0.1 * torch.randn(16))

    def forward(self, x):
        h = x + self.fc(x)
        if self.spelling == "module":
            return self.norm(h)
        if self.spelling == "functional":
            return F.rms_norm(h, (16,), self.norm.weight)
        return F.rms_norm(h, (16,))


class AnnotatedLayerNorm(nn.Module):
    """harvardnlp's Annotated Transformer: ``a_2 * (x - mean) / (std + eps) + b_2`` with x.std(-1) unbiased,
    eps outside the root: another function than LayerNorm (reported, left alone)."""

    def __init__(self, features=16, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features) + 0.1 * torch.randn(features))
        self.b_2 = nn.Parameter(0.1 * torch.randn(features))
        self.eps = eps
        self.sublayer = nn.Linear(features, features)

    def forward(self, x):
        x = x + self.sublayer(x)
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class TwoDimLayerNorm(nn.Module):
    """``nn.LayerNorm([S, D])`` / ``F.layer_norm(h, h.shape[-2:])`` of a residual sum: statistics over the
    last two dims, not the last one (reported, left alone)."""

    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm([5, 16])

    def forward(self, x):
        h = x + self.fc(x)
        return F.layer_norm(h, h.shape[-2:]) if self.functional else self.ln(h)


# ========================================================================================================
# Attention on (B·H, S, S) scores: the softmax over the key dim or over the query dim
# ========================================================================================================


class BmmAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, 2, 8).permute(2, 0, 3, 1, 4).reshape(3, B * 2, S, 8)
        scores = torch.bmm(q, k.transpose(1, 2)) * 8 ** -0.5
        p = F.softmax(scores, dim=self.dim)
        return torch.bmm(p, v).view(B, 2, S, 8).transpose(1, 2).reshape(B, S, 16)


# ========================================================================================================
# Dense: nn.Sequential(Linear, GELU(approximate='tanh'), Dropout) trained with p > 0, and its loss
# ========================================================================================================


class TanhGeluMlpWithDropout(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Dropout(p),
                                 nn.Linear(32, 16), nn.Dropout(p))
        self.head = nn.Linear(16, 7)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.net(x)).view(-1, 7), y.view(-1))


# ========================================================================================================
# transformers models as installed (their own attention code, not the shared eager_attention_forward)
# ========================================================================================================

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=50,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


class HFModel(nn.Module):
    """A transformers model called with keywords; returns the loss and the logits."""

    def __init__(self, make):
        super().__init__()
        self.model = make()

    def forward(self, input_ids, attention_mask, labels):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return out.loss, out.logits


def _squeezebert():
    import transformers

    cfg = transformers.SqueezeBertConfig(**SMALL, embedding_size=32, q_groups=1, k_groups=1, v_groups=1,
                                         post_attention_groups=1, intermediate_groups=1, output_groups=1)
    return transformers.SqueezeBertForMaskedLM(cfg)


def _longt5_local():
    import transformers

    cfg = transformers.LongT5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=48, num_layers=1,
                                    num_decoder_layers=1, num_heads=4, dropout_rate=0.0, local_radius=3,
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                    encoder_attention_type="local", feed_forward_proj="gated-gelu")
    return transformers.LongT5ForConditionalGeneration(cfg)


def _hf_inputs(b=2, s=9):
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 6:] = 0
    return torch.randint(3, 50, (b, s)), mask, torch.randint(0, 50, (b, s))


# name: (model and inputs, rewrites per family (the others 0), near misses (family, words of the reason),
# words the report must hold). Every count was checked by reading the module.
CASES = {
    # per layer: the attention (the padding mask through expand_as, -inf in place), layer_norm1 and
    # layer_norm2 each with their residual sum, the FFN's Linear + GELU; layer_norm_emb (plain); the loss
    "xlm_mlm": _case(lambda: (XLMModel(), _xlm_inputs()),
                     dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    # causal=True: the (bs, slen, slen) arange mask, viewed (bs, 1, qlen, klen) and expanded
    "xlm_clm": _case(lambda: (XLMModel(causal=True), _xlm_inputs()),
                     dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    # transformers' port: finfo.min in place of -inf
    "xlm_hf_port_finfo_min": _case(lambda: (XLMModel(fill=None), _xlm_inputs()),
                                   dict(attention=2, norm=5, dense=2, cross_entropy=1)),
    "xlm_style_add": _case(lambda: (XLMStyleMask("add"), (R(2, 9, 32), _padding_mask())), dict(attention=1)),
    "xlm_style_sub": _case(lambda: (XLMStyleMask("sub"), (R(2, 9, 32), _padding_mask())), dict(attention=1)),
    "xlm_style_where": _case(lambda: (XLMStyleMask("where"), (R(2, 9, 32), _padding_mask())),
                             dict(attention=1)),
    "xlm_style_masked_fill": _case(lambda: (XLMStyleMask("masked_fill"), (R(2, 9, 32), _padding_mask())),
                                   dict(attention=1)),
    # the expanded mask is read again: taking its source would leave the expand_as keeping q·kᵀ computed
    "xlm_style_mask_read_again": _case(
        lambda: (XLMStyleMask("mask_read_again"), (R(2, 9, 32), _padding_mask())),
        {}, [("attention", "intermediate 'scores' has other users (m)")]),
    # a view of the scores sees the in-place write: not functionalised, not rewritten
    "xlm_style_view_of_scores": _case(
        lambda: (XLMStyleMask("view_of_scores_read_after_the_write"), (R(2, 9, 32), _padding_mask())),
        {}, [("attention", "has other users")]),
    "whisper_cached_self_attention": _case(
        lambda: (WhisperCachedAttention(), (R(2, 6, 32), R(2, 6, 32), R(2, 6, 32),
                                            torch.empty(6, 6).fill_(-float("inf")).triu_(1))),
        dict(attention=1)),
    "whisper_cached_cross_attention": _case(
        lambda: (WhisperCachedAttention(), (R(2, 3, 32), R(2, 7, 32), R(2, 7, 32))), dict(attention=1)),
    "rms_norm_eps_none_module": _case(lambda: (TinyResidualNorm("module"), (R(2, 5, 16) * 3e-4,)),
                                      dict(norm=1)),
    "rms_norm_eps_none_functional": _case(lambda: (TinyResidualNorm("functional"), (R(2, 5, 16) * 3e-4,)),
                                          dict(norm=1)),
    "rms_norm_eps_none_no_weight": _case(lambda: (TinyResidualNorm("no weight"), (R(2, 5, 16) * 3e-4,)),
                                         dict(norm=1)),
    "annotated_transformer_layer_norm": _case(
        lambda: (AnnotatedLayerNorm(), (R(2, 5, 16),)), {},
        [("norm", "the standard deviation is unbiased")]),
    "layer_norm_over_two_dims": _case(lambda: (TwoDimLayerNorm(False), (R(2, 5, 16),)), {},
                                      [("norm", "normalises over the last 2 dims")]),
    "f_layer_norm_over_two_dims": _case(lambda: (TwoDimLayerNorm(True), (R(2, 5, 16),)), {},
                                        [("norm", "normalises over the last 2 dims")]),
    "bmm_softmax_dim_2": _case(lambda: (BmmAttention(2), (R(2, 5, 16),)), dict(attention=1)),
    "bmm_softmax_dim_1": _case(lambda: (BmmAttention(1), (R(2, 5, 16),)), {},
                               [("attention", "softmax over dim 1 of the 3-d scores")]),
    "bmm_softmax_dim_minus_2": _case(lambda: (BmmAttention(-2), (R(2, 5, 16),)), {},
                                     [("attention", "softmax over dim -2 of the 3-d scores")]),
    # 2 layers: the attention (q (B, H, S, D) by permute, k (B, H, D, S)), the Conv1d LayerNorms through the
    # permutes with their residual sums (2 per layer) and the embeddings' plain one; the head's transform
    # (Linear + GELU) and its LayerNorm; the loss
    "transformers_squeezebert": _case(lambda: (HFModel(_squeezebert), _hf_inputs()),
                                      dict(attention=2, norm=6, dense=1, cross_entropy=1)),
    # the encoder's local attention (blocks of 3 keys on each side, the bias of the relative positions
    # learned), the decoder's self- and cross-attention; T5LayerNorms; gated-gelu wi_0; the loss
    "transformers_longt5_local": _case(lambda: (HFModel(_longt5_local), _hf_inputs()),
                                       dict(attention=3, norm=7, dense=2, cross_entropy=1)),
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


def test_xlm_expanded_mask_leaves_no_score_matmul():
    """M1: the rewritten XLM attention computes no q·kᵀ beside the op (the expand_as template is gone)."""
    graphs = []

    def backend(gm, example_inputs):
        compiled = rewrite_only_backend(gm, example_inputs)
        graphs.append(gm.graph)
        return compiled

    model = XLMStyleMask("masked_fill").eval()
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(R(2, 9, 32), _padding_mask())
    targets = [n.target for n in graphs[-1].nodes]
    assert torch.matmul not in targets and "expand_as" not in targets, str(graphs[-1])


def test_xlm_under_dynamic_shapes():
    """The batch and the length vary: the padding mask expanded to symbolic scores, one compile."""
    argsets = [_xlm_inputs(bs=2, slen=9), _xlm_inputs(bs=2, slen=6), _xlm_inputs(bs=3, slen=7)]
    report = _dynamic_check(XLMModel(), argsets)
    assert sum(d.family == "attention" for d in report.rewrites) == 2, str(report)
    assert not report.near_misses, str(report)


def test_functionalize_metadata_reads():
    """A read of the scores' size (``m.expand_as(scores)``, ``t.type_as(scores)``) before the in-place write
    sees nothing of it; ``scores.expand_as(t)`` is a view of the scores, which does."""
    from fx_passes._functionalize import _reads_metadata_only

    graph = torch.fx.Graph()
    scores, mask = graph.placeholder("scores"), graph.placeholder("mask")
    template_read = graph.call_method("expand_as", (mask, scores))
    view = graph.call_method("expand_as", (scores, mask))
    both = graph.call_method("expand_as", (scores, scores))
    dtype_read = graph.call_method("type_as", (mask, scores))
    size = graph.call_method("size", (scores, -1))
    assert _reads_metadata_only(template_read, scores) and _reads_metadata_only(dtype_read, scores)
    assert _reads_metadata_only(size, scores)
    assert not _reads_metadata_only(view, scores) and not _reads_metadata_only(both, scores)


def test_tanh_gelu_mlp_dropout_draws_as_eager():
    """Trained with dropout 0.1 after the fused Linear + tanh GELU and after fc2: the rewrite draws no random
    numbers of its own, so with the same seed compiled and eager drop the same elements (and the loss, fused
    with the head, matches)."""
    model, x, y = TanhGeluMlpWithDropout(), R(2, 5, 16), _labels(2, 5, classes=7)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=rewrite_only_backend, fullgraph=True)
    torch.manual_seed(1)
    got = _run(compiled, (x, y), True)
    torch.manual_seed(1)
    expected = _run(model, (x, y), True)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL)
    flash = dict(counters["flash"])
    assert flash.get("dense") == 1 and flash.get("cross_entropy") == 1, flash


class _LinearCE(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.head = nn.Linear(16, 11)
        self.kwargs = kwargs

    def forward(self, x, y):
        return F.cross_entropy(self.head(x).view(-1, 11), y.view(-1), **self.kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_combinations(reduction):
    """ignore_index (default, 0, -1, 3) x label_smoothing (0, 0.1), with two targets ignored and with every
    target ignored (mean: eager's 0 / 0 is NaN): rewritten, eager's results."""
    x = R(2, 5, 16)
    combinations = itertools.product((None, 0, -1, 3), (0.0, 0.1), (False, True))
    for ignore_index, smoothing, all_ignored in combinations:
        kwargs = dict(reduction=reduction, label_smoothing=smoothing)
        if ignore_index is not None:
            kwargs["ignore_index"] = ignore_index
        ignored = -100 if ignore_index is None else ignore_index
        y = torch.randint(0, 11, (2, 5))
        y[0, :2] = ignored
        if all_ignored:
            y[:] = ignored
        model = _LinearCE(**kwargs)
        for train in (True, False):
            model.train(train)
            torch._dynamo.reset()
            counters.clear()
            got = _run(torch.compile(model, backend=rewrite_only_backend, fullgraph=True), (x, y), train)
            expected = _run(model, (x, y), train)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, **TOL, equal_nan=True, msg=lambda m, k=kwargs: f"{k}: {m}")
            assert counters["flash"]["cross_entropy"] == 1, (kwargs, dict(counters["flash"]))
