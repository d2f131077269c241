"""Adversarial review of the cross-entropy pass's session-28 additions (fx_passes/cross_entropy.py): LM heads
written as ``torch.addmm(b, x, w.t())`` or a Linear einsum, and row selections of the logits (narrow, select,
an unbind item, a bool mask of leading dims) fused as the loss over every row with the other rows' targets
ignored.

Every case compiles through the passes (dynamo + fx_passes, run as plain PyTorch) in training and eval with
random inputs at odd sizes, and asserts the rewrite count and eager's losses, logits and gradients (hidden
states, weight, bias).

No wrong rewrite found. Rewritten with eager's values: narrow with a negative start or length 0 (mean NaN,
sum 0, an empty per-row loss), select on dim -2 / with a negative index, unbind of a batch of 1, labels
selected differently from the logits (the pairing is kept), two selections with the shift, reduction='none'
of a select of 3-d logits (order and shape), mean with ignored targets and label smoothing (the
denominator), every selected target ignored, an ignore_index out of the class range, a mask that is all
False, a mask from the hidden states, selections after the fp32 upcast, fp16 / bf16 logits, dynamic=True.
Left alone: einsums "bii,vi->bv", "bsd,vd->bvs", an ellipsis on the weight, one broadcasting the contracted
dim; addmm with a (M, V) or (M, 1) bias, beta != 1, alpha = -1, out=.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_cross_entropy_review_s28 import B, T, _labels  # 33 rows, labels with every 4th one ignored
from test_norm_dense_ce_review_s25 import _check as _check_dynamic
from test_norm_dense_ce_review_s25 import _compile
from test_pass_review_s26 import Fn, N, V, _check
from torch._dynamo.utils import counters


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _seq(b=B, t=T):
    return torch.randn(b, t, N), _labels(b, t)


def _ce(loss):
    """A model: the head's logits lg, loss(lg, labels, hidden); returns the loss and the logits."""
    def fn(m, h, y):
        lg = m.head(h)
        return loss(lg, y, h), lg

    return Fn(fn)


def _rewritten(loss, inputs=None, **kwargs):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(_ce(loss), inputs or _seq(), "cross_entropy", rewrites=1, **kwargs)


# ========================================================================================================
# selections: indices, dims and shapes that are easy to get wrong (all rewritten with eager's values)
# ========================================================================================================

