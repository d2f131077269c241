"""Review (session 30) of fx_passes/attention: autocast, masks cast with a tensor template, GQA via flatten.

Each case runs through dynamo + the attention rewrite (the graph as plain PyTorch, the flash op on its CPU
reference: test_attention_pass's helpers) and asserts the rewrite count and what the rewrite took.

Fixed, another function was rewritten:
- F.scaled_dot_product_attention under autocast (entered around the compiled call, or a region inside it)
  was rewritten into flash_attention on the fp32 q, k, v: it ran in fp32 and returned fp32 where eager's SDPA,
  which autocast casts to bfloat16, returns bfloat16 (backend="flash" too). Now q, k, v and a float attn_mask
  are cast to the autocast dtype in the graph, as autocast does.
- A constant mask cast with a tensor template (``torch.full((S, S), -inf).triu(0).to(q)``, ``.type_as(q)``)
  was taken for a runtime mask (the template is a graph input), so the query row it leaves without a key was
  not seen: the op gave 0 there, eager NaN. The template is read for its dtype and device only: such a mask
  is a constant now, refused for its dead row, and recognised as causal where it is (Meta's Llama reference,
  ``torch.hstack([zeros(S, p), triu(full(-inf), 1)]).type_as(h)``: bottom-right causal).

- A masked-positions condition or-ed from a constant and a runtime padding mask (``triu(0) | ~pad``, also
  ``~(tril(-1) & pad)``, ``where(~m, s, -inf)``, an additive ``where(m, finfo.min, 0)``) was looked at whole
  for constant dead rows, and a runtime term hid the constant one's: rewritten, 0 where eager gives NaN or the
  average of v. Each term is looked at now (_visible_parts).

Now recognised (left alone before):
- Hand-written attention under autocast: q·kᵀ and ·v compute in bfloat16 from fp32 (or mixed) q, k, v; the
  op gets them cast as autocast casts them (baddbmm's bias too). Compared with eager under the same autocast
  and with an fp64 run: the rewrite is no further from fp64 than eager's autocast is (twice, plus a floor).
- ``scores + mask.type_as(scores)``: "cannot tell the scores from the mask" before (the cast's template read
  as a value).
- GQA's repeat_kv written with ``flatten(1, 2)``: k and v reach the op un-repeated (enable_gqa).
- A constant causal term of a masked-positions condition next to a padding mask (two masked_fills,
  ``triu(1) | ~pad``, ``~(tril() & pad)``, where with the fill first) becomes the causal band and the padding
  mask alone (a (B, 1, S, S) mask before), as a keep condition's factors already did.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from test_attention_pass import (  # noqa: F401  (_cold_inductor_cache: an autouse fixture)
    _check_same,
    _cold_inductor_cache,
    _flash_nodes,
    _rewrites,
    _run_rewritten,
)

from fx_passes import collecting

B, H, S, D = 2, 4, 8, 16
MIN = torch.finfo(torch.float32).min
NEG_INF = float("-inf")


def _qkv(dtype=torch.float32, hkv=H):
    return (torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, hkv, S, D, dtype=dtype),
            torch.randn(B, hkv, S, D, dtype=dtype))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------------------
# Autocast
# --------------------------------------------------------------------------------------------------------


def _check_autocast(fn, *args, around=True, device="cpu"):
    """fn compiled under bf16 autocast (around: entered around the call; else fn enters it itself) is one
    flash_attention, returns eager's dtype, and its output and input gradients are no further from an fp64
    run of fn (autocast leaves fp64 alone) than eager's under the same autocast are. Returns the op node."""
    ctx = torch.autocast(device, dtype=torch.bfloat16) if around else contextlib.nullcontext()
    leaves = [[a.detach().clone().requires_grad_(a.is_floating_point()) for a in args] for _ in range(3)]
    ref64 = fn(*[a.double() if a.is_floating_point() else a for a in leaves[0]])
    with ctx:
        ref = fn(*leaves[1])
        with collecting() as report:
            out, graphs = _run_rewritten(fn, *leaves[2])
    assert _rewrites() == (1, 0), str(report)
    assert out.dtype == ref.dtype == torch.bfloat16
    grad = torch.randn_like(ref64)
    for r in (ref64, ref, out):
        r.backward(grad.to(r.dtype))

    def close(got, want, base):
        err, base_err = ((t.double() - want).abs().max().item() for t in (got, base))
        assert err <= 2 * base_err + 2e-2, (err, base_err)  # bf16: a floor of a few ulp at 1

    close(out, ref64, ref)
    for r, e, a in zip(*leaves, strict=True):
        if a.is_floating_point():
            close(a.grad, r.grad, e.grad)
    nodes = _flash_nodes(graphs)
    assert len(nodes) == 1
    return nodes[0]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _sdpa_float_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_inside(q, k, v):
    with _bf16_autocast():
        return F.scaled_dot_product_attention(q, k, v)


