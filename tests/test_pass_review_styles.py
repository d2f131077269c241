"""An adversarial review of the four pass families on code styles the other suites do not spell.

Each case is one small function or module in a style real code uses. A case that computes the same
function as a fused op must be rewritten (exact count) with outputs and gradients equal to eager's; a
case that computes another function, or one the pass cannot prove equal, must be left alone, with a
near miss whose reason names why where the pass saw a candidate. Sizes are tiny and odd. Helpers come
from the family suites (tests/test_attention_pass.py, test_norm_pass.py, test_dense_pass.py,
test_cross_entropy_pass.py).
"""

from __future__ import annotations

import math

import pytest
import test_cross_entropy_pass as ce_suite
import test_dense_pass as dense_suite
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_attention_pass import _check_same, _qkv, _rewrites
from test_norm_pass import EPS, Fn, N, _assert_same, _check_near_miss, _check_rewrite, _rewritten, _x
from torch._dynamo.utils import counters

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

TOL = dict(atol=2e-5, rtol=2e-5)
B, H, S, D = 2, 3, 7, 8


# ========================================================================================================
# Attention
# ========================================================================================================


def _keep_rows(b, s):
    """(B, S) bool padding keep-mask; every row keeps key 0, so no query row is fully masked."""
    keep = torch.rand(b, s) > 0.4
    keep[:, 0] = True
    return keep


def _bloom_alibi_baddbmm(q, k, v, alibi):
    # Bloom: alibi (B·H, 1, Sk) as baddbmm's input with beta=1.0 and alpha=1/sqrt(d) spelled out, scores
    # viewed to 4-d for a finfo.min causal fill, softmax in fp32, viewed back to 3-d for the bmm
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    inv_norm = 1.0 / math.sqrt(d)
    scores = alibi.baddbmm(batch1=q3, batch2=k3.transpose(-1, -2), beta=1.0, alpha=inv_norm)
    scores = scores.view(b, h, s, s)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs.view(b * h, s, s), v3).view(b, h, s, d)


def _einsum_bnqd(q, k, v):
    s = torch.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bnqk,bnkd->bnqd", s.softmax(-1), v)


def _einsum_ellipsis(q, k, v):
    s = torch.einsum("...qd,...kd->...qk", q * q.shape[-1] ** -0.5, k)
    return torch.einsum("...qk,...kd->...qd", torch.softmax(s, dim=-1), v)


def _einsum_ellipsis_merged_heads(q, k, v):
    # the ellipsis standing for one (B·H) dim of 3-d operands
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    p = torch.einsum("...id,...jd->...ij", q3, k3).mul(0.25).softmax(-1)
    return torch.einsum("...ij,...jd->...id", p, v3).view(b, h, s, d)


def _einsum_pre_transposed_k(q, k, v):
    kt = k.transpose(-1, -2)  # (B, H, D, S), as some code caches it
    s = torch.einsum("bhqd,bhdk->bhqk", q, kt) * 0.25
    return torch.matmul(s.softmax(-1), v)


def _shared_qk(q, k, v):
    # Reformer-style shared query/key projection: q·qᵀ
    return torch.softmax(q @ q.transpose(-2, -1) * 0.25, -1) @ v


def _output_flattened(q, k, v):
    out = torch.softmax(q @ k.mT * 0.25, -1) @ v
    return out.permute(0, 2, 1, 3).flatten(2)


def _softmax_fp64_positional_dtype(q, k, v):
    # torch.softmax's third positional argument is the dtype: an upcast, then back to q's dtype
    return torch.softmax(q @ k.mT * 0.25, -1, torch.float64).to(q.dtype) @ v