SELECTIONS = {
    "narrow_negative_start": lambda lg, y, h: F.cross_entropy(lg.narrow(1, -3, 2).reshape(-1, V),
                                                              y[:, T - 3:T - 1].reshape(-1)),
    "narrow_negative_start_none": lambda lg, y, h: F.cross_entropy(
        lg.narrow(1, -3, 2).reshape(-1, V), y[:, T - 3:T - 1].reshape(-1), reduction="none"),
    "select_dim_minus2": lambda lg, y, h: F.cross_entropy(lg.select(-2, 4), y[:, 4], reduction="none"),
    "select_negative_index": lambda lg, y, h: F.cross_entropy(lg.select(1, -2), y[:, -2], reduction="sum"),
    "select_batch_negative": lambda lg, y, h: F.cross_entropy(lg.select(0, -2), y[-2], reduction="none"),
    # logits and labels selected differently: the pairing of the selection is kept
    "labels_selected_differently": lambda lg, y, h: F.cross_entropy(lg.narrow(1, 1, 5).reshape(-1, V),
                                                                    y.narrow(1, 0, 5).reshape(-1),
                                                                    reduction="none"),
    "labels_flipped": lambda lg, y, h: F.cross_entropy(lg[:, 2:9].reshape(-1, V),
                                                       y[:, 2:9].flip(1).reshape(-1), reduction="none"),
    "two_selections_and_shift": lambda lg, y, h: F.cross_entropy(
        lg.narrow(0, 1, 2)[:, :-1].select(0, 1), y[2, 1:], reduction="none"),
    "step_slice_none": lambda lg, y, h: F.cross_entropy(lg[:, 1::3].reshape(-1, V), y[:, :-1:3].reshape(-1),
                                                        reduction="none"),
    "select_then_narrow": lambda lg, y, h: F.cross_entropy(lg.select(1, 5).narrow(0, 1, 2), y[1:, 5]),
    "int_index_2d": lambda lg, y, h: F.cross_entropy(lg[1, 2:7], y[0, 3:8], reduction="none"),
    # mean over the selection with ignored targets inside it, label smoothing on: the denominator
    "mean_ignored_inside_smoothing": lambda lg, y, h: F.cross_entropy(
        lg[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), label_smoothing=0.25),
    "mean_custom_ignore_index_smoothing": lambda lg, y, h: F.cross_entropy(
        lg.narrow(1, 2, 6).reshape(-1, V), (y[:, 2:8] % 5).reshape(-1), ignore_index=3, label_smoothing=0.4),
    "ignore_index_out_of_range": lambda lg, y, h: F.cross_entropy(
        lg.narrow(1, 2, 6).reshape(-1, V), y[:, 2:8].masked_fill(y[:, 2:8] < 0, 1000).reshape(-1),
        ignore_index=1000, label_smoothing=0.1),
    "ignore_index_is_a_class_none": lambda lg, y, h: F.cross_entropy(
        lg.narrow(1, 2, 6).reshape(-1, V), (y[:, 2:8] % 5).reshape(-1), ignore_index=0, reduction="none"),
    # every selected target ignored: eager's mean is NaN (0 / 0), its gradients 0
    "all_selected_ignored_mean": lambda lg, y, h: F.cross_entropy(
        lg.narrow(1, 0, 4).reshape(-1, V), torch.full_like(y[:, :4], -100).reshape(-1)),
    "all_selected_ignored_smoothing": lambda lg, y, h: F.cross_entropy(
        lg.select(1, 3), torch.full_like(y[:, 3], -100), label_smoothing=0.2),
    # the mask: from the labels, from the hidden states (not from the logits: fine)
    "mask_of_hidden_states": lambda lg, y, h: F.cross_entropy(lg[h[..., 0] > 0], y[h[..., 0] > 0]),
    "mask_of_hidden_states_none": lambda lg, y, h: F.cross_entropy(lg[h.sum(-1) > 0], y[h.sum(-1) > 0],
                                                                   reduction="none"),
    "mask_then_smoothing_mean": lambda lg, y, h: F.cross_entropy(lg[y % 2 == 0], y[y % 2 == 0],
                                                                 label_smoothing=0.3),
    "shift_then_mask": lambda lg, y, h: F.cross_entropy(lg[:, :-1][y[:, 1:] != -100],
                                                        y[:, 1:][y[:, 1:] != -100], reduction="sum"),
    "mask_of_batch_then_select": lambda lg, y, h: F.cross_entropy(lg[y[:, 0] >= 0].select(1, 2),
                                                                  y[y[:, 0] >= 0][:, 2], reduction="none"),
    # after the fp32 upcast
    "upcast_then_narrow": lambda lg, y, h: F.cross_entropy(lg.float().narrow(1, 1, T - 1).reshape(-1, V),
                                                           y[:, :-1].reshape(-1)),
    "upcast_then_mask": lambda lg, y, h: F.cross_entropy(lg.float()[y != -100], y[y != -100],
                                                         reduction="none"),
    "upcast_then_unbind": lambda lg, y, h: F.cross_entropy(lg.float().unbind(1)[-1], y[:, -1]),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_selection_is_rewritten_with_eagers_values(name):
    _rewritten(SELECTIONS[name])


def test_unbind_of_a_batch_of_one():
    _rewritten(lambda lg, y, h: F.cross_entropy(lg.unbind(0)[0], y[0], reduction="none"), _seq(b=1))


def test_select_of_a_batch_of_one():
    _rewritten(lambda lg, y, h: F.cross_entropy(lg.select(0, -1), y[0], label_smoothing=0.1), _seq(b=1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_narrow_of_length_zero(reduction):
    # no rows: eager's mean is NaN, its sum 0, its per-row loss empty; its gradients 0
    _rewritten(lambda lg, y, h: F.cross_entropy(lg.narrow(1, 2, 0).reshape(-1, V), y[:, 2:2].reshape(-1),
                                                reduction=reduction))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mask_that_is_all_false(reduction):
    def loss(lg, y, h):
        keep = y > 10**6
        return F.cross_entropy(lg[keep], y[keep], reduction=reduction, label_smoothing=0.1)

    _rewritten(loss)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss_selected_after_the_log_softmax(reduction):
    _rewritten(lambda lg, y, h: F.nll_loss(F.log_softmax(lg, -1).narrow(1, -4, 3).select(0, -1),
                                           y[-1, T - 4:T - 1], reduction=reduction))


# ========================================================================================================
# selections under dynamic=True (one compile, several sizes)
# ========================================================================================================

DYNAMIC = {
    "narrow_shift": lambda lg, y: F.cross_entropy(lg.narrow(1, 1, lg.shape[1] - 1).reshape(-1, V),
                                                  y[:, :-1].reshape(-1)),
    "select_last": lambda lg, y: F.cross_entropy(lg.select(1, -1), y[:, -1], reduction="none"),
    "slice_none": lambda lg, y: F.cross_entropy(lg[:, 1:].reshape(-1, V), y[:, :-1].reshape(-1),
                                                reduction="none"),
    "unbind_item": lambda lg, y: F.cross_entropy(lg.unbind(0)[1], y[1], label_smoothing=0.2),
    "mask": lambda lg, y: F.cross_entropy(lg[y != -100], y[y != -100], reduction="none"),
}


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_selection_with_dynamic_shapes(name):
    # (an unbind's item count is specialised: unbind(0) of batches 3, 5, 2 compiles three times)
    loss = DYNAMIC[name]
    model = Fn(lambda m, h, y: (loss(m.head(h), y), m.head(h) * 1))
    argsets = [_seq(3, 11), _seq(5, 7), _seq(2, 13)]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check_dynamic(model, None, "cross_entropy", rewrites=3 if name == "unbind_item" else 1, dynamic=True,
                       argsets=argsets, atol=1e-5, rtol=1e-5)


# ========================================================================================================
# fp16 / bf16 logits with a selection: the op computes in fp32 (the pass's upcast rule)
# ========================================================================================================


class Half(nn.Module):
    def __init__(self, dtype, loss):
        super().__init__()
        self.head = nn.Linear(N, V).to(dtype)
        self.loss = loss

    def forward(self, h, y):
        lg = self.head(h)
        return self.loss(lg, y), lg


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("upcast", [False, True])
def test_low_precision_logits_with_a_selection(dtype, upcast):
    def loss(lg, y):
        lg = lg.float() if upcast else lg
        return F.cross_entropy(lg.narrow(1, 1, T - 2).reshape(-1, V), y[:, 1:-1].reshape(-1),
                               reduction="none")

    h, y = _seq()
    # the half gradients are rounded at other points than eager's (the op is as close as eager to an fp64
    # reference: fp16 weight gradient 1.6e-3 off it, eager 1.6e-3; bf16 1.2e-2, eager 1.3e-2 / 1.5e-2)
    tol = 4e-3 if dtype is torch.float16 else 1.6e-2
    _check(Half(dtype, loss), (h.to(dtype), y), "cross_entropy", rewrites=1, atol=tol, rtol=tol)


# ========================================================================================================
# heads: addmm and einsum spellings
# ========================================================================================================


class Head(nn.Module):
    def __init__(self, head, bias_shape=(V,)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(V, N) / N**0.5)
        self.b = nn.Parameter(0.1 * torch.randn(bias_shape))
        self.head = head

    def forward(self, h, y):
        lg = self.head(self, h)
        return F.cross_entropy(lg.reshape(-1, V), y.reshape(-1)[: lg.numel() // V]), lg


def _flat():
    return torch.randn(B * T, N), _labels(B * T)


HEADS = {
    "addmm_bias_1v": (lambda m, h: torch.addmm(m.b, h, m.w.t()), (1, V)),
    "addmm_float_beta_alpha": (lambda m, h: torch.addmm(m.b, h, m.w.t(), beta=1.0, alpha=1.0), (V,)),
    "addmm_permuted": (lambda m, h: torch.addmm(m.b, h, m.w.permute(1, 0)), (V,)),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_head_is_rewritten(name):
    head, shape = HEADS[name]
    _check(Head(head, shape), _flat(), "cross_entropy", rewrites=1)


NOT_HEADS = {
    "addmm_bias_mv": (lambda m, h: torch.addmm(m.b, h, m.w.t()), (B * T, V)),
    "addmm_beta_float": (lambda m, h: torch.addmm(m.b, h, m.w.t(), beta=0.9999), (V,)),
    "addmm_alpha_negative": (lambda m, h: torch.addmm(m.b, h, m.w.t(), alpha=-1), (V,)),
    "addmm_bias_column": (lambda m, h: torch.addmm(m.b, h, m.w.t()), (B * T, 1)),
}


@pytest.mark.parametrize("name", list(NOT_HEADS))
def test_head_is_left_alone(name):
    head, shape = NOT_HEADS[name]
    _check(Head(head, shape), _flat(), "cross_entropy", rewrites=0, skipped=1)


class Einsum(nn.Module):
    def __init__(self, equation, x_shape_fn=None, w_shape=(V, N), last=True):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*w_shape) / N**0.5)
        self.equation = equation

    def forward(self, h, y):
        lg = torch.einsum(self.equation, h, self.w)
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1)[: lg.numel() // lg.shape[-1]]), lg


def test_einsum_repeated_letter_is_left_alone():
    # "bii,vi->bv": the diagonal of each (N, N) block: not a Linear of any rows
    model = Einsum("bii,vi->bv")
    _check(model, (torch.randn(B, N, N), _labels(B)), "cross_entropy", rewrites=0, skipped=1)


def test_einsum_classes_not_last_is_left_alone():
    # "bsd,vd->bvs": classes in the middle; the loss over (B*V, S) rows is another function
    model = Einsum("bsd,vd->bvs", w_shape=(T, N))
    _check(model, (torch.randn(B, V, N), _labels(B * T)), "cross_entropy", rewrites=0, skipped=1)


def test_einsum_ellipsis_on_the_weight_is_left_alone():
    model = Einsum("btd,...d->bt...")
    _check(model, (torch.randn(B, T, N), _labels(B, T)), "cross_entropy", rewrites=0, skipped=1)


def test_einsum_with_a_selection_and_a_mask():
    model = Fn(lambda m, h, y: (F.cross_entropy(torch.einsum("btd,vd->btv", h, m.head.weight)[:, :-1][
        y[:, 1:] != -100], y[:, 1:][y[:, 1:] != -100], label_smoothing=0.1), m.head.weight.sum()))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(model, _seq(), "cross_entropy", rewrites=1)


@pytest.mark.parametrize("x_k, w_k", [(1, N), (N, 1)])
def test_einsum_broadcasting_the_contracted_dim_is_left_alone(x_k, w_k):
    # einsum broadcasts a contracted dim of size 1 (sum_d x[n, 0] * w[v, d]): not F.linear(x, w)
    model = Einsum("nd,vd->nv", w_shape=(V, w_k))
    _check(model, (torch.randn(B * T, x_k), _labels(B * T)), "cross_entropy", rewrites=0, handled=1)


def test_selected_logits_also_returned():
    def fn(m, h, y):
        lg = m.head(h)
        sel = lg[:, 1:]
        keep = y[:, :-1] != -100
        return F.cross_entropy(sel[keep], y[:, :-1][keep]), sel, sel[keep]

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(Fn(fn), _seq(), "cross_entropy", rewrites=1)


def test_one_mask_selects_the_logits_and_the_hidden_states():
    def fn(m, h, y):
        keep = h[..., 1] < 0.5
        lg = m.head(h)
        return F.cross_entropy(lg[keep], y[keep], reduction="none"), h[keep], lg

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check(Fn(fn), _seq(), "cross_entropy", rewrites=1)


def test_einsum_of_a_transposed_parameter_as_the_weight():
    # "btd,vd->btv" of W.t(), W (N, V): the (V, N) operand is the weight, a view
    def fn(m, h, y):
        lg = torch.einsum("btd,vd->btv", h, m.w_kv.t())
        return F.cross_entropy(lg[:, 1:].reshape(-1, V), y[:, :-1].reshape(-1)), m.w_kv * 1

    model = Fn(fn)
    model.w_kv = nn.Parameter(torch.randn(N, V) / N**0.5)
    _check(model, _seq(), "cross_entropy", rewrites=1)


DYNAMIC_HEADS = {
    "addmm_narrow": lambda m, h, y: F.cross_entropy(
        torch.addmm(m.head.bias, h.reshape(-1, N), m.head.weight.t()).narrow(0, 1, y.numel() - 2),
        y.reshape(-1)[2:], reduction="none"),
    "einsum_mask": lambda m, h, y: F.cross_entropy(
        torch.einsum("...d,vd->...v", h, m.head.weight)[y != -100], y[y != -100], label_smoothing=0.2),
    "nll_mask_of_hidden": lambda m, h, y: F.nll_loss(
        F.log_softmax(m.head(h), -1)[h[..., 2] > 0], y[h[..., 2] > 0], reduction="sum"),
}


@pytest.mark.parametrize("name", list(DYNAMIC_HEADS))
def test_written_out_heads_with_selections_and_dynamic_shapes(name):
    fn = DYNAMIC_HEADS[name]
    model = Fn(lambda m, h, y: (fn(m, h, y), m.head.weight * 1))
    argsets = [_seq(3, 11), _seq(5, 7), _seq(2, 13)]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _check_dynamic(model, None, "cross_entropy", rewrites=1, dynamic=True, argsets=argsets, atol=1e-5,
                       rtol=1e-5)


def test_addmm_with_out_is_left_alone():
    # out= (eval only: eager's autograd refuses it) is no F.linear spelling the pass reads
    def head(m, h):
        return torch.addmm(m.b, h, m.w.t(), out=torch.empty(h.shape[0], V))

    model, (h, y) = Head(head), _flat()
    counters.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        expected, got = model(h, y), _compile(model)(h, y)
    assert counters["flash"]["cross_entropy"] == 0 and counters["flash"]["cross_entropy_skipped"] == 1
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