SDPA_CASES = {
    "plain": (_sdpa, ()),
    "float_mask": (_sdpa_float_mask, (torch.randn(B, 1, S, S),)),
    "is_causal": (_sdpa_causal, ()),
}


@pytest.mark.parametrize("case", SDPA_CASES, ids=list(SDPA_CASES))
def test_sdpa_under_autocast_computes_in_the_autocast_dtype(case):
    """BUG (fixed): flash_attention ran on the fp32 q, k, v and returned fp32 where eager returns bf16."""
    fn, extra = SDPA_CASES[case]
    _check_autocast(fn, *_qkv(), *extra)


def test_sdpa_in_an_autocast_region_computes_in_the_autocast_dtype():
    _check_autocast(_sdpa_inside, *_qkv(), around=False)


def test_sdpa_under_autocast_casts_the_float_mask_as_autocast_does():
    """Autocast hands SDPA the mask in bf16: the op gets that cast too, eager's values exactly."""
    q, k, v = _qkv()
    m = torch.randn(B, 1, S, S)
    node = _check_autocast(_sdpa_float_mask, q, k, v, m)
    mask = node.kwargs["attn_mask"]
    assert mask.meta["example_value"].dtype == torch.bfloat16


def test_sdpa_under_autocast_with_q_k_normed_in_fp32():
    """q and k in fp32 (a norm computed in fp32 and not cast back), v in bf16: SDPA under autocast casts
    them all (left alone as "q, k, v dtypes differ" before)."""
    q, k, v = _qkv()
    _check_autocast(_sdpa, q, k, v.bfloat16())


def test_sdpa_fp64_under_autocast_stays_fp64():
    """Autocast leaves fp64 alone: no cast, the op runs in fp64 as eager does."""
    q, k, v = _qkv(torch.float64)
    with _bf16_autocast():
        ref = _sdpa(q, k, v)
        out, graphs = _run_rewritten(_sdpa, q, k, v)
    assert _rewrites() == (1, 0)
    assert out.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(out, ref)


def _hf_eager(q, k, v, m):
    w = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + m
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=True)
    return torch.matmul(w, v).transpose(1, 2).contiguous()


def _causal_masked_fill(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), NEG_INF)
    return s.softmax(-1) @ v


