"""Review (session 27) of fx_passes/attention on the spellings of attention other than its masks: GQA (Llama's
repeat_kv, repeat_interleave, tiles that are not GQA, k/v with one head broadcast by matmul or einsum, SDPA's
enable_gqa), scales (on q, on k, twice, zero, negative, a learned or per-head tensor, baddbmm's alpha),
softmax dtypes and dims, einsum equations with their operands or outputs in other orders, cross-attention,
q and k the same node, v with another head dim, views of the scores' leading dims, rotary embeddings,
dropout with p=0, returned weights, nn.MultiheadAttention's layouts, and arguments passed by keyword.

Every case runs through dynamo + the passes (the rewritten graph as plain PyTorch, the flash op on its CPU
reference) in training (outputs, input and parameter gradients) and in eval, fp32, random inputs at odd
sizes, and asserts whether it was rewritten (with what) or left alone (with the reason reported).

Fixes (each case failed before; none computed a wrong value, each cost the fusion with an internal error):
- ``F.softmax(input=s, dim=-1)`` / ``torch.softmax(input=s, ...)``: the softmax input was read as args[0]
  (IndexError, reported as an internal error).
- ``torch.matmul(p, other=v)`` / ``torch.bmm(p, mat2=v)`` for ·v: the same (IndexError); and
  ``torch.matmul(input=q, other=kᵀ)`` for q·kᵀ was refused as "not two positional operands". Operands are
  now read by position or keyword (any other keyword, such as out=, is still refused).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s23 import Fn
from test_norm_dense_ce_review_s25 import _run

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._compat import counters

B, H, HKV, S, D = 2, 4, 2, 7, 16
SQ = 5
N_REP = H // HKV
SCALE = D**-0.5
TOL = dict(atol=3e-5, rtol=3e-5)


@pytest.fixture(autouse=True)
def _cold_inductor_cache():
    """An Inductor cache hit skips the pre-grad passes, and with them the counters these tests assert."""
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():
        yield


def _check(model, args, rewrites, skipped=0, reason=None, text=None, absent=None, tol=TOL, dynamic=None,
           argsets=None):
    """In training and in eval: `rewrites` attention rewrites (None: at least one) and `skipped` near misses
    (one naming reason), the rewrite details naming `text` and not `absent`, and the compiled model gives
    eager's outputs and gradients (NaN where eager has NaN) on every argument set (one compile)."""
    model = model if isinstance(model, nn.Module) else Fn(model)
    for train in (True, False):
        model.train(train)
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            compiled = torch.compile(model, backend=rewrite_only_backend, dynamic=dynamic)
            for a in argsets or [args]:
                got = _run(compiled, a, train)
                expected = _run(model, a, train)
                assert len(got) == len(expected), str(report)
                for e, g in zip(expected, got, strict=True):
                    assert g.dtype == e.dtype and g.shape == e.shape, str(report)
                    torch.testing.assert_close(g, e, **tol, equal_nan=True)
        if rewrites is None:  # one rewrite per compile: as many as dynamo's recompiles
            assert counters["flash"]["attention"] >= 1, str(report)
        else:
            assert counters["flash"]["attention"] == rewrites, str(report)
        assert counters["flash"]["attention_skipped"] == skipped, str(report)
        if reason is not None:
            assert any(reason in d.detail for d in report.near_misses if d.family == "attention"), str(report)
        details = [d.detail for d in report.rewrites if d.family == "attention"]
        if text is not None:
            assert any(text in d for d in details), str(report)
        if absent is not None:
            assert not any(absent in d for d in details), str(report)


def _qkv(h=H, hkv=None, sq=S, sk=S, dv=D, seed=0):
    torch.manual_seed(seed)
    hkv = hkv or h
    return torch.randn(B, h, sq, D), torch.randn(B, hkv, sk, D), torch.randn(B, hkv, sk, dv)


def _t(k):
    return k.transpose(-1, -2)


def _sm(s):
    return torch.softmax(s, -1)


def _sm_dtype(q, k, dtype):
    """softmax in `dtype`, back to float32."""
    return torch.softmax(q @ _t(k) * SCALE, -1, dtype=dtype).float()


def _attend(q, k, v):
    return _sm(q @ _t(k) * SCALE) @ v


