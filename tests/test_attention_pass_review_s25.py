"""Review (session 25) of fx_passes/attention on attention styles of real models at odd sizes (Sq=37, Sk=45,
head_dim 40), and three fixes.

Fixes (each case failed before):
- A NaN fill, ``scores.masked_fill(m, nan)`` or ``torch.where(m, scores, nan)``, passed the "large negative"
  check (NaN compares False with -1e4) and was taken as -inf: eager's rows are NaN, the op's were finite.
  It is now left alone, reported.
- ``torch.baddbmm(..., alpha=nan)`` folded a NaN scale into the op, whose gradients differ from eager's.
  A non-finite alpha is now left alone, reported (a negative one is still a scale of the product only).
- Under dynamic shapes a compile-time constant mask is built from symbolic sizes and was not evaluated,
  so session 24's check of rows with no visible key (a causal band off by one, a bottom-right band with
  Sq > Sk) was skipped and the pattern rewritten into another function. The mask is now evaluated at the
  example's sizes: a dead row there leaves the pattern alone, reported.

Styles that are rewritten and give eager's outputs and gradients (inputs, learned biases, parameters):
T5 (no 1/sqrt(d), a learned relative position bias from an embedding shared by two layers, a padding mask
added to it), ALiBi from arange with a causal triu(full(-inf), 1) mask, BLOOM's baddbmm with an alibi from
the attention mask's cumsum, Falcon's fp32 upcast of q and k, GPT-J (fp32 scores, where(causal, w,
finfo.min), a tensor sqrt(d) divisor, an extended mask), MPT (k permuted straight into kᵀ, alibi, key
padding masked_fill, a bottom-right causal band), Llama's repeat_kv with SDPA is_causal for Sq < Sk,
tiled (not interleaved) k/v repeats, cross-attention with (1 - m) * finfo.min including a fully padded
sample, masked_fill with True = masked or True = keep and -inf / -1e9 / -10000 fills, GPT-2's
where(bias, w, mask_value) with 0-d tensor scale and fill, scales on kᵀ and split over q and k in an
einsum. Styles that compute another function and are left alone (reported where the pass saw a
candidate): BERT's head_mask on the probabilities, an extra op on the probabilities, the probabilities
or the scores returned too, a division after the softmax, talking-heads mixing of the scores or the
probabilities. GPT-2's original `w * b - 1e4 * (1 - b)` masking, left alone here until session 31, is
rewritten where b is provably 0 / 1 (test_gpt2_original_multiplicative_mask_is_rewritten below;
tests/test_attention_pass_forms_s31.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_pass import _check_same, _flash_nodes, _rewrites, _run_rewritten

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

B, H, SQ, SK, D = 2, 3, 37, 45, 40
TOL = dict(atol=3e-5, rtol=3e-5)
SCALE = D**-0.5


def _qkv(sq=SQ, sk=SK, h=H, hkv=None):
    torch.manual_seed(0)
    hkv = hkv or h
    return torch.randn(B, h, sq, D), torch.randn(B, hkv, sk, D), torch.randn(B, hkv, sk, D)


def _keep_keys(sk=SK, padded=5):
    """(B, Sk) bool attention mask: the second sample's last keys are padding."""
    keep = torch.ones(B, sk, dtype=torch.bool)
    keep[1, -padded:] = False
    return keep


def _slopes(h=H):
    return torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])


def _report(fn, args, dynamic=None):
    torch._dynamo.reset()
    counters.clear()
    return flash_backend.explain(fn, *args, print_report=False, dynamic=dynamic)


