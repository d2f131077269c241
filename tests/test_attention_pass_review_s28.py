"""Review (session 28) of fx_passes/attention on spellings of plain attention that real model code uses and
the pass missed: softmax as exp(log_softmax), the score scale and masks passed by keyword, kᵀ by movedim,
an integer additive mask, and nn.MultiheadAttention with a bool key_padding_mask and a float attn_mask.

Every case is compiled through the passes (dynamo + fx_passes, the graph run as plain PyTorch, the flash op
on its CPU reference; test_pass_review_s26's harness) in training (outputs, input and parameter gradients)
and in eval, at odd sizes with random inputs, and asserts the rewrite count and, where it is rewritten, what
the rewrite took (scale, mask, causal).

Now rewritten (each left alone before, with eager's results; each a test here that fails without the change):
- ``torch.log_softmax(s, dim=-1).exp()``, ``F.log_softmax(s, -1).exp()``, ``s.log_softmax(-1).exp()``,
  ``torch.exp(torch.special.log_softmax(s, 3))``: softmax(s), the dtype argument meaning what it means for
  softmax (a cast before the reduction: float64 taken, float16 of float32 inputs refused as a precision loss).
- keyword operands of the score arithmetic: ``torch.mul(s, other=c)``, ``torch.mul(input=s, other=c)``,
  ``s.mul(other=c)``, ``torch.div`` / ``s.div`` / ``torch.true_divide(s, other=c)``, a temperature tensor by
  keyword, ``torch.add(s, other=m)`` and ``torch.sub(s, other=m)`` masks, a written-out softmax divided with
  ``torch.div(e, other=sum)``; ``torch.mul(q, other=c)`` on q is folded into the scale now (it was passed
  to the op as a scaled q); ``torch.masked_fill(input=s, mask=..., value=...)`` and the method form of
  where, ``s.where(keep, -inf)`` (= torch.where(keep, s, -inf)).
- kᵀ as ``k.movedim(-1, -2)``, ``k.movedim(3, 2)``, ``k.movedim(2, 3)``, ``torch.movedim``,
  ``torch.moveaxis``, ``movedim((2, 3), (3, 2))``, by keyword, a (B, S, H, D) projection moved straight into
  kᵀ ``movedim(1, 3)``, ``k.adjoint()``; ``k.swapaxes(axis0=-1, axis1=-2)`` (an internal error before).
  (transpose / swapaxes / swapdims / .mT positionally were rewritten already: kept here as regressions.)
- an integer (int64, int32) or bool additive mask, added in either order or subtracted: eager promotes it to
  the scores' dtype (a float beats any integer) and converts it before adding, so the op gets
  ``m.to(scores.dtype)``: in float16 an int -70000 is -inf, which the constant-mask checks see (a causal
  band folded into is_causal, a dead row refused).

Fixed (another function was rewritten): ``torch.sub(s, 1.0, alpha=1e9)`` is ``s - 1e9``, a "shift" that
rounds the scores away; alpha was ignored on subtraction and the pass rewrote it into plain attention. Now
refused, as alpha on an addition was.

Left alone (reported): log_softmax over another dim, log-probabilities also used elsewhere, exp(log_softmax)
scaled before ·v, ``torch.div(s, other=c, rounding_mode="floor")``, alpha on add / sub of a mask, an integer
mask scaled after it is added, a float16 constant integer mask whose row is all -inf once converted, a movedim
that swaps batch and heads. Not a candidate: ``exp(2 * log_softmax(s))``.

nn.MultiheadAttention with a bool key_padding_mask and a float attn_mask (session 27: "gets no graph"): not
the pass. F._canonical_mask warns ("Support for mismatched key_padding_mask and attn_mask is deprecated")
through warnings.warn, which dynamo cannot trace: the graph breaks inside MultiheadAttention.forward and the
whole module runs in eager (torch.nn frames are not compiled on their own); no graph reaches the passes. With
warnings.warn in torch._dynamo.config.reorderable_logging_functions the graph is whole and the pass rewrites
it with eager's results (tested here), as it does masks of one dtype.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _run
from test_pass_review_s26 import Fn, _check
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting

B, H, SQ, SK, D = 2, 3, 7, 9, 16
SCALE = D**-0.5
FAMILY = "attention"
HALF = dict(atol=5e-3, rtol=5e-3)  # float16: eager and the op each round the probabilities to 1-2 ulps


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _qkv(dtype=torch.float32, b=B, h=H, sq=SQ, sk=SK):
    return tuple(torch.randn(b, h, s, D, dtype=dtype) for s in (sq, sk, sk))


def _t(k):
    return k.transpose(-1, -2)


def _s(q, k):
    return q @ _t(k) * SCALE


def _sm(s):
    return torch.softmax(s, -1)


def _pad():
    """transformers' attention_mask: int64, 1 = token, 0 = padding; every row keeps its first key."""
    pad = (torch.rand(B, SK) > 0.3).long()
    pad[:, 0] = 1
    pad[0, -2:] = 0
    return pad