def _einsum(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def _q_scaled(q, k, v):  # timm: q = q * self.scale in fp32, before the matmul's cast
    return ((q * D**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v


def _bloom(q, k, v, alibi):
    q3, v3 = q.reshape(B * H, S, D), v.reshape(B * H, S, D)
    k3 = k.reshape(B * H, S, D).transpose(1, 2)
    s = alibi.baddbmm(batch1=q3, batch2=k3, beta=1.0, alpha=D**-0.5)  # autocast casts alibi too
    p = F.softmax(s.view(B, H, S, S), dim=-1, dtype=torch.float32).to(q.dtype).view(B * H, S, S)
    return torch.bmm(p, v3).view(B, H, S, D)


def _gqa(q, k, v):
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    return (q @ k.transpose(2, 3) * D**-0.5).softmax(-1) @ v


def _inside(q, k, v):
    with _bf16_autocast():
        return (q @ k.transpose(-1, -2) * D**-0.5).softmax(-1) @ v


def _llama_mask():
    return torch.zeros(B, 1, S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), MIN)


HAND_CASES = {
    "hf_eager_fp32_softmax": (_hf_eager, lambda: (*_qkv(), _llama_mask()), True),
    "causal_masked_fill": (_causal_masked_fill, _qkv, True),
    "einsum": (_einsum, _qkv, True),
    "q_scaled_in_fp32": (_q_scaled, _qkv, True),
    "bloom_baddbmm_alibi": (_bloom, lambda: (*_qkv(), torch.randn(B * H, 1, S)), True),
    "gqa_repeat_interleave": (_gqa, lambda: _qkv(hkv=2), True),
    "fp16_inputs": (_causal_masked_fill, lambda: _qkv(torch.float16), True),
    "region_inside": (_inside, _qkv, False),
}


@pytest.mark.parametrize("case", HAND_CASES, ids=list(HAND_CASES))
def test_hand_written_attention_under_autocast_is_rewritten(case):
    fn, make, around = HAND_CASES[case]
    _check_autocast(fn, *make(), around=around)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["hf_eager_fp32_softmax", "causal_masked_fill", "einsum",
                                  "gqa_repeat_interleave"])
def test_cuda_hand_written_attention_under_autocast_is_rewritten(case):
    """CUDA's autocast lists differ from the CPU's (softmax runs in fp32 there): an fp32 model trained under
    bf16 autocast on the GPU, its attention rewritten and within eager's own error, the flash kernels run."""
    fn, make, around = HAND_CASES[case]
    _check_autocast(fn, *(t.cuda() for t in make()), around=around, device="cuda")


def test_hand_written_under_autocast_with_fp32_q_k_and_bf16_v():
    q, k, v = _qkv()
    node = _check_autocast(_causal_masked_fill, q, k, v.bfloat16())
    assert node.kwargs["is_causal"] is True


def test_hand_written_under_autocast_gqa_passes_k_v_unrepeated_and_cast():
    node = _check_autocast(_gqa, *_qkv(hkv=2))
    assert node.kwargs["enable_gqa"] is True
    k = node.args[1].meta["example_value"]
    assert k.shape[1] == 2 and k.dtype == torch.bfloat16


def _temperature_fp32_after_cast(q, k, v, t):
    return (q @ k.transpose(-1, -2) * t).softmax(-1) @ v


def test_fp32_temperature_on_autocast_scores_is_left_alone():
    """bf16 scores times an fp32 (H, 1, 1) temperature promote to fp32 before the softmax: the scale is not
    the scores' dtype, so it does not move onto the bf16 q; left alone, eager's values."""
    q, k, v = _qkv()
    t = torch.rand(H, 1, 1) + 0.5
    with _bf16_autocast():
        ref = _temperature_fp32_after_cast(q, k, v, t)
        out, _ = _run_rewritten(_temperature_fp32_after_cast, q, k, v, t)
    assert _rewrites() == (0, 1)
    torch.testing.assert_close(out, ref)


# --------------------------------------------------------------------------------------------------------
# Masks cast with a tensor template: m.type_as(t), m.to(t)
# --------------------------------------------------------------------------------------------------------


def _dead_row_to_q(q, k, v):
    m = torch.full((S, S), NEG_INF).triu(0).to(q)  # row 0: every key -inf
    return (q @ k.transpose(-1, -2) * 0.25 + m).softmax(-1) @ v


def _dead_row_type_as_q(q, k, v):
    m = torch.full((S, S), NEG_INF).triu(0).type_as(q)
    return (q @ k.transpose(-1, -2) * 0.25 + m).softmax(-1) @ v


@pytest.mark.parametrize("fn", [_dead_row_to_q, _dead_row_type_as_q], ids=["to_q", "type_as_q"])
def test_constant_mask_cast_with_a_template_and_a_dead_row_is_left_alone(fn):
    """BUG (fixed): the mask was a runtime one (its template q is a graph input), its dead row unseen: the op
    gave 0 on row 0 where eager gives NaN."""
    q, k, v = _qkv()
    ref = fn(q, k, v)
    with collecting() as report:
        out, _ = _run_rewritten(fn, q, k, v)
    assert _rewrites() == (0, 1), str(report)
    assert any("no visible key" in d.detail for d in report.near_misses), str(report)
    torch.testing.assert_close(out, ref, equal_nan=True)


def _causal_type_as_q(q, k, v):
    m = torch.triu(torch.full((S, S), NEG_INF), diagonal=1).type_as(q)
    return F.softmax(q @ k.transpose(-1, -2) / 4 + m, dim=-1) @ v


def _causal_to_q(q, k, v):
    keep = torch.ones(S, S, dtype=torch.bool).tril().to(q.device)
    m = torch.zeros(S, S).masked_fill(~keep, MIN).to(q)
    return F.softmax(q @ k.transpose(-1, -2) / 4 + m, dim=-1) @ v


def _causal_type_as_scores(q, k, v):
    s = q @ k.transpose(-1, -2) / 4
    s = s + torch.triu(torch.full((S, S), NEG_INF), diagonal=1).type_as(s)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [_causal_type_as_q, _causal_to_q, _causal_type_as_scores],
                         ids=["type_as_q", "to_q", "type_as_scores"])