def _where_finfo_min_runtime(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * 0.25
    s = torch.where(keep, s, torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


def _masked_fill_bhss(q, k, v, keep):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def _additive_ss_bias(q, k, v, bias):
    # a runtime (S, S) float bias (relative positions), broadcast over batch and heads
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, -1) @ v


def _cross_padding(q, k, v, keep):
    # cross-attention, Sq != Sk, with a (B, 1, 1, Sk) padding mask
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
    return F.softmax(s, dim=-1) @ v


def _cross_causal_top_left(q, k, v):
    # ones(Sq, Sk).tril(): query i sees keys 0..i (SDPA's is_causal alignment)
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril()
    return torch.softmax((q @ k.mT * 0.25).masked_fill(~keep, float("-inf")), -1) @ v


def _cross_causal_bottom_right(q, k, v):
    # decoding with a KV cache: the Sq new queries are the last Sq positions, query i sees keys 0..Sk-Sq+i
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return torch.softmax((q @ k.mT * 0.25).masked_fill(~keep, float("-inf")), -1) @ v


def _cross_causal_additive_triu(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    return torch.softmax(q @ k.mT * 0.25 + torch.full((sq, sk), float("-inf")).triu(1), -1) @ v


def _mqa_broadcast_kv(q, k, v):
    # multi-query attention with k, v of one head broadcast by matmul, no repeat
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v


def _pv_with_v_transposed(q, k, v):
    # v's last two dims swapped (S == D): still p·v' for the (B, H, Sk, D) tensor v' = vᵀ, which the op takes
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v.transpose(-1, -2)


def _einsum_heads_first_scores(q, k, v):
    # scores laid out (H, B, Sq, Sk) by the einsum's output, read back by the ·v einsum
    s = torch.einsum("bhqd,bhkd->hbqk", q, k) * 0.25
    return torch.einsum("hbqk,bhkd->bhqd", s.softmax(-1), v)


def _einsum_q_given_transposed(q, k, v):
    # q and k held as (B, H, D, S), the einsum contracts over their first non-batch dim
    s = torch.einsum("bhdq,bhdk->bhqk", q.transpose(-1, -2).contiguous(), k.transpose(-1, -2)) * 0.25
    return s.softmax(-1) @ v


class _ScaleParameter(nn.Module):
    """A learned 0-d scale as an nn.Parameter, applied to q: gradients must reach it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.37))

    def forward(self, q, k, v):
        return torch.softmax((q * self.scale) @ k.transpose(-2, -1), -1) @ v


class _ScaleBuffer(nn.Module):
    """The scale as a registered buffer applied to the scores: a tensor whose value may change."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.35))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * self.scale, -1) @ v


def _einsum_scores_transposed(q, k, v):
    # "->bhkq" gives (k-rows, q-rows) scores, normalised over q's rows, then summed with v over them: this is
    # attention with q and k in each other's roles, softmax(k qᵀ / 4) v, which the op computes from (k, q, v)
    s = torch.einsum("bhqd,bhkd->bhkq", q, k) * 0.25
    return torch.softmax(s, -1) @ v


def _einsum_k_first(q, k, v):
    # the key operand listed first: the same q·kᵀ
    s = torch.einsum("bhkd,bhqd->bhqk", k, q) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def _einsum_k_first_ellipsis(q, k, v):
    s = torch.einsum("...jd,...id->...ij", k * 0.5, q)
    return torch.softmax(s, dim=-1) @ v


def _query_mask_after_softmax(q, k, v, keep_q):
    # padded queries zeroed after the softmax
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1).masked_fill(~keep_q, 0.0)
    return p @ v


ATTENTION_SAME = {
    # name: (fn, q/k/v sizes, extra inputs, expected op kwargs)
    "bloom_alibi_baddbmm_beta1": (_bloom_alibi_baddbmm, {}, lambda: (torch.randn(B * H, 1, S),), {}),
    "einsum_bnqd_bnkd": (_einsum_bnqd, {}, tuple, {"is_causal": False}),
    "einsum_ellipsis": (_einsum_ellipsis, {}, tuple, {"is_causal": False}),
    "einsum_ellipsis_merged_heads": (_einsum_ellipsis_merged_heads, {}, tuple, {}),
    "einsum_pre_transposed_k": (_einsum_pre_transposed_k, {}, tuple, {}),
    "shared_qk": (_shared_qk, {}, tuple, {}),
    "output_permute_flatten": (_output_flattened, {}, tuple, {}),
    "softmax_fp64_positional_dtype": (_softmax_fp64_positional_dtype, {}, tuple, {}),
    "where_finfo_min_runtime_b11s": (
        _where_finfo_min_runtime, {}, lambda: (_keep_rows(B, S)[:, None, None, :],), {}),
    "masked_fill_runtime_bhss": (
        _masked_fill_bhss, {}, lambda: ((torch.rand(B, H, S, S) > 0.5) | torch.eye(S, dtype=torch.bool),),
        {}),
    "additive_runtime_ss_bias": (_additive_ss_bias, {}, lambda: (torch.randn(S, S),), {}),
    "cross_attention_padding": (
        _cross_padding, {"Sk": 11}, lambda: (_keep_rows(B, 11)[:, None, None, :],), {}),
    "cross_causal_top_left_sq_lt_sk": (_cross_causal_top_left, {"S": 5, "Sk": 9}, tuple, {}),
    "cross_causal_top_left_sq_gt_sk": (_cross_causal_top_left, {"S": 9, "Sk": 5}, tuple, {}),
    "cross_causal_bottom_right": (_cross_causal_bottom_right, {"S": 5, "Sk": 9}, tuple, {}),
    "cross_causal_additive_triu": (_cross_causal_additive_triu, {"S": 5, "Sk": 9}, tuple, {}),
    "mqa_kv_broadcast_over_heads": (_mqa_broadcast_kv, {"Hkv": 1}, tuple, {}),
    "pv_with_v_transposed": (_pv_with_v_transposed, {"S": 8}, tuple, {}),
    "einsum_heads_first_scores": (_einsum_heads_first_scores, {}, tuple, {}),
    "einsum_q_given_transposed": (_einsum_q_given_transposed, {}, tuple, {}),
    "scale_parameter_on_q": (_ScaleParameter(), {}, tuple, {}),
    "scale_buffer_on_scores": (_ScaleBuffer(), {}, tuple, {}),
    # Sq != Sk: q and k taken the wrong way round would not run, or give other shapes
    "einsum_k_first": (_einsum_k_first, {"S": 5, "Sk": 9}, tuple, {}),
    "einsum_k_first_ellipsis": (_einsum_k_first_ellipsis, {"S": 9, "Sk": 5}, tuple, {}),
    "einsum_scores_transposed_is_attention_of_k_over_q": (_einsum_scores_transposed, {}, tuple, {}),
    # whole query rows zeroed after the softmax are the op's output rows zeroed (session 34, review s34 M3;
    # left alone before)
    "query_mask_after_softmax": (
        _query_mask_after_softmax, {}, lambda: (_keep_rows(B, S)[:, None, :, None],), {}),
}


@pytest.mark.parametrize("name", list(ATTENTION_SAME))
def test_attention_same_function_is_rewritten(name):
    torch.manual_seed(0)
    fn, sizes, extra, expect = ATTENTION_SAME[name]
    sizes = {"B": B, "H": H, "S": S, "D": D, **sizes}
    (node,) = _check_same(fn, *_qkv(**sizes), *extra())
    for key, value in expect.items():
        assert node.kwargs[key] is value, (key, node.kwargs)


def test_attention_buffer_scale_changed_after_compile_is_followed():
    # The buffer is a tensor the module may update (a temperature schedule): the compiled module must read
    # its current value, never one folded at compile time.
    torch.manual_seed(0)
    m = _ScaleBuffer()
    compiled = torch.compile(m, backend="flash")
    q, k, v = _qkv(B=B, H=H, S=S, D=D)
    torch.testing.assert_close(compiled(q, k, v), m(q, k, v), **TOL)
    m.scale.fill_(2.5)
    torch.testing.assert_close(compiled(q, k, v), m(q, k, v), **TOL)
    assert counters["flash"]["attention"] >= 1


class _NnSoftmaxImplicitDim(nn.Module):
    """nn.Softmax() without dim: on a 4-d input the legacy implicit dim is 1 (the heads), not the keys."""

    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax()

    def forward(self, q, k, v):
        return self.softmax(q @ k.transpose(-2, -1) * 0.25) @ v


def _einsum_pv_wrong_contraction(q, k, v):
    # contracts the probabilities over the queries, not the keys (runs since Sq == Sk)
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return torch.einsum("bhqk,bhqd->bhkd", p, v)


def _head_mask_on_probs(q, k, v, head_mask):
    # transformers' head_mask: probabilities times a per-head factor, after the softmax
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return (p * head_mask) @ v


def _probs_entropy_regulariser(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return p @ v, -(p * torch.log(p + 1e-9)).sum()


def _scores_times_runtime_mask(q, k, v, m):
    # a multiplicative 0/1 mask on the scores: not masking (masked keys keep weight exp(0))
    return torch.softmax(q @ k.transpose(-2, -1) * m, -1) @ v


def _einsum_ellipsis_k_shared_over_batch(q, k, v):
    # k (H, S, D) shared by every batch element: the ellipsis stands for 2 dims of q and 1 of k
    s = torch.einsum("...qd,...kd->...qk", q, k[0]) * 0.25
    return torch.softmax(s, -1) @ v


def _dropout_on_scores(q, k, v):
    # dropout BEFORE the softmax (on the scores) is another function than attention dropout
    return torch.softmax(F.dropout(q @ k.mT * 0.25, 0.3, True), -1) @ v


def _fill_large_positive(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    return torch.softmax((q @ k.mT * 0.25).masked_fill(m, 1e9), -1) @ v


def _einsum_key_dim_last_query_not_second(q, k, v):
    # (B, Sq, H, Sk) scores: the same function, but the op's layout needs (.., Sq, Sk) last; reported
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bqhk", qs, ks) * 0.25
    return torch.einsum("bqhk,bkhd->bqhd", s.softmax(-1), vs)


def _renormalised_probs(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return (p / (p.sum(-1, keepdim=True) + 1e-3)) @ v


ATTENTION_OTHER = {
    # name: (fn, extra inputs, reason in the near miss, or None when no candidate is reported)
    "nn_softmax_implicit_dim": (_NnSoftmaxImplicitDim(), tuple, "softmax over dim"),
    "einsum_pv_wrong_contraction": (_einsum_pv_wrong_contraction, tuple, "is not probabilities·v"),
    # these two were not reported at all before: the walk only looked for ·v through casts and dropout
    "head_mask_on_probs": (_head_mask_on_probs, lambda: (torch.rand(1, 8, 1, 1) + 0.5,),
                           "(mul), not to a matmul with v"),
    "probs_entropy_regulariser": (_probs_entropy_regulariser, tuple, "also returned or reused"),
    "renormalised_probs": (_renormalised_probs, tuple, "also returned or reused"),
    "einsum_ellipsis_unequal_batch_dims": (_einsum_ellipsis_k_shared_over_batch, tuple,
                                           "not the same leading dims of every operand"),
    "dropout_on_scores_training": (_dropout_on_scores, tuple, None),
    "fill_large_positive": (_fill_large_positive, tuple, "not -inf or a large negative"),
    "einsum_bqhk_scores": (_einsum_key_dim_last_query_not_second, tuple, "not q·kᵀ with the scores' key dim"),
    "scores_times_01_mask_per_key": (
        _scores_times_runtime_mask, lambda: (_keep_rows(1, 8)[:, None, None, :].float(),),
        "not a compile-time constant"),
}


@pytest.mark.parametrize("name", list(ATTENTION_OTHER))
def test_attention_other_function_is_left_alone(name):
    torch.manual_seed(0)
    fn, extra, reason = ATTENTION_OTHER[name]
    q, k, v = _qkv(B=1, H=8, S=8, D=8)  # alike sizes, so that mis-laid-out operands still run
    extra = extra()
    report = flash_backend.explain(fn, q, k, v, *extra, print_report=False)
    misses = [d for d in report.near_misses if d.family == "attention"]
    if reason is None:
        assert _rewrites() == (0, 0), report
    else:
        assert _rewrites() == (0, 1), report
        (decision,) = misses
        assert reason in decision.detail, decision.line()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=rewrite_only_backend)
    torch.manual_seed(1)
    got = compiled(q, k, v, *extra)
    torch.manual_seed(1)
    torch.testing.assert_close(got, fn(q, k, v, *extra), **TOL)


def test_attention_end_to_end_flash_backend_training():
    # a few of the styles above through the whole backend (Inductor included), outputs and gradients
    for fn, sizes in ((_bloom_alibi_baddbmm, {}), (_einsum_ellipsis, {}), (_cross_causal_bottom_right,
                                                                             {"S": 5, "Sk": 9})):
        torch._dynamo.reset()
        counters.clear()
        q, k, v = _qkv(**{"B": B, "H": H, "S": S, "D": D, **sizes})
        extra = (torch.randn(B * H, 1, S),) if fn is _bloom_alibi_baddbmm else ()
        leaves_e = [t.clone().requires_grad_() for t in (q, k, v)]
        leaves_c = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = fn(*leaves_e, *extra)
        got = torch.compile(fn, backend="flash")(*leaves_c, *extra)
        assert counters["flash"]["attention"] == 1, fn.__name__
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        grad = torch.randn_like(expected)
        got_grads = torch.autograd.grad(got, leaves_c, grad)
        for a, b in zip(got_grads, torch.autograd.grad(expected, leaves_e, grad), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ========================================================================================================
# Norm
# ========================================================================================================


def _ln_deepnet_scaled_residual(m, x, r):
    # DeepNet: the residual scaled by alpha before the add; the scaled residual is the op's residual
    return F.layer_norm(r * 0.7 + F.dropout(x, 0.0, True), (N,), m.weight, m.bias)


def _ln_inplace_dropout(m, x, r):
    # nn.Dropout(inplace=True) on a fresh tensor (eval-like p = 0)
    return F.layer_norm(r + F.dropout(x * 2, 0.0, True, inplace=True), (N,), m.weight, m.bias)


def _ln_hand_written_positive_dim(m, x, r):
    # statistics over dim=2 of a 3-d input: the last dim, spelled positively
    mu = x.mean(2, keepdim=True)
    return (x - mu) / torch.sqrt(x.var(2, keepdim=True, unbiased=False) + EPS) * m.weight + m.bias


def _torch_rms_norm(m, x, r):
    return torch.rms_norm(x + r, [N], m.weight, EPS)


def _ln_weight_then_bias_subtracted(m, x, r):
    # `* w - b` is not `+ b`: the weight may fold, the subtraction must stay after the op
    return F.layer_norm(x, (N,)) * m.weight - m.bias


def _ln_divided_by_weight(m, x, r):
    return F.layer_norm(x, (N,)) / m.weight


def _ln_addcmul_with_value(m, x, r):
    # addcmul(b, n, w, value=0.5) is b + 0.5·n·w, not the affine tail b + n·w
    return torch.addcmul(m.bias, F.layer_norm(x, (N,)), m.weight, value=0.5)


def _ln_residual_subtracted(m, x, r):
    # r - dropout(x) is not a residual add: the difference is the op's input
    return F.layer_norm(r - F.dropout(x, 0.0, True), (N,), m.weight, m.bias)


NORM_SAME = {
    # name: (fn, bias, rewrites, text in the report)
    "deepnet_scaled_residual": (_ln_deepnet_scaled_residual, True, "dropout + residual add + F.layer_norm"),
    "inplace_dropout": (_ln_inplace_dropout, True, "dropout + residual add + F.layer_norm"),
    "hand_written_positive_dim": (_ln_hand_written_positive_dim, True, "hand-written LayerNorm"),
    "torch_rms_norm": (_torch_rms_norm, False, "F.rms_norm"),
    "weight_then_bias_subtracted": (_ln_weight_then_bias_subtracted, True, "F.layer_norm + weight ->"),
    "divided_by_weight": (_ln_divided_by_weight, False, "F.layer_norm ->"),
    "addcmul_with_value": (_ln_addcmul_with_value, True, "F.layer_norm ->"),
    "residual_subtracted": (_ln_residual_subtracted, True, "F.layer_norm ->"),
}


@pytest.mark.parametrize("name", list(NORM_SAME))
def test_norm_same_function_is_rewritten(name):
    torch.manual_seed(0)
    fn, bias, text = NORM_SAME[name]
    m = Fn(fn, bias=bias)
    with torch.no_grad():
        m.weight.add_(2.0 * torch.sign(m.weight))  # away from 0: one case divides by it
    _check_rewrite(m, (_x(2, 5, N), _x(2, 5, N)), text=text, atol=1e-4, rtol=1e-4)


def _ln_stats_by_sum_over_n(m, x):
    mu = x.sum(-1, keepdim=True) / N
    c = x - mu
    return c / torch.sqrt((c * c).sum(-1, keepdim=True) / N + EPS) * m.weight


def _ln_unbiased_by_sum(m, x):
    c = x - x.mean(-1, keepdim=True)
    return c / torch.sqrt((c * c).sum(-1, keepdim=True) / (N - 1) + EPS)


def _rms_l1_mean(m, x):
    return x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + EPS)


def _ln_mean_detached(m, x):
    # same forward, but no gradient through the mean: the fused backward would differ
    return (x - x.mean(-1, keepdim=True).detach()) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + EPS)


def _rms_mean_square_detached(m, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).detach() + EPS)


def test_norm_sum_over_n_is_rewritten():
    # a sum / N is a mean (fx_passes/norm.py _as_mean; more spellings in tests/test_norm_pass_more_forms.py)
    _check_rewrite(Fn(_ln_stats_by_sum_over_n, bias=False), (_x(2, 5, N),),
                   text="hand-written LayerNorm + weight", atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn", [_ln_unbiased_by_sum, _rms_l1_mean, _ln_mean_detached,
                                _rms_mean_square_detached], ids=lambda f: f.__name__.strip("_"))