def _int_mask(pad):
    return (1 - pad[:, None, None, :]) * -10000  # int64


def _keep():
    keep = torch.rand(B, 1, 1, SK) > 0.3
    keep[..., 0] = True
    return keep


def _rewritten(fn, args, detail=None, variant=None, tol=None):
    """One rewrite in training and one in eval, eager's outputs and gradients, and each rewrite's details
    naming `detail` (scale, mask, causal). fn: fn(module, *args) or a module."""
    model = fn if isinstance(fn, nn.Module) else Fn(fn)
    # the decisions as logged: _check collects its own report, and a report nested in another is not
    # removed by identity (fx_passes._report.collecting)
    lines = _Lines()
    logger = logging.getLogger("flash_backend")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        _check(model, args, FAMILY, rewrites=1, text=variant, **(tol or {}))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    rewrites = [line for line in lines.lines if line.startswith(f"[{FAMILY}] rewrote")]
    assert len(rewrites) == 2, lines.lines
    if detail is not None:
        assert all(detail in line for line in rewrites), rewrites


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


# --------------------------------------------------------------------------------------------------------
# softmax as exp(log_softmax)
# --------------------------------------------------------------------------------------------------------


def _written_out_div_other(m, q, k, v):
    s = _s(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.div(e, other=e.sum(-1, keepdim=True)) @ v


LOG_SOFTMAX = {
    # name: (fn(module, q, k, v), text in the rewrite's details)
    "torch_log_softmax_exp": (lambda m, q, k, v: torch.log_softmax(_s(q, k), dim=-1).exp() @ v, "scale=0.25"),
    "f_log_softmax_exp": (lambda m, q, k, v: F.log_softmax(_s(q, k), -1).exp() @ v, "scale=0.25"),
    "method_log_softmax_exp": (lambda m, q, k, v: _s(q, k).log_softmax(-1).exp() @ v, "scale=0.25"),
    "torch_exp_special_log_softmax_dim3": (
        lambda m, q, k, v: torch.exp(torch.special.log_softmax(_s(q, k), 3)) @ v, "scale=0.25"),
    "f_log_softmax_dtype_float64": (
        lambda m, q, k, v: F.log_softmax(_s(q, k), -1, dtype=torch.float64).exp().float() @ v, "scale=0.25"),
    "method_log_softmax_dtype_float32": (
        lambda m, q, k, v: _s(q, k).log_softmax(dim=-1, dtype=torch.float32).exp() @ v, "scale=0.25"),
    "log_softmax_exp_with_key_mask": (
        lambda m, q, k, v, keep: F.log_softmax(_s(q, k).masked_fill(~keep, float("-inf")), -1).exp() @ v,
        "mask [2, 1, 1, 9]"),
}


@pytest.mark.parametrize("case", LOG_SOFTMAX)
def test_log_softmax_exp_is_softmax(case):
    fn, detail = LOG_SOFTMAX[case]
    extra = (_keep(),) if "mask" in case else ()
    _rewritten(fn, (*_qkv(), *extra), detail, variant="log_softmax.exp")


def test_log_softmax_exp_in_bfloat16():
    fn = LOG_SOFTMAX["method_log_softmax_exp"][0]
    _rewritten(fn, _qkv(torch.bfloat16), "scale=0.25", tol=dict(atol=3e-2, rtol=3e-2))


LOG_SOFTMAX_OTHER = {
    # name: (fn, skipped, reason)
    "log_softmax_over_queries": (lambda m, q, k, v: F.log_softmax(_s(q, k), -2).exp() @ v, 1,
                                 "log_softmax over dim -2"),
    "log_softmax_dtype_float16": (
        lambda m, q, k, v: F.log_softmax(_s(q, k), -1, dtype=torch.float16).exp().float() @ v, 1,
        "casts to torch.float16"),
    "log_probabilities_also_returned": (
        lambda m, q, k, v: (lambda lp: (lp.exp() @ v, lp))(_s(q, k).log_softmax(-1)), 1, "other users"),
    "exp_log_softmax_scaled_before_v": (lambda m, q, k, v: (_s(q, k).log_softmax(-1).exp() * 2) @ v, 1,
                                        "not to a matmul with v"),
    "exp_of_twice_log_softmax": (lambda m, q, k, v: torch.exp(2 * _s(q, k).log_softmax(-1)) @ v, 0, None),
}


@pytest.mark.parametrize("case", LOG_SOFTMAX_OTHER)
def test_log_softmax_other_function_is_left_alone(case):
    fn, skipped, reason = LOG_SOFTMAX_OTHER[case]
    _check(Fn(fn), _qkv(), FAMILY, rewrites=0, skipped=skipped, reason=reason)


# --------------------------------------------------------------------------------------------------------
# Operands by keyword
# --------------------------------------------------------------------------------------------------------


KEYWORDS = {
    # name: (fn(module, q, k, v, extra...), extra inputs, text in the rewrite's details)
    "torch_mul_other": (lambda m, q, k, v: _sm(torch.mul(q @ _t(k), other=SCALE)) @ v, (), "scale=0.25"),
    "torch_mul_input_other": (lambda m, q, k, v: _sm(torch.mul(input=q @ _t(k), other=SCALE)) @ v, (),
                              "scale=0.25"),
    "method_mul_other": (lambda m, q, k, v: _sm((q @ _t(k)).mul(other=SCALE)) @ v, (), "scale=0.25"),
    "torch_div_other": (lambda m, q, k, v: _sm(torch.div(q @ _t(k), other=4.0)) @ v, (), "scale=0.25"),
    "method_div_other": (lambda m, q, k, v: _sm((q @ _t(k)).div(other=4.0)) @ v, (), "scale=0.25"),
    "true_divide_other": (lambda m, q, k, v: _sm(torch.true_divide(q @ _t(k), other=4.0)) @ v, (),
                          "scale=0.25"),
    # folded into the scale: it reached the op as a scaled q before (scale=1)
    "q_torch_mul_other": (lambda m, q, k, v: _sm(torch.mul(q, other=SCALE) @ _t(k)) @ v, (), "scale=0.25"),
    "temperature_tensor_other": (lambda m, q, k, v, t: _sm(torch.mul(q @ _t(k), other=t)) @ v,
                                 lambda: (torch.tensor(0.3),), "(on q)"),
    "torch_add_other_mask": (lambda m, q, k, v, b: _sm(torch.add(_s(q, k), other=b)) @ v,
                             lambda: (torch.randn(H, SQ, SK),), "mask [3, 7, 9]"),
    "torch_sub_other_mask": (lambda m, q, k, v, b: _sm(torch.sub(_s(q, k), other=b)) @ v,
                             lambda: (torch.randn(H, SQ, SK),), "mask [3, 7, 9]"),
    "torch_sub_other_mask_alpha_1": (lambda m, q, k, v, b: _sm(torch.sub(_s(q, k), other=b, alpha=1)) @ v,
                                     lambda: (torch.randn(H, SQ, SK),), "mask [3, 7, 9]"),
    "masked_fill_by_keyword": (
        lambda m, q, k, v, keep: _sm(torch.masked_fill(input=_s(q, k), mask=~keep, value=float("-inf"))) @ v,
        lambda: (_keep(),), "mask [2, 1, 1, 9]"),
    "method_where": (lambda m, q, k, v, keep: _sm(_s(q, k).where(keep, float("-inf"))) @ v,
                     lambda: (_keep(),), "mask [2, 1, 1, 9]"),
    "written_out_softmax_div_other": (_written_out_div_other, (), "scale=0.25"),
}


@pytest.mark.parametrize("case", KEYWORDS)
def test_keyword_operands_are_read(case):
    fn, extra, detail = KEYWORDS[case]
    _rewritten(fn, (*_qkv(), *(extra() if callable(extra) else extra)), detail)


KEYWORDS_OTHER = {
    # name: (fn, extra inputs, reason)
    "div_rounding_mode_floor": (
        lambda m, q, k, v: _sm(torch.div(q @ _t(k), other=4.0, rounding_mode="floor")) @ v, (),
        "scores are scaled by"),
    # FIXED: rewritten before (alpha ignored), another function: eager rounds the scores away
    "sub_number_alpha_1e9": (lambda m, q, k, v: _sm(torch.sub(_s(q, k), 1.0, alpha=1e9)) @ v, (),
                             "subtracts with {'alpha': 1000000000.0}"),
    "sub_mask_alpha_2": (lambda m, q, k, v, b: _sm(torch.sub(_s(q, k), other=b, alpha=2)) @ v,
                         lambda: (torch.randn(H, SQ, SK),), "subtracts with {'alpha': 2}"),
    "add_mask_alpha_2": (lambda m, q, k, v, b: _sm(torch.add(_s(q, k), other=b, alpha=2)) @ v,
                         lambda: (torch.randn(H, SQ, SK),), "alpha=2"),
}


@pytest.mark.parametrize("case", KEYWORDS_OTHER)
def test_keyword_forms_of_other_functions_are_left_alone(case):
    fn, extra, reason = KEYWORDS_OTHER[case]
    _check(Fn(fn), (*_qkv(), *(extra() if callable(extra) else extra)), FAMILY, rewrites=0, skipped=1,
           reason=reason)


# --------------------------------------------------------------------------------------------------------
# kᵀ spellings
# --------------------------------------------------------------------------------------------------------


def _kt_attention(kt):
    return lambda m, q, k, v: _sm(q @ kt(k) * SCALE) @ v


def _bshd_movedim(m, q, k, v):
    """k projected as (B, S, H, D) and moved straight into kᵀ (B, H, D, S)."""
    k_bshd = k.transpose(1, 2).contiguous()
    return _sm(q @ k_bshd.movedim(1, 3) * SCALE) @ v


TRANSPOSES = {
    "movedim_minus1_minus2": _kt_attention(lambda k: k.movedim(-1, -2)),
    "movedim_3_2": _kt_attention(lambda k: k.movedim(3, 2)),
    "movedim_2_3": _kt_attention(lambda k: k.movedim(2, 3)),
    "movedim_by_keyword": _kt_attention(lambda k: k.movedim(source=-1, destination=-2)),
    "movedim_sequences": _kt_attention(lambda k: k.movedim((2, 3), (3, 2))),
    "torch_movedim": _kt_attention(lambda k: torch.movedim(k, -1, -2)),
    "torch_moveaxis": _kt_attention(lambda k: torch.moveaxis(k, 3, 2)),
    "bshd_movedim_into_kt": _bshd_movedim,
    "adjoint": _kt_attention(lambda k: k.adjoint()),
    "swapaxes_by_keyword": _kt_attention(lambda k: k.swapaxes(axis0=-1, axis1=-2)),
    # rewritten before this session too: regressions
    "swapaxes": _kt_attention(lambda k: k.swapaxes(-1, -2)),
    "swapdims": _kt_attention(lambda k: k.swapdims(2, 3)),
    "torch_swapaxes": _kt_attention(lambda k: torch.swapaxes(k, 3, 2)),
    "mT": _kt_attention(lambda k: k.mT),
}


@pytest.mark.parametrize("case", TRANSPOSES)
def test_key_transposed_spellings(case):
    _rewritten(TRANSPOSES[case], _qkv(), "scale=0.25")


def test_movedim_that_swaps_batch_and_heads_is_left_alone():
    """k.movedim((0, 1, 2), (1, 0, 3)) is k.permute(1, 0, 3, 2): kᵀ with batch and heads swapped (B == H
    here, so the product is defined): each query meets another (batch, head)'s keys. Reported."""
    fn = _kt_attention(lambda k: k.movedim((0, 1, 2), (1, 0, 3)))
    _check(Fn(fn), _qkv(b=H), FAMILY, rewrites=0, skipped=1, reason="k is permuted by [1, 0, 3, 2]")


# --------------------------------------------------------------------------------------------------------
# Integer and bool additive masks: eager converts them to the scores' dtype before adding
# --------------------------------------------------------------------------------------------------------


def _causal_int32(m, q, k, v):
    """A constant int32 causal mask of -70000: -inf in float16 (a causal band, folded into is_causal), a
    finite -70000 in float32 (folded too since session 32, as a fill at or below -1e4 is: the report says
    so; review s31 M4)."""
    s = q.shape[-2]
    mask = torch.full((s, s), -70000, dtype=torch.int32).triu(1)
    return _sm(_s(q, k) + mask) @ v


INT_MASKS = {
    # name: (fn(module, q, k, v, pad), text in the rewrite's details)
    "int64_added": (lambda m, q, k, v, pad: _sm(_s(q, k) + _int_mask(pad)) @ v, "mask [2, 1, 1, 9]"),
    "int32_added": (lambda m, q, k, v, pad: _sm(_s(q, k) + _int_mask(pad).int()) @ v, "mask [2, 1, 1, 9]"),
    "int64_mask_first": (lambda m, q, k, v, pad: _sm(_int_mask(pad) + _s(q, k)) @ v, "mask [2, 1, 1, 9]"),
    "int64_subtracted": (lambda m, q, k, v, pad: _sm(_s(q, k) - (1 - pad[:, None, None, :]) * 10000) @ v,
                         "mask [2, 1, 1, 9]"),
    "int64_torch_add_other": (lambda m, q, k, v, pad: _sm(torch.add(_s(q, k), other=_int_mask(pad))) @ v,
                              "mask [2, 1, 1, 9]"),
    "int64_int_bias_per_key": (lambda m, q, k, v, pad: _sm(_s(q, k) + pad[:, None, None, :] * 3) @ v,
                               "mask [2, 1, 1, 9]"),
    "bool_added": (lambda m, q, k, v, pad: _sm(_s(q, k) + pad.bool()[:, None, None, :]) @ v,
                   "mask [2, 1, 1, 9]"),
    "int64_with_a_float_mask": (
        lambda m, q, k, v, pad: _sm(_s(q, k) + _int_mask(pad) + torch.zeros(SQ, SK).triu(3)) @ v, "mask"),
}


@pytest.mark.parametrize("case", INT_MASKS)
def test_integer_additive_mask_is_converted_as_eager_promotes_it(case):
    fn, detail = INT_MASKS[case]
    _rewritten(fn, (*_qkv(), _pad()), detail)


def test_integer_mask_of_minus_70000_is_minus_inf_in_float16():
    """Runtime int64 mask, float16 scores: -70000 converts to -inf, as in eager."""

    def big(m, q, k, v, pad):
        return _sm(_s(q, k) + _int_mask(pad) * 7) @ v  # values 0 and -70000

    _rewritten(big, (*_qkv(torch.float16), _pad()), "mask [2, 1, 1, 9]", tol=HALF)


def test_constant_integer_causal_mask_is_converted_before_the_causal_check():
    # the converted values decide: -inf in float16 (nothing taken as -inf), a finite -70000 in float32
    _rewritten(_causal_int32, _qkv(torch.float16, sq=SQ, sk=SQ), "causal)", tol=HALF)
    _rewritten(_causal_int32, _qkv(sq=SQ, sk=SQ), "causal, additive -7e+04 taken as -inf)")


def test_constant_integer_mask_with_a_dead_row_in_float16_is_left_alone():
    """triu(0) masks row 0 entirely: -inf in float16, where eager's softmax gives NaN and the op 0 for every
    input. The constant-mask check sees the converted values (in float32 the row is finite: rewritten)."""

    def dead_row(m, q, k, v):
        mask = torch.full((SQ, SQ), -70000, dtype=torch.int32).triu(0)
        return _sm(_s(q, k) + mask) @ v

    _check(Fn(dead_row), _qkv(torch.float16, sk=SQ), FAMILY, rewrites=0, skipped=1,
           reason="leaves a query row with no visible key", **HALF)
    _rewritten(dead_row, _qkv(sk=SQ), "mask [7, 7]")


INT_MASKS_OTHER = {
    # name: (fn, reason)
    "int_mask_added_with_alpha": (
        lambda m, q, k, v, pad: _sm(torch.add(_s(q, k), _int_mask(pad), alpha=2)) @ v, "alpha=2"),
    "int_mask_scaled_afterwards": (lambda m, q, k, v, pad: _sm((q @ _t(k) + _int_mask(pad)) * SCALE) @ v,
                                   "scaled after an additive mask"),
}


@pytest.mark.parametrize("case", INT_MASKS_OTHER)
def test_integer_mask_other_functions_are_left_alone(case):
    fn, reason = INT_MASKS_OTHER[case]
    _check(Fn(fn), (*_qkv(), _pad()), FAMILY, rewrites=0, skipped=1, reason=reason)


# --------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: bool key_padding_mask with a float attn_mask
# --------------------------------------------------------------------------------------------------------

L, N, E = 7, 3, 32


class _MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, 4)

    def forward(self, x, key_padding_mask, attn_mask):
        return self.mha(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)[0]