def test_causal_mask_cast_with_a_template_is_causal(fn):
    nodes = _check_same(fn, *_qkv())
    assert nodes[0].kwargs["is_causal"] is True and nodes[0].kwargs["attn_mask"] is None


def _meta_llama(xq, keys, values, start_pos=3):
    """Meta's Llama reference attention (KV-cache decoding with start_pos cached keys)."""
    seqlen = xq.shape[1]
    mask = torch.full((seqlen, seqlen), NEG_INF, device=xq.device)
    mask = torch.triu(mask, diagonal=1)
    mask = torch.hstack([torch.zeros((seqlen, start_pos), device=xq.device), mask]).type_as(xq)
    xq, keys, values = (t.transpose(1, 2) for t in (xq, keys, values))
    scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(D)
    scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    return torch.matmul(scores, values).transpose(1, 2).contiguous().view(xq.shape[0], seqlen, -1)


def test_meta_llama_hstack_mask_is_bottom_right_causal():
    xq, keys, values = torch.randn(B, 5, H, D), torch.randn(B, 8, H, D), torch.randn(B, 8, H, D)
    node = _check_same(_meta_llama, xq, keys, values)[0]
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    assert node.kwargs["causal_alignment"] == "bottom_right"


def _runtime_mask_type_as_scores(q, k, v, am):
    s = q @ k.transpose(-1, -2) * 0.25
    s = s + ((1 - am[:, None, None, :]) * -10000).type_as(s)
    return s.softmax(-1) @ v


def test_runtime_mask_type_as_scores_is_rewritten_with_the_mask():
    """Left alone before: "cannot tell the scores from the mask" (the template read as a value)."""
    am = torch.ones(B, S, dtype=torch.long)
    am[0, -3:] = 0
    nodes = _check_same(_runtime_mask_type_as_scores, *_qkv(), am)
    assert nodes[0].kwargs["attn_mask"] is not None