def test_norm_lookalikes_are_left_alone(fn):
    # Statistics that are not a mean (a sum / (N - 1), a mean of |x|: other functions) or detached (same
    # forward, another backward): no candidate, nothing rewritten, and forward and gradients stay eager's.
    m = Fn(fn, bias=False)
    counters.clear()
    with collecting() as report:
        _check_rewrite(m, (_x(2, 5, N),), rewrites=0)
    assert not report.decisions, str(report)


@pytest.mark.parametrize("module, args", [
    (Fn(lambda m, x: F.layer_norm(x, (5, N), m.weight, m.bias), weight_shape=(5, N)), lambda: (_x(2, 5, N),)),
    (nn.RMSNorm((5, N)), lambda: (_x(2, 5, N),)),
], ids=["F.layer_norm_last_two_dims", "nn.RMSNorm_last_two_dims"])
def test_norm_over_the_last_two_dims_is_a_near_miss(module, args):
    _check_near_miss(module, args(), "normalises over the last 2 dims")
    counters.clear()
    compiled, _ = _rewritten(module)
    _assert_same(module, compiled, args())  # and it runs as eager, gradients included
    assert counters["flash"]["norm"] == 0


def test_norm_dropout_of_the_sum_is_not_split_into_dropout_plus_residual():
    # dropout(x + r) drops the residual too: the op must take the sum as x, with no residual
    def fn(m, x, r):
        return F.layer_norm(F.dropout(x + r, 0.5, True), (N,), m.weight, m.bias)

    graphs = []

    def backend(gm, example_inputs):
        from fx_passes import run_passes

        run_passes(gm.graph)
        graphs.append(gm)
        return gm.forward

    torch.compile(Fn(fn), backend=backend, fullgraph=True)(_x(2, 5, N), _x(2, 5, N))
    assert counters["flash"]["norm"] == 1
    (op,) = [n for n in graphs[0].graph.nodes
             if n.op == "call_function" and "add_dropout_norm" in str(n.target)]
    assert op.args[1] is None and op.kwargs["dropout_p"] == 0.5, op.format_node()
    assert "add" in op.args[0].name  # the sum itself


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_norm_eps_attribute_changed_after_compile_is_followed(dynamic):
    class EpsAttr(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.eps = nn.LayerNorm(N), 1e-5

        def forward(self, x):
            return F.layer_norm(x, (N,), self.ln.weight, self.ln.bias, self.eps)

    m = EpsAttr()
    compiled = torch.compile(m, backend="flash", dynamic=dynamic)
    x = _x(3, N) * 0.05  # small variance, so that eps shows
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), atol=1e-4, rtol=1e-4)
        m.eps = 0.5
        torch.testing.assert_close(compiled(x), m(x), atol=1e-4, rtol=1e-4)
    assert counters["flash"]["norm"] >= 1