def _mha_inputs(kpm_dtype=torch.bool, mask_dtype=torch.float32):
    padded = torch.rand(N, L) < 0.3
    padded[:, 0] = False
    kpm = padded if kpm_dtype == torch.bool else torch.zeros(N, L).masked_fill(padded, float("-inf"))
    attn = torch.randn(L, L) if mask_dtype != torch.bool else torch.rand(L, L) < 0.2
    if mask_dtype == torch.bool:
        attn.fill_diagonal_(False)
    return torch.randn(L, N, E), kpm, attn


def test_mha_mixed_mask_dtypes_break_the_graph_in_canonical_mask():
    """Not the pass: MultiheadAttention's F._canonical_mask calls warnings.warn for mismatched mask dtypes,
    which dynamo cannot trace; nothing of the module is compiled, no graph reaches the passes."""
    model, args = _MHA(), _mha_inputs()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=lambda gm, example_inputs: gm.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e, g in zip(_run(model, args, True), _run(compiled, args, True), strict=True):
            torch.testing.assert_close(g, e)
    breaks = " ".join(counters["graph_break"])
    assert "warn" in breaks, dict(counters["graph_break"])
    assert counters["flash"][FAMILY] == 0


MHA_MASK_DTYPES = {"bool_padding_float_mask": (torch.bool, torch.float32),
                   "bool_padding_bool_mask": (torch.bool, torch.bool),
                   "float_padding_float_mask": (torch.float32, torch.float32)}


