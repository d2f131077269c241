"""Session 31: attention forms real code writes that fx_passes/attention did not recognise (README, "Still not
recognised"), now rewritten where they are provably eager's function, and reported as near misses where not.

- softmax written as ``torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))`` (any spelling of the
  logsumexp, the dim as -1 or the last index, by position or keyword);
- softmax written out with the reciprocal of its sum, ``e * (1 / e.sum(-1, keepdim=True))``,
  ``e * e.sum(-1, keepdim=True).reciprocal()``, ``torch.reciprocal(..) * e``, ``e * sum ** -1`` (the row max
  by every spelling ``e / e.sum(..)`` takes);
- old GPT-2 / OpenAI GPT / early Megatron multiplicative masking, ``w = w * b - 1e4 * (1 - b)``: a keep mask
  with fill -1e4 when b provably holds 0 and 1 only (a bool converted to float: the mask; a tril of ones
  built in the graph: the causal band). GPT-2's own registered float buffer is a graph input whose values
  are not known at compile time: left alone, reported;
- litgpt's GQA, k / v expanded to q's heads before the SDPA call (``k[:, :, None].expand(..).reshape(..)``,
  ``unsqueeze(2).expand(..).flatten(1, 2)``, repeat_interleave, one head expanded for multi-query): the op
  gets them un-repeated (enable_gqa). Heads tiled rather than repeated, or k written in place between its
  repeat and the call, are passed repeated (eager's values);
- DeepSeek-style attention, v's head dim (16) other than q's and k's (24), through every form above.

Each case runs through dynamo + the attention rewrite (test_attention_pass's helpers: the graph as plain
PyTorch, the flash op on its CPU reference), on odd sizes (S = 13), and is compared with eager, outputs and
gradients (inputs and parameters), in training and in eval, and under torch.no_grad.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_codebases_s30 import _rope
from test_attention_pass import (  # noqa: F401  (_cold_inductor_cache: an autouse fixture)
    _check_same,
    _cold_inductor_cache,
    _flash_nodes,
    _rewrites,
    _run_rewritten,
)
from test_attention_pass_styles import _assert_left_alone_and_reported

from fx_passes import collecting

B, H, G, S, D = 2, 4, 2, 13, 16
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _qkv(hkv=H, d=D, dv=None, s=S):
    return torch.randn(B, H, s, d), torch.randn(B, hkv, s, d), torch.randn(B, hkv, s, dv or d)


def _check_inference(fn, *args, rewrites=1):
    """fn rewritten under torch.no_grad matches eager; returns the flash_attention nodes."""
    with torch.no_grad():
        ref = fn(*args)
        with collecting() as report:
            out, graphs = _run_rewritten(fn, *args)
    assert _rewrites() == (rewrites, 0), str(report)
    torch.testing.assert_close(out, ref, **TOL)
    return _flash_nodes(graphs)


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))


def _causal_fill(s):
    n = s.size(-1)
    return s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


# --------------------------------------------------------------------------------------------------------
# 1. softmax as exp(s - logsumexp(s))
# --------------------------------------------------------------------------------------------------------


def _lse_keyword(q, k, v):
    s = _scores(q, k)
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)) @ v


def _lse_method_positional(q, k, v):
    s = _scores(q, k)
    return (s - s.logsumexp(-1, True)).exp() @ v


def _lse_last_positive_index(q, k, v):
    s = _scores(q, k)
    return torch.matmul(torch.exp(torch.sub(s, torch.logsumexp(s, 3, keepdim=True))), v)


def _lse_special_dim_list(q, k, v):
    s = _scores(q, k)
    return torch.exp(s - torch.special.logsumexp(s, dim=[-1], keepdim=True)) @ v


def _lse_expression_repeated(q, k, v):
    # dynamo records an expression as often as the source writes it: two q·kᵀ, proven the same
    return torch.exp(q @ k.mT * 0.25 - torch.logsumexp(q @ k.mT * 0.25, -1, keepdim=True)) @ v


def _lse_causal(q, k, v):
    s = _causal_fill(_scores(q, k))
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)) @ v


def _lse_padding(q, k, v, keep):
    s = _scores(q, k).masked_fill(~keep[:, None, None, :], torch.finfo(q.dtype).min)
    return torch.exp(s - s.logsumexp(-1, keepdim=True)) @ v


def _key_keep(pad=3):
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[-1, S - pad:] = False
    return keep




class BlockwiseReferenceAttention(nn.Module):
    """Attention as the references of blockwise / ring-attention code write it, the probabilities through
    the row logsumexp (which their kernels keep): the projections, scores, ``exp(s - lse)``, dropout, ·v."""

    def __init__(self, dim=32, heads=4, dropout=0.0, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        s = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        if self.causal:
            s = _causal_fill(s)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out = torch.einsum("bhij,bhjd->bhid", self.dropout(torch.exp(s - lse)), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_blockwise_reference_attention_through_logsumexp(training):
    (node,) = _check_same(BlockwiseReferenceAttention().train(training), torch.randn(B, S, 32))
    assert node.kwargs["is_causal"] is True


def _lse_over_queries(q, k, v):
    s = _scores(q, k)
    return torch.exp(s - torch.logsumexp(s, dim=-2, keepdim=True)) @ v


def _lse_without_keepdim(q, k, v):
    # (B, H, Sq) broadcasts against the key dim (runs since Sq == Sk == H)
    s = _scores(q, k)
    return torch.exp(s - torch.logsumexp(s, dim=-1)) @ v


def _lse_of_other_tensor(q, k, v):
    s = _scores(q, k)
    return torch.exp(s - torch.logsumexp(2 * s, dim=-1, keepdim=True)) @ v


def _lse_also_returned(q, k, v):
    s = _scores(q, k)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def _lse_sub_alpha(q, k, v):
    s = _scores(q, k)
    return torch.exp(torch.sub(s, torch.logsumexp(s, -1, keepdim=True), alpha=2)) @ v


LSE_LOOK_ALIKES = [
    (_lse_over_queries, "is not over the last (key) dim with keepdim=True"),
    (_lse_without_keepdim, "is not over the last (key) dim with keepdim=True"),
    (_lse_of_other_tensor, "not of the scores"),
    (_lse_also_returned, "has other users"),
    (_lse_sub_alpha, "subtracts the logsumexp with {'alpha': 2}"),
]


# --------------------------------------------------------------------------------------------------------
# 2. softmax written out with the reciprocal of its sum
# --------------------------------------------------------------------------------------------------------


def _shifted_exp(s):
    return torch.exp(s - s.amax(-1, keepdim=True))


def _recip_div_one(q, k, v):
    e = _shifted_exp(_scores(q, k))
    return (e * (1 / e.sum(-1, keepdim=True))) @ v


def _recip_method_max_values(q, k, v):
    s = _scores(q, k)
    e = (s - s.max(dim=-1, keepdim=True).values).exp()
    return torch.matmul(e * e.sum(dim=3, keepdim=True).reciprocal(), v)


def _recip_function_first_max_getitem(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - torch.max(s, -1, keepdim=True)[0].detach())
    return (torch.reciprocal(torch.sum(e, -1, keepdim=True)) * e) @ v


def _recip_pow(q, k, v):
    e = _shifted_exp(_causal_fill(_scores(q, k)))
    return (e * e.sum(-1, keepdim=True) ** -1) @ v


def _recip_expression_repeated(q, k, v):
    s = _scores(q, k)
    return (_shifted_exp(s) * (1.0 / _shifted_exp(s).sum(-1, keepdim=True))) @ v


SOFTMAX_FORMS = [  # (fn, extra inputs, causal)
    (_lse_keyword, (), False),
    (_lse_method_positional, (), False),
    (_lse_last_positive_index, (), False),
    (_lse_special_dim_list, (), False),
    (_lse_expression_repeated, (), False),
    (_lse_causal, (), True),
    (_lse_padding, (_key_keep(),), False),
    (_recip_div_one, (), False),
    (_recip_method_max_values, (), False),
    (_recip_function_first_max_getitem, (), False),
    (_recip_pow, (), True),
    (_recip_expression_repeated, (), False),
]


@pytest.mark.parametrize("fn, extra, causal", SOFTMAX_FORMS,
                         ids=[f.__name__.strip("_") for f, _, _ in SOFTMAX_FORMS])
def test_softmax_forms_are_rewritten(fn, extra, causal):
    (node,) = _check_same(fn, *_qkv(), *extra)
    assert node.kwargs["is_causal"] is causal
    _check_inference(fn, *_qkv(), *extra)


def _recip_sum_over_queries(q, k, v):
    e = _shifted_exp(_scores(q, k))
    return (e * (1 / e.sum(-2, keepdim=True))) @ v


def _recip_sum_without_keepdim(q, k, v):
    e = _shifted_exp(_scores(q, k))
    return (e * e.sum(-1).reciprocal()) @ v


def _recip_of_other_sum(q, k, v):
    s = _scores(q, k)
    e = _shifted_exp(s)
    return (e * (1 / torch.exp(s).sum(-1, keepdim=True))) @ v


def _recip_no_max(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s)
    return (e * (1 / e.sum(-1, keepdim=True))) @ v


def _recip_shared(q, k, v):
    e = _shifted_exp(_scores(q, k))
    r = 1 / e.sum(-1, keepdim=True)
    return (e * r) @ v, r


RECIPROCAL_LOOK_ALIKES = [
    (_recip_sum_over_queries, "not a sum over the last (key) dim with keepdim=True"),
    (_recip_sum_without_keepdim, "not a sum over the last (key) dim with keepdim=True"),
    (_recip_of_other_sum, "not the numerator"),
    (_recip_no_max, "without subtracting its row max"),
    (_recip_shared, "has other users"),
]


SOFTMAX_LOOK_ALIKES = LSE_LOOK_ALIKES + RECIPROCAL_LOOK_ALIKES


@pytest.mark.parametrize("fn, reason", SOFTMAX_LOOK_ALIKES,
                         ids=[f.__name__.strip("_") for f, _ in SOFTMAX_LOOK_ALIKES])
def test_softmax_form_look_alikes_are_left_alone(fn, reason):
    # heads, queries and keys alike, so that what broadcasts along the wrong dim still runs
    _assert_left_alone_and_reported(fn, tuple(torch.randn(1, 8, 8, 8) for _ in range(3)), reason)


# --------------------------------------------------------------------------------------------------------
# 3. old GPT-2 / OpenAI GPT / early Megatron multiplicative masking: w * b - 1e4 * (1 - b)
# --------------------------------------------------------------------------------------------------------


class OldGPT2Attention(nn.Module):
    """GPT-2's Attention as pytorch-pretrained-BERT / transformers 2.x wrote it: c_attn, split_heads with k
    permuted straight to kᵀ, ``_attn`` masking with ``w * b - 1e4 * (1 - b)``, nn.Softmax, dropout.

    mask: "float_buffer", GPT-2's own ``tril(ones)`` float buffer (a graph input: not provably 0 / 1);
    "bool_buffer", a bool tril buffer converted with ``.to(w.dtype)`` (a runtime 0 / 1 mask);
    "tril_in_forward", ``torch.tril(torch.ones(ns, ns))`` built in forward (a constant: the causal band);
    "openai_gpt", OpenAI GPT's ``w * b + -1e4 * (1 - b)`` on the bool buffer's ``.float()``."""

    def __init__(self, nx=32, n_ctx=24, n_head=4, mask="bool_buffer", attn_pdrop=0.0):
        super().__init__()
        self.n_head, self.split_size, self.mask = n_head, nx, mask
        tril = torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx)
        self.register_buffer("bias", tril if mask == "float_buffer" else tril.bool())
        self.c_attn, self.c_proj = nn.Linear(nx, 3 * nx), nn.Linear(nx, nx)
        self.attn_dropout = nn.Dropout(attn_pdrop)

    def _attn(self, q, k, v):
        w = torch.matmul(q, k)
        w = w / math.sqrt(v.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        if self.mask == "float_buffer":
            b = self.bias[:, :, ns - nd:ns, :ns]
        elif self.mask == "tril_in_forward":
            b = torch.tril(torch.ones(ns, ns, dtype=w.dtype, device=w.device)).view(1, 1, ns, ns)
            b = b[:, :, ns - nd:ns, :ns]
        elif self.mask == "openai_gpt":
            b = self.bias[:, :, :nd, :ns].float()
            return torch.matmul(self.attn_dropout(nn.Softmax(dim=-1)(w * b + -1e4 * (1 - b))), v)
        else:
            b = self.bias[:, :, ns - nd:ns, :ns].to(w.dtype)
        w = w * b - 1e4 * (1 - b)
        w = nn.Softmax(dim=-1)(w)
        w = self.attn_dropout(w)
        return torch.matmul(w, v)

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x):
        query, key, value = self.c_attn(x).split(self.split_size, dim=2)
        a = self._attn(self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value))
        a = a.permute(0, 2, 1, 3).contiguous()
        return self.c_proj(a.view(*a.size()[:-2], a.size(-2) * a.size(-1)))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mask, causal", [("bool_buffer", False), ("openai_gpt", False),
                                          ("tril_in_forward", True)])
def test_old_gpt2_multiplicative_mask_is_rewritten(mask, causal, training):
    module, x = OldGPT2Attention(mask=mask).train(training), torch.randn(B, S, 32)
    (node,) = _check_same(module, x)
    assert node.kwargs["is_causal"] is causal
    if not causal:  # the buffer's 0 / 1 values, as the bool mask the op takes
        assert node.kwargs["attn_mask"].meta["example_value"].dtype == torch.bool
    _check_inference(module, x)


def test_old_gpt2_float_buffer_is_left_alone_and_reported():
    # GPT-2 verbatim: its float buffer may hold anything at run time (w * b - 1e4 * (1 - b) is then no mask)
    module, x = OldGPT2Attention(mask="float_buffer"), torch.randn(B, S, 32)
    _assert_left_alone_and_reported(module, (x,), "a mask only where b holds 0 and 1 alone")


def test_old_gpt2_multiplicative_mask_under_dynamic_shapes():
    # the tril of ones is 0 / 1 by construction at any size (a mask of symbolic size, passed to the op)
    module = OldGPT2Attention(mask="tril_in_forward")
    for s in (13, 9):
        x = torch.randn(B, s, 32)
        out, _ = _run_rewritten(module, x, options={"dynamic": True})
        assert _rewrites() == (1, 0)
        torch.testing.assert_close(out, module(x), **TOL)


def _megatron_ltor(q, k, v):
    # early Megatron's gpt2 attention mask function on the left-to-right mask it builds from the sizes
    n = q.size(-2)
    ltor_mask = torch.tril(torch.ones((1, n, n), dtype=q.dtype, device=q.device)).view(1, 1, n, n)
    scores = torch.mul(_scores(q, k), ltor_mask) - 10000.0 * (1.0 - ltor_mask)
    return torch.matmul(F.softmax(scores, dim=-1), v)


def _keep_cast(q, k, v, keep):
    b = keep[:, None, None, :].type_as(q)
    return torch.softmax(b * _scores(q, k) - (1 - b) * 1e4, -1) @ v


def _gpt2_layer_past(q, k, v):
    # GPT-2's _attn with a layer_past: nd queries after ns - nd cached keys, the band's last nd rows
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
    nd, ns = w.size(-2), w.size(-1)
    b = torch.tril(torch.ones(ns, ns, dtype=w.dtype)).view(1, 1, ns, ns)[:, :, ns - nd:ns, :ns]
    return torch.matmul(torch.softmax(w * b - 1e4 * (1 - b), -1), v)


def test_multiplicative_mask_forms():
    (node,) = _check_same(_megatron_ltor, *_qkv())
    assert node.kwargs["is_causal"] is True
    q = torch.randn(B, H, 5, D)
    (node,) = _check_same(_gpt2_layer_past, q, *_qkv()[1:])
    assert node.kwargs["is_causal"] is True and node.kwargs["causal_alignment"] == "bottom_right"
    (node,) = _check_same(_keep_cast, *_qkv(), _key_keep())
    assert node.kwargs["attn_mask"].meta["example_value"].shape == (B, 1, 1, S)


def test_multiplicative_mask_in_bfloat16():
    # 1e4 is 9984 in bfloat16: what eager fills, still a masked value
    q, k, v = (t.bfloat16() for t in _qkv())
    (node,) = _check_same(_megatron_ltor, q, k, v, tol=dict(atol=2e-2, rtol=2e-2))
    assert node.kwargs["is_causal"] is True


def _float_mask_input(q, k, v, b):
    w = _scores(q, k)
    return torch.softmax(w * b - 1e4 * (1 - b), -1) @ v


def _half_tril(q, k, v):
    n = q.size(-2)
    b = torch.tril(torch.full((n, n), 0.5))
    return torch.softmax(_scores(q, k) * b - 1e4 * (1 - b), -1) @ v


def _two_masks(q, k, v):
    n = q.size(-2)
    b, b2 = torch.ones(n, n).tril(), torch.ones(n, n).tril(-1)
    return torch.softmax(_scores(q, k) * b - 1e4 * (1 - b2), -1) @ v


def _small_penalty(q, k, v):
    b = torch.ones(q.size(-2), q.size(-2)).tril()
    return torch.softmax(_scores(q, k) * b - 10 * (1 - b), -1) @ v


def _infinite_penalty(q, k, v):
    # inf * (1 - 1) is NaN: eager's scores are NaN everywhere
    b = torch.ones(q.size(-2), q.size(-2)).tril()
    return torch.softmax(_scores(q, k) * b - float("inf") * (1 - b), -1) @ v


def _scaled_after(q, k, v):
    b = torch.ones(q.size(-2), q.size(-2)).tril()
    return torch.softmax((q @ k.mT * b - 1e4 * (1 - b)) * 1e-3, -1) @ v


def _product_reused(q, k, v):
    b = torch.ones(q.size(-2), q.size(-2)).tril()
    wb = _scores(q, k) * b
    return torch.softmax(wb - 1e4 * (1 - b), -1) @ v, wb


def _additive_inside(q, k, v, am):
    b = torch.ones(q.size(-2), q.size(-2)).tril()
    return torch.softmax((_scores(q, k) + am) * b - 1e4 * (1 - b), -1) @ v


MULTIPLICATIVE_LOOK_ALIKES = [
    (_float_mask_input, (torch.ones(8, 8).tril(),), "a mask only where b holds 0 and 1 alone"),
    (_half_tril, (), "a mask only where b holds 0 and 1 alone"),
    (_two_masks, (), "not the same mask"),
    (_small_penalty, (), "not a finite large negative constant"),
    (_scaled_after, (), "is scaled by 0.001 afterwards"),
    (_product_reused, (), "has other users"),
    (_additive_inside, (torch.randn(1, 1, 1, 8),), "may leave -inf scores where b is 0"),
]


def _inf_fill_inside(q, k, v):
    # -inf * 0 where both mask: NaN on every row with a masked key
    n = q.size(-2)
    b = torch.ones(n, n).tril()
    s = _scores(q, k).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s * b - 1e4 * (1 - b), -1) @ v


@pytest.mark.parametrize("fn, reason", [(_infinite_penalty, "not a finite large negative constant"),
                                        (_inf_fill_inside, "may leave -inf scores where b is 0")],
                         ids=["infinite_penalty", "inf_fill_inside"])
def test_multiplicative_mask_eager_turns_into_nan_is_left_alone(fn, reason):
    # eager: NaN (inf * 0); the op, taking b as a keep mask, would be finite
    q, k, v = _qkv()
    with collecting() as report:
        out, _ = _run_rewritten(fn, q, k, v)
    assert _rewrites() == (0, 1) and reason in report.near_misses[0].detail, str(report)
    torch.testing.assert_close(out, fn(q, k, v), equal_nan=True)
    assert fn(q, k, v).isnan().any()


def _finite_fill_inside(q, k, v):
    n = q.size(-2)
    b = torch.ones(n, n).tril()
    s = _scores(q, k).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(2), -1e9)
    return torch.softmax(s * b - 1e4 * (1 - b), -1) @ v


def test_multiplicative_mask_over_a_finite_fill_is_rewritten():
    (node,) = _check_same(_finite_fill_inside, *_qkv())
    assert node.kwargs["is_causal"] is True  # the two constant bands together


@pytest.mark.parametrize("fn, extra, reason", MULTIPLICATIVE_LOOK_ALIKES,
                         ids=[f.__name__.strip("_") for f, _, _ in MULTIPLICATIVE_LOOK_ALIKES])
def test_multiplicative_mask_look_alikes_are_left_alone(fn, extra, reason):
    _assert_left_alone_and_reported(fn, (*(torch.randn(1, 8, 8, 8) for _ in range(3)), *extra), reason)


# --------------------------------------------------------------------------------------------------------
# 4. litgpt's GQA: k / v expanded to q's heads before F.scaled_dot_product_attention
# --------------------------------------------------------------------------------------------------------


class LitGPTGroupedAttention(nn.Module):
    """litgpt's CausalSelfAttention (after its qkv split became a split of the last dim): q, k, v viewed to
    (B, T, heads, hs) and transposed, partial rotary on q and k, then k and v expanded from n_query_groups
    to n_head heads before SDPA (with is_causal, or an explicit mask).

    repeat: "none_index" ``k[:, :, None].expand(B, groups, q_per_kv, T, hs).reshape(B, -1, T, hs)``;
    "unsqueeze_flatten" ``k.unsqueeze(2).expand(-1, -1, q_per_kv, -1, -1).flatten(1, 2)``;
    "repeat_interleave" ``k.repeat_interleave(q_per_kv, dim=1)``; "tiled" ``k[:, None].expand(B,
    q_per_kv, groups, ..)``, heads in another order (not GQA's pairing: passed repeated)."""

    def __init__(self, n_embd=32, n_head=4, n_query_groups=2, rope_n_elem=4, repeat="none_index"):
        super().__init__()
        self.n_head, self.groups, self.hs = n_head, n_query_groups, n_embd // n_head
        self.rope_n_elem, self.repeat = rope_n_elem, repeat
        self.qkv = nn.Linear(n_embd, (n_head + 2 * n_query_groups) * self.hs)
        self.proj = nn.Linear(n_embd, n_embd)

    def _expanded(self, t, q_per_kv):
        B, _, T, hs = t.shape
        if self.repeat == "none_index":
            return t[:, :, None].expand(B, self.groups, q_per_kv, T, hs).reshape(B, -1, T, hs)
        if self.repeat == "unsqueeze_flatten":
            return t.unsqueeze(2).expand(-1, -1, q_per_kv, -1, -1).flatten(1, 2)
        if self.repeat == "repeat_interleave":
            return t.repeat_interleave(q_per_kv, dim=1)
        if self.repeat == "mqa_expand":
            return t.expand(B, self.n_head, T, hs)
        return t[:, None].expand(B, q_per_kv, self.groups, T, hs).reshape(B, -1, T, hs)  # tiled

    def forward(self, x, mask=None):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split((self.n_head * self.hs, self.groups * self.hs, self.groups * self.hs), -1)
        q = q.view(B, T, self.n_head, self.hs).transpose(1, 2)
        k = k.view(B, T, self.groups, self.hs).transpose(1, 2)
        v = v.view(B, T, self.groups, self.hs).transpose(1, 2)
        n_elem = self.rope_n_elem
        theta = 1.0 / (10000 ** (torch.arange(0, n_elem, 2, device=x.device).float() / n_elem))
        idx_theta = torch.outer(torch.arange(T, device=x.device), theta).repeat(1, 2)
        cos, sin = torch.cos(idx_theta), torch.sin(idx_theta)
        q = torch.cat((_rope(q[..., :n_elem], cos, sin), q[..., n_elem:]), dim=-1)
        k = torch.cat((_rope(k[..., :n_elem], cos, sin), k[..., n_elem:]), dim=-1)
        if self.groups != self.n_head:
            q_per_kv = self.n_head // self.groups
            k, v = self._expanded(k, q_per_kv), self._expanded(v, q_per_kv)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                           scale=1.0 / math.sqrt(self.hs), is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def _kv_heads(node):
    return [a.meta["example_value"].shape[1] for a in node.args[1:3]]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("repeat, groups", [("none_index", 2), ("unsqueeze_flatten", 2),
                                            ("repeat_interleave", 2), ("mqa_expand", 1), ("none_index", 1)])
def test_litgpt_gqa_reaches_the_op_unrepeated(repeat, groups, training):
    module = LitGPTGroupedAttention(n_query_groups=groups, repeat=repeat).train(training)
    x = torch.randn(B, S, 32)
    with collecting() as report:
        (node,) = _check_same(module, x)
    assert node.kwargs["enable_gqa"] is True and _kv_heads(node) == [groups, groups]
    assert "gqa: k/v un-repeated" in report.rewrites[0].detail
    (node,) = _check_inference(module, x)
    assert _kv_heads(node) == [groups, groups]


def test_litgpt_gqa_with_an_explicit_mask():
    keep = torch.rand(B, 1, S, S) < 0.8
    keep[..., 0] = True
    (node,) = _check_same(LitGPTGroupedAttention(), torch.randn(B, S, 32), keep)
    assert _kv_heads(node) == [G, G] and node.kwargs["attn_mask"] is not None


def test_litgpt_gqa_under_dynamic_shapes():
    module = LitGPTGroupedAttention()
    for s in (13, 9):
        x = torch.randn(B, s, 32)
        out, graphs = _run_rewritten(module, x, options={"dynamic": True})
        assert _rewrites() == (1, 0)
        torch.testing.assert_close(out, module(x), **TOL)
        assert _kv_heads(_flash_nodes(graphs)[0]) == [G, G]


def _mqa_expanded(q, k, v):
    # one k / v head expanded to every query head, on the hand-written path
    k, v = k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1)
    return torch.softmax(_scores(q, k), -1) @ v