# ========================================================================================================
# Dense
# ========================================================================================================

DK, DN = dense_suite.K, dense_suite.N


class _Params(nn.Module):
    """Those of w, b, b2 (bare parameters) and `lin` (an nn.Linear) that fn(m, x) uses, named in `parts`
    (every parameter must get a gradient)."""

    def __init__(self, fn, w_shape=(DN, DK), n=DN, parts="w b"):
        super().__init__()
        self.fn, parts = fn, parts.split()
        if "w" in parts:
            self.w = nn.Parameter(torch.randn(w_shape) / DK**0.5)
        for name in ("b", "b2"):
            if name in parts:
                setattr(self, name, nn.Parameter(torch.randn(n)))
        if "lin" in parts:
            self.lin = nn.Linear(DK, n)

    def forward(self, x):
        return self.fn(self, x)


def _inplace_bias(m, x):
    h = x @ m.w.t()
    h += m.b
    return F.gelu(h)


DENSE_SAME = {
    # name: (module, input, text)
    # a square weight: x @ w (in, out) and x @ w.t() (out, in) both run; each must keep its own layout
    "square_weight_in_out": (_Params(lambda m, x: F.gelu(x @ m.w + m.b), (DK, DK), DK), (3, 5, DK),
                             "x @ w + b"),
    "square_weight_out_in": (_Params(lambda m, x: F.gelu(x @ m.w.t() + m.b), (DK, DK), DK), (3, 5, DK),
                             "x @ w.t() + b"),
    "bias_added_in_place": (_Params(_inplace_bias), (3, 5, DK), "x @ w.t() + b"),
    "nn_gelu_tanh_module": (nn.Sequential(nn.Linear(DK, DN), nn.GELU(approximate="tanh")), (4, DK),
                            "F.gelu(tanh)"),
    # linear(x, w, b) + b2 is linear(x, w, b + b2): the op gets the sum (tests/test_dense_pass_more_forms.py)
    "second_bias_on_a_biased_linear": (_Params(lambda m, x: F.gelu(m.lin(x) + m.b2), parts="lin b2"),
                                       (3, 5, DK), "F.linear + b2 + F.gelu"),
}