@pytest.mark.parametrize("dtypes", MHA_MASK_DTYPES.values(), ids=MHA_MASK_DTYPES.keys())
def test_mha_masks_are_rewritten_once_the_graph_is_whole(dtypes):
    """bool key_padding_mask + float attn_mask rewritten with eager's results when warnings.warn does not
    break the graph; masks of one dtype need nothing."""
    model, args = _MHA(), _mha_inputs(*dtypes)
    with warnings.catch_warnings(), torch._dynamo.config.patch(reorderable_logging_functions={warnings.warn}):
        warnings.simplefilter("ignore")
        _rewritten(model, args)


# --------------------------------------------------------------------------------------------------------
# A matmul of the pattern that also writes into out= (found after the review, s28)
# --------------------------------------------------------------------------------------------------------


def _pv_into(q, k, v, buf):
    torch.matmul(torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1), v, out=buf)
    return buf


def _scores_into(q, k, v, buf):
    torch.matmul(q, k.transpose(-2, -1), out=buf)
    return torch.softmax(buf * 0.3, -1) @ v, buf


@pytest.mark.parametrize(("fn", "buf_shape", "skipped"), [(_pv_into, (2, 3, 7, 8), 1),
                                                          (_scores_into, (2, 3, 7, 9), 0)],
                         ids=["p_v_into_out", "scores_into_out"])
def test_matmul_writing_into_out_is_not_fused_away(fn, buf_shape, skipped):
    """``torch.matmul(p, v, out=buf)`` returned as buf: fused, the matmul was erased and buf never written
    (zeros returned). Now a near miss (fx_passes/_match.out_writer). Scores written into a buffer the
    softmax then reads are not a q·kᵀ the pass sees (no candidate). Inference only: out= has no autograd."""
    q, k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    with torch.no_grad():
        expected = fn(q, k, v, torch.zeros(buf_shape))
        torch._dynamo.reset()
        counters.clear()
        with collecting() as report:
            got = torch.compile(fn, backend=rewrite_only_backend)(q, k, v, torch.zeros(buf_shape))
    assert counters["flash"]["attention"] == 0, str(report)
    assert counters["flash"]["attention_skipped"] == skipped, str(report)
    if skipped:
        assert any("out=" in d.detail for d in report.near_misses), str(report)
    for e, g in zip(expected if isinstance(expected, tuple) else (expected,),
                    got if isinstance(got, tuple) else (got,), strict=True):
        torch.testing.assert_close(g, e)