def _assert_left_alone(fn, args, reason=None, dynamic=None):
    """No rewrite; with a reason, one attention near miss naming it; eager's numbers (NaN where eager has)."""
    report = _report(fn, args, dynamic)
    near = [d for d in report.near_misses if d.family == "attention"]
    if reason is None:
        assert _rewrites()[0] == 0, report
    else:
        assert _rewrites() == (0, 1), report
        (decision,) = near
        assert reason in decision.detail, decision.line()
    torch._dynamo.reset()
    got = torch.compile(fn, backend=rewrite_only_backend, dynamic=dynamic)(*args)
    want = fn(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        torch.testing.assert_close(g, w, equal_nan=True)


# --------------------------------------------------------------------------------------------------------
# Fixed: NaN fills and a NaN baddbmm alpha are no mask and no scale
# --------------------------------------------------------------------------------------------------------


def _scores(q, k):
    return q @ k.transpose(-1, -2) * SCALE


def _masked_fill_nan(q, k, v, keep):
    return _scores(q, k).masked_fill(~keep, float("nan")).softmax(-1) @ v


def _where_nan(q, k, v, keep):
    return torch.where(keep, _scores(q, k), float("nan")).softmax(-1) @ v


def _where_full_like_nan(q, k, v, keep):
    s = _scores(q, k)
    return torch.where(keep, s, torch.full_like(s, float("nan"))).softmax(-1) @ v


def _masked_fill_nan_tensor(q, k, v, keep):
    return _scores(q, k).masked_fill(~keep, torch.tensor(float("nan"))).softmax(-1) @ v


@pytest.mark.parametrize("fn", [_masked_fill_nan, _where_nan, _where_full_like_nan, _masked_fill_nan_tensor])
def test_nan_fill_is_not_a_mask(fn):
    keep = _keep_keys()[:, None, None, :]
    _assert_left_alone(fn, (*_qkv(), keep), "is not -inf or a large negative constant")


def _baddbmm(q, k, v, alpha, bias=None):
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    bias = torch.zeros(b * h, sq, sk) if bias is None else bias
    s = torch.baddbmm(bias, q.reshape(b * h, sq, d), k.reshape(b * h, sk, d).transpose(1, 2), alpha=alpha)
    return torch.bmm(s.softmax(-1), v.reshape(b * h, sk, d)).view(b, h, sq, d)


def test_baddbmm_nan_alpha_is_left_alone():
    _assert_left_alone(lambda q, k, v: _baddbmm(q, k, v, float("nan")), _qkv(), "alpha=nan is not a finite")


def test_baddbmm_negative_alpha_scales_the_product_only():
    # beta·input + alpha·q·kᵀ: a negative alpha does not reach the (masked) input
    bias = torch.zeros(B * H, 1, SK).masked_fill(~_keep_keys().repeat_interleave(H, 0)[:, None], -1e9)
    _check_same(lambda q, k, v, m: _baddbmm(q, k, v, -0.2, m), *_qkv(), bias, tol=TOL)


# --------------------------------------------------------------------------------------------------------
# Fixed: constant masks with a dead row under dynamic shapes
# --------------------------------------------------------------------------------------------------------


def _strictly_causal_minus_inf(q, k, v):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(diagonal=-1)
    return torch.softmax(_scores(q, k).masked_fill(~keep, float("-inf")), -1) @ v


def _strictly_causal_finfo_min(q, k, v):
    # the fill spelled in the function: a float closed over becomes a symbolic input under dynamic=True
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(diagonal=-1)
    return torch.softmax(_scores(q, k).masked_fill(~keep, torch.finfo(q.dtype).min), -1) @ v


def _bottom_right_band(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return torch.softmax(_scores(q, k).masked_fill(~keep, torch.finfo(q.dtype).min), -1) @ v


def _strictly_causal_and_padding(q, k, v, pad):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(diagonal=-1)[None, None] & pad[:, None, None, :]
    return torch.softmax(_scores(q, k) + torch.where(keep, 0.0, torch.finfo(q.dtype).min), -1) @ v


DYNAMIC_DEAD_ROWS = {
    "strictly_causal_minus_inf": (_strictly_causal_minus_inf, lambda: _qkv(sq=SK)),
    "strictly_causal_finfo_min": (_strictly_causal_finfo_min, lambda: _qkv(sq=SK)),
    "bottom_right_sq_gt_sk": (_bottom_right_band, lambda: _qkv(sq=SK, sk=SQ)),
    "strictly_causal_and_padding": (_strictly_causal_and_padding, lambda: (*_qkv(sq=SK), _keep_keys())),
}


@pytest.mark.parametrize("case", DYNAMIC_DEAD_ROWS)
def test_constant_mask_with_a_dead_row_under_dynamic_shapes_is_left_alone(case):
    fn, args = DYNAMIC_DEAD_ROWS[case]
    _assert_left_alone(fn, args(), "no visible key for every input of the example's sizes", dynamic=True)


def _causal_and_padding(q, k, v, pad):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
    return torch.softmax(_scores(q, k) + torch.where(keep, 0.0, torch.finfo(q.dtype).min), -1) @ v


@pytest.mark.parametrize("fn, args", [
    (_causal_and_padding, lambda: (*_qkv(sq=SK), _keep_keys())),
    (_bottom_right_band, lambda: _qkv()),  # Sq < Sk: every row keeps a key
])
def test_constant_mask_without_a_dead_row_under_dynamic_shapes_is_rewritten(fn, args):
    _check_same(fn, *args(), options=dict(dynamic=True), tol=TOL)


# --------------------------------------------------------------------------------------------------------
# Real-model styles that are rewritten
# --------------------------------------------------------------------------------------------------------


class T5StyleStack(nn.Module):
    """T5: no 1/sqrt(d), a learned relative position bias (an embedding of clamped relative positions,
    (1, H, S, S)) computed once and shared by every layer, the padding mask added to it, fp32 softmax
    cast back with type_as, dropout on the probabilities."""

    def __init__(self, layers=2, dropout=0.0):
        super().__init__()
        self.rel = nn.Embedding(32, H)
        self.qkv = nn.ModuleList(nn.Linear(H * D, 3 * H * D, bias=False) for _ in range(layers))
        self.dropout = dropout

    def forward(self, x, keep):
        b, n, _ = x.shape
        buckets = (torch.arange(n)[None] - torch.arange(n)[:, None]).clamp(-15, 16) + 15
        position_bias = self.rel(buckets).permute(2, 0, 1).unsqueeze(0)
        position_bias = position_bias + (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for proj in self.qkv:
            q, k, v = proj(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
            scores = torch.matmul(q, k.transpose(3, 2))
            scores += position_bias
            w = F.softmax(scores.float(), dim=-1).type_as(scores)
            w = F.dropout(w, p=self.dropout, training=self.training)
            x = x + torch.matmul(w, v).transpose(1, 2).reshape(b, n, H * D)
        return x


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_t5_shared_learned_position_bias(training):
    torch.manual_seed(0)
    model = T5StyleStack(dropout=0.0 if training else 0.1).train(training)
    x = torch.randn(B, SK, H * D)
    nodes = _check_same(model, x, _keep_keys(), rewrites=2, tol=dict(atol=1e-4, rtol=1e-4))
    assert all(n.kwargs.get("dropout_p", 0.0) == 0.0 for n in nodes)


def _t5_bias(q, k, v, bias):
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(3, 2)) + bias, dim=-1), v)


def _alibi_causal(q, k, v):
    # ALiBi: a per-head slope times the key position (arange), and a top-left causal triu(full(-inf), 1)
    sq, sk = q.shape[-2], k.shape[-2]
    alibi = _slopes()[:, None, None] * torch.arange(sk)[None, None, :]
    causal = torch.triu(torch.full((sq, sk), float("-inf")), diagonal=1)
    return (q @ k.transpose(-2, -1) * SCALE + alibi + causal).softmax(-1) @ v


def _bloom(q, k, v, am):
    # BLOOM: alibi from the attention mask's cumsum as baddbmm's input, alpha = inv_norm_factor, causal
    # (bottom-right) | padding masked_fill with finfo.min, fp32 softmax cast back
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    positions = ((am.cumsum(-1) - 1) * am)[:, None, :].to(q.dtype)
    alibi = (_slopes(h)[None, :, None] * positions).reshape(b * h, 1, sk)
    s = alibi.baddbmm(batch1=q.reshape(b * h, sq, d), batch2=k.reshape(b * h, sk, d).transpose(-1, -2),
                      beta=1.0, alpha=1.0 / math.sqrt(d)).view(b, h, sq, sk)
    masked = torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq)[None, None] | ~am.bool()[:, None, None, :]
    p = F.softmax(torch.masked_fill(s, masked, torch.finfo(s.dtype).min), dim=-1, dtype=torch.float32)
    return torch.bmm(p.to(q.dtype).view(b * h, sq, sk), v.reshape(b * h, sk, d)).view(b, h, sq, d)