@pytest.mark.parametrize("name", list(DENSE_SAME))
def test_dense_same_function_is_rewritten(name):
    torch.manual_seed(0)
    module, shape, text = DENSE_SAME[name]
    dense_suite._check(module, x=torch.randn(shape), text=text)


_FULL_ADDEND = torch.randn(7, DN)

DENSE_OTHER = {
    # name: (fn, the parameters it reads, input shape, reason in the near miss or None when the pass sees no
    # candidate)
    "geglu_chunk": (lambda m, x: (lambda a, g: a * F.gelu(g))(*m.lin(x).chunk(2, -1)), "lin", (3, 5, DK),
                    None),
    "gelu_of_a_slice": (lambda m, x: F.gelu(m.lin(x)[..., :7]), "lin", (3, 5, DK), None),
    "erf_gelu_of_2h": (lambda m, x: dense_suite.erf_gelu(2 * m.lin(x)), "lin", (3, 5, DK), None),
    "gelu_of_scaled_linear": (lambda m, x: F.gelu(m.lin(x) * 2), "lin", (3, 5, DK), None),
    "silu": (lambda m, x: F.silu(m.lin(x)), "lin", (3, 5, DK), None),
    "x_sigmoid_x": (lambda m, x: (lambda h: h * torch.sigmoid(h))(m.lin(x)), "lin", (3, 5, DK), None),
    "addmm_full_addend": (lambda m, x: F.gelu(torch.addmm(_FULL_ADDEND, x, m.w.t())), "w", (7, DK),
                          "not a 1-d (N,) tensor"),
    "addmm_row_bias_1xn": (lambda m, x: F.gelu(torch.addmm(m.b[None], x, m.w.t())), "w b", (7, DK),
                           "not a 1-d (N,) tensor"),
}