# --------------------------------------------------------------------------------------------------------
# GQA: passed un-repeated only when k and v are repeated per head (interleaved), never when tiled
# --------------------------------------------------------------------------------------------------------


def _repeat_kv(x, n):
    """Llama's repeat_kv: each k/v head n times in a row (head h of q reads k/v head h // n)."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _tile_kv(x, n):
    """expand over a new dim 1: the heads tiled (head h of q reads k/v head h % n): not SDPA's GQA."""
    b, h, s, d = x.shape
    return x[:, None].expand(b, n, h, s, d).reshape(b, h * n, s, d)


def _llama(q, k, v):
    n = q.shape[1] // k.shape[1]
    s = q @ _t(_repeat_kv(k, n)) / math.sqrt(q.shape[-1])
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ _repeat_kv(v, n)


def _repeat_interleave_keywords(q, k, v):
    k = torch.repeat_interleave(k, N_REP, dim=1)
    return _attend(q, k, v.repeat_interleave(repeats=N_REP, dim=-3))


def _repeat_interleave_bshd(q, k, v):
    """(B, S, H, D) projections repeated over dim 2 and contracted by einsum."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(N_REP, 2), v.repeat_interleave(N_REP, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    return torch.einsum("bhqk,bkhd->bqhd", _sm(s), v)


def _tiled_by_expand(q, k, v):
    return _attend(q, _tile_kv(k, N_REP), _tile_kv(v, N_REP))


def _uneven_repeats(q, k, v):
    reps = torch.tensor([1, 3])
    return _attend(q, k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1))


def _k_interleaved_v_tiled(q, k, v):
    return _attend(q, k.repeat_interleave(N_REP, 1), v.repeat(1, N_REP, 1, 1))


def _one_kv_head_broadcast_by_matmul(q, k, v):
    return _attend(q, k[:, :1], v[:, :1])


def _one_kv_head_broadcast_by_einsum(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k[:, :1]) * SCALE
    return torch.einsum("bhqk,bhkd->bhqd", _sm(s), v[:, :1])


GQA = {
    # name: (fn, inputs, text in the details, text not in the details)
    "llama_repeat_kv": (_llama, lambda: _qkv(hkv=HKV), "gqa", None),
    "repeat_interleave_keywords": (_repeat_interleave_keywords, lambda: _qkv(hkv=HKV), "gqa", None),
    "repeat_interleave_bshd_einsum": (_repeat_interleave_bshd, lambda: _qkv(hkv=HKV), "gqa", None),
    "tiled_by_expand_not_gqa": (_tiled_by_expand, lambda: _qkv(hkv=HKV), "scale=0.25", "gqa"),
    "uneven_repeats_not_gqa": (_uneven_repeats, lambda: _qkv(hkv=HKV), "scale=0.25", "gqa"),
    "k_interleaved_v_tiled_not_gqa": (_k_interleaved_v_tiled, lambda: _qkv(hkv=HKV), "scale=0.25", "gqa"),
    "one_kv_head_matmul": (_one_kv_head_broadcast_by_matmul, _qkv, "scale=0.25", None),
    "one_kv_head_einsum": (_one_kv_head_broadcast_by_einsum, _qkv, "scale=0.25", None),
}


@pytest.mark.parametrize("case", GQA)
def test_gqa_spellings(case):
    fn, args, text, absent = GQA[case]
    _check(fn, args(), rewrites=1, text=text, absent=absent)


def test_gqa_group_count_under_dynamic_shapes():
    """One dynamic graph reused over several (heads, kv heads, Sq, Sk): the un-repeated k/v stay right."""

    def sizes(h, hkv, sq=S, sk=S):
        return _qkv(h=h, hkv=hkv, sq=sq, sk=sk, seed=h * 10 + hkv)

    argsets = [sizes(4, 2), sizes(6, 2), sizes(6, 3), sizes(8, 2, sq=9, sk=3)]
    _check(_llama, argsets[0], rewrites=None, dynamic=True, argsets=argsets, text="gqa")


# --------------------------------------------------------------------------------------------------------
# Scales, softmax and matmul spellings that are the same function
# --------------------------------------------------------------------------------------------------------


def _baddbmm(q, k, v, alpha):
    q3, k3, v3 = (t.reshape(B * H, t.shape[2], D) for t in (q, k, v))
    w = torch.baddbmm(torch.zeros(B * H, q.shape[2], k.shape[2]), q3, _t(k3), beta=0, alpha=alpha)
    return torch.bmm(_sm(w), v3).view(B, H, q.shape[2], D)


def _einsum_heads_first_scores(q, k, v):
    """Scores laid out (H, B, Sq, Sk) by the equation, read back by the ·v einsum."""
    s = torch.einsum("bhqd,bhkd->hbqk", q, k) * SCALE
    return torch.einsum("hbqk,bhkd->bhqd", _sm(s), v)


def _einsum_k_heads_first(q, k, v):
    k = k.transpose(0, 1).contiguous()  # (H, B, S, D)
    return _sm(torch.einsum("bhqd,hbkd->bhqk", q, k) * SCALE) @ v


def _einsum_kt_operand(q, k, v):
    return _sm(torch.einsum("bhqd,bhdk->bhqk", q, _t(k)) * SCALE) @ v


def _einsum_output_transposed(q, k, v):
    return torch.einsum("bhqk,bhkd->bhdq", _sm(q @ _t(k) * SCALE), v)


def _einsum_one_scaled_operand_twice(q, k, v):
    x = q * -0.5  # both operands: (-0.5)² = 0.25
    return _sm(torch.einsum("bhqd,bhkd->bhqk", x, x)) @ v


def _scores_viewed_heads_first(q, k, v, bias):
    """The (B, H) scores viewed as (H, B) rows for a bias, then back: one flat (batch·head) index."""
    s = (q @ _t(k) * SCALE).view(H, B, S, S) + bias
    return _sm(s).reshape(B, H, S, S) @ v


def _rotate_half(x):
    return torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1)


def _rotary(q, k, v):
    pos = torch.arange(q.shape[-2], dtype=torch.float32)
    freqs = torch.outer(pos, 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    emb = torch.cat((freqs, freqs), -1)
    q, k = (t * emb.cos() + _rotate_half(t) * emb.sin() for t in (q, k))
    return _sm(q @ _t(k) / math.sqrt(D)) @ v


class _Dropout0(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, q, k, v):
        return self.drop(_sm(q @ _t(k) * SCALE)) @ v


SAME = {
    # name: (fn, inputs, text in the rewrite's details)
    "scale_on_q_negative": (lambda q, k, v: _sm((q * -0.25) @ _t(k)) @ v, _qkv, "scale=-0.25"),
    "scale_on_k_negative": (lambda q, k, v: _sm(q @ _t(k * -0.25)) @ v, _qkv, "scale=-0.25"),
    "scale_on_q_zero": (lambda q, k, v: _sm((q * 0.0) @ _t(k)) @ v, _qkv, "scale=0"),
    "baddbmm_alpha_zero": (lambda q, k, v: _baddbmm(q, k, v, 0.0), _qkv, "scale=0"),
    "scale_split_over_q_and_scores": (lambda q, k, v: _sm((q * D**-0.25) @ _t(k) * D**-0.25) @ v, _qkv,
                                      "scale=0.25"),
    "scale_on_kt_by_sqrt_tensor": (lambda q, k, v: _sm(q @ (_t(k) / torch.tensor(D).sqrt())) @ v, _qkv,
                                   "scale=0.25"),
    "negative_learned_temperature": (lambda q, k, v, t: _sm(q @ _t(k) * t) @ v,
                                     lambda: (*_qkv(), torch.tensor(-0.3)), "(on q)"),
    "per_head_scale": (lambda q, k, v, t: _sm(q @ _t(k) * t) @ v, lambda: (*_qkv(), torch.randn(H, 1, 1)),
                       "(on q)"),
    "softmax_dtype_float64": (lambda q, k, v: _sm_dtype(q, k, torch.float64) @ v, _qkv, "scale=0.25"),
    "einsum_heads_first_scores": (_einsum_heads_first_scores, _qkv, "scale=0.25"),
    "einsum_k_heads_first": (_einsum_k_heads_first, _qkv, "scale=0.25"),
    "einsum_kt_operand": (_einsum_kt_operand, _qkv, "scale=0.25"),
    "einsum_output_transposed": (_einsum_output_transposed, _qkv, "scale=0.25"),
    "einsum_one_scaled_operand_twice": (_einsum_one_scaled_operand_twice, _qkv, "scale=0.25"),
    "q_is_k_scaled_once": (lambda q, k, v: _sm((q * 0.5) @ _t(q)) @ v, _qkv, "scale=0.5"),
    "cross_attention_sq_lt_sk": (_attend, lambda: _qkv(sq=SQ), "scale=0.25"),
    "cross_attention_sq_gt_sk": (_attend, lambda: _qkv(sq=S, sk=SQ), "scale=0.25"),
    "v_head_dim_24": (_attend, lambda: _qkv(dv=24), "scale=0.25"),
    "scores_viewed_heads_first_with_bias": (_scores_viewed_heads_first,
                                            lambda: (*_qkv(), torch.randn(H, 1, 1, S)), "mask"),
    "rotary_q_and_k": (_rotary, _qkv, "scale=0.25"),
    "nn_dropout_p0": (_Dropout0(), _qkv, "scale=0.25"),
    "f_dropout_in_place_p0": (lambda q, k, v: F.dropout(_sm(q @ _t(k) * SCALE), 0.0, True, inplace=True) @ v,
                              _qkv, "scale=0.25"),
    # by keyword (fixed: internal error / refused before)
    "f_softmax_input_keyword": (lambda q, k, v: F.softmax(input=q @ _t(k) * SCALE, dim=-1) @ v, _qkv,
                                "scale=0.25"),
    "torch_softmax_input_keyword": (lambda q, k, v: torch.softmax(input=q @ _t(k) * SCALE, dim=-1) @ v, _qkv,
                                    "scale=0.25"),
    "matmul_other_keyword_for_pv": (lambda q, k, v: torch.matmul(_sm(q @ _t(k) * SCALE), other=v), _qkv,
                                    "scale=0.25"),
    "matmul_keywords_for_qk": (lambda q, k, v: _sm(torch.matmul(input=q, other=_t(k)) * SCALE) @ v, _qkv,
                               "scale=0.25"),
    "bmm_mat2_keyword": (lambda q, k, v: torch.bmm(_sm(torch.bmm(q[0], mat2=_t(k[0])) * SCALE), mat2=v[0]),
                         _qkv, "scale=0.25"),
}


@pytest.mark.parametrize("case", SAME)
def test_same_function_is_rewritten(case):
    fn, args, text = SAME[case]
    _check(fn, args(), rewrites=1, text=text)


def _sdpa(**kw):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


SDPA = {
    "scale_zero": (_sdpa(scale=0.0), _qkv),
    "scale_negative": (_sdpa(scale=-0.3), _qkv),
    "enable_gqa_causal_sq_lt_sk": (_sdpa(is_causal=True, enable_gqa=True), lambda: _qkv(hkv=HKV, sq=SQ)),
    "causal_sq_gt_sk_top_left": (_sdpa(is_causal=True), lambda: _qkv(sq=S, sk=SQ)),
    "v_head_dim_24": (_sdpa(), lambda: _qkv(dv=24)),
    "one_kv_head_without_enable_gqa": (_sdpa(), lambda: _qkv(hkv=1)),
    "three_d_k_batch_1": (lambda q, k, v: F.scaled_dot_product_attention(q[0], k[0, :1], v[0, :1]), _qkv),
    "three_d_enable_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q[0], k[0], v[0], enable_gqa=True),
                           lambda: _qkv(hkv=HKV)),
}


@pytest.mark.parametrize("case", SDPA)
def test_sdpa_forms_are_rewritten(case):
    fn, args = SDPA[case]
    _check(fn, args(), rewrites=1)


# --------------------------------------------------------------------------------------------------------
# Left alone: another function, or one the op cannot take
# --------------------------------------------------------------------------------------------------------


def _weights_returned_detached(q, k, v):
    p = _sm(q @ _t(k) * SCALE)
    return p @ v, p.detach()


def _weights_returned_after_a_cast(q, k, v):
    p = _sm(q @ _t(k) * SCALE).float()
    return p.to(v.dtype) @ v, p


def _gqa_as_5d_view(q, k, v):
    s = q.view(B, HKV, N_REP, S, D) @ _t(k)[:, :, None] * SCALE
    return (_sm(s) @ v[:, :, None]).view(B, H, S, D)


OTHER = {
    # name: (fn, inputs, reason)
    "softmax_dtype_float16": (lambda q, k, v: _sm_dtype(q, k, torch.float16) @ v, _qkv,
                              "less precise than the torch.float32"),
    "softmax_method_dtype_bfloat16": (lambda q, k, v: (q @ _t(k) * SCALE).softmax(-1, dtype=torch.bfloat16)
                                      .float() @ v, _qkv, "less precise than the torch.float32"),
    "nn_softmax_without_dim": (lambda q, k, v: nn.Softmax()(q @ _t(k) * SCALE) @ v, _qkv, "dim None"),
    "per_key_scale": (lambda q, k, v, t: _sm(q @ _t(k) * t) @ v, lambda: (*_qkv(), torch.randn(S)),
                      "scores are scaled by"),
    "baddbmm_alpha_inf": (lambda q, k, v: _baddbmm(q, k, v, float("inf")), _qkv, "not a finite number"),
    "k_one_head_v_all_heads": (lambda q, k, v: _attend(q, k[:, :1], v), _qkv, "do not pair up"),
    "q_one_head_k_all_heads": (lambda q, k, v: _attend(q[:, :1], k, v), _qkv, "are not (batch..., Sq, Sk)"),
    "k_and_v_batch_broadcast": (lambda q, k, v: _attend(q, k[:1], v[:1]), _qkv, "batch dims differ"),
    "einsum_pv_contracts_queries": (lambda q, k, v: torch.einsum("bhqk,bhqd->bhkd", _sm(q @ _t(k)), v),
                                    _qkv, "is not probabilities·v"),
    "gqa_as_5d_view": (_gqa_as_5d_view, lambda: _qkv(hkv=HKV), "5-d"),
    "sdpa_k_one_head_v_all_heads": (lambda q, k, v: F.scaled_dot_product_attention(q, k[:, :1], v), _qkv,
                                    "without enable_gqa"),
    "weights_returned_detached": (_weights_returned_detached, _qkv, "also returned or reused"),
    "weights_returned_after_a_cast": (_weights_returned_after_a_cast, _qkv, "also returned or reused"),
    "matmul_out_keyword": (lambda q, k, v: _sm(torch.matmul(q, _t(k), out=None) * SCALE) @ v, _qkv,
                           "does not take q and kᵀ as its two operands"),
}


@pytest.mark.parametrize("case", OTHER)
def test_other_functions_are_left_alone(case):
    fn, args, reason = OTHER[case]
    _check(fn, args(), rewrites=0, skipped=1, reason=reason)


# --------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention's layouts and projections (no masks)
# --------------------------------------------------------------------------------------------------------

E, MH, L, SRC = 32, 2, 7, 5


class MHA(nn.Module):
    def __init__(self, mode, need_weights=True, **kw):
        super().__init__()
        torch.manual_seed(1)
        self.mha = nn.MultiheadAttention(E, MH, **kw)
        self.mode, self.need_weights = mode, need_weights

    def forward(self, x, y, z):
        q, k, v = {"self": (x, x, x), "kv_same": (x, y, y), "all_different": (x, y, z)}[self.mode]
        return self.mha(q, k, v, need_weights=self.need_weights)[0]


def _mha_inputs(batch_first=False):
    torch.manual_seed(0)
    if batch_first:
        return torch.randn(B, L, E), torch.randn(B, SRC, E), torch.randn(B, SRC, E)
    return torch.randn(L, B, E), torch.randn(SRC, B, E), torch.randn(SRC, B, E)


MHA_CASES = {
    "self_batch_first_no_weights": (lambda: MHA("self", False, batch_first=True), True),
    "kv_same_batch_first": (lambda: MHA("kv_same", True, batch_first=True), True),
    "all_different": (lambda: MHA("all_different"), False),
    "no_bias": (lambda: MHA("self", bias=False), False),
}


@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention_layouts_are_rewritten(case):
    model, batch_first = MHA_CASES[case]
    _check(model(), _mha_inputs(batch_first), rewrites=1, tol=dict(atol=5e-5, rtol=5e-5))
