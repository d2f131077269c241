"""Cross-entropy pass, session 33 (findings C1): the loss over logits whose rows were permuted.

Sequence-first models compute the head's logits (S, B, V) and move them batch-first before the loss:
ChatGLM2/3's ``lm_logits.transpose(0, 1).contiguous()`` then ``.to(torch.float32)``, the shift and
``view(-1, V)``; Megatron's ``output.transpose(0, 1)``; fairseq-style T x B x C decoders; nn.Transformer with
batch_first=False. A permutation of the dimensions before the class one maps the Linear's rows one-to-one
onto the rows the loss reads, so the pass replays it (with the row selections, in their order) on a grid of
row numbers, pairs every Linear row with its own target and reads the op's per-row loss back in eager's
order; the op returns the logits in the Linear's layout and the model's permute reads them.

Every case compiles through the passes (dynamo + fx_passes, the graph run as plain PyTorch, the op on its CPU
reference) in training (the outputs and the gradients of every input and parameter) and in eval, and asserts
the rewrite / near-miss counts and eager's values.

Rewritten: ChatGLM's exact form (fp32 and bf16, also returning lm_logits), Megatron's transpose + view with
the labels transposed too, ``permute(1, 0, 2)``, ``movedim``, ``swapaxes``, a 4-D permutation, each
reduction, label_smoothing, ignore_index with ignored targets, a shift before and after the transpose, a
mask, a select and an unbind item after it, the row permutation followed by the (N, C, d) class move, the
nll_loss of a log_softmax permuted, dynamic=True over 3 lengths. Left alone, reported: a permutation that
moves the class dimension, a row selection or permutation after a reshape that regrouped the rows, the
permuted view of the logits written in place after the loss.

Also rewritten (appended below): the one-step (N, C, d) permutation ``permute(1, 2, 0)`` of sequence-first
logits and its equivalents (``permute(1, -1, 0)``, ``movedim``, 4-D), decomposed into a row permutation (the
classes kept last) followed by the class move ``movedim(-1, 1)`` (_row_permutation with class_move).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_norm_dense_ce_review_s25 import _check

S, B, D, V = 7, 3, 8, 11  # sequence-first (S, B, D) hidden states, 11 classes
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _labels(*shape, ignore=-100):
    y = torch.randint(0, V, shape)
    y.view(-1)[::4] = ignore
    return y


class Head(nn.Module):
    """loss(lm_logits, labels) over a Linear head's logits of sequence-first hidden states; returns what loss
    returns (a loss, or a loss and logits)."""

    def __init__(self, loss, bias=False, dtype=torch.float32):
        super().__init__()
        self.output_layer = nn.Linear(D, V, bias=bias, dtype=dtype)
        self.loss = loss

    def forward(self, h, y):
        return self.loss(self.output_layer(h), y)


def _glm(lm_logits, labels, returns=True, reduction="mean", label_smoothing=None):
    """ChatGLMForConditionalGeneration.forward's head and loss, as modeling_chatglm.py writes them. (No float
    default: dynamic=True would make it an input, specialised by a restart that runs the pass twice.)"""
    lm_logits = lm_logits.transpose(0, 1).contiguous()
    returned = lm_logits
    lm_logits = lm_logits.to(torch.float32)
    shift_logits = lm_logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    kw = {} if label_smoothing is None else dict(label_smoothing=label_smoothing)
    loss_fct = nn.CrossEntropyLoss(ignore_index=-100, reduction=reduction, **kw)
    loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
    return (loss, returned) if returns else loss


def _sf(dtype=torch.float32, s=S, b=B):
    """Sequence-first hidden states and batch-first labels."""
    return torch.randn(s, b, D, dtype=dtype), _labels(b, s)


def _rewritten(loss, inputs, text=None, tol=FP32, **kwargs):
    _check(Head(loss, **kwargs.pop("head", {})), inputs, "cross_entropy", 1, text=text, **tol, **kwargs)


def _left_alone(loss, inputs, reason, **kwargs):
    _check(Head(loss), inputs, "cross_entropy", 0, skipped=1, reason=reason, **FP32, **kwargs)


# ========================================================================================================
# ChatGLM2 / ChatGLM3
# ========================================================================================================


@pytest.mark.parametrize("returns", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chatglm(dtype, returns):
    _rewritten(lambda lg, y: _glm(lg, y, returns), _sf(dtype), head=dict(dtype=dtype),
               text="F.linear -> transpose -> contiguous -> to -> getitem -> contiguous -> view -> "
                    "F.cross_entropy", tol=BF16 if dtype is torch.bfloat16 else FP32)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_chatglm_reductions_and_smoothing(reduction):
    _rewritten(lambda lg, y: _glm(lg, y, reduction=reduction, label_smoothing=0.1), _sf(),
               head=dict(bias=True))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chatglm_dynamic_over_three_lengths(reduction):
    argsets = [_sf(s=7), _sf(s=5, b=2), _sf(s=12, b=4)]
    _check(Head(lambda lg, y: _glm(lg, y, reduction=reduction)), None, "cross_entropy", 1, dynamic=True,
           argsets=argsets, **FP32)


# ========================================================================================================
# other sequence-first heads: every spelling of the row permutation, each reduction
# ========================================================================================================


def _megatron(lg, y, **kw):
    """Megatron: the (S, B, V) output transposed before the loss; here the labels come (S, B) as well."""
    logits = lg.transpose(0, 1).contiguous().view(-1, V)
    return F.cross_entropy(logits, y.transpose(0, 1).contiguous().view(-1), **kw), lg


PERMUTED = {
    # name: (loss(lg, y), inputs)
    "megatron_mean": (_megatron, lambda: (torch.randn(S, B, D), _labels(S, B))),
    "megatron_sum_smoothing": (lambda lg, y: _megatron(lg, y, reduction="sum", label_smoothing=0.2),
                               lambda: (torch.randn(S, B, D), _labels(S, B))),
    "megatron_none_ignore_index": (lambda lg, y: _megatron(lg, y % 5, reduction="none", ignore_index=3),
                                   lambda: (torch.randn(S, B, D), _labels(S, B))),
    "permute_102_none": (lambda lg, y: F.cross_entropy(lg.permute(1, 0, 2).reshape(-1, V), y.reshape(-1),
                                                       reduction="none", label_smoothing=0.3), _sf),
    "torch_permute_dims_kw_sum": (lambda lg, y: F.cross_entropy(
        torch.permute(lg, dims=(1, 0, 2)).flatten(0, 1), y.flatten(), reduction="sum"), _sf),
    "movedim_mean": (lambda lg, y: F.cross_entropy(lg.movedim(0, 1).reshape(-1, V), y.reshape(-1)), _sf),
    "swapaxes_float_none": (lambda lg, y: F.cross_entropy(lg.swapaxes(0, 1).float().reshape(-1, V),
                                                          y.reshape(-1), reduction="none"), _sf),
    # 4-d (T, B, H, V) logits to (B, H, T, V)
    "permute_4d_none": (lambda lg, y: (F.cross_entropy(lg.permute(1, 2, 0, 3).reshape(-1, V), y.reshape(-1),
                                                       reduction="none"), lg),
                        lambda: (torch.randn(5, 2, 3, D), _labels(2, 3, 5))),
    # the shift before the transpose (sequence-first) and after it (batch-first)
    "shift_before_transpose_none": (lambda lg, y: F.cross_entropy(
        lg[:-1].transpose(0, 1).reshape(-1, V), y[:, 1:].reshape(-1), reduction="none"), _sf),
    "shift_before_and_after_sum": (lambda lg, y: F.cross_entropy(
        lg[1:].transpose(0, 1)[:, :-1].reshape(-1, V), y[:, 1:-1].reshape(-1), reduction="sum"), _sf),
    "select_after_transpose_none": (lambda lg, y: F.cross_entropy(lg.transpose(0, 1).select(1, 2), y[:, 2],
                                                                  reduction="none"), _sf),
    "unbind_item_after_transpose_none": (lambda lg, y: F.cross_entropy(
        lg.transpose(0, 1).unbind(1)[2], y[:, 2], reduction="none"), _sf),
    # two permutations that undo each other, a narrow between them
    "transpose_narrow_transpose": (lambda lg, y: F.cross_entropy(
        lg.transpose(0, 1).narrow(0, 1, 2).transpose(0, 1).reshape(-1, V), y[1:3].t().reshape(-1),
        reduction="none"), _sf),
    # the row permutation, then the classes moved to dim 1: (S, B, V) -> (B, S, V) -> (B, V, S)
    "then_classes_moved_none": (lambda lg, y: F.cross_entropy(lg.transpose(0, 1).transpose(1, 2), y,
                                                              reduction="none"), _sf),
    # the nll_loss form: permuted log-probabilities, and the log_softmax of the permuted logits
    "nll_of_permuted_log_probs": (lambda lg, y: F.nll_loss(
        F.log_softmax(lg, -1).transpose(0, 1).reshape(-1, V), y.reshape(-1), reduction="none"), _sf),
    "nll_of_log_softmax_of_permuted": (lambda lg, y: F.nll_loss(
        F.log_softmax(lg.transpose(0, 1).float(), -1)[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)), _sf),
}


@pytest.mark.parametrize("name", list(PERMUTED))
def test_row_permutation_is_rewritten(name):
    loss, inputs = PERMUTED[name]
    _rewritten(loss, inputs(), head=dict(bias=True))


def test_mask_after_the_transpose():
    loss = lambda lg, y: F.cross_entropy(lg.transpose(0, 1)[y != -100], y[y != -100], reduction="none")  # noqa: E731
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _rewritten(loss, _sf())


# ========================================================================================================
# left alone, with the reason
# ========================================================================================================


def _written_after(lg, y):
    loss = F.cross_entropy(lg.transpose(0, 1).reshape(-1, V), y.reshape(-1))
    lg.transpose(0, 1).mul_(2)
    return loss, lg * 1


LEFT_ALONE = {
    # name: (loss(lg, y), inputs, reason)
    # the class dimension moved: (S, B, V).mT is (S, V, B), read as rows of B classes
    "mT_moves_classes": (lambda lg, y: F.cross_entropy(lg.mT.reshape(-1, B), y.reshape(-1)),
                         lambda: (torch.randn(S, B, D), torch.randint(0, B, (S, V))),
                         "moves the class dimension from the last"),
    "2d_t_moves_classes": (lambda lg, y: F.cross_entropy(lg.reshape(-1, V).t(), y),
                           lambda: (torch.randn(S, B, D), torch.randint(0, S * B, (V,))), "pass through t"),
    # rows regrouped, then selected or permuted: the index means rows of another shape
    "selection_after_regroup": (lambda lg, y: F.cross_entropy(
        lg.transpose(0, 1).reshape(-1, V)[1:], y.reshape(-1)[1:]), _sf, "regrouped their rows"),
    "permute_after_regroup": (lambda lg, y: F.cross_entropy(
        lg.reshape(B, S, V).transpose(0, 1).reshape(-1, V), y.reshape(-1)), _sf, "permuted by transpose"),
    # the permuted view of the logits written after the loss: the op keeps the logits for its backward
    "written_through_the_transpose": (_written_after, _sf, "written in place"),
    # (the one-step (N, C, d) permutation permute(1, 2, 0) of sequence-first logits is fused: below)
    # a 3-D nll input whose dim 1 is the batch: the rows permuted, the classes not at dim 1
    "nll_3d_rows_permuted": (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).transpose(0, 1), y),
                             lambda: (torch.randn(S, B, D), torch.randint(0, S, (B, V))), "by (1, 0, 2)"),
}


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_left_alone(name):
    loss, inputs, reason = LEFT_ALONE[name]
    _left_alone(loss, inputs(), reason)


# ========================================================================================================
# the one-step (N, C, d1, ..) permutation of sequence-first logits: a row permutation, then the class move
# ========================================================================================================
# ``lg.permute(1, 2, 0)`` of (S, B, V) logits is ``lg.permute(1, 0, 2)`` (the rows reordered, the classes
# kept last) then ``movedim(-1, 1)``: the pass replays the row permutation (1, 0) on the rows' numbers and
# takes the classes-at-dim-1 path. Eager's reduction='none' loss is (B, S), the target's layout.


def _moved_and_returned(lg, y):
    moved = lg.permute(1, 2, 0)
    return F.cross_entropy(moved, y, reduction="none"), moved


ONE_STEP = {
    # name: (loss(lg, y), inputs, the text of the rewrite)
    "permute_120_mean": (lambda lg, y: F.cross_entropy(lg.permute(1, 2, 0), y), _sf,
                         "F.linear -> permute -> F.cross_entropy"),
    "permute_120_sum": (lambda lg, y: F.cross_entropy(lg.permute(1, 2, 0), y, reduction="sum"), _sf, None),
    "permute_120_none": (lambda lg, y: F.cross_entropy(lg.permute(1, 2, 0), y, reduction="none"), _sf, None),
    "permute_1m10_none_smoothing": (lambda lg, y: F.cross_entropy(lg.permute(1, -1, 0), y, reduction="none",
                                                                  label_smoothing=0.2), _sf, None),
    "torch_permute_dims_kw_ignore_index": (lambda lg, y: F.cross_entropy(
        torch.permute(lg, dims=(1, 2, 0)), y % 5, ignore_index=3, reduction="none"), _sf, None),
    "movedim_0_m1_sum_smoothing": (lambda lg, y: F.cross_entropy(
        lg.movedim(0, -1), y, reduction="sum", label_smoothing=0.1), _sf, "movedim"),
    "movedim_two_dims": (lambda lg, y: F.cross_entropy(lg.movedim((0, 1), (2, 0)), y, reduction="none"),
                         _sf, "movedim"),
    "moveaxis_contiguous_float": (lambda lg, y: F.cross_entropy(
        torch.moveaxis(lg, 0, 2).contiguous().float(), y), _sf, "moveaxis -> contiguous -> float"),
    "permute_120_also_returned": (_moved_and_returned, _sf, None),
    # the causal-LM shift before the permutation (sequence-first), ignored targets at both ends
    "shift_then_permute_120_none": (lambda lg, y: F.cross_entropy(
        lg[:-1].permute(1, 2, 0), y[:, 1:], reduction="none"), _sf, "getitem -> permute"),
    # 4-D: (T, B, H, V) -> (B, V, T, H) and -> (H, V, B, T)
    "permute_4d_1302_none": (lambda lg, y: F.cross_entropy(lg.permute(1, 3, 0, 2), y, reduction="none"),
                             lambda: (torch.randn(5, 2, 3, D), _labels(2, 5, 3)), None),
    "permute_4d_2310_mean": (lambda lg, y: F.cross_entropy(lg.permute(2, 3, 1, 0), y),
                             lambda: (torch.randn(5, 2, 3, D), _labels(3, 2, 5)), None),
    # (N, H, W, V) -> (N, V, W, H): the spatial dims swapped as the classes move, the rows permuted by
    # (0, 2, 1) (square, so the target (N, W, H) is also (N, H, W)-shaped: each row still gets its own)
    "transpose_13_square_4d_none": (lambda lg, y: F.cross_entropy(lg.transpose(1, 3), y, reduction="none"),
                                    lambda: (torch.randn(2, 5, 5, D), _labels(2, 5, 5)), "transpose"),
    # the nll_loss forms: log-probabilities permuted in one step, the log_softmax over dim 1 of the permuted
    "nll_of_log_probs_permuted_120": (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).permute(1, 2, 0), y,
                                                               reduction="none"), _sf, "F.nll_loss"),
    "nll_of_log_softmax_dim_1_of_permuted_120": (lambda lg, y: F.nll_loss(
        F.log_softmax(lg.permute(1, 2, 0), dim=1), y, reduction="sum"), _sf, "F.nll_loss"),
}


@pytest.mark.parametrize("name", list(ONE_STEP))
def test_one_step_permutation_to_classes_at_dim_1_is_rewritten(name):
    loss, inputs, text = ONE_STEP[name]
    _rewritten(loss, inputs(), text=text, head=dict(bias=True))


@pytest.mark.parametrize("upcast", [True, False], ids=["upcast", "bf16_loss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_one_step_permutation_bf16(reduction, upcast):
    # bf16 logits cast up (transformers' upcast) or not: the op computes the loss in fp32 either way
    def loss(lg, y):
        moved = lg.permute(1, 2, 0)
        return F.cross_entropy(moved.float() if upcast else moved, y, reduction=reduction)

    _rewritten(loss, _sf(torch.bfloat16), tol=BF16, head=dict(bias=True, dtype=torch.bfloat16))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_one_step_permutation_dynamic_over_three_lengths(reduction):
    argsets = [_sf(s=7), _sf(s=5, b=2), _sf(s=12, b=4)]
    loss = lambda lg, y: F.cross_entropy(lg.permute(1, 2, 0), y, reduction=reduction)  # noqa: E731
    _check(Head(loss, bias=True), None, "cross_entropy", 1, dynamic=True, argsets=argsets, **FP32)


ONE_STEP_LEFT_ALONE = {
    # name: (loss(lg, y), inputs, reason)
    # the class dimension not at dim 1: (S, B, V) -> (V, B, S) reads the classes at dim 0
    "permute_210_classes_at_0": (lambda lg, y: F.cross_entropy(lg.permute(2, 1, 0), y),
                                 lambda: (torch.randn(S, B, D), torch.randint(0, B, (V, S))), "by (2, 1, 0)"),
    # 4-D: (T, B, H, V) -> (B, T, V, H), the classes at dim 2
    "permute_4d_classes_at_2": (lambda lg, y: F.cross_entropy(lg.permute(1, 0, 3, 2), y),
                                lambda: (torch.randn(5, 2, 3, D), torch.randint(0, 5, (2, V, 3))),
                                "by (1, 0, 3, 2)"),
    # the rows regrouped by a reshape, then permuted with the class move: the permutation means other rows
    "permute_120_after_regroup": (lambda lg, y: F.cross_entropy(lg.reshape(B, S, V).permute(1, 2, 0), y.t()),
                                  _sf, "permuted by permute (permute) after reshape"),
    # a row selection after the one-step permutation (classes at dim 1: it selects along d1)
    "selection_after_permute_120": (lambda lg, y: F.cross_entropy(lg.permute(1, 2, 0)[..., :-1], y[:, 1:]),
                                    _sf, "comes from getitem"),
}


@pytest.mark.parametrize("name", list(ONE_STEP_LEFT_ALONE))
def test_one_step_permutation_look_alikes_are_left_alone(name):
    loss, inputs, reason = ONE_STEP_LEFT_ALONE[name]
    _left_alone(loss, inputs(), reason)
