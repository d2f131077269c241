"""Review of the cross-entropy pass (fx_passes/cross_entropy.py): regressions for what the review found.

Wrong rewrites, now left alone with their reason:

- the logits written in place through a view the loss reads, ``flat = logits.view(-1, V); flat.mul_(2)``
  before ``F.cross_entropy(flat, ...)`` (or through the fp32 copy of an upcast, or a row selection): the
  in-place check did not walk into the pattern's own views, and the op, computing the logits itself, gave
  the loss of the logits unwritten: a silently different loss;
- the logits written in place after the loss (``logits.div_(T)`` for a caller, in training): the op keeps
  the logits it returns for its backward, eager's loss its log-probabilities, so the compiled backward
  failed (a version-counter error; backend="flash" failed to compile) where eager's runs;
- a target computed from the logits (pseudo-labels, ``F.cross_entropy(logits, logits.argmax(-1))``): the op
  needs its target before it computes the logits, and the rewrite made a cycle that failed the compile.

Forms that are the same function and were missed, now rewritten:

- the head written as a matmul with the transposed weight, ``h @ self.wte.weight.T`` (tied embeddings;
  ``torch.matmul``, ``Tensor.matmul``, ``torch.mm``, ``.t()``, ``.mT``, ``.transpose(0, 1)``,
  ``.permute(1, 0)``): a bias-free F.linear is that matmul in ATen; a right operand that is not a transpose
  (``h @ m``) is left alone;
- a selection of rows of the log-probabilities, ``F.nll_loss(F.log_softmax(logits, -1)[:, :-1]...)``: the
  log_softmax is row-wise, so that is the selection of the logits' rows, which the pass already rewrites.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_cross_entropy_pass import Head, K, V, _check, _labels, _not_rewritten, _run
from torch._dynamo.utils import counters

from fx_passes import collecting

# --------------------------------------------------------------------------------------------------------
# the logits written in place
# --------------------------------------------------------------------------------------------------------


def view_scaled_before(lg, y):
    flat = lg.view(-1, V)
    flat.mul_(2.0)  # the loss reads the doubled logits
    return F.cross_entropy(flat, y.view(-1))


def shifted_scaled_before(lg, y):
    shift = lg[:, :-1]
    shift.div_(3.0)
    return F.cross_entropy(shift.reshape(-1, V), y[:, 1:].reshape(-1))


def upcast_scaled_before(lg, y):
    z = lg.float()
    z.mul_(0.5)
    return F.nll_loss(F.log_softmax(z.view(-1, V), -1), y.view(-1))


@pytest.mark.parametrize("loss_fn", [view_scaled_before, shifted_scaled_before, upcast_scaled_before])
def test_logits_written_through_a_view_the_loss_reads_are_left_alone(loss_fn):
    torch.manual_seed(0)
    # eager's loss is that of the written logits; the fused op's was that of the logits unwritten
    args = (torch.randn(3, 7, K), _labels((3, 7)))
    report = _check(Head(loss_fn), args, rewrites=0, skipped=1, train=False)
    assert "written in place" in str(report), str(report)


def scaled_after(lg, y):
    loss = F.cross_entropy(lg.view(-1, V), y.view(-1))
    lg.div_(2.0)  # the logits the caller gets, written after the loss read them
    return loss


def view_zeroed_after(lg, y):
    flat = lg.view(-1, V)
    loss = F.cross_entropy(flat, y.view(-1))
    flat[0] = 0.0
    return loss


@pytest.mark.parametrize("loss_fn", [scaled_after, view_zeroed_after])
def test_logits_written_in_place_after_the_loss_are_left_alone(loss_fn):
    # eager's backward reads the log-probabilities its loss kept, not the logits; the op's reads the logits
    torch.manual_seed(0)
    report = _check(Head(loss_fn), (torch.randn(3, 7, K), _labels((3, 7))), rewrites=0, skipped=1)
    assert "written in place" in str(report), str(report)


def test_logits_written_in_place_after_the_loss_through_inductor():
    torch.manual_seed(0)
    model, args = Head(scaled_after), (torch.randn(2, 5, K), _labels((2, 5)))
    expected = _run(model, args, True)
    counters.clear()
    with collecting() as report:
        got = _run(torch.compile(model, backend="flash"), args, True)
    assert counters["flash"]["cross_entropy"] == 0 and "written in place" in str(report), str(report)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------
# a target computed from the logits
# --------------------------------------------------------------------------------------------------------


def pseudo_labels(lg, y):
    return F.cross_entropy(lg.view(-1, V), lg.detach().argmax(-1).view(-1))


def pseudo_labels_where_unlabelled(lg, y):
    target = torch.where(y == -100, lg.detach().argmax(-1), y)
    return F.nll_loss(F.log_softmax(lg, -1).view(-1, V), target.view(-1), reduction="sum")


@pytest.mark.parametrize("loss_fn", [pseudo_labels, pseudo_labels_where_unlabelled])
def test_target_computed_from_the_logits_is_left_alone(loss_fn):
    _not_rewritten(loss_fn, "computed from the logits")


# --------------------------------------------------------------------------------------------------------
# the head as a matmul with the transposed (tied) weight
# --------------------------------------------------------------------------------------------------------


class TiedHead(nn.Module):
    """A decoder's head on its token embedding, written as a matmul: ``logits = head(h, self.wte.weight)``."""

    def __init__(self, head, loss_fn, bias=False):
        super().__init__()
        self.wte = nn.Embedding(V, K)
        self.head, self.loss_fn = head, loss_fn
        self.bias = nn.Parameter(torch.randn(V)) if bias else None

    def forward(self, ids, labels):
        h = self.wte(ids) * 2.0
        logits = self.head(h, self.wte.weight)
        if self.bias is not None:
            logits = logits + self.bias
        return self.loss_fn(logits, labels), logits