@pytest.mark.parametrize("name", list(DENSE_OTHER))
def test_dense_other_function_is_left_alone(name):
    torch.manual_seed(0)
    fn, parts, shape, reason = DENSE_OTHER[name]
    m, x = _Params(fn, parts=parts), torch.randn(shape)
    counters.clear()
    with collecting() as report:
        dense_suite._assert_same(m, dense_suite._rewritten(m), x)
    assert counters["flash"]["dense"] == 0, str(report)
    if reason is None:
        assert counters["flash"]["dense_skipped"] == 0, str(report)
    else:
        assert counters["flash"]["dense_skipped"] == 1, str(report)
        assert reason in report.near_misses[0].detail, str(report)


def test_dense_end_to_end_square_weight_layouts():
    in_out = lambda m, x: F.gelu(x @ m.w + m.b)  # noqa: E731
    out_in = lambda m, x: F.gelu(x @ m.w.t() + m.b, approximate="tanh")  # noqa: E731
    for fn in (in_out, out_in):
        torch._dynamo.reset()
        counters.clear()
        m = _Params(fn, (DK, DK), DK)
        dense_suite._assert_same(m, torch.compile(m, backend="flash"), torch.randn(2, 3, DK), atol=1e-4,
                                 rtol=1e-4)
        assert counters["flash"]["dense"] == 1


