"""Review (session 27) of fx_passes/attention on attention masks written the ways real code writes them:
transformers' padding masks (``(1 - m[:, None, None, :]) * finfo.min``, ``.unsqueeze(1).unsqueeze(2)``,
``.view(B, 1, 1, S)``, ``masked_fill(m == 0, -inf)`` on an int mask, ``where(m, s, -inf)``, the fill first),
masks added before the scale, GPT-2's causal buffer with a padding mask, fairseq's key padding mask on the
(B·H) scores, nn.MultiheadAttention's key_padding_mask / attn_mask (bool, float, 3-d, constant), learned
biases that take gradients, masks built in place, and masks that are not masks.

Every case runs through dynamo + the passes (the rewritten graph as plain PyTorch, the flash op on its CPU
reference) in training (outputs, input and parameter gradients) and in eval, fp32 (bf16 where it says so),
random inputs at odd sizes, and asserts whether it was rewritten or left alone (with the reason reported).

Fixes (each case failed before):
- A number added to or subtracted from every score was taken as a shift that softmax ignores whatever it
  was: ``s + float("-inf")`` and ``s - nan`` (eager: NaN everywhere) and ``s - 1e9`` (eager: the scores
  rounded away, the average of v) were rewritten into plain attention. Only a finite shift below 1e4 in
  magnitude is now dropped; others are left alone, reported.
- nn.MultiheadAttention with a constant attn_mask that leaves a query row without a key (a causal mask one
  off, ``triu(diagonal=0)``) was rewritten: with need_weights (the default) eager gives NaN there (-inf or
  bool masks) where the op gives 0, and with a finfo.min fill SDPA's CPU backward differs. The softmax and
  SDPA paths refused such constant masks already; the MHA path now does too.
- A constant mask built in place was taken for a runtime mask, so a dead row in it was not seen (and a
  causal one was passed as a mask rather than is_causal): ``torch.full(..).triu_(0)`` chained, ``m =
  torch.full(..); m.triu_(1)`` or ``m[2] = -inf`` as statements, and F._canonical_mask's
  ``zeros_like(m).masked_fill_(m, -inf)`` inside MultiheadAttention. _const_eval now evaluates in-place
  writes into a fresh tensor when every reader comes after them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_pass_forms_review_s27 import (  # noqa: F401  (_cold_inductor_cache: an autouse fixture)
    Fn,
    _check,
    _cold_inductor_cache,
)

B, H, S, D = 2, 3, 7, 16
SQ = 5
SCALE = D**-0.5
TOL = dict(atol=3e-5, rtol=3e-5)
MIN = torch.finfo(torch.float32).min


def _qkv(dtype=torch.float32, sq=S, sk=S):
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, s, D, dtype=dtype) for s in (sq, sk, sk))


def _pad(sk=S):
    """transformers' attention_mask: int64, 1 = token, 0 = padding (every row keeps a key)."""
    m = torch.ones(B, sk, dtype=torch.long)
    m[1, -3:] = 0
    m[0, -1] = 0
    return m


def _s(q, k):
    return q @ k.transpose(-1, -2)


# --------------------------------------------------------------------------------------------------------
# Rewritten: the same function, eager's numbers
# --------------------------------------------------------------------------------------------------------