def _template_is_a_value(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    return (s + s.softmax(-1).type_as(q)).softmax(-1) @ v  # the cast's value reads the scores


def test_cast_of_the_scores_values_is_not_a_mask():
    q, k, v = _qkv()
    ref = _template_is_a_value(q, k, v)
    out, _ = _run_rewritten(_template_is_a_value, q, k, v)
    assert _rewrites()[0] == 0
    torch.testing.assert_close(out, ref)


# --------------------------------------------------------------------------------------------------------
# Masked-positions conditions built from a constant and a runtime padding mask (a | b, ~(a & b))
# --------------------------------------------------------------------------------------------------------


def _pad():
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, -3:] = False
    return pad


def _scores(q, k):
    return q @ k.transpose(-1, -2) * 0.25


def _or_dead(q, k, v, pad):
    m = torch.ones(S, S, dtype=torch.bool).triu(0) | ~pad[:, None, None, :]  # row 0: every key masked
    return _scores(q, k).masked_fill(m, NEG_INF).softmax(-1) @ v


def _or_dead_finite(q, k, v, pad):
    m = torch.ones(S, S, dtype=torch.bool).triu(0) | ~pad[:, None, None, :]
    return _scores(q, k).masked_fill(m, MIN).softmax(-1) @ v


def _not_and_dead(q, k, v, pad):
    keep = torch.ones(S, S, dtype=torch.bool).tril(-1) & pad[:, None, None, :]
    return _scores(q, k).masked_fill(~keep, NEG_INF).softmax(-1) @ v


def _where_not_or_dead(q, k, v, pad):
    m = torch.ones(S, S, dtype=torch.bool).triu(0) | ~pad[:, None, None, :]
    return torch.where(~m, _scores(q, k), NEG_INF).softmax(-1) @ v


def _additive_where_or_dead(q, k, v, pad):
    m = torch.ones(S, S, dtype=torch.bool).triu(0) | ~pad[:, None, None, :]
    return (_scores(q, k) + torch.where(m, MIN, 0.0)).softmax(-1) @ v


DEAD_OR = {
    "masked_fill_or_inf": _or_dead,
    "masked_fill_or_finfo_min": _or_dead_finite,
    "masked_fill_not_and": _not_and_dead,
    "where_not_or": _where_not_or_dead,
    "additive_where_or": _additive_where_or_dead,
}


@pytest.mark.parametrize("case", DEAD_OR, ids=list(DEAD_OR))
def test_constant_dead_row_or_ed_with_a_runtime_mask_is_left_alone(case):
    """BUG (fixed): the constant term's dead row (row 0 sees no key) was not looked for in a condition with
    a runtime term; rewritten, the op gave 0 there where eager gives NaN (-inf) or the average of v
    (finfo.min; the additive where's matched on the CPU reference only, not the kernels' 0)."""
    fn = DEAD_OR[case]
    q, k, v = _qkv()
    ref = fn(q, k, v, _pad())
    with collecting() as report:
        out, _ = _run_rewritten(fn, q, k, v, _pad())
    assert _rewrites() == (0, 1), str(report)
    assert any("no visible key" in d.detail for d in report.near_misses), str(report)
    torch.testing.assert_close(out, ref, equal_nan=True)


def _or_causal(q, k, v, pad):
    m = torch.ones(S, S, dtype=torch.bool).triu(1) | ~pad[:, None, None, :]
    return _scores(q, k).masked_fill(m, NEG_INF).softmax(-1) @ v


def _two_fills(q, k, v, pad):
    s = _scores(q, k).masked_fill(pad.unsqueeze(1).unsqueeze(2) == 0, NEG_INF)
    s = s.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), NEG_INF)
    return torch.softmax(s, dim=-1) @ v


def _not_and_causal(q, k, v, pad):
    keep = torch.ones(S, S, dtype=torch.bool).tril() & pad[:, None, None, :]
    return _scores(q, k).masked_fill(~keep, MIN).softmax(-1) @ v


def _where_fill_first(q, k, v, pad):
    s = torch.where(torch.ones(S, S, dtype=torch.bool).triu(1), NEG_INF, _scores(q, k))
    return torch.where(~pad[:, None, None, :], NEG_INF, s).softmax(-1) @ v