def _falcon_upcast_qk(q, k, v):
    return F.softmax((q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D), dim=-1).to(q.dtype) @ v


def _gptj(q, k, v, ext):
    sq, sk = q.shape[-2], k.shape[-2]
    causal = torch.tril(torch.ones(sk, sk, dtype=torch.bool))[None, None, sk - sq:sk, :sk]
    w = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
    w = torch.where(causal, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
    w = w / torch.sqrt(torch.tensor(D, dtype=torch.float32)) + ext
    return torch.matmul(F.softmax(w, dim=-1).to(v.dtype), v)


def _mpt(q, k, v, alibi, keep):
    sq, sk = q.shape[-2], k.shape[-2]
    w = q.matmul(k.permute(0, 1, 3, 2)) * SCALE + alibi
    w = w.masked_fill(~keep.view(B, 1, 1, -1), torch.finfo(q.dtype).min)
    causal = torch.ones(sq, sk, dtype=torch.float16).tril(sk - sq).to(torch.bool)
    w = w.masked_fill(~causal.view(1, 1, sq, sk), torch.finfo(q.dtype).min)
    return torch.softmax(w, dim=-1).to(v.dtype).matmul(v)


def _repeat_kv(x, n_rep):
    b, hkv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


def _llama_sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, _repeat_kv(k, 3), _repeat_kv(v, 3), is_causal=True)