def _hf_extended_none_none(q, k, v, m):
    ext = (1.0 - m[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(_s(q, k) / math.sqrt(D) + ext, -1) @ v


def _hf_extended_unsqueeze_1e4(q, k, v, m):
    ext = (1.0 - m.unsqueeze(1).unsqueeze(2).to(q.dtype)) * -10000.0
    return torch.softmax(_s(q, k) / math.sqrt(D) + ext, -1) @ v


def _hf_extended_view_first(q, k, v, m):
    """The mask as the first operand of the add, the scale on the left."""
    ext = (1.0 - m.view(B, 1, 1, -1).to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(ext + SCALE * _s(q, k), -1) @ v


def _hf_expand_mask(q, k, v, m):
    """transformers' _expand_mask: (B, 1, Sq, Sk) inverted, then masked_fill with finfo.min."""
    inv = 1.0 - m[:, None, None, :].expand(B, 1, q.shape[-2], k.shape[-2]).to(q.dtype)
    inv = inv.masked_fill(inv.to(torch.bool), torch.finfo(q.dtype).min)
    return torch.softmax(_s(q, k) * SCALE + inv, -1) @ v


def _masked_fill_int_eq0(q, k, v, m):
    return torch.softmax((_s(q, k) * SCALE).masked_fill(m[:, None, None, :] == 0, float("-inf")), -1) @ v


def _where_fill_first(q, k, v, m):
    return torch.softmax(torch.where(m[:, None, None, :] == 0, MIN, _s(q, k) * SCALE), -1) @ v


def _where_mask_before_scale(q, k, v, m):
    """(s + mask) / sqrt(d) with a mask of 0 and -1e9 only: s / sqrt(d) + mask, exactly where it counts."""
    ext = torch.where(m[:, None, None, :].bool(), 0.0, -1e9)
    return torch.softmax((_s(q, k) + ext) / math.sqrt(D), -1) @ v


def _gpt2_buffer_and_padding(q, k, v, m):
    """GPT-2: where(causal, w, finfo.min) and then the extended padding mask added."""
    w = _s(q, k) / (v.size(-1) ** 0.5)
    n = q.shape[-2]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
    w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
    w = w + (1.0 - m[:, None, None, :].to(w.dtype)) * torch.finfo(w.dtype).min
    return torch.softmax(w, -1).type(v.dtype) @ v


def _fairseq_key_padding(q, k, v, pad):
    """fairseq: (B·H) scores viewed to (B, H, S, S) for masked_fill(key_padding_mask), and back."""
    b, h, s, d = q.shape
    w = torch.bmm(q.reshape(b * h, s, d) * SCALE, k.reshape(b * h, s, d).transpose(1, 2)).view(b, h, s, s)
    w = w.masked_fill(pad.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")).view(b * h, s, s)
    return torch.bmm(torch.softmax(w, -1), v.reshape(b * h, s, d)).view(b, h, s, d)


def _bmm_mask_repeat_interleave(q, k, v, m):
    b, h, s, d = q.shape
    keep = m.bool()[:, None, :].repeat_interleave(h, 0)  # (B·H, 1, S)
    w = torch.bmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2)) * SCALE
    w = w.masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.bmm(torch.softmax(w, -1), v.reshape(b * h, s, d)).view(b, h, s, d)


def _causal_plus_padding_one_mask(q, k, v, m):
    n = q.shape[-2]
    causal = torch.triu(torch.full((n, n), torch.finfo(q.dtype).min), 1)
    ext = (1.0 - m[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(_s(q, k) * SCALE + (causal + ext), -1) @ v


def _mask_from_recomputed_scores(q, k, v):
    """A mask computed from q·kᵀ written out again (not the scores node): a runtime mask like any other."""
    keep = (q @ k.transpose(-1, -2)) > -1.0
    return torch.softmax((_s(q, k) * SCALE).masked_fill(~keep, -1e9), -1) @ v


def _learned_bias(q, k, v, bias):
    return torch.softmax(_s(q, k) * SCALE + bias, -1) @ v


def _bias_from_q_and_k(q, k, v):
    """An additive bias that depends on q and k (and so takes their gradients through the op's dbias)."""
    bias = F.logsigmoid(q.sum(-1, keepdim=True) * k.sum(-1)[:, :, None, :])
    return torch.softmax(_s(q, k) * SCALE + bias, -1) @ v


def _fp64_mask(q, k, v, m):
    ext = (1.0 - m[:, None, None, :].double()) * -1e4
    return torch.softmax(_s(q, k) * SCALE + ext, -1).to(q.dtype) @ v


def _statement_built_causal(q, k, v):
    """A causal mask built by statements: a constant, folded into is_causal."""
    n = q.shape[-2]
    mask = torch.full((n, n), float("-inf"))
    mask.triu_(1)
    return torch.softmax(_s(q, k) * SCALE + mask, -1) @ v


def _setitem_built_mask(q, k, v):
    n = q.shape[-2]
    mask = torch.full((n, n), float("-inf"))
    mask[:, :3] = 0.0  # a visible prefix for every query
    return torch.softmax(_s(q, k) * SCALE + mask, -1) @ v


def _view_taken_before_the_write(q, k, v):
    """A view of the mask read after a write into it: evaluated with the write (s29: a runtime mask before),
    and causal: is_causal."""
    n = q.shape[-2]
    mask = torch.full((n, n), float("-inf"))
    early = mask[None]
    mask.triu_(1)
    return torch.softmax(_s(q, k) * SCALE + early, -1) @ v


def _int_additive(q, k, v, m):
    """An int64 additive mask (the tokenizer's dtype, no cast): eager promotes it to the scores' dtype, and
    the rewrite passes the op that conversion (a near miss until session 28)."""
    return torch.softmax(_s(q, k) * SCALE + (1 - m[:, None, None, :]) * -10000, -1) @ v


SAME = {
    # name: (fn, extra inputs, text in the rewrite's details)
    "hf_extended_none_none_finfo_min": (_hf_extended_none_none, lambda: (_pad(),), "mask [2, 1, 1, 7]"),
    "hf_extended_unsqueeze_1e4": (_hf_extended_unsqueeze_1e4, lambda: (_pad(),), "mask [2, 1, 1, 7]"),
    "hf_extended_view_mask_first": (_hf_extended_view_first, lambda: (_pad(),), "mask [2, 1, 1, 7]"),
    "hf_expand_mask_b1ss": (_hf_expand_mask, lambda: (_pad(),), "mask [2, 1, 7, 7]"),
    "masked_fill_int_mask_eq0": (_masked_fill_int_eq0, lambda: (_pad(),), "-inf fill"),
    "where_fill_first": (_where_fill_first, lambda: (_pad(),), "mask [2, 1, 1, 7]"),
    "where_mask_before_scale": (_where_mask_before_scale, lambda: (_pad(),), "scale=0.25"),
    "gpt2_causal_buffer_and_padding": (_gpt2_buffer_and_padding, lambda: (_pad(),), "causal"),
    "fairseq_key_padding_bh_view": (_fairseq_key_padding, lambda: (1 - _pad(),), "mask [2, 1, 1, 7]"),
    "bmm_mask_repeat_interleave": (_bmm_mask_repeat_interleave, lambda: (_pad(),), "mask [6, 1, 7]"),
    "causal_plus_padding_one_mask": (_causal_plus_padding_one_mask, lambda: (_pad(),), "mask [2, 1, 7, 7]"),
    "mask_from_recomputed_scores": (_mask_from_recomputed_scores, lambda: (), "mask [2, 3, 7, 7]"),
    "learned_bias_hss": (_learned_bias, lambda: (torch.randn(H, S, S),), "mask [3, 7, 7]"),
    # rewritten since session 28 (the mask converted to the scores' dtype, as eager's promotion does)
    "int_additive_mask": (_int_additive, lambda: (_pad(),), "mask [2, 1, 1, 7]"),
    "learned_bias_per_key": (_learned_bias, lambda: (torch.randn(S),), "mask [7]"),
    "learned_bias_b1ss": (_learned_bias, lambda: (torch.randn(B, 1, S, S),), "mask [2, 1, 7, 7]"),
    "bias_from_q_and_k": (_bias_from_q_and_k, lambda: (), "mask [2, 3, 7, 7]"),
    "fp64_mask": (_fp64_mask, lambda: (_pad(),), "mask [2, 1, 1, 7]"),
    "statement_built_causal_is_causal": (_statement_built_causal, lambda: (), "causal"),
    "setitem_built_mask": (_setitem_built_mask, lambda: (), "mask [7, 7]"),
    "view_taken_before_the_write": (_view_taken_before_the_write, lambda: (), "causal"),
}


@pytest.mark.parametrize("case", SAME)
def test_masks_are_rewritten(case):
    fn, extra, text = SAME[case]
    _check(fn, (*_qkv(), *extra()), rewrites=1, text=text)


def _bf16_padding(q, k, v, m):
    s = _s(q, k) * SCALE + ((1.0 - m[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min)
    return torch.softmax(s, -1, dtype=torch.float32).to(q.dtype) @ v


def test_bf16_padding_mask_is_rewritten():
    _check(_bf16_padding, (*_qkv(torch.bfloat16), _pad()), rewrites=1, tol=dict(atol=2e-2, rtol=2e-2))


# --------------------------------------------------------------------------------------------------------
# Left alone: another function, or one not proven the same
# --------------------------------------------------------------------------------------------------------


def _mask_before_scale_1e4(q, k, v, m):
    """-1e4 scaled by 1/4 is -2500: still a mask in eager, but not provably one (a real bias would be scaled
    too)."""
    ext = (1.0 - m[:, None, None, :].to(q.dtype)) * -10000.0
    return torch.softmax((_s(q, k) + ext) / math.sqrt(D), -1) @ v


def _bias_before_scale(q, k, v, bias):
    return torch.softmax((_s(q, k) + bias) * SCALE, -1) @ v


def _multiplied_key_mask(q, k, v, m):
    mm = m[:, None, None, :].to(q.dtype)
    return torch.softmax(_s(q, k) * SCALE * mm + (1.0 - mm) * -1e9, -1) @ v


def _renormalised_after_softmax(q, k, v, m):
    p = torch.softmax(_s(q, k) * SCALE, -1) * m[:, None, None, :]
    return (p / p.sum(-1, keepdim=True)) @ v


def _mask_from_the_scores(q, k, v):
    s = _s(q, k) * SCALE
    return torch.softmax(s.masked_fill(s < 0, float("-inf")), -1) @ v


OTHER = {
    # name: (fn, extra inputs, near misses, reason)
    "mask_before_scale_1e4": (_mask_before_scale_1e4, lambda: (_pad(),), 1, "scaled after an additive mask"),
    "bias_before_scale": (_bias_before_scale, lambda: (torch.randn(H, S, S),), 1, "scaled after an additive"),
    "multiplied_key_mask": (_multiplied_key_mask, lambda: (_pad(),), 1, "scores are scaled by"),
    "renormalised_after_softmax": (_renormalised_after_softmax, lambda: (_pad().float(),), 1,
                                   "not to a matmul with v"),
    "mask_from_the_scores": (_mask_from_the_scores, lambda: (), 1, "other users"),
}


@pytest.mark.parametrize("case", OTHER)
def test_other_functions_are_left_alone(case):
    fn, extra, skipped, reason = OTHER[case]
    _check(fn, (*_qkv(), *extra()), rewrites=0, skipped=skipped, reason=reason)


# --------------------------------------------------------------------------------------------------------
# Fixed: a constant "shift" that is not one
# --------------------------------------------------------------------------------------------------------


SHIFTS = {
    "plus_minus_inf": lambda q, k, v: torch.softmax(_s(q, k) * SCALE + float("-inf"), -1) @ v,
    "minus_nan": lambda q, k, v: torch.softmax(_s(q, k) * SCALE - float("nan"), -1) @ v,
    "minus_1e9": lambda q, k, v: torch.softmax(_s(q, k) * SCALE - 1e9, -1) @ v,
    "plus_inf_before_scale": lambda q, k, v: torch.softmax((_s(q, k) + float("inf")) * SCALE, -1) @ v,
}


@pytest.mark.parametrize("case", SHIFTS)
def test_non_finite_or_huge_shift_is_left_alone(case):
    """Was rewritten into plain attention: eager gives NaN (or the average of v) on every row."""
    _check(SHIFTS[case], _qkv(), rewrites=0, skipped=1, reason="not a small finite constant")


def test_small_shift_is_still_dropped():
    _check(lambda q, k, v: torch.softmax(_s(q, k) * SCALE - 3.5, -1) @ v, _qkv(), rewrites=1)


# --------------------------------------------------------------------------------------------------------
# Fixed: constant masks built in place, with a row that sees no key
# --------------------------------------------------------------------------------------------------------


def _chained_triu_dead(q, k, v):
    n = q.shape[-2]
    return torch.softmax(_s(q, k) * SCALE + torch.full((n, n), float("-inf")).triu_(0), -1) @ v


def _statement_triu_dead(q, k, v):
    n = q.shape[-2]
    mask = torch.full((n, n), MIN)
    mask.triu_(0)
    return torch.softmax(_s(q, k) * SCALE + mask, -1) @ v


def _setitem_dead(q, k, v):
    n = q.shape[-2]
    mask = torch.zeros(n, n)
    mask[2] = float("-inf")
    return torch.softmax(_s(q, k) * SCALE + mask, -1) @ v


@pytest.mark.parametrize("fn", [_chained_triu_dead, _statement_triu_dead, _setitem_dead])
def test_constant_mask_built_in_place_with_a_dead_row_is_left_alone(fn):
    _check(fn, _qkv(), rewrites=0, skipped=1, reason="no visible key for every input")


# --------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: masks of every kind; fixed: a constant mask with a dead row
# --------------------------------------------------------------------------------------------------------

E, MH = 32, 2


class MHA(nn.Module):
    """MultiheadAttention (L, N, E) with a mask built in forward (`kind`) or passed in."""

    def __init__(self, kind=None, need_weights=True):
        super().__init__()
        torch.manual_seed(1)
        self.mha = nn.MultiheadAttention(E, MH)
        self.kind, self.need_weights = kind, need_weights

    def forward(self, x, kpm=None, am=None):
        if kpm is not None and kpm.dim() == 3:  # an attn_mask passed alone
            kpm, am = None, kpm
        n = x.shape[0]
        if self.kind == "bool_causal":
            am = torch.ones(n, n, dtype=torch.bool).triu(1)
        elif self.kind == "float_dead_inf":
            am = torch.triu(torch.full((n, n), float("-inf")), diagonal=0)  # one off: row 0 sees nothing
        elif self.kind == "float_dead_min":
            am = torch.triu(torch.full((n, n), MIN), diagonal=0)
        elif self.kind == "bool_dead":
            am = torch.ones(n, n, dtype=torch.bool).triu(0)
        return self.mha(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=self.need_weights)[0]


def _x():
    torch.manual_seed(0)
    return torch.randn(S, B, E)


def _kpm():
    m = torch.zeros(B, S, dtype=torch.bool)
    m[1, -3:] = True
    return m


MHA_SAME = {
    "kpm_bool": (MHA(), lambda: (_x(), _kpm())),
    "kpm_float": (MHA(), lambda: (_x(), _kpm().float() * -1e9)),
    "attn_mask_3d_float_with_grad": (MHA(), lambda: (_x(), torch.randn(B * MH, S, S))),
    "attn_mask_3d_bool": (MHA(), lambda: (_x(), torch.rand(B * MH, S, S) > 0.8)),
    "kpm_and_attn_mask_bool": (MHA(), lambda: (_x(), _kpm(), torch.rand(S, S) > 0.8)),
    "constant_bool_causal": (MHA("bool_causal"), lambda: (_x(),)),
    "constant_bool_causal_kpm_no_weights": (MHA("bool_causal", need_weights=False), lambda: (_x(), _kpm())),
}


@pytest.mark.parametrize("case", MHA_SAME)
def test_multihead_attention_masks_are_rewritten(case):
    model, args = MHA_SAME[case]
    _check(model, args(), rewrites=1)


@pytest.mark.parametrize("kind", ["float_dead_inf", "float_dead_min", "bool_dead"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_constant_dead_row_is_left_alone(kind, need_weights):
    """Was rewritten: 0 on row 0, where eager gives NaN (need_weights, -inf or bool) or, for finfo.min
    without weights, SDPA's CPU gradients for that row."""
    _check(MHA(kind, need_weights), (_x(),), rewrites=0, skipped=1, reason="no visible key")