CAUSAL_AND_PAD = {"or": _or_causal, "two_fills": _two_fills, "not_and": _not_and_causal,
                  "where_fill_first": _where_fill_first}


@pytest.mark.parametrize("case", CAUSAL_AND_PAD, ids=list(CAUSAL_AND_PAD))
def test_constant_causal_term_of_a_masked_condition_is_the_causal_band(case):
    """The padding mask reaches the op alone, (B, 1, 1, S), with the causal band as the (-1, 0) window (the
    whole (B, 1, S, S) condition before)."""
    node = _check_same(CAUSAL_AND_PAD[case], *_qkv(), _pad())[0]
    assert node.kwargs["window_size"] == (-1, 0)
    assert tuple(node.kwargs["attn_mask"].meta["example_value"].shape) == (B, 1, 1, S)


def _bottom_right_and_pad(q, k, v, pad):
    sq, sk = q.shape[-2], k.shape[-2]
    s = _scores(q, k).masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), NEG_INF)
    return s.masked_fill(~pad[:, None, None, :], NEG_INF).softmax(-1) @ v


def test_constant_bottom_right_term_of_a_masked_condition_is_the_band():
    q = torch.randn(B, H, 5, D)
    _, k, v = _qkv()
    node = _check_same(_bottom_right_and_pad, q, k, v, _pad())[0]
    assert node.kwargs["window_size"] == (-1, 0) and node.kwargs["causal_alignment"] == "bottom_right"


def _or_triu2(q, k, v, pad):  # keys up to i + 1: not causal
    m = torch.ones(S, S, dtype=torch.bool).triu(2) | ~pad[:, None, None, :]
    return _scores(q, k).masked_fill(m, NEG_INF).softmax(-1) @ v


def test_constant_term_that_is_not_causal_stays_in_the_mask():
    node = _check_same(_or_triu2, *_qkv(), _pad())[0]
    assert node.kwargs["is_causal"] is False and "window_size" not in node.kwargs
    assert tuple(node.kwargs["attn_mask"].meta["example_value"].shape)[-2:] == (S, S)


def test_masked_condition_with_a_constant_term_under_dynamic_shapes():
    """A constant term against symbolic sizes stays in the whole mask (an internal error once split)."""
    nodes = _check_same(_two_fills, *_qkv(), _pad(), options=dict(dynamic=True))
    assert nodes[0].kwargs["attn_mask"] is not None


# --------------------------------------------------------------------------------------------------------
# GQA: repeat_kv through flatten(1, 2)
# --------------------------------------------------------------------------------------------------------


def _repeat_kv_flatten(x, n):
    return x.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(1, 2)


def _gqa_flatten(q, k, v):
    k, v = _repeat_kv_flatten(k, 2), _repeat_kv_flatten(v, 2)
    return (q @ k.transpose(2, 3) * 0.25).softmax(-1) @ v


def _tiled_flatten(q, k, v):  # k heads tiled (h0, h1, h0, h1), not interleaved: no GQA
    b, h, s, d = k.shape
    k, v = (t.unsqueeze(1).expand(-1, 2, -1, -1, -1).flatten(1, 2) for t in (k, v))
    return (q @ k.transpose(2, 3) * 0.25).softmax(-1) @ v


def test_repeat_kv_with_flatten_is_gqa():
    node = _check_same(_gqa_flatten, *_qkv(hkv=2))[0]
    assert node.kwargs["enable_gqa"] is True
    assert node.args[1].meta["example_value"].shape[1] == 2


def test_heads_tiled_with_flatten_are_not_gqa():
    node = _check_same(_tiled_flatten, *_qkv(hkv=2))[0]
    assert node.kwargs["enable_gqa"] is False
    assert node.args[1].meta["example_value"].shape[1] == H