# ========================================================================================================
# Cross-entropy
# ========================================================================================================

V = ce_suite.V
CK = ce_suite.K


def _z_loss(lg, y):
    # PaLM's z-loss reads the logits too: the op returns them, and both gradients reach the Linear
    return F.cross_entropy(lg.view(-1, V), y.view(-1)) + 1e-2 * torch.logsumexp(lg, -1).pow(2).mean()


class _TiedLinearHead(nn.Module):
    """A head tied to the embedding: F.linear(h, emb.weight), no bias."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, CK)

    def forward(self, x, labels):
        logits = F.linear(x, self.emb.weight)
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten()), logits


class _ShiftedHiddenHead(nn.Module):
    """The shift done on the hidden states before the head (logits_to_keep style), labels shifted too."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(CK, V)

    def forward(self, h, labels):
        logits = self.proj(h[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1)), logits


class _TiedMatmulHead(_TiedLinearHead):
    def forward(self, x, labels):
        logits = x @ self.emb.weight.t()
        return F.cross_entropy(logits.view(-1, V), labels.view(-1)), logits


CE_SAME = {
    "z_loss_second_user": (lambda: ce_suite.Head(_z_loss), (3, 7), -100),
    "module_sum_smoothing_ignore0": (
        lambda: ce_suite.Head(lambda lg, y: nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1,
                                                                ignore_index=0)(lg.view(-1, V), y.view(-1))),
        (3, 7), 0),
    "tied_embedding_linear": (_TiedLinearHead, (3, 7), -100),
    # h @ wte.weight.T: F.linear without a bias is matmul(input, weight.t()) in ATen
    "tied_embedding_matmul": (_TiedMatmulHead, (3, 7), -100),
    "shifted_hidden_states": (_ShiftedHiddenHead, (3, 7), -100),
    # nll_loss(log_softmax(z)) is cross-entropy (more spellings: tests/test_cross_entropy_pass_nll_forms.py)
    "nll_loss_of_log_softmax": (
        lambda: ce_suite.Head(lambda lg, y: F.nll_loss(F.log_softmax(lg.view(-1, V), -1), y.view(-1))),
        (3, 7), -100),
    # the rows permuted, the classes last: each Linear row paired with its own target (since session 33;
    # more forms in tests/test_cross_entropy_pass_s33.py)
    "seq_first_logits_transposed": (
        lambda: ce_suite.Head(lambda lg, y: F.cross_entropy(lg.transpose(0, 1).reshape(-1, V),
                                                            y.t().reshape(-1))),
        (3, 7), 2),
}