def gpt2_shift(logits, labels):
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return nn.CrossEntropyLoss()(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def flat_float(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=3, reduction="sum")


MATMUL_HEADS = {
    "h @ w.T": lambda h, w: h @ w.T,
    "torch.matmul(h, w.t())": lambda h, w: torch.matmul(h, w.t()),
    "h.matmul(w.transpose(0, 1))": lambda h, w: h.matmul(w.transpose(0, 1)),
    "h @ w.transpose(-1, -2)": lambda h, w: h @ w.transpose(-1, -2),
    "h @ w.mT": lambda h, w: h @ w.mT,
    "h @ w.permute(1, 0)": lambda h, w: h @ w.permute(1, 0),
    "torch.mm(h[0], w.t())": lambda h, w: torch.mm(h[0], w.t()),
}


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("loss_fn", [gpt2_shift, flat_float])
@pytest.mark.parametrize("name", list(MATMUL_HEADS))
def test_matmul_head_with_the_transposed_weight_is_rewritten(name, loss_fn, train):
    torch.manual_seed(0)
    labels = _labels((3, 7), ignore=3 if loss_fn is flat_float else -100)
    if name.startswith("torch.mm"):
        labels = labels[0]
    report = _check(TiedHead(MATMUL_HEADS[name], loss_fn), (torch.randint(0, V, (3, 7)), labels), train=train)
    assert "x @ w.t() -> " in str(report), str(report)


def test_matmul_head_plus_a_class_bias_is_rewritten():
    torch.manual_seed(0)
    report = _check(TiedHead(MATMUL_HEADS["h @ w.T"], gpt2_shift, bias=True),
                    (torch.randint(0, V, (3, 7)), _labels((3, 7))))
    assert "x @ w.t() -> add -> getitem" in str(report), str(report)


def test_matmul_head_through_inductor():
    torch.manual_seed(0)
    model = TiedHead(MATMUL_HEADS["h @ w.T"], gpt2_shift)
    args = (torch.randint(0, V, (2, 5)), _labels((2, 5)))
    expected = _run(model, args, True)
    counters.clear()
    got = _run(torch.compile(model, backend="flash"), args, True)
    assert counters["flash"]["cross_entropy"] == 1
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", [
    lambda h, w: h @ w.t().flip(0),  # the rows of the transpose reversed: another contraction
    lambda h, w: torch.matmul(h, w.t().unsqueeze(0)),  # a batched right operand
], ids=["flipped", "batched"])
def test_matmul_heads_that_are_not_the_transpose_are_left_alone(head):
    torch.manual_seed(0)
    report = _check(TiedHead(head, gpt2_shift), (torch.randint(0, V, (3, 7)), _labels((3, 7))), rewrites=0,
                    skipped=1)
    assert "not from an F.linear" in str(report) or "which is not a reshape" in str(report), str(report)


# --------------------------------------------------------------------------------------------------------
# rows of the log-probabilities
# --------------------------------------------------------------------------------------------------------


def log_probs_shifted(lg, y):
    log_probs = F.log_softmax(lg, dim=-1)
    return F.nll_loss(log_probs[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))


def log_probs_fp32_shifted_per_token(lg, y):
    log_probs = F.log_softmax(lg.float(), dim=-1)
    return F.nll_loss(log_probs[..., 1:, :].contiguous().view(-1, V), y[..., :-1].contiguous().view(-1),
                      reduction="none", ignore_index=3)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("loss_fn", [log_probs_shifted, log_probs_fp32_shifted_per_token])
def test_row_selection_of_log_probs_is_rewritten(loss_fn, train):
    torch.manual_seed(0)
    labels = _labels((3, 7), ignore=3 if loss_fn is log_probs_fp32_shifted_per_token else -100)
    report = _check(Head(loss_fn), (torch.randn(3, 7, K), labels), train=train)
    assert "log_softmax -> getitem" in str(report), str(report)


@pytest.mark.parametrize("loss_fn, reason", [
    # the classes sliced: a loss over fewer classes than the log_softmax normalised
    (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1)[..., 1:].reshape(-1, V - 1), y.reshape(-1) % (V - 1)),
     "selection of rows"),
    # rows selected after a reshape that regrouped them
    (lambda lg, y: F.nll_loss(F.log_softmax(lg, -1).view(-1, V)[1:], y.view(-1)[1:]), "regrouped"),
], ids=["classes_sliced", "after_regroup"])
def test_selection_of_log_probs_not_of_rows_is_left_alone(loss_fn, reason):
    _not_rewritten(loss_fn, reason)