def _tiled_kv(q, k, v):
    # k.repeat tiles the heads (0, 1, 0, 1, ...): not repeat_kv's grouping, and not passed as GQA
    k, v = k.repeat(1, 3, 1, 1), v[:, None].expand(B, 3, 2, SK, D).reshape(B, 6, SK, D)
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D), dim=-1), v)


def _cross_padding_finfo_min(q, k, v, keep):
    ext = (1.0 - keep[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return (q @ k.transpose(-1, -2) * SCALE + ext).softmax(-1) @ v


def _masked_fill(value, keep_means_visible):
    def fn(q, k, v, keep):
        mask = ~keep if keep_means_visible else keep
        return _scores(q, k).masked_fill(mask, value).softmax(-1) @ v

    return fn


def _gpt2_where(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    bias = torch.tril(torch.ones(64, 64, dtype=torch.bool))[sk - sq:sk, :sk]
    w = q @ k.transpose(-1, -2) / torch.full([], v.size(-1) ** 0.5)
    mask_value = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype)
    return F.softmax(torch.where(bias, w.to(w.dtype), mask_value), dim=-1) @ v


def _scale_on_kt(q, k, v):
    return torch.softmax(q @ (k.transpose(-1, -2) / math.sqrt(D)), -1) @ v


def _scale_split_einsum(q, k, v):
    f = D**-0.25
    return torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q * f, k * f), -1) @ v


def _random_keep():
    torch.manual_seed(1)
    keep = torch.rand(B, 1, SQ, SK) > 0.3
    keep[..., 0] = True
    return keep


def _fully_padded_sample():
    keep = _keep_keys()
    keep[0] = False  # eager averages v over every key there, and so does the op on a finfo.min mask
    return keep