@pytest.mark.parametrize("name", list(CE_SAME))
def test_cross_entropy_same_function_is_rewritten(name):
    torch.manual_seed(0)
    make, shape, ignore = CE_SAME[name]
    ce_suite._check(make(), (torch.randn(*shape, CK), ce_suite._labels(shape, ignore=ignore)))


CE_OTHER = {
    # name: (model, labels, reason or None when the pass sees no candidate)
    # the class dim split in two by the view: another classification problem
    "view_splits_the_class_dim": (
        lambda: ce_suite.Head(lambda lg, y: F.cross_entropy(lg.view(-1, 19), y.view(-1)), classes=38),
        lambda: ce_suite._labels((3, 7, 2), classes=19), "view (view), which is not a reshape keeping"),
    "logits_max_subtracted": (
        lambda: ce_suite.Head(lambda lg, y: F.cross_entropy((lg - lg.amax(-1, keepdim=True)).view(-1, V),
                                                            y.view(-1))),
        lambda: ce_suite._labels((3, 7)), "sub (sub)"),
}


@pytest.mark.parametrize("name", list(CE_OTHER))
def test_cross_entropy_other_chains_are_left_alone(name):
    torch.manual_seed(0)
    make, labels, reason = CE_OTHER[name]
    skipped = int(reason is not None)
    report = ce_suite._check(make(), (torch.randn(3, 7, CK), labels()), rewrites=0, skipped=skipped)
    if reason is not None:
        assert reason in str(report), str(report)


def test_cross_entropy_end_to_end_z_loss():
    torch.manual_seed(0)
    model = ce_suite.Head(_z_loss)
    args = (torch.randn(2, 5, CK), ce_suite._labels((2, 5)))
    expected = ce_suite._run(model, args, True)
    got = ce_suite._run(torch.compile(model, backend="flash"), args, True)
    assert counters["flash"]["cross_entropy"] == 1
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
