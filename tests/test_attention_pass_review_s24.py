"""Review (session 24) of fx_passes/attention: the in-place dropout's training flag, views that reinterpret
the dtype, and constant masks that leave a query row with no visible key.

- ``torch.dropout_(p, 0.5, train=False)`` names its flag ``train`` like ``torch.dropout``; it was read as
  ``training``, missing, so the rewrite dropped half the probabilities where eager drops nothing.
- ``x.view(dtype)`` is a bitcast, not a reshape: float16 scores read as bfloat16 were seen through as a
  leading-dim view, and a bfloat16 mask read as float16 (0 or about -20, no longer a mask) was taken as
  one of 0 and masked-out values when the scores are scaled after it.
- A compile-time constant mask that leaves a row with no visible key (a causal band off by one,
  ``tril(diagonal=-1)``; a bottom-right band with Sq > Sk) has that row for every input: eager gives NaN
  (-inf fill) or the uniform average of v (a finite fill such as finfo.min), the op 0. It was rewritten
  (with at most a note in the report); it is now left alone, reported. Bands that keep a key in every row
  are still rewritten.

Sizes are tiny; every rewritten case compares outputs and gradients with eager.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_pass import _check_same, _qkv, _rewrites
from test_attention_pass_styles import _assert_left_alone_and_reported

import flash_backend
from flash_backend.backend import rewrite_only_backend
from fx_passes._compat import counters

B, H, S, D = 2, 3, 7, 8


def _scores(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5


# --------------------------------------------------------------------------------------------------------
# Dropout's training flag, by the name each spelling gives it
# --------------------------------------------------------------------------------------------------------


def _dropout_in_place_train_false(q, k, v):
    return torch.dropout_(torch.softmax(_scores(q, k), -1), 0.5, train=False) @ v


def _dropout_train_false(q, k, v):
    return torch.dropout(torch.softmax(_scores(q, k), -1), 0.5, train=False) @ v


@pytest.mark.parametrize("fn", [_dropout_in_place_train_false, _dropout_train_false])
def test_dropout_with_train_false_drops_nothing(fn):
    (node,) = _check_same(fn, *_qkv(B=B, H=H, S=S, D=D))
    assert node.kwargs["dropout_p"] == 0.0


def test_dropout_in_place_train_true_reaches_the_op():
    def fn(q, k, v):
        return torch.dropout_(torch.softmax(_scores(q, k), -1), 0.25, train=True) @ v

    torch._dynamo.reset()
    counters.clear()
    (rewrite,) = flash_backend.explain(fn, *_qkv(B=B, H=H, S=S, D=D), print_report=False).rewrites
    assert "dropout=0.25" in rewrite.detail, rewrite.detail


# --------------------------------------------------------------------------------------------------------
# view(dtype) reinterprets the bits: never seen through
# --------------------------------------------------------------------------------------------------------


def _half_qkv():
    torch.manual_seed(0)
    return tuple(t.half() for t in _qkv(B=B, H=H, S=S, D=D))


def _scores_bitcast(q, k, v):
    s = _scores(q, k).view(torch.bfloat16)
    return torch.softmax(s, -1).view(torch.float16) @ v


def _probs_bitcast_round_trip(q, k, v):
    return torch.softmax(_scores(q, k), -1).view(torch.bfloat16).view(torch.float16) @ v


@pytest.mark.parametrize("fn", [_scores_bitcast, _probs_bitcast_round_trip])
def test_view_to_another_dtype_is_left_alone(fn):
    _assert_left_alone_and_reported(fn, _half_qkv(), "reinterprets")


def _mask_bitcast_then_scaled(q, k, v, keep):
    # bfloat16 -1e9 read as float16 is about -20: the "mask" is a bias, scaled by 0.25 with the scores
    m = torch.where(keep, 0.0, -1e9).to(torch.bfloat16).view(torch.float16)
    return torch.softmax((q @ k.transpose(-2, -1) + m) * 0.25, -1) @ v


def test_mask_read_as_another_dtype_is_not_taken_as_a_mask():
    keep = torch.rand(B, 1, 1, S) > 0.5
    args = (*_half_qkv(), keep)
    _assert_left_alone_and_reported(_mask_bitcast_then_scaled, args, "scaled after an additive")


# --------------------------------------------------------------------------------------------------------
# Constant masks with a query row that sees no key
# --------------------------------------------------------------------------------------------------------


def _strictly_causal_finfo_min(q, k, v):
    # query i sees keys 0..i-1: query 0 sees none, and eager averages v uniformly there
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(diagonal=-1)
    return torch.softmax(_scores(q, k).masked_fill(~keep, torch.finfo(q.dtype).min), -1) @ v


def _strictly_causal_where(q, k, v):
    n = q.shape[-2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    return torch.softmax(torch.where(j < i, _scores(q, k), -1e9), -1) @ v


def _strictly_causal_additive_and_padding(q, k, v, pad):
    # transformers' eager mask: where(keep, 0, finfo.min) with the padding folded in
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(diagonal=-1)[None, None] & pad[:, None, None, :]
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    return torch.softmax(_scores(q, k) + mask, -1) @ v


def _bottom_right_band(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return torch.softmax(_scores(q, k).masked_fill(~keep, torch.finfo(q.dtype).min), -1) @ v


def _window_band(q, k, v):
    sq, sk = q.shape[-2], k.shape[-2]
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
    return torch.softmax(_scores(q, k).masked_fill((j > i) | (j <= i - 3), float("-inf")), -1) @ v


def _pad():
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, -2:] = False
    return pad


DEAD_ROWS = {
    "strictly_causal_finfo_min": (_strictly_causal_finfo_min, {}),
    "strictly_causal_where": (_strictly_causal_where, {}),
    "strictly_causal_additive_and_padding": (_strictly_causal_additive_and_padding, {"pad": True}),
    "bottom_right_sq_gt_sk": (_bottom_right_band, {"Sk": 4}),
    "window_sq_gt_sk": (_window_band, {"Sk": 3}),
}


@pytest.mark.parametrize("case", DEAD_ROWS)
def test_constant_mask_with_a_row_that_sees_no_key_is_left_alone(case):
    fn, sizes = DEAD_ROWS[case]
    torch.manual_seed(0)
    args = _qkv(B=B, H=H, S=S, D=D, Sk=sizes.get("Sk")) + ((_pad(),) if sizes.get("pad") else ())
    torch._dynamo.reset()
    counters.clear()
    report = flash_backend.explain(fn, *args, print_report=False)
    assert _rewrites() == (0, 1), report
    (decision,) = [d for d in report.near_misses if d.family == "attention"]
    assert "no visible key for every input" in decision.detail, decision.line()
    got, expected = torch.compile(fn, backend=rewrite_only_backend)(*args), fn(*args)
    torch.testing.assert_close(got, expected, equal_nan=True)


def _causal_diagonal_plus_one(q, k, v):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril(diagonal=1)
    return torch.softmax(_scores(q, k).masked_fill(~keep, torch.finfo(q.dtype).min), -1) @ v


def _causal_finfo_min_and_padding(q, k, v, pad):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
    return torch.softmax(_scores(q, k) + torch.where(keep, 0.0, torch.finfo(q.dtype).min), -1) @ v


KEPT_ROWS = {
    "causal_diagonal_plus_one": (_causal_diagonal_plus_one, {}),
    "causal_finfo_min_and_padding": (_causal_finfo_min_and_padding, {"pad": True}),
    "bottom_right_sq_lt_sk": (_bottom_right_band, {"Sq": 4}),
    "window_sq_lt_sk": (_window_band, {"Sq": 4}),
}


@pytest.mark.parametrize("case", KEPT_ROWS)
def test_constant_mask_that_keeps_a_key_in_every_row_is_rewritten(case):
    fn, sizes = KEPT_ROWS[case]
    torch.manual_seed(0)
    q, k, v = _qkv(B=B, H=H, S=S, D=D)
    q = q[:, :, : sizes.get("Sq", S)].contiguous()
    args = (q, k, v) + ((_pad(),) if sizes.get("pad") else ())
    _check_same(fn, *args)