REWRITTEN = {
    "t5_bias_1hss": (_t5_bias, lambda: (*_qkv(), torch.randn(1, H, SQ, SK))),
    "t5_bias_bhss": (_t5_bias, lambda: (*_qkv(), torch.randn(B, H, SQ, SK))),
    "t5_bias_hss": (_t5_bias, lambda: (*_qkv(), torch.randn(H, SQ, SK))),
    "alibi_arange_causal": (_alibi_causal, lambda: _qkv()),
    "bloom_baddbmm": (_bloom, lambda: (*_qkv(), _keep_keys().long())),
    "falcon_upcast_qk": (_falcon_upcast_qk, lambda: _qkv()),
    "gptj": (_gptj, lambda: (*_qkv(sq=SK),
                             (~_keep_keys()[:, None, None, :]).float() * torch.finfo(torch.float32).min)),
    "mpt": (_mpt, lambda: (*_qkv(), (_slopes()[:, None, None] * torch.arange(1 - SK, 1))[None],
                           _keep_keys())),
    "llama_repeat_kv_sdpa_causal_sq_lt_sk": (_llama_sdpa_causal, lambda: _qkv(h=6, hkv=2)),
    "tiled_kv_repeats": (_tiled_kv, lambda: _qkv(h=6, hkv=2)),
    "cross_padding_finfo_min": (_cross_padding_finfo_min, lambda: (*_qkv(), _keep_keys())),
    "cross_padding_fully_padded_sample": (_cross_padding_finfo_min,
                                          lambda: (*_qkv(), _fully_padded_sample())),
    "masked_fill_not_keep_minus_inf": (_masked_fill(float("-inf"), True), lambda: (*_qkv(), _random_keep())),
    "masked_fill_masked_minus_inf": (_masked_fill(float("-inf"), False), lambda: (*_qkv(), ~_random_keep())),
    "masked_fill_minus_1e9": (_masked_fill(-1e9, True), lambda: (*_qkv(), _random_keep())),
    "masked_fill_minus_10000": (_masked_fill(-10000.0, True), lambda: (*_qkv(), _random_keep())),
    "gpt2_where_sq_lt_sk": (_gpt2_where, lambda: _qkv()),
    "scale_on_kt": (_scale_on_kt, lambda: _qkv()),
    "scale_split_over_q_and_k_einsum": (_scale_split_einsum, lambda: _qkv()),
}


@pytest.mark.parametrize("case", REWRITTEN)
def test_real_model_styles_are_rewritten(case):
    fn, args = REWRITTEN[case]
    _check_same(fn, *args(), tol=TOL)


def test_tiled_kv_repeats_are_not_passed_as_gqa():
    # repeat_kv would pair q head i with kv head i // 3; k.repeat pairs it with i % 2
    _, graphs = _run_rewritten(_tiled_kv, *_qkv(h=6, hkv=2))
    (node,) = _flash_nodes(graphs)
    assert node.args[1].meta["example_value"].shape[1] == 6  # k as repeated: q heads pair with its heads


def test_t5_style_stack_end_to_end_with_inductor():
    torch.manual_seed(0)
    model = T5StyleStack()
    x, keep = torch.randn(B, SK, H * D), _keep_keys()
    want = model(x, keep)
    torch._dynamo.reset()
    got = torch.compile(model, backend="flash")(x, keep)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    grads_e = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    grads_c = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, atol=1e-3, rtol=1e-4)


# --------------------------------------------------------------------------------------------------------
# Other functions: left alone
# --------------------------------------------------------------------------------------------------------


def _head_mask(q, k, v, head_mask):
    # BERT: probs * head_mask[None, :, None, None] before ·v
    return (F.softmax(_scores(q, k), dim=-1) * head_mask[None, :, None, None]) @ v


def _head_mask_per_sample(q, k, v, head_mask):
    p = F.dropout(F.softmax(_scores(q, k), dim=-1), 0.0, training=True)
    return torch.matmul(head_mask[:, :, None, None] * p, v)