def test_hand_written_multi_query_expand_reaches_the_op_with_one_head():
    (node,) = _check_same(_mqa_expanded, *_qkv(hkv=1))
    assert node.kwargs["enable_gqa"] is True and _kv_heads(node) == [1, 1]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_tiled_heads_are_passed_repeated(training):
    # head r·G + g reads k head g (h % G), not h // q_per_kv: the same function only with k repeated
    with collecting() as report:
        (node,) = _check_same(LitGPTGroupedAttention(repeat="tiled").train(training), torch.randn(B, S, 32))
    assert node.kwargs["enable_gqa"] is False and _kv_heads(node) == [H, H]
    assert "un-repeated" not in report.rewrites[0].detail


def _repeat(t, n):
    b, g, s, d = t.shape
    return t[:, :, None].expand(b, g, n, s, d).reshape(b, g * n, s, d)


def _written_between(q, k, v):
    # the repeat copies k: eager's attention reads k before the write, the op given k itself would not
    k = k * 1
    kr, vr = _repeat(k, H // G), _repeat(v, H // G)
    k.mul_(2)
    return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)


def _k_and_v_repeated_differently(q, k, v):
    return F.scaled_dot_product_attention(q, _repeat(k, H // G), _repeat(v[:, :1], H), is_causal=True)


@pytest.mark.parametrize("fn", [_written_between, _k_and_v_repeated_differently])
def test_gqa_that_cannot_be_passed_unrepeated_is_passed_repeated(fn):
    (node,) = _check_same(fn, *_qkv(hkv=G))
    assert node.kwargs["enable_gqa"] is False and _kv_heads(node) == [H, H]


def _hand_written_written_between(q, k, v):
    k = k * 1
    kr, vr = _repeat(k, H // G), _repeat(v, H // G)
    k.mul_(2)
    return torch.softmax(_scores(q, kr), -1) @ vr


def test_hand_written_gqa_with_k_written_between_is_passed_repeated():
    # the same proof on the hand-written path (before: k un-repeated, read after the write)
    (node,) = _check_same(_hand_written_written_between, *_qkv(hkv=G))
    assert _kv_heads(node) == [H, H]


# --------------------------------------------------------------------------------------------------------
# DeepSeek-style attention: v's head dim (16) other than q's and k's (24)
# --------------------------------------------------------------------------------------------------------


class DeepSeekStyleAttention(nn.Module):
    """DeepSeek-V2's eager attention, small: q and k of a no-rope part (16) and a rotary part (8) whose k is
    one head shared by all (expanded), v of head dim 16; softmax_scale on q·kᵀ, F.softmax in fp32 and back,
    or SDPA with scale=; the output's v-sized heads projected back."""

    def __init__(self, dim=32, heads=4, nope=16, rope=8, v_dim=16, sdpa=False):
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.sdpa = heads, nope, rope, v_dim, sdpa
        self.softmax_scale = (nope + rope) ** -0.5
        self.q_proj = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.kv_proj = nn.Linear(dim, heads * (nope + v_dim) + rope, bias=False)
        self.o_proj = nn.Linear(heads * v_dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        kv, k_pe = torch.split(self.kv_proj(x), [self.heads * (self.nope + self.v_dim), self.rope], dim=-1)
        kv = kv.view(b, n, self.heads, -1).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.view(b, n, 1, self.rope).transpose(1, 2)
        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(-1, self.heads, -1, -1)], dim=-1)
        if self.sdpa:
            out = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True,
                                                 scale=self.softmax_scale)
        else:
            w = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
            w = w + torch.full((n, n), float("-inf"), device=x.device).triu(1)
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(query_states.dtype)
            out = torch.matmul(w, value_states)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("sdpa", [False, True], ids=["eager_attention", "sdpa"])
def test_deepseek_v_head_dim_other_than_q_k(sdpa, training):
    (node,) = _check_same(DeepSeekStyleAttention(sdpa=sdpa).train(training), torch.randn(B, S, 32))
    q, k, v = (a.meta["example_value"] for a in node.args[:3])
    assert q.shape[-1] == k.shape[-1] == 24 and v.shape[-1] == 16 and node.kwargs["is_causal"] is True


def _gqa_sdpa_small_v(q, k, v):
    return F.scaled_dot_product_attention(q, _repeat(k, H // G), _repeat(v, H // G), is_causal=True)


def _gqa_multiplicative(q, k, v):
    kr, vr = _repeat(k, H // G), _repeat(v, H // G)
    n = q.size(-2)
    b = torch.ones(n, n).tril()
    return torch.softmax(_scores(q, kr) * b - 1e4 * (1 - b), -1) @ vr


@pytest.mark.parametrize("fn, gqa", [(_lse_causal, False), (_recip_pow, False), (_megatron_ltor, False),
                                     (_gqa_sdpa_small_v, True), (_gqa_multiplicative, True)])
def test_new_forms_with_v_head_dim_other_than_q_k(fn, gqa):
    # (the default scale is 1/√24, q's head dim, in eager and in the op)
    (node,) = _check_same(fn, *_qkv(hkv=G if gqa else H, d=24, dv=16))
    assert node.args[2].meta["example_value"].shape[-1] == 16
    assert _kv_heads(node) == ([G, G] if gqa else [H, H])