def _probs_plus_eps(q, k, v):
    return (F.softmax(_scores(q, k), -1) + 1e-6) @ v


def _probs_times_half(q, k, v):
    return (F.softmax(_scores(q, k), -1) * 0.5) @ v


def _probs_zeroed_after(q, k, v):
    return F.softmax(_scores(q, k), -1).masked_fill(torch.arange(SK) > 30, 0.0) @ v


def _div_after_softmax(q, k, v):
    return (F.softmax(q @ k.transpose(-1, -2), -1) / math.sqrt(D)) @ v


def _output_attentions(q, k, v):
    p = F.softmax(_scores(q, k), -1)
    return p @ v, p.mean(1)


def _scores_returned(q, k, v):
    s = _scores(q, k)
    return s.softmax(-1) @ v, s


def _gpt2_original(q, k, v):
    # GPT-2's original masking by a multiply: w * b - 1e4 * (1 - b)
    sq, sk = q.shape[-2], k.shape[-2]
    b = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)[:, :, sk - sq:sk, :sk]
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
    return torch.matmul(F.softmax(w * b - 1e4 * (1 - b), dim=-1), v)


def _talking_heads_scores(q, k, v, mix):
    return torch.einsum("bhqk,hg->bgqk", _scores(q, k), mix).softmax(-1) @ v


def _talking_heads_probs(q, k, v, mix):
    return torch.einsum("bhqk,hg->bgqk", _scores(q, k).softmax(-1), mix) @ v


LEFT_ALONE = {
    "bert_head_mask": (_head_mask, lambda: (torch.tensor([1.0, 0.0, 1.0]),), "not to a matmul with v"),
    "bert_head_mask_per_sample": (_head_mask_per_sample,
                                  lambda: (torch.tensor([[1.0, 0.0, 1.0], [0.5, 1.0, 1.0]]),),
                                  "not to a matmul with v"),
    "probs_plus_eps": (_probs_plus_eps, tuple, "not to a matmul with v"),
    "probs_times_half": (_probs_times_half, tuple, "not to a matmul with v"),
    "probs_zeroed_after": (_probs_zeroed_after, tuple, "not to a matmul with v"),
    "div_after_softmax": (_div_after_softmax, tuple, "not to a matmul with v"),
    "output_attentions": (_output_attentions, tuple, "also returned or reused"),
    "scores_returned": (_scores_returned, tuple, "has other users"),
    "talking_heads_scores": (_talking_heads_scores, lambda: (torch.randn(H, H),), "is not q·kᵀ"),
    "talking_heads_probs": (_talking_heads_probs, lambda: (torch.randn(H, H),), "is not probabilities·v"),
}


@pytest.mark.parametrize("case", LEFT_ALONE)
def test_other_functions_are_left_alone_and_reported(case):
    fn, extra, reason = LEFT_ALONE[case]
    _assert_left_alone(fn, (*_qkv(), *extra()), reason)


def test_gpt2_original_multiplicative_mask_is_rewritten():
    """b = tril(ones) built in the function is provably 0 / 1 and causal: the multiply-and-subtract masking is
    eager's masked_fill with -1e4, and the band folds into is_causal (tests/test_attention_pass_forms_s31.py
    has the other spellings and the look-alikes left alone)."""
    (node,) = _check_same(_gpt2_original, *_qkv(sq=SK))
    assert node.kwargs["is_causal"] and node.kwargs.get("attn_mask") is None, node.kwargs


@pytest.mark.parametrize("op", [lambda p: p.clamp(min=1e-4), torch.relu, torch.nan_to_num,
                                torch.Tensor.detach], ids=["clamp", "relu", "nan_to_num", "detach"])
def test_other_ops_on_the_probabilities_are_left_alone(op):
    _assert_left_alone(lambda q, k, v: op(F.softmax(_scores(q, k), -1)) @ v, _qkv())
